"""The data-locality check: the dataset and the checkpoint store are where the run is.

A dataset in another region is read across regions every epoch; a checkpoint store in
another region, on a disk that dies with the instance, or on the other cloud makes every
save slow, lost or impossible. Both answers go into one "data" result.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from jobs.preflight.regions import region_requests, said_list
from jobs.preflight.report import CheckResult, PreflightContext, PreflightPlan, Status
from jobs.providers import PROVIDERS, cloud_of_scheme
from jobs.providers.base import BucketLocation, Provider, ProviderError
from jobs.spec import JobSpec

__all__ = ["BucketLookup", "DataLocalityCheck", "region_refusal"]

log = logging.getLogger(__name__)

_ORDER = (Status.PASS, Status.WARN, Status.FAIL)


@dataclass(frozen=True)
class _Finding:
    """One half of the check's answer (the dataset's, or the checkpoint store's)."""

    status: Status
    detail: str
    remedy: str = ""
    data: dict[str, Any] = field(default_factory=dict)


class DataLocalityCheck:
    """The dataset and the checkpoint store are in the accelerators' region.

    A local dataset path is checked for existence only when the provider's instances run
    on this machine: with a cloud provider the control plane never looks at its own disk
    for a path from a spec, which would tell a chat user what files it has. Relative
    paths are taken from the control plane's working directory, where local instances
    start.
    """

    name: str = "data"

    def run(self, ctx: PreflightContext, *, prior: PreflightPlan) -> CheckResult:
        lookup = BucketLookup(ctx.provider)
        regions = [req.region for req in region_requests(ctx)]
        answers = {
            region: (_dataset(ctx, region, lookup), _checkpoint_store(ctx, region, lookup))
            for region in regions
        }
        verdicts = {
            r: max((f.status for f in pair), key=_ORDER.index) for r, pair in answers.items()
        }
        best = min(verdicts.values(), key=_ORDER.index)
        chosen = [r for r in regions if verdicts[r] is best]
        dataset, store = answers[chosen[0]]
        data: dict[str, Any] = {**dataset.data, "checkpoint": store.data}
        if len(regions) == 1:
            return CheckResult(
                self.name,
                best,
                f"{dataset.detail}; {store.detail}",
                _remedy(dataset, store),
                data=data,
            )
        data["usable_regions"] = [r for r in regions if verdicts[r] is not Status.FAIL]
        data["regions"] = {r: v.value for r, v in verdicts.items()}
        parts = [f"{said_list(chosen)}: {dataset.detail}; {store.detail}"]
        for region in regions:
            if region not in chosen:
                found = [f.detail for f in answers[region] if f.status is not Status.PASS]
                parts.append(f"not {region}: {'; '.join(found)}")
        head = {
            Status.PASS: "the run can go to",
            Status.WARN: "with a warning, the run can go to",
            Status.FAIL: "no region of resources.regions suits the data:",
        }[best]
        remedies = [f"{r}: {_remedy(*answers[r])}" for r in chosen if _remedy(*answers[r])]
        return CheckResult(
            self.name,
            best,
            f"{head} {' — '.join(parts)}",
            "" if best is Status.PASS else "; ".join(remedies),
            data=data,
        )


def _remedy(dataset: _Finding, store: _Finding) -> str:
    return "; ".join(f.remedy for f in (dataset, store) if f.status is not Status.PASS)


class BucketLookup:
    """Each bucket's location, asked once however many regions are checked (an error too)."""

    def __init__(self, provider: Provider) -> None:
        self._provider = provider
        self._seen: dict[str, BucketLocation | ProviderError | None] = {}

    def location(self, uri: str) -> BucketLocation | None:
        if uri not in self._seen:
            try:
                self._seen[uri] = self._provider.bucket_location(uri)
            except ProviderError as exc:
                self._seen[uri] = exc
        found = self._seen[uri]
        if isinstance(found, ProviderError):
            raise found
        return found


def region_refusal(
    lookup: BucketLookup, spec: JobSpec, *, checkpoint_uri: str | None, region: str
) -> str | None:
    """Why an attempt may not move to ``region`` for where its data is: the dataset's or
    the checkpoint store's bucket is not there (a multi- or dual-region that covers it
    is). None when it may, or when ``resources.allow_cross_region_data`` allows it. A
    bucket whose location cannot be read is not a refusal: preflight has said so."""
    if spec.resources.allow_cross_region_data:
        return None
    for what, uri in (("the dataset", spec.data_uri), ("the checkpoint store", checkpoint_uri)):
        if not uri:
            continue
        try:
            where = lookup.location(uri)
        except ProviderError as exc:
            log.warning("cannot tell the region of %s: %s", uri, exc)
            continue
        if where is not None and not where.covers(region):
            return (
                f"{what} {uri} is in {where} (set resources.allow_cross_region_data=true "
                "to use it from there)"
            )
    return None


def _dataset(ctx: PreflightContext, region: str, buckets: BucketLookup) -> _Finding:
    """Where ``data_uri`` is: reading it from another region is slow and billed per GB."""
    uri = ctx.spec.data_uri
    if uri is None:
        return _Finding(Status.PASS, "no dataset declared (data_uri is unset)")
    data: dict[str, Any] = {"uri": uri, "region": region}
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        path = Path(unquote(parsed.path) if parsed.scheme == "file" else uri)
        if not ctx.provider.capabilities.runs_on_this_machine:
            data["path"] = str(path)
            return _Finding(
                Status.WARN,
                f"data_uri {uri} is a path on the instance; it cannot be checked from here",
                f"make sure the {ctx.provider.name} image has {path}, or stage the data "
                f"into a bucket in {region} and set data_uri to it",
                data,
            )
        path = path.expanduser()
        data["path"] = str(path)
        if not path.exists():
            return _Finding(
                Status.FAIL,
                f"the dataset path {path.resolve()} does not exist on this machine",
                f"create or copy the data to {path.resolve()}, or fix data_uri in the spec",
                data,
            )
        return _Finding(Status.PASS, f"dataset {path} is on this machine", data=data)
    location = buckets.location(uri)
    bucket_region = str(location) if location is not None else None
    data["bucket_region"] = bucket_region
    if location is None:
        return _Finding(
            Status.WARN,
            f"cannot tell which region holds {uri} (the {ctx.provider.name} provider "
            "cannot see that bucket)",
            f"check that {uri} is in {region}; if not, stage the data into a bucket in "
            f"{region} to avoid cross-region reads",
            data,
        )
    if location.covers(region):
        return _Finding(Status.PASS, f"dataset {uri} is in {_where(location, region)}", data=data)
    if ctx.spec.resources.allow_cross_region_data:
        return _Finding(
            Status.PASS,
            f"the dataset {uri} is in {bucket_region}, read from {region} across regions "
            "(resources.allow_cross_region_data: slower, and billed per GB)",
            data=data,
        )
    staging = ctx.staging.offer(uri, region) if ctx.staging is not None else None
    if staging is not None:
        data["stage"] = staging
    stage = (
        f"stage it: {staging}"
        if staging is not None
        else f"stage the data into a bucket in {region} and point data_uri at it"
    )
    return _Finding(
        Status.FAIL,
        f"the dataset {uri} is in {bucket_region} but the accelerators run in "
        f"{region}: every read would cross regions (slow, and billed per GB)",
        f"{stage}; or list {bucket_region} in resources.regions if the accelerators are "
        "available there, or set resources.allow_cross_region_data=true",
        data,
    )


def _where(location: BucketLocation, region: str) -> str:
    """``us-east-1``, or ``US, which covers us-east1`` for a multi- or dual-region."""
    return region if location.name == region else f"{location}, which covers {region}"


def _checkpoint_store(ctx: PreflightContext, region: str, buckets: BucketLookup) -> _Finding:
    """Where the checkpoints go: every save and every restore after a preemption reads or
    writes it, so it belongs in the run's region, on the run's cloud, off the instance."""
    uri = ctx.checkpoint_uri
    provider = ctx.provider
    data: dict[str, Any] = {"uri": uri, "region": region}
    scheme = urlparse(uri).scheme
    new_bucket = _new_bucket_remedy(ctx, region)
    if provider.capabilities.runs_on_this_machine:
        where = "on this machine" if scheme in ("", "file") else "reached from this machine"
        return _Finding(Status.PASS, f"checkpoint store {uri} is {where}", data=data)
    if scheme in ("", "file"):
        return _Finding(
            Status.WARN,
            f"the checkpoint store {uri} is a path on the {provider.name} instance: its "
            "checkpoints die with the instance, so every preemption restarts the run from "
            "step 0",
            new_bucket,
            data,
        )
    # The provider whose instances hold credentials for the scheme (the registry says).
    owner = cloud_of_scheme(scheme)
    if owner is not None and _has_store(provider.name) and owner != provider.name:
        data["cloud"] = owner
        return _Finding(
            Status.FAIL,
            f"the checkpoint store {uri} is on {owner} but the run's instances are on "
            f"{provider.name}: they have no credentials for it, so no checkpoint could be "
            "written",
            new_bucket,
            data,
        )
    try:
        location = buckets.location(uri)
    except ProviderError as exc:
        data["error"] = str(exc)
        return _Finding(
            Status.FAIL,
            f"cannot check the checkpoint store {uri}: {exc}",
            f"fix what the message says, or {new_bucket}; then run preflight again",
            data,
        )
    data["bucket_region"] = str(location) if location is not None else None
    if location is None:
        return _Finding(
            Status.WARN,
            f"cannot tell which region holds the checkpoint store {uri} (the "
            f"{provider.name} provider cannot see that bucket)",
            f"check that {uri} is in {region}; if not, {new_bucket}",
            data,
        )
    if location.covers(region):
        return _Finding(
            Status.PASS, f"checkpoint store {uri} is in {_where(location, region)}", data=data
        )
    crossing = (
        f"the checkpoint store {uri} is in {location} but the run is in {region}: "
        "every save and every restore would cross regions (slower, a longer stall, a "
        "flush less likely to fit the preemption window, and billed per GB)"
    )
    if ctx.spec.resources.allow_cross_region_data:
        # Allowed, and said: a person confirms the launch (a failover takes it as allowed).
        return _Finding(
            Status.WARN,
            f"{crossing}; resources.allow_cross_region_data allows it",
            new_bucket,
            data,
        )
    return _Finding(Status.FAIL, crossing, new_bucket, data)


def _has_store(name: str) -> bool:
    """The provider has an object store of its own (a test's provider may not be in the
    registry)."""
    found = PROVIDERS.get(name)
    return found is not None and bool(found.store_schemes)


def _new_bucket_remedy(ctx: PreflightContext, region: str) -> str:
    found = PROVIDERS.get(ctx.provider.name)
    command = found.new_bucket if found is not None else ""
    how = f" (`{command.format(region=region)}`)" if command else ""
    return (
        f"create a checkpoint bucket in {region}{how} and set checkpoint.uri in the spec "
        "(or TRAINBOT_CHECKPOINT_URI) to it"
    )

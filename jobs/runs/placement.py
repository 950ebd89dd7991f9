"""Where the next attempt goes: its region, zone and market.

Spot first, always (spot is the point). The same zone as before; after a preemption, or
a launch refused for lack of capacity, the next zone the provider ranks; once every zone
of a region has refused, the next region of ``resources.regions``, whose quota and data
locality (the dataset's bucket and the checkpoint store's) are checked before anything
launches there. Only when no allowed zone of any region has spot capacity does an
attempt run on-demand, and only where the spec allows it
(``resources.on_demand_fallback``); the attempt after it tries spot again.
``resubmit.on_demand_after_preemptions`` switches to on-demand for good after N.

"Refused" means refused since the run last had an instance: the trailing attempts that
failed for lack of capacity. A preemption or any launched attempt starts the count
again. When every allowed zone has refused, the run waits for capacity
(:mod:`jobs.runs.capacity`), and the refused launches of that pass are forgotten, so the
next pass tries every zone again.

:func:`decide` is the policy, given the questions it asks as functions;
:func:`choose_placement` answers them with the run's provider.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from sqlmodel import Session, col, select

from jobs.database.models import Attempt, Run
from jobs.domain.lifecycle import AttemptState
from jobs.preflight.data import BucketLookup, region_refusal
from jobs.preflight.interval import request_in, resource_request
from jobs.process.deps import Deps
from jobs.providers.base import Provider, ProviderError, ZoneCapacity
from jobs.spec import JobSpec

__all__ = [
    "NO_CAPACITY",
    "Capacity",
    "Fits",
    "NoPlacement",
    "Placement",
    "choose_placement",
    "decide",
    "run_provider",
]

log = logging.getLogger(__name__)

#: How a launch refused for lack of capacity is recorded: the next attempt moves zone.
NO_CAPACITY = "no capacity"

#: (region, spot) → the provider's zones for the request there, best first; raises
#: ProviderError when it cannot tell.
Capacity = Callable[[str, bool], Sequence[ZoneCapacity]]
#: (region, spot) → why the run cannot go there (quota, data locality), None when it can.
Fits = Callable[[str, bool], str | None]


@dataclass(frozen=True)
class Placement:
    """Where the next attempt goes."""

    #: Region it launches in.
    region: str
    #: Zone; None lets the provider choose (when it could not rank zones).
    zone: str | None
    #: Spot capacity rather than on-demand.
    spot: bool
    #: Why it is not on spot, or not in the first region, for the run's thread; "" when
    #: it is where the spec would put it anyway.
    note: str = ""
    #: The name of the provider it launches on (:func:`run_provider`); "" until
    #: :func:`choose_placement` sets it.
    provider: str = ""
    #: Regions passed over, each with why ("us-west-2: the dataset … is in us-east-1").
    skipped: tuple[str, ...] = ()


@dataclass(frozen=True)
class NoPlacement:
    """No allowed zone can take the attempt: the run fails with ``reason``, or waits
    for capacity (:mod:`jobs.runs.capacity`) when ``waitable``."""

    reason: str
    #: Launches were refused for lack of capacity, which may come back: waiting may help
    #: (not so a provider that is not configured, or regions the quota or the data rule
    #: out).
    waitable: bool = False


def run_provider(deps: Deps, spec: JobSpec, attempts: Sequence[Attempt]) -> Provider:
    """The provider a run's next attempt launches on: its previous attempt's (a run stays
    with the provider it was launched on), else the spec's ``resources.cloud``, else the
    default; :class:`~jobs.providers.ProviderNotConfigured` when that one is not
    configured here."""
    return deps.provider_for(spec, launched_on=attempts[-1].provider if attempts else None)


def refused_since_launch(attempts: Sequence[Attempt]) -> dict[tuple[str, str | None, bool], str]:
    """(region, zone, spot) → what it said, for the trailing launches refused for lack of
    capacity: the zones this run has tried in vain since it last had an instance."""
    streak: list[Attempt] = []
    for attempt in reversed(attempts):
        reason = attempt.end_reason or ""
        if attempt.state != AttemptState.FAILED or not reason.startswith(NO_CAPACITY):
            break
        streak.append(attempt)
    return {  # in the order they were tried; the latest answer of a zone wins
        (a.region or "", a.zone, a.spot): (a.end_reason or "")
        .removeprefix(NO_CAPACITY)
        .lstrip(": ")
        for a in reversed(streak)
    }


def decide(
    spec: JobSpec,
    attempts: Sequence[Attempt],
    *,
    preemptions: int,
    default_region: str,
    capacity: Capacity,
    fits: Fits,
) -> Placement | NoPlacement:
    """The placement policy (see the module's docstring). ``attempts``: the run's, oldest
    first; ``default_region``: where a spec naming no region runs.

    Where the provider ranks no zone of any region, and no launch there has been refused
    yet, the attempt goes to the listed zones (or lets the provider pick) as before: the
    launch's answer decides. A provider's "not now" is sometimes only advice (the local
    provider's busy cores); a refused launch is not.
    """
    res = spec.resources
    regions = list(res.regions) or [default_region]
    prev = attempts[-1] if attempts else None
    refused = refused_since_launch(attempts)
    limit = spec.resubmit.on_demand_after_preemptions
    switched = res.spot and limit is not None and preemptions >= limit
    spot_first = res.spot and not switched
    on_demand = not res.spot or switched or res.on_demand_fallback
    stages = [(True, False)] if spot_first else []
    stages += [(False, False)] if on_demand else []
    stages += [(True, True)] if spot_first else []
    stages += [(False, True)] if on_demand else []
    said: dict[bool, list[str]] = {}
    for spot, last_resort in stages:
        found, tried = _place(
            spec,
            regions,
            prev,
            refused,
            spot=spot,
            last_resort=last_resort,
            capacity=capacity,
            fits=fits,
        )
        said.setdefault(spot, tried)
        if not isinstance(found, Placement):
            continue
        if spot or not res.spot:
            return found
        if switched:
            return replace(
                found,
                note=f"after {preemptions} preemptions "
                f"(resubmit.on_demand_after_preemptions={limit})",
            )
        return replace(found, note=f"no spot capacity in {'; '.join(said.get(True, []))}")
    if spot_first and not on_demand:
        return NoPlacement(
            f"no spot capacity in any allowed zone ({'; '.join(said.get(True, []))}); set "
            "resources.on_demand_fallback=true to run on-demand when spot is out, or list "
            "other zones or regions",
            waitable=bool(refused),
        )
    parts = [
        f"{'spot' if spot else 'on-demand'}: {'; '.join(tried)}" for spot, tried in said.items()
    ]
    return NoPlacement(
        f"no capacity in any allowed zone ({' / '.join(parts)}); try again later, or list "
        "other zones or regions",
        waitable=bool(refused),
    )


def _place(
    spec: JobSpec,
    regions: Sequence[str],
    prev: Attempt | None,
    refused: dict[tuple[str, str | None, bool], str],
    *,
    spot: bool,
    last_resort: bool,
    capacity: Capacity,
    fits: Fits,
) -> tuple[Placement | NoPlacement, list[str]]:
    """The first region, from the current one on, with a zone of the market not refused;
    else why not, and what each region said. ``last_resort``: take the listed zones of a
    region the provider ranked none of (or let it pick one: None)."""
    here = prev.region if prev is not None and prev.region in regions else regions[0]
    start = regions.index(here)
    order = [*regions[start:], *regions[:start]]
    tried: list[str] = []
    skipped: list[str] = []
    for region in order:
        zones, said = _zones(spec, region, spot=spot, capacity=capacity)
        if last_resort and not zones:
            zones = list(spec.resources.zones_in(region)) or [None]
        candidates = [z for z in zones if (region, z, spot) not in refused]
        if not spec.resubmit.zone_failover:
            candidates = candidates[:1] if zones and zones[0] in candidates else []
        if not candidates:
            refusals = [
                f"{zone or 'a zone the provider chose'}: {why}"
                for (r, zone, s), why in refused.items()
                if r == region and s == spot
            ]
            tried.append(f"{region}: {', '.join([*refusals, *said]) or 'no zone'}")
            continue
        # A region the run moves to is checked first (quota, data); so is the first of
        # several on the first attempt, since preflight passes when any one can take it.
        if region != here or (prev is None and (region != regions[0] or len(regions) > 1)):
            why_not = fits(region, spot)
            if why_not is not None:
                skipped.append(f"{region}: {why_not}")
                tried.append(f"{region} skipped: {why_not}")
                continue
        zone = _next_zone(spec, candidates, zones, prev, region)
        market = "spot" if spot else "on-demand"
        note = f"no {market} capacity in {'; '.join(tried)}" if tried else ""
        return Placement(region, zone, spot, note=note, skipped=tuple(skipped)), tried
    return NoPlacement("; ".join(tried)), tried


def _zones(
    spec: JobSpec, region: str, *, spot: bool, capacity: Capacity
) -> tuple[list[str | None], list[str]]:
    """The zones to try in ``region``, best first, and what the provider said of the
    others. When the provider cannot rank them, the listed zones (or any: None)."""
    try:
        answer = list(capacity(region, spot))
    except ProviderError as exc:
        log.warning("capacity lookup in %s failed: %s", region, exc)
        listed: list[str | None] = list(spec.resources.zones_in(region))
        return listed or [None], []
    said = [f"{z.zone}: {z.detail or 'no capacity'}" for z in answer if not z.available]
    return [z.zone for z in answer if z.available], said


def _next_zone(
    spec: JobSpec,
    candidates: Sequence[str | None],
    zones: Sequence[str | None],
    prev: Attempt | None,
    region: str,
) -> str | None:
    """Same zone first; the next one the provider ranks after a preemption or a refusal."""
    if prev is None or prev.region != region or prev.zone not in zones:
        return candidates[0]
    moved_out = prev.state == AttemptState.PREEMPTED or (
        prev.state == AttemptState.FAILED and (prev.end_reason or "").startswith(NO_CAPACITY)
    )
    if not moved_out or not spec.resubmit.zone_failover:
        return prev.zone if prev.zone in candidates else candidates[0]
    at = zones.index(prev.zone)
    for zone in [*zones[at + 1 :], *zones[: at + 1]]:
        if zone in candidates:
            return zone
    return candidates[0]  # pragma: no cover - candidates is a non-empty subset of zones


def choose_placement(
    deps: Deps, session: Session, run: Run, spec: JobSpec
) -> Placement | NoPlacement:
    """:func:`decide` for the run's next attempt, asking the run's provider
    (:func:`run_provider`)."""
    attempts = session.exec(
        select(Attempt).where(Attempt.run_id == run.id).order_by(col(Attempt.number))
    ).all()
    try:
        provider = run_provider(deps, spec, attempts)
        default = resource_request(spec, provider).region
    except ProviderError as exc:  # not configured here (any more), or no default region
        return NoPlacement(str(exc))
    buckets = BucketLookup(provider)
    checkpoint_uri = run.checkpoint_uri or deps.settings.checkpoint_uri

    def capacity(region: str, spot: bool) -> Sequence[ZoneCapacity]:
        return provider.capacity(request_in(spec, region, spot=spot, provider=provider))

    def fits(region: str, spot: bool) -> str | None:
        refused = region_refusal(buckets, spec, checkpoint_uri=checkpoint_uri, region=region)
        if refused is not None:
            return refused
        try:
            quota = provider.quota(request_in(spec, region, spot=spot, provider=provider))
        except ProviderError as exc:
            log.warning("quota lookup for %s in %s failed: %s", run.id, region, exc)
            return None  # unknown is not a refusal: the launch will say
        return None if quota.ok else f"{quota.detail}; {quota.remedy}".rstrip("; ")

    decided = decide(
        spec,
        list(attempts),
        preemptions=run.preemptions,
        default_region=default,
        capacity=capacity,
        fits=fits,
    )
    if isinstance(decided, NoPlacement):
        return decided
    return replace(decided, provider=provider.name)

"""Quota and capacity: how many GPUs the project may hold, and which zones offer them.

They are separate questions with separate calls: ``regions.get`` and ``projects.get``
give the quotas, ``acceleratorTypes.aggregatedList`` the zones that offer a type at all;
only ``instances.insert`` finds out whether a zone has one free now, and a zone that
answered with a stockout is ranked unavailable for a while.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

from google.cloud import compute_v1

from jobs.providers.base import CapacityError, QuotaInfo, ResourceRequest, ZoneCapacity
from jobs.providers.gcp.api import ComputeApi
from jobs.providers.gcp.catalog import Accelerator, Catalog, accelerator
from jobs.providers.gcp.errors import QUOTAS_CONSOLE
from jobs.providers.gcp.names import last

__all__ = ["Placement"]


class Placement:
    """Quotas and zones, and what this process has learnt about them: each region's
    zones, and the zones that ran out of a type lately."""

    def __init__(self, api: ComputeApi, catalog: Catalog) -> None:
        self._api = api
        self._catalog = catalog
        self._lock = threading.Lock()
        self._region_zones: dict[str, list[str]] = {}
        self._stockouts: dict[tuple[str, str], float] = {}

    # -- quota ---------------------------------------------------------------------------

    def quota(self, req: ResourceRequest, *, region: str) -> QuotaInfo:
        """The regional metric for the type (preemptible for spot, when the project has
        any), and GPUS_ALL_REGIONS; the tighter of the two binds. Both count every
        instance of the request (``req.instances``)."""
        accel = accelerator(req)
        regional = self._regional_quota(req, region=region, accel=accel)
        if accel is None:
            return regional
        world = self._project_gpu_quota(needed=regional.needed)
        return regional if world is None else _binding(regional, world)

    def _regional_quota(
        self, req: ResourceRequest, *, region: str, accel: Accelerator | None
    ) -> QuotaInfo:
        found = self._region(region, what=f"read the quotas of region {region}")
        metrics = {q.metric: q for q in found.quotas}
        standard = accel.metric if accel else "CPUS"
        preemptible = f"PREEMPTIBLE_{standard}"
        metric, note = standard, ""
        if req.spot:
            pre = metrics.get(preemptible)
            if pre is not None and pre.limit > 0:
                metric = preemptible
            else:
                # Without preemptible quota, spot VMs consume the standard quota.
                note = f" (no {preemptible} quota, so spot VMs count against {standard})"
        quota = metrics.get(metric)
        limit, used = (quota.limit, quota.usage) if quota is not None else (0.0, 0.0)
        if quota is None:
            note += f"; region {region} lists no {metric} quota"
        # Per instance, times the instances the run holds at once (a gang's nodes).
        per_instance = float(req.accelerator_count if accel else self._catalog.vcpus(req))
        instances = max(1, req.instances)
        needed = per_instance * instances
        unit = "GPUs" if accel else "vCPUs"
        if instances > 1:
            note += f"; {instances} instances of {per_instance:g} {unit} each"
        remedy = self._remedy(preemptible if req.spot else standard, used + needed, region=region)
        if req.spot and metric == standard:
            remedy += f" (or raise {standard}: spot VMs use it while {preemptible} is 0)"
        what = f"{accel.name} {unit}" if accel else unit
        return QuotaInfo.check(
            limit,
            used,
            needed,
            unit,
            detail=f"{metric} in {region}: {used:g} of {limit:g} {what} in use{note}",
            remedy=remedy,
        )

    def _project_gpu_quota(self, *, needed: float) -> QuotaInfo | None:
        api = self._api
        found = api.call(
            f"read the quotas of project {api.project}",
            "projects.get",
            lambda: api.client("projects").get(project=api.project, timeout=api.call_timeout_s),
            not_found=f"project {api.project} does not exist or is not visible: fix the"
            " configured GCP project id",
        )
        total = next((q for q in found.quotas if q.metric == "GPUS_ALL_REGIONS"), None)
        if total is None:
            return None
        return QuotaInfo.check(
            total.limit,
            total.usage,
            needed,
            "GPUs",
            detail=f"GPUS_ALL_REGIONS in project {api.project}: {total.usage:g} of"
            f" {total.limit:g} GPUs in use",
            remedy=self._remedy("GPUS_ALL_REGIONS", total.usage + needed, region=None),
        )

    def _remedy(self, metric: str, wanted: float, *, region: str | None) -> str:
        project = self._api.project
        scope = "region" if region else "project"
        quota_id = f"{metric.replace('_', '-')}-per-project" + ("-region" if region else "")
        where = f" in region {region}" if region else " for the project"
        dims = f" --dimensions=region={region}" if region else ""
        return (
            f"request an increase of {metric}{where} to at least {wanted:g}: in the console"
            f" at {QUOTAS_CONSOLE.format(project=project)} (filter on {metric},"
            f" {scope} {region or 'global'}), or run `gcloud quotas preferences create"
            f" --service=compute.googleapis.com --project={project}"
            f" --quota-id={quota_id} --preferred-value={wanted:g}{dims} --email=YOU@EXAMPLE.COM`"
        )

    # -- capacity ------------------------------------------------------------------------

    def capacity(
        self,
        req: ResourceRequest,
        *,
        region: str,
        zones: Sequence[str],
        cooldown_s: float,
    ) -> list[ZoneCapacity]:
        """``zones`` (or all of the region's) ranked: those that offer the type first.

        Compute Engine publishes no spot placement score, so there are no scores; a zone
        that answered an insert with a stockout within ``cooldown_s`` is unavailable.
        """
        accel = accelerator(req)
        in_region = self.zones_of(region)
        candidates = list(dict.fromkeys(req.zones or zones or in_region))
        offered: dict[str, int] = {}
        if accel is not None:
            offered = self._offered(accel)
        kind = self._catalog.kind(req)
        now = time.monotonic()
        found: list[ZoneCapacity] = []
        for zone in candidates:
            since = self._stockouts.get((zone, kind))
            if zone not in in_region:
                found.append(ZoneCapacity.unavailable(zone, f"not a zone of {region}"))
            elif since is not None and now - since < cooldown_s:
                ago = int(now - since)
                found.append(
                    ZoneCapacity.unavailable(
                        zone, f"ran out of {kind} {ago} s ago (ZONE_RESOURCE_POOL_EXHAUSTED)"
                    )
                )
            elif accel is None:
                found.append(ZoneCapacity(zone, True, detail="CPU machine types"))
            elif zone not in offered:
                found.append(ZoneCapacity.unavailable(zone, f"does not offer {accel.name}"))
            elif req.accelerator_count > offered[zone]:
                found.append(
                    ZoneCapacity.unavailable(
                        zone, f"offers at most {offered[zone]} {accel.name} per instance"
                    )
                )
            else:
                found.append(
                    ZoneCapacity(
                        zone, True, detail=f"offers {accel.name} (up to {offered[zone]} per VM)"
                    )
                )
        return sorted(found, key=lambda z: not z.available)

    def first_zone(
        self, req: ResourceRequest, *, region: str, zones: Sequence[str], cooldown_s: float
    ) -> str:
        for zone in self.capacity(req, region=region, zones=zones, cooldown_s=cooldown_s):
            if zone.available:
                return zone.zone
        raise CapacityError(
            f"no zone of {region} offers the request now; try later or another region"
        )

    def ran_out(self, zone: str, kind: str) -> None:
        """Record a stockout of ``kind`` in ``zone``, so capacity ranks it unavailable."""
        with self._lock:
            self._stockouts[(zone, kind)] = time.monotonic()

    def zones_of(self, region: str) -> list[str]:
        with self._lock:
            cached = self._region_zones.get(region)
        if cached is not None:
            return cached
        found = self._region(region, what=f"list the zones of region {region}")
        return sorted(last(z) for z in found.zones)

    def _region(self, region: str, *, what: str) -> Any:
        """regions.get, which lists the region's quotas and zones; the zones are kept."""
        api = self._api
        found = api.call(
            what,
            "regions.get",
            lambda: api.client("regions").get(
                project=api.project, region=region, timeout=api.call_timeout_s
            ),
            not_found=f"region {region} does not exist for project {api.project}: fix"
            " resources.region (GCP regions look like us-central1)",
        )
        with self._lock:
            self._region_zones[region] = sorted(last(z) for z in found.zones)
        return found

    def _offered(self, accel: Accelerator) -> dict[str, int]:
        """Zone → most GPUs of the type per instance, for every zone that offers it."""
        api = self._api
        request = compute_v1.AggregatedListAcceleratorTypesRequest(
            project=api.project, filter=f'name = "{accel.name}"'
        )

        def collect() -> dict[str, int]:
            pager = api.client("accelerator_types").aggregated_list(
                request=request, timeout=api.call_timeout_s
            )
            out: dict[str, int] = {}
            for scope, scoped in pager:
                for t in scoped.accelerator_types:
                    if t.name == accel.name and not (t.deprecated and t.deprecated.state):
                        out[last(scope)] = int(t.maximum_cards_per_instance or 0)
            return out

        return api.call(
            f"list the zones that offer {accel.name}", "acceleratorTypes.aggregatedList", collect
        )


def _binding(regional: QuotaInfo, world: QuotaInfo) -> QuotaInfo:
    """Of a regional and the project-wide quota, the one that stops the request (or,
    when both allow it, the one with less headroom), naming both."""
    if not regional.ok and not world.ok:
        return dataclasses.replace(
            regional,
            detail=f"{regional.detail}; {world.detail}",
            remedy=f"{regional.remedy}; and {world.remedy}",
        )
    if regional.ok and world.ok:
        tighter = regional.limit - regional.used <= world.limit - world.used
        first, second = (regional, world) if tighter else (world, regional)
    else:
        first, second = (world, regional) if regional.ok else (regional, world)
    return dataclasses.replace(first, detail=f"{first.detail}; {second.detail}")

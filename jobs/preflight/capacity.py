"""The capacity check: which zones offer the type now, ranked.

Capacity is a separate question from quota. Where the provider has a permission probe
(EC2's ``DryRun``), it also asks whether a launch in the best zone would be allowed: a
missing credential found here costs a minute, found at launch a failed run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from jobs.preflight.findings import CapacityFindings
from jobs.preflight.regions import region_requests, said_list
from jobs.preflight.report import (
    CheckResult,
    PreflightContext,
    PreflightPlan,
    Status,
    describe_request,
)
from jobs.providers.base import ProviderError, ResourceRequest, ZoneCapacity

__all__ = ["CapacityCheck"]


class CapacityCheck:
    """Which zones offer the type now, ranked best first, in each listed region.

    With several ``resources.regions`` the run fails over between them, so capacity in
    any one passes; the zones reported are the first such region's, where the launch
    goes. With ``resources.on_demand_fallback`` and no spot capacity in any region, it
    asks again for on-demand capacity and warns that the run will pay on-demand prices.
    """

    name: str = "capacity"

    def run(self, ctx: PreflightContext, *, prior: PreflightPlan) -> CheckResult:
        req = ctx.request
        requests = region_requests(ctx)
        answers = _ask(ctx, requests)
        where = said_list([r.region for r in requests], word="or")
        what = describe_request(req, where=where)
        found = [(r, zones) for r, zones in answers if _ranked(zones)]
        if found:
            return self._available(ctx, found, answers)
        if req.spot and ctx.spec.resources.on_demand_fallback:
            on_demand = [
                (r, z) for r, z in _ask(ctx, region_requests(ctx, spot=False)) if _ranked(z)
            ]
            if on_demand:
                od_req, od_zones = on_demand[0]
                ranked = _ranked(od_zones)
                refused = self._launch_refused(ctx, od_req, od_zones)
                if refused is not None:
                    return refused
                names = ", ".join(z.zone for _, zones in on_demand for z in _ranked(zones))
                finding, data = _capacity(od_zones, ranked, on_demand=True, region=od_req.region)
                return CheckResult(
                    self.name,
                    Status.WARN,
                    f"no zone of {where} has spot capacity for {what} now; "
                    f"on-demand capacity in {names}",
                    "launch anyway to run on demand at on-demand prices (the budget check "
                    "uses them), or wait and run preflight again for spot capacity",
                    data=data,
                    finding=finding,
                )
        finding, data = _capacity(answers[0][1], [], on_demand=False, region=answers[0][0].region)
        if len(answers) == 1:
            found_text = _refusals(answers[0][1])
        else:
            found_text = "; ".join(f"{r.region}: {_refusals(zones)}" for r, zones in answers)
        return CheckResult(
            self.name,
            Status.FAIL,
            f"no zone of {where} offers {what} now ({found_text}); capacity is a separate "
            "question from quota: a quota that allows it does not mean a zone has it free",
            "try again later, list other zones or another region in resources.regions/"
            "resources.zones, pick another accelerator type, or set "
            "resources.on_demand_fallback=true",
            data=data,
            finding=finding,
        )

    def _available(
        self,
        ctx: PreflightContext,
        found: Sequence[tuple[ResourceRequest, Sequence[ZoneCapacity]]],
        answers: Sequence[tuple[ResourceRequest, Sequence[ZoneCapacity]]],
    ) -> CheckResult:
        """PASS (or WARN for listed zones without it) in the first region with capacity."""
        req, zones = found[0]
        available = _ranked(zones)
        refused = self._launch_refused(ctx, req, zones)
        if refused is not None:
            return refused
        finding, data = _capacity(zones, available, on_demand=False, region=req.region)
        what = describe_request(req)
        listing = ", ".join(_zone_text(z) for z in available)
        others = ""
        if len(answers) > 1:
            usable = [r.region for r, _ in found]
            data["usable_regions"] = usable
            also = [
                f"{r.region}: {', '.join(_zone_text(z) for z in _ranked(z_))}"
                for r, z_ in found[1:]
            ]
            none = [f"{r.region} ({_refusals(z_)})" for r, z_ in answers if r.region not in usable]
            others += f"; also in {'; '.join(also)}" if also else ""
            others += f"; none in {'; '.join(none)}" if none else ""
        missing = [z for z in req.zones if z not in {a.zone for a in available}]
        if missing:
            return CheckResult(
                self.name,
                Status.WARN,
                f"{what}: only {listing} of the requested zones "
                f"{', '.join(req.zones)} offer it now; {', '.join(missing)} do not{others}",
                f"the launch will use {available[0].zone}; drop {', '.join(missing)} from "
                "resources.zones, or leave zones empty to let the ranking choose",
                data=data,
                finding=finding,
            )
        return CheckResult(
            self.name,
            Status.PASS,
            f"{what} available now in {listing} (best first){others}",
            data=data,
            finding=finding,
        )

    def _launch_refused(
        self, ctx: PreflightContext, req: ResourceRequest, zones: Sequence[ZoneCapacity]
    ) -> CheckResult | None:
        """A FAIL when the provider says a launch in the best zone would be refused."""
        ranked = _ranked(zones)
        if not ctx.provider.capabilities.permission_probe or not ranked:
            return None
        try:
            ctx.provider.check_launch_permissions(req, zone=ranked[0].zone)
        except ProviderError as exc:
            finding, data = _capacity(zones, ranked, on_demand=not req.spot, region=req.region)
            return CheckResult(
                self.name,
                Status.FAIL,
                f"{describe_request(req)} is available in {ranked[0].zone}, but a launch "
                f"there would be refused: {exc}",
                "grant the control plane what the message names, then run preflight again",
                data={**data, "launch_refused": str(exc)},
                finding=finding,
            )
        return None


def _ranked(zones: Sequence[ZoneCapacity]) -> list[ZoneCapacity]:
    """Available zones, highest score first; the provider's order breaks ties."""
    available = [z for z in zones if z.available]
    return sorted(available, key=lambda z: -z.score if z.score is not None else math.inf)


def _capacity(
    zones: Sequence[ZoneCapacity],
    ranked: Sequence[ZoneCapacity],
    *,
    on_demand: bool,
    region: str,
) -> tuple[CapacityFindings, dict[str, Any]]:
    """Where the run goes (what the budget check prices: ``region`` and its best zone),
    and the result's data: that, with every zone's answer."""
    finding = CapacityFindings(
        region=region, zones=tuple(z.zone for z in ranked), on_demand=on_demand
    )
    return finding, {**finding.as_data(), "all": [asdict(z) for z in zones]}


def _ask(
    ctx: PreflightContext, requests: Sequence[ResourceRequest]
) -> list[tuple[ResourceRequest, list[ZoneCapacity]]]:
    """Each region's zones. With several regions, one that cannot answer counts as none
    (its error shown as its zone's detail); it raises only when none can."""
    if len(requests) == 1:
        return [(requests[0], list(ctx.provider.capacity(requests[0])))]
    answers: list[tuple[ResourceRequest, list[ZoneCapacity]]] = []
    errors: list[ProviderError] = []
    for req in requests:
        try:
            answers.append((req, list(ctx.provider.capacity(req))))
        except ProviderError as exc:
            errors.append(exc)
            answers.append((req, [ZoneCapacity(req.region, False, None, f"cannot tell: {exc}")]))
    if len(errors) == len(requests):
        raise errors[0]
    return answers


def _refusals(zones: Sequence[ZoneCapacity]) -> str:
    return "; ".join(f"{z.zone}: {z.detail}" for z in zones if z.detail) or "none listed"


def _zone_text(zone: ZoneCapacity) -> str:
    return zone.zone if zone.score is None else f"{zone.zone} (score {zone.score:g})"

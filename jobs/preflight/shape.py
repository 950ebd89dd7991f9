"""One larger instance before several small ones.

N instances of k accelerators talk to each other over the network for every gradient
exchange, have to be launched together, and have N times the chances to be preempted
(any one stops them all). When the provider's catalogue has one instance type of the
same accelerator that holds all N·k, that is usually the better run: the accelerators
talk over the instance's own interconnect (NVLink, PCIe), and there is one machine to
launch, watch and restart. The check says so, with both prices, as a warning.

A provider that cannot launch several nodes as one gang (its capabilities say no
``gang_placement``) fails the check: validation stays offline, so it is said here.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from jobs.domain.format import usd
from jobs.preflight.report import CheckResult, PreflightContext, PreflightPlan, Status
from jobs.providers.base import Provider, ResourceRequest

__all__ = ["InstanceShapeCheck", "OneLarger", "one_larger_instance"]

log = logging.getLogger(__name__)

#: Why one instance is preferred, said with every finding.
REASON = (
    "one instance exchanges gradients over its own interconnect instead of the network "
    "between nodes, and is one machine to launch, watch and restart after a preemption"
)


@dataclass(frozen=True)
class OneLarger:
    """N instances of k accelerators, and the one instance type that holds N·k."""

    instances: int
    per_instance: int
    accelerator: str
    #: The type of each small instance (None when the provider would pick it).
    small_type: str | None
    large_type: str
    #: USD per hour of all N small instances, and of the one large one, in the market asked.
    small_usd_per_hour: float
    large_usd_per_hour: float
    spot: bool

    @property
    def total(self) -> int:
        return self.instances * self.per_instance

    def detail(self) -> str:
        market = "spot" if self.spot else "on-demand"
        small = f" ({self.small_type})" if self.small_type else ""
        return (
            f"{self.instances} instances of {self.per_instance} × {self.accelerator}{small} "
            f"cost {usd(self.small_usd_per_hour)}/h {market}; one {self.large_type} holds "
            f"all {self.total} for {usd(self.large_usd_per_hour)}/h"
        )

    def remedy(self) -> str:
        return (
            f"prefer one {self.large_type}: set resources.accelerator={self.accelerator}:"
            f"{self.total} and resources.instances=1 ({REASON})"
        )


def _hourly(provider: Provider, req: ResourceRequest) -> float:
    quote = provider.price(req)
    return quote.spot_usd_per_hour if req.spot else quote.on_demand_usd_per_hour


def one_larger_instance(
    provider: Provider, request: ResourceRequest, instances: int
) -> OneLarger | None:
    """The one instance type that holds what ``instances`` × ``request`` asks for, priced;
    None for one instance, a CPU-only request, or when no single type holds it all.
    Raises :class:`ProviderError` when the provider cannot price it."""
    if instances <= 1 or request.accelerator_count <= 0 or not request.accelerator_type:
        return None
    large = dataclasses.replace(
        request, accelerator_count=request.accelerator_count * instances, instance_type=None
    )
    large_type = provider.instance_type_for(large)
    if large_type is None:
        return None
    small_type = request.instance_type or provider.instance_type_for(request)
    return OneLarger(
        instances=instances,
        per_instance=request.accelerator_count,
        accelerator=request.accelerator_type,
        small_type=small_type,
        large_type=large_type,
        small_usd_per_hour=_hourly(provider, request) * instances,
        large_usd_per_hour=_hourly(provider, dataclasses.replace(large, instance_type=large_type)),
        spot=request.spot,
    )


class InstanceShapeCheck:
    """N instances of k accelerators, when one instance type holds N·k: a warning."""

    name = "instances"

    def run(self, ctx: PreflightContext, *, prior: PreflightPlan) -> CheckResult:
        resources = ctx.spec.resources
        n = resources.instances
        if n <= 1:
            return CheckResult(self.name, Status.PASS, "one instance", data={"instances": 1})
        placement = ctx.provider.capabilities.gang_placement
        if not placement:
            return CheckResult(
                self.name,
                Status.FAIL,
                f"{n} instances: the {ctx.provider.name} provider launches one instance per "
                "attempt, not a gang of nodes",
                "set resources.instances=1 (a larger instance, more accelerators each), or "
                "run on a provider that launches multi-node gangs (local, aws, gcp)",
                data={"instances": n},
            )
        found = one_larger_instance(ctx.provider, ctx.request, n)
        if found is None:
            what = (
                "no single instance type of the "
                f"{ctx.provider.name} catalogue holds all their accelerators"
                if ctx.request.accelerator_count > 0
                else "CPU-only, nothing to combine"
            )
            return CheckResult(
                self.name,
                Status.PASS,
                f"{n} instances launched together ({placement}): {what}",
                data={"instances": n},
            )
        return CheckResult(
            self.name,
            Status.WARN,
            found.detail(),
            found.remedy(),
            data={
                "instances": n,
                "large_type": found.large_type,
                "small_usd_per_hour": found.small_usd_per_hour,
                "large_usd_per_hour": found.large_usd_per_hour,
            },
        )

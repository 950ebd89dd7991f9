"""What a cloud dry run may cost: the types an admin allows, a price ceiling, and how many
run at once in one channel.

A spec once chose any instance for its dry run (``dry_run.instance_type=p5.48xlarge``
with ``resources.spot=false`` launched at $98.32/h), and four long dry runs in one
channel held every background worker (issue 23.3 and 23.8). The limits are process
settings, set by whoever runs the control plane, never by a spec:

- ``TRAINBOT_DRY_RUN_INSTANCE_TYPES``: the types a spec may name (unset: the provider's
  one-GPU and small CPU types below). ``cpu``, and no type at all (the cheapest type of
  the run's accelerator), stay allowed; the price ceiling bounds them.
- ``TRAINBOT_DRY_RUN_MAX_USD_PER_HOUR``: whatever the type, its price as launched (spot,
  or on demand for an on-demand run).
- ``TRAINBOT_DRY_RUNS_PER_CHANNEL``: dry runs under way at once in one channel.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from sqlmodel import Session, col, select

from jobs.database.models import DryRunInstance, Run
from jobs.domain.format import usd
from jobs.preflight.report import CheckResult, Status
from jobs.process.settings import Settings
from jobs.providers import PROVIDERS
from jobs.providers.base import CPU_INSTANCE

__all__ = ["DryRunLimits", "live_in_channel", "slot_lock"]

#: Held while a dry run is counted against its channel and its row written, so two
#: preflights of one replica cannot both take the last place. (Replicas sharing a
#: database check again once the row is written: the later of two is withdrawn.)
slot_lock = threading.Lock()


@dataclass(frozen=True)
class DryRunLimits:
    """The admin's limits on cloud dry runs (``TRAINBOT_DRY_RUN*``)."""

    #: Types a spec may name; empty: the provider's defaults (its registration's
    #: ``dry_run_types``, :mod:`jobs.providers`).
    instance_types: tuple[str, ...] = ()
    #: The most a dry run's instance may cost per hour, as launched.
    max_usd_per_hour: float = 8.0
    #: Dry runs under way at once in one channel.
    per_channel: int = 2

    @classmethod
    def from_settings(cls, settings: Settings) -> DryRunLimits:
        return cls(
            instance_types=tuple(settings.dry_run_instance_types),
            max_usd_per_hour=settings.dry_run_max_usd_per_hour,
            per_channel=settings.dry_runs_per_channel,
        )

    def allowed(self, provider: str) -> tuple[str, ...]:
        found = PROVIDERS.get(provider)
        return self.instance_types or (found.dry_run_types if found is not None else ())

    def refuse_type(self, provider: str, instance_type: str | None) -> CheckResult | None:
        """A FAIL when the spec names a type the admin does not allow, else None."""
        if not instance_type or instance_type == CPU_INSTANCE:
            return None
        allowed = self.allowed(provider)
        if instance_type in allowed:
            return None
        listed = ", ".join(allowed) or "none"
        source = (
            "TRAINBOT_DRY_RUN_INSTANCE_TYPES"
            if self.instance_types
            else f"the {provider} defaults; TRAINBOT_DRY_RUN_INSTANCE_TYPES changes them"
        )
        return CheckResult(
            "dry_run",
            Status.FAIL,
            f"dry_run.instance_type={instance_type} is not a dry-run type this control plane "
            f"allows ({listed}: {source}); nothing was launched",
            f"set dry_run.instance_type to one of {listed}, or dry_run.instance_type=cpu, or "
            "leave it unset for the cheapest type of the run's accelerator; an admin can add "
            "the type to TRAINBOT_DRY_RUN_INSTANCE_TYPES",
            data={"refused": "instance_type", "allowed": list(allowed)},
        )

    def refuse_price(self, instance_type: str, *, price: float, spot: bool) -> CheckResult | None:
        """A FAIL when the dry run's instance costs more per hour than the ceiling."""
        if price <= self.max_usd_per_hour:
            return None
        market = "spot" if spot else "on demand"
        cheaper = "" if spot else "resources.spot=true (the dry run is then spot too), or "
        return CheckResult(
            "dry_run",
            Status.FAIL,
            f"the dry run's {instance_type} costs {usd(price)}/h {market}, above the "
            f"{usd(self.max_usd_per_hour)}/h a dry run may cost "
            "(TRAINBOT_DRY_RUN_MAX_USD_PER_HOUR); nothing was launched",
            f"set {cheaper}dry_run.instance_type=cpu or a smaller type, or ask an admin to "
            "raise TRAINBOT_DRY_RUN_MAX_USD_PER_HOUR",
            data={"refused": "price", "price_per_hour": price},
        )

    def refuse_busy(self, channel: str, busy: list[str]) -> CheckResult | None:
        """A FAIL when ``channel`` has its limit of dry runs under way (``busy``: their runs)."""
        if len(busy) < self.per_channel:
            return None
        runs = ", ".join(sorted(set(busy)))
        return CheckResult(
            "dry_run",
            Status.FAIL,
            f"{channel} has {len(busy)} dry runs under way ({runs}), its limit "
            f"(TRAINBOT_DRY_RUNS_PER_CHANNEL={self.per_channel}); this one was not launched",
            f"run `/train preflight` again once one of them has reported, or stop one "
            f"(`/train stop {sorted(set(busy))[0]}`)",
            data={"refused": "per_channel", "busy": sorted(set(busy))},
        )


def live_in_channel(session: Session, run_id: str) -> tuple[str, list[tuple[str, str]]]:
    """The channel of run ``run_id`` and the dry runs under way there, oldest first, as
    (dry run id, run id)."""
    run = session.get(Run, run_id)
    channel = run.channel if run is not None else None
    same = col(Run.channel).is_(None) if channel is None else col(Run.channel) == channel
    rows = session.exec(
        select(DryRunInstance.id, DryRunInstance.run_id)
        .join(Run, col(Run.id) == DryRunInstance.run_id)
        .where(col(DryRunInstance.ended_at).is_(None), same)
        .order_by(col(DryRunInstance.created_at), col(DryRunInstance.id))
    ).all()
    return channel or "this channel", [(dry_id, owner) for dry_id, owner in rows]

"""What one preflight check finds that a later check, the report or the launch needs.

Each is a frozen dataclass a check produces and hands on in the plan
(:class:`jobs.preflight.report.PreflightPlan`): the capacity check says where the run
goes (:class:`CapacityFindings`), the dry run what a step and a checkpoint cost and the
interval chosen from them (:class:`DryRunFindings`), the budget check what the run should
cost (:class:`CostEstimate`). Their stored form is the result's JSON ``data`` that the
card, ``/train status`` and the database have always shown: ``as_data`` writes it and
``from_data`` reads it back, from rows of this version and older ones alike, a field of
the wrong type counting as missing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

__all__ = ["CapacityFindings", "CostEstimate", "DryRunFindings", "Finding"]


def _number(value: Any) -> float | None:
    """A finite number from JSON-able data; None for anything else (a bool too)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _whole(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value) if math.isfinite(value) else None


@dataclass(frozen=True)
class CapacityFindings:
    """Where the capacity check found room: what the budget check prices."""

    #: The check whose result carries it.
    check: ClassVar[str] = "capacity"

    #: The region the launch goes to (the first listed one with capacity); None when the
    #: check could not say.
    region: str | None = None
    #: Zones with capacity now, best first; empty when none has.
    zones: tuple[str, ...] = ()
    #: True when only on-demand capacity was found (``resources.on_demand_fallback``).
    on_demand: bool = False

    @property
    def best_zone(self) -> str | None:
        return self.zones[0] if self.zones else None

    def as_data(self) -> dict[str, Any]:
        return {"zones": list(self.zones), "on_demand": self.on_demand, "region": self.region}

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> CapacityFindings:
        region = data.get("region")
        zones = data.get("zones")
        return cls(
            region=region if isinstance(region, str) else None,
            zones=tuple(z for z in zones if isinstance(z, str)) if isinstance(zones, list) else (),
            on_demand=bool(data.get("on_demand")),
        )


@dataclass(frozen=True)
class DryRunFindings:
    """What a passing dry run measured, and the checkpoint interval chosen from it.

    The budget check prices the run from it; the launch hands the runner the measured
    write (its emergency-flush margin) and the interval's M; a resubmit re-chooses the
    interval with the same M. Every figure may be missing (a runner that does not say,
    an older row).
    """

    check: ClassVar[str] = "dry_run"

    #: Seconds per training step on the dry run's machine.
    step_time_s: float | None = None
    #: Size of the checkpoint it committed.
    checkpoint_bytes: int | None = None
    #: Seconds to write that checkpoint to the run's store.
    write_s: float | None = None
    #: Seconds a periodic save blocked the loop.
    stall_s: float | None = None
    #: Seconds to restore it.
    restore_s: float | None = None
    #: The checkpoint interval chosen: the spec's, or Daly's for ``"auto"``; None when
    #: ``"auto"`` had no write time to work from.
    interval_s: float | None = None
    #: Daly's C: seconds lost per save (the stall, else the write time).
    interval_cost_s: float | None = None
    #: Daly's M: mean seconds between the preemptions that lose work.
    interval_mtbp_s: float | None = None
    #: The floor of the ``"auto"`` interval: the write time (one save in flight).
    interval_floor_s: float | None = None
    #: The provider's termination window; None where it has none.
    termination_window_s: float | None = None
    #: Whether an emergency checkpoint fits that window; None without a window.
    emergency_fits_window: bool | None = None

    #: Fields written only when known (the stored shape has always left them out).
    _OPTIONAL: ClassVar[frozenset[str]] = frozenset(
        {
            "interval_cost_s",
            "interval_mtbp_s",
            "interval_floor_s",
            "termination_window_s",
            "emergency_fits_window",
        }
    )

    @property
    def write_bandwidth_bps(self) -> float | None:
        """Bytes per second the measured write achieved; None without both figures."""
        nbytes, write_s = self.checkpoint_bytes, self.write_s
        if nbytes is None or write_s is None or not (nbytes > 0 and write_s > 0):
            return None
        return nbytes / write_s

    def as_data(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None or k not in self._OPTIONAL}

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> DryRunFindings:
        fits = data.get("emergency_fits_window")
        return cls(
            step_time_s=_number(data.get("step_time_s")),
            checkpoint_bytes=_whole(data.get("checkpoint_bytes")),
            write_s=_number(data.get("write_s")),
            stall_s=_number(data.get("stall_s")),
            restore_s=_number(data.get("restore_s")),
            interval_s=_number(data.get("interval_s")),
            interval_cost_s=_number(data.get("interval_cost_s")),
            interval_mtbp_s=_number(data.get("interval_mtbp_s")),
            interval_floor_s=_number(data.get("interval_floor_s")),
            termination_window_s=_number(data.get("termination_window_s")),
            emergency_fits_window=fits if isinstance(fits, bool) else None,
        )

    @classmethod
    def stored(cls, report: Mapping[str, Any] | None) -> DryRunFindings:
        """The findings in a run's stored preflight report (``Run.preflight``); empty
        without a dry run."""
        results = (report or {}).get("results")
        for result in results if isinstance(results, list) else []:
            if isinstance(result, Mapping) and result.get("name") == cls.check:
                data = result.get("data")
                return cls.from_data(data if isinstance(data, Mapping) else {})
        return cls()


@dataclass(frozen=True)
class CostEstimate:
    """The budget check's answer: what the run should cost, and from what."""

    check: ClassVar[str] = "budget"

    #: Expected USD (price × instances × hours); None when it cannot be estimated.
    estimate_usd: float | None = None
    #: Hours the estimate assumes.
    expected_hours: float | None = None
    usd_per_hour: float | None = None
    #: "spot" or "on-demand".
    price_kind: str | None = None
    #: Where the price came from (the provider's quote).
    price_source: str | None = None
    instances: int | None = None
    #: The checkpoint interval the estimate assumes (the dry run's, else the spec's).
    interval_s: float | None = None
    #: USD that ``max_hours`` allows; None without it.
    max_hours_usd: float | None = None
    #: The spec's ``budget.usd``.
    budget_usd: float | None = None
    #: How the hours were worked out, in words.
    basis: str | None = None

    def as_data(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> CostEstimate:
        def text(key: str) -> str | None:
            value = data.get(key)
            return value if isinstance(value, str) else None

        return cls(
            estimate_usd=_number(data.get("estimate_usd")),
            expected_hours=_number(data.get("expected_hours")),
            usd_per_hour=_number(data.get("usd_per_hour")),
            price_kind=text("price_kind"),
            price_source=text("price_source"),
            instances=_whole(data.get("instances")),
            interval_s=_number(data.get("interval_s")),
            max_hours_usd=_number(data.get("max_hours_usd")),
            budget_usd=_number(data.get("budget_usd")),
            basis=text("basis"),
        )


#: Any check's finding, as a :class:`~jobs.preflight.report.CheckResult` carries it.
Finding = CapacityFindings | DryRunFindings | CostEstimate

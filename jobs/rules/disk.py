"""Disk: the scratch volume is above a threshold, or filling fast enough to be full soon."""

from __future__ import annotations

import math
from collections.abc import Sequence

from jobs.domain import format as fmt
from jobs.rules import base

__all__ = ["Disk"]

# Disk use at or above this percentage is critical: the next checkpoint may not fit.
_DISK_CRITICAL = 97.0
# Samples needed before a growth rate predicts anything.
_DISK_FIT_MIN_POINTS = 3


class Disk(base.Thresholded):
    """The scratch disk is nearly full, or filling fast enough to be full soon.

    A full disk fails the next checkpoint, which is the one thing a spot run cannot lose.
    """

    name = "disk"
    trigger = base.Trigger.STREAM

    def evaluate(
        self, window: Sequence[base.Obs], *, now: float, ctx: base.RunContext
    ) -> list[base.Signal]:
        # Each node of a multi-node run has its own scratch disk; the alert names it.
        return base.per_node(
            base.of_type(window, "system"), lambda _, system: self._node(system, now=now, ctx=ctx)
        )

    def _node(
        self, system: Sequence[base.Obs], *, now: float, ctx: base.RunContext
    ) -> list[base.Signal]:
        samples: list[tuple[float, float, float]] = []
        for obs in system:
            data = obs.data
            used, total = data.get("disk_used"), data.get("disk_total")
            if type(used) is int and type(total) is int:  # nearly always: _num, inlined
                used, total = float(used), float(total)
            else:
                used, total = base.number(data, "disk_used"), base.number(data, "disk_total")
            if used is not None and total is not None and total > 0 and math.isfinite(used):
                samples.append((obs.time, used, total))
        if not samples:
            return []
        signals = [self._threshold(samples[-1], ctx)]
        full_in = self._full_in(samples, now=now, ctx=ctx)
        if full_in is not None:
            signals.append(full_in)
        return signals

    def _hint(self) -> str:
        return (
            "Free space on the scratch volume (caches, local checkpoint copies) or relaunch "
            "with a bigger disk; a full disk fails the next checkpoint."
        )

    def _threshold(self, latest: tuple[float, float, float], ctx: base.RunContext) -> base.Signal:
        _, used, total = latest
        pct = 100.0 * used / total
        figures = f"disk {pct:.1f}% used ({fmt.size(used)} of {fmt.size(total)})"
        data = {"percent": pct, "used": used, "total": total}
        verdict = base.Verdict(self.name, "threshold", base.Severity.WARNING, data)
        if pct <= self.cfg.disk_percent:
            return verdict.cleared(f"Disk of run {ctx.run_id} is back to {pct:.0f}% used", figures)
        critical = pct >= _DISK_CRITICAL
        return verdict.firing(
            f"Disk {pct:.0f}% full on run {ctx.run_id}",
            f"{figures}; alert above {self.cfg.disk_percent:g}%",
            hint=self._hint(),
            severity=base.Severity.CRITICAL if critical else base.Severity.WARNING,
        )

    def _full_in(
        self, samples: list[tuple[float, float, float]], *, now: float, ctx: base.RunContext
    ) -> base.Signal | None:
        if len(samples) < _DISK_FIT_MIN_POINTS:
            return None
        times = [t for t, _, _ in samples]
        if times[-1] == times[0]:
            return None
        rate = base.slope(times, [u for _, u, _ in samples])  # bytes per second
        _, used, total = samples[-1]
        horizon = self.cfg.disk_horizon_s
        eta = (total - used) / rate if rate > 0 else math.inf
        if eta > horizon:
            return base.Verdict(
                self.name, "full-in", base.Severity.WARNING, {"rate_bytes_per_s": rate}
            ).cleared(
                f"Disk of run {ctx.run_id} is no longer filling fast",
                f"disk {100 * used / total:.1f}% used, growing {fmt.size(rate * 60)}/min",
            )
        eta = max(eta, 0.0)
        return base.Verdict(self.name, "full-in", base.Severity.WARNING).firing(
            f"Disk of run {ctx.run_id} will be full in ~{fmt.duration(eta)}",
            (
                f"disk {100 * used / total:.1f}% used ({fmt.size(used)} of {fmt.size(total)}), "
                f"growing {fmt.size(rate * 60)}/min over {len(samples)} samples: full in "
                f"~{fmt.duration(eta)} (about {fmt.clock(now + eta)})"
            ),
            hint=self._hint(),
            data={"eta_s": eta, "rate_bytes_per_s": rate, "used": used, "total": total},
        )

"""Divergent loss: NaN or Inf at once, a spike held for several points, a rising trend."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from jobs.domain import format as fmt
from jobs.rules.base import (
    Obs,
    RunContext,
    Severity,
    Signal,
    Thresholded,
    Trigger,
    Verdict,
    integer,
    number,
    of_type,
    slope,
)

__all__ = ["DivergentLoss"]

# A trend alerts only when the latest loss is this multiple of the window's minimum.
_TREND_RATIO = 1.5
# NaN, spike and trend are one problem: they join one alert (see jobs.alerts).
INCIDENT = "divergence"


class DivergentLoss(Thresholded):
    """The loss went NaN/Inf, spiked for several points, or keeps rising.

    A diverging run burns its budget producing nothing, so NaN alerts at once (and, by
    default, asks for the run to be stopped at once); a spike needs several points in a
    row because a single bad batch is normal. A spike or a trend asks for a stop only
    when nobody acknowledges it within ``stop_after``. All three join one incident.
    """

    name = "divergent_loss"
    trigger = Trigger.STREAM

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        points: list[tuple[int | None, float]] = []
        for obs in of_type(window, "metrics"):
            data = obs.data
            loss = data.get("loss")
            if type(loss) is not float:  # the rest, inlined: this runs for every point
                loss = number(data, "loss")
                if loss is None:
                    continue
            step = data.get("step")
            points.append((step if type(step) is int else integer(data, "step"), loss))
        signals: list[Signal] = []
        bad = [(step, loss) for step, loss in points if not math.isfinite(loss)]
        if bad:
            signals.append(self._nan(bad, len(points), ctx))
        finite = [(step, loss) for step, loss in points if math.isfinite(loss)]
        spike = self._spike(finite, ctx)
        if spike is not None:
            signals.append(spike)
        trend = self._trend(finite, ctx)
        if trend is not None:
            signals.append(trend)
        return signals

    def _stop_hint(self, ctx: RunContext) -> str:
        where = (
            f"the last checkpoint (step {ctx.last_committed_step})"
            if ctx.last_committed_step is not None
            else "scratch (no checkpoint is committed yet)"
        )
        return (
            f"Stop it (`/train stop {ctx.run_id}`), lower the learning rate or clip gradients, "
            f"and resubmit from {where}."
        )

    def _nan(self, bad: list[tuple[int | None, float]], total: int, ctx: RunContext) -> Signal:
        step, loss = bad[0]
        return Verdict(self.name, "nan", Severity.CRITICAL, incident=INCIDENT).firing(
            f"Loss is {loss} in run {ctx.run_id} at step {step}",
            f"first non-finite loss {loss} at step {step}; "
            f"{len(bad)} of the last {total} losses are not finite",
            hint=f"The run is diverging and will not recover. {self._stop_hint(ctx)}",
            data={"step": step, "loss": str(loss), "non_finite": len(bad)},
            stop_after_s=0.0 if self.cfg.on_nan == "stop" else None,
            began_step=step,
        )

    def _spike(self, finite: list[tuple[int | None, float]], ctx: RunContext) -> Signal | None:
        m, factor = self.cfg.loss_spike_points, self.cfg.loss_spike_factor
        earlier, recent = finite[:-m], finite[-m:]
        if len(recent) < m or len(earlier) < max(3, m):
            return None  # too few points to tell a spike from the start of training
        baseline = statistics.median(loss for _, loss in earlier)
        if baseline <= 0:
            return None  # a ratio to a non-positive loss means nothing
        line = factor * baseline
        verdict = Verdict(self.name, "spike", Severity.CRITICAL, incident=INCIDENT)
        if not all(loss > line for _, loss in recent):
            return verdict.cleared(
                f"Loss of run {ctx.run_id} is back near its baseline",
                f"latest loss {fmt.loss(finite[-1][1])} vs baseline {fmt.loss(baseline)}",
            )
        values = ", ".join(fmt.loss(loss) for _, loss in recent)
        first_step, last_step = recent[0][0], recent[-1][0]
        peak = max(loss for _, loss in recent)
        return verdict.firing(
            f"Loss spiked to {peak / baseline:.1f}× its baseline in run {ctx.run_id}",
            (
                f"loss {values} at steps {first_step}–{last_step}, above {factor:g}× the "
                f"baseline {fmt.loss(baseline)} (median of {len(earlier)} earlier points) "
                f"for {m} points in a row"
            ),
            hint=f"It may be diverging. {self._stop_hint(ctx)}",
            data={"step": last_step, "baseline": baseline, "losses": [x for _, x in recent]},
            stop_after_s=self.cfg.stop_after,
            began_step=first_step,
        )

    def _trend(self, finite: list[tuple[int | None, float]], ctx: RunContext) -> Signal | None:
        n = self.cfg.trend_points
        if len(finite) < n:
            return None
        last = finite[-n:]
        losses = [loss for _, loss in last]
        per_point = slope([float(i) for i in range(n)], losses)
        low = min(losses)
        rising = per_point > 0 and low > 0 and losses[-1] > _TREND_RATIO * low
        verdict = Verdict(self.name, "trend", Severity.WARNING, incident=INCIDENT)
        if not rising:
            return verdict.cleared(
                f"Loss of run {ctx.run_id} is no longer rising",
                f"latest loss {fmt.loss(losses[-1])}, window minimum {fmt.loss(low)}",
            )
        return verdict.firing(
            f"Loss keeps rising in run {ctx.run_id}",
            (
                f"loss rose to {fmt.loss(losses[-1])} at step {last[-1][0]}, "
                f"{losses[-1] / low:.1f}× the minimum {fmt.loss(low)} of the last {n} points "
                f"(steps {last[0][0]}–{last[-1][0]}); slope +{per_point:.3g} per point"
            ),
            hint=(
                "Check the learning-rate schedule and the data order. If it keeps rising: "
                + self._stop_hint(ctx)
            ),
            data={"step": last[-1][0], "loss": losses[-1], "min": low, "slope": per_point},
            stop_after_s=self.cfg.stop_after,
            # The rise began where the window's loss was lowest.
            began_step=last[losses.index(low)][0],
        )

"""Thresholds on reported metrics, from the spec (``alerts.thresholds``).

``{metric: val_loss, above: 2.5, for: 5m, severity: warning}`` alerts once ``val_loss``
has been above 2.5 in every point for five minutes, and resolves at the first point back
on the right side. The metric is any figure of a ``metrics`` event: ``loss``,
``step_time_s``, ``data_wait_fraction``, or a name the script logs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from jobs.domain import format as fmt
from jobs.rules.base import (
    Obs,
    RunContext,
    Severity,
    Signal,
    Thresholded,
    Trigger,
    Verdict,
    number,
    of_type,
)
from jobs.spec.sections import MetricThreshold

__all__ = ["MetricThresholds", "metric_value"]


def metric_value(data: Mapping[str, Any], name: str) -> float | None:
    """A metrics event's figure by name: its own fields first, then the script's."""
    if name in data and name != "metrics":
        return number(data, name)
    logged = data.get("metrics")
    return number(logged, name) if isinstance(logged, Mapping) else None


class MetricThresholds(Thresholded):
    """Each of the spec's thresholds: a metric past its line for a while."""

    name = "metric_threshold"
    trigger = Trigger.STREAM

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        if not self.cfg.thresholds:
            return []
        metrics = of_type(window, "metrics")
        signals: list[Signal] = []
        for threshold in self.cfg.thresholds:
            signal = self._judge(threshold, metrics, now=now, ctx=ctx)
            if signal is not None:
                signals.append(signal)
        return signals

    def _judge(
        self, rule: MetricThreshold, metrics: list[Obs], *, now: float, ctx: RunContext
    ) -> Signal | None:
        points = [
            (obs.time, value, obs.data.get("step"))
            for obs in metrics
            if (value := metric_value(obs.data, rule.metric)) is not None
        ]
        if not points:
            return None
        above = rule.above is not None
        line = rule.above if rule.above is not None else rule.below
        assert line is not None  # the section's validator: one of the two

        def past(value: float) -> bool:
            if math.isnan(value):
                return True  # a NaN is past any line: it is not getting better
            return value > line if above else value < line

        side = "above" if above else "below"
        verdict = Verdict(
            self.name,
            f"{rule.metric}:{side}:{line:g}",
            Severity(rule.severity.upper()),
            {"metric": rule.metric, side: line},
        )
        newest_time, newest, newest_step = points[-1]
        if not past(newest):
            return verdict.cleared(
                f"{rule.metric} of run {ctx.run_id} is back {'below' if above else 'above'} "
                f"{line:g}",
                f"{rule.metric} {newest:.4g} at step {newest_step}",
            )
        began, began_step = newest_time, newest_step
        for time, value, step in reversed(points):
            if not past(value):
                break
            began, began_step = time, step
        held = now - began
        if held < rule.for_s:
            return None  # past the line, not for long enough yet: nothing to say
        for_text = f" for {fmt.duration(held)}" if rule.for_s > 0 else ""
        return verdict.firing(
            f"{rule.metric} of run {ctx.run_id} is {side} {line:g}{for_text}",
            (
                f"{rule.metric} {newest:.4g} at step {newest_step}; {side} {line:g} since "
                f"step {began_step} ({fmt.clock(began)})"
                + (f", longer than the {fmt.duration(rule.for_s)} allowed" if rule.for_s else "")
            ),
            hint=(
                f"A threshold of the run's spec (alerts.thresholds). Look at the run's "
                f"metrics; `/train stop {ctx.run_id}` if it will not recover."
            ),
            data={"metric": rule.metric, "value": newest, side: line, "held_s": held},
            began_step=began_step if isinstance(began_step, int) else None,
        )

"""Low utilisation: the accelerator idles, and the data-wait fraction says whether the
input pipeline is why; without a GPU, the data-wait fraction alone decides."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from jobs.domain import format as fmt
from jobs.rules import base

__all__ = ["LowUtilisation"]

# The samples of a time window must span this share of it, so one low reading, or a run
# that only just started reporting, never fires.
_COVERAGE = 0.8
# With a GPU, a data-wait share above this is worth naming as the cause of low utilisation.
_INPUT_BOUND = 0.25


class LowUtilisation(base.Thresholded):
    """The accelerator idles, and the data-wait fraction says whether the input is why.

    Low utilisation almost always means the input pipeline, and the fix (loader workers,
    prefetch, local staging) is cheap next to paying for an idle GPU. A run without a GPU
    (local, CPU) has no utilisation to report, so there the data-wait fraction decides.
    """

    name = "low_utilisation"
    trigger = base.Trigger.STREAM

    def evaluate(
        self, window: Sequence[base.Obs], *, now: float, ctx: base.RunContext
    ) -> list[base.Signal]:
        start = now - self.cfg.low_util_window_s
        metrics = [o for o in base.of_type(window, "metrics") if o.time >= start]
        # A multi-node run: one slow node's loader idles every node's GPUs, so each node
        # is judged on its own figures (a node after the first sends its data wait with
        # its system samples), and the alert says which node.
        return base.per_node(
            (o for o in base.of_type(window, "system") if o.time >= start),
            lambda node, system: self._node(system, metrics if node == 0 else system, ctx),
        )

    def _node(
        self, system: Sequence[base.Obs], metrics: Sequence[base.Obs], ctx: base.RunContext
    ) -> list[base.Signal]:
        """The verdict on one node's samples: GPU utilisation from ``system``, data wait
        from ``metrics``."""
        gpu = [(o.time, u) for o in system if (u := base.number(o.data, "gpu_util")) is not None]
        waits = [
            (o.time, min(max(w, 0.0), 1.0))
            for o in metrics
            if (w := base.number(o.data, "data_wait_fraction")) is not None
        ]
        wait = statistics.fmean(w for _, w in waits) if waits else None
        if gpu:
            return self._gpu(gpu, wait, ctx)
        return self._cpu(waits, wait, ctx)

    def _covered(self, times: Sequence[float]) -> bool:
        return len(times) >= 2 and times[-1] - times[0] >= _COVERAGE * self.cfg.low_util_window_s

    def _gpu(
        self, gpu: list[tuple[float, float]], wait: float | None, ctx: base.RunContext
    ) -> list[base.Signal]:
        if not self._covered([t for t, _ in gpu]):
            return []
        mean = statistics.fmean(u for _, u in gpu)
        threshold = self.cfg.low_util_percent
        span = fmt.duration(self.cfg.low_util_window_s)
        verdict = base.Verdict(
            self.name, "gpu", base.Severity.WARNING, {"gpu_util": mean, "data_wait_fraction": wait}
        )
        if mean >= threshold:
            return [
                verdict.cleared(
                    f"GPU utilisation of run {ctx.run_id} recovered to {mean:.0f}%",
                    f"mean GPU utilisation {mean:.0f}% over the last {span}",
                )
            ]
        if wait is None:
            why = "data-wait not reported"
            hint = (
                "Check the input pipeline first (loader workers, prefetch, local data), "
                "then the batch size and CPU work inside the step."
            )
        elif wait > _INPUT_BOUND:
            why = f"data-wait {wait:.0%} of step time"
            hint = _pipeline_hint(wait)
        else:
            why = f"data-wait only {wait:.0%} of step time"
            hint = (
                f"data-wait is only {wait:.0%}, so the input is not the cause: look at the "
                "batch size, CPU work inside the step, or communication; profile one step."
            )
        return [
            verdict.firing(
                f"GPU utilisation {mean:.0f}% on run {ctx.run_id} for the last {span}",
                f"mean GPU utilisation {mean:.0f}% over {len(gpu)} samples "
                f"(alert below {threshold:g}%); {why}",
                hint=hint,
            )
        ]

    def _cpu(
        self, waits: list[tuple[float, float]], wait: float | None, ctx: base.RunContext
    ) -> list[base.Signal]:
        if wait is None or not self._covered([t for t, _ in waits]):
            return []
        threshold = self.cfg.data_wait_fraction
        span = fmt.duration(self.cfg.low_util_window_s)
        verdict = base.Verdict(
            self.name,
            "data-wait",
            base.Severity.WARNING,
            {"gpu_util": None, "data_wait_fraction": wait},
        )
        if wait <= threshold:
            return [
                verdict.cleared(
                    f"Run {ctx.run_id} is no longer waiting on its input",
                    f"data-wait {wait:.0%} of step time over the last {span}",
                )
            ]
        return [
            verdict.firing(
                f"Run {ctx.run_id} spends {wait:.0%} of each step waiting for data",
                f"data-wait {wait:.0%} of step time, mean of {len(waits)} samples over the "
                f"last {span} (alert above {threshold:.0%}); no GPU utilisation reported",
                hint=_pipeline_hint(wait),
            )
        ]


def _pipeline_hint(wait: float) -> str:
    return (
        f"data-wait {wait:.0%} of step time: the input pipeline is the bottleneck — "
        "add loader workers, prefetch, or stage data locally."
    )

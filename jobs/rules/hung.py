"""A hung run: the runner's heartbeats go on, and the step stands still.

A collective waiting for a rank that died, a deadlock, a read that never returns: the
instance bills, the GPU may even look busy, and no event says anything is wrong. So the
rule is evaluated on every reconcile pass (:attr:`Trigger.PERIODIC`), not on the stream.
The step may stand still for :func:`runner.stacks.stall_limit_s` (the spec's
``alerts.hung``: a multiple of the run's own median step time, never less than a floor);
past that it alerts with the last step and the Python stacks the runner dumped
(:mod:`runner.stacks`), and, where the spec says so, asks for the run to be stopped when
nobody acknowledges the alert in time.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from itertools import pairwise

from jobs.domain import format as fmt
from jobs.rules.base import (
    Obs,
    RunContext,
    Severity,
    Signal,
    Thresholded,
    Trigger,
    Verdict,
    attempt_of,
    integer,
    number,
    of_type,
)
from runner.stacks import stall_limit_s

__all__ = ["STACKS_SHOWN", "Hung"]

#: A script without the session API whose metrics the runner reads from a framework's
#: files (``runner.frameworks``: the Trainer writes them at each save) reports steps in
#: bursts, one per save: its step may stand still this many save intervals before it is hung.
SAVE_INTERVALS = 1.5
#: Characters of the stacks the alert's message shows (a Slack section holds 3,000);
#: each process's innermost frames come first, and the whole dump is in the run's logs.
STACKS_SHOWN = 1800


def stacks_excerpt(text: str, limit: int = STACKS_SHOWN) -> str:
    """The dump's first ``limit`` characters, cut at a line, as a preformatted block (a
    fence in the text would end it early, so it cannot close the block)."""
    text = text.replace("```", "ˋˋˋ").strip("\n")
    if len(text) > limit:
        cut = text.rfind("\n", 0, limit)
        text = text[: cut if cut > 0 else limit] + "\n…"
    return f"```\n{text}\n```"


class Hung(Thresholded):
    """The step has not moved for much longer than the run's own step time."""

    name = "hung"
    trigger = Trigger.PERIODIC

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        metrics = [
            o for o in of_type(window, "metrics") if attempt_of(o, ctx) == ctx.attempt_number
        ]
        if not metrics:
            return []  # not training yet: the lost heartbeat and the dry run watch that
        last = metrics[-1]
        step = integer(last.data, "step")
        times = [t for t in (number(o.data, "step_time_s") for o in metrics) if t is not None]
        cfg = self.cfg.hung
        limit = stall_limit_s(times, factor=cfg.factor, floor_s=cfg.floor)
        bursts = self._save_interval(window, ctx, first=metrics[0].time)
        if bursts is not None:
            limit = max(limit, SAVE_INTERVALS * bursts)
        stalled = now - last.time
        verdict = Verdict(self.name, "step", Severity.CRITICAL, {"step": step, "limit_s": limit})
        if stalled <= limit:
            return [
                verdict.cleared(
                    f"Run {ctx.run_id} is making progress again",
                    f"step {step}, {fmt.duration(max(stalled, 0.0))} ago",
                )
            ]
        finite = [t for t in times if t > 0]
        median = statistics.median(finite) if finite else None
        typical = f"its median step time is {median:.3g} s, " if median is not None else ""
        detail = (
            f"step {step} at {fmt.clock(last.time)}, {fmt.duration(stalled)} ago, while its "
            f"runner still reports; {typical}so {fmt.duration(limit)} without a step is hung "
            f"(alerts.hung: {cfg.factor:g}× the median, at least {fmt.duration(cfg.floor)}); "
            f"attempt {ctx.attempt_number}"
        )
        dump = self._stacks(window, ctx, since=last.time)
        if dump is not None:
            detail += f"\nPython stacks the runner dumped, innermost frames first:\n{dump}"
        else:
            detail += (
                "\nNo stacks: the runner dumps them from Python processes it started "
                "(not under python -I, nor a process that is not Python)."
            )
        stop = (
            f" trainbot stops it after {fmt.duration(cfg.stop_after)} unacknowledged."
            if cfg.stop_after is not None
            else ""
        )
        return [
            verdict.firing(
                f"Run {ctx.run_id} looks hung: step {step} has not moved for "
                f"{fmt.duration(stalled)}",
                detail,
                hint=(
                    f"The whole dump is in `/train logs {ctx.run_id}`. A collective waiting "
                    f"for a dead rank or a deadlock will not recover: `/train stop "
                    f"{ctx.run_id}` and resubmit from the last checkpoint "
                    f"(step {ctx.last_committed_step}).{stop}"
                ),
                data={"step": step, "stalled_s": stalled, "limit_s": limit},
                stop_after_s=cfg.stop_after,
                began_step=step,
            )
        ]

    @staticmethod
    def _save_interval(window: Sequence[Obs], ctx: RunContext, *, first: float) -> float | None:
        """The median interval between this attempt's saves when its checkpoints are
        files the runner synced (no ``stall_s``: not the session's) and its steps come in
        bursts with them; None for a session's checkpoints. The first interval runs from
        its first step."""
        saves = [
            o.time
            for o in of_type(window, "checkpoint_committed")
            if attempt_of(o, ctx) == ctx.attempt_number and o.data.get("stall_s") is None
        ]
        if not saves:
            return None
        marks = [first, *sorted(saves)]
        gaps = [b - a for a, b in pairwise(marks) if b > a]
        return statistics.median(gaps) if gaps else None

    @staticmethod
    def _stacks(window: Sequence[Obs], ctx: RunContext, *, since: float) -> str | None:
        """The newest dump of this attempt taken after its last step, as a block."""
        for obs in reversed(of_type(window, "stacks")):
            if attempt_of(obs, ctx) == ctx.attempt_number and obs.time >= since:
                text = obs.data.get("text")
                return stacks_excerpt(text) if isinstance(text, str) and text else None
        return None

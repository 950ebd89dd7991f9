"""Lost heartbeat: the runner has gone quiet past its deadline."""

from __future__ import annotations

from collections.abc import Sequence

from jobs.domain import format as fmt
from jobs.rules.base import Obs, RunContext, Severity, Signal, Thresholded, Trigger, Verdict

__all__ = ["LostHeartbeat"]


class LostHeartbeat(Thresholded):
    """The runner has gone quiet: the instance may be gone, hung, or still billing."""

    name = "lost_heartbeat"
    trigger = Trigger.SILENT

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        if ctx.last_heartbeat is None:
            return []  # not started yet; the reconcile job watches provisioning
        silent = now - ctx.last_heartbeat
        deadline = self.cfg.heartbeat_deadline_s
        data = {"silent_s": silent, "last_heartbeat": ctx.last_heartbeat}
        verdict = Verdict(self.name, "heartbeat", Severity.CRITICAL, data)
        if silent <= deadline:
            return [
                verdict.cleared(
                    f"Run {ctx.run_id} is reporting again",
                    f"last heartbeat {fmt.duration(max(silent, 0.0))} ago",
                )
            ]
        return [
            verdict.firing(
                f"No heartbeat from run {ctx.run_id} for {fmt.duration(silent)}",
                (
                    f"last heartbeat at {fmt.clock(ctx.last_heartbeat)}, "
                    f"{fmt.duration(silent)} ago "
                    f"(deadline {fmt.duration(deadline)}); attempt {ctx.attempt_number}"
                ),
                hint=(
                    f"The instance may be gone or hung and still billing: check "
                    f"`/train logs {ctx.run_id}`, then `/train resubmit {ctx.run_id}` or "
                    f"`/train stop {ctx.run_id}`."
                ),
            )
        ]

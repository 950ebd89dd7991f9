"""Alerts the training script raises itself (``session.alert``, as ``wandb.alert``).

Each arrives once, as an ``alert`` event (:class:`runner.wire.schema.AlertData`), and
becomes an alert of the run like the built-in ones: one per title (a repeat updates it),
acknowledged with its button, escalated when critical and unacknowledged. It never
resolves by itself: the script said something is wrong, and a person says it is dealt with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from jobs.rules.base import (
    Obs,
    RunContext,
    Severity,
    Signal,
    Thresholded,
    Trigger,
    Verdict,
    of_type,
)

__all__ = ["ScriptAlert"]


class ScriptAlert(Thresholded):
    """The script's own alerts, one per title."""

    name = "script_alert"
    trigger = Trigger.SCRIPT

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        signals = []
        for obs in of_type(window, "alert"):
            title = str(obs.data.get("title") or "").strip()
            if not title:
                continue
            try:
                severity = Severity(str(obs.data.get("severity", "warning")).upper())
            except ValueError:
                severity = Severity.WARNING
            step = obs.data.get("step")
            # The title names the alert; a digest keeps the key short whatever its length.
            key = hashlib.sha256(title.encode()).hexdigest()[:16]
            verdict = Verdict(self.name, key, severity, {"title": title, "step": step})
            at = f" at step {step}" if isinstance(step, int) else ""
            signals.append(
                verdict.firing(
                    f"{title} (run {ctx.run_id}{at})",
                    str(obs.data.get("text") or ""),
                    hint=(
                        "Raised by the training script (session.alert). Acknowledge it once "
                        f"someone looks; `/train stop {ctx.run_id}` if the run should not go on."
                    ),
                    began_step=step if isinstance(step, int) else None,
                )
            )
        return signals

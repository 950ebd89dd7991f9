"""``session.alert``: an alert raised by the training code itself, as ``wandb.alert``.

It travels as an ``alert`` event (:class:`runner.wire.schema.AlertData`) and becomes an
alert of the run like the built-in ones: posted in its thread, deduplicated by title,
acknowledged, escalated when critical and unacknowledged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, get_args

from runner.errors import RunnerError
from runner.wire.schema import ALERT_TEXT_MAX, ALERT_TITLE_MAX, AlertSeverity

__all__ = ["DEFAULT_WAIT_S", "SEVERITIES", "AlertGate", "alert_payload"]

#: A repeat of a title within this many seconds is not sent (``wait_s``, as
#: ``wandb.alert``'s ``wait_duration``): a loop that alerts every step sends one.
DEFAULT_WAIT_S = 60.0

SEVERITIES = frozenset(get_args(AlertSeverity))
#: wandb's levels (``wandb.AlertLevel``), so a script moving over keeps its calls.
_ALIASES = {"warn": "warning", "error": "critical"}


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def alert_payload(
    title: object, text: object, severity: object, *, step: int | None
) -> dict[str, Any]:
    """The event's payload: the title on one line, both clipped to the wire's bounds.
    A severity that is not one of :data:`SEVERITIES` (or wandb's names) is the caller's
    mistake, said at once rather than dropped on the way."""
    level = str(getattr(severity, "value", severity)).strip().lower()
    level = _ALIASES.get(level, level)
    if level not in SEVERITIES:
        raise RunnerError(
            f"session.alert: severity must be one of {', '.join(sorted(SEVERITIES))} "
            f"(got {severity!r})"
        )
    line = " ".join(str(title).split())
    if not line:
        raise RunnerError("session.alert: give the alert a title (one line saying what is wrong)")
    return {
        "title": _clip(line, ALERT_TITLE_MAX),
        "text": _clip(str(text), ALERT_TEXT_MAX),
        "severity": level,
        "step": step if step and step > 0 else None,
    }


class AlertGate:
    """Which of a script's alerts to send: a title's repeat only after its wait."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._sent: dict[str, float] = {}

    def admit(self, title: str, *, wait_s: float) -> bool:
        """Whether to send an alert with this title now (and count it sent)."""
        now = self._clock()
        last = self._sent.get(title)
        if last is not None and now - last < wait_s:
            return False
        self._sent[title] = now
        return True

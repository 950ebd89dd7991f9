"""Durations as people write them: ``90s``, ``10m``, ``2h``, ``1d``, ``1h30m``, ``1.5h``.

The one parser for the runner's command line, the job spec and the chat commands (the
runner never imports the control plane, so it lives here). Each caller adds its own
bounds and words its own error; this one raises ``ValueError``.
"""

from __future__ import annotations

import math
import re

__all__ = ["DURATION_HINT", "parse_duration"]

#: What a duration looks like, for error messages.
DURATION_HINT = "expected a duration such as 90s, 10m, 2h, 1d or a number of seconds"

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER = r"[0-9]+(?:\.[0-9]+)?"
# ASCII only: ``\d`` would take other scripts' digits, which nobody means as a duration.
_PLAIN = re.compile(_NUMBER, re.ASCII)
_WITH_UNITS = re.compile(rf"(?:{_NUMBER}[smhd])+", re.ASCII)
_PART = re.compile(rf"({_NUMBER})([smhd])", re.ASCII)
# The most of someone's input an error message quotes.
_QUOTED_CHARS = 40


def parse_duration(value: object, *, unit_required: bool = False) -> float:
    """Seconds in ``value``: a string of number-unit parts, or plain seconds.

    Numbers (not booleans) are seconds. Case and spaces do not matter. With
    ``unit_required`` a bare number is refused (in chat, ``30`` could mean minutes).
    Raises ``ValueError`` for anything else, and for a negative or non-finite time.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{DURATION_HINT} (got {_quoted(value)})")
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if _WITH_UNITS.fullmatch(text):
            seconds = sum(float(n) * _UNITS[unit] for n, unit in _PART.findall(text))
        elif _PLAIN.fullmatch(text) and not unit_required:
            seconds = float(text)
        else:
            raise ValueError(f"{DURATION_HINT} (got {_quoted(value)})")
    else:
        try:
            seconds = float(value)
        except OverflowError:  # an int past the float range
            seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a duration must be a finite, non-negative time (got {_quoted(value)})")
    return seconds


def _quoted(value: object) -> str:
    """Someone's input for an error message, cut short: it may be any size."""
    if isinstance(value, str):
        if len(value) <= _QUOTED_CHARS:
            return repr(value)
        return f"{value[:_QUOTED_CHARS]!r}… ({len(value)} characters)"
    if isinstance(value, float) or (isinstance(value, int) and abs(value) < 10**20):
        return repr(value)
    return f"<{type(value).__name__}>"

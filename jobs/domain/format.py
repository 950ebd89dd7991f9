"""Figures as people read them: money, shares, durations, sizes, clock times, losses.

One place, so an alert, a preflight report and a chat reply write the same figure the
same way. ``None`` is written ``n/a``: a figure that is not known yet is not an error.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone

__all__ = ["clock", "duration", "loss", "percent", "size", "usd"]

_NA = "n/a"


def usd(value: float | None) -> str:
    """``$1,234.50``; below a cent, four decimals, so a cheap hour does not read ``$0.00``."""
    if value is None:
        return _NA
    return f"${value:,.2f}" if value >= 0.01 or value == 0 else f"${value:.4f}"


def percent(fraction: float | None) -> str:
    """A fraction as a percentage with one decimal: ``0.954`` is ``95.4%``."""
    return _NA if fraction is None else f"{100 * fraction:.1f}%"


def duration(seconds: float | None) -> str:
    """``250 ms``, ``45 s``, ``12 min``, ``3.5 h``, ``2.1 days``: the unit people think in."""
    if seconds is None:
        return _NA
    if 0 < seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def size(n_bytes: float | None) -> str:
    """Bytes in decimal units, as disks and object stores count them: ``1.5 GB``."""
    if n_bytes is None:
        return _NA
    value = float(n_bytes)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def clock(value: datetime | float | None) -> str:
    """The time of day in UTC, ``14:05 UTC``, from a datetime or unix seconds."""
    if value is None:
        return _NA
    if not isinstance(value, datetime):
        value = datetime.fromtimestamp(value, tz=timezone.utc)
    elif value.tzinfo is not None:
        value = value.astimezone(timezone.utc)
    return value.strftime("%H:%M UTC")


def loss(value: float | None) -> str:
    """A loss to four significant figures; ``NaN`` as the runner reports it."""
    if value is None:
        return _NA
    return "NaN" if math.isnan(value) else f"{value:.4g}"

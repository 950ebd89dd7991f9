"""What keeping staged copies costs, for the digest's storage line.

Kept apart from the rest of :mod:`jobs.staging` (no service dependencies), since the
spend digest imports it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlmodel import Session, col, or_, select

from jobs.spend.storage import MONTH_S, monthly_usd, storage_price
from jobs.staging.models import Staging

__all__ = ["staged_figures"]


def staged_figures(
    session: Session, *, channel: str | None, since: datetime, until: datetime
) -> dict[str, Any]:
    """Staged copies of the channel (every channel when None) in ``[since, until)``:
    what keeping them cost in the window (prorated), what is kept at ``until`` and what
    it costs a month, priced as the store's storage (``jobs.spend.storage``)."""
    query = select(Staging).where(
        col(Staging.finished_at).is_not(None),
        col(Staging.finished_at) < until,
        or_(col(Staging.deleted_at).is_(None), col(Staging.deleted_at) > since),
    )
    if channel is not None:
        query = query.where(Staging.channel == channel)
    usd = per_month = 0.0
    kept = copies = 0
    for row in session.exec(query).all():
        assert row.finished_at is not None
        price = storage_price(row.target, row.region)
        start, end = max(row.finished_at, since), min(row.deleted_at or until, until)
        inside = max(0.0, (end - start).total_seconds())
        usd += monthly_usd(row.bytes_done, price) * inside / MONTH_S
        if row.deleted_at is None or row.deleted_at > until:
            kept += row.bytes_done
            per_month += monthly_usd(row.bytes_done, price)
            copies += 1
    return {
        "usd": round(usd, 4),
        "bytes_kept": kept,
        "usd_per_month": round(per_month, 4),
        "copies": copies,
    }

"""What keeping checkpoints costs: the bytes each run keeps × its store's price per GB-month.

The bytes are the control plane's own records: each committed checkpoint's size (from its
``checkpoint_committed`` event, the manifest's total), kept from ``committed_at`` until
retention deletes it (``deleted_at``). The price comes from the shipped, dated table
``jobs/providers/data/storage_prices.json`` (S3 Standard and Cloud Storage Standard by
region; the local store costs nothing), like the instance price tables. The store is
read from the checkpoint's URI (``s3://``, ``gs://``, a local path); its region is the
region the run's attempts ran in, where preflight's data check keeps the store, else the
spec's first region, else the table's fallback region for that store (the figures say so).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import or_
from sqlmodel import Session, col, select

from jobs.database.models import Attempt, Checkpoint, Run
from jobs.domain.errors import TrainbotError
from jobs.providers.data import read_table
from jobs.spec import Resources, stored_section
from runner.store import store_kind as runner_store_kind

__all__ = [
    "BILLED_GB",
    "MONTH_S",
    "PRICES_PATH",
    "UNKNOWN_STORE",
    "StoragePrice",
    "monthly_usd",
    "run_storage_price",
    "storage_figures",
    "storage_price",
    "store_kind",
]

#: The shipped storage price table.
PRICES_PATH = Path(__file__).resolve().parents[1] / "providers" / "data" / "storage_prices.json"
#: The kind of a checkpoint URI no store opens: not priced (and said so).
UNKNOWN_STORE = "unknown"
#: A billed gigabyte: AWS and Google Cloud count storage in 2^30 bytes.
BILLED_GB = 2**30
#: A billing month: 730 hours, as both clouds spread a GB-month.
MONTH_S = 730 * 3600.0


@dataclass(frozen=True)
class StoragePrice:
    """One store's price per GB-month, and where the figure comes from."""

    #: "s3", "gcs" or "local" (:data:`runner.store.STORE_KINDS`), or "unknown".
    store: str
    #: The region priced (the fallback region's when the table lacks the store's).
    region: str
    usd_per_gb_month: float
    #: "S3 Standard, us-east-1, 2024-06-01"; says when a fallback region was used.
    source: str


def store_kind(uri: str) -> str:
    """Which store a checkpoint URI is in, as the store registry names it
    (:data:`runner.store.STORE_KINDS`: ``s3``, ``gcs``, ``local`` for a path), or
    ``unknown`` for a scheme no store opens."""
    return runner_store_kind(uri) or UNKNOWN_STORE


def _load(path: Path) -> dict[str, Any]:
    try:
        return read_table(path, key="stores")
    except ValueError as exc:
        raise TrainbotError(f"the storage price table {path} {exc}: reinstall trainbot") from None


def storage_price(uri: str, region: str | None, *, path: Path = PRICES_PATH) -> StoragePrice:
    """The price per GB-month of keeping data at ``uri`` in ``region``."""
    kind = store_kind(uri)
    if kind == UNKNOWN_STORE:  # never priced as another store: said, at nothing
        scheme = uri.partition(":")[0]
        return StoragePrice(
            store=kind,
            region=region or "",
            usd_per_gb_month=0.0,
            source=f"not priced: no store opens {scheme}:// URIs",
        )
    entry = _load(path)["stores"].get(kind)
    if not isinstance(entry, dict):
        raise TrainbotError(f"the storage price table {path} has no {kind} store: reinstall it")
    regions: dict[str, Any] = entry.get("regions") or {}
    fallback = str(entry.get("fallback_region"))
    wanted = (region or "").lower()
    if kind == "local":
        wanted = fallback  # a directory on this machine: one price, whatever the region
    priced = wanted if wanted in regions else fallback
    source = f"{entry.get('class', kind)}, {priced}, {entry.get('as_of')}"
    if priced != wanted:
        source += f" ({region or 'the region is unknown'}: {fallback}'s price)"
    return StoragePrice(
        store=kind, region=priced, usd_per_gb_month=float(regions[priced]), source=source
    )


def monthly_usd(n_bytes: float, price: StoragePrice) -> float:
    """What keeping ``n_bytes`` costs a month at ``price``."""
    return n_bytes / BILLED_GB * price.usd_per_gb_month


def _regions(session: Session, runs: Iterable[Run]) -> dict[str, str | None]:
    """Each run's store region: its newest attempt's region, else its spec's first."""
    runs = list(runs)
    found: dict[str, str | None] = {}
    ids = [r.id for r in runs]
    if ids:
        rows = session.exec(
            select(Attempt.run_id, Attempt.region)
            .where(col(Attempt.run_id).in_(ids), col(Attempt.region).is_not(None))
            .order_by(col(Attempt.number))
        ).all()
        for run_id, region in rows:
            found[run_id] = region  # the newest attempt's wins
    for run in runs:
        if found.get(run.id) is None:
            regions = stored_section(run.spec, Resources, run_id=run.id).regions
            found[run.id] = regions[0] if regions else None
    return found


def run_storage_price(session: Session, run: Run, uri: str) -> StoragePrice:
    """The price of the run's checkpoint store at ``uri`` (see the module's notes)."""
    return storage_price(uri, _regions(session, [run])[run.id])


def storage_figures(
    session: Session,
    *,
    channel: str | None,
    since: datetime,
    until: datetime,
    run_ids: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Storage of the channel's runs (every run when ``channel`` is None; of ``run_ids``
    when given) in ``[since, until)``.

    ``usd`` is what keeping the checkpoints cost inside the window (each prorated by the
    part of its life inside); ``bytes_kept`` and ``usd_per_month`` are what is kept at
    ``until`` and what it costs a month from then. ``per_run`` lists the runs that kept
    anything in the window, the most expensive first.
    """
    query = (
        select(Checkpoint, Run)
        .join(Run, col(Run.id) == Checkpoint.run_id)
        .where(
            col(Checkpoint.committed_at) < until,
            or_(col(Checkpoint.deleted_at).is_(None), col(Checkpoint.deleted_at) > since),
        )
        .order_by(col(Checkpoint.run_id), col(Checkpoint.step))
    )
    if channel is not None:
        query = query.where(Run.channel == channel)
    if run_ids is not None:
        query = query.where(col(Run.id).in_(list(run_ids)))
    rows = session.exec(query).all()
    runs = {run.id: run for _, run in rows}
    regions = _regions(session, runs.values())
    per_run: dict[str, dict[str, Any]] = {}
    window_usd: dict[str, float] = defaultdict(float)
    kept: dict[str, int] = defaultdict(int)
    monthly: dict[str, float] = defaultdict(float)
    for ckpt, run in rows:
        price = storage_price(ckpt.uri, regions[run.id])
        start = max(ckpt.committed_at, since)
        end = min(ckpt.deleted_at or until, until)
        inside = max(0.0, (end - start).total_seconds())
        window_usd[run.id] += monthly_usd(ckpt.bytes, price) * inside / MONTH_S
        alive = ckpt.deleted_at is None or ckpt.deleted_at > until
        if alive:
            kept[run.id] += ckpt.bytes
            monthly[run.id] += monthly_usd(ckpt.bytes, price)
        row = per_run.setdefault(
            run.id,
            {
                "run_id": run.id,
                "store": price.store,
                "region": price.region,
                "usd_per_gb_month": price.usd_per_gb_month,
                "price_source": price.source,
            },
        )
        row["bytes_kept"] = kept[run.id]
        row["usd_per_month"] = round(monthly[run.id], 4)
        row["usd"] = round(window_usd[run.id], 4)
    ordered = sorted(per_run.values(), key=lambda r: (-r["usd"], -r["bytes_kept"], r["run_id"]))
    return {
        "usd": round(sum(window_usd.values()), 4),
        "bytes_kept": sum(kept.values()),
        "usd_per_month": round(sum(monthly.values()), 4),
        "per_run": ordered,
    }

"""What a staging copy costs and how long it takes, before it starts.

The prices are the shipped, dated table ``jobs/providers/data/transfer_prices.json``
(inter-region transfer per GB, by store and source region, same continent or another),
kept the way the storage and instance price tables are. The time is the table's assumed
rate for one sequential server-side copy; the progress message later says the real one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.domain.errors import TrainbotError
from jobs.providers.data import read_table
from jobs.spend.storage import BILLED_GB, store_kind

__all__ = ["PRICES_PATH", "TransferEstimate", "continent", "estimate"]

PRICES_PATH = Path(__file__).resolve().parents[1] / "providers" / "data" / "transfer_prices.json"

#: Region name prefixes (AWS and Google Cloud) and the continent each is on.
_CONTINENTS = (
    ("northamerica-", "north-america"),
    ("southamerica-", "south-america"),
    ("us-", "north-america"),
    ("ca-", "north-america"),
    ("sa-", "south-america"),
    ("eu-", "europe"),
    ("europe-", "europe"),
    ("me-", "middle-east"),
    ("af-", "africa"),
    ("ap-", "asia-pacific"),
    ("asia-", "asia-pacific"),
    ("australia-", "asia-pacific"),
)


def continent(region: str) -> str | None:
    """The continent a region is on, from its name; None when the name says nothing."""
    name = region.lower()
    for prefix, where in _CONTINENTS:
        if name.startswith(prefix):
            return where
    return None


@dataclass(frozen=True)
class TransferEstimate:
    """What copying a dataset between two regions costs, and takes, before it starts."""

    n_bytes: int
    usd: float
    usd_per_gb: float
    seconds: float
    #: "AWS S3 pricing page, …, 2024-06-01: us-east-1 to us-west-2, same continent".
    source: str


def _load() -> dict[str, Any]:
    try:
        return read_table(PRICES_PATH, key="stores")
    except ValueError as exc:
        raise TrainbotError(
            f"the transfer price table {PRICES_PATH} {exc}: reinstall trainbot"
        ) from None


def estimate(uri: str, *, n_bytes: int, source_region: str, target_region: str) -> TransferEstimate:
    """The cost and time of copying ``n_bytes`` at ``uri`` from ``source_region`` to
    ``target_region``."""
    kind = store_kind(uri)
    entry = _load()["stores"].get(kind)
    if not isinstance(entry, dict):
        raise TrainbotError(f"{uri}: staging copies only s3:// and gs:// data (not {kind})")
    same = continent(source_region) == continent(target_region) is not None
    leg = "same_continent" if same else "other_continent"
    priced = (entry.get("regions") or {}).get(source_region.lower()) or entry
    per_gb = 0.0 if source_region == target_region else float(priced[leg])
    rate = float(entry.get("rate_mb_s") or 100) * 2**20
    where = "the same continent" if same else "another continent"
    return TransferEstimate(
        n_bytes=n_bytes,
        usd=n_bytes / BILLED_GB * per_gb,
        usd_per_gb=per_gb,
        seconds=n_bytes / rate,
        source=f"{entry['source']}, {entry['as_of']}: {source_region} to {target_region}, {where}",
    )

"""The price-refresh tool: on-demand Linux prices from the Price List API into the table.

Run by a person, ``python -m jobs.providers.aws refresh-prices [--region R …]``; it needs
``pricing:GetProducts`` (any account). Tests never call it against AWS.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from datetime import date
from pathlib import Path
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from jobs.providers.aws.catalog import ACCELERATOR_TYPES, PRICES_PATH, load_prices
from jobs.providers.aws.clients import utcnow

__all__ = ["main", "refresh_prices"]

log = logging.getLogger(__name__)


def _hourly_usd(product: Mapping[str, Any]) -> float | None:
    """The on-demand hourly USD price in one Price List product document."""
    for term in (product.get("terms") or {}).get("OnDemand", {}).values():
        for dimension in (term.get("priceDimensions") or {}).values():
            usd = (dimension.get("pricePerUnit") or {}).get("USD")
            if dimension.get("unit") == "Hrs" and usd is not None and float(usd) > 0:
                return float(usd)
    return None


def refresh_prices(
    *,
    regions: Sequence[str],
    instance_types: Sequence[str] | None = None,
    path: str | os.PathLike[str] = PRICES_PATH,
    session: boto3.session.Session | None = None,
    client: Any = None,
    today: date | None = None,
) -> dict[str, Any]:
    """Fetch on-demand Linux prices from the Price List API into the table, dated today.

    Needs ``pricing:GetProducts`` (any account). Regions not asked for keep their old,
    dated entries. Types default to those already in the table and the accelerator map.
    """
    target = Path(path)
    try:
        table: dict[str, Any] = json.loads(target.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        table = {}
    table.setdefault("regions", {})
    pricing = client or (session or boto3.session.Session()).client(
        "pricing", region_name="us-east-1"
    )
    stamp = (today or utcnow().date()).isoformat()
    for region in regions:
        old = (table["regions"].get(region) or {}).get("prices", {})
        types = sorted(set(instance_types or [*old, *ACCELERATOR_TYPES.values()]))
        prices: dict[str, float] = {}
        for itype in types:
            filters = [
                {"Type": "TERM_MATCH", "Field": field, "Value": value}
                for field, value in (
                    ("instanceType", itype),
                    ("regionCode", region),
                    ("operatingSystem", "Linux"),
                    ("tenancy", "Shared"),
                    ("preInstalledSw", "NA"),
                    ("capacitystatus", "Used"),
                )
            ]
            pages = pricing.get_paginator("get_products").paginate(
                ServiceCode="AmazonEC2", Filters=filters
            )
            for page in pages:
                for raw in page.get("PriceList", []):
                    usd = _hourly_usd(json.loads(raw) if isinstance(raw, str) else raw)
                    if usd is not None:
                        prices[itype] = usd
                        break
                if itype in prices:
                    break
            if itype not in prices:
                log.warning("no on-demand price for %s in %s", itype, region)
        table["regions"][region] = {
            "as_of": stamp,
            "source": "AWS Price List API, Linux, shared tenancy",
            "prices": dict(sorted(prices.items())),
        }
    table["refresh"] = "python -m jobs.providers.aws refresh-prices --region REGION"
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, target)
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jobs.providers.aws refresh-prices [--region R …] [--type T …]``."""
    parser = argparse.ArgumentParser(prog="python -m jobs.providers.aws")
    sub = parser.add_subparsers(dest="cmd", required=True)
    refresh = sub.add_parser("refresh-prices", help="refresh the shipped on-demand price table")
    refresh.add_argument("--region", action="append", dest="regions")
    refresh.add_argument("--type", action="append", dest="types")
    refresh.add_argument("--output", default=str(PRICES_PATH))
    args = parser.parse_args(argv)
    regions = args.regions or sorted(load_prices(Path(args.output))["regions"])
    try:
        table = refresh_prices(regions=regions, instance_types=args.types, path=args.output)
    except (BotoCoreError, ClientError) as exc:
        print(f"refresh-prices failed: {exc}", file=sys.stderr)
        return 1
    for region in regions:
        count = len(table["regions"][region]["prices"])
        print(f"{region}: {count} prices as of {table['regions'][region]['as_of']}")
    return 0

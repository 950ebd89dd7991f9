"""The price-refresh tool: rebuild the shipped price table from the Cloud Billing Catalog.

Run as ``python -m jobs.providers.gcp refresh-prices --regions us-central1,…``; never run
by tests, which check :func:`prices_from_catalog` on sample SKUs instead.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from datetime import date
from pathlib import Path
from typing import Any

from google.auth import exceptions as auth_exceptions

from jobs.providers.base import ProviderError
from jobs.providers.gcp.api import CLOUD_PLATFORM
from jobs.providers.gcp.catalog import PRICES_PATH, load_prices

__all__ = ["main", "prices_from_catalog", "refresh_prices"]

_COMPUTE_SERVICE = "services/6F81-5844-456A"  # Compute Engine in the Cloud Billing Catalog
_SKU_MACHINE = re.compile(
    r"^(?:Spot Preemptible )?(?P<family>[A-Z][A-Z0-9]+) (?:Predefined )?Instance "
    r"(?P<kind>Core|Ram) running in"
)
# Accelerator type → the start of its GPU SKUs' descriptions.
_SKU_GPU = {
    "nvidia-tesla-a100": "Nvidia Tesla A100 GPU",
    "nvidia-a100-80gb": "Nvidia A100 80GB GPU",
    "nvidia-h100-80gb": "Nvidia H100 80GB GPU",
    "nvidia-l4": "Nvidia L4 GPU",
    "nvidia-tesla-t4": "Nvidia Tesla T4 GPU",
    "nvidia-tesla-v100": "Nvidia Tesla V100 GPU",
    "nvidia-tesla-p100": "Nvidia Tesla P100 GPU",
    "nvidia-tesla-p4": "Nvidia Tesla P4 GPU",
}
_SKU_SKIP = ("Commitment", "Custom", "Sole Tenancy", "Workstation", "Reserved", "DWS", "Calendar")


def _unit_price(sku: Mapping[str, Any]) -> float | None:
    try:
        rates = sku["pricingInfo"][0]["pricingExpression"]["tieredRates"]
        money = rates[-1]["unitPrice"]
        return round(int(money.get("units") or 0) + int(money.get("nanos") or 0) / 1e9, 9)
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def prices_from_catalog(
    skus: Iterable[Mapping[str, Any]], *, regions: Sequence[str]
) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """Unit prices per region from Cloud Billing Catalog SKUs of Compute Engine.

    Returns ``{region: {"vcpu"|"ram_gb": {FAMILY: {...}}, "gpu": {type: {...}}}}`` with
    ``on_demand`` and ``spot`` per entry: the shape of the shipped table's ``regions``.
    """
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {
        r: {"vcpu": {}, "ram_gb": {}, "gpu": {}} for r in regions
    }
    for sku in skus:
        category = sku.get("category") or {}
        usage = {"OnDemand": "on_demand", "Preemptible": "spot"}.get(str(category.get("usageType")))
        description = str(sku.get("description", ""))
        price = _unit_price(sku)
        if usage is None or price is None or any(s in description for s in _SKU_SKIP):
            continue
        where = [r for r in sku.get("serviceRegions") or [] if r in out]
        entry: tuple[str, str] | None = None
        if category.get("resourceGroup") == "GPU":
            for name, prefix in _SKU_GPU.items():
                bare = description.removeprefix("Spot Preemptible ")
                if bare.startswith(prefix + " ") or bare.startswith(prefix + "s "):
                    entry = ("gpu", name)
        elif m := _SKU_MACHINE.match(description):
            entry = ("vcpu" if m.group("kind") == "Core" else "ram_gb", m.group("family"))
        if entry is None:
            continue
        for region in where:
            out[region][entry[0]].setdefault(entry[1], {})[usage] = price
    for tables in out.values():
        for table in tables.values():
            for key in [k for k, v in table.items() if set(v) != {"on_demand", "spot"}]:
                del table[key]
    return out


def _dump_prices(doc: Mapping[str, Any]) -> str:
    """The table as JSON with one line per leaf entry, so refreshes diff readably."""
    leaf = re.compile(r"\{\n\s+([^{}\[\]]*?)\n\s+\}", re.S)
    text = json.dumps(doc, indent=1)
    return leaf.sub(lambda m: "{" + re.sub(r",\n\s+", ", ", m.group(1)) + "}", text) + "\n"


def _fetch_skus(session: Any) -> Iterable[Mapping[str, Any]]:
    url = f"https://cloudbilling.googleapis.com/v1/{_COMPUTE_SERVICE}/skus"
    token = ""
    while True:
        params = {"currencyCode": "USD", "pageSize": "5000"}
        if token:
            params["pageToken"] = token
        response = session.get(url, params=params, timeout=120)
        response.raise_for_status()
        page = response.json()
        yield from page.get("skus", [])
        token = page.get("nextPageToken", "")
        if not token:
            return


def refresh_prices(
    *, regions: Sequence[str], path: Path = PRICES_PATH, session: Any = None
) -> None:
    """Rewrite the price table from the Cloud Billing Catalog, keeping its machine shapes."""
    if session is None:
        import google.auth
        from google.auth.transport.requests import AuthorizedSession

        credentials, _ = google.auth.default(scopes=[CLOUD_PLATFORM])
        session = AuthorizedSession(credentials)
    doc = load_prices(path)
    fresh = prices_from_catalog(_fetch_skus(session), regions=regions)
    for region, tables in fresh.items():
        if not any(tables.values()):
            raise ProviderError(f"the Billing Catalog listed no Compute Engine prices for {region}")
        doc["regions"][region] = tables
    doc["as_of"] = date.today().isoformat()
    doc["source"] = "Cloud Billing Catalog API (Compute Engine SKUs, list prices)"
    path.write_text(_dump_prices(doc), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.providers.gcp")
    sub = parser.add_subparsers(dest="command", required=True)
    refresh = sub.add_parser("refresh-prices", help="refresh the shipped GCP price table")
    refresh.add_argument("--regions", default="us-central1,us-east1,us-west1")
    refresh.add_argument("--output", type=Path, default=PRICES_PATH)
    args = parser.parse_args(argv)
    regions = [r.strip() for r in args.regions.split(",") if r.strip()]
    import requests

    try:
        refresh_prices(regions=regions, path=args.output)
    except (
        ProviderError,
        OSError,
        auth_exceptions.GoogleAuthError,
        requests.RequestException,
    ) as e:
        print(f"could not refresh the GCP prices: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} for {', '.join(regions)}")
    return 0

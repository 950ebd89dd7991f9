"""What EC2 sells and for how much: instance types, zones, spot and on-demand prices.

Spot prices come from EC2's price history; on-demand ones from the shipped, dated table
(``data/aws_prices.json``, refreshed with ``python -m jobs.providers.aws refresh-prices``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from jobs.providers.aws.clients import Clients, TypeInfo, utc
from jobs.providers.aws.errors import error_code
from jobs.providers.base import PriceQuote, ProviderError, ResourceRequest
from jobs.providers.data import read_table

__all__ = [
    "ACCELERATOR_TYPES",
    "PRICES_PATH",
    "accelerator_type",
    "dry_run_type",
    "exact_type",
    "load_prices",
    "price",
    "type_info",
    "zones",
]

#: The shipped on-demand price table.
PRICES_PATH = Path(__file__).resolve().parents[1] / "data" / "aws_prices.json"

#: (accelerator, count) → instance type, for specs that name an accelerator and no type.
ACCELERATOR_TYPES: Mapping[tuple[str, int], str] = {
    ("T4", 1): "g4dn.xlarge",
    ("T4", 4): "g4dn.12xlarge",
    ("T4", 8): "g4dn.metal",
    ("A10G", 1): "g5.xlarge",
    ("A10G", 4): "g5.12xlarge",
    ("A10G", 8): "g5.48xlarge",
    ("L4", 1): "g6.xlarge",
    ("L4", 4): "g6.12xlarge",
    ("L4", 8): "g6.48xlarge",
    ("L40S", 1): "g6e.xlarge",
    ("L40S", 4): "g6e.12xlarge",
    ("L40S", 8): "g6e.48xlarge",
    ("V100", 1): "p3.2xlarge",
    ("V100", 4): "p3.8xlarge",
    ("V100", 8): "p3.16xlarge",
    ("A100", 8): "p4d.24xlarge",
    ("A100-80GB", 8): "p4de.24xlarge",
    ("H100", 8): "p5.48xlarge",
    ("H200", 8): "p5e.48xlarge",
}


def _accelerator_key(name: str) -> str:
    text = name.strip().upper()
    for prefix in ("NVIDIA-", "TESLA-", "NVIDIA ", "TESLA "):
        text = text.removeprefix(prefix)
    return text.removeprefix("TESLA-").replace(" ", "-")


def accelerator_type(req: ResourceRequest) -> tuple[str, int | None]:
    """(instance type, accelerators it holds; None when the request named the type).

    The smallest type that holds the request's accelerators; a count no single type holds
    gives the largest type of that accelerator, so the quota question is still answered
    (for as many instances as it takes), and ``launch`` refuses it.
    """
    if req.instance_type:
        return req.instance_type, None
    if not req.accelerator_type:
        raise ProviderError(
            "a CPU-only run on AWS needs resources.instance_type (for example m6i.xlarge)"
        )
    wanted = _accelerator_key(req.accelerator_type)
    sizes = sorted((n, t) for (a, n), t in ACCELERATOR_TYPES.items() if a == wanted)
    if not sizes:
        known = ", ".join(sorted({a for a, _ in ACCELERATOR_TYPES}))
        raise ProviderError(
            f"no EC2 instance type is known for the accelerator {req.accelerator_type}; "
            f"set resources.instance_type, or use one of {known}"
        )
    count = max(req.accelerator_count, 1)
    n, itype = next(((n, t) for n, t in sizes if n >= count), sizes[-1])
    return itype, n


def exact_type(req: ResourceRequest) -> str | None:
    """The instance type that holds exactly the request's accelerators, if one does."""
    if not req.accelerator_type or req.accelerator_count <= 0:
        return None
    return ACCELERATOR_TYPES.get((_accelerator_key(req.accelerator_type), req.accelerator_count))


def dry_run_type(req: ResourceRequest, *, prices_path: Path, region: str) -> str:
    """The cheapest EC2 type that runs ``req``'s dry run: of the types that carry its
    accelerator, those with the fewest, the cheapest on demand in ``region`` (the shipped
    table); for a request without an accelerator, the cheapest type that carries none.

    A request that names its type and no accelerator gets a CPU type; one that names a
    GPU type without the accelerator keeps its own type (the table says nothing of it).
    """
    table: dict[str, Any] = load_prices(prices_path)["regions"]
    prices: dict[str, float] = dict((table.get("us-east-1") or {}).get("prices") or {})
    prices.update((table.get(region) or {}).get("prices") or {})
    gpu_types = set(ACCELERATOR_TYPES.values())
    if req.accelerator_type:
        wanted = _accelerator_key(req.accelerator_type)
        sizes = sorted(n for (a, n) in ACCELERATOR_TYPES if a == wanted)
        if not sizes:
            return accelerator_type(req)[0]  # raises, naming the accelerators it knows
        smallest = [t for (a, n), t in ACCELERATOR_TYPES.items() if a == wanted and n == sizes[0]]
        return min(smallest, key=lambda t: prices.get(t, float("inf")))
    if req.instance_type and req.instance_type in gpu_types:
        return req.instance_type
    cpu = {t: usd for t, usd in prices.items() if t not in gpu_types}
    if not cpu:
        raise ProviderError(
            f"the shipped AWS price table lists no CPU instance type for {region}: set "
            "dry_run.instance_type (for example m6i.large)"
        )
    return min(cpu, key=lambda t: cpu[t])


def type_info(clients: Clients, instance_types: Sequence[str], region: str) -> dict[str, TypeInfo]:
    """The sizes of the types EC2 knows in ``region`` (cached: a type never changes)."""
    cache = clients.types
    missing = sorted({t for t in instance_types if (t, region) not in cache})
    if missing:
        ec2 = clients.client("ec2", region=region)
        with clients.call("ec2", f"describe instance types {', '.join(missing)}"):
            try:
                found = ec2.describe_instance_types(InstanceTypes=missing)["InstanceTypes"]
            except ClientError as exc:
                if error_code(exc) == "InvalidInstanceType":
                    raise ProviderError(
                        f"EC2 has no instance type {', '.join(missing)} in {region}: "
                        "fix resources.instance_type"
                    ) from None
                raise
        for item in found:
            gpus = sum(g.get("Count", 0) for g in (item.get("GpuInfo") or {}).get("Gpus", []))
            info = TypeInfo(vcpus=int(item["VCpuInfo"]["DefaultVCpus"]), gpus=gpus)
            cache[(item["InstanceType"], region)] = info
    return {t: cache[(t, region)] for t in instance_types if (t, region) in cache}


def zones(clients: Clients, region: str) -> dict[str, str]:
    """Zone name → zone id of the region's available availability zones."""
    ec2 = clients.client("ec2", region=region)
    with clients.call("ec2", f"list the availability zones of {region}"):
        found = ec2.describe_availability_zones(
            Filters=[{"Name": "zone-type", "Values": ["availability-zone"]}]
        )["AvailabilityZones"]
    return {z["ZoneName"]: z["ZoneId"] for z in found if z.get("State") == "available"}


# -- prices ------------------------------------------------------------------------------


def load_prices(path: Path) -> dict[str, Any]:
    """The on-demand table at ``path``, read again only when the file changes."""
    try:
        return read_table(path, key="regions")
    except ValueError as exc:
        raise ProviderError(
            f"the AWS price table {path} {exc}: reinstall trainbot or run "
            "python -m jobs.providers.aws refresh-prices"
        ) from None


def price(
    clients: Clients,
    req: ResourceRequest,
    itype: str,
    *,
    zone: str | None,
    prices_path: Path,
    clock: Callable[[], datetime],
) -> PriceQuote:
    """Latest spot price (the zone's, or the lowest of the candidate zones) and on-demand."""
    region = req.region or clients.region
    on_demand, od_as_of, od_source = _on_demand(itype, region, prices_path)
    ec2 = clients.client("ec2", region=region)
    candidates = [zone] if zone else list(req.zones)
    params: dict[str, Any] = {
        "InstanceTypes": [itype],
        "ProductDescriptions": ["Linux/UNIX"],
        "StartTime": clock(),
    }
    if candidates:
        params["Filters"] = [{"Name": "availability-zone", "Values": candidates}]
    latest: dict[str, tuple[datetime, float]] = {}
    with clients.call("ec2", f"read the spot price of {itype} in {region}"):
        for page in ec2.get_paginator("describe_spot_price_history").paginate(**params):
            for item in page["SpotPriceHistory"]:
                az, when = item["AvailabilityZone"], utc(item["Timestamp"])
                if az not in latest or when > latest[az][0]:
                    latest[az] = (when, float(item["SpotPrice"]))
    if latest:
        best_zone, (spot_at, spot) = min(latest.items(), key=lambda kv: kv[1][1])
        source = (
            f"aws spot price history ({best_zone}, {spot_at:%Y-%m-%d %H:%M} UTC); "
            f"on-demand: {od_source}"
        )
        as_of = min(spot_at, od_as_of)
    else:
        spot, as_of = on_demand, od_as_of
        where = ", ".join(candidates) if candidates else region
        source = f"no spot price for {itype} in {where}; on-demand used: {od_source}"
    return PriceQuote(
        spot_usd_per_hour=spot,
        on_demand_usd_per_hour=on_demand,
        source=source,
        as_of=as_of,
    )


def _on_demand(itype: str, region: str, prices_path: Path) -> tuple[float, datetime, str]:
    table = load_prices(prices_path)
    regions: dict[str, Any] = table["regions"]
    order = [region, "us-east-1", *sorted(regions)]
    for name in dict.fromkeys(order):
        entry = regions.get(name) or {}
        usd = (entry.get("prices") or {}).get(itype)
        if usd is None:
            continue
        as_of = datetime.combine(
            date.fromisoformat(str(entry["as_of"])), datetime.min.time(), timezone.utc
        )
        source = f"shipped table ({entry.get('source', 'AWS price list')}, {entry['as_of']})"
        if name != region:
            source += f", {name} price used for {region}"
        return float(usd), as_of, source
    raise ProviderError(
        f"the shipped AWS price table has no on-demand price for {itype}: run "
        f"python -m jobs.providers.aws refresh-prices --region {region} --type {itype}"
    )

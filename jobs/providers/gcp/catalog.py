"""GPU types, machine types and the shipped price table.

Compute Engine publishes no price API that answers per machine type, so prices come from
a dated table (``jobs/providers/data/gcp_prices.json``) of unit prices per region, which
``python -m jobs.providers.gcp refresh-prices`` rebuilds (:mod:`.refresh`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any

from jobs.providers.base import CPU_INSTANCE, PriceQuote, ProviderError, ResourceRequest

__all__ = ["PRICES_PATH", "Accelerator", "Catalog", "accelerator", "load_prices"]

#: The shipped price table (dated; see its ``refresh`` field).
PRICES_PATH = Path(__file__).resolve().parents[1] / "data" / "gcp_prices.json"
_REFRESH = "`python -m jobs.providers.gcp refresh-prices`"


@dataclass(frozen=True)
class Accelerator:
    """One GPU type in Compute Engine's vocabulary."""

    # Compute Engine accelerator type ("nvidia-tesla-a100").
    name: str
    # Regional quota metric for on-demand use; spot uses PREEMPTIBLE_ + this.
    metric: str
    # GPUs per instance → the machine type that carries them.
    machines: Mapping[int, str]
    # Other spellings a spec may use ("A100").
    aliases: tuple[str, ...]


_N1 = {1: "n1-standard-8", 2: "n1-standard-16", 4: "n1-standard-32", 8: "n1-standard-64"}
ACCELERATORS = (
    Accelerator(
        "nvidia-tesla-a100",
        "NVIDIA_A100_GPUS",
        {1: "a2-highgpu-1g", 2: "a2-highgpu-2g", 4: "a2-highgpu-4g", 8: "a2-highgpu-8g"}
        | {16: "a2-megagpu-16g"},
        ("a100", "a100-40gb"),
    ),
    Accelerator(
        "nvidia-a100-80gb",
        "NVIDIA_A100_80GB_GPUS",
        {1: "a2-ultragpu-1g", 2: "a2-ultragpu-2g", 4: "a2-ultragpu-4g", 8: "a2-ultragpu-8g"},
        ("a100-80gb", "a100_80gb"),
    ),
    Accelerator(
        "nvidia-h100-80gb",
        "NVIDIA_H100_GPUS",
        {1: "a3-highgpu-1g", 2: "a3-highgpu-2g", 4: "a3-highgpu-4g", 8: "a3-highgpu-8g"},
        ("h100", "h100-80gb"),
    ),
    Accelerator(
        "nvidia-l4",
        "NVIDIA_L4_GPUS",
        {1: "g2-standard-4", 2: "g2-standard-24", 4: "g2-standard-48", 8: "g2-standard-96"},
        ("l4",),
    ),
    Accelerator("nvidia-tesla-t4", "NVIDIA_T4_GPUS", _N1, ("t4",)),
    Accelerator("nvidia-tesla-v100", "NVIDIA_V100_GPUS", _N1, ("v100",)),
    Accelerator("nvidia-tesla-p100", "NVIDIA_P100_GPUS", _N1, ("p100",)),
    Accelerator("nvidia-tesla-p4", "NVIDIA_P4_GPUS", _N1, ("p4",)),
)
_BY_NAME = {k: a for a in ACCELERATORS for k in (a.name, *a.aliases)}
#: Machine families whose machines carry GPUs of their own (A2, A3, G2): not CPU types.
_GPU_FAMILIES = frozenset({"A2", "A3", "G2"})


def accelerator(req: ResourceRequest) -> Accelerator | None:
    """The request's GPU type; None for a CPU-only request."""
    if req.accelerator_count <= 0 or req.accelerator_type is None:
        return None
    found = _BY_NAME.get(req.accelerator_type.strip().lower())
    if found is None:
        known = ", ".join(a.aliases[0].upper() for a in ACCELERATORS)
        raise ProviderError(
            f"unknown GCP accelerator type {req.accelerator_type!r}: use one of {known}, or a"
            " Compute Engine name such as nvidia-tesla-a100"
        )
    return found


def load_prices(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ProviderError(
            f"the GCP price table {path} is unreadable ({e}): reinstall trainbot, or rebuild"
            f" it with {_REFRESH}"
        ) from None
    if not isinstance(data, dict) or "regions" not in data or "machine_types" not in data:
        raise ProviderError(f"the GCP price table {path} has no regions or machine_types")
    return data


class Catalog:
    """Which machine type carries a request, and what it costs per hour.

    ``machine_type_for`` maps ``TYPE:COUNT`` or ``TYPE`` (``A100:8``, ``nvidia-l4``;
    ``cpu`` for CPU-only runs) to a machine type, over the built-in choice. The price
    table is read on first use.
    """

    def __init__(self, *, prices_path: Path, machine_type_for: Mapping[str, str]) -> None:
        self.prices_path = prices_path
        self.machine_type_for = machine_type_for
        self._lock = threading.Lock()
        self._prices: dict[str, Any] | None = None

    def table(self) -> dict[str, Any]:
        with self._lock:
            if self._prices is None:
                self._prices = load_prices(self.prices_path)
            return self._prices

    def machine_type(self, req: ResourceRequest) -> str:
        if req.instance_type:
            return req.instance_type
        accel = accelerator(req)
        if accel is None:
            chosen = self.machine_type_for.get("cpu")
            if chosen:
                return chosen
            cpus = req.cpus or 4
            size = next((n for n in (2, 4, 8, 16, 32) if n >= cpus), None)
            if size is None:
                raise ProviderError(
                    f"{cpus} vCPUs is more than e2-standard-32 offers: set"
                    " resources.instance_type to a larger machine type"
                )
            return f"e2-standard-{size}"
        count = req.accelerator_count
        configured = self._configured_for_count(accel, req)
        if configured is not None:
            return configured
        for key in (accel.name, (req.accelerator_type or "").lower()):
            if key in self.machine_type_for:
                return self.machine_type_for[key]
        machine = accel.machines.get(count)
        if machine is None:
            counts = ", ".join(str(c) for c in sorted(accel.machines))
            raise ProviderError(
                f"Compute Engine has no machine type with {count} {accel.name}: ask for"
                f" {counts} per instance, or set resources.instance_type"
            )
        return machine

    def _configured_for_count(self, accel: Accelerator, req: ResourceRequest) -> str | None:
        """The machine type ``machine_type_for`` names for ``TYPE:COUNT``, if any."""
        count = req.accelerator_count
        for key in (f"{accel.name}:{count}", f"{(req.accelerator_type or '').lower()}:{count}"):
            if key in self.machine_type_for:
                return self.machine_type_for[key]
        return None

    def exact_machine_type(self, req: ResourceRequest) -> str | None:
        """The machine type that holds exactly the request's GPUs (the configured one for
        ``TYPE:COUNT``, else the built-in one), if one does; None for a CPU-only request."""
        accel = accelerator(req)
        if accel is None:
            return None
        return self._configured_for_count(accel, req) or accel.machines.get(req.accelerator_count)

    def dry_run_request(
        self, req: ResourceRequest, *, instance_type: str | None
    ) -> ResourceRequest:
        """One instance of the cheapest machine for ``req``'s dry run: ``instance_type``
        (``"cpu"``: the cheapest CPU machine), else the machine that carries the fewest of
        its GPUs (one, where Compute Engine has it) or, without GPUs, the cheapest CPU
        machine of the table, priced in the request's region."""
        accel = accelerator(req)
        if instance_type and instance_type != CPU_INSTANCE:
            return replace(req, instance_type=instance_type, cpus=None)
        if accel is not None and instance_type is None:
            count = min(accel.machines)
            one = replace(req, accelerator_count=count, instance_type=None, cpus=None)
            return replace(one, instance_type=self.machine_type(one))
        cpu = replace(req, accelerator_type=None, accelerator_count=0, instance_type=None)
        region = req.region if req.region not in ("", "local") else "us-central1"
        machines = [
            name
            for name, shape in self.table()["machine_types"].items()
            if shape.get("family") not in _GPU_FAMILIES
        ]
        if not machines:
            raise ProviderError(
                f"the GCP price table {self.prices_path} lists no CPU machine type: set "
                "dry_run.instance_type (for example e2-standard-2)"
            )

        def hourly(name: str) -> float:
            quote = self.price(replace(cpu, instance_type=name), region=region)
            return quote.spot_usd_per_hour if req.spot else quote.on_demand_usd_per_hour

        return replace(cpu, instance_type=min(machines, key=hourly), cpus=None)

    def vcpus(self, req: ResourceRequest) -> int:
        shape = self.table()["machine_types"].get(self.machine_type(req))
        return int(shape["vcpus"]) if shape else int(req.cpus or 1)

    def kind(self, req: ResourceRequest) -> str:
        """What a zone runs out of: the GPU type, or the machine type for CPU runs."""
        accel = accelerator(req)
        return accel.name if accel else self.machine_type(req)

    def price(self, req: ResourceRequest, *, region: str) -> PriceQuote:
        """Machine vCPUs and memory plus GPUs, from the region's unit prices (or the
        table's fallback region's, for a region it does not list)."""
        table = self.table()
        machine = self.machine_type(req)
        shape = table["machine_types"].get(machine)
        if shape is None:
            raise ProviderError(
                f"the GCP price table has no machine type {machine}: add it to"
                f" {self.prices_path} (family, vcpus, memory_gb) and refresh the prices with"
                f" {_REFRESH}"
            )
        units = table["regions"].get(region)
        priced = region
        if units is None:
            priced = str(table.get("fallback_region", "us-central1"))
            units = table["regions"][priced]
        accel = accelerator(req)
        totals: dict[str, float] = {}
        for model in ("on_demand", "spot"):
            try:
                total = shape["vcpus"] * units["vcpu"][shape["family"]][model]
                total += shape["memory_gb"] * units["ram_gb"][shape["family"]][model]
                if accel is not None:
                    total += req.accelerator_count * units["gpu"][accel.name][model]
            except KeyError as e:
                raise ProviderError(
                    f"the GCP price table has no {model} price for {e.args[0]} in {priced}:"
                    f" refresh it with {_REFRESH}"
                ) from None
            totals[model] = round(total, 6)
        where = priced if priced == region else f"{priced} figures; {region} is not in the table"
        return PriceQuote(
            spot_usd_per_hour=totals["spot"],
            on_demand_usd_per_hour=totals["on_demand"],
            source=f"gcp price table {self.prices_path.name} ({machine}, {where})",
            as_of=datetime.combine(
                date.fromisoformat(str(table["as_of"])), datetime.min.time(), timezone.utc
            ),
        )

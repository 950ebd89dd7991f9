"""This machine as a cloud: its cores and GPUs as quota and capacity; configured prices.

GPUs are what ``nvidia-smi -L`` lists, asked once; cores are shared by the running
instances according to what each asked for.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Sequence
from datetime import datetime, timezone

from jobs.providers.base import PriceQuote, QuotaInfo, ResourceRequest, ZoneCapacity
from jobs.providers.local.records import ZONE, Record

__all__ = ["INSTANCE_TYPE", "Machine", "capacity", "detect_gpus", "gpu_matches", "price"]

#: The local provider's one instance type: this machine.
INSTANCE_TYPE = "local"


class Machine:
    """The cores and GPUs local instances share."""

    def __init__(self, *, cores: int, gpu_names: Sequence[str] | None) -> None:
        self.cores = cores
        self._gpu_names = list(gpu_names) if gpu_names is not None else None
        self._lock = threading.Lock()

    def gpus(self) -> list[str]:
        with self._lock:
            if self._gpu_names is None:
                self._gpu_names = detect_gpus()
            return list(self._gpu_names)

    def instance_type_for(self, req: ResourceRequest) -> str | None:
        """One local instance is this machine: it holds as many GPUs of a type as it has."""
        if req.accelerator_count <= 0:
            return None
        gpus = [n for n in self.gpus() if gpu_matches(n, req.accelerator_type)]
        return INSTANCE_TYPE if len(gpus) >= req.accelerator_count else None

    def quota(self, req: ResourceRequest, live: Sequence[Record]) -> QuotaInfo:
        """Cores and GPUs, less what the ``live`` instances asked for."""
        cores = self.cores
        used_cpus = sum(r.cpus for r in live)
        n = max(req.instances, 1)  # a gang's nodes all run here
        cpu = _quota(
            limit=cores,
            used=used_cpus,
            needed=(req.cpus or 1) * n,
            unit="cores",
            detail=f"{cores} cores for local instances",
            remedy=f"ask for at most {max(cores - used_cpus, 0)} cpus, or stop a local run",
        )
        if req.accelerator_count <= 0 or not cpu.ok:
            return cpu
        gpus = [n for n in self.gpus() if gpu_matches(n, req.accelerator_type)]
        used_gpus = sum(r.accelerator_count for r in live)
        kind = req.accelerator_type or "GPU"
        return _quota(
            limit=len(gpus),
            used=used_gpus,
            needed=req.accelerator_count * n,
            unit="GPUs",
            detail=f"{len(gpus)} {kind} GPU(s) on this machine (nvidia-smi -L)",
            remedy=f"ask for at most {max(len(gpus) - used_gpus, 0)} {kind} GPU(s) here,"
            " or launch on a cloud provider",
        )


def capacity(req: ResourceRequest, quota: QuotaInfo) -> list[ZoneCapacity]:
    """One zone, available when this machine's quota covers the request."""
    zones = [ZoneCapacity(zone=ZONE, available=quota.ok, score=None, detail=quota.detail)]
    zones += [
        ZoneCapacity.unavailable(z, f"the local provider has one zone, {ZONE}")
        for z in dict.fromkeys(req.zones)
        if z != ZONE
    ]
    return zones


def price(*, spot_usd_per_hour: float, on_demand_usd_per_hour: float) -> PriceQuote:
    """The configured prices, so local spend is the same arithmetic as a cloud's."""
    return PriceQuote(
        spot_usd_per_hour=spot_usd_per_hour,
        on_demand_usd_per_hour=on_demand_usd_per_hour,
        source="local: configured",
        as_of=datetime.now(timezone.utc),
    )


def _quota(*, limit: int, used: int, needed: int, unit: str, detail: str, remedy: str) -> QuotaInfo:
    taken = f"{detail}: {used} taken by running local instances, {needed} needed"
    return QuotaInfo.check(limit, used, needed, unit, detail=taken, remedy=remedy)


def gpu_matches(name: str, accelerator_type: str | None) -> bool:
    """Whether an ``nvidia-smi`` GPU name is the requested type ("A100", "nvidia-tesla-a100")."""
    if accelerator_type is None or accelerator_type.lower() in ("gpu", "any"):
        return True
    wanted = accelerator_type.lower().removeprefix("nvidia-").removeprefix("tesla-")
    return wanted in name.lower()


def detect_gpus() -> list[str]:
    """GPU names from ``nvidia-smi -L``; none when it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "-L"], capture_output=True, text=True, timeout=20, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    # "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-…)"
    return [
        line.split(":", 1)[1].split("(UUID", 1)[0].strip()
        for line in out.splitlines()
        if line.startswith("GPU ") and ":" in line
    ]

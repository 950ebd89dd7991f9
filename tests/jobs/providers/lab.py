"""A fourth provider, defined in the tests alone: "lab", a bench of this machine's cores
in one pretend region (``lab-1``, zones ``lab-1a`` and ``lab-1b``).

It exists to show that a provider is its own module plus its registration
(:func:`jobs.providers.register`): nothing in ``jobs/`` names it. Its instances are
process groups started here, so it declares ``runs_on_this_machine``; it has no
accelerators, no cloud budgets, no logs and no permission probe, and says so.

The registry's three functions are at the bottom: ``make``, ``from_settings`` and
``credential_broker``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlparse

from jobs.providers import base
from runner import EXIT_PREEMPTED, EXIT_SUCCEEDED

REGION = "lab-1"
ZONES = ("lab-1a", "lab-1b")


@dataclass
class _Instance:
    info: base.InstanceInfo
    process: subprocess.Popen[bytes]
    cpus: int
    terminated: bool = False


class LabProvider:
    """The "lab" provider (see the module's docstring)."""

    name = "lab"

    def __init__(self, *, cores: int = 8, spot_usd_per_hour: float = 0.25) -> None:
        self.cores = cores
        self.spot_usd_per_hour = spot_usd_per_hour
        self._instances: dict[str, _Instance] = {}
        self._by_key: dict[str, str] = {}
        self._lock = threading.Lock()

    @property
    def capabilities(self) -> base.Capabilities:
        return base.Capabilities(
            runs_on_this_machine=True,
            termination_window_s=5.0,
            preemption_source="signal",
            default_region=REGION,
        )

    # -- questions ---------------------------------------------------------------------

    def _used(self) -> int:
        with self._lock:
            return sum(i.cpus for i in self._instances.values() if i.process.poll() is None)

    def quota(self, req: base.ResourceRequest) -> base.QuotaInfo:
        if req.accelerator_count:
            return base.QuotaInfo.check(
                0,
                0,
                req.accelerator_count * req.instances,
                "GPUs",
                detail=f"the lab has no accelerators ({req.accelerator_type} asked)",
                remedy="drop resources.accelerator, or set resources.cloud to a cloud",
            )
        needed = (req.cpus or 1) * req.instances
        return base.QuotaInfo.check(
            self.cores,
            self._used(),
            needed,
            "cores",
            detail=f"lab cores: {self._used()} of {self.cores} in use, {needed} asked",
            remedy="wait for the lab's other runs to end, or ask for fewer cores",
        )

    def capacity(self, req: base.ResourceRequest) -> list[base.ZoneCapacity]:
        if req.accelerator_count:
            return [base.ZoneCapacity.unavailable(z, "no accelerators in the lab") for z in ZONES]
        return [
            base.ZoneCapacity(zone, True, float(len(ZONES) - i), "bench free")
            for i, zone in enumerate(ZONES)
        ]

    def price(self, req: base.ResourceRequest, *, zone: str | None = None) -> base.PriceQuote:
        spot = self.spot_usd_per_hour * (req.cpus or 1)
        return base.PriceQuote(spot, spot * 2, "lab: fixed", datetime.now(timezone.utc))

    def bucket_location(self, uri: str) -> base.BucketLocation | None:
        if urlparse(uri).scheme in ("", "file"):
            return base.BucketLocation.region(REGION)
        return None

    def instance_type_for(self, req: base.ResourceRequest) -> str | None:
        return None  # no type of the lab holds an accelerator

    def dry_run_request(
        self, req: base.ResourceRequest, *, instance_type: str | None = None
    ) -> base.ResourceRequest:
        cpu = instance_type in (None, base.CPU_INSTANCE)
        return dataclasses.replace(
            req, instances=1, instance_type=None if cpu else instance_type, cpus=1
        )

    # -- instances ---------------------------------------------------------------------

    def launch(self, req: base.LaunchRequest) -> base.InstanceInfo:
        if req.zone not in ("", *ZONES):
            raise base.CapacityError(f"the lab has no zone {req.zone!r}", zone=req.zone)
        if req.nodes > 1:
            raise base.ProviderError("the lab launches one instance per attempt")
        with self._lock:
            known = self._by_key.get(req.key)
            if known is not None:
                return self._instances[known].info
            env = {k: os.environ[k] for k in base.PASSTHROUGH_ENV if k in os.environ}
            process = subprocess.Popen(
                list(req.command),
                env={**env, **req.env},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            instance_id = f"lab-{uuid.uuid4().hex[:10]}"
            info = base.InstanceInfo(
                instance_id=instance_id,
                run_id=req.run_id,
                attempt_id=req.attempt_id,
                zone=req.zone or ZONES[0],
                state=base.InstanceState.RUNNING,
                launched_at=datetime.now(timezone.utc),
                tags=req.tags(req.key),
            )
            self._instances[instance_id] = _Instance(info, process, req.request.cpus or 1)
            self._by_key[req.key] = instance_id
            return info

    def _get(self, instance_id: str) -> _Instance:
        with self._lock:
            found = self._instances.get(instance_id)
        if found is None:
            raise base.InstanceNotFound(
                f"the lab has no instance {instance_id}", instance_id=instance_id
            )
        return found

    def status(self, instance_id: str) -> base.InstanceStatus:
        inst = self._get(instance_id)
        code = inst.process.poll()
        if inst.terminated:
            return base.InstanceStatus(
                instance_id, base.InstanceState.TERMINATED, "terminated", exit_code=code
            )
        if code is None:
            return base.InstanceStatus(instance_id, base.InstanceState.RUNNING, "running")
        state = {
            EXIT_SUCCEEDED: base.InstanceState.SUCCEEDED,
            EXIT_PREEMPTED: base.InstanceState.PREEMPTED,
        }.get(code, base.InstanceState.FAILED)
        return base.InstanceStatus(instance_id, state, f"exited {code}", exit_code=code)

    def terminate(self, instance_id: str) -> None:
        inst = self._get(instance_id)
        with self._lock:
            first = not inst.terminated
            inst.terminated = True
        if first and inst.process.poll() is None:
            _signal(inst.process, signal.SIGTERM)
            try:
                inst.process.wait(timeout=self.capabilities.termination_window_s)
            except subprocess.TimeoutExpired:
                _signal(inst.process, signal.SIGKILL)
                inst.process.wait()

    def list_instances(self) -> list[base.InstanceInfo]:
        with self._lock:
            ids = list(self._instances)
        return [
            dataclasses.replace(self._instances[i].info, state=self.status(i).state) for i in ids
        ]

    # -- optional capabilities: none ---------------------------------------------------

    def create_budget(self, *, run_id: str, usd: float, thresholds: Sequence[int]) -> str:
        raise base.Unsupported("the lab has no budgets")

    def delete_budget(self, *, run_id: str) -> None:
        raise base.Unsupported("the lab has no budgets")

    def check_launch_permissions(
        self, req: base.ResourceRequest, *, zone: str | None = None
    ) -> None:
        raise base.Unsupported("the lab has no permission probe")

    def instance_log(self, instance_id: str, *, lines: int) -> str:
        raise base.Unsupported("the lab keeps no logs")

    def close(self) -> None:
        """Tests end their instances; a closed provider leaves them be."""

    def terminate_all(self) -> None:
        with self._lock:
            ids = list(self._instances)
        for instance_id in ids:
            self.terminate(instance_id)


def _signal(process: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


# -- the registry's functions ------------------------------------------------------------


def make(**options: Any) -> LabProvider:
    return LabProvider(**options)


def from_settings(settings: Any) -> LabProvider:
    return LabProvider()


def credential_broker(settings: Any) -> None:
    return None

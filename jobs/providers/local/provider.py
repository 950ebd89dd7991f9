"""``LocalProvider``: the Provider Protocol over this machine's processes, and the
registry's factories.

The class holds the options and answers the Protocol; the work is in the modules beside
it: machine (quota, capacity, prices), records (the state directory), processes
(launch, signals), preemption (spot behaviour), status (state, termination).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from jobs.providers import base, gang
from jobs.providers.local import machine, status
from jobs.providers.local.machine import Machine
from jobs.providers.local.preemption import Preemptions
from jobs.providers.local.processes import CONTAINER_TAG, DEFAULT_NICE, spawn
from jobs.providers.local.records import (
    EXIT,
    LOG,
    PROCESS,
    REGION,
    SCRATCH,
    TERMINATED,
    ZONE,
    Instances,
)
from runner import env as contract
from runner.nodes import free_port

if TYPE_CHECKING:
    from jobs.process.settings import Settings

__all__ = ["LocalProvider", "from_settings", "make"]

#: On node 0 of a local gang: the port its rendezvous listens on, for a retried launch.
MASTER_PORT_TAG = "trainbot-master-port"


class LocalProvider:
    """Runs each instance as a local process group, with spot behaviour that is real.

    Preemptions come from ``preempt()``, ``schedule_preemption()`` or, with
    ``mean_time_between_preemptions_s``, at random (exponential gaps, seeded) for every
    spot launch. Scheduled preemptions live in this object only; a restarted control
    plane keeps the instances but not their schedule. ``close()`` stops the threads and
    leaves the instances running.
    """

    name = "local"

    def __init__(
        self,
        state_dir: Path | str,
        *,
        termination_window_s: float = contract.DEFAULT_TERMINATION_WINDOW_S,
        terminate_grace_s: float = 5.0,
        spot_usd_per_hour: float = 1.0,
        on_demand_usd_per_hour: float = 3.0,
        mean_time_between_preemptions_s: float | None = None,
        seed: int | None = None,
        gpu_names: Sequence[str] | None = None,
        workdir: Path | str | None = None,
        cores: int | None = None,
        nice: int = DEFAULT_NICE,
    ) -> None:
        """``gpu_names``: the GPUs to offer (None: ask ``nvidia-smi -L``). ``workdir``: where
        commands start (None: the control plane's working directory, for ``train.py``).
        ``cores``: the CPU cores instances may share (None: this machine's count).
        ``nice``: how much lower than this process's CPU priority instances run, 0–19
        (0: the same)."""
        for label, value in (
            ("termination_window_s", termination_window_s),
            ("terminate_grace_s", terminate_grace_s),
            ("spot_usd_per_hour", spot_usd_per_hour),
            ("on_demand_usd_per_hour", on_demand_usd_per_hour),
        ):
            if value < 0:
                raise base.ProviderError(f"local provider: {label} is {value}; use 0 or more")
        if not 0 <= nice <= 19:
            raise base.ProviderError(
                f"local provider: nice is {nice}; use 0 (the control plane's own priority)"
                " to 19 (the lowest)"
            )
        if mean_time_between_preemptions_s is not None and mean_time_between_preemptions_s <= 0:
            raise base.ProviderError(
                "local provider: mean_time_between_preemptions_s must be more than 0"
                " (or None for no random preemptions)"
            )
        self.state_dir = Path(state_dir)
        self.terminate_grace_s = terminate_grace_s
        self.spot_usd_per_hour = spot_usd_per_hour
        self.on_demand_usd_per_hour = on_demand_usd_per_hour
        self.nice = nice
        self._capabilities = base.Capabilities(
            runs_on_this_machine=True,
            termination_window_s=termination_window_s,
            preemption_source="signal",
            default_region="local",
            mean_time_between_preemptions_s=mean_time_between_preemptions_s,
            instance_logs=True,
            gang_placement="this machine",
        )
        self._workdir = str(workdir) if workdir is not None else None
        self._machine = Machine(
            cores=cores if cores is not None else (os.cpu_count() or 1), gpu_names=gpu_names
        )
        self._instances = Instances(self.state_dir)
        self._lock = threading.RLock()
        self._preemptions = Preemptions(
            self._instances,
            lock=self._lock,
            window_s=termination_window_s,
            mean_time_between_s=mean_time_between_preemptions_s,
            seed=seed,
        )

    @property
    def cores(self) -> int:
        """The CPU cores local instances share."""
        return self._machine.cores

    @property
    def capabilities(self) -> base.Capabilities:
        """Instances are processes of this machine, so a dry run may run here too; the
        window and the mean time between preemptions are this provider's own settings."""
        return self._capabilities

    # -- Provider: questions --------------------------------------------------------------

    def quota(self, req: base.ResourceRequest) -> base.QuotaInfo:
        """Cores and GPUs of this machine, less what running local instances asked for."""
        live = [
            r
            for r in self._instances.records()
            if status.state_of(self._instances, r).state is base.InstanceState.RUNNING
        ]
        return self._machine.quota(req, live)

    def capacity(self, req: base.ResourceRequest) -> list[base.ZoneCapacity]:
        """One zone, available when this machine's quota covers the request."""
        return machine.capacity(req, self.quota(req))

    def instance_type_for(self, req: base.ResourceRequest) -> str | None:
        """``local``, this machine, when it has as many GPUs of the type as asked for."""
        return self._machine.instance_type_for(req)

    def dry_run_request(
        self, req: base.ResourceRequest, *, instance_type: str | None = None
    ) -> base.ResourceRequest:
        """The request itself: a local dry run is a process on this machine, not an
        instance (``capabilities.runs_on_this_machine``)."""
        return req

    def price(self, req: base.ResourceRequest, *, zone: str | None = None) -> base.PriceQuote:
        """The configured prices (see :meth:`set_prices`), so local spend is the same
        arithmetic as a cloud's."""
        with self._lock:
            return machine.price(
                spot_usd_per_hour=self.spot_usd_per_hour,
                on_demand_usd_per_hour=self.on_demand_usd_per_hour,
            )

    def set_prices(
        self,
        *,
        spot_usd_per_hour: float | None = None,
        on_demand_usd_per_hour: float | None = None,
    ) -> None:
        """Move the prices, as a spot market does (tests, the demo): later ``price`` calls
        and launches see the new figures; a price limit's watcher launches on a drop."""
        for label, value in (
            ("spot_usd_per_hour", spot_usd_per_hour),
            ("on_demand_usd_per_hour", on_demand_usd_per_hour),
        ):
            if value is not None and not 0 <= value < float("inf"):
                raise base.ProviderError(f"local provider: {label} is {value}; use 0 or more")
        with self._lock:
            if spot_usd_per_hour is not None:
                self.spot_usd_per_hour = spot_usd_per_hour
            if on_demand_usd_per_hour is not None:
                self.on_demand_usd_per_hour = on_demand_usd_per_hour

    def bucket_location(self, uri: str) -> base.BucketLocation | None:
        """Local paths and file URIs are in this machine's region; anything else is unknown."""
        scheme = urlparse(uri).scheme
        return base.BucketLocation.region(REGION) if scheme in ("", "file") else None

    # -- Provider: instances --------------------------------------------------------------

    def launch(self, req: base.LaunchRequest) -> base.InstanceInfo:
        """Start the command as a new process group; the same key returns the same instance.
        A gang's nodes are process groups of this machine that reach node 0 through the
        loopback, on a port free when node 0 was launched."""
        if req.nodes > 1:
            # gloo's peers on one machine talk over the loopback, whatever the hostname
            # resolves to (Linux names it lo).
            env = {"GLOO_SOCKET_IFNAME": "lo", **req.env} if sys.platform == "linux" else req.env
            return gang.launch(
                self._launch_one,
                replace(req, env=env),
                terminate_one=self._terminate_one,
                master_port=self._gang_port(req),
                loopback=True,
            )
        return self._launch_one(req)

    def _gang_port(self, req: base.LaunchRequest) -> int:
        """Node 0's rendezvous port: the one it was launched with, when it was (a launch
        retried after a crash), else a port free now."""
        key = req.idempotency_key or req.attempt_id
        for record in self._instances.records():
            if record.idempotency_key == key and MASTER_PORT_TAG in record.tags:
                return int(record.tags[MASTER_PORT_TAG])
        return free_port()

    def _launch_one(self, req: base.LaunchRequest) -> base.InstanceInfo:
        if not req.command:
            raise base.ProviderError(
                f"run {req.run_id} attempt {req.attempt_id}: the launch command is empty;"
                " the spec needs a command to run"
            )
        if req.zone not in (None, "", ZONE):
            raise base.CapacityError(
                f"the local provider has one zone, {ZONE}; it cannot launch in {req.zone!r}",
                zone=req.zone,
            )
        if self._preemptions.closed:
            raise base.ProviderError("this local provider is closed; make a new one to launch")
        key = req.key
        instances = self._instances
        with self._lock, instances.launch_lock():
            record = next((r for r in instances.records() if r.idempotency_key == key), None)
            if record is None:
                port = req.env.get(contract.MASTER_PORT.name)
                rendezvous = {MASTER_PORT_TAG: port} if port and req.node_rank == 0 else {}
                if req.env.get(contract.IMAGE.name):  # killed, it leaves a container
                    rendezvous[CONTAINER_TAG] = "podman"
                record = instances.create(req, key, extra_tags=rendezvous)
            elif any(instances.has(record.instance_id, f) for f in (PROCESS, EXIT, TERMINATED)):
                return status.info(instances, record)
            # New, or recorded by a control plane that died before starting it: start it.
            spawn(instances, record, req.env, nice=self.nice, workdir=self._workdir)
        delay = self._preemptions.random_delay_s() if req.spot else None
        if delay is not None:
            self.schedule_preemption(record.instance_id, after_s=delay)
        return status.info(instances, record)

    def status(self, instance_id: str) -> base.InstanceStatus:
        """Read from the instance's files, so it works for instances of earlier processes."""
        return gang.status(
            self._status_one, instance_id, window_s=self.capabilities.termination_window_s
        )

    def _status_one(self, instance_id: str) -> base.InstanceStatus:
        return status.state_of(self._instances, self._instances.load(instance_id))

    def terminate(self, instance_id: str) -> None:
        """SIGTERM to the group, SIGKILL after the grace; returns once it is gone (every
        node of a gang, at once)."""
        gang.terminate(self._terminate_one, instance_id)

    def _terminate_one(self, instance_id: str) -> None:
        record = self._instances.load(instance_id)
        with self._lock:
            if not self._instances.has(instance_id, TERMINATED):
                now = time.time()
                self._instances.write(instance_id, TERMINATED, {"at": now, "signalled_at": now})
            self._preemptions.cancel(instance_id)
        status.end(self._instances, record, grace_s=self.terminate_grace_s)

    def list_instances(self) -> list[base.InstanceInfo]:
        """Every instance in the state directory, oldest first, whatever its state."""
        return gang.group(status.info(self._instances, r) for r in self._instances.records())

    # -- spot behaviour -------------------------------------------------------------------

    def preempt(self, instance_id: str, *, now: datetime | None = None) -> None:
        """Reclaim the instance like a spot cloud: SIGTERM now, SIGKILL after the window.

        Returns at once; a timer sends the SIGKILL. ``now`` is the preemption time
        reported by ``status``. Preempting an instance that is not running does nothing.
        A gang's id preempts every node; a node's id that node alone.
        """
        for node in gang.node_ids(instance_id):
            self._preemptions.preempt(node, now=now)

    def schedule_preemption(
        self, instance_id: str, *, at: datetime | None = None, after_s: float | None = None
    ) -> None:
        """Preempt the instance at a time, or after some seconds (replacing any earlier)."""
        if (at is None) == (after_s is None):
            raise base.ProviderError("schedule_preemption takes exactly one of at= and after_s=")
        self._instances.load(instance_id)
        when = at.timestamp() if at is not None else time.time() + (after_s or 0.0)
        self._preemptions.schedule(instance_id, when)

    def scheduled_preemptions(self) -> dict[str, datetime]:
        """Instance id → when it will be preempted, for those still waiting."""
        return self._preemptions.scheduled()

    # -- for the console and tests --------------------------------------------------------

    def log_path(self, instance_id: str) -> Path:
        """The file holding the command's stdout and stderr (``/train logs``); node 0's
        of a gang."""
        instance_id = gang.node_ids(instance_id)[0]
        self._instances.load(instance_id)
        return self._instances.dir(instance_id) / LOG

    def instance_log(self, instance_id: str, *, lines: int) -> str:
        """The last ``lines`` lines of the command's stdout and stderr (``/train logs``);
        of each node of a gang, under a line naming it."""
        nodes = gang.node_ids(instance_id)
        if len(nodes) == 1:
            return self._log_tail(instance_id, lines)
        parts = []
        for rank, node in enumerate(nodes):
            try:
                tail = self._log_tail(node, lines)
            except base.InstanceNotFound as exc:
                tail = str(exc)
            parts.append(f"== node {rank} ({node}) ==\n{tail}")
        return "\n".join(parts)

    def _log_tail(self, instance_id: str, lines: int) -> str:
        try:
            text = self.log_path(instance_id).read_text(errors="replace")
        except FileNotFoundError:
            raise base.InstanceNotFound(
                f"no log for instance {instance_id} yet", instance_id=instance_id
            ) from None
        return "\n".join(text.splitlines()[-lines:])

    def create_budget(self, *, run_id: str, usd: float, thresholds: Sequence[int]) -> str:
        raise base.Unsupported("the local provider has no cloud billing")

    def delete_budget(self, *, run_id: str) -> None:
        raise base.Unsupported("the local provider has no cloud billing")

    def check_launch_permissions(
        self, req: base.ResourceRequest, *, zone: str | None = None
    ) -> None:
        """Anyone who can run the control plane can start processes here."""

    def scratch_dir(self, instance_id: str) -> Path:
        """The instance's scratch volume (gone once it is terminated); node 0's of a gang."""
        instance_id = gang.node_ids(instance_id)[0]
        self._instances.load(instance_id)
        return self._instances.dir(instance_id) / SCRATCH

    def close(self) -> None:
        """Stop the preemption threads. Instances keep running; a pending SIGKILL is sent by
        the next ``status`` call of any provider on this state directory."""
        self._preemptions.close()

    def __enter__(self) -> LocalProvider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make(**options: Any) -> LocalProvider:
    """The registry's factory: ``options`` are :class:`LocalProvider`'s keyword arguments."""
    return LocalProvider(**options)


def from_settings(settings: Settings) -> LocalProvider:
    """The local provider as ``TRAINBOT_LOCAL_*`` configure it, under the state directory."""
    return LocalProvider(
        state_dir=settings.state_dir / "local",
        termination_window_s=settings.local_termination_window_s,
        spot_usd_per_hour=settings.local_price_per_hour_usd,
        on_demand_usd_per_hour=settings.local_price_per_hour_usd * 3,
        mean_time_between_preemptions_s=settings.local_mean_time_between_preemptions_s,
        cores=settings.local_cores,
        nice=settings.local_nice,
    )

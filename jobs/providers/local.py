"""The laptop's spot cloud: each instance is a local process group that can be preempted.

An instance is a small wrapper process (this module's ``_wrap_main``) leading its own
process group; it runs the launch command as its child and records the child's exit code
in a file when it ends. Everything the provider knows lives in files under
``<state_dir>/instances/<instance_id>/``, written atomically, so a restarted control plane
sees, controls and reports on instances started by the one before it:

- ``instance.json``   ids, tags, command, what was asked for (never the environment: it
                      holds the runner token)
- ``process.json``    pid, process group and the process's start time (guards pid reuse)
- ``exit.json``       the command's exit code and end time, written by the wrapper
- ``preempted.json``  / ``terminated.json``: what this provider did to it, and when
- ``output.log``      the command's stdout and stderr, for ``/train logs``
- ``scratch/``        the instance's scratch volume (removed on terminate)

Preemption behaves like a cloud's: SIGTERM to the whole group, the termination window,
then SIGKILL. POSIX only (process groups, ``fcntl``), like the laptops it runs on.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from jobs.providers.base import (
    PASSTHROUGH_ENV,
    TAG_ATTEMPT_ID,
    TAG_IDEMPOTENCY_KEY,
    TAG_MANAGED,
    TAG_OWNER,
    TAG_RUN_ID,
    Capabilities,
    CapacityError,
    InstanceInfo,
    InstanceNotFound,
    InstanceState,
    InstanceStatus,
    LaunchRequest,
    PriceQuote,
    ProviderError,
    QuotaInfo,
    ResourceRequest,
    ZoneCapacity,
)
from runner import EXIT_PREEMPTED, EXIT_SUCCEEDED

__all__ = ["REGION", "ZONE", "LocalProvider"]

log = logging.getLogger(__name__)

#: The local provider's only region and zone.
REGION = "local"
ZONE = "local-a"


_INSTANCE = "instance.json"
_PROCESS = "process.json"
_EXIT = "exit.json"
_PREEMPTED = "preempted.json"
_TERMINATED = "terminated.json"
_LOG = "output.log"
_SCRATCH = "scratch"
_ID = re.compile(r"local-[0-9a-f]{12}")
# A record without a process this long after launch never got one started.
_START_TIMEOUT_S = 60.0
# After SIGKILL, how long to wait for the group to go before calling it stuck.
_KILL_WAIT_S = 5.0
_POLL_S = 0.02

#: How much lower than the control plane's own CPU priority instances run (as ``nice -n``).
#: The control plane shares the laptop with its training runs, and a run that keeps every
#: core busy must not make Slack wait for its answer; niced, the run still gets every
#: cycle the control plane leaves idle.
DEFAULT_NICE = 10
# The wrapper runs in isolated mode (-I) so nothing in the environment can change which
# ``jobs`` it imports; argv[1] is the directory that holds this package, argv[2] the
# niceness, applied first thing, so the wrapper and everything it starts run at it.
_WRAP_BOOT = (
    "import os, sys; n = int(sys.argv[2]); n and os.nice(n); sys.path.insert(0, sys.argv[1]); "
    "from jobs.providers.local import _wrap_main; sys.exit(_wrap_main(sys.argv[3:]))"
)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


# -- files -------------------------------------------------------------------------------


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Replace ``path`` atomically: readers see the old file or the new one, never half."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ProviderError(
            f"local instance file {path} is unreadable ({e}): delete its instance directory"
            " if the instance is no longer needed"
        ) from None
    if not isinstance(data, dict):
        raise ProviderError(f"local instance file {path} holds no JSON object: delete it")
    return data


# -- processes ---------------------------------------------------------------------------


def _process_stat(pid: int) -> tuple[str, str] | None:
    """(state letter, start-time token) of a process, or None when there is none.

    The start time tells a process from a later one that got the same pid.
    """
    if os.path.exists("/proc/self/stat"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                raw = f.read().decode("ascii", "replace")
        except OSError:
            return None
        # The command name (field 2) may hold spaces and parentheses: split after it.
        fields = raw.rpartition(")")[2].split()
        return (fields[0], fields[19]) if len(fields) > 19 else None
    try:  # macOS and the BSDs
        out = subprocess.run(
            ["ps", "-o", "stat=", "-o", "lstart=", "-p", str(pid)],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = out.split(None, 1)
    return (parts[0][:1], parts[1]) if len(parts) == 2 else None


@dataclass(frozen=True)
class _Process:
    """The wrapper process of one instance, as recorded in process.json."""

    pid: int
    pgid: int
    start: str

    def alive(self) -> bool:
        stat = _process_stat(self.pid)
        return stat is not None and stat[0] not in ("Z", "X") and stat[1] == self.start

    def signal_group(self, sig: signal.Signals) -> None:
        """Signal every process of the instance, and never someone else's.

        While the leader's pid names a different process the group id may have been
        reused, so nothing is sent. While it names no process, a surviving group can only
        be ours: the kernel does not hand out a pid still in use as a group id.
        """
        stat = _process_stat(self.pid)
        if stat is not None and stat[1] != self.start:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)


def _wrap_main(argv: Sequence[str]) -> int:
    """The wrapper: run ``argv[2:]`` and record how it ended in ``argv[0]``/exit.json.

    It leads the instance's process group, so a signal to the group reaches the command
    directly; the wrapper itself catches SIGTERM (and does nothing) to outlive its child
    and write the exit code. A SIGKILL ends both; the provider then knows why.
    """
    instance_dir = Path(argv[0])
    command = list(argv[2:]) if len(argv) > 1 and argv[1] == "--" else list(argv[1:])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    pid = os.getpid()
    stat = _process_stat(pid)
    _write_json(
        instance_dir / _PROCESS,
        asdict(_Process(pid=pid, pgid=os.getpgid(0), start=stat[1] if stat else "")),
    )
    try:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    except OSError as e:
        name = command[0] if command else ""
        print(f"trainbot: cannot start {name!r}: {e}", file=sys.stderr, flush=True)
        code = 127 if isinstance(e, FileNotFoundError) else 126
    else:
        code = child.wait()
    _write_json(instance_dir / _EXIT, {"exit_code": code, "ended_at": time.time()})
    return 0


# -- records -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Record:
    """instance.json: what was launched. Holds no environment, so no runner token."""

    instance_id: str
    run_id: str
    attempt_id: str
    owner: str
    zone: str
    idempotency_key: str
    spot: bool
    launched_at: float
    command: list[str]
    scratch_bytes: int
    cpus: int
    accelerator_count: int
    tags: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> _Record:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def _utc(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=timezone.utc)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited {code}"


# -- the provider ------------------------------------------------------------------------


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
        termination_window_s: float = 30.0,
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
                raise ProviderError(f"local provider: {label} is {value}; use 0 or more")
        if not 0 <= nice <= 19:
            raise ProviderError(
                f"local provider: nice is {nice}; use 0 (the control plane's own priority)"
                " to 19 (the lowest)"
            )
        if mean_time_between_preemptions_s is not None and mean_time_between_preemptions_s <= 0:
            raise ProviderError(
                "local provider: mean_time_between_preemptions_s must be more than 0"
                " (or None for no random preemptions)"
            )
        self.state_dir = Path(state_dir)
        self.termination_window_s = termination_window_s
        self.terminate_grace_s = terminate_grace_s
        self.spot_usd_per_hour = spot_usd_per_hour
        self.on_demand_usd_per_hour = on_demand_usd_per_hour
        self.mean_time_between_preemptions_s = mean_time_between_preemptions_s
        self._rng = random.Random(seed)
        self._gpu_names = list(gpu_names) if gpu_names is not None else None
        self._workdir = str(workdir) if workdir is not None else None
        self.cores = cores if cores is not None else (os.cpu_count() or 1)
        self.nice = nice
        self._instances = self.state_dir / "instances"
        self._instances.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._kill_timers: dict[str, threading.Timer] = {}
        self._schedule: dict[str, float] = {}
        self._wake = threading.Condition()
        self._scheduler: threading.Thread | None = None
        self._closed = False

    @property
    def capabilities(self) -> Capabilities:
        """Instances are processes of this machine, so a dry run may run here too; the
        window and the mean time between preemptions are this provider's own settings."""
        return Capabilities(
            runs_on_this_machine=True,
            termination_window_s=self.termination_window_s,
            mean_time_between_preemptions_s=self.mean_time_between_preemptions_s,
        )

    # -- Provider: questions --------------------------------------------------------------

    def quota(self, req: ResourceRequest) -> QuotaInfo:
        """Cores and GPUs of this machine, less what running local instances asked for."""
        live = [r for r in self._records() if self._state_of(r).state is InstanceState.RUNNING]
        cores = self.cores
        used_cpus = sum(r.cpus for r in live)
        cpu = _quota(
            limit=cores,
            used=used_cpus,
            needed=req.cpus or 1,
            unit="cores",
            detail=f"{cores} cores for local instances",
            remedy=f"ask for at most {max(cores - used_cpus, 0)} cpus, or stop a local run",
        )
        if req.accelerator_count <= 0 or not cpu.ok:
            return cpu
        gpus = [n for n in self._gpus() if _gpu_matches(n, req.accelerator_type)]
        used_gpus = sum(r.accelerator_count for r in live)
        kind = req.accelerator_type or "GPU"
        return _quota(
            limit=len(gpus),
            used=used_gpus,
            needed=req.accelerator_count,
            unit="GPUs",
            detail=f"{len(gpus)} {kind} GPU(s) on this machine (nvidia-smi -L)",
            remedy=f"ask for at most {max(len(gpus) - used_gpus, 0)} {kind} GPU(s) here,"
            " or launch on a cloud provider",
        )

    def capacity(self, req: ResourceRequest) -> list[ZoneCapacity]:
        """One zone, available when this machine's quota covers the request."""
        quota = self.quota(req)
        zones = [ZoneCapacity(zone=ZONE, available=quota.ok, score=None, detail=quota.detail)]
        zones += [
            ZoneCapacity(zone=z, available=False, detail=f"the local provider has one zone, {ZONE}")
            for z in dict.fromkeys(req.zones)
            if z != ZONE
        ]
        return zones

    def price(self, req: ResourceRequest, *, zone: str | None = None) -> PriceQuote:
        """The configured prices, so local spend is the same arithmetic as a cloud's."""
        return PriceQuote(
            spot_usd_per_hour=self.spot_usd_per_hour,
            on_demand_usd_per_hour=self.on_demand_usd_per_hour,
            source="local: configured",
            as_of=datetime.now(timezone.utc),
        )

    def bucket_region(self, uri: str) -> str | None:
        """Local paths and file URIs are in this machine's region; anything else is unknown."""
        scheme = urlparse(uri).scheme
        return REGION if scheme in ("", "file") else None

    # -- Provider: instances --------------------------------------------------------------

    def launch(self, req: LaunchRequest) -> InstanceInfo:
        """Start the command as a new process group; the same key returns the same instance."""
        if not req.command:
            raise ProviderError(
                f"run {req.run_id} attempt {req.attempt_id}: the launch command is empty;"
                " the spec needs a command to run"
            )
        if req.zone not in (None, "", ZONE):
            raise CapacityError(
                f"the local provider has one zone, {ZONE}; it cannot launch in {req.zone!r}",
                zone=req.zone,
            )
        if self._closed:
            raise ProviderError("this local provider is closed; make a new one to launch")
        key = req.idempotency_key or f"{req.run_id}/{req.attempt_id}"
        with self._lock, self._launch_lock():
            record = next((r for r in self._records() if r.idempotency_key == key), None)
            if record is None:
                record = self._create(req, key)
            elif any(self._has(record.instance_id, f) for f in (_PROCESS, _EXIT, _TERMINATED)):
                return self._info(record)
            # New, or recorded by a control plane that died before starting it: start it.
            self._spawn(record, req.env)
        if req.spot and self.mean_time_between_preemptions_s is not None:
            with self._lock:
                delay = self._rng.expovariate(1.0 / self.mean_time_between_preemptions_s)
            self.schedule_preemption(record.instance_id, after_s=delay)
        return self._info(record)

    def status(self, instance_id: str) -> InstanceStatus:
        """Read from the instance's files, so it works for instances of earlier processes."""
        return self._state_of(self._load(instance_id))

    def terminate(self, instance_id: str) -> None:
        """SIGTERM to the group, SIGKILL after the grace; returns once it is gone."""
        record = self._load(instance_id)
        with self._lock:
            if not self._has(instance_id, _TERMINATED):
                now = time.time()
                self._write(instance_id, _TERMINATED, {"at": now, "signalled_at": now})
            timer = self._kill_timers.pop(instance_id, None)
        if timer is not None:
            timer.cancel()
        with self._wake:
            self._schedule.pop(instance_id, None)
        process = self._read_process(instance_id)
        if process is not None:
            if process.alive():
                process.signal_group(signal.SIGTERM)
                _wait_until_dead(process, self.terminate_grace_s)
            # Also reaches stragglers in the group after the wrapper has gone.
            process.signal_group(signal.SIGKILL)
            if not _wait_until_dead(process, _KILL_WAIT_S):
                raise ProviderError(
                    f"local instance {instance_id} (pid {process.pid}) is still running after"
                    " SIGKILL; it is stuck in the kernel: check `ps -o stat -p"
                    f" {process.pid}` and reboot if it stays"
                )
        shutil.rmtree(self._dir(instance_id) / _SCRATCH, ignore_errors=True)
        log.info("terminated local instance %s (run %s)", instance_id, record.run_id)

    def list_instances(self) -> list[InstanceInfo]:
        """Every instance in the state directory, oldest first, whatever its state."""
        return [self._info(r) for r in self._records()]

    # -- spot behaviour -------------------------------------------------------------------

    def preempt(self, instance_id: str, *, now: datetime | None = None) -> None:
        """Reclaim the instance like a spot cloud: SIGTERM now, SIGKILL after the window.

        Returns at once; a timer sends the SIGKILL. ``now`` is the preemption time
        reported by ``status``. Preempting an instance that is not running does nothing.
        """
        self._load(instance_id)
        with self._lock:
            process = self._read_process(instance_id)
            if self._has(instance_id, _PREEMPTED) or process is None or not process.alive():
                return
            signalled = time.time()
            at = now.timestamp() if now is not None else signalled
            window = self.termination_window_s
            self._write(
                instance_id,
                _PREEMPTED,
                {"at": at, "signalled_at": signalled, "kill_at": signalled + window},
            )
            process.signal_group(signal.SIGTERM)
            timer = threading.Timer(window, self._kill_after_window, args=(instance_id,))
            timer.daemon = True
            self._kill_timers[instance_id] = timer
            timer.start()
        log.info("preempted local instance %s; SIGKILL in %g s if alive", instance_id, window)

    def schedule_preemption(
        self, instance_id: str, *, at: datetime | None = None, after_s: float | None = None
    ) -> None:
        """Preempt the instance at a time, or after some seconds (replacing any earlier)."""
        if (at is None) == (after_s is None):
            raise ProviderError("schedule_preemption takes exactly one of at= and after_s=")
        self._load(instance_id)
        when = at.timestamp() if at is not None else time.time() + (after_s or 0.0)
        with self._wake:
            if self._closed:
                raise ProviderError("the local provider is closed; make a new one")
            self._schedule[instance_id] = when
            if self._scheduler is None:
                self._scheduler = threading.Thread(
                    target=self._run_schedule, name="local-preemptions", daemon=True
                )
                self._scheduler.start()
            self._wake.notify()

    def scheduled_preemptions(self) -> dict[str, datetime]:
        """Instance id → when it will be preempted, for those still waiting."""
        with self._wake:
            return {i: _utc(t) for i, t in self._schedule.items()}

    # -- for the console and tests --------------------------------------------------------

    def log_path(self, instance_id: str) -> Path:
        """The file holding the command's stdout and stderr (``/train logs``)."""
        self._load(instance_id)
        return self._dir(instance_id) / _LOG

    def scratch_dir(self, instance_id: str) -> Path:
        """The instance's scratch volume (gone once it is terminated)."""
        self._load(instance_id)
        return self._dir(instance_id) / _SCRATCH

    def close(self) -> None:
        """Stop the preemption threads. Instances keep running; a pending SIGKILL is sent by
        the next ``status`` call of any provider on this state directory."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
            thread = self._scheduler
        if thread is not None:
            thread.join(timeout=5)
        with self._lock:
            timers = list(self._kill_timers.values())
            self._kill_timers.clear()
        for timer in timers:
            timer.cancel()

    def __enter__(self) -> LocalProvider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------

    def _dir(self, instance_id: str) -> Path:
        return self._instances / instance_id

    def _has(self, instance_id: str, name: str) -> bool:
        return (self._dir(instance_id) / name).exists()

    def _write(self, instance_id: str, name: str, data: Mapping[str, Any]) -> None:
        _write_json(self._dir(instance_id) / name, data)

    def _load(self, instance_id: str) -> _Record:
        data = None
        if _ID.fullmatch(instance_id):
            data = _read_json(self._dir(instance_id) / _INSTANCE)
        if data is None:
            raise InstanceNotFound(
                f"no local instance {instance_id!r} in {self._instances}: it was never"
                " launched here, or its directory was deleted",
                instance_id=instance_id,
            )
        return _Record.from_json(data)

    def _records(self) -> list[_Record]:
        records = []
        for d in self._instances.iterdir():
            if not _ID.fullmatch(d.name):
                continue
            try:
                data = _read_json(d / _INSTANCE)
            except ProviderError as e:  # one damaged record must not hide the others
                log.warning("skipping local instance %s: %s", d.name, e)
                continue
            if data is not None:
                records.append(_Record.from_json(data))
        return sorted(records, key=lambda r: (r.launched_at, r.instance_id))

    def _read_process(self, instance_id: str) -> _Process | None:
        data = _read_json(self._dir(instance_id) / _PROCESS)
        if data is None:
            return None
        return _Process(pid=int(data["pid"]), pgid=int(data["pgid"]), start=str(data["start"]))

    @contextlib.contextmanager
    def _launch_lock(self) -> Iterator[None]:
        """Serialise launches across processes sharing the state directory."""
        with open(self.state_dir / ".launch.lock", "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _create(self, req: LaunchRequest, key: str) -> _Record:
        instance_id = f"local-{uuid.uuid4().hex[:12]}"
        directory = self._dir(instance_id)
        (directory / _SCRATCH).mkdir(parents=True)
        record = _Record(
            instance_id=instance_id,
            run_id=req.run_id,
            attempt_id=req.attempt_id,
            owner=req.owner,
            zone=ZONE,
            idempotency_key=key,
            spot=req.spot,
            launched_at=time.time(),
            command=list(req.command),
            scratch_bytes=req.scratch_bytes,
            cpus=req.request.cpus or 1,
            accelerator_count=max(req.request.accelerator_count, 0),
            tags={
                TAG_MANAGED: "true",
                TAG_RUN_ID: req.run_id,
                TAG_ATTEMPT_ID: req.attempt_id,
                TAG_OWNER: req.owner,
                TAG_IDEMPOTENCY_KEY: key,
            },
        )
        _write_json(directory / _INSTANCE, asdict(record))
        return record

    def _spawn(self, record: _Record, request_env: Mapping[str, str]) -> None:
        directory = self._dir(record.instance_id)
        scratch = directory / _SCRATCH
        scratch.mkdir(parents=True, exist_ok=True)
        env = {k: os.environ[k] for k in PASSTHROUGH_ENV if k in os.environ}
        env.update(request_env)
        env["TRAINBOT_SCRATCH_DIR"] = str(scratch)
        env["TRAINBOT_SCRATCH_BYTES"] = str(record.scratch_bytes)
        env["TRAINBOT_INSTANCE_ID"] = record.instance_id
        argv = [sys.executable, "-I", "-c", _WRAP_BOOT, _PACKAGE_ROOT, str(self.nice)]
        argv += [str(directory), "--"]
        try:
            with open(directory / _LOG, "ab") as out:
                child = subprocess.Popen(
                    [*argv, *record.command],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self._workdir,
                    start_new_session=True,
                )
        except OSError as e:
            _write_json(directory / _EXIT, {"exit_code": 127, "ended_at": time.time()})
            raise ProviderError(
                f"local instance {record.instance_id} for run {record.run_id} could not start"
                f" ({e}); check the python at {sys.executable} and the workdir"
            ) from None
        # Reap the wrapper when it ends, so it is never left a zombie.
        threading.Thread(target=child.wait, name=f"reap-{record.instance_id}", daemon=True).start()
        stat = _process_stat(child.pid)
        process = _Process(pid=child.pid, pgid=child.pid, start=stat[1] if stat else "")
        # The wrapper writes the same record first thing; this covers a slow start.
        self._write(record.instance_id, _PROCESS, asdict(process))
        log.info(
            "launched local instance %s for run %s attempt %s (pid %d)",
            record.instance_id,
            record.run_id,
            record.attempt_id,
            child.pid,
        )

    def _info(self, record: _Record) -> InstanceInfo:
        return InstanceInfo(
            instance_id=record.instance_id,
            run_id=record.run_id,
            attempt_id=record.attempt_id,
            zone=record.zone,
            state=self._state_of(record).state,
            launched_at=_utc(record.launched_at),
            tags=dict(record.tags),
        )

    def _kill_after_window(self, instance_id: str) -> None:
        with self._lock:
            self._kill_timers.pop(instance_id, None)
        process = self._read_process(instance_id)
        if process is not None and process.alive():
            log.info("local instance %s outlived its termination window: SIGKILL", instance_id)
            process.signal_group(signal.SIGKILL)

    def _run_schedule(self) -> None:
        while True:
            with self._wake:
                while not self._closed:
                    now = time.time()
                    due = [i for i, t in self._schedule.items() if t <= now]
                    if due:
                        break
                    wait = min(self._schedule.values(), default=now + 3600.0) - now
                    self._wake.wait(timeout=wait)
                if self._closed:
                    return
                for instance_id in due:
                    del self._schedule[instance_id]
            for instance_id in due:
                try:
                    self.preempt(instance_id)
                except ProviderError as e:
                    log.warning("scheduled preemption of %s skipped: %s", instance_id, e)

    def _state_of(self, record: _Record) -> InstanceStatus:
        instance_id = record.instance_id
        directory = self._dir(instance_id)
        process = self._read_process(instance_id)
        preempted = _read_json(directory / _PREEMPTED)
        terminated = _read_json(directory / _TERMINATED)
        if process is not None and process.alive():
            if preempted is not None and time.time() >= preempted["kill_at"]:
                # Its timer died with an earlier control plane: enforce the window now.
                process.signal_group(signal.SIGKILL)
                _wait_until_dead(process, _KILL_WAIT_S)
            if process.alive():
                return _running(instance_id, preempted, terminated)

        def make(state: InstanceState, reason: str, **kw: Any) -> InstanceStatus:
            return InstanceStatus(instance_id=instance_id, state=state, reason=reason, **kw)

        ended = _read_json(directory / _EXIT)
        code: int | None = int(ended["exit_code"]) if ended is not None else None
        logs = f"see the log at {directory / _LOG}"
        if process is None and ended is None:
            if terminated is not None:
                return make(InstanceState.TERMINATED, "terminated before it started")
            if time.time() - record.launched_at < _START_TIMEOUT_S:
                return make(InstanceState.PENDING, "starting")
            return make(InstanceState.FAILED, f"the instance process never started; {logs}")

        # A marker counts only if it came before the end (a run that succeeded and was
        # terminated afterwards still succeeded); of two, the earlier one is the cause.
        def signalled_at(marker: dict[str, Any] | None) -> float:
            if marker is None:
                return math.inf
            at = float(marker["signalled_at"])
            return at if ended is None or float(ended["ended_at"]) >= at else math.inf

        exited = f"the command {_describe_exit(code)}" if code is not None else ""
        t_terminated, t_preempted = signalled_at(terminated), signalled_at(preempted)
        if terminated is not None and t_terminated < math.inf and t_terminated <= t_preempted:
            when = _utc(float(terminated["at"])).isoformat(timespec="seconds")
            return make(
                InstanceState.TERMINATED,
                f"terminated by the control plane at {when}" + (f"; {exited}" if exited else ""),
                exit_code=code,
            )
        if code == EXIT_SUCCEEDED:
            return make(InstanceState.SUCCEEDED, "the command exited 0", exit_code=code)
        if preempted is not None and t_preempted < math.inf:
            at = _utc(float(preempted["at"]))
            if code is None or code == -signal.SIGKILL:
                how = "it was still running after the termination window and was killed"
            else:
                how = exited
                if code == EXIT_PREEMPTED:
                    how += " (a checkpoint is committed)"
            return make(
                InstanceState.PREEMPTED,
                f"preempted (spot capacity reclaimed) at {at.isoformat(timespec='seconds')}; {how}",
                exit_code=code,
                preempted_at=at,
            )
        if code == EXIT_PREEMPTED:
            assert ended is not None
            return make(
                InstanceState.PREEMPTED,
                f"the command exited {EXIT_PREEMPTED}: preempted, with a checkpoint committed",
                exit_code=code,
                preempted_at=_utc(float(ended["ended_at"])),
            )
        if code is None:
            return make(
                InstanceState.FAILED,
                "the instance process died without recording an exit code (killed from"
                f" outside trainbot?); {logs}",
            )
        return make(InstanceState.FAILED, f"{exited}; {logs}", exit_code=code)

    def _gpus(self) -> list[str]:
        with self._lock:
            if self._gpu_names is None:
                self._gpu_names = _detect_gpus()
            return list(self._gpu_names)


def _running(
    instance_id: str, preempted: dict[str, Any] | None, terminated: dict[str, Any] | None
) -> InstanceStatus:
    reason = "running"
    if terminated is not None:
        reason = "terminating"
    elif preempted is not None:
        at = _utc(float(preempted["at"])).isoformat(timespec="seconds")
        kill = _utc(float(preempted["kill_at"])).isoformat(timespec="seconds")
        reason = f"preemption notice sent at {at}; killed at {kill} if still running"
    return InstanceStatus(instance_id=instance_id, state=InstanceState.RUNNING, reason=reason)


def _wait_until_dead(process: _Process, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while process.alive():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _quota(*, limit: int, used: int, needed: int, unit: str, detail: str, remedy: str) -> QuotaInfo:
    ok = used + needed <= limit
    return QuotaInfo(
        limit=limit,
        used=used,
        needed=needed,
        unit=unit,
        ok=ok,
        detail=f"{detail}: {used} taken by running local instances, {needed} needed",
        remedy="" if ok else remedy,
    )


def _gpu_matches(name: str, accelerator_type: str | None) -> bool:
    """Whether an ``nvidia-smi`` GPU name is the requested type ("A100", "nvidia-tesla-a100")."""
    if accelerator_type is None or accelerator_type.lower() in ("gpu", "any"):
        return True
    wanted = accelerator_type.lower().removeprefix("nvidia-").removeprefix("tesla-")
    return wanted in name.lower()


def _detect_gpus() -> list[str]:
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

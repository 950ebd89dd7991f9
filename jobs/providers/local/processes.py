"""Instance processes: the wrapper that leads each instance's process group, its launch
(environment, niceness, log file, scratch volume) and the signals sent to it.

POSIX only (process groups, ``fcntl``), like the laptops it runs on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from jobs.providers.base import PASSTHROUGH_ENV, ProviderError
from jobs.providers.local.records import (
    EXIT,
    LOG,
    PROCESS,
    SCRATCH,
    Instances,
    Record,
    write_json,
)
from runner import env as contract
from runner.container import remove_labelled

__all__ = [
    "DEFAULT_NICE",
    "KILL_WAIT_S",
    "Process",
    "kill_instance",
    "process_stat",
    "read_process",
    "spawn",
    "wait_until_dead",
    "wrap_main",
]

log = logging.getLogger(__name__)

# After SIGKILL, how long to wait for the group to go before calling it stuck.
KILL_WAIT_S = 5.0
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
    "from jobs.providers.local.processes import wrap_main; sys.exit(wrap_main(sys.argv[3:]))"
)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])


def process_stat(pid: int) -> tuple[str, str] | None:
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
class Process:
    """The wrapper process of one instance, as recorded in process.json."""

    pid: int
    pgid: int
    start: str

    def alive(self) -> bool:
        stat = process_stat(self.pid)
        return stat is not None and stat[0] not in ("Z", "X") and stat[1] == self.start

    def signal_group(self, sig: signal.Signals) -> None:
        """Signal every process of the instance, and never someone else's.

        While the leader's pid names a different process the group id may have been
        reused, so nothing is sent. While it names no process, a surviving group can only
        be ours: the kernel does not hand out a pid still in use as a group id.
        """
        stat = process_stat(self.pid)
        if stat is not None and stat[1] != self.start:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)


#: The tag of an instance whose runner starts its command in a container (podman).
CONTAINER_TAG = "trainbot-container"


def kill_instance(instances: Instances, instance_id: str, process: Process) -> None:
    """SIGKILL the instance's group, then remove the container its runner started
    (runner.container): podman's client dies with the group, and the container would
    run on, writing to the run's store beside the next attempt."""
    process.signal_group(signal.SIGKILL)
    try:
        tags = instances.load(instance_id).tags
    except ProviderError:  # its directory is gone: nothing recorded to look for
        return
    if CONTAINER_TAG in tags:
        wait_until_dead(process, KILL_WAIT_S)
        removed = remove_labelled("podman", f"trainbot.instance={instance_id}")
        if removed:
            log.info("removed %d container(s) local instance %s left", removed, instance_id)


def read_process(instances: Instances, instance_id: str) -> Process | None:
    data = instances.read(instance_id, PROCESS)
    if data is None:
        return None
    return Process(pid=int(data["pid"]), pgid=int(data["pgid"]), start=str(data["start"]))


def wait_until_dead(process: Process, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while process.alive():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def wrap_main(argv: Sequence[str]) -> int:
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
    stat = process_stat(pid)
    write_json(
        instance_dir / PROCESS,
        asdict(Process(pid=pid, pgid=os.getpgid(0), start=stat[1] if stat else "")),
    )
    try:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    except OSError as e:
        name = command[0] if command else ""
        print(f"trainbot: cannot start {name!r}: {e}", file=sys.stderr, flush=True)
        code = 127 if isinstance(e, FileNotFoundError) else 126
    else:
        code = child.wait()
    write_json(instance_dir / EXIT, {"exit_code": code, "ended_at": time.time()})
    return 0


def spawn(
    instances: Instances,
    record: Record,
    request_env: Mapping[str, str],
    *,
    nice: int,
    workdir: str | None,
) -> None:
    """Start the instance's wrapper as a new session, its output appended to output.log.

    The environment is the request's over a short pass-through list, never the control
    plane's own, which holds its secrets.
    """
    directory = instances.dir(record.instance_id)
    scratch = directory / SCRATCH
    scratch.mkdir(parents=True, exist_ok=True)
    env = {k: os.environ[k] for k in PASSTHROUGH_ENV if k in os.environ}
    env.update(request_env)
    # The instance's share of the cores, as a cloud instance's are its own: without it
    # torch starts a thread per core of this machine in every local instance, and a few
    # runs side by side spend their time contending (100 tiny steps: 80 s, against 14 s
    # with one thread, on two busy cores). A spec's own OMP_NUM_THREADS wins.
    env.setdefault("OMP_NUM_THREADS", str(max(record.cpus, 1)))
    env |= contract.render(
        {
            contract.SCRATCH_DIR: scratch,
            contract.SCRATCH_BYTES: record.scratch_bytes,
            contract.INSTANCE_ID: record.instance_id,
        }
    )
    argv = [sys.executable, "-I", "-c", _WRAP_BOOT, _PACKAGE_ROOT, str(nice)]
    argv += [str(directory), "--"]
    try:
        with open(directory / LOG, "ab") as out:
            child = subprocess.Popen(
                [*argv, *record.command],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=workdir,
                start_new_session=True,
            )
    except OSError as e:
        write_json(directory / EXIT, {"exit_code": 127, "ended_at": time.time()})
        raise ProviderError(
            f"local instance {record.instance_id} for run {record.run_id} could not start"
            f" ({e}); check the python at {sys.executable} and the workdir"
        ) from None
    # Reap the wrapper when it ends, so it is never left a zombie.
    threading.Thread(target=child.wait, name=f"reap-{record.instance_id}", daemon=True).start()
    stat = process_stat(child.pid)
    process = Process(pid=child.pid, pgid=child.pid, start=stat[1] if stat else "")
    # The wrapper writes the same record first thing; this covers a slow start.
    instances.write(record.instance_id, PROCESS, asdict(process))
    log.info(
        "launched local instance %s for run %s attempt %s (pid %d)",
        record.instance_id,
        record.run_id,
        record.attempt_id,
        child.pid,
    )

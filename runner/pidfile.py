"""A process group recorded in a file, so that whoever finds the file after a crash of
the process that wrote it can end what it left running (the preflight dry run).

Standard library only: the control plane reads these files at start, and must not need
torch or any other training dependency to do it.

The file is written twice for each process: once *before* it is spawned, naming only
the dry run's id (a crash in the middle of the spawn leaves a process no pid names yet),
and once after, naming its process group. Whoever ends a stale dry run kills the group
it names and then every process whose environment carries that dry run's id and phase:
so a process spawned just before the crash, or a child that left the group, is ended too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

from runner import env as contract

__all__ = ["end_stale_dry_run", "record_process_group", "record_spawn"]

#: The environment variable every process of a dry run carries (``runner.dryrun``).
_PHASE_KEY = f"{contract.DRY_RUN_PHASE.name}=".encode()


def record_spawn(pid_file: Path, *, run_id: str | None) -> None:
    """Name the dry run whose process is about to be spawned (no group yet)."""
    pid_file.write_text(json.dumps({"pgid": None, "run_id": run_id}))


def record_process_group(pid_file: Path, pgid: int, *, run_id: str | None) -> None:
    """Name the running process group, and the run id its leader's environment carries."""
    pid_file.write_text(json.dumps({"pgid": pgid, "run_id": run_id}))


def end_stale_dry_run(pid_file: Path) -> bool:
    """End the dry run that ``pid_file`` names, left running by a process that crashed
    while it ran; True when one was found and killed.

    A process is killed only while its environment still carries the dry run's
    ``TRAINBOT_RUN_ID``, so a recycled pid is never hit.
    """
    try:
        record = json.loads(pid_file.read_text())
        pgid = None if record.get("pgid") is None else int(record["pgid"])
        run_id = str(record["run_id"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    finally:
        pid_file.unlink(missing_ok=True)
    marker = f"{contract.RUN_ID.name}={run_id}".encode()
    killed = False
    if pgid is not None and marker in _environ(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
            killed = True
    for pid in _dry_run_processes(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed = True
    return killed


def _environ(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []  # gone (or no /proc to tell whose it is: leave it alone)


def _dry_run_processes(marker: bytes) -> list[int]:
    """Live processes of the dry run whose ``TRAINBOT_RUN_ID`` entry is ``marker``."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    found: list[int] = []
    me = os.getpid()
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        environ = _environ(int(entry.name))
        if marker in environ and any(v.startswith(_PHASE_KEY) for v in environ):
            found.append(int(entry.name))
    return found

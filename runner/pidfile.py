"""A process group recorded in a file, so that whoever finds the file after a crash of
the process that wrote it can end what it left running (the preflight dry run).

Standard library only: the control plane reads these files at start, and must not need
torch or any other training dependency to do it.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

__all__ = ["end_stale_dry_run", "record_process_group"]


def record_process_group(pid_file: Path, pgid: int, *, run_id: str | None) -> None:
    """Name the running process group, and the run id its leader's environment carries."""
    pid_file.write_text(json.dumps({"pgid": pgid, "run_id": run_id}))


def end_stale_dry_run(pid_file: Path) -> bool:
    """End the dry run that ``pid_file`` names, left running by a process that crashed
    while it ran; True when one was found and killed.

    The process group is killed only while its leader still carries the dry run's
    ``TRAINBOT_RUN_ID`` in its environment, so a recycled pid is never hit.
    """
    try:
        record = json.loads(pid_file.read_text())
        pgid, run_id = int(record["pgid"]), str(record["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    finally:
        pid_file.unlink(missing_ok=True)
    try:
        environ = Path(f"/proc/{pgid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False  # gone (or no /proc to tell whose it is: leave it alone)
    if f"TRAINBOT_RUN_ID={run_id}".encode() not in environ:
        return False
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True

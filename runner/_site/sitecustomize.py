"""trainbot's site hook: every Python process of a supervised command can dump its stacks.

The supervisor puts this file's directory first on the command's ``PYTHONPATH`` and names
a directory in ``TRAINBOT_STACKS_DIR``. At start-up Python imports this module; it
registers :mod:`faulthandler` on SIGUSR2, writing every thread's stack into
``<pid>.stacks`` there, and leaves ``<pid>.pid`` (the process's start time, so a reused
pid is never signalled). faulthandler dumps from the C signal handler, so a main thread
stuck inside a C call (a hung collective, a deadlocked lock, a blocking read) still shows
where it is: a Python-level handler would never run there.

Then it hands over to the ``sitecustomize`` that this one shadows, if the environment has
one. Standard library only: it runs in the command's own interpreter and environment.
"""

from __future__ import annotations

import os
import sys

#: Variable naming the directory of the dumps (set by the supervisor only).
STACKS_DIR = "TRAINBOT_STACKS_DIR"
#: The signal the supervisor sends; SIGUSR1 is taken by Lightning's SLURM requeue.
SIGNAL_NAME = "SIGUSR2"
#: Open dump files: faulthandler writes to their descriptors, so they must stay open.
_KEEP: list[object] = []


def start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22),
    or "" where there is no ``/proc``: with the pid, it names one process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()
    except (OSError, IndexError):
        return ""


def install(directory: str | None = None) -> bool:
    """Register this process's dump (once); whether it is registered."""
    directory = directory if directory is not None else os.environ.get(STACKS_DIR, "")
    if not directory:
        return False
    import faulthandler
    import signal

    pid = os.getpid()
    started = start_time(pid)
    pid_file = os.path.join(directory, f"{pid}.pid")
    try:
        with open(pid_file, encoding="ascii") as f:
            if started and f.read().strip() == started:
                return True  # this very process registered already (its site hook)
    except OSError:
        pass
    try:
        out = open(os.path.join(directory, f"{pid}.stacks"), "ab", buffering=0)  # noqa: SIM115
        faulthandler.register(getattr(signal, SIGNAL_NAME), file=out, all_threads=True)
        with open(pid_file, "w", encoding="ascii") as f:
            f.write(started)
    except (OSError, RuntimeError, ValueError, AttributeError):
        return False  # no dump for this process; it runs as it would have
    _KEEP.append(out)
    return True


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows (the image's or the venv's), as Python
    would have without trainbot."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if p and os.path.abspath(p) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if __name__ == "sitecustomize":
    install()
    _chain()

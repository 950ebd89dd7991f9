"""A notice handed on to a supervised process with its real deadline.

The supervisor sees a preemption first (its metadata pollers, or its own SIGTERM) and
tells the training process with a SIGTERM, which carries no deadline: the child would
count its window from when that signal arrived, a supervisor's poll after the notice
(and up to the AWS poller's 5 s after the notice was posted), and so believe it had more
time than it has. So before signalling, the supervisor writes the notice here, its
deadline in Unix time (the processes share no monotonic clock by contract), to the file
named by ``TRAINBOT_NOTICE_FILE``; the child's session reads it once its flag is set and
brings its deadline forward. Standard library only.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from runner.preemption.flag import SOURCES, Notice


def write_notice(path: str | Path, notice: Notice) -> None:
    """Write ``notice`` to ``path`` atomically (a reader sees all of it or nothing)."""
    path = Path(path)
    left = notice.deadline - time.monotonic()
    doc = {"source": notice.source, "reason": notice.reason, "deadline_unix": time.time() + left}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def read_notice(path: str | Path) -> Notice | None:
    """The notice in ``path``, on this process's monotonic clock; None while there is none
    (or it cannot be read: the signal's own deadline then stands)."""
    try:
        doc = json.loads(Path(path).read_text())
        deadline_unix = float(doc["deadline_unix"])
        source, reason = str(doc["source"]), str(doc["reason"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if source not in SOURCES:
        return None
    now = time.monotonic()
    deadline = now + (deadline_unix - time.time())
    return Notice(source=source, reason=reason, received_at=now, deadline=deadline)

"""The dry run's two phases as a script's session plays them (``trainbot-runner dry-run``
drives them, :mod:`runner.dryrun`): "save" checkpoints at the step limit the way the run
will and waits to be killed; "verify" restores, reports the state's digest, takes two steps.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

from runner.checkpoint import CheckpointWriter
from runner.preemption import PreemptionFlag
from runner.telemetry import EventSink

#: How many times the dry run saves its checkpoint (see :func:`save_as_the_run_will`).
DRY_RUN_SAVES = 3
#: Steps the "verify" phase takes after its restore.
VERIFY_STEPS = 2


def step_limit(phase: str | None, *, step: int, max_steps: int | None) -> int | None:
    """The step the loop stops at: two after the restore when verifying, else the limit."""
    return step + VERIFY_STEPS if phase == "verify" else max_steps


def report(sink: EventSink, phase: str, *, step: int, state_sha256: str) -> None:
    """Tell the dry run where this phase stands: as an event and on stderr."""
    doc = {"phase": phase, "step": step, "state_sha256": state_sha256}
    sink.emit("dry_run", {"report": doc})
    print(json.dumps({"dry_run": doc}), file=sys.stderr, flush=True)


def save_as_the_run_will(save: Callable[[], None], writer: CheckpointWriter, *, step: int) -> bool:
    """The dry run's checkpoint, saved :data:`DRY_RUN_SAVES` times the way periodic saves
    are (copying the state into staging buffers), so that their stall is measured.

    The first save also allocates the buffers, which a run pays once per attempt; the
    later ones show the stall of every other save. Each rewrites the same step.
    """
    for _ in range(DRY_RUN_SAVES):
        save()
        info = writer.wait()
        if info is None or info.step != step:
            return False
    return True


def await_kill(sink: EventSink, flag: PreemptionFlag) -> None:
    """In the dry run's first phase, wait to be killed like a lost instance would be."""
    if hasattr(sink, "flush"):
        sink.flush(10.0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not flag.is_set:
        time.sleep(0.05)

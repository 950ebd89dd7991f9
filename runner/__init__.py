"""trainbot-runner: the process on every spot instance.

It supervises the training process, checkpoints to the object store, catches the
preemption notice and reports telemetry. It never imports ``jobs`` or ``bot``.
"""

from __future__ import annotations

__all__ = ["EXIT_FAILED", "EXIT_PREEMPTED", "EXIT_SUCCEEDED"]

#: The training finished.
EXIT_SUCCEEDED = 0
#: Preempted: resubmit and resume from the newest committed checkpoint, which the runner
#: flushed if it fitted the window (or from the start if none was ever committed).
EXIT_PREEMPTED = 75
#: Anything else non-zero is a failure; this is the one the runner itself uses.
EXIT_FAILED = 1

"""The runner's exit code, from its child's and what the runner saw.

The control plane reads it (with the events) to tell a preemption from a failure:
:data:`runner.EXIT_PREEMPTED` whenever a notice came, whatever the child made of it.
"""

from __future__ import annotations

from typing import Any

from runner import EXIT_PREEMPTED, EXIT_SUCCEEDED

__all__ = ["exit_code", "flush_before_start"]


def exit_code(code: int, *, reported: int | None, under_torchrun: bool, noticed: bool) -> int:
    """The runner's exit code from its child's: preempted (75) whenever a notice came,
    unless the child said it finished; a signal's death as the shell's 128 + N."""
    if under_torchrun and code > 0 and reported is not None:
        # A worker's 75 (its node was told to stop by another's notice) is torchrun's 1.
        code = reported
    if code < 0 and reported is not None:
        # The child decided its exit code and said so, then a second SIGTERM (sent to
        # the whole process group as well as forwarded by us) ended it first.
        code = reported
    if noticed:
        # Preempted, whatever the child made of it (143 or -15 before it had a handler,
        # 1 from a KeyboardInterrupt, 0 from a script that stops on SIGTERM): resumable,
        # unless the session says it finished with its last step committed.
        finished = code == EXIT_SUCCEEDED and reported == EXIT_SUCCEEDED
        return EXIT_SUCCEEDED if finished else EXIT_PREEMPTED
    if code < 0:
        return 128 - code  # killed by signal N: the shell's 128 + N
    return code


def flush_before_start() -> dict[str, Any]:
    """The exit's flush report for a command that the notice's signal killed before it
    had sent a single event: no trainbot session had caught the signal (none had
    started, or the script uses none), and it made no flush; the next attempt resumes
    from the newest committed checkpoint. Issue 29: a notice in the milliseconds between
    a session script's imports and its session's start killed it with no report at all.
    """
    return {
        "before_start": True,
        "notice_step": None,
        "committed_step": None,
        "flushes": [],
        "trained_on_steps": 0,
        "given_up_steps": 0,
        "summary": "the notice's signal ended the training script without a report of its "
        "own (no trainbot session had started, or it uses none), so it made no flush; the "
        "next attempt resumes from the newest committed checkpoint",
    }

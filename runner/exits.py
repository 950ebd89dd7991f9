"""The runner's exit code, from its child's and what the runner saw.

The control plane reads it (with the events) to tell a preemption from a failure:
:data:`runner.EXIT_PREEMPTED` whenever a notice came, whatever the child made of it.
"""

from __future__ import annotations

from runner import EXIT_PREEMPTED, EXIT_SUCCEEDED

__all__ = ["exit_code"]


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

"""What became of an instance, read from its files; and ending one.

Status is derived from the files alone, so it is the same for instances started by an
earlier control plane, and it enforces a termination window whose timer died with one.
"""

from __future__ import annotations

import logging
import math
import shutil
import signal
import time
from typing import Any

from jobs.providers.base import InstanceInfo, InstanceState, InstanceStatus, ProviderError
from jobs.providers.local.processes import (
    KILL_WAIT_S,
    kill_instance,
    read_process,
    wait_until_dead,
)
from jobs.providers.local.records import (
    EXIT,
    LOG,
    PREEMPTED,
    SCRATCH,
    TERMINATED,
    Instances,
    Record,
    read_json,
    utc,
)
from runner import EXIT_PREEMPTED, EXIT_SUCCEEDED

__all__ = ["end", "info", "state_of"]

log = logging.getLogger(__name__)

# A record without a process this long after launch never got one started.
_START_TIMEOUT_S = 60.0


def info(instances: Instances, record: Record) -> InstanceInfo:
    return InstanceInfo(
        instance_id=record.instance_id,
        run_id=record.run_id,
        attempt_id=record.attempt_id,
        zone=record.zone,
        state=state_of(instances, record).state,
        launched_at=utc(record.launched_at),
        tags=dict(record.tags),
    )


def state_of(instances: Instances, record: Record) -> InstanceStatus:
    instance_id = record.instance_id
    directory = instances.dir(instance_id)
    process = read_process(instances, instance_id)
    preempted = read_json(directory / PREEMPTED)
    terminated = read_json(directory / TERMINATED)
    if process is not None and process.alive():
        if preempted is not None and time.time() >= preempted["kill_at"]:
            # Its timer died with an earlier control plane: enforce the window now.
            kill_instance(instances, instance_id, process)
            wait_until_dead(process, KILL_WAIT_S)
        if process.alive():
            return _running(instance_id, preempted, terminated)

    def make(state: InstanceState, reason: str, **kw: Any) -> InstanceStatus:
        return InstanceStatus(instance_id=instance_id, state=state, reason=reason, **kw)

    ended = read_json(directory / EXIT)
    code: int | None = int(ended["exit_code"]) if ended is not None else None
    logs = f"see the log at {directory / LOG}"
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
        when = utc(float(terminated["at"])).isoformat(timespec="seconds")
        return make(
            InstanceState.TERMINATED,
            f"terminated by the control plane at {when}" + (f"; {exited}" if exited else ""),
            exit_code=code,
        )
    if code == EXIT_SUCCEEDED:
        return make(InstanceState.SUCCEEDED, "the command exited 0", exit_code=code)
    if preempted is not None and t_preempted < math.inf:
        at = utc(float(preempted["at"]))
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
            f"the command exited {EXIT_PREEMPTED}: preempted; the next attempt resumes "
            "from its newest checkpoint",
            exit_code=code,
            preempted_at=utc(float(ended["ended_at"])),
        )
    if code is None:
        return make(
            InstanceState.FAILED,
            "the instance process died without recording an exit code (killed from"
            f" outside trainbot?); {logs}",
        )
    return make(InstanceState.FAILED, f"{exited}; {logs}", exit_code=code)


def end(instances: Instances, record: Record, *, grace_s: float) -> None:
    """SIGTERM to the group, SIGKILL after ``grace_s``; returns once it is gone, its
    scratch volume removed. The caller has written terminated.json first."""
    instance_id = record.instance_id
    process = read_process(instances, instance_id)
    if process is not None:
        if process.alive():
            process.signal_group(signal.SIGTERM)
            wait_until_dead(process, grace_s)
        # Also reaches stragglers in the group after the wrapper has gone.
        kill_instance(instances, instance_id, process)
        if not wait_until_dead(process, KILL_WAIT_S):
            raise ProviderError(
                f"local instance {instance_id} (pid {process.pid}) is still running after"
                " SIGKILL; it is stuck in the kernel: check `ps -o stat -p"
                f" {process.pid}` and reboot if it stays"
            )
    shutil.rmtree(instances.dir(instance_id) / SCRATCH, ignore_errors=True)
    log.info("terminated local instance %s (run %s)", instance_id, record.run_id)


def _running(
    instance_id: str, preempted: dict[str, Any] | None, terminated: dict[str, Any] | None
) -> InstanceStatus:
    reason = "running"
    if terminated is not None:
        reason = "terminating"
    elif preempted is not None:
        at = utc(float(preempted["at"])).isoformat(timespec="seconds")
        kill = utc(float(preempted["kill_at"])).isoformat(timespec="seconds")
        reason = f"preemption notice sent at {at}; killed at {kill} if still running"
    return InstanceStatus(instance_id=instance_id, state=InstanceState.RUNNING, reason=reason)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited {code}"

"""What became of an instance: describe, tell preemption from failure, terminate, list.

Preemption is read from the instance's state reason and the spot request's status; an
instance that shut itself down is classified from the runner's exit code, which the user
data writes to the serial console (docs/architecture.md, "Providers: AWS").
"""

from __future__ import annotations

import base64
import logging
import re
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from botocore.parsers import ResponseParserError

from jobs.providers.aws.clients import Clients, utc
from jobs.providers.aws.errors import error_code
from jobs.providers.base import (
    TAG_ATTEMPT_ID,
    TAG_MANAGED,
    TAG_RUN_ID,
    InstanceInfo,
    InstanceNotFound,
    InstanceState,
    InstanceStatus,
)
from runner import EXIT_PREEMPTED, EXIT_SUCCEEDED
from runner.preemption import WINDOWS_S

__all__ = [
    "TAG_TERMINATED_BY",
    "TERMINATION_WINDOW_S",
    "info",
    "list_instances",
    "status",
    "terminate",
]

log = logging.getLogger(__name__)

#: Put on an instance just before the control plane terminates it, so ``status`` can tell
#: our terminations from everyone else's.
TAG_TERMINATED_BY = "trainbot-terminated-by"
_BY_CONTROL_PLANE = "control-plane"
#: Seconds between EC2's spot interruption notice and the instance being reclaimed.
TERMINATION_WINDOW_S = WINDOWS_S["aws"]

_NOT_FOUND = frozenset({"InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"})
# The instance's state reason when EC2 reclaimed it.
_RECLAIMED = frozenset(
    {
        "Server.SpotInstanceTermination",
        "Server.SpotInstanceShutdown",
        "Server.InsufficientInstanceCapacity",
    }
)
# Spot request status codes of an interruption (the request's side of the story).
_SPOT_INTERRUPTED = frozenset(
    {
        "instance-terminated-by-price",
        "instance-terminated-no-capacity",
        "instance-terminated-capacity-oversubscribed",
        "instance-terminated-launch-group-constraint",
        "instance-terminated-by-experiment",
        "instance-stopped-by-price",
        "instance-stopped-no-capacity",
        "instance-stopped-capacity-oversubscribed",
        "instance-stopped-by-experiment",
    }
)
_SPOT_NOTICE = frozenset({"marked-for-termination", "marked-for-stop"})
_EXIT_MARKER = re.compile(r"trainbot-runner exited with code (\d+)")
_SERVICE_TIME = re.compile(r"\((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) (?:GMT|UTC)\)")

Clock = Callable[[], datetime]


def _tags(item: Mapping[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in item.get("Tags") or ()}


def _decode_console(output: str | None) -> str:
    if not output:
        return ""
    try:
        return base64.b64decode(output, validate=False).decode("utf-8", "replace")
    except ValueError:
        return output


def status(clients: Clients, instance_id: str, *, clock: Clock) -> InstanceStatus:
    """What EC2 says about the instance, with the spot request's side where there is one."""
    inst = _describe(clients, instance_id)
    state = inst["State"]["Name"]
    reason = (inst.get("StateReason") or {}).get("Code", "")
    spot: tuple[str, datetime | None] | None = None
    if inst.get("SpotInstanceRequestId") and reason not in _RECLAIMED:
        spot = _spot_request(clients, inst["SpotInstanceRequestId"])
    exit_code = None
    if (
        state in ("shutting-down", "terminated", "stopping", "stopped")
        and reason == "Client.InstanceInitiatedShutdown"
        and _tags(inst).get(TAG_TERMINATED_BY) != _BY_CONTROL_PLANE
    ):
        exit_code = _exit_code(clients, instance_id)
    return _classify(inst, clock=clock, spot=spot, exit_code=exit_code)


def _describe(clients: Clients, instance_id: str) -> dict[str, Any]:
    ec2 = clients.client("ec2")
    with clients.call("ec2", f"describe {instance_id}"):
        try:
            reservations = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
        except ClientError as exc:
            if error_code(exc) in _NOT_FOUND:
                reservations = []
            else:
                raise
    for reservation in reservations:
        for inst in reservation["Instances"]:
            if inst["InstanceId"] == instance_id:
                return dict(inst)
    raise InstanceNotFound(
        f"EC2 has no instance {instance_id} in {clients.region} (never launched there, or "
        "terminated long enough ago that EC2 forgot it)",
        instance_id=instance_id,
    )


def _spot_request(clients: Clients, request_id: str) -> tuple[str, datetime | None] | None:
    """(status code, when) of a spot request; None when EC2 will not say."""
    try:
        answer = clients.client("ec2").describe_spot_instance_requests(
            SpotInstanceRequestIds=[request_id]
        )
    except (ClientError, BotoCoreError, ResponseParserError) as exc:
        log.info("spot request %s unreadable: %s", request_id, exc)
        return None
    for item in answer.get("SpotInstanceRequests", []):
        found = item.get("Status") or {}
        when = found.get("UpdateTime")
        return str(found.get("Code", "")), utc(when) if when else None
    return None


def _exit_code(clients: Clients, instance_id: str) -> int | None:
    """The runner's exit code, from the line the user data writes to the console."""
    try:
        answer = clients.client("ec2", advisory=True).get_console_output(InstanceId=instance_id)
    except (ClientError, BotoCoreError, ResponseParserError) as exc:
        log.info("console output of %s unreadable: %s", instance_id, exc)
        return None
    codes = _EXIT_MARKER.findall(_decode_console(answer.get("Output")))
    return int(codes[-1]) if codes else None


def _classify(
    inst: Mapping[str, Any],
    *,
    clock: Clock,
    spot: tuple[str, datetime | None] | None = None,
    exit_code: int | None = None,
) -> InstanceStatus:
    iid = inst["InstanceId"]
    state = inst["State"]["Name"]
    state_reason = inst.get("StateReason") or {}
    code = str(state_reason.get("Code", ""))
    said = str(state_reason.get("Message", "")) or code
    spot_code, spot_at = spot if spot is not None else ("", None)

    def make(s: InstanceState, why: str, **kw: Any) -> InstanceStatus:
        return InstanceStatus(instance_id=iid, state=s, reason=why, **kw)

    if state == "pending":
        return make(InstanceState.PENDING, "starting")
    if state == "running":
        if spot_code in _SPOT_NOTICE:
            return make(
                InstanceState.RUNNING,
                f"preemption notice: EC2 reclaims this spot instance within "
                f"{TERMINATION_WINDOW_S:g} s ({spot_code})",
            )
        return make(InstanceState.RUNNING, "running")
    if code in _RECLAIMED or spot_code in _SPOT_INTERRUPTED:
        match = _SERVICE_TIME.search(str(inst.get("StateTransitionReason") or ""))
        if match:
            when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S").replace(
                tzinfo=timezone.utc
            )
        else:
            when = spot_at or clock()
        why = spot_code if spot_code in _SPOT_INTERRUPTED else said
        return make(
            InstanceState.PREEMPTED,
            f"preempted: EC2 reclaimed the spot capacity ({why})",
            preempted_at=when,
        )
    if _tags(inst).get(TAG_TERMINATED_BY) == _BY_CONTROL_PLANE:
        return make(InstanceState.TERMINATED, "terminated by the control plane")
    if code == "Client.InstanceInitiatedShutdown":
        if exit_code == EXIT_SUCCEEDED:
            return make(
                InstanceState.SUCCEEDED,
                "the runner finished and the instance shut down",
                exit_code=exit_code,
            )
        if exit_code == EXIT_PREEMPTED:
            return make(
                InstanceState.PREEMPTED,
                "the runner stopped on a preemption notice and the instance shut down",
                exit_code=exit_code,
                preempted_at=clock(),
            )
        if exit_code is not None:
            return make(
                InstanceState.FAILED,
                f"the runner exited {exit_code} and the instance shut down",
                exit_code=exit_code,
            )
        return make(
            InstanceState.FAILED,
            "the instance shut itself down and its console shows no runner exit code (the "
            f"runner may not have started): aws ec2 get-console-output --instance-id {iid}",
        )
    if state in ("stopping", "stopped"):
        return make(
            InstanceState.FAILED,
            f"stopped ({said or 'no reason given'}); trainbot's instances terminate rather "
            "than stop, so terminate it to stop paying for its volume",
        )
    if code == "Client.UserInitiatedShutdown" or spot_code == "instance-terminated-by-user":
        return make(InstanceState.TERMINATED, "terminated outside trainbot (console, CLI or API)")
    return make(InstanceState.FAILED, f"{state}: {said or 'EC2 gave no reason'}")


def info(inst: Mapping[str, Any], *, clock: Clock) -> InstanceInfo:
    """An instance as DescribeInstances or RunInstances gives it, as the Provider says it."""
    tags = _tags(inst)
    return InstanceInfo(
        instance_id=inst["InstanceId"],
        run_id=tags.get(TAG_RUN_ID, ""),
        attempt_id=tags.get(TAG_ATTEMPT_ID, ""),
        zone=str((inst.get("Placement") or {}).get("AvailabilityZone", "")),
        state=_classify(inst, clock=clock).state,
        launched_at=utc(inst["LaunchTime"]),
        tags=tags,
        # RunInstances gives it at once, so a gang's node 0 can be named to the others.
        address=str(inst.get("PrivateIpAddress") or ""),
    )


def terminate(clients: Clients, instance_id: str) -> None:
    """Tag the instance as ours to end, then terminate it; ended instances are left be."""
    inst = _describe(clients, instance_id)
    if inst["State"]["Name"] in ("shutting-down", "terminated"):
        return
    ec2 = clients.client("ec2")
    with clients.call("ec2", f"terminate {instance_id}"):
        try:
            ec2.create_tags(
                Resources=[instance_id],
                Tags=[{"Key": TAG_TERMINATED_BY, "Value": _BY_CONTROL_PLANE}],
            )
            ec2.terminate_instances(InstanceIds=[instance_id])
        except ClientError as exc:
            if error_code(exc) in _NOT_FOUND:
                raise InstanceNotFound(
                    f"EC2 has no instance {instance_id} in {clients.region}",
                    instance_id=instance_id,
                ) from None
            raise
    log.info("terminated %s", instance_id)


def list_instances(clients: Clients, *, clock: Clock) -> list[InstanceInfo]:
    """Every instance tagged ``trainbot-managed=true`` in the region, in any state."""
    ec2 = clients.client("ec2")
    out: list[InstanceInfo] = []
    with clients.call("ec2", "list trainbot's instances"):
        pages = ec2.get_paginator("describe_instances").paginate(
            Filters=[{"Name": f"tag:{TAG_MANAGED}", "Values": ["true"]}]
        )
        for page in pages:
            for reservation in page["Reservations"]:
                out.extend(info(inst, clock=clock) for inst in reservation["Instances"])
    return out

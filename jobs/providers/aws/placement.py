"""Cluster placement groups for multi-node attempts: one per attempt, created before its
first node and deleted once its nodes are gone.

A cluster group puts the nodes in one zone on a low-latency network, which is what the
collectives of a multi-node run need. The group is tagged like the instances, so the IAM
policy can confine the control plane to trainbot's own groups. EC2 refuses to delete a
group while any instance in it is still shutting down, which right after a terminate is
the usual case; so a gang's end deletes its group if it can, and :func:`sweep`, run with
every ``list_instances``, deletes those left behind. A group costs nothing, so one that
lingers for a while is harmless; none of this ever fails the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, MutableSet, Sequence
from datetime import datetime, timedelta
from typing import Any

from botocore.exceptions import ClientError

from jobs.providers.aws.clients import Clients, utc
from jobs.providers.aws.errors import error_code
from jobs.providers.base import (
    TAG_ATTEMPT_ID,
    TAG_MANAGED,
    TAG_NODE,
    TAG_OWNER,
    TAG_RUN_ID,
    InstanceInfo,
    LaunchRequest,
    ProviderError,
    ProviderPermissionError,
)

__all__ = [
    "EMPTY_GRACE",
    "TAG_CREATED_AT",
    "check_permission",
    "delete",
    "ensure",
    "release",
    "sweep",
]

log = logging.getLogger(__name__)

#: On each group: when the control plane created it (ISO 8601, UTC). DescribePlacementGroups
#: gives no creation time, and the sweep must not take a group whose first node is being
#: launched right now for an abandoned one.
TAG_CREATED_AT = "trainbot-created-at"
#: How long a group that holds no instance of ours is left alone: far longer than a gang's
#: launch takes, and a group costs nothing meanwhile.
EMPTY_GRACE = timedelta(hours=1)
_STRATEGY = "cluster"
_PREFIX = "trainbot-"


def _tagging(*, run_id: str, attempt_id: str, owner: str, now: datetime) -> list[dict[str, Any]]:
    tags = {
        TAG_MANAGED: "true",
        TAG_RUN_ID: run_id,
        TAG_ATTEMPT_ID: attempt_id,
        TAG_OWNER: owner,
        TAG_CREATED_AT: utc(now).isoformat(timespec="seconds"),
    }
    return [
        {
            "ResourceType": "placement-group",
            "Tags": [{"Key": k, "Value": v[:256]} for k, v in tags.items()],
        }
    ]


def ensure(clients: Clients, req: LaunchRequest, *, now: datetime) -> None:
    """Create the attempt's cluster placement group; one that exists already (a retried or
    adopted launch) is the one to use."""
    name = req.placement_group
    ec2 = clients.client("ec2")
    with clients.call("ec2", f"create the cluster placement group {name}"):
        try:
            ec2.create_placement_group(
                GroupName=name,
                Strategy=_STRATEGY,
                TagSpecifications=_tagging(
                    run_id=req.run_id, attempt_id=req.attempt_id, owner=req.owner, now=now
                ),
            )
        except ClientError as exc:
            if error_code(exc) != "InvalidPlacementGroup.Duplicate":
                raise
            return
    log.info("created placement group %s for attempt %s", name, req.attempt_id)


def check_permission(clients: Clients, *, now: datetime) -> None:
    """Ask EC2 whether the control plane may create a tagged cluster group (``DryRun``),
    creating nothing."""
    with clients.call("ec2", "create a cluster placement group (dry run)"):
        try:
            clients.client("ec2").create_placement_group(
                DryRun=True,
                GroupName=f"{_PREFIX}permission-check",
                Strategy=_STRATEGY,
                TagSpecifications=_tagging(
                    run_id="preflight", attempt_id="permission-check", owner="trainbot", now=now
                ),
            )
        except ClientError as exc:
            if error_code(exc) != "DryRunOperation":
                raise


def delete(clients: Clients, name: str, *, in_use: int = logging.INFO) -> bool:
    """Delete the group; False when EC2 will not yet (an instance in it is still shutting
    down: logged at level ``in_use``, since the sweep meets that often) or at all (a
    warning). Never raises: the sweep tries again."""
    try:
        with clients.call("ec2", f"delete the placement group {name}"):
            try:
                clients.client("ec2").delete_placement_group(GroupName=name)
            except ClientError as exc:
                code = error_code(exc)
                if code == "InvalidPlacementGroup.Unknown":
                    return True
                if code == "InvalidPlacementGroup.InUse":
                    log.log(
                        in_use,
                        "placement group %s still holds instances that are shutting down; "
                        "it is deleted on a later pass",
                        name,
                    )
                    return False
                raise
    except ProviderError as exc:
        log.warning("could not delete placement group %s (tried again later): %s", name, exc)
        return False
    log.info("deleted placement group %s", name)
    return True


def release(clients: Clients, node_ids: Sequence[str]) -> None:
    """Delete the groups of a gang whose nodes were just terminated (best effort)."""
    groups: set[str] = set()
    try:
        with clients.call("ec2", "find the placement group of " + ", ".join(node_ids)):
            pages = (
                clients.client("ec2")
                .get_paginator("describe_instances")
                .paginate(InstanceIds=list(node_ids))
            )
            for page in pages:
                for reservation in page["Reservations"]:
                    for inst in reservation["Instances"]:
                        name = str((inst.get("Placement") or {}).get("GroupName") or "")
                        if name.startswith(_PREFIX):
                            groups.add(name)
    except ProviderError as exc:
        log.info("placement group of %s not found now (%s); the sweep deletes it", node_ids, exc)
        return
    for name in sorted(groups):
        delete(clients, name)


def _groups(clients: Clients) -> list[dict[str, Any]]:
    with clients.call("ec2", "list trainbot's placement groups"):
        answer = clients.client("ec2").describe_placement_groups(
            Filters=[{"Name": f"tag:{TAG_MANAGED}", "Values": ["true"]}]
        )
    return [dict(g) for g in answer.get("PlacementGroups", [])]


def _created(tags: dict[str, str]) -> datetime | None:
    try:
        return utc(datetime.fromisoformat(tags[TAG_CREATED_AT]))
    except (KeyError, ValueError):
        return None


def sweep(
    clients: Clients,
    instances: Iterable[InstanceInfo],
    *,
    now: datetime,
    warned: MutableSet[str],
) -> list[str]:
    """Delete the trainbot groups whose gang has ended: every node of it ended, or none
    left and the group older than :data:`EMPTY_GRACE`. ``instances``: the region's
    trainbot instances, as just listed. Returns the names deleted. A missing permission is
    logged once per region (``warned`` remembers), since this runs with every listing."""
    try:
        groups = _groups(clients)
    except ProviderPermissionError as exc:
        if clients.region not in warned:
            warned.add(clients.region)
            log.warning("placement groups of %s are not cleaned up: %s", clients.region, exc)
        return []
    except ProviderError as exc:
        log.info("placement groups of %s not listed this time: %s", clients.region, exc)
        return []
    nodes = [i for i in instances if TAG_NODE in i.tags and i.attempt_id]
    running = {i.attempt_id for i in nodes if not i.state.is_terminal()}
    seen = {i.attempt_id for i in nodes}
    deleted: list[str] = []
    for group in groups:
        name = str(group.get("GroupName", ""))
        tags = {t["Key"]: t["Value"] for t in group.get("Tags") or ()}
        attempt = tags.get(TAG_ATTEMPT_ID, "")
        if not name.startswith(_PREFIX) or group.get("State") != "available":
            continue
        if attempt in running:
            continue
        created = _created(tags)
        if attempt not in seen and created is not None and now - created < EMPTY_GRACE:
            continue  # its first node may be being launched right now
        if delete(clients, name, in_use=logging.DEBUG):
            deleted.append(name)
    return deleted

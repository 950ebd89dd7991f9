"""AWS at the network edge: moto's server on 127.0.0.1, and an S3 that always refuses.

Tests talk to these over real HTTP with the real boto3 client, so request signing,
retries, XML parsing and error codes are all exercised. The server also answers EC2's
placement-group calls, which moto lacks (the section at the end).
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import boto3
from moto.core.responses import ActionResult, EmptyResult
from moto.ec2.exceptions import EC2ClientError
from moto.ec2.responses import EC2Response
from moto.ec2.responses.instances import InstanceResponse
from moto.server import ThreadedMotoServer

from tests.fakes.loopback import QuietHandler, read_body, reply, serving


class MotoServer:
    """moto's threaded server on a free port of 127.0.0.1."""

    def __init__(self) -> None:
        # Port 0: the kernel picks a free port, so parallel sessions never collide.
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint_url = ""

    def start(self) -> str:
        serve_placement_groups()
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        return self.endpoint_url

    def stop(self) -> None:
        self._server.stop()


def create_bucket(endpoint_url: str, *, prefix: str = "test") -> str:
    """A new, uniquely named bucket on the server; returns its name."""
    name = f"{prefix}-{uuid.uuid4().hex[:16]}"
    client = boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1")
    client.create_bucket(Bucket=name)
    return name


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (connecting is refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _RefusingHandler(QuietHandler):
    protocol_version = "HTTP/1.1"
    status = 403
    code = "AccessDenied"
    #: The region S3 names on a refusal (``x-amz-bucket-region``), or None: no header.
    region: str | None = None

    def _refuse(self) -> None:
        read_body(self)
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{self.code}</Code><Message>refused by the test</Message>"
            "<RequestId>fake</RequestId></Error>"
        ).encode()
        region = () if self.region is None else [("x-amz-bucket-region", self.region)]
        reply(self, self.status, body, "application/xml", headers=region)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _refuse


@contextmanager
def refusing_s3(
    *, status: int = 403, code: str = "AccessDenied", region: str | None = None
) -> Iterator[str]:
    """An S3 endpoint that answers every request with one error (naming ``region`` in
    the ``x-amz-bucket-region`` header when given); yields its URL."""
    attrs = {"status": status, "code": code, "region": region}
    with serving(type("Handler", (_RefusingHandler,), attrs)) as url:
        yield url


# -- EC2 placement groups, which moto lacks ------------------------------------------------
#
# moto 5 answers CreatePlacementGroup with a 500 and ignores RunInstances'
# Placement.GroupName. The AWS provider puts a multi-node attempt's nodes in a cluster
# placement group, so the server learns the three calls, as EC2 answers them over its
# query protocol: groups per account and region, tags on create, DryRun, the errors EC2
# gives (``InvalidPlacementGroup.Duplicate``, ``.Unknown``, ``.InUse``), instances
# launched into a group (their ``Placement.GroupName``), and a cluster group that has no
# room for another instance (``InsufficientInstanceCapacity``, the usual way a cluster
# launch fails). The groups live beside moto's own model in this process, like it.


@dataclass
class PlacementGroup:
    """One group as EC2 keeps it."""

    name: str
    group_id: str
    strategy: str
    region: str
    account: str
    tags: dict[str, str] = field(default_factory=dict)


class PlacementGroups:
    """Every placement group the server holds, and the room tests give cluster groups."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[tuple[str, str, str], PlacementGroup] = {}
        #: (region, name) → how many running instances the group may hold; a name may be
        #: limited before the group exists (the provider creates it during the launch).
        self._room: dict[tuple[str, str], int] = {}

    def limit(self, name: str, *, instances: int, region: str) -> None:
        with self._lock:
            self._room[(region, name)] = instances

    def room(self, name: str, *, region: str) -> int | None:
        with self._lock:
            return self._room.get((region, name))

    def get(self, account: str, region: str, name: str) -> PlacementGroup | None:
        with self._lock:
            return self._groups.get((account, region, name))

    def add(self, group: PlacementGroup) -> bool:
        """False when a group of that name exists already."""
        with self._lock:
            key = (group.account, group.region, group.name)
            if key in self._groups:
                return False
            self._groups[key] = group
            return True

    def remove(self, account: str, region: str, name: str) -> None:
        with self._lock:
            self._groups.pop((account, region, name), None)

    def all(self, account: str, region: str) -> list[PlacementGroup]:
        with self._lock:
            return [g for (a, r, _), g in self._groups.items() if (a, r) == (account, region)]


#: The server's groups: module state, as moto's own backends are.
PLACEMENT_GROUPS = PlacementGroups()
_LIVE = frozenset({"pending", "running", "stopping", "stopped", "shutting-down"})


def _members(backend: Any, name: str, *, live: bool = True) -> list[Any]:
    return [
        i
        for i in backend.all_instances()
        if i.placement.group_name == name and (not live or i._state.name in _LIVE)
    ]


def _unknown(name: str) -> EC2ClientError:
    return EC2ClientError(
        "InvalidPlacementGroup.Unknown", f"The Placement Group '{name}' is unknown."
    )


def _as_answer(group: PlacementGroup) -> dict[str, Any]:
    return {
        "GroupName": group.name,
        "GroupId": group.group_id,
        "State": "available",
        "Strategy": group.strategy,
        "GroupArn": f"arn:aws:ec2:{group.region}:{group.account}:placement-group/{group.name}",
        "Tags": [{"Key": k, "Value": v} for k, v in group.tags.items()],
    }


def _create_placement_group(self: Any) -> ActionResult:
    name = str(self._get_param("GroupName") or "")
    strategy = str(self._get_param("Strategy") or "")
    if not name or strategy not in ("cluster", "spread", "partition"):
        raise EC2ClientError(
            "InvalidParameterValue",
            f"Invalid placement group name or strategy ({name!r}, {strategy!r})",
        )
    tags = self._parse_tag_specification("placement-group").get("placement-group", {})
    self.error_on_dryrun()
    group = PlacementGroup(
        name=name,
        group_id=f"pg-{uuid.uuid4().hex[:17]}",
        strategy=strategy,
        region=self.region,
        account=self.current_account,
        tags=dict(tags),
    )
    if not PLACEMENT_GROUPS.add(group):
        raise EC2ClientError(
            "InvalidPlacementGroup.Duplicate", f"The Placement Group '{name}' already exists."
        )
    return ActionResult({"PlacementGroup": _as_answer(group)})


def _describe_placement_groups(self: Any) -> ActionResult:
    names = self._get_param("GroupNames", []) or []
    self.error_on_dryrun()
    groups = PLACEMENT_GROUPS.all(self.current_account, self.region)
    if names:
        known = {g.name for g in groups}
        for name in names:
            if name not in known:
                raise _unknown(name)
        groups = [g for g in groups if g.name in names]

    def passes(group: PlacementGroup, key: str, values: list[str]) -> bool:
        if key == "group-name":
            found = [group.name]
        elif key == "strategy":
            found = [group.strategy]
        elif key == "state":
            found = ["available"]
        elif key == "tag-key":
            found = list(group.tags)
        elif key.startswith("tag:"):
            found = [group.tags[key[4:]]] if key[4:] in group.tags else []
        else:
            raise EC2ClientError("InvalidParameterValue", f"The filter '{key}' is invalid")
        return any(fnmatchcase(f, v) for f in found for v in values)

    filters = self._filters_from_querystring()
    groups = [g for g in groups if all(passes(g, k, v) for k, v in filters.items())]
    return ActionResult({"PlacementGroups": [_as_answer(g) for g in groups]})


def _delete_placement_group(self: Any) -> ActionResult:
    name = str(self._get_param("GroupName") or "")
    self.error_on_dryrun()
    if PLACEMENT_GROUPS.get(self.current_account, self.region, name) is None:
        raise _unknown(name)
    if _members(self.ec2_backend, name):
        # EC2 keeps a group while any instance in it has not finished terminating.
        raise EC2ClientError(
            "InvalidPlacementGroup.InUse",
            f"The placement group '{name}' is in use and may not be deleted.",
        )
    PLACEMENT_GROUPS.remove(self.current_account, self.region, name)
    return EmptyResult()


def _run_instances(self: Any) -> ActionResult:
    name = self._get_param("Placement.GroupName")
    if not name:
        return InstanceResponse.run_instances(self)
    group = PLACEMENT_GROUPS.get(self.current_account, self.region, name)
    if group is None:
        raise _unknown(name)
    room = PLACEMENT_GROUPS.room(name, region=self.region)
    count = int(self._get_param("MinCount", if_none="1"))
    if room is not None and len(_members(self.ec2_backend, name)) + count > room:
        itype = self._get_param("InstanceType", "m1.small")
        raise EC2ClientError(
            "InsufficientInstanceCapacity",
            f"We currently do not have sufficient {itype} capacity in the placement group "
            f"'{name}'. Our system will be working on provisioning additional capacity.",
        )
    result = InstanceResponse.run_instances(self)
    reservation: Any = result.result
    for inst in reservation.instances:
        inst.placement.group_name = name
    return result


def serve_placement_groups() -> None:
    """Teach moto's EC2 server placement groups (idempotent; see the section above)."""
    actions = {
        "create_placement_group": _create_placement_group,
        "describe_placement_groups": _describe_placement_groups,
        "delete_placement_group": _delete_placement_group,
        # Shadows InstanceResponse's, which it calls.
        "run_instances": _run_instances,
    }
    for name, action in actions.items():
        setattr(EC2Response, name, action)

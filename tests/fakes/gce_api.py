"""A local Compute Engine REST API (and the bits of Cloud Storage and the instance
metadata server that trainbot touches), for the real ``google-cloud-compute`` client.

Real HTTP on 127.0.0.1 (port 0): the provider under test builds its clients with
``client_options.api_endpoint="http://127.0.0.1:PORT"`` and anonymous credentials, so
every request goes through the client's REST transport, URL building, JSON encoding and
error mapping exactly as it would against compute.googleapis.com. The fake answers with
the JSON the real API answers (field names, ``selfLink`` URLs, aggregated scopes,
operations, error bodies) for the calls trainbot makes:

- ``projects.get`` (quota ``GPUS_ALL_REGIONS``), ``regions.get`` (regional quotas, zones)
- ``acceleratorTypes.list`` and ``aggregatedList``
- ``instances.insert`` (``requestId`` idempotency; ``alreadyExists`` on a taken name;
  validation of names, labels and scheduling; quota), ``get``, ``delete``, ``list``,
  ``aggregatedList`` (``filter`` on labels), ``getGuestAttributes``
- ``zoneOperations.list`` (``filter`` on ``operationType``), ``get``, ``wait``
- ``resourcePolicies.insert``, ``get``, ``delete``, ``list`` (regional compact placement
  policies: ``alreadyExists`` on a taken name, ``resourceInUseByAnotherResource`` while an
  instance lists the policy; ``filter`` as for other lists) and ``regionOperations.get``, ``wait``; instances list their
  ``resourcePolicies`` (at most ``vmCount`` of them per policy, in its region) and each
  gets a distinct private ``networkIP``
- Cloud Storage ``buckets.get`` (a bucket's location)

Test hooks play the parts of the cloud and the guest: :meth:`preempt` (status
TERMINATED, a ``compute.instances.preempted`` operation, and deletion when the instance
asked for ``instanceTerminationAction=DELETE``), :meth:`exhaust` (inserts end in
``ZONE_RESOURCE_POOL_EXHAUSTED``, optionally after a number of inserts that still
succeed), :meth:`deny` / :meth:`allow_only` (403 with the real
error body naming the permission), :meth:`age_policy` (a resource policy's
``creationTimestamp`` moved back), :meth:`guest_exit` (what the startup script does
when the runner ends), and :meth:`metadata_server` (an instance's metadata server, for
running the real startup script).
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

from tests.fakes.loopback import ClosedOnExit, LoopbackServer, QuietHandler, read_body, reply

__all__ = ["GCE_PERMISSIONS", "FakeComputeApi", "Seen"]

_BASE = "https://www.googleapis.com/compute/v1/"
_NAME = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")
_LABEL_KEY = re.compile(r"[a-z][a-z0-9_-]{0,62}")
_LABEL_VALUE = re.compile(r"[a-z0-9_-]{0,63}")
_RUNNING = ("PROVISIONING", "STAGING", "RUNNING", "STOPPING")

#: Every permission the fake checks, by what it guards (for tests that deny them).
GCE_PERMISSIONS = frozenset(
    {
        "compute.projects.get",
        "compute.regions.get",
        "compute.acceleratorTypes.list",
        "compute.instances.create",
        "compute.disks.create",
        "compute.instances.setMetadata",
        "compute.instances.setLabels",
        "compute.instances.setServiceAccount",
        "compute.subnetworks.use",
        "compute.subnetworks.useExternalIp",
        "iam.serviceAccounts.actAs",
        "compute.instances.get",
        "compute.instances.getGuestAttributes",
        "compute.instances.delete",
        "compute.instances.list",
        "compute.zoneOperations.get",
        "compute.zoneOperations.list",
        "compute.resourcePolicies.create",
        "compute.resourcePolicies.get",
        "compute.resourcePolicies.delete",
        "compute.resourcePolicies.list",
        "compute.resourcePolicies.use",
        "compute.regionOperations.get",
        "storage.buckets.get",
    }
)


@dataclass(frozen=True)
class Seen:
    """One request as the fake saw it."""

    method: str
    #: Path without the query string.
    path: str
    #: Decoded query parameters (first value of each).
    query: Mapping[str, str]
    #: The status the fake answered.
    status: int


class ApiError(Exception):
    """An error answer, in the body format of the API that raised it."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "code": self.status,
                "message": self.message,
                "errors": [{"message": self.message, "domain": "global", "reason": self.reason}],
            }
        }


def _stamp(when: datetime) -> str:
    """RFC 3339 with milliseconds and a numeric offset, as Compute Engine writes times."""
    return when.astimezone(timezone(timedelta(hours=-8))).isoformat(timespec="milliseconds")


def _last(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


#: What answers a request: (handler, body) -> (status, payload, content type).
Route = Callable[[BaseHTTPRequestHandler, bytes], tuple[int, bytes, str]]


class _Handler(QuietHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    route: Route

    def _any(self) -> None:
        status, payload, content_type = self.route(self, read_body(self))
        reply(self, status, payload, content_type)

    do_GET = do_POST = do_DELETE = do_PUT = _any


def _serve(route: Route) -> LoopbackServer:
    handler = type("Handler", (_Handler,), {"route": staticmethod(route)})
    return LoopbackServer(handler, poll_interval=0.02)


_T = TypeVar("_T")


def _found(found: _T | None, resource: str) -> _T:
    """``found``, or Compute's 404 for ``resource`` when it is not there."""
    if found is None:
        raise ApiError(404, "notFound", f"The resource '{resource}' was not found")
    return found


def _named(body: Mapping[str, Any], rule: str) -> str:
    """The body's ``name``, or the 400 Compute answers for one it refuses, quoting
    ``rule`` (the regex of the resource's kind, as its message says it)."""
    name = str(body.get("name", ""))
    if not _NAME.fullmatch(name):
        raise ApiError(
            400,
            "invalid",
            f"Invalid value for field 'resource.name': '{name}'. Must be a match of regex '{rule}'",
        )
    return name


def _json(status: int, data: Any) -> tuple[int, bytes, str]:
    return status, json.dumps(data).encode(), "application/json; charset=UTF-8"


class FakeComputeApi(ClosedOnExit):
    """One project's Compute Engine, served over HTTP on 127.0.0.1."""

    def __init__(
        self,
        *,
        project: str = "trainbot-test",
        regions: Mapping[str, Sequence[str]] | None = None,
        accelerators: Mapping[str, Mapping[str, int]] | None = None,
        quotas: Mapping[str, Mapping[str, float]] | None = None,
        project_quotas: Mapping[str, float] | None = None,
        buckets: Mapping[str, str] | None = None,
        page_size: int = 500,
    ) -> None:
        """``regions``: region → zones. ``accelerators``: zone → {type: max per instance}.
        ``quotas``: region → {metric: limit}. ``buckets``: name → location ("US-CENTRAL1")."""
        self.project = project
        self.project_number = "123456789012"
        self.regions = {r: list(z) for r, z in (regions or _default_regions()).items()}
        self.accelerators = {
            z: dict(a) for z, a in (accelerators or _default_accelerators(self.regions)).items()
        }
        self.quotas = {r: dict(q) for r, q in (quotas or _default_quotas(self.regions)).items()}
        self.project_quotas = dict(
            project_quotas or {"GPUS_ALL_REGIONS": 16, "CPUS_ALL_REGIONS": 512}
        )
        self.buckets = dict(buckets or {})
        self.page_size = page_size
        self.seen: list[Seen] = []
        self._lock = threading.RLock()
        self._instances: dict[tuple[str, str], dict[str, Any]] = {}
        self._guest: dict[tuple[str, str], dict[str, str]] = {}
        self._operations: dict[tuple[str, str], dict[str, Any]] = {}
        self._request_ids: dict[str, tuple[str, str]] = {}
        self._deleting: dict[tuple[str, str], int] = {}
        # Zone → inserts that still succeed there before it runs out.
        self._exhausted: dict[str, int] = {}
        self._policies: dict[tuple[str, str], dict[str, Any]] = {}
        self._region_operations: dict[tuple[str, str], dict[str, Any]] = {}
        self._addresses = itertools.count(2)
        self._denied: set[str] = set()
        self._allowed: set[str] | None = None
        self._ids = itertools.count(4_000_000_000_000_000_001)
        #: (project, image name) → image; the public Deep Learning VM and Debian families
        #: are there from the start (:meth:`add_image` adds others).
        self.images: dict[tuple[str, str], dict[str, Any]] = {}
        self._boot_images: dict[tuple[str, str], str] = {}
        for image_project, name, family in _DEFAULT_IMAGES:
            self.add_image(image_project, name, family=family)
        self._server = _serve(self._handle)
        self.url = self._server.url

    # -- images -----------------------------------------------------------------------------

    def add_image(
        self, project: str, name: str, *, family: str | None = None, deprecated: bool = False
    ) -> dict[str, Any]:
        """An image in ``project`` (images are global); newest last within a family."""
        with self._lock:
            image: dict[str, Any] = {
                "kind": "compute#image",
                "id": str(next(self._ids)),
                "name": name,
                "selfLink": f"{_BASE}projects/{project}/global/images/{name}",
                "status": "READY",
                "diskSizeGb": "50",
                "creationTimestamp": _stamp(datetime.now(timezone.utc)),
            }
            if family:
                image["family"] = family
            if deprecated:
                image["deprecated"] = {"state": "DEPRECATED"}
            self.images[(project, name)] = image
            return image

    def boot_image(self, zone: str, name: str) -> str | None:
        """The image an instance's boot disk was made from (the disk's ``sourceImage``)."""
        with self._lock:
            return self._boot_images.get((zone, name))

    def _image(self, project: str, rest: str) -> dict[str, Any]:
        """``images.get`` (``NAME``) and ``images.getFromFamily`` (``family/FAMILY``)."""
        resource = f"projects/{project}/global/images/{rest}"
        with self._lock:
            if not rest.startswith("family/"):
                return copy.deepcopy(_found(self.images.get((project, rest)), resource))
            family = rest[len("family/") :]
            found = [
                i
                for (p, _), i in self.images.items()
                if p == project and i.get("family") == family and "deprecated" not in i
            ]
            return copy.deepcopy(_found(found[-1] if found else None, resource))

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        self._server.close()

    # -- test hooks -------------------------------------------------------------------------

    def exhaust(self, zone: str, *, exhausted: bool = True, after: int = 0) -> None:
        """Make inserts in ``zone`` end in ZONE_RESOURCE_POOL_EXHAUSTED (or stop doing so);
        ``after``: that many more inserts succeed first (the zone had room for so many)."""
        with self._lock:
            if exhausted:
                self._exhausted[zone] = after
            else:
                self._exhausted.pop(zone, None)

    def resource_policies(self) -> list[dict[str, Any]]:
        """Every resource policy that exists now (deep copies)."""
        with self._lock:
            return [copy.deepcopy(p) for p in self._policies.values()]

    def age_policy(self, region: str, name: str, by: timedelta) -> None:
        """Move a resource policy's ``creationTimestamp`` back by ``by``, as if it had been
        created that long before."""
        with self._lock:
            policy = self._policy(region, name)
            created = datetime.fromisoformat(policy["creationTimestamp"])
            policy["creationTimestamp"] = _stamp(created - by)

    def deny(self, *permissions: str) -> None:
        """Answer 403 to any request that needs one of these permissions."""
        with self._lock:
            self._denied.update(permissions)

    def allow_only(self, permissions: Sequence[str] | frozenset[str] | set[str]) -> None:
        """Grant exactly these permissions (as a custom role would); everything else is 403."""
        with self._lock:
            self._allowed = set(permissions)

    def preempt(self, zone: str, name: str, *, at: datetime | None = None) -> dict[str, Any]:
        """Preempt a spot instance as Compute Engine does; returns the system operation."""
        with self._lock:
            inst = self._instances[(zone, name)]
            when = at or datetime.now(timezone.utc)
            op = self._operation(
                zone,
                inst,
                "compute.instances.preempted",
                user="system",
                name=f"systemevent-{int(when.timestamp() * 1000)}-{next(self._ids):x}",
                when=when,
                status_message="Instance was preempted.",
            )
            inst["status"] = "TERMINATED"
            inst["lastStopTimestamp"] = _stamp(when)
            action = inst.get("scheduling", {}).get("instanceTerminationAction", "STOP")
            if action == "DELETE":
                self._remove(zone, name)
            return copy.deepcopy(op)

    def guest_exit(self, zone: str, name: str, exit_code: int) -> None:
        """What the startup script does when the runner ends: report the exit code as a
        guest attribute, then halt the guest (the instance goes TERMINATED)."""
        with self._lock:
            self.put_guest_attribute(zone, name, "trainbot", "exit-code", str(exit_code))
            self.set_status(zone, name, "TERMINATED")

    def put_guest_attribute(
        self, zone: str, name: str, namespace: str, key: str, value: str
    ) -> None:
        with self._lock:
            inst = self._instances[(zone, name)]
            if _metadata(inst).get("enable-guest-attributes", "").upper() != "TRUE":
                raise ApiError(
                    400, "badRequest", "Guest attributes are disabled for this instance."
                )
            self._guest.setdefault((zone, name), {})[f"{namespace}/{key}"] = value

    def set_status(self, zone: str, name: str, status: str) -> None:
        with self._lock:
            inst = self._instances[(zone, name)]
            inst["status"] = status
            if status == "TERMINATED":
                inst["lastStopTimestamp"] = _stamp(datetime.now(timezone.utc))

    def instances(self) -> list[dict[str, Any]]:
        """Every instance that exists now (deep copies)."""
        with self._lock:
            return [copy.deepcopy(i) for i in self._instances.values()]

    def instance(self, zone: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            inst = self._instances.get((zone, name))
            return copy.deepcopy(inst) if inst is not None else None

    def operations(self, zone: str) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(o) for (z, _), o in self._operations.items() if z == zone]

    def calls(self, method: str, pattern: str) -> list[Seen]:
        """Requests whose method matches and whose path matches the regex ``pattern``."""
        with self._lock:
            return [s for s in self.seen if s.method == method and re.search(pattern, s.path)]

    @contextmanager
    def metadata_server(self, zone: str, name: str) -> Iterator[str]:
        """The metadata server of one instance (attributes from its metadata, guest
        attributes written back here); yields its base URL."""

        def handle(req: BaseHTTPRequestHandler, body: bytes) -> tuple[int, bytes, str]:
            return self._metadata_request(zone, name, req, body)

        with _serve(handle) as server:
            yield server.url

    # -- the HTTP front ---------------------------------------------------------------------

    def _handle(self, req: BaseHTTPRequestHandler, body: bytes) -> tuple[int, bytes, str]:
        parts = urlsplit(req.path)
        path = unquote(parts.path)
        query = {k: v[0] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        try:
            status, data = self._route(req.command, path, query, body)
        except ApiError as e:
            status, data = e.status, e.body()
        with self._lock:
            self.seen.append(Seen(req.command, path, query, status))
        return _json(status, data)

    def _route(
        self, method: str, path: str, query: Mapping[str, str], body: bytes
    ) -> tuple[int, Any]:
        m = re.fullmatch(r"/storage/v1/b/([^/]+)", path)
        if m and method == "GET":
            with self._lock:
                return 200, self._bucket(m.group(1))
        m = re.fullmatch(r"/compute/v1/projects/([^/]+)/global/images/((?:family/)?[^/]+)", path)
        if m and method == "GET":  # images are readable across projects (public families)
            self._check(
                ["compute.images.getFromFamily" if "/" in m.group(2) else "compute.images.get"],
                f"projects/{m.group(1)}/global/images/{m.group(2)}",
            )
            return 200, self._image(m.group(1), m.group(2))
        m = re.fullmatch(r"/compute/v1/projects/([^/]+)(/.*)?", path)
        if not m:
            raise ApiError(404, "notFound", f"The requested URL {path} was not found.")
        project, rest = m.group(1), m.group(2) or ""
        if project != self.project:
            raise ApiError(404, "notFound", f"The resource 'projects/{project}' was not found")
        with self._lock:
            return self._compute(method, rest, query, body)

    def _compute(
        self, method: str, rest: str, query: Mapping[str, str], body: bytes
    ) -> tuple[int, Any]:
        p = f"projects/{self.project}"
        if rest == "" and method == "GET":
            self._check(["compute.projects.get"], p)
            return 200, self._project()
        if m := re.fullmatch(r"/regions/([^/]+)", rest):
            self._check(["compute.regions.get"], f"{p}/regions/{m.group(1)}")
            return 200, self._region(m.group(1))
        if m := re.fullmatch(r"/regions/([^/]+)(/.+)", rest):
            return self._regional(method, m.group(1), m.group(2), query, body)
        if rest == "/aggregated/acceleratorTypes":
            self._check(["compute.acceleratorTypes.list"], p)
            return 200, self._aggregated("acceleratorTypes", self._accelerator_types, query)
        if rest == "/aggregated/instances":
            self._check(["compute.instances.list"], p)
            self._settle()
            return 200, self._aggregated("instances", self._zone_instances, query)
        m = re.fullmatch(r"/zones/([^/]+)(/.*)", rest)
        if not m:
            raise ApiError(
                404, "notFound", f"The requested URL /compute/v1/{p}{rest} was not found."
            )
        zone, sub = m.group(1), m.group(2)
        if zone not in self._zones():
            raise ApiError(
                400, "invalid", f"Invalid value for field 'zone': '{zone}'. Unknown zone."
            )
        zp = f"{p}/zones/{zone}"
        if sub == "/acceleratorTypes" and method == "GET":
            self._check(["compute.acceleratorTypes.list"], zp)
            return 200, self._list(
                "compute#acceleratorTypeList", self._accelerator_types(zone), query
            )
        if sub == "/instances" and method == "GET":
            self._check(["compute.instances.list"], zp)
            self._settle()
            return 200, self._list("compute#instanceList", self._zone_instances(zone), query)
        if sub == "/instances" and method == "POST":
            return 200, self._insert(zone, json.loads(body or b"{}"), query.get("requestId"))
        if m := re.fullmatch(r"/instances/([^/]+)", sub):
            name = m.group(1)
            if method == "GET":
                self._check(["compute.instances.get"], f"{zp}/instances/{name}")
                return 200, self._get_instance(zone, name)
            if method == "DELETE":
                self._check(["compute.instances.delete"], f"{zp}/instances/{name}")
                return 200, self._delete(zone, name, query.get("requestId"))
        if m := re.fullmatch(r"/instances/([^/]+)/getGuestAttributes", sub):
            name = m.group(1)
            self._check(["compute.instances.getGuestAttributes"], f"{zp}/instances/{name}")
            return 200, self._guest_attributes(zone, name, query)
        if sub == "/operations" and method == "GET":
            self._check(["compute.zoneOperations.list"], zp)
            self._settle()
            ops = [o for (z, _), o in self._operations.items() if z == zone]
            return 200, self._list("compute#operationList", ops, query)
        if m := re.fullmatch(r"/operations/([^/]+)(/wait)?", sub):
            return 200, self._get_operation("zone", zp, self._operations, (zone, m.group(1)))
        raise ApiError(404, "notFound", f"The requested URL /compute/v1/{p}{rest} was not found.")

    # -- permissions ------------------------------------------------------------------------

    def _check(self, permissions: Sequence[str], resource: str) -> None:
        for permission in permissions:
            refused = permission in self._denied or (
                self._allowed is not None and permission not in self._allowed
            )
            if refused:
                raise ApiError(
                    403, "forbidden", f"Required '{permission}' permission for '{resource}'"
                )

    # -- resources --------------------------------------------------------------------------

    def _zones(self) -> list[str]:
        return [z for zones in self.regions.values() for z in zones]

    def _project(self) -> dict[str, Any]:
        used = {"GPUS_ALL_REGIONS": self._gpus_in_use(None)}
        return {
            "kind": "compute#project",
            "id": self.project_number,
            "name": self.project,
            "selfLink": f"{_BASE}projects/{self.project}",
            "quotas": [
                {"metric": k, "limit": float(v), "usage": float(used.get(k, 0))}
                for k, v in self.project_quotas.items()
            ],
        }

    def _region(self, region: str) -> dict[str, Any]:
        if region not in self.regions:
            raise ApiError(
                404,
                "notFound",
                f"The resource 'projects/{self.project}/regions/{region}' was not found",
            )
        usage = self._regional_usage(region)
        return {
            "kind": "compute#region",
            "id": str(1000 + sorted(self.regions).index(region)),
            "name": region,
            "status": "UP",
            "selfLink": f"{_BASE}projects/{self.project}/regions/{region}",
            "zones": [f"{_BASE}projects/{self.project}/zones/{z}" for z in self.regions[region]],
            "quotas": [
                {"metric": k, "limit": float(v), "usage": float(usage.get(k, 0))}
                for k, v in self.quotas.get(region, {}).items()
            ],
        }

    def _accelerator_types(self, zone: str) -> list[dict[str, Any]]:
        return [
            {
                "kind": "compute#acceleratorType",
                "id": str(10_000 + i),
                "name": name,
                "description": name.replace("-", " ").title(),
                "zone": f"{_BASE}projects/{self.project}/zones/{zone}",
                "selfLink": f"{_BASE}projects/{self.project}/zones/{zone}/acceleratorTypes/{name}",
                "maximumCardsPerInstance": cards,
            }
            for i, (name, cards) in enumerate(sorted(self.accelerators.get(zone, {}).items()))
        ]

    def _zone_instances(self, zone: str) -> list[dict[str, Any]]:
        return [i for (z, _), i in self._instances.items() if z == zone]

    def _bucket(self, name: str) -> dict[str, Any]:
        self._check(["storage.buckets.get"], f"projects/_/buckets/{name}")
        if name not in self.buckets:
            raise ApiError(404, "notFound", "The specified bucket does not exist.")
        location = self.buckets[name]
        kind = (
            "region"
            if "-" in location
            else ("dual-region" if location[-1].isdigit() else "multi-region")
        )
        return {
            "kind": "storage#bucket",
            "id": name,
            "name": name,
            "location": location,
            "locationType": kind,
        }

    # -- lists and filters ------------------------------------------------------------------

    def _page(self, items: list[dict[str, Any]], query: Mapping[str, str]) -> tuple[list[Any], str]:
        size = min(int(query.get("maxResults") or self.page_size), self.page_size)
        start = int(query.get("pageToken") or 0)
        end = start + size
        return items[start:end], (str(end) if end < len(items) else "")

    def _list(
        self, kind: str, items: list[dict[str, Any]], query: Mapping[str, str]
    ) -> dict[str, Any]:
        chosen = [copy.deepcopy(i) for i in items if _matches(i, query.get("filter", ""))]
        page, token = self._page(chosen, query)
        out: dict[str, Any] = {"kind": kind, "items": page}
        if token:
            out["nextPageToken"] = token
        return out

    def _aggregated(self, field: str, per_zone: Any, query: Mapping[str, str]) -> dict[str, Any]:
        scopes: list[tuple[str, dict[str, Any]]] = []
        for zone in self._zones():
            scopes.extend(
                (zone, copy.deepcopy(i))
                for i in per_zone(zone)
                if _matches(i, query.get("filter", ""))
            )
        page, token = self._page(scopes, query)  # type: ignore[arg-type]
        items: dict[str, Any] = {}
        for zone in self._zones():
            found = [item for z, item in page if z == zone]
            scope = f"zones/{zone}"
            if found:
                items[scope] = {field: found}
            else:
                items[scope] = {
                    "warning": {
                        "code": "NO_RESULTS_ON_PAGE",
                        "message": f"There are no results for scope '{scope}' on this page.",
                        "data": [{"key": "scope", "value": scope}],
                    }
                }
        out: dict[str, Any] = {"kind": f"compute#{field[:-1]}AggregatedList", "items": items}
        if token:
            out["nextPageToken"] = token
        return out

    # -- instances --------------------------------------------------------------------------

    def _insert(self, zone: str, body: dict[str, Any], request_id: str | None) -> dict[str, Any]:
        name = str(body.get("name", ""))
        resource = f"projects/{self.project}/zones/{zone}/instances/{name}"
        needed = ["compute.instances.create", "compute.disks.create"]
        if body.get("metadata", {}).get("items"):
            needed.append("compute.instances.setMetadata")
        if body.get("labels"):
            needed.append("compute.instances.setLabels")
        needed.append("compute.subnetworks.use")
        if any(n.get("accessConfigs") for n in body.get("networkInterfaces", [])):
            needed.append("compute.subnetworks.useExternalIp")
        accounts = body.get("serviceAccounts") or []
        if accounts:
            needed.append("compute.instances.setServiceAccount")
        self._check(needed, resource)
        for url in body.get("resourcePolicies") or []:
            self._check(["compute.resourcePolicies.use"], _partial(url))
        for account in accounts:
            self._check(
                ["iam.serviceAccounts.actAs"], f"projects/-/serviceAccounts/{account.get('email')}"
            )
        if request_id:
            if not re.fullmatch(
                r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", request_id
            ):
                raise ApiError(
                    400,
                    "invalid",
                    f"Invalid value for field 'requestId': '{request_id}'. Must be a UUID.",
                )
            if request_id in self._request_ids:
                op = self._operations[self._request_ids[request_id]]
                return copy.deepcopy(op)
        self._validate(zone, body)
        if (zone, name) in self._instances:
            raise ApiError(409, "alreadyExists", f"The resource '{resource}' already exists")
        self._validate_policies(zone, body)
        now = datetime.now(timezone.utc)
        error = self._insert_error(zone, body)
        inst: dict[str, Any] = {}
        if error is None:
            inst = self._create(zone, body, now)
        else:
            inst = {"name": name, "id": str(next(self._ids))}
        op = self._operation(zone, inst, "insert", when=now, error=error, target_name=name)
        if request_id:
            self._request_ids[request_id] = (zone, op["name"])
        answer = copy.deepcopy(op)
        answer.update(status="RUNNING", progress=0)  # the first answer is still in flight
        answer.pop("endTime", None)
        answer.pop("error", None)
        answer.pop("httpErrorStatusCode", None)
        answer.pop("httpErrorMessage", None)
        return answer

    def _validate(self, zone: str, body: dict[str, Any]) -> None:
        _named(body, "(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?|[1-9][0-9]{0,19})")
        for key, value in (body.get("labels") or {}).items():
            if not _LABEL_KEY.fullmatch(key) or not _LABEL_VALUE.fullmatch(str(value)):
                raise ApiError(
                    400,
                    "invalid",
                    f"Invalid value for field 'resource.labels': '{key}'. Label keys and values "
                    "can only contain lowercase letters, numeric characters, underscores and dashes.",
                )
        machine = str(body.get("machineType", ""))
        if not re.fullmatch(
            rf"(?:{re.escape(_BASE)}projects/[^/]+/)?zones/{zone}/machineTypes/[a-z0-9-]+", machine
        ):
            raise ApiError(
                400, "invalid", f"Invalid value for field 'resource.machineType': '{machine}'."
            )
        scheduling = body.get("scheduling") or {}
        spot = scheduling.get("provisioningModel") == "SPOT" or scheduling.get("preemptible")
        accelerators = body.get("guestAccelerators") or []
        if spot and scheduling.get("automaticRestart", True):
            raise ApiError(
                400,
                "invalid",
                "Invalid value for field 'resource.scheduling.automaticRestart': 'true'. "
                "Preemptible instances cannot be automatically restarted.",
            )
        if (spot or accelerators) and scheduling.get("onHostMaintenance", "MIGRATE") != "TERMINATE":
            raise ApiError(
                400,
                "invalid",
                "Invalid value for field 'resource.scheduling.onHostMaintenance': 'MIGRATE'. "
                "Instances with guest accelerators or Spot VMs do not support live migration.",
            )
        action = scheduling.get("instanceTerminationAction")
        if action is not None and action not in ("STOP", "DELETE"):
            raise ApiError(
                400,
                "invalid",
                f"Invalid value for field 'resource.scheduling.instanceTerminationAction': '{action}'.",
            )
        for i, acc in enumerate(accelerators):
            kind = _last(str(acc.get("acceleratorType", "")))
            offered = self.accelerators.get(zone, {})
            if kind not in offered:
                raise ApiError(
                    400,
                    "invalid",
                    f"Invalid value for field 'resource.guestAccelerators[{i}].acceleratorType': "
                    f"'{acc.get('acceleratorType')}'. Accelerator type '{kind}' does not exist in "
                    f"zone '{zone}'.",
                )
        if not body.get("disks"):
            raise ApiError(
                400, "invalid", "Invalid value for field 'resource.disks': ''. No boot disk."
            )
        items = (body.get("metadata") or {}).get("items") or []
        if len(json.dumps(items)) > 512 * 1024:
            raise ApiError(400, "invalid", "Metadata exceeds the 512 KB limit.")

    def _insert_error(self, zone: str, body: dict[str, Any]) -> dict[str, Any] | None:
        if zone in self._exhausted and self._exhausted[zone] > 0:
            self._exhausted[zone] -= 1
        elif zone in self._exhausted:
            return {
                "code": "ZONE_RESOURCE_POOL_EXHAUSTED",
                "message": f"The zone 'projects/{self.project}/zones/{zone}' does not have enough "
                "resources available to fulfill the request.  Try a different zone, or try "
                "again later.",
            }
        gpus = _gpu_count(body)
        if not gpus:
            return None
        region = self._region_of(zone)
        metric = _metric(body)
        spot = (body.get("scheduling") or {}).get("provisioningModel") == "SPOT"
        pre = f"PREEMPTIBLE_{metric}"
        limits = self.quotas.get(region, {})
        if spot and limits.get(pre, 0) > 0:
            metric = pre
        usage = self._regional_usage(region)
        limit = limits.get(metric, 0.0)
        if usage.get(metric, 0) + gpus > limit:
            return _quota_error(metric, limit, f"region {region}")
        total = self.project_quotas.get("GPUS_ALL_REGIONS")
        if total is not None and self._gpus_in_use(None) + gpus > total:
            return _quota_error("GPUS_ALL_REGIONS", total, "project")
        return None

    def _create(self, zone: str, body: dict[str, Any], now: datetime) -> dict[str, Any]:
        inst = copy.deepcopy(body)
        name = inst["name"]
        zone_url = f"{_BASE}projects/{self.project}/zones/{zone}"
        inst.update(
            kind="compute#instance",
            id=str(next(self._ids)),
            creationTimestamp=_stamp(now),
            zone=zone_url,
            status="RUNNING",
            selfLink=f"{zone_url}/instances/{name}",
            machineType=f"{zone_url}/machineTypes/{_last(inst['machineType'])}",
            labelFingerprint="42WmSpB8rSM=",
            lastStartTimestamp=_stamp(now),
        )
        inst.setdefault("metadata", {}).update(kind="compute#metadata", fingerprint="w8i2H3gy3dA=")
        for acc in inst.get("guestAccelerators", []):
            acc["acceleratorType"] = f"{zone_url}/acceleratorTypes/{_last(acc['acceleratorType'])}"
        for i, disk in enumerate(inst.get("disks", [])):
            made = disk.pop("initializeParams", None) or {}
            if disk.get("boot") and made.get("sourceImage"):
                self._boot_images[(zone, name)] = str(made["sourceImage"])
            disk.update(
                kind="compute#attachedDisk",
                index=i,
                deviceName=disk.get("deviceName", "persistent-disk-0"),
                source=f"{zone_url}/disks/{name}",
            )
        for i, nic in enumerate(inst.get("networkInterfaces", [])):
            n = next(self._addresses)  # one address per instance, never handed out twice
            nic.update(name=f"nic{i}", networkIP=f"10.128.{n // 256}.{n % 256}")
        inst["resourcePolicies"] = [
            f"{_BASE}{_partial(url)}" for url in inst.get("resourcePolicies") or []
        ]
        if not inst["resourcePolicies"]:
            del inst["resourcePolicies"]
        self._instances[(zone, name)] = inst
        return inst

    def _instance(self, zone: str, name: str) -> dict[str, Any]:
        resource = f"projects/{self.project}/zones/{zone}/instances/{name}"
        return _found(self._instances.get((zone, name)), resource)

    def _get_instance(self, zone: str, name: str) -> dict[str, Any]:
        self._settle((zone, name))
        return copy.deepcopy(self._instance(zone, name))

    def _delete(self, zone: str, name: str, request_id: str | None) -> dict[str, Any]:
        if request_id and request_id in self._request_ids:
            return copy.deepcopy(self._operations[self._request_ids[request_id]])
        inst = self._instance(zone, name)
        op = self._operation(zone, inst, "delete", when=datetime.now(timezone.utc))
        if request_id:
            self._request_ids[request_id] = (zone, op["name"])
        inst["status"] = "STOPPING"
        # Deletion takes a while: the next read still sees the instance STOPPING.
        self._deleting[(zone, name)] = 1
        return copy.deepcopy(op)

    def _settle(self, key: tuple[str, str] | None = None) -> None:
        """Finish deletions in progress, one read after they were asked for."""
        for k, left in list(self._deleting.items()):
            if key is not None and k != key:
                continue
            if left > 0:
                self._deleting[k] = left - 1
            else:
                self._remove(*k)

    def _remove(self, zone: str, name: str) -> None:
        self._instances.pop((zone, name), None)
        self._guest.pop((zone, name), None)
        self._deleting.pop((zone, name), None)

    def _guest_attributes(self, zone: str, name: str, query: Mapping[str, str]) -> dict[str, Any]:
        self._get_instance(zone, name)
        path = query.get("queryPath", "")
        namespace = path.rstrip("/")
        found = {
            k: v
            for k, v in self._guest.get((zone, name), {}).items()
            if k.startswith(f"{namespace}/")
        }
        if not found:
            raise ApiError(
                404,
                "notFound",
                f"The resource 'projects/{self.project}/zones/{zone}/instances/{name}/"
                f"guestAttributes/{path}' was not found",
            )
        return {
            "kind": "compute#guestAttributes",
            "queryPath": path,
            "selfLink": f"{_BASE}projects/{self.project}/zones/{zone}/instances/{name}/guestAttributes/{path}",
            "queryValue": {
                "items": [
                    {"namespace": k.split("/", 1)[0], "key": k.split("/", 1)[1], "value": v}
                    for k, v in sorted(found.items())
                ]
            },
        }

    # -- resource policies (regional) -------------------------------------------------------

    def _regional(
        self, method: str, region: str, sub: str, query: Mapping[str, str], body: bytes
    ) -> tuple[int, Any]:
        p = f"projects/{self.project}"
        if region not in self.regions:
            raise ApiError(404, "notFound", f"The resource '{p}/regions/{region}' was not found")
        rp = f"{p}/regions/{region}"
        if sub == "/resourcePolicies" and method == "POST":
            self._check(["compute.resourcePolicies.create"], f"{rp}/resourcePolicies")
            return 200, self._insert_policy(region, json.loads(body or b"{}"))
        if sub == "/resourcePolicies" and method == "GET":
            self._check(["compute.resourcePolicies.list"], f"{rp}/resourcePolicies")
            here = [p for (r, _), p in sorted(self._policies.items()) if r == region]
            return 200, self._list("compute#resourcePolicyList", here, query)
        if m := re.fullmatch(r"/resourcePolicies/([^/]+)", sub):
            name = m.group(1)
            if method == "GET":
                self._check(["compute.resourcePolicies.get"], f"{rp}/resourcePolicies/{name}")
                return 200, copy.deepcopy(self._policy(region, name))
            if method == "DELETE":
                self._check(["compute.resourcePolicies.delete"], f"{rp}/resourcePolicies/{name}")
                return 200, self._delete_policy(region, name)
        if m := re.fullmatch(r"/operations/([^/]+)(/wait)?", sub):
            ops = self._region_operations
            return 200, self._get_operation("region", rp, ops, (region, m.group(1)))
        raise ApiError(404, "notFound", f"The requested URL /compute/v1/{rp}{sub} was not found.")

    def _policy(self, region: str, name: str) -> dict[str, Any]:
        resource = f"projects/{self.project}/regions/{region}/resourcePolicies/{name}"
        return _found(self._policies.get((region, name)), resource)

    def _insert_policy(self, region: str, body: dict[str, Any]) -> dict[str, Any]:
        name = _named(body, "[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")
        group = body.get("groupPlacementPolicy") or {}
        collocation = group.get("collocation", "UNSPECIFIED_COLLOCATION")
        if collocation not in ("COLLOCATED", "UNSPECIFIED_COLLOCATION"):
            raise ApiError(
                400,
                "invalid",
                "Invalid value for field 'resource.groupPlacementPolicy.collocation': "
                f"'{collocation}'.",
            )
        count = group.get("vmCount")
        if count is not None and not 2 <= int(count) <= 1500:
            raise ApiError(
                400,
                "invalid",
                f"Invalid value for field 'resource.groupPlacementPolicy.vmCount': '{count}'. "
                "Must be between 2 and 1500.",
            )
        url = f"{_BASE}projects/{self.project}/regions/{region}/resourcePolicies/{name}"
        if (region, name) in self._policies:
            raise ApiError(409, "alreadyExists", f"The resource '{_partial(url)}' already exists")
        now = datetime.now(timezone.utc)
        policy = copy.deepcopy(body)
        policy.update(
            kind="compute#resourcePolicy",
            id=str(next(self._ids)),
            creationTimestamp=_stamp(now),
            region=f"{_BASE}projects/{self.project}/regions/{region}",
            selfLink=url,
            status="READY",
        )
        self._policies[(region, name)] = policy
        op = self._region_operation(region, url, "insert", when=now)
        answer = copy.deepcopy(op)
        answer.update(status="RUNNING", progress=0)  # the first answer is still in flight
        answer.pop("endTime", None)
        return answer

    def _delete_policy(self, region: str, name: str) -> dict[str, Any]:
        policy = self._policy(region, name)
        url = policy["selfLink"]
        users = sorted(
            f"projects/{self.project}/zones/{z}/instances/{n}"
            for (z, n), inst in self._instances.items()
            if url in inst.get("resourcePolicies", [])
        )
        if users:
            # As Compute Engine: refused at once, while any instance (even one being
            # deleted) still lists the policy.
            raise ApiError(
                400,
                "resourceInUseByAnotherResource",
                f"The resource_policy resource '{_partial(url)}' is already being used by "
                f"'{users[0]}'",
            )
        del self._policies[(region, name)]
        return copy.deepcopy(
            self._region_operation(region, url, "delete", when=datetime.now(timezone.utc))
        )

    def _validate_policies(self, zone: str, body: Mapping[str, Any]) -> None:
        """An instance may list existing policies of its own region only, and a compact
        placement policy no more instances than its vmCount."""
        region = self._region_of(zone)
        for i, url in enumerate(body.get("resourcePolicies") or []):
            parts = re.search(r"regions/([^/]+)/resourcePolicies/([^/]+)$", url)
            where = f"Invalid value for field 'resource.resourcePolicies[{i}]': '{url}'."
            if parts is None:
                raise ApiError(400, "invalid", f"{where} Not a resource policy URL.")
            if parts.group(1) != region:
                raise ApiError(
                    400,
                    "invalid",
                    f"{where} Resource policy must be in the same region as the instance.",
                )
            try:
                policy = self._policy(region, parts.group(2))
            except ApiError as e:
                raise ApiError(400, "invalid", f"{where} {e.message}") from None
            count = (policy.get("groupPlacementPolicy") or {}).get("vmCount")
            users = sum(
                policy["selfLink"] in inst.get("resourcePolicies", [])
                for inst in self._instances.values()
            )
            if count is not None and users >= int(count):
                raise ApiError(
                    400,
                    "invalid",
                    f"{where} The placement policy already holds its vmCount of {count} instances.",
                )

    def _region_operation(
        self, region: str, target: str, kind: str, *, when: datetime
    ) -> dict[str, Any]:
        region_url = f"{_BASE}projects/{self.project}/regions/{region}"
        op = self._done("region", region_url, kind, target, when=when)
        self._region_operations[(region, op["name"])] = op
        return op

    # -- operations and quota ---------------------------------------------------------------

    def _operation(
        self,
        zone: str,
        inst: Mapping[str, Any],
        kind: str,
        *,
        when: datetime,
        user: str = "trainbot-cp@trainbot-test.iam.gserviceaccount.com",
        name: str | None = None,
        error: Mapping[str, str] | None = None,
        status_message: str | None = None,
        target_name: str | None = None,
    ) -> dict[str, Any]:
        zone_url = f"{_BASE}projects/{self.project}/zones/{zone}"
        target = f"{zone_url}/instances/{target_name or inst['name']}"
        op = self._done("zone", zone_url, kind, target, when=when, user=user, name=name)
        op["targetId"] = str(inst.get("id", ""))
        if status_message:
            op["statusMessage"] = status_message
        if error is not None:
            op["error"] = {"errors": [dict(error)]}
            op["httpErrorStatusCode"] = 503 if "EXHAUSTED" in error["code"] else 403
            op["httpErrorMessage"] = (
                "SERVICE UNAVAILABLE" if "EXHAUSTED" in error["code"] else "FORBIDDEN"
            )
        self._operations[(zone, op["name"])] = op
        return op

    def _done(
        self,
        scope: str,
        scope_url: str,
        kind: str,
        target: str,
        *,
        when: datetime,
        user: str = "trainbot-cp@trainbot-test.iam.gserviceaccount.com",
        name: str | None = None,
    ) -> dict[str, Any]:
        """A finished operation of ``kind`` on ``target``, in a zone or a region
        (``scope``) whose URL is ``scope_url``."""
        name = name or f"operation-{int(when.timestamp() * 1000)}-{next(self._ids):x}"
        return {
            "kind": "compute#operation",
            "id": str(next(self._ids)),
            "name": name,
            scope: scope_url,
            "operationType": kind,
            "targetLink": target,
            "status": "DONE",
            "user": user,
            "progress": 100,
            "insertTime": _stamp(when),
            "startTime": _stamp(when),
            "endTime": _stamp(when),
            "selfLink": f"{scope_url}/operations/{name}",
        }

    def _get_operation(
        self,
        scope: str,
        path: str,
        operations: Mapping[tuple[str, str], dict[str, Any]],
        key: tuple[str, str],
    ) -> dict[str, Any]:
        """``zoneOperations.get`` or ``regionOperations.get`` (``scope``) of the operation
        ``key`` (place, name) under ``path``."""
        resource = f"{path}/operations/{key[1]}"
        self._check([f"compute.{scope}Operations.get"], resource)
        return copy.deepcopy(_found(operations.get(key), resource))

    def _region_of(self, zone: str) -> str:
        return next(r for r, zones in self.regions.items() if zone in zones)

    def _regional_usage(self, region: str) -> dict[str, float]:
        usage: dict[str, float] = {}
        for (zone, _), inst in self._instances.items():
            if self._region_of(zone) != region or inst.get("status") not in _RUNNING:
                continue
            gpus = _gpu_count(inst)
            if not gpus:
                continue
            metric = _metric(inst)
            spot = (inst.get("scheduling") or {}).get("provisioningModel") == "SPOT"
            if spot and self.quotas.get(region, {}).get(f"PREEMPTIBLE_{metric}", 0) > 0:
                metric = f"PREEMPTIBLE_{metric}"
            usage[metric] = usage.get(metric, 0) + gpus
        return usage

    def _gpus_in_use(self, region: str | None) -> float:
        return float(
            sum(
                _gpu_count(i)
                for (z, _), i in self._instances.items()
                if i.get("status") in _RUNNING and (region is None or self._region_of(z) == region)
            )
        )

    # -- the instance metadata server -------------------------------------------------------

    def _metadata_request(
        self, zone: str, name: str, req: BaseHTTPRequestHandler, body: bytes
    ) -> tuple[int, bytes, str]:
        text = "application/text"
        if req.headers.get("Metadata-Flavor") != "Google":
            return 403, b"Missing Metadata-Flavor:Google header.", "text/html"
        path = unquote(urlsplit(req.path).path)
        prefix = "/computeMetadata/v1/instance/"
        if not path.startswith(prefix):
            return 404, b"not found", "text/html"
        rest = path[len(prefix) :]
        with self._lock:
            inst = self._instances.get((zone, name))
            if inst is None:
                return 503, b"instance gone", "text/html"
            if req.command == "PUT" and rest.startswith("guest-attributes/"):
                namespace, _, key = rest[len("guest-attributes/") :].partition("/")
                try:
                    self.put_guest_attribute(zone, name, namespace, key, body.decode())
                except ApiError as e:
                    return 400, e.message.encode(), "text/html"
                return 200, b"", text
            if req.command != "GET":
                return 405, b"", "text/html"
            simple = {
                "name": name,
                "zone": f"projects/{self.project_number}/zones/{zone}",
                "id": inst["id"],
            }
            if rest in simple:
                return 200, simple[rest].encode(), text
            if rest == "service-accounts/default/token":
                # The instance's service account's access token (a stand-in the GCS
                # emulator accepts, as it accepts any).
                token = {"access_token": f"ya29.fake-{name}", "expires_in": 3599}
                return (
                    200,
                    json.dumps({**token, "token_type": "Bearer"}).encode(),
                    "application/json",
                )
            if rest.startswith("attributes/"):
                value = _metadata(inst).get(rest[len("attributes/") :])
                if value is None:
                    return 404, b"not found", "text/html"
                return 200, value.encode(), text
        return 404, b"not found", "text/html"


# -- helpers ----------------------------------------------------------------------------------


def _metadata(inst: Mapping[str, Any]) -> dict[str, str]:
    return {i["key"]: i.get("value", "") for i in (inst.get("metadata") or {}).get("items", [])}


def _partial(url: str) -> str:
    """A resource URL without the API's base (``projects/…/regions/…/resourcePolicies/…``)."""
    found = url.find("projects/")
    return url[found:] if found >= 0 else url


def _gpu_count(inst: Mapping[str, Any]) -> int:
    return sum(int(a.get("acceleratorCount", 0)) for a in inst.get("guestAccelerators") or [])


# Accelerator type → regional quota metric, as Compute Engine names them.
_METRICS = {
    "nvidia-tesla-a100": "NVIDIA_A100_GPUS",
    "nvidia-a100-80gb": "NVIDIA_A100_80GB_GPUS",
    "nvidia-h100-80gb": "NVIDIA_H100_GPUS",
    "nvidia-l4": "NVIDIA_L4_GPUS",
    "nvidia-tesla-t4": "NVIDIA_T4_GPUS",
    "nvidia-tesla-v100": "NVIDIA_V100_GPUS",
}


def _metric(inst: Mapping[str, Any]) -> str:
    kinds = [_last(a["acceleratorType"]) for a in inst.get("guestAccelerators") or []]
    return _METRICS.get(kinds[0], "GPUS") if kinds else "GPUS"


def _quota_error(metric: str, limit: float, where: str) -> dict[str, str]:
    return {
        "code": "QUOTA_EXCEEDED",
        "message": f"Quota '{metric}' exceeded.  Limit: {float(limit)} in {where}.",
    }


_COMPARISON = re.compile(r'\s*([\w.-]+)\s*(=|!=|eq|ne)\s*"?([^"]*?)"?\s*')


def _matches(item: Mapping[str, Any], expression: str) -> bool:
    """Compute Engine list filters: ``(a = "x") AND (b != "y")``, with OR between groups;
    ``eq`` and ``ne`` take a regular expression that must match the whole value."""
    expression = expression.strip()
    if not expression:
        return True
    groups = re.split(r"\)\s+OR\s+\(", expression)
    if len(groups) > 1:
        return any(_matches(item, f"({g})" if not g.startswith("(") else g) for g in groups)
    terms = re.split(r"\)\s+AND\s+\(", expression)
    for term in terms:
        m = _COMPARISON.fullmatch(term.strip().strip("()"))
        if m is None:
            raise ApiError(
                400,
                "invalid",
                f"Invalid value for field 'filter': '{expression}'. Invalid list filter expression.",
            )
        field, op, value = m.groups()
        actual: Any = item
        for part in field.split("."):
            actual = actual.get(part) if isinstance(actual, Mapping) else None
        if actual is None:
            equal = False
        elif op in ("eq", "ne"):
            equal = re.fullmatch(value, str(actual)) is not None
        else:
            equal = str(actual).lower() == value.lower()
        if equal != (op in ("=", "eq")):
            return False
    return True


#: (project, image, family) the fake starts with: the provider's default boot image family
#: (jobs.providers.gcp.images.DEFAULT_IMAGE) and Debian's.
_DEFAULT_IMAGES = (
    ("deeplearning-platform-release", "common-cu121-v20240922-debian-11", "common-cu121-debian-11"),
    ("debian-cloud", "debian-12-bookworm-v20240910", "debian-12"),
)


def _default_regions() -> dict[str, list[str]]:
    return {
        "us-central1": ["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f"],
        "europe-west4": ["europe-west4-a", "europe-west4-b", "europe-west4-c"],
    }


def _default_accelerators(regions: Mapping[str, Sequence[str]]) -> dict[str, dict[str, int]]:
    """A100s in every zone but one per region (as in life, not every zone has every type)."""
    out: dict[str, dict[str, int]] = {}
    for zones in regions.values():
        for i, zone in enumerate(zones):
            offered = {"nvidia-tesla-t4": 4, "nvidia-l4": 8}
            if i != 1:
                offered["nvidia-tesla-a100"] = 16
            out[zone] = offered
    return out


def _default_quotas(regions: Mapping[str, Sequence[str]]) -> dict[str, dict[str, float]]:
    return {
        region: {
            "CPUS": 72,
            "PREEMPTIBLE_CPUS": 0,
            "NVIDIA_A100_GPUS": 0,
            "PREEMPTIBLE_NVIDIA_A100_GPUS": 8,
            "NVIDIA_T4_GPUS": 4,
            "PREEMPTIBLE_NVIDIA_T4_GPUS": 0,
            "NVIDIA_L4_GPUS": 8,
            "PREEMPTIBLE_NVIDIA_L4_GPUS": 8,
        }
        for region in regions
    }

"""The Compute Engine clients of one project, built on first use.

Building them lazily means a missing credential shows up as a preflight failure that
says how to fix it, not as a control plane that will not start.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import InitVar, dataclass
from typing import Any

from google.api_core import exceptions as api_exceptions
from google.api_core.client_options import ClientOptions
from google.auth import exceptions as auth_exceptions
from google.cloud import compute_v1

from jobs.providers.gcp import errors

__all__ = ["CLOUD_PLATFORM", "ComputeApi"]

log = logging.getLogger(__name__)

CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
_FACTORIES: dict[str, Any] = {
    "regions": compute_v1.RegionsClient,
    "projects": compute_v1.ProjectsClient,
    "accelerator_types": compute_v1.AcceleratorTypesClient,
    "instances": compute_v1.InstancesClient,
    "zone_operations": compute_v1.ZoneOperationsClient,
    "resource_policies": compute_v1.ResourcePoliciesClient,
    "region_operations": compute_v1.RegionOperationsClient,
    "images": compute_v1.ImagesClient,
}


@dataclass(eq=False, kw_only=True)
class ComputeApi:
    """One project's clients, its call timeout and the calls that translate errors."""

    project: str
    api_endpoint: str | None
    call_timeout_s: float
    #: None: the application-default credentials, looked up on first use.
    credentials: InitVar[Any]

    def __post_init__(self, credentials: Any) -> None:
        self._credentials = credentials
        _quiet_payload_logging()
        self._lock = threading.Lock()
        self._clients: dict[str, Any] = {}

    def client(self, kind: str) -> Any:
        """The client for ``kind`` (a key of ``_FACTORIES``), built once."""
        with self._lock:
            client = self._clients.get(kind)
            if client is not None:
                return client
            credentials = self._credentials_or_default()
            options = ClientOptions(api_endpoint=self.api_endpoint) if self.api_endpoint else None
            client = _FACTORIES[kind](credentials=credentials, client_options=options)
            self._clients[kind] = client
            return client

    def storage_session(self) -> Any:
        """google-auth's authorized session, for the Cloud Storage JSON API."""
        from google.auth.transport.requests import AuthorizedSession

        with self._lock:
            session = self._clients.get("storage")
            if session is None:
                session = AuthorizedSession(self._credentials_or_default())
                self._clients["storage"] = session
            return session

    #: :func:`errors.call`: one API call, Google's errors as ProviderErrors.
    call = staticmethod(errors.call)

    def send(
        self,
        what: str,
        call: str,
        request: Any,
        *,
        client: str,
        method: str,
        not_found: str | None = "",
        conflict: bool = False,
    ) -> Any:
        """:meth:`call` of ``method`` of the ``client`` client (a key of ``_FACTORIES``)
        with ``request``, within the call timeout; ``not_found`` and ``conflict`` as
        :func:`errors.call` takes them."""
        return self.call(
            what,
            call,
            lambda: getattr(self.client(client), method)(
                request=request, timeout=self.call_timeout_s
            ),
            not_found=not_found,
            conflict=conflict,
        )

    def insert(self, what: str, call: str, request: Any, *, client: str) -> Any | None:
        """:meth:`send` of ``insert_unary``: its operation, or None when the resource exists
        already (a 409: a retried insert, or a name that is taken)."""
        try:
            return self.send(
                what, call, request, client=client, method="insert_unary", conflict=True
            )
        except api_exceptions.Conflict:
            return None

    def wait(self, zone: str, op: Any, *, what: str, timeout_s: float) -> Any:
        """Wait for a zone operation (zoneOperations.wait returns at DONE or after ~2 min)."""
        return self._wait(
            op, "zone_operations", "zoneOperations.wait", {"zone": zone}, what, timeout_s
        )

    def wait_region(self, region: str, op: Any, *, what: str, timeout_s: float) -> Any:
        """Wait for a region operation (a resource policy's insert), as :meth:`wait`."""
        return self._wait(
            op, "region_operations", "regionOperations.wait", {"region": region}, what, timeout_s
        )

    def _wait(
        self, op: Any, kind: str, call: str, scope: dict[str, str], what: str, timeout_s: float
    ) -> Any:
        deadline = time.monotonic() + timeout_s
        while op.status != compute_v1.Operation.Status.DONE:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("%s: still %s after %.0f s", what, op.status, timeout_s)
                return op
            op = self.call(
                what,
                call,
                functools.partial(
                    self.client(kind).wait,
                    project=self.project,
                    operation=op.name,
                    timeout=min(left, 130.0),
                    **scope,
                ),
            )
        return op

    def _credentials_or_default(self) -> Any:
        """Caller holds the lock. Application-default credentials, once."""
        if self._credentials is None:
            import google.auth

            try:
                self._credentials, _ = google.auth.default(scopes=[CLOUD_PLATFORM])
            except auth_exceptions.DefaultCredentialsError as e:
                raise errors.translate(
                    e, what="call the Compute Engine API", call="regions.get"
                ) from None
        return self._credentials


def _quiet_payload_logging() -> None:
    """Keep the instances client from logging request and response payloads.

    At DEBUG, google-cloud-compute logs each payload in the record's extra fields, and an
    instance's metadata holds the runner token; a structured log handler would write it.
    """
    logging.getLogger("google.cloud.compute_v1.services.instances").setLevel(logging.INFO)

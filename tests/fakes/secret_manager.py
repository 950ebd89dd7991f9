"""GCP Secret Manager's REST API (v1) on 127.0.0.1, and the metadata server's token.

What the control plane and the runner call, over real HTTP:

- ``GET /v1/projects/P/secrets/S``: the secret's metadata (404 ``NOT_FOUND`` when absent);
- ``POST /v1/projects/P/secrets/S:getIamPolicy``: its bindings;
- ``GET /v1/projects/P/secrets/S/versions/V:access``: the payload, base64 with its
  CRC32C, for a bearer token whose service account holds
  ``roles/secretmanager.secretAccessor`` on the secret (403 ``PERMISSION_DENIED`` else);
- ``GET /computeMetadata/v1/instance/service-accounts/default/token`` (with
  ``Metadata-Flavor: Google``): the instance's service-account token.

Errors have Google's JSON shape (``{"error": {"code", "message", "status"}}``).
"""

from __future__ import annotations

import base64
import re
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler

from tests.fakes.loopback import ClosedOnExit, LoopbackServer, QuietHandler, reply_json

__all__ = ["ACCESSOR", "FakeSecretManager"]

ACCESSOR = "roles/secretmanager.secretAccessor"
_TOKEN_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"
_SECRET = re.compile(r"^/v1/(projects/[^/]+/secrets/[^/:]+)(?::(getIamPolicy))?$")
_ACCESS = re.compile(r"^/v1/(projects/[^/]+/secrets/[^/:]+)/versions/([^/:]+):access$")


@dataclass
class _Secret:
    versions: list[bytes] = field(default_factory=list)
    #: role → members ("serviceAccount:…").
    bindings: dict[str, set[str]] = field(default_factory=dict)


class FakeSecretManager(ClosedOnExit):
    """Secrets by resource name (``projects/P/secrets/S``), and the instance's account."""

    def __init__(self, *, instance_account: str = "runner@p.iam.gserviceaccount.com") -> None:
        self.instance_account = instance_account
        self._secrets: dict[str, _Secret] = {}
        self._tokens: dict[str, str] = {}  # token → service account
        self._lock = threading.Lock()
        #: (method, path, status) of every request, payloads never.
        self.seen: list[tuple[str, str, int]] = []
        fake = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                fake._handle(self, "GET")

            def do_POST(self) -> None:
                fake._handle(self, "POST")

        self._server = LoopbackServer(Handler)
        self.url = self._server.url

    def close(self) -> None:
        self._server.close()

    def add(self, name: str, value: str, *, readers: tuple[str, ...] = ()) -> None:
        """A secret with one version holding ``value``; ``readers`` may access it."""
        with self._lock:
            found = self._secrets.setdefault(name, _Secret())
            found.versions.append(value.encode())
            for member in readers:
                found.bindings.setdefault(ACCESSOR, set()).add(f"serviceAccount:{member}")

    def delete(self, name: str) -> None:
        with self._lock:
            self._secrets.pop(name, None)

    def _handle(self, req: BaseHTTPRequestHandler, method: str) -> None:
        status, body = self._answer(req, method)
        with self._lock:
            self.seen.append((method, req.path, status))
        reply_json(req, status, body)

    def _answer(self, req: BaseHTTPRequestHandler, method: str) -> tuple[int, dict]:
        if req.path == _TOKEN_PATH and method == "GET":
            if req.headers.get("Metadata-Flavor") != "Google":
                return 403, {"error": "Missing Metadata-Flavor:Google header."}
            token = "ya29.fake-" + secrets.token_hex(8)
            with self._lock:
                self._tokens[token] = self.instance_account
            return 200, {"access_token": token, "expires_in": 3599, "token_type": "Bearer"}
        auth = req.headers.get("Authorization", "")
        with self._lock:
            access = _ACCESS.match(req.path)
            if access and method == "GET":
                # Only the payload needs the instance's token: the control plane's calls
                # (metadata, policy) come with the test's anonymous credentials.
                caller = self._tokens.get(auth.removeprefix("Bearer "))
                if caller is None:
                    return _error(401, "UNAUTHENTICATED", "Request had invalid credentials.")
                found = self._secrets.get(access[1])
                if found is None or not found.versions:
                    return _error(404, "NOT_FOUND", f"Secret [{access[1]}] not found.")
                members = found.bindings.get(ACCESSOR, set())
                if f"serviceAccount:{caller}" not in members:
                    return _error(
                        403,
                        "PERMISSION_DENIED",
                        f"Permission 'secretmanager.versions.access' denied for resource "
                        f"'{access[1]}/versions/{access[2]}'.",
                    )
                index = len(found.versions) if access[2] == "latest" else int(access[2])
                payload = found.versions[index - 1]
                return 200, {
                    "name": f"{access[1]}/versions/{index}",
                    "payload": {"data": base64.b64encode(payload).decode()},
                }
            meta = _SECRET.match(req.path)
            if meta is None:
                return _error(404, "NOT_FOUND", f"no route {req.path}")
            found = self._secrets.get(meta[1])
            if found is None:
                return _error(404, "NOT_FOUND", f"Secret [{meta[1]}] not found.")
            if meta[2] == "getIamPolicy" and method == "POST":
                bindings = [
                    {"role": role, "members": sorted(members)}
                    for role, members in found.bindings.items()
                ]
                return 200, {"version": 1, "etag": "BwX=", "bindings": bindings}
            if meta[2] is None and method == "GET":
                return 200, {"name": meta[1], "replication": {"automatic": {}}}
        return _error(405, "INVALID_ARGUMENT", f"{method} {req.path}")


def _error(code: int, status: str, message: str) -> tuple[int, dict]:
    return code, {"error": {"code": code, "message": message, "status": status}}

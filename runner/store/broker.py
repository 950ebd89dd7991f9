"""The runner's client of the control plane's credential broker (no boto3 here).

With ``TRAINBOT_STORE_CREDENTIALS=broker`` the checkpoint store uses short-lived
credentials the control plane issues for this run's prefix alone (``POST {control
plane}/v1/credentials`` with the attempt's token). The answer is JSON with ``Version`` 1,
in one of two shapes, by the run's store:

- S3 (``jobs/providers/aws/credentials.py``): ``credential_process`` output,
  ``{"Version": 1, "AccessKeyId", "SecretAccessKey", "SessionToken", "Expiration"}``;
  ``trainbot-runner credentials`` prints it for an operator's ``aws s3 ls``.
- Cloud Storage (``jobs/providers/gcp/credentials.py``): a bearer token downscoped to the
  run's prefix, ``{"Version": 1, "Kind": "gcp-access-token", "AccessToken",
  "Expiration"}``.

``Expiration`` is ISO 8601 with its offset. This module needs the standard library only.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from typing import Any

from runner import env as contract
from runner.errors import StoreError

log = logging.getLogger(__name__)

#: ``broker``: the store signs with credentials from the control plane's broker.
STORE_CREDENTIALS_ENV = contract.STORE_CREDENTIALS.name
#: The broker's route, next to the events route the runner is given.
CREDENTIALS_ROUTE = "/v1/credentials"
_EVENTS_ROUTE = "/v1/events"
#: The answers' kinds: AWS's ``credential_process`` output (which carries no ``Kind``)
#: and Google's bearer token.
AWS_CREDENTIALS = "aws-credentials"
GCP_ACCESS_TOKEN = "gcp-access-token"
#: The fields each kind of answer must carry, as non-empty strings.
_FIELDS = {
    AWS_CREDENTIALS: ("AccessKeyId", "SecretAccessKey", "SessionToken", "Expiration"),
    GCP_ACCESS_TOKEN: ("AccessToken", "Expiration"),
}


def route_url(ingest_url: str, route: str) -> str:
    """A control-plane route's URL from ``TRAINBOT_INGEST_URL`` (the events URL, or the
    base URL): the broker's, the dry run's report."""
    base = ingest_url.rstrip("/")
    base = base.removesuffix(_EVENTS_ROUTE)
    return base + route


def post_request(url: str, token: str, body: bytes = b"") -> urllib.request.Request:
    """A ``POST`` to the control plane with the attempt's (or dry run's) token; a body, where
    there is one, is JSON."""
    headers = {"Authorization": f"Bearer {token}"}
    if body:
        headers["Content-Type"] = "application/json"
    return urllib.request.Request(url, data=body, method="POST", headers=headers)


def credentials_url(ingest_url: str) -> str:
    """The broker's URL from ``TRAINBOT_INGEST_URL``."""
    return route_url(ingest_url, CREDENTIALS_ROUTE)


def fetch_broker_credentials(
    *,
    ingest_url: str | None = None,
    token: str | None = None,
    timeout_s: float = 10.0,
    tries: int = 3,
    backoff_s: float = 1.0,
    kind: str = AWS_CREDENTIALS,
) -> dict[str, Any]:
    """This attempt's checkpoint credentials from the control plane, of ``kind`` (the
    ``credential_process`` shape by default). Defaults: ``TRAINBOT_INGEST_URL`` and
    ``TRAINBOT_TOKEN``.

    A refusal (4xx) is final; a 5xx or an unreachable control plane is tried ``tries``
    times. Raises StoreError; the token appears in no message.
    """
    ingest_url = ingest_url or os.environ.get(contract.INGEST_URL.name)
    token = token or os.environ.get(contract.TOKEN.name)
    if not ingest_url or not token:
        raise StoreError(
            f"{STORE_CREDENTIALS_ENV}=broker needs TRAINBOT_INGEST_URL and TRAINBOT_TOKEN "
            "(the control plane sets them on its instances)"
        )
    url = credentials_url(ingest_url)
    request = post_request(url, token)
    for attempt in range(1, tries + 1):
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                answer = json.loads(reply.read())
            break
        except urllib.error.HTTPError as exc:
            problem = f"{exc.code}: {_error_text(exc)}"
            if exc.code < 500 or attempt == tries:
                raise StoreError(
                    f"the control plane at {url} refused checkpoint credentials ({problem})"
                ) from None
        except (OSError, ValueError) as exc:  # URLError, timeouts, resets, bad JSON
            problem = str(getattr(exc, "reason", exc))
            if attempt == tries:
                raise StoreError(
                    f"could not get checkpoint credentials from {url} ({problem}): check that "
                    "the control plane is reachable from this instance"
                ) from None
        log.warning("checkpoint credentials: try %d of %d failed (%s)", attempt, tries, problem)
        time.sleep(backoff_s * 2 ** (attempt - 1))
    got = answer.get("Kind", AWS_CREDENTIALS) if isinstance(answer, dict) else None
    if got != kind and isinstance(got, str):
        raise StoreError(
            f"the control plane at {url} issued {got!r} credentials where {kind!r} were "
            "asked for: the run's checkpoint URI and the control plane's provider disagree"
        )
    if (
        not isinstance(answer, dict)
        or answer.get("Version") != 1
        or not all(isinstance(answer.get(k), str) and answer[k] for k in _FIELDS[kind])
    ):
        raise StoreError(
            f"the control plane at {url} answered with no usable credentials: upgrade the "
            "runner and the control plane to the same version"
        )
    return answer


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read())
    except (OSError, ValueError):
        return str(exc.reason)
    return str(body.get("error") if isinstance(body, dict) else body)[:500]

"""Short-lived Cloud Storage tokens for one run's checkpoint prefix, downscoped by STS.

The control plane takes a token of the runner-storage service account (impersonated,
when ``TRAINBOT_GCP_RUNNER_STORAGE_SERVICE_ACCOUNT`` names it; its own otherwise) and
exchanges it at Google's Security Token Service for one whose Credential Access Boundary
allows objects under ``<prefix>/<run>/`` only, and listings inside it only. The answer is
a bearer token with its expiry (:data:`TOKEN_KIND`, next to AWS's ``credential_process``
shape in ``runner/store/broker.py``); neither token is ever logged.

google-auth's ``downscoped.Credentials`` does this exchange too, but builds the STS URL
from a private pattern (``https://sts.{universe}/v1/token``) that nothing can point
elsewhere. So the exchange is google-auth's own token-exchange client
(``google.oauth2.sts.Client``) with the endpoint as a parameter (tests point it at a local
fake STS), and the boundary is google-auth's ``CredentialAccessBoundary``, sent as
``downscoped.Credentials`` sends it.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import google.auth
from google.auth import downscoped, impersonated_credentials
from google.auth.exceptions import GoogleAuthError, OAuthError
from google.auth.transport.requests import Request
from google.oauth2 import sts

from jobs.domain.errors import NotFound, PermissionDenied
from jobs.providers.base import ProviderError

if TYPE_CHECKING:
    from jobs.process.settings import Settings

__all__ = [
    "AVAILABLE_PERMISSIONS",
    "STS_TOKEN_URL",
    "TOKEN_KIND",
    "StorageTokenBroker",
    "access_boundary",
    "boundary_expression",
    "gcs_scope",
]

log = logging.getLogger(__name__)

#: Google's token-exchange endpoint (what ``downscoped.Credentials`` calls).
STS_TOKEN_URL = "https://sts.googleapis.com/v1/token"
#: The answer's ``Kind``: a bearer token for Cloud Storage, with its ``Expiration``.
TOKEN_KIND = "gcp-access-token"
#: The upper bound on permissions inside the boundary: the narrowest predefined role with
#: objects create, get, list and delete (``storage.objectAdmin`` adds the objects' IAM
#: policies and retention overrides). The storage account's own role bounds it further.
AVAILABLE_PERMISSIONS = ("inRole:roles/storage.objectUser",)
_CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
_GRANT_TYPE = "urn:ietf:params:oauth:grant-type:token-exchange"
_ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"
#: A source token with less left than this is renewed first, so each issued token
#: lasts at least this long (a downscoped token expires with its source).
MIN_SOURCE_LIFETIME = timedelta(minutes=15)
#: An impersonated token's lifetime (the IAM Credentials API's default and maximum).
DEFAULT_LIFETIME_S = 3600
#: Used only when neither STS nor the source says when the token expires.
_FALLBACK_LIFETIME = timedelta(minutes=5)
#: Seconds any one call to Google may take.
_TIMEOUT_S = 15
# Cloud Storage's rule for bucket names (the dotted, domain-named kind included).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
# One path segment: nothing a CEL string literal, a URI or a path walk reads specially
# (quotes, backslashes, control characters, '?', '#', '%', '*').
_SEGMENT = re.compile(r"^[A-Za-z0-9_.=+@~-]+$")
#: Longest prefix scoped: the CEL expression must stay under STS's 2,048 characters.
_MAX_PREFIX = 512


def gcs_scope(checkpoint_uri: str, run_prefix: str) -> tuple[str, str]:
    """``(bucket, object prefix)`` of one run's checkpoints: ``root/run`` with no slashes
    at either end. Raises NotFound for a store that is not Cloud Storage (nothing to
    broker) and PermissionDenied for a location a boundary cannot name safely."""
    raw = checkpoint_uri.strip()
    parsed = urlparse(raw)
    if parsed.scheme != "gs" or not parsed.netloc:
        raise NotFound(
            f"the credential broker serves gs:// checkpoint stores only, and this run's is "
            f"{checkpoint_uri!r}: its runner uses its own credentials"
        )
    parts = [p for p in f"{parsed.path}/{run_prefix}".split("/") if p]
    where = f"gs://{parsed.netloc}/{'/'.join(parts)}"
    if (
        not run_prefix.strip("/")
        or not _BUCKET.fullmatch(parsed.netloc)
        or any(c in raw for c in "?#;")
        or not all(_SEGMENT.fullmatch(p) and p not in (".", "..") for p in parts)
        or len("/".join(parts)) > _MAX_PREFIX
    ):
        raise PermissionDenied(
            f"cannot scope credentials to {where!r}: a checkpoint location must be a valid "
            "bucket and a non-empty prefix of letters, digits and '_.=+@~-' (no '.' or '..' "
            f"segments, at most {_MAX_PREFIX} characters)"
        )
    return parsed.netloc, "/".join(parts)


def boundary_expression(bucket: str, prefix: str) -> str:
    """The CEL condition of the boundary: objects under ``prefix/``, and listings whose
    prefix starts with ``prefix/`` (the slash is what keeps ``r-1`` out of ``r-10``).

    ``bucket`` and ``prefix`` must come from :func:`gcs_scope`, which admits no character
    that could end the string literals.
    """
    return (
        f"resource.name.startsWith('projects/_/buckets/{bucket}/objects/{prefix}/')"
        " || api.getAttribute('storage.googleapis.com/objectListPrefix', '')"
        f".startsWith('{prefix}/')"
    )


def access_boundary(bucket: str, prefix: str) -> downscoped.CredentialAccessBoundary:
    """The one-rule boundary that narrows a bucket-wide token to ``gs://bucket/prefix/``."""
    rule = downscoped.AccessBoundaryRule(
        available_resource=f"//storage.googleapis.com/projects/_/buckets/{bucket}",
        available_permissions=list(AVAILABLE_PERMISSIONS),
        availability_condition=downscoped.AvailabilityCondition(
            boundary_expression(bucket, prefix),
            title="trainbot run checkpoints",
            description=f"gs://{bucket}/{prefix}/ only",
        ),
    )
    return downscoped.CredentialAccessBoundary(rules=[rule])


def _utcnow() -> datetime:
    """Naive UTC, as google-auth keeps ``expiry``."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


class StorageTokenBroker:
    """Issues downscoped tokens of the runner-storage identity; thread-safe.

    ``service_account``: the account to impersonate (the control plane then needs
    ``iam.serviceAccounts.getAccessToken`` on it and no storage access of its own); None
    downscopes the control plane's own credentials. ``source_credentials``: the control
    plane's (application-default credentials when None, found on first use, so a
    missing one is a 503 that says what to set, not a failed start). ``sts_endpoint`` and
    ``iam_endpoint_override`` exist for tests.
    """

    def __init__(
        self,
        *,
        service_account: str | None = None,
        source_credentials: Any = None,
        sts_endpoint: str = STS_TOKEN_URL,
        iam_endpoint_override: str | None = None,
        lifetime_s: int = DEFAULT_LIFETIME_S,
    ) -> None:
        if service_account is not None and "@" not in service_account:
            raise ProviderError(
                f"{service_account!r} is not a service account e-mail: set "
                "TRAINBOT_GCP_RUNNER_STORAGE_SERVICE_ACCOUNT to "
                "trainbot-runner-storage@PROJECT.iam.gserviceaccount.com"
            )
        self.service_account = service_account
        self.sts_endpoint = sts_endpoint
        self._iam_endpoint_override = iam_endpoint_override
        self._lifetime_s = lifetime_s
        self._given = source_credentials
        self._source: Any = None
        self._lock = threading.Lock()
        # google-auth's calls take a request callable; this one bounds each call's time.
        self._request: Any = functools.partial(Request(), timeout=_TIMEOUT_S)
        self._sts = sts.Client(sts_endpoint)

    @property
    def _identity(self) -> str:
        return self.service_account or "the control plane's own service account"

    def _source_token(self) -> tuple[str, datetime | None]:
        """The undownscoped token, renewed when it has under MIN_SOURCE_LIFETIME left."""
        with self._lock:
            if self._source is None:
                base = self._given
                if base is None:
                    base, _ = google.auth.default(scopes=[_CLOUD_PLATFORM])
                self._source = (
                    impersonated_credentials.Credentials(
                        source_credentials=base,
                        target_principal=self.service_account,
                        target_scopes=[_CLOUD_PLATFORM],
                        lifetime=self._lifetime_s,
                        iam_endpoint_override=self._iam_endpoint_override,
                    )
                    if self.service_account
                    else base
                )
            source = self._source
            expiry = source.expiry
            if not source.token or (
                expiry is not None and expiry - _utcnow() < MIN_SOURCE_LIFETIME
            ):
                source.refresh(self._request)
            return str(source.token), source.expiry

    def issue(
        self, *, checkpoint_uri: str, run_prefix: str, run_id: str, attempt_id: str
    ) -> dict[str, Any]:
        """A token for ``{checkpoint_uri}/{run_prefix}/`` only, as ``{"Version": 1, "Kind":
        "gcp-access-token", "AccessToken", "Expiration"}``. Raises NotFound (not gs://),
        PermissionDenied (unscopable prefix) or ProviderError (Google refused or failed)."""
        bucket, prefix = gcs_scope(checkpoint_uri, run_prefix)
        boundary = access_boundary(bucket, prefix)
        try:
            subject, source_expiry = self._source_token()
        except GoogleAuthError as exc:
            hint = (
                f"grant the control plane's service account the trainbotMintRunnerStorageTokens "
                f"role on {self.service_account} (deploy/gcp/README.md)"
                if self.service_account
                else "run the control plane with its service account attached, or set "
                "GOOGLE_APPLICATION_CREDENTIALS"
            )
            raise ProviderError(
                f"could not get a token of {self._identity} to downscope for run {run_id} "
                f"({type(exc).__name__}: {exc}): {hint}"
            ) from None
        now = _utcnow()
        try:
            answer = self._sts.exchange_token(
                request=self._request,
                grant_type=_GRANT_TYPE,
                subject_token=subject,
                subject_token_type=_ACCESS_TOKEN_TYPE,
                requested_token_type=_ACCESS_TOKEN_TYPE,
                additional_options=boundary.to_json(),
            )
        except OAuthError as exc:
            raise ProviderError(
                f"Google's STS refused to downscope a token of {self._identity} for run "
                f"{run_id} ({exc}): check that the Security Token Service API is enabled"
            ) from None
        except GoogleAuthError as exc:
            raise ProviderError(
                f"could not reach Google's STS at {self.sts_endpoint} for run {run_id}: {exc}"
            ) from None
        token = answer.get("access_token")
        if not isinstance(token, str) or not token:
            raise ProviderError(f"Google's STS answered without a token for run {run_id}")
        lifetime = answer.get("expires_in")
        if isinstance(lifetime, (int, float)) and lifetime > 0:
            expiry = now + timedelta(seconds=lifetime)
        else:  # a downscoped token lives as long as its source (google-auth does the same)
            expiry = source_expiry or now + _FALLBACK_LIFETIME
        expires = expiry.replace(tzinfo=timezone.utc)
        log.info(
            "issued a checkpoint token for gs://%s/%s/ to attempt %s of run %s, until %s",
            bucket,
            prefix,
            attempt_id,
            run_id,
            expires.isoformat(),
        )
        return {
            "Version": 1,
            "Kind": TOKEN_KIND,
            "AccessToken": token,
            "Expiration": expires.isoformat(),
        }


def credential_broker(settings: Settings) -> StorageTokenBroker | None:
    """The broker ``TRAINBOT_GCP_RUNNER_STORAGE_SERVICE_ACCOUNT`` enables; None without it."""
    if not settings.gcp_runner_storage_service_account:
        return None
    return StorageTokenBroker(service_account=settings.gcp_runner_storage_service_account)

"""Google's exceptions as the ProviderErrors the service layer understands.

Every Compute Engine and Cloud Storage call goes through :func:`call`, so a missing
permission, a disabled API or a throttled request reaches the user as what to do.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TypeVar

from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions

from jobs.providers.base import ProviderError, ProviderPermissionError
from jobs.providers.gcp.permissions import PERMISSIONS

__all__ = ["QUOTAS_CONSOLE", "ROLE_HINT", "call", "translate"]

T = TypeVar("T")

QUOTAS_CONSOLE = "https://console.cloud.google.com/iam-admin/quotas?project={project}"
ROLE_HINT = (
    "grant the trainbotControlPlane role from deploy/gcp/roles.yaml to the control plane's "
    "service account (deploy/gcp/README.md)"
)
_PERMISSION = re.compile(r"\b((?:compute|iam|storage)\.[A-Za-z]+\.[A-Za-z]+)\b")


def _reasons(exc: api_exceptions.GoogleAPICallError) -> set[str]:
    return {str(e.get("reason", "")) for e in exc.errors or [] if isinstance(e, Mapping)}


def translate(exc: Exception, *, what: str, call: str) -> ProviderError:
    """A Google error as the ProviderError the service layer understands."""
    if isinstance(exc, (auth_exceptions.DefaultCredentialsError, auth_exceptions.RefreshError)):
        return ProviderError(
            f"no usable Google Cloud credentials to {what} ({exc}): run the control plane with"
            " the trainbot service account attached, set GOOGLE_APPLICATION_CREDENTIALS to its"
            " key file, or run `gcloud auth application-default login`"
        )
    if not isinstance(exc, api_exceptions.GoogleAPICallError):
        return ProviderError(f"could not reach Google Cloud to {what} ({exc}); try again")
    message = exc.message.split(": ", 1)[-1] if exc.message else str(exc)
    reasons = _reasons(exc)
    if isinstance(exc, api_exceptions.Forbidden):
        if reasons & {"rateLimitExceeded", "userRateLimitExceeded", "quotaExceeded"}:
            return ProviderError(f"Google Cloud is rate-limiting requests to {what}; try again")
        if "accessNotConfigured" in reasons or "SERVICE_DISABLED" in message:
            return ProviderError(
                f"the Compute Engine API is not enabled, so trainbot cannot {what}: run"
                " `gcloud services enable compute.googleapis.com` in the project"
            )
        found = _PERMISSION.search(message)
        permission = found.group(1) if found else PERMISSIONS[call][0]
        return ProviderPermissionError(
            f"Google Cloud refused to {what}: the control plane's credentials lack"
            f" {permission} ({message}); {ROLE_HINT}",
            permission=permission,
        )
    if isinstance(exc, api_exceptions.Unauthorized):
        return ProviderError(
            f"Google Cloud rejected the credentials while trying to {what} ({message}): renew"
            " them, or check GOOGLE_APPLICATION_CREDENTIALS"
        )
    if isinstance(exc, (api_exceptions.TooManyRequests, api_exceptions.ServerError)):
        return ProviderError(f"Google Cloud could not {what} just now ({message}); try again")
    return ProviderError(f"Google Cloud could not {what}: {message}")


def call(
    what: str,
    call: str,
    fn: Callable[[], T],
    *,
    not_found: str | None = "",
    conflict: bool = False,
) -> T:
    """Run one API call; Google's errors become ProviderErrors that say what to do.

    ``what`` completes "could not …"; ``call`` names the API method (a key of
    PERMISSIONS). ``not_found``: the message for a 404 ("" keeps the generic one; None
    lets the NotFound through to the caller). ``conflict``: let a 409 through.
    """
    try:
        return fn()
    except api_exceptions.NotFound as e:
        if not_found is None:
            raise
        if not_found:
            raise ProviderError(not_found) from None
        raise translate(e, what=what, call=call) from None
    except api_exceptions.Conflict as e:
        if conflict:
            raise
        raise translate(e, what=what, call=call) from None
    except ProviderError:
        raise
    except Exception as e:  # every other Google, auth or network error
        if isinstance(e, (api_exceptions.GoogleAPIError, auth_exceptions.GoogleAuthError)):
            raise translate(e, what=what, call=call) from None
        if type(e).__module__.startswith(("requests", "urllib3")):
            raise translate(e, what=what, call=call) from None
        raise

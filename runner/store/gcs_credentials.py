"""Credentials for the Cloud Storage store: the control plane's broker, anonymous for an
emulator, or application-default credentials."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import google.auth
from google.auth.credentials import AnonymousCredentials, Credentials
from google.auth.exceptions import DefaultCredentialsError
from google.oauth2.credentials import Credentials as OAuth2Credentials

from runner.errors import StoreError
from runner.store.broker import GCP_ACCESS_TOKEN, fetch_broker_credentials

#: The standard variable the official clients read; it may omit the scheme.
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"


def _naive_utc(text: str) -> datetime:
    """An ISO 8601 time as google-auth keeps ``expiry``: naive UTC."""
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc).replace(tzinfo=None)
    return moment


def broker_credentials(
    fetch: Callable[..., dict[str, Any]] = fetch_broker_credentials,
) -> OAuth2Credentials:
    """Credentials whose token comes from the control plane's broker, now and at every
    refresh. Raises StoreError when the broker refuses or cannot be reached."""

    def token(request: Any = None, scopes: Any = None) -> tuple[str, datetime]:
        answer = fetch(kind=GCP_ACCESS_TOKEN)
        try:
            return answer["AccessToken"], _naive_utc(answer["Expiration"])
        except ValueError:
            raise StoreError(
                f"the control plane's checkpoint token has an unreadable expiry "
                f"{answer['Expiration']!r}: upgrade the runner and the control plane together"
            ) from None

    value, expiry = token()
    return OAuth2Credentials(token=value, expiry=expiry, refresh_handler=token)


def store_credentials(uri: str, *, host: str | None, brokered: bool) -> Credentials:
    """The broker's token when ``brokered``; else anonymous for an emulator at ``host``,
    else application-default credentials. Raises StoreError when there are none."""
    if brokered:
        return broker_credentials()
    if host:
        return AnonymousCredentials()  # as the official client does for an emulator
    try:
        found, _ = google.auth.default(scopes=[_SCOPE])
    except DefaultCredentialsError as exc:
        raise StoreError(
            f"no Google credentials for {uri} ({exc}): run on an instance with a "
            "service account, set GOOGLE_APPLICATION_CREDENTIALS, or run "
            "`gcloud auth application-default login`"
        ) from exc
    return found

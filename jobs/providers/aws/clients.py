"""One AWS account, in its home region and any other, as the provider's modules share it.

The botocore clients (cached, thread-safe), the error translation every call goes
through, what never changes there (the account id, instance-type sizes, AMI roots), and
the UTC conversion every dated answer needs.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import NoRegionError

from jobs.providers.aws.errors import decode_denial, translate
from jobs.providers.base import ProviderError

__all__ = ["Clients", "TypeInfo", "utc", "utcnow"]


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def utc(value: datetime) -> datetime:
    """``value`` in UTC; AWS's naive timestamps are UTC already."""
    return value.astimezone(timezone.utc) if value.tzinfo else value.replace(tzinfo=timezone.utc)


@dataclass(frozen=True)
class TypeInfo:
    """What the quota arithmetic needs of an instance type."""

    #: Default vCPUs, which is what EC2's quotas count.
    vcpus: int
    #: GPUs of every kind on the type; 0 for CPU-only types.
    gpus: int


class Clients:
    """The clients of one provider, and the facts it caches about its account."""

    def __init__(
        self, *, region: str, session: boto3.session.Session, endpoint_url: str | None
    ) -> None:
        self.region = region
        self._session = session
        self._endpoint_url = endpoint_url
        self._lock = threading.Lock()
        self._clients: dict[tuple[str, str, bool], Any] = {}
        self._account: str | None = None
        #: (instance type, region) → its sizes.
        self.types: dict[tuple[str, str], TypeInfo] = {}
        #: (region, AMI id) → (root device, size in GiB), None when AWS does not say.
        self.roots: dict[tuple[str, str], tuple[str, int] | None] = {}
        #: Region → the same clients and caches, with that region as the default.
        self._views: dict[str, Clients] = {region: self}

    def in_region(self, region: str) -> Clients:
        """These clients with ``region`` as their default: one cache of clients and facts
        for every region the provider works in (an attempt may fail over to another)."""
        with self._lock:
            view = self._views.get(region)
            if view is None:
                view = copy.copy(self)  # shares the lock, the client cache and the facts
                view.region = region
                self._views[region] = view
            return view

    def regions(self) -> list[str]:
        """The regions these clients have worked in, this one first."""
        with self._lock:
            return list(self._views)

    def client(self, service: str, *, region: str | None = None, advisory: bool = False) -> Any:
        """The botocore client this provider uses for ``service`` (cached, thread-safe).

        ``advisory`` clients answer questions whose failure only degrades a report (spot
        placement scores, console output): one try and short timeouts, so a slow or
        refusing endpoint never holds up preflight or reconcile. Tests attach botocore's
        Stubber to these same objects.
        """
        key = (service, region or self.region, advisory)
        with self._lock:
            found = self._clients.get(key)
            if found is None:
                config = Config(
                    retries={"mode": "standard", "max_attempts": 1 if advisory else 4},
                    connect_timeout=5 if advisory else 10,
                    read_timeout=15 if advisory else 60,
                    user_agent_extra="trainbot",
                )
                try:
                    found = self._session.client(
                        service,
                        region_name=key[1],
                        endpoint_url=self._endpoint_url,
                        config=config,
                    )
                except NoRegionError:  # pragma: no cover - region is always passed
                    raise ProviderError("no AWS region: set TRAINBOT_AWS_REGION") from None
                self._clients[key] = found
            return found

    @contextlib.contextmanager
    def call(self, service: str, doing: str) -> Iterator[None]:
        """Turn SDK failures into ProviderErrors that say what to do."""
        with translate(service, doing, decode=self.decode_denial):
            yield

    def decode_denial(self, message: str) -> tuple[str, str] | None:
        """The action and resource EC2 denied, from its encoded message (best effort)."""
        return decode_denial(message, sts=lambda: self.client("sts", advisory=True))

    def account_id(self) -> str:
        if self._account is None:
            with self.call("sts", "identify the AWS account"):
                self._account = str(self.client("sts").get_caller_identity()["Account"])
        return self._account

"""Who sent a batch: the runner's bearer token, looked up by its hash.

A look-up is cached for :data:`TOKEN_CACHE_S`; revocation does not wait for the cache,
because the batch's transaction compares the hash again on the locked attempt row.

An attempt's token is derived from the control plane's secret and the attempt id, and
only its hash is stored, so every replica must share the secret
(``TRAINBOT_RUNNER_TOKEN_SECRET``): a replica that relaunches another's attempt hands the
instance the token the stored hash names. A multi-node attempt's nodes after the first
hold tokens derived from the attempt's (:func:`jobs.providers.gang.node_token`), each
good for events as that node only.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time as _time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime

from sqlalchemy import Engine, select

from jobs.database.models import Attempt, hash_token, table_of
from jobs.database.replica_tables import LEADER_LEASE, SchedulerLease
from jobs.domain.errors import SettingsError
from jobs.providers.gang import node_token, parse_node_token

log = logging.getLogger(__name__)

#: How long a token → attempt look-up is trusted before the database is asked again.
#: Revocation does not wait for it: the transaction re-checks the hash on the locked row.
TOKEN_CACHE_S = 1.0
_TOKEN_CACHE_MAX = 4096

#: What a runner is told when its token is unknown or was revoked.
REVOKED = (
    "unknown or revoked runner token: the attempt has ended or the token is wrong; "
    "stop sending for this attempt"
)

_ATTEMPTS = table_of(Attempt)


@dataclass(frozen=True)
class Principal:
    """Who a token belongs to."""

    #: The hash of the attempt's own token (node 0's), whatever node's token was shown:
    #: the transaction compares it with the attempt row's, so revoking the attempt's
    #: token revokes every node's.
    token_hash: str
    attempt_id: str
    run_id: str
    #: The node of the attempt the token was made for; it may send events as that node only.
    node: int = 0


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer …`` header; None for anything else."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


class Tokens:
    """Token hash → :class:`Principal`, asking the database at most once per
    :data:`TOKEN_CACHE_S` per token. Thread-safe."""

    def __init__(
        self, engine: Engine, *, attempt_token: Callable[[str], str] | None = None
    ) -> None:
        """``attempt_token(attempt id)``: the attempt's token, as the control plane derives
        it (``Deps.runner_token``); without it, node tokens are refused."""
        self._engine = engine
        self._attempt_token = attempt_token
        self._cache: OrderedDict[str, tuple[Principal, float]] = OrderedDict()
        self._lock = threading.Lock()

    def principal(self, token_hash: str, *, cached: bool = True) -> Principal | None:
        """Whose token this is, or None; ``cached=False`` asks the database in any case.

        Raises SQLAlchemyError when the database is unavailable.
        """
        clock = _time.monotonic()
        with self._lock:
            hit = self._cache.get(token_hash)
            if cached and hit is not None and hit[1] > clock:
                return hit[0]
        attempts = _ATTEMPTS.c
        with self._engine.connect() as connection:
            row = connection.execute(
                select(attempts.id, attempts.run_id).where(attempts.token_hash == token_hash)
            ).first()
        if row is None:
            return None
        principal = Principal(token_hash, row.id, row.run_id)
        with self._lock:
            self._cache[token_hash] = (principal, clock + TOKEN_CACHE_S)
            self._cache.move_to_end(token_hash)
            while len(self._cache) > _TOKEN_CACHE_MAX:
                self._cache.popitem(last=False)
        return principal

    def of_token(self, token: str, *, cached: bool = True) -> Principal | None:
        """Whose token this is, an attempt's (node 0) or one node's of it, or None.

        Raises SQLAlchemyError when the database is unavailable.
        """
        parsed = parse_node_token(token)
        if parsed is None:
            return self.principal(hash_token(token), cached=cached)
        rank, attempt_id = parsed
        if self._attempt_token is None:
            return None
        attempt_token = self._attempt_token(attempt_id)
        if not hmac.compare_digest(node_token(attempt_token, attempt_id, rank), token):
            return None
        principal = self.principal(hash_token(attempt_token), cached=cached)
        if principal is None or principal.attempt_id != attempt_id:
            return None
        return replace(principal, node=rank)

    def drop(self, token_hash: str) -> None:
        """Forget a look-up: the token was found revoked."""
        with self._lock:
            self._cache.pop(token_hash, None)


#: How many live attempts :func:`check_secret` compares at start.
_CHECKED_ATTEMPTS = 100


def check_secret(
    engine: Engine,
    attempt_token: Callable[[str], str],
    *,
    replica: str,
    now: datetime,
) -> None:
    """Refuse to start beside replicas that sign runner tokens with another secret.

    Nothing records the secret; the live attempts' stored hashes are the witnesses. When
    this replica's secret does not reproduce one of them and another replica holds the
    scheduler lease now, the two differ, and an attempt one launched and the other
    relaunched would be refused by ingest: raise SettingsError saying how to share one.
    With no other replica up, the secret changed since those attempts launched (a lost
    state directory): their runners keep working, but a relaunch or a node after the
    first would not, so say so in the log and start.
    """
    attempts = _ATTEMPTS.c
    with engine.connect() as connection:
        rows = connection.execute(
            select(attempts.id, attempts.token_hash)
            .where(attempts.token_hash.is_not(None))
            .limit(_CHECKED_ATTEMPTS)
        ).all()
        leases = table_of(SchedulerLease).c
        lease = connection.execute(
            select(leases.holder, leases.expires_at).where(leases.name == LEADER_LEASE)
        ).first()
    foreign = [row.id for row in rows if hash_token(attempt_token(row.id)) != row.token_hash]
    if not foreign:
        return
    named = ", ".join(foreign[:5]) + (" …" if len(foreign) > 5 else "")
    if lease is not None and lease.holder != replica and lease.expires_at > now:
        raise SettingsError(
            "TRAINBOT_RUNNER_TOKEN_SECRET: this replica signs runner tokens with another "
            f"secret than replica {lease.holder}, which shares this database (attempts "
            f"{named} carry its tokens); an attempt one launches and the other relaunches "
            "would be refused. Set TRAINBOT_RUNNER_TOKEN_SECRET to one value on every "
            "replica (openssl rand -hex 32, from a Kubernetes or compose secret)"
        )
    log.warning(
        "runner tokens: attempts %s were signed with another secret than this control "
        "plane's (TRAINBOT_RUNNER_TOKEN_SECRET or the state directory's secret changed); "
        "their runners keep sending, but a relaunch of them or their nodes after the first "
        "will be refused",
        named,
    )

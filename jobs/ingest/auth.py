"""Who sent a batch: the runner's bearer token, looked up by its hash.

A look-up is cached for :data:`TOKEN_CACHE_S`; revocation does not wait for the cache,
because the batch's transaction compares the hash again on the locked attempt row.
"""

from __future__ import annotations

import threading
import time as _time
from collections import OrderedDict
from dataclasses import dataclass

from sqlalchemy import Engine, select

from jobs.models import Attempt, table_of

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

    token_hash: str
    attempt_id: str
    run_id: str


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

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
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

    def drop(self, token_hash: str) -> None:
        """Forget a look-up: the token was found revoked."""
        with self._lock:
            self._cache.pop(token_hash, None)

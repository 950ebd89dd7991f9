"""People's tokens for the HTTP API: issued from chat (``/train token``), used by the
command-line client and CI (``Authorization: Bearer <token>`` on ``/v1/commands``).

A token stands for one person in one channel: the one who asked for it, in the channel
they asked in. A request with it is decided as a command they typed there would be
(:mod:`bot.api`), so it can do nothing its holder could not do in chat. Only its SHA-256
is stored, so it is shown once; it expires, and its holder (or an admin) revokes it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlmodel import col, select

from jobs.database.db import session_scope
from jobs.database.models import ApiToken, hash_token
from jobs.domain.actor import Actor
from jobs.domain.errors import NotFound, PermissionDenied
from jobs.process.deps import Deps

__all__ = [
    "MAX_TOKENS",
    "PREFIX",
    "TOKEN_DAYS",
    "Holder",
    "Issued",
    "holder",
    "issue",
    "revoke",
    "tokens",
]

#: Every person token starts with this, so a leaked one is recognised (secret scanners).
PREFIX = "tbt_"
#: Days a token is valid.
TOKEN_DAYS = 90
#: Live tokens one person may hold: a loop that issues them cannot fill the table.
MAX_TOKENS = 20


@dataclass(frozen=True)
class Issued:
    """A token just issued: the only time its value exists outside its holder's hands."""

    id: str
    token: str
    name: str
    expires_at: datetime


@dataclass(frozen=True)
class Holder:
    """Who a valid token acts as, and where."""

    token_id: str
    user: str
    channel: str


def issue(deps: Deps, actor: Actor, *, name: str, days: int = TOKEN_DAYS) -> Issued:
    """A new token for ``actor`` in their channel; the value is returned, its hash kept."""
    now = deps.clock()
    value = PREFIX + secrets.token_urlsafe(32)
    with session_scope(deps.engine) as session:
        live = session.exec(
            select(ApiToken.id).where(
                ApiToken.user == actor.user,
                col(ApiToken.revoked_at).is_(None),
                ApiToken.expires_at > now,
            )
        ).all()
        if len(live) >= MAX_TOKENS:
            raise PermissionDenied(
                f"you hold {len(live)} live tokens, the most there can be; revoke one "
                "(/train token revoke <id>) first"
            )
        row = ApiToken(
            token_hash=hash_token(value),
            user=actor.user,
            channel=actor.channel,
            name=name,
            created_at=now,
            expires_at=now + timedelta(days=days),
        )
        session.add(row)
        session.flush()
        issued = Issued(id=row.id, token=value, name=name, expires_at=row.expires_at)
    deps.journal.record("token issued", None, user=actor.user, token=issued.id, name=name)
    return issued


def tokens(deps: Deps, actor: Actor) -> list[ApiToken]:
    """The caller's live tokens, newest first (never their values, which are not kept)."""
    now = deps.clock()
    with session_scope(deps.engine) as session:
        rows = session.exec(
            select(ApiToken)
            .where(
                ApiToken.user == actor.user,
                col(ApiToken.revoked_at).is_(None),
                ApiToken.expires_at > now,
            )
            .order_by(col(ApiToken.created_at).desc())
        ).all()
        for row in rows:
            session.expunge(row)
        return list(rows)


def revoke(deps: Deps, actor: Actor, token_id: str) -> list[str]:
    """Revoke one of the caller's tokens (an admin: anyone's), or all of theirs
    (``all``); returns the ids revoked."""
    now = deps.clock()
    with session_scope(deps.engine) as session:
        query = select(ApiToken).where(col(ApiToken.revoked_at).is_(None))
        if token_id == "all":
            query = query.where(ApiToken.user == actor.user)
        else:
            query = query.where(ApiToken.id == token_id)
        rows = session.exec(query).all()
        mine = bool(rows) and (actor.is_admin or rows[0].user == actor.user)
        if token_id != "all" and not mine:
            raise NotFound(f"no live token {token_id} of yours; /train token list shows them")
        for row in rows:
            row.revoked_at = now
            session.add(row)
        revoked = [row.id for row in rows]
    for each in revoked:
        deps.journal.record("token revoked", None, user=actor.user, token=each)
    return revoked


def holder(deps: Deps, token: str | None) -> Holder | None:
    """Who ``token`` acts as, or None when it is unknown, revoked or expired. Asked of
    the database on every request, so a revoke takes effect at once."""
    if not token or not token.startswith(PREFIX) or len(token) > 200:
        return None
    now = deps.clock()
    with session_scope(deps.engine) as session:
        row = session.exec(select(ApiToken).where(ApiToken.token_hash == hash_token(token))).first()
        if row is None or row.revoked_at is not None or row.expires_at <= now:
            return None
        row.last_used_at = now
        session.add(row)
        return Holder(token_id=row.id, user=row.user, channel=row.channel)

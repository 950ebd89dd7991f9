"""The one place where a string becomes Slack markup: escaping, mentions, handle lookup.

Slack turns ``<!channel>``, ``<!here>``, ``<@U…>``, ``<!subteam^S…>`` and ``<https://…|…>``
into pings and links. Text from users (spec names, details, handles typed into a spec)
must never do that, so everything is escaped except a mention whose id has the shape
of a Slack user or user-group id. Handles (``@ml-oncall``) notify nobody in a message
posted by an app: :class:`MentionResolver` turns them into ids through
``usergroups.list`` and ``users.list``, cached and refreshed.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackRequestError

__all__ = ["MentionResolver", "escape", "mention"]

log = logging.getLogger(__name__)

_USER_ID = re.compile(r"^[UW][A-Z0-9]{2,}$")
_GROUP_ID = re.compile(r"^S[A-Z0-9]{2,}$")
_USER_MARKUP = re.compile(r"^<@([UW][A-Z0-9]{2,})(?:\|[^<>&]*)?>$")
_GROUP_MARKUP = re.compile(r"^<!subteam\^(S[A-Z0-9]{2,})(?:\|[^<>&]*)?>$")


def escape(text: str) -> str:
    """Slack's three control characters, so user text cannot forge mentions or links."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def mention(who: str | None) -> str:
    """A user or user group as a mention when ``who`` is one by id, else escaped text.

    ``U…``/``W…`` and ``<@U…>`` become ``<@U…>``; ``S…`` and ``<!subteam^S…>`` become
    ``<!subteam^S…>``. Anything else (``<!channel>``, a link, a handle) is shown as
    typed and notifies nobody.
    """
    if not who:
        return "someone"
    who = who.strip()
    if _USER_ID.match(who):
        return f"<@{who}>"
    if _GROUP_ID.match(who):
        return f"<!subteam^{who}>"
    user = _USER_MARKUP.match(who)
    if user:
        return f"<@{user.group(1)}>"
    group = _GROUP_MARKUP.match(who)
    if group:
        return f"<!subteam^{group.group(1)}>"
    return escape(who)


def _id_of(who: str) -> str | None:
    """The id in ``who`` when it is an id or id markup, else None."""
    who = who.strip()
    if _USER_ID.match(who) or _GROUP_ID.match(who):
        return who
    found = _USER_MARKUP.match(who) or _GROUP_MARKUP.match(who)
    return found.group(1) if found else None


class MentionResolver:
    """Handles and ids to mention markup, from the workspace's directory.

    One ``usergroups.list`` and one (paginated) ``users.list`` answer every lookup for
    ``ttl_s``; a handle not found is looked up again at most every ``retry_s`` (a group
    created a minute ago should page). When Slack cannot be asked, ids still become
    mentions (their shape is checked) and handles stay text.
    """

    def __init__(
        self,
        client: WebClient | None,
        *,
        ttl_s: float = 600.0,
        retry_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._ttl = ttl_s
        self._retry = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._loaded_at: float | None = None
        #: lower-case handle -> markup; id -> markup.
        self._by_handle: dict[str, str] = {}
        self._by_id: dict[str, str] = {}

    def resolve(self, who: str | None) -> str | None:
        """``who`` as ``<@U…>`` or ``<!subteam^S…>``; None when it names nobody known."""
        if not who:
            return None
        key = who.strip()
        for attempt in range(2):
            self._load(force=attempt == 1)
            with self._lock:
                known = self._loaded_at is not None
                ident = _id_of(key)
                if ident is not None:
                    found = self._by_id.get(ident)
                    if found is None and not self._by_id:
                        found = mention(ident)  # no directory: trust the id's shape
                else:
                    found = self._by_handle.get(key.lstrip("@").lower())
            if found is not None or not known:
                return found
        return None

    def text(self, who: str | None) -> str:
        """What a message shows for ``who``: its mention, else the name, escaped."""
        return self.resolve(who) or escape(who or "someone")

    def _load(self, *, force: bool) -> None:
        now = self._clock()
        with self._lock:
            age = None if self._loaded_at is None else now - self._loaded_at
            if age is not None and age < (self._retry if force else self._ttl):
                return
            self._loaded_at = now  # one caller loads; the others use what is there
        if self._client is None:
            return
        by_handle: dict[str, str] = {}
        by_id: dict[str, str] = {}
        try:
            for group in self._client.usergroups_list().get("usergroups") or ():
                if group.get("date_delete"):
                    continue
                markup = f"<!subteam^{group['id']}>"
                by_id[str(group["id"])] = markup
                by_handle[str(group.get("handle", "")).lower()] = markup
            for user in self._users():
                if user.get("deleted") or not user.get("id"):
                    continue
                markup = f"<@{user['id']}>"
                by_id[str(user["id"])] = markup
                profile = user.get("profile") or {}
                for name in (profile.get("display_name"), user.get("name")):
                    if name:
                        by_handle.setdefault(str(name).lower(), markup)
        except (SlackApiError, SlackRequestError, OSError, KeyError) as exc:
            log.warning(
                "could not read the Slack directory (%s): handles stay plain text; "
                "add the usergroups:read and users:read scopes",
                exc,
            )
            return
        with self._lock:
            self._by_handle, self._by_id = by_handle, by_id

    def _users(self) -> list[dict[str, Any]]:
        assert self._client is not None
        users: list[dict[str, Any]] = []
        cursor = None
        for _ in range(100):  # 100 pages of 200: a large workspace, never an endless loop
            page = self._client.users_list(limit=200, cursor=cursor)
            users.extend(page.get("members") or ())
            cursor = (page.get("response_metadata") or {}).get("next_cursor")
            if not cursor:
                break
        return users

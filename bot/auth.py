"""Who may do what from Slack, decided from the signed payload alone.

The text of a command can say anything; the user id, team id and channel id of a request
signed with the app's secret cannot be forged, so every decision here starts from those
(a :class:`Caller`). Three questions are asked, on every command and every button:

- Is the channel allowed? ``TRAINBOT_ALLOWED_CHANNELS`` (ids or names); empty allows all.
- May this person launch? ``launchers`` (user ids or user groups); empty means everyone
  in an allowed channel.
- May this person change someone else's run? Only its requester or an admin
  (``TRAINBOT_ADMINS``: user ids, user group ids ``S…`` or group handles ``@ml-leads``).

User groups are resolved through the Web API (``usergroups:read``) and cached for a few
minutes; a failure to resolve counts as "not a member", so an outage of that API fails
closed. Every denial is audited: a ``denied`` record in the journal and a warning in the
log, with who, where, what and why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackRequestError

from jobs.notify import Journal
from jobs.service import Actor
from jobs.settings import Settings

__all__ = [
    "GROUP_TTL_S",
    "Authorizer",
    "Caller",
    "Policy",
    "caller_from_action",
    "caller_from_command",
    "caller_from_event",
    "caller_from_view",
]

log = logging.getLogger(__name__)

#: Seconds a user group's members are trusted before they are fetched again.
GROUP_TTL_S = 300.0


@dataclass(frozen=True)
class Caller:
    """Who sent a request and from where, as the signed payload says."""

    #: Workspace id (``T…``); None only in hand-built payloads.
    team: str | None
    #: Slack user id (``U…`` or ``W…``).
    user: str
    #: Channel id (``C…``, ``G…``, ``D…``); None for the App Home and modals.
    channel: str | None
    #: The channel's name without ``#``, when the payload carries it.
    channel_name: str | None = None


def caller_from_command(body: Mapping[str, Any]) -> Caller:
    """A slash command's form fields."""
    return Caller(
        team=body.get("team_id"),
        user=str(body.get("user_id") or ""),
        channel=body.get("channel_id"),
        channel_name=body.get("channel_name"),
    )


def caller_from_action(body: Mapping[str, Any]) -> Caller:
    """An interactive payload (``block_actions``): a button in a message or the App Home."""
    channel = body.get("channel") or {}
    container = body.get("container") or {}
    return Caller(
        team=(body.get("team") or {}).get("id") or (body.get("user") or {}).get("team_id"),
        user=str((body.get("user") or {}).get("id") or ""),
        channel=channel.get("id") or container.get("channel_id"),
        channel_name=channel.get("name"),
    )


def caller_from_view(body: Mapping[str, Any], *, channel: str | None) -> Caller:
    """A modal submission: the channel comes from the modal's private metadata, which we
    wrote when we opened it and Slack returns signed."""
    return Caller(
        team=(body.get("team") or {}).get("id"),
        user=str((body.get("user") or {}).get("id") or ""),
        channel=channel,
    )


def caller_from_event(body: Mapping[str, Any]) -> Caller:
    """An Events API envelope (``app_home_opened``)."""
    event = body.get("event") or {}
    return Caller(team=body.get("team_id"), user=str(event.get("user") or ""), channel=None)


@dataclass(frozen=True)
class Policy:
    """The rules, as configured; see the module docstring."""

    #: Channel ids and names (without ``#``); empty allows every channel.
    allowed_channels: frozenset[str] = frozenset()
    #: User ids, group ids or ``@handles`` who may launch; empty allows everyone.
    launchers: frozenset[str] = frozenset()
    #: User ids, group ids or ``@handles`` who may change anyone's run.
    admins: frozenset[str] = frozenset()

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        # ``launchers`` is read if the settings have it, so this works before and after
        # a TRAINBOT_LAUNCHERS setting exists; without it, everyone in an allowed
        # channel may launch.
        launchers: Iterable[str] = getattr(settings, "launchers", None) or ()
        return cls(
            allowed_channels=frozenset(_channel_key(c) for c in settings.allowed_channels),
            launchers=frozenset(launchers),
            admins=frozenset(settings.admins),
        )


def _channel_key(name: str) -> str:
    return name.strip().lstrip("#").lower()


class Authorizer:
    """Answers the three questions for a :class:`Caller`, and audits every "no"."""

    def __init__(
        self,
        policy: Policy,
        *,
        client: WebClient | None,
        journal: Journal,
        clock: Callable[[], float] = time.monotonic,
        group_ttl_s: float = GROUP_TTL_S,
    ) -> None:
        self.policy = policy
        self._client = client
        self._journal = journal
        self._clock = clock
        self._ttl = group_ttl_s
        self._lock = threading.Lock()
        #: (fetched at, members by group id, group id by handle)
        self._groups: tuple[float, dict[str, frozenset[str]], dict[str, str]] | None = None

    # --- the questions ------------------------------------------------------------------

    def channel_allowed(self, caller: Caller, *, channel: str | None = None) -> bool:
        """Whether commands are accepted where this came from (or in ``channel``, for a
        button in the App Home, which has no channel of its own)."""
        names = {caller.channel, caller.channel_name} if channel is None else {channel}
        return any(self.channel_allowed_name(n) for n in names if n is not None) or (
            not self.policy.allowed_channels
        )

    def channel_allowed_name(self, channel: str | None) -> bool:
        """Whether a channel (id or name) is one where trainbot works."""
        allowed = self.policy.allowed_channels
        return not allowed or (channel is not None and _channel_key(channel) in allowed)

    def may_launch(self, caller: Caller) -> bool:
        return not self.policy.launchers or self._member(caller.user, self.policy.launchers)

    def is_admin(self, caller: Caller) -> bool:
        return bool(self.policy.admins) and self._member(caller.user, self.policy.admins)

    def may_change(self, caller: Caller, *, owner: str) -> bool:
        """Whether ``caller`` may stop, resubmit or confirm a run that ``owner`` started."""
        return caller.user == owner or self.is_admin(caller)

    def actor(self, caller: Caller, *, channel: str | None = None) -> Actor:
        """The service layer's view of the caller."""
        return Actor(
            user=caller.user,
            channel=channel or caller.channel or "",
            is_admin=self.is_admin(caller),
        )

    def deny(self, caller: Caller, *, action: str, reason: str, run_id: str | None = None) -> None:
        """Audit a denial: the journal (kept with the run's story) and the log."""
        self._journal.record(
            "denied",
            run_id,
            user=caller.user,
            team=caller.team,
            channel=caller.channel,
            action=action,
            reason=reason,
        )
        log.warning(
            "denied %s to %s in %s%s: %s",
            action,
            caller.user,
            caller.channel or "(no channel)",
            f" on {run_id}" if run_id else "",
            reason,
        )

    # --- user groups --------------------------------------------------------------------

    def _member(self, user: str, entries: frozenset[str]) -> bool:
        if user in entries:
            return True
        groups = [e for e in entries if _is_group(e)]
        if not groups:
            return False
        members, handles = self._directory()
        for entry in groups:
            group_id = handles.get(entry[1:].lower()) if entry.startswith("@") else entry
            if group_id is not None and user in members.get(group_id, frozenset()):
                return True
        return False

    def _directory(self) -> tuple[dict[str, frozenset[str]], dict[str, str]]:
        """The workspace's user groups: members by group id, and group ids by handle.

        One ``usergroups.list`` call (with the members) answers every group question,
        cached for ``group_ttl_s``; when it fails, every group counts as empty.
        """
        now = self._clock()
        with self._lock:
            if self._groups is not None and now - self._groups[0] < self._ttl:
                return self._groups[1], self._groups[2]
        members: dict[str, frozenset[str]] = {}
        handles: dict[str, str] = {}
        if self._client is not None:
            try:
                response = self._client.usergroups_list(include_users=True)
            except (SlackApiError, SlackRequestError, OSError) as exc:
                log.warning(
                    "could not list the Slack user groups (%s); treating them as empty", exc
                )
                return members, handles
            for group in response.get("usergroups") or ():
                group_id = str(group.get("id"))
                members[group_id] = frozenset(str(u) for u in group.get("users") or ())
                handles[str(group.get("handle", "")).lower()] = group_id
        with self._lock:
            self._groups = (now, members, handles)
        return members, handles


def _is_group(entry: str) -> bool:
    """``S…`` is a user group id; ``@name`` a group handle. Users are ``U…``/``W…``."""
    return entry.startswith("@") or (entry[:1] == "S" and entry[1:].isalnum())

"""Who may do what, in Slack or at the console, decided from who is asking alone.

The text of a command can say anything; the user id, team id and channel id of a request
signed with the app's secret cannot be forged, so every decision here starts from those
(a :class:`Caller`, read from the payload by :mod:`bot.listeners`; at the console, the
login name). These questions are asked, on every command and every button:

- Is the person one of the team? A user whose workspace is not ours (``TRAINBOT_SLACK_TEAM_IDS``,
  by default the bot's own, from ``auth.test``), such as a Slack Connect guest in a
  shared channel, is refused unless ``TRAINBOT_ALLOW_EXTERNAL_USERS`` is set.
- Is the channel allowed? ``TRAINBOT_ALLOWED_CHANNELS``: channel ids, compared exactly,
  or ``#names``, compared with the name Slack's API gives for the channel id (never the
  name the payload claims); empty allows all.
- May this person launch? ``TRAINBOT_LAUNCHERS`` (user ids or user groups); empty means
  everyone in an allowed channel (``trainbot serve`` refuses that with the local provider).
- May this person change someone else's run? Only its requester or an admin
  (``TRAINBOT_ADMINS``: user ids, user group ids ``S…`` or group handles ``@ml-leads``).
- What may this person see? The runs and alerts of the channel they are in; in the App
  Home, of the channels they are a member of (``users.conversations``); admins see all.
- Is the person in the channel? A button in a message acts for the channel it was
  pressed in, so only that channel's members may press it (anyone in the workspace can
  open a public channel's messages); a run reports to a private channel of its
  ``notify.channel`` only when its launcher is a member of it.

Every front end (Slack commands, buttons, the App Home, the console) describes what a
request would do as an :class:`Ask` and gets its answer from :meth:`Authorizer.authorize`,
the one place these rules are applied, at the moment the request acts: the launcher list
is the one the process runs with now, so a person removed from ``TRAINBOT_LAUNCHERS`` can
start nothing more, whether by a command, a button on an old message or the console.

User groups, channel names and memberships are resolved through the Web API and cached
for a few minutes; a failure to resolve counts as "no", so an outage fails closed. Every
denial is audited: a ``denied`` record in the journal and a warning in the log, with
who, where, what and why, and never the values of the command.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackRequestError

from jobs.outbound.notify import Journal
from jobs.process.settings import Settings
from jobs.usecases.service import Actor

__all__ = [
    "CHANNEL_DENIED",
    "EXTERNAL_DENIED",
    "GROUP_TTL_S",
    "LAUNCH_DENIED",
    "LAUNCH_GROUP_TTL_S",
    "NOT_A_MEMBER",
    "NOT_IN_CHANNEL",
    "ONCALL_DENIED",
    "PRIVATE_CHANNEL_DENIED",
    "Ask",
    "Authorizer",
    "Caller",
    "Denial",
    "LocalAuthorizer",
    "Policy",
    "not_yours",
    "redact_command",
]

log = logging.getLogger(__name__)

#: Seconds a user group's members are trusted before they are fetched again.
GROUP_TTL_S = 300.0
#: At most this old when they decide whether someone may start compute: a person taken
#: out of a launcher group can start nothing seconds later, not minutes.
LAUNCH_GROUP_TTL_S = 15.0

CHANNEL_DENIED = (
    "trainbot does not take commands in this channel. Ask an admin to add it to "
    "TRAINBOT_ALLOWED_CHANNELS, or use one of the team's training channels."
)
EXTERNAL_DENIED = (
    "trainbot takes commands only from members of this team's workspace. People from "
    "other organisations in a shared channel can read along; ask a team member to act, "
    "or an admin to set TRAINBOT_ALLOW_EXTERNAL_USERS."
)
NOT_IN_CHANNEL = (
    "{target} reports to a channel you are not in, so it cannot be changed from here. "
    "Ask in its channel."
)
NOT_A_MEMBER = (
    "Only members of this channel can use its buttons, and you are not one. Join the "
    "channel, or ask someone in it."
)
PRIVATE_CHANNEL_DENIED = (
    "notify.channel names a private channel you are not a member of, so the run cannot "
    "report there. Ask to be added to it, or leave notify.channel out to report here."
)
ONCALL_DENIED = (
    "Only admins choose who is on call (TRAINBOT_ADMINS). Ask one of them, or ask an "
    "admin to add you."
)
LAUNCH_DENIED = (
    "You are not on the list of people who may launch runs. Ask an admin to add you "
    "(TRAINBOT_LAUNCHERS), or ask a teammate who is."
)


def not_yours(run_id: str, owner: str) -> str:
    return (
        f"{run_id} belongs to <@{owner}>; only they or an admin can change it. "
        "Ask them, or the on-call admin."
    )


@dataclass(frozen=True)
class Caller:
    """Who sent a request and from where, as the signed payload says."""

    #: The person's own workspace id (``T…``): for a Slack Connect guest, theirs, not
    #: ours. None only in hand-built payloads (and then the person counts as external).
    team: str | None
    #: Slack user id (``U…`` or ``W…``).
    user: str
    #: Channel id (``C…``, ``G…``, ``D…``); None for the App Home and modals.
    channel: str | None
    #: The channel's name without ``#``, when the payload carries it.
    channel_name: str | None = None


@dataclass(frozen=True)
class Policy:
    """The rules, as configured; see the module docstring."""

    #: Channel ids (``C…``, ``G…``), compared exactly; empty with ``channel_names`` allows all.
    allowed_channels: frozenset[str] = frozenset()
    #: Channel names (lowercase, without ``#``), compared with Slack's name for the id.
    channel_names: frozenset[str] = frozenset()
    #: User ids, group ids or ``@handles`` who may launch; empty allows everyone.
    launchers: frozenset[str] = frozenset()
    #: User ids, group ids or ``@handles`` who may change anyone's run.
    admins: frozenset[str] = frozenset()
    #: Our workspaces; empty means the bot's own (``auth.test``).
    teams: frozenset[str] = frozenset()
    #: Whether people of other workspaces (Slack Connect) may use trainbot.
    allow_external: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        ids, names = split_channels(settings.allowed_channels)
        return cls(
            allowed_channels=ids,
            channel_names=names,
            launchers=frozenset(settings.launchers),
            admins=frozenset(settings.admins),
            teams=frozenset(settings.slack_team_ids),
            allow_external=settings.allow_external_users,
        )

    @property
    def restricts_channels(self) -> bool:
        return bool(self.allowed_channels or self.channel_names)


@dataclass(frozen=True)
class Ask:
    """What a request would do, as far as permission goes. Each front end describes its
    command or button as one of these; :meth:`Authorizer.authorize` answers it."""

    #: The verb or button, for the audit (never the command's values).
    action: str
    #: Whether it starts compute (a launch, a preflight's dry run, a resubmit, Launch
    #: anyway, Continue): only for people on ``TRAINBOT_LAUNCHERS`` as it stands now.
    starts_compute: bool = False
    #: The run or alert a button acts on, as its messages name it: the caller must see
    #: the channel it reports to (``target_channel``). Commands leave it out: the service
    #: answers a run of another channel as one that does not exist.
    target: str | None = None
    #: The run it changes (or whose alert it acts on), and that run's requester: when
    #: ``owner`` is given, only they or an admin may.
    run: str | None = None
    owner: str | None = None
    #: Whether it sets who is on call (admins only).
    sets_oncall: bool = False
    #: The channel ``target`` reports to; in the App Home (which has no channel of its
    #: own) the request is allowed or not as that channel is.
    target_channel: str | None = None
    #: A button pressed in a message: only members of the message's channel may.
    in_message: bool = False
    #: The channel a new run would report to (``notify.channel``), when not this one.
    reports_to: str | None = None


@dataclass(frozen=True)
class Denial:
    """Why a request is refused: ``reason`` is audited, ``text`` shown to the caller."""

    reason: str
    text: str
    run_id: str | None = None


#: A Slack conversation id: upper-case letters and digits, ``C…`` or ``G…`` (or ``D…``).
_CHANNEL_ID = re.compile(r"[CGD][A-Z0-9]{2,}")


def split_channels(entries: Iterable[str]) -> tuple[frozenset[str], frozenset[str]]:
    """(ids, names) of ``TRAINBOT_ALLOWED_CHANNELS``: an entry that is a channel id as
    Slack writes it (``C0123ABC``) is an id; anything else (``#ml-training``) is a name.
    Ids are never compared with names: a channel named ``c0priv`` is not ``C0PRIV``."""
    ids: set[str] = set()
    names: set[str] = set()
    for entry in entries:
        text = entry.strip()
        if _CHANNEL_ID.fullmatch(text):
            ids.add(text)
        elif text:
            names.add(text.lstrip("#").lower())
    return frozenset(ids), frozenset(names)


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
        launch_group_ttl_s: float = LAUNCH_GROUP_TTL_S,
    ) -> None:
        self.policy = policy
        self._client = client
        self._journal = journal
        self._clock = clock
        self._ttl = group_ttl_s
        self._launch_ttl = min(launch_group_ttl_s, group_ttl_s)
        self._lock = threading.Lock()
        #: (fetched at, members by group id, group id by handle)
        self._groups: tuple[float, dict[str, frozenset[str]], dict[str, str]] | None = None
        #: channel id -> (fetched at, its name as Slack says it, whether it is private)
        self._names: dict[str, tuple[float, str | None, bool | None]] = {}
        #: user id -> (fetched at, the allowed channels they are in)
        self._memberships: dict[str, tuple[float, frozenset[str]]] = {}
        #: our workspace ids, once asked of ``auth.test``
        self._teams: frozenset[str] | None = None

    # --- the decision -------------------------------------------------------------------

    def authorize(self, caller: Caller, ask: Ask, *, audit: bool = True) -> Denial | None:
        """Whether ``caller`` may do what ``ask`` describes: None when they may, else
        why not (audited unless ``audit`` is False, for a repeated delivery)."""
        denial = self.decide(caller, ask)
        if denial is not None and audit:
            self.deny(caller, action=ask.action, reason=denial.reason, run_id=denial.run_id)
        return denial

    def decide(self, caller: Caller, ask: Ask) -> Denial | None:
        """The rules, in order: who (workspace), where (channel, membership), then what
        (on-call, someone else's run, starting compute, where a run reports)."""
        run_id = ask.run
        if self.is_external(caller):
            return Denial("external user", EXTERNAL_DENIED, run_id)
        where = caller.channel if caller.channel else ask.target_channel
        if not self.channel_allowed_id(where):
            return Denial("channel not allowed", CHANNEL_DENIED, run_id)
        # Admins act in every channel (by command too), so a press of theirs is let be.
        outsider = caller.channel is not None and not self.is_member(caller.user, caller.channel)
        if ask.in_message and outsider and not self.is_admin(caller):
            return Denial(f"not a member of {caller.channel}", NOT_A_MEMBER, run_id)
        if ask.target is not None and not self.actor(caller).sees(ask.target_channel):
            target = ask.target or run_id or "It"
            return Denial(
                f"{target} is not in the caller's channels",
                NOT_IN_CHANNEL.format(target=target),
                run_id,
            )
        if ask.sets_oncall and not self.may_set_oncall(caller):
            return Denial("may not set the on-call", ONCALL_DENIED)
        owner = ask.owner
        if run_id is not None and owner is not None and not self.may_change(caller, owner=owner):
            return Denial(f"{run_id} belongs to {owner}", not_yours(run_id, owner), run_id)
        if ask.starts_compute and not self.may_launch(caller, fresh=True):
            return Denial("may not launch", LAUNCH_DENIED, run_id)
        private = ask.reports_to
        if private and private != caller.channel and not self.may_report_to(caller, private):
            return Denial(f"not a member of the private channel {private}", PRIVATE_CHANNEL_DENIED)
        return None

    # --- the questions ------------------------------------------------------------------

    def channel_verdict(self, channel: str | None) -> bool | None:
        """Whether a channel is allowed, from the configuration alone: None when only
        Slack's name for the channel can tell (the answer needs :meth:`channel_allowed_id`)."""
        policy = self.policy
        if not policy.restricts_channels:
            return True
        if channel is None:
            return False
        if channel in policy.allowed_channels:
            return True
        return None if policy.channel_names else False

    def channel_allowed(self, caller: Caller, *, channel: str | None = None) -> bool:
        """Whether commands are accepted where this came from (or in ``channel``, for a
        button in the App Home, which has no channel of its own)."""
        return self.channel_allowed_id(channel if channel is not None else caller.channel)

    def channel_allowed_id(self, channel: str | None) -> bool:
        """Whether a channel (by id) is one where trainbot works."""
        verdict = self.channel_verdict(channel)
        if verdict is not None:
            return verdict
        assert channel is not None
        name = self._channel_name(channel)
        return name is not None and name in self.policy.channel_names

    def is_external(self, caller: Caller) -> bool:
        """Whether the person belongs to another organisation's workspace (and that is
        not allowed). Unknown teams count as external: a request must say whose it is."""
        if self.policy.allow_external:
            return False
        return caller.team is None or caller.team not in self._home_teams()

    def may_launch(self, caller: Caller, *, fresh: bool = False) -> bool:
        """Whether ``caller`` is on ``TRAINBOT_LAUNCHERS`` (or it is empty); ``fresh``: with
        user groups at most ``launch_group_ttl_s`` old, as when compute is about to start."""
        launchers = self.policy.launchers
        if not launchers:
            return True
        return self._member(caller.user, launchers, max_age=self._launch_ttl if fresh else None)

    def may_start(self, requester: str) -> bool | None:
        """``Deps.may_launch``: whether a run's requester may still start compute, when a
        launch happens on its own; None while Slack cannot list the launcher groups."""
        if self.may_launch(Caller(team=None, user=requester, channel=None), fresh=True):
            return True
        if not any(_is_group(entry) for entry in self.policy.launchers):
            return False
        with self._lock:  # the listing just asked for is recorded only when it succeeded
            listed = self._groups[0] if self._groups is not None else None
        return None if listed is None or self._clock() - listed >= self._launch_ttl else False

    def is_member(self, user: str, channel: str) -> bool:
        """Whether ``user`` is in ``channel`` (an allowed one), as the App Home asks it:
        ``users.conversations``, cached; "no" when Slack cannot say."""
        return channel in self.member_channels(user)

    def may_report_to(self, caller: Caller, channel: str) -> bool:
        """Whether a run of ``caller``'s may report to ``channel`` (``notify.channel``):
        a private channel only when they are a member of it; a public one, which anyone
        in the workspace can read, whichever allowed channel it is. A channel Slack
        cannot describe counts as private."""
        if self._is_private(channel) is False:
            return True
        return self.is_member(caller.user, channel)

    def is_admin(self, caller: Caller) -> bool:
        return bool(self.policy.admins) and self._member(caller.user, self.policy.admins)

    def may_change(self, caller: Caller, *, owner: str) -> bool:
        """Whether ``caller`` may stop, resubmit or confirm a run that ``owner`` started."""
        return caller.user == owner or self.is_admin(caller)

    def may_set_oncall(self, caller: Caller) -> bool:
        """Admins choose who is paged; without any admins configured, whoever may launch."""
        if self.policy.admins:
            return self.is_admin(caller)
        return self.may_launch(caller)

    def actor(self, caller: Caller, *, channel: str | None = None) -> Actor:
        """The service layer's view of the caller: in a channel, they see that channel;
        in the App Home (no channel), the channels they are a member of."""
        where = channel or caller.channel
        admin = self.is_admin(caller)
        seen = frozenset() if where or admin else self.member_channels(caller.user)
        return Actor(user=caller.user, channel=where or "", is_admin=admin, channels=seen)

    def member_channels(self, user: str) -> frozenset[str]:
        """The allowed channels ``user`` is a member of (``users.conversations``), cached;
        empty when Slack cannot say."""
        now = self._clock()
        with self._lock:
            cached = self._memberships.get(user)
            if cached is not None and now - cached[0] < self._ttl:
                return cached[1]
        found: set[str] = set()
        if self._client is not None:
            try:
                cursor: str | None = None
                while True:
                    response = self._client.users_conversations(
                        user=user,
                        types="public_channel,private_channel",
                        exclude_archived=True,
                        limit=200,
                        cursor=cursor,
                    )
                    for channel in response.get("channels") or ():
                        found.add(str(channel.get("id")))
                        name = channel.get("name")
                        if name:
                            private = channel.get("is_private")
                            with self._lock:
                                self._names[str(channel.get("id"))] = (
                                    now,
                                    str(name).lower(),
                                    None if private is None else bool(private),
                                )
                    cursor = (response.get("response_metadata") or {}).get("next_cursor")
                    if not cursor:
                        break
            except (SlackApiError, SlackRequestError, OSError) as exc:
                log.warning("could not list the channels of %s (%s); showing none", user, exc)
                return frozenset()
        channels = frozenset(c for c in found if self.channel_allowed_id(c))
        with self._lock:
            self._memberships[user] = (now, channels)
        return channels

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

    # --- lookups ------------------------------------------------------------------------

    def _home_teams(self) -> frozenset[str]:
        if self.policy.teams:
            return self.policy.teams
        with self._lock:
            if self._teams is not None:
                return self._teams
        if self._client is None:
            return frozenset()
        try:
            team = self._client.auth_test().get("team_id")
        except (SlackApiError, SlackRequestError, OSError) as exc:
            log.warning("could not ask Slack which workspace is ours (%s): refusing all", exc)
            return frozenset()
        teams = frozenset({str(team)}) if team else frozenset()
        with self._lock:
            self._teams = teams
        return teams

    def _channel_name(self, channel: str) -> str | None:
        """Slack's name for a channel id (``conversations.info``), cached; None when
        Slack cannot say."""
        return self._channel_info(channel, privacy=False)[0]

    def _is_private(self, channel: str) -> bool | None:
        """Whether Slack says the channel is private; None when it cannot say."""
        return self._channel_info(channel, privacy=True)[1]

    def _channel_info(self, channel: str, *, privacy: bool) -> tuple[str | None, bool | None]:
        now = self._clock()
        with self._lock:
            cached = self._names.get(channel)
            fresh = cached is not None and now - cached[0] < self._ttl
            if cached is not None and fresh and (not privacy or cached[2] is not None):
                return cached[1], cached[2]
        if self._client is None:
            return None, None
        try:
            response = self._client.conversations_info(channel=channel)
        except (SlackApiError, SlackRequestError, OSError) as exc:
            log.warning(
                "could not look up channel %s (%s); treating it as not allowed", channel, exc
            )
            return None, None
        info = response.get("channel") or {}
        raw = info.get("name")
        name = str(raw).lower() if raw else None
        private = None if info.get("is_private") is None else bool(info.get("is_private"))
        with self._lock:
            self._names[channel] = (now, name, private)
        return name, private

    # --- user groups --------------------------------------------------------------------

    def _member(self, user: str, entries: frozenset[str], *, max_age: float | None = None) -> bool:
        if user in entries:
            return True
        groups = [e for e in entries if _is_group(e)]
        if not groups:
            return False
        members, handles = self._directory(max_age=max_age)
        for entry in groups:
            group_id = handles.get(entry[1:].lower()) if entry.startswith("@") else entry
            if group_id is not None and user in members.get(group_id, frozenset()):
                return True
        return False

    def _directory(
        self, *, max_age: float | None = None
    ) -> tuple[dict[str, frozenset[str]], dict[str, str]]:
        """The workspace's user groups: members by group id, and group ids by handle.

        One ``usergroups.list`` call (with the members) answers every group question,
        cached for ``group_ttl_s`` (``max_age``, when given); when it fails, every group
        counts as empty.
        """
        now = self._clock()
        with self._lock:
            ttl = self._ttl if max_age is None else max_age
            if self._groups is not None and now - self._groups[0] < ttl:
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


class LocalAuthorizer(Authorizer):
    """The console's rules: the same decision as Slack's, for the person at the terminal.

    They are one of the team (no other workspace can reach a terminal) and the console
    is its own one channel, which they are in; who may launch and who is an admin are
    ``TRAINBOT_LAUNCHERS`` and ``TRAINBOT_ADMINS``, matched against their login name. User
    groups cannot be resolved without Slack, so a group entry admits nobody here.
    """

    def __init__(self, policy: Policy, *, journal: Journal) -> None:
        super().__init__(policy, client=None, journal=journal)

    def is_external(self, caller: Caller) -> bool:
        return False

    def channel_allowed_id(self, channel: str | None) -> bool:
        return True

    def member_channels(self, user: str) -> frozenset[str]:
        return frozenset()

    def may_report_to(self, caller: Caller, channel: str) -> bool:
        return True  # the console prints every run's messages to the one terminal


def _is_group(entry: str) -> bool:
    """``S…`` is a user group id; ``@name`` a group handle. Users are ``U…``/``W…``."""
    return entry.startswith("@") or (entry[:1] == "S" and entry[1:].isalnum())


_KEY = re.compile(r"[A-Za-z_][\w.\-]*")
_WORD = re.compile(r"[\w@.\-/]{1,64}")


def redact_command(text: str) -> str:
    """A command as the audit log keeps it: the verb and its subject (``launch tiny``,
    ``stop r-1``), then each override as ``key=…``. Values can hold secrets
    (``env.WANDB_API_KEY=…``), so none is kept."""
    out: list[str] = []
    for index, token in enumerate(text.split()):
        key, sep, _ = token.partition("=")
        key = key.strip("\"'")
        if sep:
            out.append(f"{key}=…" if _KEY.fullmatch(key) else "…=…")
        elif index < 3 and _WORD.fullmatch(token):
            out.append(token)
        else:
            out.append("…")
    return " ".join(out)[:500]

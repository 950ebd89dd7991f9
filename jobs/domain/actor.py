"""Who is asking, and what they may see and change: the checks every use-case makes.

An :class:`Actor` is built by a front end from the signed request (Slack) or the
terminal's user (console); nothing here trusts the text of a command.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlmodel import Session

from jobs.database.models import Alert, Run
from jobs.domain.errors import NotFound, PermissionDenied

__all__ = ["Actor", "may_see", "may_see_alert", "may_touch", "report_channel"]


@dataclass(frozen=True)
class Actor:
    """Who asked, from where: taken from the signed request, never from the text."""

    user: str
    #: Where the request came from ("" for the App Home).
    channel: str
    is_admin: bool = False
    #: Other channels whose runs and alerts the person may see and act on (the App Home:
    #: the channels they are a member of).
    channels: frozenset[str] = frozenset()

    def sees(self, channel: str | None) -> bool:
        """Whether a run or alert that reports to ``channel`` is this person's business:
        admins see every channel, everyone else the one they are in."""
        if self.is_admin:
            return True
        return channel is not None and (
            (channel == self.channel and channel != "") or channel in self.channels
        )

    @property
    def visible(self) -> frozenset[str]:
        return frozenset(c for c in (self.channel, *self.channels) if c)


def may_see(actor: Actor, run: Run) -> None:
    """Reads and actions on someone's run go through the channel it reports to; to anyone
    outside it, the run does not exist."""
    if not actor.sees(run.channel):
        raise NotFound(f"no run {run.id} reports to this channel; ask in the channel it reports to")


def may_touch(actor: Actor, run: Run) -> None:
    if actor.is_admin or actor.user == run.requester:
        return
    raise PermissionDenied(
        f"{run.id} belongs to {run.requester}; only they or an admin can change it"
    )


def may_see_alert(session: Session, actor: Actor, alert_id: str) -> None:
    alert = session.get(Alert, alert_id)
    if alert is None:
        return  # the alerts module says so in its own words
    channel = alert.message_channel
    if channel is None and alert.run_id is not None:
        run = session.get(Run, alert.run_id)
        channel = run.channel if run is not None else None
    if not actor.sees(channel):
        raise NotFound(f"no alert {alert_id} in this channel; acknowledge it where it was posted")


def report_channel(allowed_channels: Iterable[str], wanted: str | None, actor: Actor) -> str:
    """Where a run reports: the channel the command came from, or ``notify.channel`` when
    that is one of the allowed channels (by id). The bot may post in any public channel,
    so a spec must not be able to send a run's card and alerts just anywhere."""
    if not wanted or wanted == actor.channel:
        return actor.channel
    allowed = set(allowed_channels)
    if actor.is_admin and not allowed:
        return wanted
    if wanted in allowed:
        return wanted
    listed = ", ".join(sorted(allowed)) or "none: TRAINBOT_ALLOWED_CHANNELS is not set"
    raise PermissionDenied(
        f"notify.channel={wanted[:40]!r} is not one of the channels trainbot may post to "
        f"({listed}); leave it out to report here, or ask an admin to add the channel's "
        "id to TRAINBOT_ALLOWED_CHANNELS"
    )

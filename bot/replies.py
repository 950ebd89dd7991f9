"""Replies to commands, every sentence of them: what a command did, or why it did nothing.

The messages a run posts into its thread are in :mod:`bot.messages`; these are the answers
a person gets back to what they typed (or clicked), in Slack and the console alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from bot.messages import MAX_REPLY_TEXT, more_not_shown, run_card
from jobs.domain.format import clock, percent, usd
from jobs.outbound.notify import RunCard
from jobs.spec.sources import Catalog


def fit_lines(text: str, *, limit: int = MAX_REPLY_TEXT, what: str = "lines") -> str:
    """``text`` in at most ``limit`` characters: whole lines, then how many were left out.

    A single line longer than the room left is cut at its end with an ellipsis. Escaped
    text stays whole: a line is never cut inside an ``&amp;``.
    """
    if len(text) <= limit:
        return text
    lines = text.split("\n")
    room = limit - len(more_not_shown(len(lines), what)) - 1
    out: list[str] = []
    used = 0
    for index, line in enumerate(lines):
        if used + len(line) + 1 > room:
            if not out:  # one huge first line: keep its start
                cut = line[: max(room - 1, 0)]
                amp = cut.rfind("&")
                if amp >= 0 and ";" not in cut[amp:]:
                    cut = cut[:amp]
                out.append(cut + "…")
                index += 1
            if index < len(lines):
                out.append(more_not_shown(len(lines) - index, what))
            break
        out.append(line)
        used += len(line) + 1
    return "\n".join(out)


def submitted(run_id: str, spec: str) -> str:
    return f"Run {run_id} ({spec}) submitted: preflight is running; the report goes in its thread."


def preflight_only(run_id: str, spec: str) -> str:
    return f"Preflight of {spec} started as {run_id}; nothing launches until you confirm."


def confirmed(run_id: str) -> str:
    return f"Launching {run_id} despite the preflight warnings."


def stopped(run_id: str) -> str:
    return f"Stopping {run_id}: its runner flushes a checkpoint and the instance shuts down."


def resubmitted(old: str, new: str) -> str:
    if old == new:
        return f"Launching the next attempt of {old} from its newest checkpoint."
    return f"Resubmitted {old} as {new}; it resumes from {old}'s newest checkpoint."


def resubmitted_changed(old: str, new: str, max_price: float | None) -> str:
    wait = (
        f" It launches once an instance-hour costs ${max_price:.2f} or less."
        if max_price is not None
        else ""
    )
    return (
        f"Resubmitted {old} as {new} with your changes; it resumes from {old}'s newest "
        f"checkpoint. Its thread lists what changed.{wait}"
    )


def resubmitted_from(old: str, new: str, step: int | None) -> str:
    return f"Resubmitted {old} as {new}; it resumes from step {step}."


def acked(alert_id: str, user: str) -> str:
    return f"Alert {alert_id} acknowledged by {user}; it will not notify or escalate again."


def snoozed(alert_id: str, until: datetime | None) -> str:
    return f"Alert {alert_id} snoozed until {clock(until)}."


def run_list(cards: Sequence[RunCard], scope: str) -> str:
    if not cards:
        return (
            f"No {'' if scope == 'all' else scope + ' '}runs. Start one with /train launch <spec>."
        )
    return "\n".join(run_card(c) + _spec_from(c) + _data_from(c) + _kept(c) for c in cards)


def _kept(card: RunCard) -> str:
    """A failed attempt's instance kept to look at: until when, how to connect, how to end it."""
    if not card.kept:
        return ""
    return f" · kept instance {card.kept} (billed; `/train release {card.run_id}` ends it)"


def _data_from(card: RunCard) -> str:
    """The staged copy the run reads, and the dataset it is a copy of."""
    return f" · data {card.data_from}" if card.data_from else ""


def _spec_from(card: RunCard) -> str:
    """Where the run's spec was read: the repository's commit, the directory's file."""
    return f" · spec from {card.spec_from}" if card.spec_from else ""


def spend_report(report: Mapping[str, Any]) -> str:
    lines = [
        f"Spend this {report.get('period', 'day')} (since {report.get('first_date', '')}): "
        f"{usd(report.get('usd'))} · preemptions {report.get('preemptions', 0)} · "
        f"goodput {percent(report.get('goodput'))}"
    ]
    for row in report.get("per_run", [])[:15]:
        lines.append(f"  {row.get('run_id')} ({row.get('requester', '')}): {usd(row.get('usd'))}")
    for row in report.get("per_user", [])[:15]:
        lines.append(f"  {row.get('user')}: {usd(row.get('usd'))}")
    return "\n".join(lines)


def budget_table(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "No runs with budgets in this channel."
    out = []
    for r in rows:
        share = f" ({r['pct']:.0f}%)" if r.get("pct") is not None else ""
        out.append(
            f"  {r['run_id']}: {usd(r['spent_usd'])} of {usd(r.get('budget_usd'))}{share}, "
            f"{str(r['state']).lower()}"
        )
    return "Budgets:\n" + "\n".join(out)


def oncall(user: str | None, *, changed: bool) -> str:
    if user is None:
        return "Nobody is on call for this channel. Set someone: /train oncall @user"
    if changed:
        return f"{user} is now on call here; unacknowledged critical alerts escalate to them."
    return f"{user} is on call for this channel."


def cleanup(summary: Mapping[str, Any]) -> str:
    if "error" in summary:
        return f"Cleanup of {summary['run_id']} failed: {summary['error']}"
    verb = "Would delete" if summary.get("dry_run") else "Deleted"
    freed = summary.get("usd_per_month_freed")
    saving = f", {usd(freed)} a month" if freed is not None else ""
    return (
        f"{verb} checkpoints {summary['deleted']} of {summary['run_id']} "
        f"({summary['bytes_freed']:,} bytes{saving}) and torn saves {summary['torn']}; "
        f"kept {summary['kept']}."
    )


def error(message: str) -> str:
    return f"Sorry — {message}"


def unexpected() -> str:
    return (
        "Something went wrong on our side; nothing was changed. "
        "The control plane's log has the details."
    )


def token_issued(token_id: str, token: str, *, name: str, expires: datetime, url: str) -> str:
    """A new API token, shown this once (the reply is the asker's alone)."""
    where = url or "<this control plane's URL>"
    return (
        f"Your token {name} ({token_id}), shown this once — copy it now:\n{token}\n"
        f"It acts as you, in this channel, until {expires:%Y-%m-%d}. Use it with the "
        f"command-line client: export TRAINBOT_URL={where} TRAINBOT_TOKEN=<the token>, "
        f"then trainbot list. /train token revoke {token_id} ends it."
    )


def token_list(rows: Sequence[tuple[str, str, datetime, datetime | None]]) -> str:
    """``/train token list``: (id, name, expires, last used) of each live token."""
    if not rows:
        return "You hold no live tokens. /train token new <name> makes one."
    lines = [f"Your tokens ({len(rows)}):"]
    for token_id, name, expires, used in rows:
        seen = f"last used {used:%Y-%m-%d %H:%M} UTC" if used else "never used"
        lines.append(f"{token_id}  {name}  expires {expires:%Y-%m-%d}, {seen}")
    return "\n".join(lines)


def tokens_revoked(ids: Sequence[str]) -> str:
    if not ids:
        return "You held no live tokens; nothing was revoked."
    them = "it" if len(ids) == 1 else "them"
    return f"Revoked {', '.join(ids)}: requests with {them} are refused from now on."


def spec_list(found: Catalog) -> str:
    """``/train specs``: each launchable name with its description and its source."""
    lines = []
    if found.specs:
        lines.append("Specs you can launch (/train launch <name> [key.path=value …]):")
    for spec in found.specs:
        about = f": {spec.description}" if spec.description else ""
        lines.append(f"  {spec.name}{about} · {spec.where}")
    if found.more:
        lines.append(f"  … and {found.more} more not listed (a source holds over 200).")
    for problem in found.problems:
        lines.append(f"Could not read the source {problem.label}: {problem.problem}")
    if not found.specs:
        lines.insert(
            0,
            "No specs to launch: an admin adds <name>.yaml files to a directory or "
            "repository listed in TRAINBOT_SPEC_SOURCES.",
        )
    return "\n".join(lines)


def released(run_id: str, instances: Sequence[str]) -> str:
    """``/train release``: which kept instances of the run were terminated."""
    if not instances:
        return (
            f"{run_id}'s kept instance is not terminated yet: another request is terminating "
            "it, or its provider refused for now and reconcile tries again. "
            f"`/train status {run_id}` shows whether it is still kept."
        )
    return f"Released {run_id}'s kept instance {', '.join(instances)}: terminated, billing stopped."

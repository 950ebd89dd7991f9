"""Every user-facing sentence, in one place: messages and replies rendered as text.

Written for a tired on-call engineer: what happened, to which run, what it costs, what to
do. The console prints these; the Slack views build their Block Kit from the same
functions, so both front ends say the same thing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from jobs.domain.format import clock, duration, percent, size, usd
from jobs.domain.format import loss as fmt_loss
from jobs.outbound.notify import (
    AlertMessage,
    DigestMessage,
    Message,
    PreflightMessage,
    ProjectionMessage,
    RunCard,
    TextMessage,
)

if TYPE_CHECKING:
    from jobs.usecases.run_logs import RunLog

#: A reply's length: a screenful or two. Slack refuses ``text`` over 40,000 characters,
#: and nobody reads a reply that long in a chat.
MAX_REPLY_TEXT = 12_000

STATUS_ICON = {"pass": "✓", "warn": "!", "fail": "✗"}
SEVERITY_ICON = {"info": "ℹ", "warning": "⚠", "critical": "‼"}
STATE_WORD = {
    "PENDING": "pending",
    "PREFLIGHT": "running preflight checks",
    "PREFLIGHT_FAILED": "preflight failed",
    "AWAITING_CONFIRMATION": "waiting for confirmation",
    "LAUNCHING": "launching",
    "RUNNING": "running",
    "RECOVERING": "recovering from a preemption",
    "SUCCEEDED": "finished",
    "FAILED": "failed",
    "STOPPED": "stopped",
    "BUDGET_EXCEEDED": "stopped at its budget cap",
}


def run_card(card: RunCard) -> str:
    progress = ""
    if card.step is not None:
        progress = f" · step {card.step}" + (f"/{card.target_steps}" if card.target_steps else "")
    loss = ""
    if card.loss is not None:
        loss = f" · loss {fmt_loss(card.loss)}"
    budget = f" of {usd(card.budget_usd)}" if card.budget_usd else ""
    where = f" · {card.instance_id} in {card.zone}" if card.instance_id else ""
    market = card_market(card)
    where += f" ({market})" if market else ""
    attempt = f" · attempt {card.attempt}" if card.attempt else ""
    reason = f" — {card.reason}" if card.reason and card.state not in ("RUNNING",) else ""
    return (
        f"[{card.run_id}] {card.spec_name} by {card.requester}: "
        f"{STATE_WORD.get(card.state, card.state.lower())}{reason}{attempt}{progress}{loss}"
        f" · spent {usd(card.spent_usd)}{budget}{where}"
    )


def card_market(card: RunCard) -> str:
    """Where the attempt runs and at which price: "on-demand in us-west-2 on aws"; ""
    before any."""
    on = f" on {card.provider}" if card.provider else ""
    if card.market and card.region:
        return f"{card.market} in {card.region}{on}"
    return (card.market or card.region or "") + on


def preflight_report(msg: PreflightMessage) -> str:
    lines = [f"{preflight_title(msg.run_id)}:"]
    for check in msg.checks:
        lines.append(f"  {STATUS_ICON.get(check.status, '?')} {check.name}: {check.detail}")
        if check.remedy and check.status != "pass":
            lines.append(f"      → {check.remedy}")
    if msg.estimate_usd is not None:
        lines.append(f"  {estimated_cost(msg.estimate_usd)}")
    if msg.interval_s is not None:
        lines.append(f"  {checkpoint_interval(msg.interval_s)}")
    lines.append(f"  {preflight_verdict(msg)}")
    return "\n".join(lines)


def preflight_title(run_id: str) -> str:
    return f"Preflight for {run_id}"


def estimated_cost(value: float) -> str:
    return f"Estimated cost {usd(value)}."


def checkpoint_interval(seconds: float) -> str:
    return f"Checkpoint every {seconds:.1f} s."


def preflight_verdict(msg: PreflightMessage, *, button: bool = False) -> str:
    """What happens next; ``button`` when the chat shows a "Launch anyway" button."""
    if not msg.ok:
        return "Not launched: fix the failed checks and launch again."
    if msg.needs_confirmation:
        if button:
            return f"Warnings above. Launch anyway with the button, or /train resubmit {msg.run_id}"
        return f"Warnings above. Launch anyway: /train resubmit {msg.run_id}"
    return "All checks passed: launching."


def alert(msg: AlertMessage) -> str:
    icon = SEVERITY_ICON.get(msg.severity.lower(), "!")
    head = f"{icon} {msg.severity.upper()} [{msg.alert_id}] {msg.title}"
    if msg.count > 1:
        head += f" (×{msg.count})"
    lines = [head]
    if msg.detail:
        lines.append(f"    {msg.detail}")
    if msg.hint:
        lines.append(f"    → {msg.hint}")
    if msg.escalate_to:
        lines.append(f"    {alert_escalated(msg.escalate_to)}")
    if msg.state == "ACKED":
        lines.append(f"    {alert_acknowledged(msg.acked_by, msg.acked_at)}")
    elif msg.state == "RESOLVED":
        lines.append(f"    {alert_resolved()}")
    elif msg.snoozed_until is not None:
        lines.append(f"    {alert_snoozed(msg.snoozed_until)}")
    else:
        lines.append(f"    /train ack {msg.alert_id} · /train snooze {msg.alert_id} 1h")
    return "\n".join(lines)


def alert_escalated(group: str) -> str:
    return f"Escalated to {group}: unacknowledged."


def alert_acknowledged(user: str | None, at: datetime | None) -> str:
    return f"Acknowledged by {user} at {clock(at)}."


def alert_resolved() -> str:
    return "Resolved."


def alert_snoozed(until: datetime | None) -> str:
    return f"Snoozed until {clock(until)}."


def confirm_stop(run_id: str) -> str:
    """The question before a Stop button does anything."""
    return f"Stop {run_id}? Its runner flushes a checkpoint and the instance shuts down."


def projection(msg: ProjectionMessage) -> str:
    """The projection from a run's profiled start, and what happens next."""
    lines = [projection_title(msg), f"  {projection_measured(msg)}", f"  {projection_whole(msg)}"]
    lines.append(f"  {projection_verdict(msg)}")
    if msg.stopped:
        lines.append(f"  {projection_commands(msg)}")
    return "\n".join(lines)


def projection_title(msg: ProjectionMessage) -> str:
    where = f" on {msg.zone}" if msg.zone else ""
    return f"Profile of {msg.run_id}: the first {msg.step} steps{where}"


def projection_measured(msg: ProjectionMessage) -> str:
    gpu = "no GPU" if msg.gpu_util is None else f"GPU {msg.gpu_util:.0f}% busy"
    wait = "data-wait not reported" if msg.data_wait is None else f"data-wait {msg.data_wait:.0%}"
    step = "n/a" if msg.step_time_s is None else duration(msg.step_time_s)
    return f"Measured: {step} a step, {wait}, {gpu}, {usd(msg.price_per_hour)}/h."


def projection_whole(msg: ProjectionMessage) -> str:
    if msg.hours_left is None:
        return (
            "No projection of the whole run: its command gives no --steps, so the steps "
            "left are unknown."
        )
    budget = f" (budget {usd(msg.budget_usd)})" if msg.budget_usd else ""
    lost = (
        f", losing about {duration(msg.lost_s)} of work"
        + (f" at the {duration(msg.interval_s)} checkpoint interval" if msg.interval_s else "")
        if msg.lost_s
        else ""
    )
    return (
        f"Projection: {msg.hours_left:.2f} h more to step {msg.target_steps}, "
        f"{usd(msg.cost_usd)} in all{budget}, finishing about {_when(msg.finish_at)}; "
        f"about {msg.preemptions or 0:.1f} preemption(s){lost}."
    )


def _when(moment: datetime | None) -> str:
    return "n/a" if moment is None else moment.strftime("%a %d %b %H:%M UTC")


def projection_verdict(msg: ProjectionMessage) -> str:
    if not msg.reasons:
        return "Within its budget and limits: it goes on."
    why = "; ".join(msg.reasons)
    if msg.stopped:
        return f"Stopped at a checkpoint before spending more: {why}. Continue or stop?"
    return f"Warning: {why}. It goes on (profile.ask is false)."


def projection_commands(msg: ProjectionMessage) -> str:
    raise_to = (
        f" · with a budget that covers it: /train resubmit {msg.run_id} "
        f"budget.usd={msg.suggested_budget_usd:.0f}"
        if msg.suggested_budget_usd
        else ""
    )
    return f"Continue: /train resubmit {msg.run_id}{raise_to}"


def digest(msg: DigestMessage) -> str:
    f = msg.figures
    lines = [
        f"{digest_title(msg.channel, f.get('date', ''))}:",
        f"  {f.get('day_label', 'yesterday')} {usd(f.get('day_usd'))} · month to date "
        f"{usd(f.get('month_to_date_usd'))}",
        f"  preemptions {f.get('preemptions', 0)} · goodput {percent(f.get('goodput'))} · "
        f"GPU-hours lost {f.get('gpu_hours_lost', 0):.2f} · instance-hours lost "
        f"{f.get('instance_hours_lost', 0):.3f}",
    ]
    storage = f.get("storage")
    if storage:
        lines.append(f"  {digest_storage_line(storage, str(f.get('day_label', 'yesterday')))}")
    if f.get("kept_usd"):
        lines.append(f"  {digest_kept_line(f)}")
    badput = f.get("badput")
    if badput:
        lines.extend(f"  {line}" for line in badput_lines(badput))
    for row in f.get("per_run", [])[:10]:
        lines.append(f"  {digest_run_line(row)}")
    for row in (storage or {}).get("per_run", [])[:10]:
        lines.append(f"  {storage_run_line(row)}")
    for row in f.get("per_user", [])[:10]:
        lines.append(f"  {digest_user_line(row)}")
    if msg.chart_png:
        lines.append(f"  (spend chart attached, {len(msg.chart_png):,} bytes PNG)")
    return "\n".join(lines)


def digest_title(channel: str, date: str) -> str:
    return f"Daily spend digest for {channel} ({date})"


def digest_run_line(row: Mapping[str, Any]) -> str:
    return (
        f"{row.get('run_id')} {row.get('spec', '')} ({row.get('requester', '')}): "
        f"{usd(row.get('usd'))}{_dry_run_share(row)}, {row.get('preemptions', 0)} "
        f"preemption(s), goodput {percent(row.get('goodput'))}, "
        f"{str(row.get('state', '')).lower()}"
    )


def _dry_run_share(row: Mapping[str, Any]) -> str:
    """What of a run's spend its preflight dry runs' instances, and its failed instances
    kept to look at, cost, when they cost any."""
    share = row.get("dry_run_usd")
    kept = row.get("kept_usd")
    return (f" (dry run {usd(share)})" if share else "") + (
        f" (kept failed instance {usd(kept)})" if kept else ""
    )


def digest_kept_line(figures: Mapping[str, Any]) -> str:
    """What failed attempts' instances kept for people to look at cost
    (``debug.keep_failed_instance``), of the compute above."""
    return (
        f"kept failed instances {usd(figures.get('kept_usd'))} of it "
        "(debug.keep_failed_instance; `/train release <run>` ends one)"
    )


def digest_storage_line(storage: Mapping[str, Any], day_label: str) -> str:
    """Storage beside compute: what the checkpoints cost in the day and the month, and
    what those kept now cost a month; and the staged datasets kept (``/train stage``)."""
    line = (
        f"storage {usd(storage.get('usd'))} {day_label} · month to date "
        f"{usd(storage.get('month_to_date_usd'))} · {size(storage.get('bytes_kept'))} of "
        f"checkpoints kept, {usd(storage.get('usd_per_month'))} a month"
    )
    staged = storage.get("staged") or {}
    copies = int(staged.get("copies") or 0)
    if copies or staged.get("usd"):
        line += (
            f" · staged data {size(staged.get('bytes_kept'))} in {copies} "
            f"cop{'y' if copies == 1 else 'ies'}, {usd(staged.get('usd'))} {day_label}, "
            f"{usd(staged.get('usd_per_month'))} a month"
        )
    return line


def storage_run_line(row: Mapping[str, Any]) -> str:
    """One run's checkpoints: bytes kept, in which store, what they cost a month."""
    return (
        f"{row.get('run_id')} keeps {size(row.get('bytes_kept'))} in {row.get('store')} "
        f"({row.get('region')}): {usd(row.get('usd_per_month'))} a month"
    )


def badput_lines(badput: Mapping[str, Any]) -> list[str]:
    """The paid time that made no progress, by cause: the total, then each cause."""
    share = badput.get("share")
    of_spend = f" ({percent(share)} of compute)" if share is not None else ""
    lines = [
        f"badput {usd(badput.get('usd'))}{of_spend}, "
        f"{float(badput.get('instance_hours') or 0):.2f} instance-hours:"
    ]
    for row in badput.get("categories", []):
        hours = float(row.get("instance_hours") or 0)
        time = "" if row.get("name") == "on_demand_premium" else f" ({hours:.2f} h)"
        lines.append(f"  {row.get('label')}: {usd(row.get('usd'))}{time}")
    unknown = int(badput.get("premium_unknown") or 0)
    if unknown:
        lines.append(f"  ({unknown} on-demand attempt(s) with no recorded spot price left out)")
    return lines


def digest_user_line(row: Mapping[str, Any]) -> str:
    return f"{row.get('user')}: {usd(row.get('usd'))}"


def digest_chart_in_thread() -> str:
    return "The spend chart is in the thread."


def text(msg: TextMessage) -> str:
    if not msg.log_tail:
        return msg.text
    block, shown, total = log_block(msg.log_tail, limit=FAILURE_TAIL_CHARS)
    said = "Its last line" if shown == 1 else f"Its last {shown} lines"
    more = f" (of the {total} it sent)" if shown < total else ""
    return f"{msg.text}\n{said}{more}:\n{block}"


#: Characters, as Slack counts them (escaped), of a failure's log tail in its message: a
#: Slack section takes 3,000 characters.
FAILURE_TAIL_CHARS = 2_400
#: Characters of a log reply's lines, escaped, leaving room for its own sentences.
LOG_REPLY_CHARS = MAX_REPLY_TEXT - 1_000


def slack_length(text: str) -> int:
    """``text``'s length once escaped for Slack (``&`` → ``&amp;``, ``<`` → ``&lt;`` …),
    which is what a Slack limit counts: output full of ``<`` grows up to five times."""
    return len(text) + 4 * text.count("&") + 3 * (text.count("<") + text.count(">"))


def log_block(text: str, *, limit: int) -> tuple[str, int, int]:
    """The newest lines of ``text`` that fit ``limit`` (escaped) as a preformatted block;
    with how many lines it shows and how many there were. A line too long for the room
    left keeps its end."""
    lines = text.rstrip("\n").split("\n")
    room = limit - 8  # the fences
    kept: list[str] = []
    for line in reversed(lines):
        line = line.replace("```", "ˋˋˋ")  # a fence in the output would end the block
        size = slack_length(line) + 1
        if size > room:
            if not kept:  # one huge last line: its end
                while line and slack_length(line) + 2 > room:
                    line = line[max(len(line) // 8, 1) :]
                kept.append("…" + line)
            break
        kept.append(line)
        room -= size
    kept.reverse()
    return "```\n" + "\n".join(kept) + "\n```", len(kept), len(lines)


def run_log(found: RunLog) -> str:
    """``/train logs``: the end of an attempt's output, as much as a reply holds."""
    on = f", node {found.node}" if found.node else ""
    head = f"Attempt {found.attempt} of {found.run_id}{on} ({found.state})"
    where = f"The whole output: {found.location}" if found.location else ""
    if not found.text:
        note = found.note or ""
        lines = [
            f"{head}: no output to show." + (f" {note[:1].upper()}{note[1:]}." if note else "")
        ]
        if found.location:
            lines.append(f"Its log would be in {found.location}")
        return "\n".join(lines)
    block, shown, total = log_block(found.text, limit=LOG_REPLY_CHARS)
    source = " on its instance" if found.source == "instance" else ""
    earlier = shown < total or found.cut
    said = "its last line" if shown == 1 else f"its last {shown} lines"
    lines = [f"{head}: {said}{source}{' (earlier output not shown)' if earlier else ''}:"]
    if found.note:
        lines.append(f"Note: {found.note}.")
    lines.append(block)
    if where and earlier:
        lines.append(where)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- Slack views


def home_no_runs() -> str:
    return "No active runs. Start one with /train launch <spec>."


def home_no_alerts() -> str:
    return "No open alerts."


def more_not_shown(count: int, what: str) -> str:
    return f"…and {count} more {what} not shown here."


def launch_modal_no_specs() -> str:
    return (
        "No job specs found: add a <name>.yaml file to a spec source (a directory or "
        "repository in TRAINBOT_SPEC_SOURCES; unset, the directory TRAINBOT_SPECS_DIR), "
        "then try again, or paste a spec below."
    )


def launch_modal_more_specs() -> str:
    return "Launch any spec by name: /train launch <spec>."


def launch_modal_overrides_hint() -> str:
    return "Optional: key.path=value pairs, space separated, e.g. budget.usd=800"


R = TypeVar("R")


def by_type(
    msg: Message, renderers: Mapping[type[Message], Callable[[Any], R]], other: Callable[[Any], R]
) -> R:
    """The one type dispatch every front end renders messages through: the renderer of the
    message's class (or of a class it derives from), else ``other``."""
    for kind in type(msg).__mro__:
        found = renderers.get(kind)
        if found is not None:
            return found(msg)
    return other(msg)


_RENDERERS: dict[type[Message], Callable[[Any], str]] = {
    RunCard: run_card,
    PreflightMessage: preflight_report,
    ProjectionMessage: projection,
    AlertMessage: alert,
    DigestMessage: digest,
    TextMessage: text,
}


def render(msg: Message) -> str:
    """Any message as text."""
    return by_type(msg, _RENDERERS, str)

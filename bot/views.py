"""Messages as Slack Block Kit: pure functions from the control plane's messages to blocks.

The sentences come from :mod:`bot.messages`, so Slack and the console say the same
thing; this module only lays them out and adds the buttons. Every function returns
plain dicts, ready for ``chat.postMessage(blocks=…)`` or ``views.publish(view=…)``,
and stays inside Slack's limits whatever the input: a detail string of any length, a
hundred checks or a thousand runs are clipped, never rejected by Slack as
``invalid_blocks``.

Interactive elements, for the listeners:

==================  =======================  ==========================================
action_id           element                  value
==================  =======================  ==========================================
``launch_anyway``   button (preflight)       run id
``alert_ack``       button (alert)           alert id
``alert_snooze``    static_select (alert)    ``"<alert id>|<1h|4h|1d>"``, see
                                             :func:`parse_snooze_value`
``run_stop``        button (alert), confirm  run id
``run_resubmit``    button (alert)           run id
==================  =======================  ==========================================

The launch modal has ``callback_id="launch_modal"``; :func:`read_launch_modal` reads
its submission.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from bot import messages
from jobs.format import loss as fmt_loss
from jobs.format import percent, usd
from jobs.notify import (
    AlertMessage,
    DigestMessage,
    Message,
    PreflightMessage,
    RunCard,
    TextMessage,
)

Block = dict[str, Any]

# Slack's limits (Block Kit reference). Exceeding any of them fails the whole call.
MAX_BLOCKS = 50
MAX_VIEW_BLOCKS = 100
MAX_SECTION_TEXT = 3000
MAX_FIELD_TEXT = 2000
MAX_FIELDS = 10
MAX_CONTEXT_TEXT = 2000
MAX_HEADER_TEXT = 150
MAX_BUTTON_TEXT = 75
MAX_BUTTON_VALUE = 2000
MAX_OPTION_TEXT = 75
MAX_OPTION_VALUE = 150
MAX_OPTIONS = 100
MAX_MODAL_TITLE = 24
MAX_LABEL = 2000
MAX_PLACEHOLDER = 150
MAX_PRIVATE_METADATA = 3000
MAX_BLOCK_ID = 255
#: The notification text. Slack truncates ``text`` at 40,000 characters, but a
#: notification is read on a phone: the blocks carry the detail.
MAX_FALLBACK_TEXT = 3000

LAUNCH_MODAL_CALLBACK = "launch_modal"
LAUNCH_ANYWAY = "launch_anyway"
ALERT_ACK = "alert_ack"
ALERT_SNOOZE = "alert_snooze"
RUN_STOP = "run_stop"
RUN_RESUBMIT = "run_resubmit"
#: Snooze choices: (value suffix, label).
SNOOZE_CHOICES = (("1h", "1 hour"), ("4h", "4 hours"), ("1d", "1 day"))

_STATE_EMOJI = {
    "PENDING": ":hourglass:",
    "PREFLIGHT": ":mag:",
    "PREFLIGHT_FAILED": ":x:",
    "AWAITING_CONFIRMATION": ":raised_hand:",
    "LAUNCHING": ":rocket:",
    "RUNNING": ":large_green_circle:",
    "RECOVERING": ":arrows_counterclockwise:",
    "SUCCEEDED": ":white_check_mark:",
    "FAILED": ":x:",
    "STOPPED": ":black_square_for_stop:",
    "BUDGET_EXCEEDED": ":money_with_wings:",
}
_CHECK_EMOJI = {"pass": ":white_check_mark:", "warn": ":warning:", "fail": ":x:"}
_SEVERITY_EMOJI = {
    "info": ":information_source:",
    "warning": ":warning:",
    "critical": ":rotating_light:",
}
_KIND_EMOJI = {
    "launched": ":rocket:",
    "preempted": ":zap:",
    "resubmitted": ":repeat:",
    "resumed": ":arrow_forward:",
    "checkpoint": ":floppy_disk:",
    "info": ":information_source:",
    "error": ":x:",
    "finished": ":checkered_flag:",
    "stopping": ":octagonal_sign:",
}
_USER_ID = re.compile(r"^[UW][A-Z0-9]{2,}$")
_GROUP_ID = re.compile(r"^S[A-Z0-9]{2,}$")
_CHANNEL_ID = re.compile(r"^[CGD][A-Z0-9]{2,}$")
# What a cut can leave dangling at the end of mrkdwn: half an entity, half a <link>.
_PARTIAL_TAIL = re.compile(r"(&[#a-zA-Z0-9]{0,8}|<[^>]*)$")


# ----------------------------------------------------------------------------- text


def escape(text: str) -> str:
    """Slack's three control characters, so user text cannot forge mentions or links."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters with an ellipsis, never mid-entity or mid-link."""
    if len(text) <= limit:
        return text
    cut = _PARTIAL_TAIL.sub("", text[: max(limit - 1, 0)])
    return cut + "…"


def mention(who: str | None) -> str:
    """A user or user group as Slack shows it: ``<@U…>``, ``<!subteam^S…>``, else the name."""
    if not who:
        return "someone"
    if who.startswith("<") and who.endswith(">"):
        return who  # already Slack markup, from a signed payload
    if _USER_ID.match(who):
        return f"<@{who}>"
    if _GROUP_ID.match(who):
        return f"<!subteam^{who}>"
    return escape(who)


def channel_mention(channel: str) -> str:
    return f"<#{channel}>" if _CHANNEL_ID.match(channel) else escape(f"#{channel.lstrip('#')}")


def _mrkdwn(text: str, limit: int) -> dict[str, Any]:
    return {"type": "mrkdwn", "text": clip(text or " ", limit)}


def _plain(text: str, limit: int) -> dict[str, Any]:
    return {"type": "plain_text", "text": clip(text or " ", limit), "emoji": True}


def section(text: str, *, fields: Sequence[str] = (), block_id: str | None = None) -> Block:
    block: Block = {"type": "section", "text": _mrkdwn(text, MAX_SECTION_TEXT)}
    if fields:
        block["fields"] = [_mrkdwn(f, MAX_FIELD_TEXT) for f in fields[:MAX_FIELDS]]
    if block_id:
        block["block_id"] = clip(block_id, MAX_BLOCK_ID)
    return block


def context(*texts: str) -> Block:
    return {"type": "context", "elements": [_mrkdwn(t, MAX_CONTEXT_TEXT) for t in texts[:10]]}


def header(text: str) -> Block:
    return {"type": "header", "text": _plain(text, MAX_HEADER_TEXT)}


def divider() -> Block:
    return {"type": "divider"}


def button(
    label: str,
    *,
    action_id: str,
    value: str,
    style: str | None = None,
    confirm: dict[str, Any] | None = None,
) -> dict[str, Any]:
    element: dict[str, Any] = {
        "type": "button",
        "text": _plain(label, MAX_BUTTON_TEXT),
        "action_id": action_id,
        "value": value[:MAX_BUTTON_VALUE],
    }
    if style:
        element["style"] = style
    if confirm:
        element["confirm"] = confirm
    return element


def _option(label: str, value: str) -> dict[str, Any]:
    return {"text": _plain(label, MAX_OPTION_TEXT), "value": value[:MAX_OPTION_VALUE]}


def _fit(blocks: list[Block], limit: int = MAX_BLOCKS) -> list[Block]:
    """At most ``limit`` blocks; the last one says how many were left out."""
    if len(blocks) <= limit:
        return blocks
    left_out = len(blocks) - (limit - 1)
    return [*blocks[: limit - 1], context(messages.more_not_shown(left_out, "blocks"))]


# ----------------------------------------------------------------------------- messages


def run_card(card: RunCard) -> list[Block]:
    """The run's root message: who, what, where it stands, what it has cost."""
    state = messages.STATE_WORD.get(card.state, card.state.lower())
    icon = _STATE_EMOJI.get(card.state, ":grey_question:")
    head = (
        f"{icon} *{escape(card.run_id)}* · {escape(card.spec_name)} by {mention(card.requester)}"
        f" — *{escape(state)}*"
    )
    if card.reason and card.state != "RUNNING":
        head += f"\n{escape(card.reason)}"
    step = "n/a" if card.step is None else str(card.step)
    if card.step is not None and card.target_steps:
        step += f" / {card.target_steps}"
    spend = usd(card.spent_usd)
    if card.budget_usd:
        share = percent(card.spent_usd / card.budget_usd)
        spend += f" of {usd(card.budget_usd)} ({share})"
    where = "n/a"
    if card.instance_id:
        where = escape(card.instance_id) + (f" in {escape(card.zone)}" if card.zone else "")
    fields = [
        f"*Status*\n{escape(state)}",
        f"*Attempt*\n{card.attempt or 'n/a'}",
        f"*Step*\n{step}",
        f"*Loss*\n{fmt_loss(card.loss)}",
        f"*Spend*\n{spend}",
        f"*Instance*\n{where}",
    ]
    return [section(head, fields=fields, block_id=f"run:{card.run_id}")]


def preflight_report(msg: PreflightMessage) -> list[Block]:
    """Each check with its verdict and remedy; "Launch anyway" when warnings wait for it."""
    blocks: list[Block] = [section(f"*{escape(messages.preflight_title(msg.run_id))}*")]
    lines = []
    for check in msg.checks:
        icon = _CHECK_EMOJI.get(check.status, ":grey_question:")
        line = f"{icon} *{escape(check.name)}*: {escape(check.detail)}"
        if check.remedy and check.status != "pass":
            line += f"\n→ {escape(check.remedy)}"
        lines.append(line)
    # One section per check, while they fit; the rest share the last one.
    room = MAX_BLOCKS - 5
    blocks.extend(section(line) for line in lines[: room - 1])
    if len(lines) > room - 1:
        blocks.append(section("\n".join(lines[room - 1 :])))
    facts = []
    if msg.estimate_usd is not None:
        facts.append(messages.estimated_cost(msg.estimate_usd))
    if msg.interval_s is not None:
        facts.append(messages.checkpoint_interval(msg.interval_s))
    if facts:
        blocks.append(context(escape(" ".join(facts))))
    confirm = msg.ok and msg.needs_confirmation
    blocks.append(section(escape(messages.preflight_verdict(msg, button=confirm))))
    if confirm:
        blocks.append(
            {
                "type": "actions",
                "block_id": clip(f"preflight:{msg.run_id}", MAX_BLOCK_ID),
                "elements": [
                    button(
                        "Launch anyway", action_id=LAUNCH_ANYWAY, value=msg.run_id, style="primary"
                    )
                ],
            }
        )
    return _fit(blocks)


def alert(msg: AlertMessage) -> list[Block]:
    """Severity, what happened, to which run, the hint; buttons until someone acknowledges."""
    severity = msg.severity.lower()
    icon = _SEVERITY_EMOJI.get(severity, ":warning:")
    head = f"{icon} *{escape(msg.severity.upper())}* · *{escape(msg.title)}*"
    if msg.count > 1:
        head += f" (×{msg.count})"
    body = [head]
    if msg.detail:
        body.append(escape(msg.detail))
    if msg.hint:
        body.append(f"→ {escape(msg.hint)}")
    blocks: list[Block] = []
    if msg.escalate_to:
        blocks.append(section(messages.alert_escalated(mention(msg.escalate_to))))
    blocks.append(section("\n".join(body), block_id=f"alert:{msg.alert_id}"))
    about = [f"alert {escape(msg.alert_id)}", f"rule {escape(msg.rule)}"]
    if msg.run_id:
        about.insert(0, f"run *{escape(msg.run_id)}*")
    blocks.append(context(" · ".join(about)))
    if msg.state == "ACKED":
        blocks.append(context(messages.alert_acknowledged(mention(msg.acked_by), msg.acked_at)))
        return blocks
    if msg.state == "RESOLVED":
        blocks.append(context(messages.alert_resolved()))
        return blocks
    if msg.snoozed_until is not None:
        blocks.append(context(messages.alert_snoozed(msg.snoozed_until)))
    blocks.append(_alert_actions(msg))
    return blocks


def _alert_actions(msg: AlertMessage) -> Block:
    elements: list[dict[str, Any]] = [
        button("Acknowledge", action_id=ALERT_ACK, value=msg.alert_id, style="primary"),
        {
            "type": "static_select",
            "action_id": ALERT_SNOOZE,
            "placeholder": _plain("Snooze", MAX_PLACEHOLDER),
            "options": [
                _option(label, snooze_value(msg.alert_id, code)) for code, label in SNOOZE_CHOICES
            ],
        },
    ]
    if msg.run_id:
        stop_confirm = {
            "title": _plain("Stop the run?", MAX_MODAL_TITLE),
            "text": _mrkdwn(escape(messages.confirm_stop(msg.run_id)), 300),
            "confirm": _plain("Stop run", MAX_MODAL_TITLE),
            "deny": _plain("Keep it running", MAX_MODAL_TITLE),
            "style": "danger",
        }
        elements.append(
            button(
                "Stop run",
                action_id=RUN_STOP,
                value=msg.run_id,
                style="danger",
                confirm=stop_confirm,
            )
        )
        elements.append(button("Resubmit", action_id=RUN_RESUBMIT, value=msg.run_id))
    return {
        "type": "actions",
        "block_id": clip(f"alert_actions:{msg.alert_id}", MAX_BLOCK_ID),
        "elements": elements,
    }


def snooze_value(alert_id: str, duration: str) -> str:
    return f"{alert_id}|{duration}"


def parse_snooze_value(value: str) -> tuple[str, str]:
    """``(alert id, duration)`` from a Snooze option's value (``"a-1f2e|4h"``)."""
    alert_id, _, duration = value.rpartition("|")
    if not alert_id or duration not in {code for code, _ in SNOOZE_CHOICES}:
        raise ValueError(f"not a snooze choice: {value!r}")
    return alert_id, duration


def digest(msg: DigestMessage) -> list[Block]:
    """The daily spend digest: totals as fields, then per run and per user."""
    f = msg.figures
    title = messages.digest_title(channel_mention(msg.channel), escape(str(f.get("date", ""))))
    fields = [
        f"*{str(f.get('day_label', 'yesterday')).capitalize()}*\n{usd(f.get('day_usd'))}",
        f"*Month to date*\n{usd(f.get('month_to_date_usd'))}",
        f"*Preemptions*\n{f.get('preemptions', 0)}",
        f"*Goodput*\n{percent(f.get('goodput'))}",
        f"*GPU-hours lost*\n{float(f.get('gpu_hours_lost') or 0):.2f}",
        f"*Instance-hours lost*\n{float(f.get('instance_hours_lost') or 0):.3f}",
    ]
    blocks = [section(f":bar_chart: *{title}*", fields=fields)]
    runs = [escape(messages.digest_run_line(row)) for row in f.get("per_run", [])]
    if runs:
        blocks.append(section("*Per run*\n" + _bullets(runs)))
    users = [
        f"{mention(str(row.get('user')))}: {usd(row.get('usd'))}" for row in f.get("per_user", [])
    ]
    if users:
        blocks.append(section("*Per user*\n" + _bullets(users)))
    if msg.chart_png:
        blocks.append(context(messages.digest_chart_in_thread()))
    return blocks


def _bullets(lines: Sequence[str], limit: int = MAX_SECTION_TEXT - 40) -> str:
    """Whole lines that fit in one section, then how many did not."""
    out: list[str] = []
    used = 0
    for index, line in enumerate(lines):
        item = f"• {line}"
        if used + len(item) + 1 > limit:
            out.append(messages.more_not_shown(len(lines) - index, "lines"))
            break
        out.append(item)
        used += len(item) + 1
    return "\n".join(out)


def text_line(msg: TextMessage) -> list[Block]:
    """A line in the run's thread: launched, preempted, resubmitted, a checkpoint summary …"""
    icon = _KIND_EMOJI.get(msg.kind, ":information_source:")
    return [section(f"{icon} {escape(messages.text(msg))}")]


def render(msg: Message) -> list[Block]:
    """Any message as blocks."""
    if isinstance(msg, RunCard):
        return run_card(msg)
    if isinstance(msg, PreflightMessage):
        return preflight_report(msg)
    if isinstance(msg, AlertMessage):
        return alert(msg)
    if isinstance(msg, DigestMessage):
        return digest(msg)
    if isinstance(msg, TextMessage):
        return text_line(msg)
    return [section(escape(messages.render(msg)))]


def fallback_text(msg: Message) -> str:
    """The ``text`` of a message with blocks: what notifications and screen readers show.

    An escalation starts with the group's mention, so the page reaches the on-call
    people even where blocks are not rendered.
    """
    text = escape(messages.render(msg))
    if isinstance(msg, AlertMessage) and msg.escalate_to:
        text = f"{mention(msg.escalate_to)} {text}"
    return clip(text, MAX_FALLBACK_TEXT)


# ----------------------------------------------------------------------------- views


def home_tab(active_runs: Sequence[RunCard], open_alerts: Sequence[AlertMessage]) -> dict[str, Any]:
    """The App Home tab: the runs still going and the alerts nobody has closed."""
    blocks: list[Block] = [header("Active runs")]
    # Keep room for the alerts' header and one alert, whatever the number of runs.
    _add_items(
        blocks,
        [run_card(card) for card in active_runs],
        limit=MAX_VIEW_BLOCKS - 8,
        empty=messages.home_no_runs(),
        what="runs",
    )
    blocks.append(header("Open alerts"))
    _add_items(
        blocks,
        [alert(a) for a in open_alerts],
        limit=MAX_VIEW_BLOCKS,
        empty=messages.home_no_alerts(),
        what="alerts",
    )
    return {"type": "home", "blocks": blocks}


def _add_items(
    blocks: list[Block], items: Sequence[list[Block]], *, limit: int, empty: str, what: str
) -> None:
    """Append whole items (each followed by a divider) while they fit under ``limit``."""
    if not items:
        blocks.append(context(empty))
        return
    for index, item in enumerate(items):
        left = len(items) - index
        reserve = 1 if left > 1 else 0  # the "…and N more" line
        if len(blocks) + len(item) + 1 + reserve > limit:
            blocks.append(context(messages.more_not_shown(left, what)))
            return
        blocks.extend(item)
        blocks.append(divider())


def launch_modal(spec_names: Sequence[str], *, private_metadata: str = "") -> dict[str, Any]:
    """The modal `/train launch` opens when given no spec: pick one, add overrides.

    ``private_metadata`` comes back with the submission (the channel to launch in:
    a view submission carries no channel of its own).
    """
    view: dict[str, Any] = {
        "type": "modal",
        "callback_id": LAUNCH_MODAL_CALLBACK,
        "title": _plain("Launch a run", MAX_MODAL_TITLE),
        "close": _plain("Cancel", MAX_MODAL_TITLE),
        "private_metadata": private_metadata[:MAX_PRIVATE_METADATA],
    }
    names = [n for n in spec_names if n][:MAX_OPTIONS]
    if not names:
        view["blocks"] = [section(escape(messages.launch_modal_no_specs()))]
        return view
    view["submit"] = _plain("Launch", MAX_MODAL_TITLE)
    view["blocks"] = [
        {
            "type": "input",
            "block_id": "spec",
            "label": _plain("Job spec", MAX_LABEL),
            "element": {
                "type": "static_select",
                "action_id": "spec",
                "placeholder": _plain("Choose a spec", MAX_PLACEHOLDER),
                "options": [_option(name, name) for name in names],
            },
        },
        {
            "type": "input",
            "block_id": "overrides",
            "optional": True,
            "label": _plain("Overrides", MAX_LABEL),
            "hint": _plain(messages.launch_modal_overrides_hint(), MAX_LABEL),
            "element": {
                "type": "plain_text_input",
                "action_id": "overrides",
                "placeholder": _plain("budget.usd=800", MAX_PLACEHOLDER),
                "max_length": 2000,
            },
        },
    ]
    return view


def read_launch_modal(values: Mapping[str, Any]) -> tuple[str | None, str]:
    """``(spec name, overrides text)`` from a submission's ``view.state.values``."""
    spec_block = values.get("spec", {}).get("spec", {})
    selected = spec_block.get("selected_option") or {}
    spec = selected.get("value") if isinstance(selected, Mapping) else None
    overrides = values.get("overrides", {}).get("overrides", {}).get("value") or ""
    return (str(spec) if spec else None), str(overrides).strip()

"""Alerts, with their buttons, and the values those buttons carry back to the listeners."""

from __future__ import annotations

from typing import Any

from bot import messages
from bot.mentions import escape, mention
from bot.views.blocks import (
    MAX_BLOCK_ID,
    MAX_MODAL_TITLE,
    MAX_PLACEHOLDER,
    Block,
    button,
    context,
    mrkdwn,
    option,
    plain,
    section,
)
from bot.views.text import clip
from jobs.outbound.notify import AlertMessage

ALERT_ACK = "alert_ack"
ALERT_SNOOZE = "alert_snooze"
RUN_STOP = "run_stop"
RUN_RESUBMIT = "run_resubmit"
RUN_RESUBMIT_FROM = "run_resubmit_from"
#: Snooze choices: (value suffix, label).
SNOOZE_CHOICES = (("1h", "1 hour"), ("4h", "4 hours"), ("1d", "1 day"))
_SEVERITY_EMOJI = {
    "info": ":information_source:",
    "warning": ":warning:",
    "critical": ":rotating_light:",
}


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
        if msg.run_id and msg.resume_step is not None:
            # The offer stands while the alert is open, acknowledged or not.
            blocks.append(
                {
                    "type": "actions",
                    "block_id": clip(f"alert_resume:{msg.alert_id}", MAX_BLOCK_ID),
                    "elements": [_resubmit_from_button(msg.run_id, msg.resume_step)],
                }
            )
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
            "placeholder": plain("Snooze", MAX_PLACEHOLDER),
            "options": [
                option(label, snooze_value(msg.alert_id, code)) for code, label in SNOOZE_CHOICES
            ],
        },
    ]
    if msg.run_id:
        stop_confirm = {
            "title": plain("Stop the run?", MAX_MODAL_TITLE),
            "text": mrkdwn(escape(messages.confirm_stop(msg.run_id)), 300),
            "confirm": plain("Stop run", MAX_MODAL_TITLE),
            "deny": plain("Keep it running", MAX_MODAL_TITLE),
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
        if msg.resume_step is not None:
            elements.append(_resubmit_from_button(msg.run_id, msg.resume_step))
        elements.append(button("Resubmit", action_id=RUN_RESUBMIT, value=msg.run_id))
    return {
        "type": "actions",
        "block_id": clip(f"alert_actions:{msg.alert_id}", MAX_BLOCK_ID),
        "elements": elements,
    }


def _resubmit_from_button(run_id: str, step: int) -> dict[str, Any]:
    return button(
        f"Resubmit from step {step}",
        action_id=RUN_RESUBMIT_FROM,
        value=resubmit_from_value(run_id, step),
    )


def resubmit_from_value(run_id: str, step: int) -> str:
    return f"{run_id}|{step}"


def parse_resubmit_from_value(value: str) -> tuple[str, int]:
    """(run id, step) from a Resubmit-from button's value; ValueError when it is not one."""
    run_id, sep, step = value.strip().partition("|")
    if not sep or not run_id or not step.isdigit():
        raise ValueError(f"{value[:60]!r} is not <run id>|<step>")
    return run_id, int(step)


def snooze_value(alert_id: str, duration: str) -> str:
    return f"{alert_id}|{duration}"


def parse_snooze_value(value: str) -> tuple[str, str]:
    """``(alert id, duration)`` from a Snooze option's value (``"a-1f2e|4h"``)."""
    alert_id, _, duration = value.rpartition("|")
    if not alert_id or duration not in {code for code, _ in SNOOZE_CHOICES}:
        raise ValueError(f"not a snooze choice: {value!r}")
    return alert_id, duration

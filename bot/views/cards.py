"""A run's root message (the run card) and the lines in its thread."""

from __future__ import annotations

from bot import messages
from bot.mentions import escape, mention
from bot.views.blocks import Block, section
from jobs.domain.format import loss as fmt_loss
from jobs.domain.format import percent, usd
from jobs.outbound.notify import RunCard, TextMessage

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
    market = messages.card_market(card)
    fields = [
        f"*Status*\n{escape(state)}",
        f"*Attempt*\n{card.attempt or 'n/a'}",
        f"*Step*\n{step}",
        f"*Loss*\n{fmt_loss(card.loss)}",
        f"*Spend*\n{spend}",
        f"*Instance*\n{where}",
        *([f"*Market*\n{escape(market)}"] if market else []),
        *([f"*Data*\n{escape(card.data_from)}"] if card.data_from else []),
    ]
    return [section(head, fields=fields, block_id=f"run:{card.run_id}")]


def text_line(msg: TextMessage) -> list[Block]:
    """A line in the run's thread: launched, preempted, resubmitted, a checkpoint summary …"""
    icon = _KIND_EMOJI.get(msg.kind, ":information_source:")
    return [section(f"{icon} {escape(messages.text(msg))}")]

"""Any control-plane message as blocks, as notification text, or in short."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bot import messages
from bot.mentions import escape, mention
from bot.views.alerts import alert
from bot.views.blocks import MAX_FALLBACK_TEXT, MAX_SECTION_TEXT, Block, section
from bot.views.cards import run_card, text_line
from bot.views.digest import digest
from bot.views.preflight import preflight_report
from bot.views.projection import projection
from bot.views.text import clip_middle
from jobs.outbound import notify

_RENDERERS: dict[type[notify.Message], Callable[[Any], list[Block]]] = {
    notify.RunCard: run_card,
    notify.PreflightMessage: preflight_report,
    notify.ProjectionMessage: projection,
    notify.AlertMessage: alert,
    notify.DigestMessage: digest,
    notify.TextMessage: text_line,
}


def render(msg: notify.Message) -> list[Block]:
    """Any message as blocks."""
    return messages.by_type(
        msg, _RENDERERS, lambda other: [section(escape(messages.render(other)))]
    )


def fallback_text(msg: notify.Message) -> str:
    """The ``text`` of a message with blocks: what notifications and screen readers show.

    An escalation starts with the group's mention, so the page reaches the on-call
    people even where blocks are not rendered.
    """
    text = escape(messages.render(msg))
    if isinstance(msg, notify.AlertMessage) and msg.escalate_to:
        text = f"{mention(msg.escalate_to)} {text}"
    return clip_middle(text, MAX_FALLBACK_TEXT)


def compact(msg: notify.Message) -> list[Block]:
    """The message in a few small blocks, for when Slack refuses the full ones
    (``msg_blocks_too_long``, ``invalid_blocks``): its text with the start and the end
    kept (the verdict, the command to run), and its buttons."""
    blocks = [section(clip_middle(escape(messages.render(msg)), MAX_SECTION_TEXT))]
    full = render(msg)
    blocks.extend(b for b in full if b.get("type") == "actions")
    return blocks

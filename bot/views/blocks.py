"""Slack's Block Kit limits, and the blocks and elements every view is built from.

Each helper clips its text to the limit of the field it fills, so no input makes Slack
answer ``invalid_blocks``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bot import messages
from bot.views.text import clip

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
#: The notification text. Slack refuses ``text`` over 40,000 characters, but a
#: notification is read on a phone: the blocks carry the detail.
MAX_FALLBACK_TEXT = 3000
#: The text of a message's blocks taken together. Slack answers ``msg_blocks_too_long``
#: somewhere above 13,000 characters (undocumented; observed about 13,200).
MAX_BLOCKS_TEXT = 12_000


def mrkdwn(text: str, limit: int) -> dict[str, Any]:
    return {"type": "mrkdwn", "text": clip(text or " ", limit)}


def plain(text: str, limit: int) -> dict[str, Any]:
    return {"type": "plain_text", "text": clip(text or " ", limit), "emoji": True}


def section(text: str, *, fields: Sequence[str] = (), block_id: str | None = None) -> Block:
    block: Block = {"type": "section", "text": mrkdwn(text, MAX_SECTION_TEXT)}
    if fields:
        block["fields"] = [mrkdwn(f, MAX_FIELD_TEXT) for f in fields[:MAX_FIELDS]]
    if block_id:
        block["block_id"] = clip(block_id, MAX_BLOCK_ID)
    return block


def context(*texts: str) -> Block:
    return {"type": "context", "elements": [mrkdwn(t, MAX_CONTEXT_TEXT) for t in texts[:10]]}


def header(text: str) -> Block:
    return {"type": "header", "text": plain(text, MAX_HEADER_TEXT)}


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
        "text": plain(label, MAX_BUTTON_TEXT),
        "action_id": action_id,
        "value": value[:MAX_BUTTON_VALUE],
    }
    if style:
        element["style"] = style
    if confirm:
        element["confirm"] = confirm
    return element


def option(label: str, value: str) -> dict[str, Any]:
    return {"text": plain(label, MAX_OPTION_TEXT), "value": value[:MAX_OPTION_VALUE]}


def fit(blocks: list[Block], limit: int = MAX_BLOCKS) -> list[Block]:
    """At most ``limit`` blocks; the last one says how many were left out."""
    if len(blocks) <= limit:
        return blocks
    left_out = len(blocks) - (limit - 1)
    return [*blocks[: limit - 1], context(messages.more_not_shown(left_out, "blocks"))]

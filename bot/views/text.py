"""Text for Block Kit: cut to Slack's limits without breaking mrkdwn, and channel links."""

from __future__ import annotations

import re

from bot.mentions import escape

_CHANNEL_ID = re.compile(r"^[CGD][A-Z0-9]{2,}$")
# What a cut can leave dangling at the end of mrkdwn: half an entity, half a <link>.
_PARTIAL_TAIL = re.compile(r"(&[#a-zA-Z0-9]{0,8}|<[^>]*)$")
_PARTIAL_HEAD = re.compile(r"^([#a-zA-Z0-9]{0,8};|[^<]*>)")
_GAP = "\n…\n"


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters with an ellipsis, never mid-entity or mid-link."""
    if len(text) <= limit:
        return text
    cut = _PARTIAL_TAIL.sub("", text[: max(limit - 1, 0)])
    return cut + "…"


def clip_middle(text: str, limit: int) -> str:
    """``text`` in ``limit`` characters keeping its start and its end.

    The end of a message is what to do (the verdict, ``/train resubmit``,
    ``/train ack``), so a cut takes the middle out, never the end.
    """
    if len(text) <= limit:
        return text
    if limit < 40:
        return clip(text, limit)
    tail_room = (limit - len(_GAP)) * 2 // 3
    head = _PARTIAL_TAIL.sub("", text[: limit - len(_GAP) - tail_room])
    tail = text[len(text) - tail_room :]
    newline = tail.find("\n")
    # Whole lines at the end when a line break is near; else not half an entity or link.
    whole = 0 <= newline < len(tail) // 2
    tail = tail[newline + 1 :] if whole else _PARTIAL_HEAD.sub("", tail)
    return head + _GAP + tail


def channel_mention(channel: str) -> str:
    return f"<#{channel}>" if _CHANNEL_ID.match(channel) else escape(f"#{channel.lstrip('#')}")

"""Messages as Slack Block Kit: pure functions from the control plane's messages to blocks.

The sentences come from :mod:`bot.messages`, so Slack and the console say the same
thing; this package only lays them out and adds the buttons. Every function returns
plain dicts, ready for ``chat.postMessage(blocks=…)`` or ``views.publish(view=…)``,
and stays inside Slack's limits whatever the input: a detail string of any length, a
hundred checks or a thousand runs are clipped, never rejected by Slack as
``invalid_blocks``.

Interactive elements, for the listeners:

==================  =======================  ==========================================
action_id           element                  value
==================  =======================  ==========================================
``launch_anyway``   button (preflight)       run id
``run_stage``       button (preflight)       run id: copy its dataset into its region
``alert_ack``       button (alert)           alert id
``alert_snooze``    static_select (alert)    ``"<alert id>|<1h|4h|1d>"``, see
                                             :func:`parse_snooze_value`
``run_stop``        button (alert), confirm  run id
``run_resubmit``    button (alert)           run id
``run_resubmit_from`` button (stopped alert) ``"<run id>|<step>"``, see
                                             :func:`parse_resubmit_from_value`
``profile_continue`` button (projection)     run id, or ``"<run id>|<budget>"``, see
                                             :func:`parse_continue_value`
``profile_stop``    button (projection)      run id
==================  =======================  ==========================================

The launch modal has ``callback_id="launch_modal"``; :func:`read_launch_modal` reads
its submission.

One module per view: ``cards`` (a run's card and thread lines), ``alerts``, ``preflight``,
``digest``, ``home`` (the App Home tab), ``modal`` (the launch modal), ``render`` (any
message as blocks or text); ``blocks`` holds Slack's limits and the block helpers,
``text`` the clipping. Import from ``bot.views``: every public name is here.
"""

from __future__ import annotations

from bot.mentions import escape, mention
from bot.views.alerts import (
    ALERT_ACK,
    ALERT_SNOOZE,
    RUN_RESUBMIT,
    RUN_RESUBMIT_FROM,
    RUN_STOP,
    SNOOZE_CHOICES,
    alert,
    parse_resubmit_from_value,
    parse_snooze_value,
    resubmit_from_value,
    snooze_value,
)
from bot.views.blocks import (
    MAX_BLOCK_ID,
    MAX_BLOCKS,
    MAX_BLOCKS_TEXT,
    MAX_BUTTON_TEXT,
    MAX_BUTTON_VALUE,
    MAX_CONTEXT_TEXT,
    MAX_FALLBACK_TEXT,
    MAX_FIELD_TEXT,
    MAX_FIELDS,
    MAX_HEADER_TEXT,
    MAX_LABEL,
    MAX_MODAL_TITLE,
    MAX_OPTION_TEXT,
    MAX_OPTION_VALUE,
    MAX_OPTIONS,
    MAX_PLACEHOLDER,
    MAX_PRIVATE_METADATA,
    MAX_SECTION_TEXT,
    MAX_VIEW_BLOCKS,
    Block,
    button,
    context,
    divider,
    header,
    section,
)
from bot.views.cards import run_card, text_line
from bot.views.digest import digest
from bot.views.home import home_tab
from bot.views.modal import LAUNCH_MODAL_CALLBACK, launch_modal, read_launch_modal
from bot.views.preflight import LAUNCH_ANYWAY, preflight_report
from bot.views.projection import (
    PROFILE_CONTINUE,
    PROFILE_STOP,
    continue_value,
    parse_continue_value,
    projection,
)
from bot.views.render import compact, fallback_text, render
from bot.views.text import channel_mention, clip, clip_middle

__all__ = [
    "ALERT_ACK",
    "ALERT_SNOOZE",
    "LAUNCH_ANYWAY",
    "LAUNCH_MODAL_CALLBACK",
    "MAX_BLOCKS",
    "MAX_BLOCKS_TEXT",
    "MAX_BLOCK_ID",
    "MAX_BUTTON_TEXT",
    "MAX_BUTTON_VALUE",
    "MAX_CONTEXT_TEXT",
    "MAX_FALLBACK_TEXT",
    "MAX_FIELDS",
    "MAX_FIELD_TEXT",
    "MAX_HEADER_TEXT",
    "MAX_LABEL",
    "MAX_MODAL_TITLE",
    "MAX_OPTIONS",
    "MAX_OPTION_TEXT",
    "MAX_OPTION_VALUE",
    "MAX_PLACEHOLDER",
    "MAX_PRIVATE_METADATA",
    "MAX_SECTION_TEXT",
    "MAX_VIEW_BLOCKS",
    "PROFILE_CONTINUE",
    "PROFILE_STOP",
    "RUN_RESUBMIT",
    "RUN_RESUBMIT_FROM",
    "RUN_STOP",
    "SNOOZE_CHOICES",
    "Block",
    "alert",
    "button",
    "channel_mention",
    "clip",
    "clip_middle",
    "compact",
    "context",
    "continue_value",
    "digest",
    "divider",
    "escape",
    "fallback_text",
    "header",
    "home_tab",
    "launch_modal",
    "mention",
    "parse_continue_value",
    "parse_resubmit_from_value",
    "parse_snooze_value",
    "preflight_report",
    "projection",
    "read_launch_modal",
    "render",
    "resubmit_from_value",
    "run_card",
    "section",
    "snooze_value",
    "text_line",
]

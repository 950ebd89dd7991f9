"""The "New run from YAML" modal: a spec pasted whole, and reading its submission.

The pasted text is validated as a spec file is (:func:`jobs.spec.spec_from_text`); Slack
caps a text input at :data:`MAX_PASTED_CHARS`, below the file bound, so a spec longer
than that belongs in a spec source (``/train specs``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bot.views.blocks import (
    MAX_CONTEXT_TEXT,
    MAX_LABEL,
    MAX_MODAL_TITLE,
    MAX_PLACEHOLDER,
    MAX_PRIVATE_METADATA,
    context,
    plain,
)

__all__ = [
    "CHANNEL_BLOCK",
    "MAX_PASTED_CHARS",
    "SPEC_BLOCK",
    "YAML_MODAL_CALLBACK",
    "YAML_SHORTCUT",
    "read_yaml_modal",
    "yaml_modal",
]

#: ``callback_id`` of the global shortcut (deploy/slack-manifest.yaml).
YAML_SHORTCUT = "new_run_yaml"
#: ``callback_id`` of the modal, and its submission.
YAML_MODAL_CALLBACK = "yaml_launch_modal"
#: The blocks (and their inputs' ``action_id``) whose errors Slack shows under them.
SPEC_BLOCK = "spec_yaml"
CHANNEL_BLOCK = "channel"
#: The most characters Slack lets a ``plain_text_input`` take.
MAX_PASTED_CHARS = 3000

_EXAMPLE = "description: what it trains\ncommand: python train.py\nresources:\n  accelerator: …"


def yaml_modal(*, channel: str | None = None, private_metadata: str = "") -> dict[str, Any]:
    """The modal: the spec's YAML and the channel the run reports in (``channel``: the one
    it was opened from, if any)."""
    channel_select: dict[str, Any] = {
        "type": "conversations_select",
        "action_id": CHANNEL_BLOCK,
        "placeholder": plain("Where the run reports", MAX_PLACEHOLDER),
        "filter": {"include": ["public", "private"], "exclude_bot_users": True},
    }
    if channel:
        channel_select["initial_conversation"] = channel
    return {
        "type": "modal",
        "callback_id": YAML_MODAL_CALLBACK,
        "title": plain("New run from YAML", MAX_MODAL_TITLE),
        "submit": plain("Launch", MAX_MODAL_TITLE),
        "close": plain("Cancel", MAX_MODAL_TITLE),
        "private_metadata": private_metadata[:MAX_PRIVATE_METADATA],
        "blocks": [
            {
                "type": "input",
                "block_id": SPEC_BLOCK,
                "label": plain("Job spec (YAML)", MAX_LABEL),
                "element": {
                    "type": "plain_text_input",
                    "action_id": SPEC_BLOCK,
                    "multiline": True,
                    "max_length": MAX_PASTED_CHARS,
                    "placeholder": plain(_EXAMPLE, MAX_PLACEHOLDER),
                },
            },
            {
                "type": "input",
                "block_id": CHANNEL_BLOCK,
                "label": plain("Report in", MAX_LABEL),
                "element": channel_select,
            },
            context(
                (
                    "Checked like a spec file: unknown keys and bad values are errors. "
                    "Preflight runs first, as for /train launch. For a longer spec, or one "
                    "the team reuses, add it to a spec source (/train specs)."
                )[:MAX_CONTEXT_TEXT]
            ),
        ],
    }


def read_yaml_modal(values: Mapping[str, Any]) -> tuple[str, str | None]:
    """``(pasted text, channel id)`` from a submission's ``view.state.values``."""
    text = values.get(SPEC_BLOCK, {}).get(SPEC_BLOCK, {}).get("value") or ""
    channel = values.get(CHANNEL_BLOCK, {}).get(CHANNEL_BLOCK, {}).get("selected_conversation")
    return str(text), (str(channel) if channel else None)

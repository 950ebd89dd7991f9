"""The launch modal `/train launch` opens when given no spec, and reading its submission.

Its last block is a button that opens "New run from YAML" over it (a spec pasted whole:
:mod:`bot.views.spec_yaml`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bot import messages
from bot.mentions import escape
from bot.views.blocks import (
    MAX_LABEL,
    MAX_MODAL_TITLE,
    MAX_OPTIONS,
    MAX_PLACEHOLDER,
    MAX_PRIVATE_METADATA,
    button,
    context,
    option,
    plain,
    section,
)

LAUNCH_MODAL_CALLBACK = "launch_modal"
#: ``action_id`` of the launch modal's button that opens "New run from YAML" over it.
PASTE_YAML_ACTION = "paste_yaml"


def _paste_yaml() -> dict[str, Any]:
    return {
        "type": "actions",
        "block_id": PASTE_YAML_ACTION,
        "elements": [button("Paste a spec (YAML)", action_id=PASTE_YAML_ACTION, value="yaml")],
    }


def launch_modal(spec_names: Sequence[str], *, private_metadata: str = "") -> dict[str, Any]:
    """The modal `/train launch` opens when given no spec: pick one, add overrides.

    ``private_metadata`` comes back with the submission (the channel to launch in:
    a view submission carries no channel of its own).
    """
    view: dict[str, Any] = {
        "type": "modal",
        "callback_id": LAUNCH_MODAL_CALLBACK,
        "title": plain("Launch a run", MAX_MODAL_TITLE),
        "close": plain("Cancel", MAX_MODAL_TITLE),
        "private_metadata": private_metadata[:MAX_PRIVATE_METADATA],
    }
    every = [n for n in spec_names if n]
    names = every[:MAX_OPTIONS]
    if not names:
        view["blocks"] = [section(escape(messages.launch_modal_no_specs())), _paste_yaml()]
        return view
    view["submit"] = plain("Launch", MAX_MODAL_TITLE)
    view["blocks"] = [
        {
            "type": "input",
            "block_id": "spec",
            "label": plain("Job spec", MAX_LABEL),
            "element": {
                "type": "static_select",
                "action_id": "spec",
                "placeholder": plain("Choose a spec", MAX_PLACEHOLDER),
                "options": [option(name, name) for name in names],
            },
        },
        {
            "type": "input",
            "block_id": "overrides",
            "optional": True,
            "label": plain("Overrides", MAX_LABEL),
            "hint": plain(messages.launch_modal_overrides_hint(), MAX_LABEL),
            "element": {
                "type": "plain_text_input",
                "action_id": "overrides",
                "placeholder": plain("budget.usd=800", MAX_PLACEHOLDER),
                "max_length": 2000,
            },
        },
    ]
    if len(every) > len(names):
        hidden = messages.more_not_shown(len(every) - len(names), "specs")
        view["blocks"].append(context(escape(f"{hidden} {messages.launch_modal_more_specs()}")))
    view["blocks"].append(_paste_yaml())
    return view


def read_launch_modal(values: Mapping[str, Any]) -> tuple[str | None, str]:
    """``(spec name, overrides text)`` from a submission's ``view.state.values``."""
    spec_block = values.get("spec", {}).get("spec", {})
    selected = spec_block.get("selected_option") or {}
    spec = selected.get("value") if isinstance(selected, Mapping) else None
    overrides = values.get("overrides", {}).get("overrides", {}).get("value") or ""
    return (str(spec) if spec else None), str(overrides).strip()

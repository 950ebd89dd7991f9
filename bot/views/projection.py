"""The projection from a run's profiled start, with Continue and Stop when it asks."""

from __future__ import annotations

from typing import Any

from bot import messages
from bot.mentions import escape
from bot.views.blocks import MAX_BLOCK_ID, Block, button, context, section
from bot.views.text import clip
from jobs.outbound.notify import ProjectionMessage

PROFILE_CONTINUE = "profile_continue"
PROFILE_STOP = "profile_stop"


def projection(msg: ProjectionMessage) -> list[Block]:
    """What the profile measured, the projection, the verdict; the buttons when the run
    was stopped to ask."""
    blocks: list[Block] = [
        section(f"*{escape(messages.projection_title(msg))}*"),
        section(escape(messages.projection_measured(msg))),
        section(escape(messages.projection_whole(msg))),
        section(escape(messages.projection_verdict(msg))),
    ]
    if not msg.stopped:
        return blocks
    elements: list[dict[str, Any]] = [
        button("Continue", action_id=PROFILE_CONTINUE, value=msg.run_id, style="primary")
    ]
    if msg.suggested_budget_usd:
        elements.append(
            button(
                f"Continue with budget ${msg.suggested_budget_usd:,.0f}",
                action_id=PROFILE_CONTINUE,
                value=continue_value(msg.run_id, msg.suggested_budget_usd),
            )
        )
    elements.append(button("Stop", action_id=PROFILE_STOP, value=msg.run_id, style="danger"))
    blocks.append(
        {
            "type": "actions",
            "block_id": clip(f"profile:{msg.run_id}", MAX_BLOCK_ID),
            "elements": elements,
        }
    )
    blocks.append(context(escape(messages.projection_commands(msg))))
    return blocks


def continue_value(run_id: str, budget_usd: float | None) -> str:
    """A Continue button's value: the run, and the budget it raises to (if any)."""
    return run_id if budget_usd is None else f"{run_id}|{budget_usd:.0f}"


def parse_continue_value(value: str) -> tuple[str, float | None]:
    """(run id, budget or None) from a Continue button's value; ValueError when it is not one."""
    run_id, sep, budget = value.strip().partition("|")
    if not run_id or (sep and not budget.isdigit()):
        raise ValueError(f"{value[:60]!r} is not <run id>[|<budget>]")
    return run_id, float(budget) if sep else None

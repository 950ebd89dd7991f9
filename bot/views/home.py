"""The App Home tab: active runs and open alerts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bot import messages
from bot.views.alerts import alert
from bot.views.blocks import MAX_VIEW_BLOCKS, Block, context, divider, header
from bot.views.cards import run_card
from jobs.outbound.notify import AlertMessage, RunCard


def home_tab(
    active_runs: Sequence[RunCard],
    open_alerts: Sequence[AlertMessage],
    *,
    max_items: int | None = None,
) -> dict[str, Any]:
    """The App Home tab: the runs still going and the alerts nobody has closed.

    At most ``max_items`` of each, and as many as fit; the rest are counted, all of them.
    """
    blocks: list[Block] = [header("Active runs")]
    # Keep room for the alerts' header and one alert, whatever the number of runs.
    _add_items(
        blocks,
        active_runs,
        run_card,
        limit=MAX_VIEW_BLOCKS - 8,
        max_items=max_items,
        empty=messages.home_no_runs(),
        what="runs",
    )
    blocks.append(header("Open alerts"))
    _add_items(
        blocks,
        open_alerts,
        alert,
        limit=MAX_VIEW_BLOCKS,
        max_items=max_items,
        empty=messages.home_no_alerts(),
        what="alerts",
    )
    return {"type": "home", "blocks": blocks}


def _add_items(
    blocks: list[Block],
    items: Sequence[Any],
    draw: Any,
    *,
    limit: int,
    max_items: int | None,
    empty: str,
    what: str,
) -> None:
    """Append whole items (each followed by a divider) while they fit under ``limit``."""
    if not items:
        blocks.append(context(empty))
        return
    for index, item in enumerate(items):
        left = len(items) - index
        drawn = draw(item)
        reserve = 1 if left > 1 else 0  # the "…and N more" line
        full = max_items is not None and index >= max_items
        if full or len(blocks) + len(drawn) + 1 + reserve > limit:
            blocks.append(context(messages.more_not_shown(left, what)))
            return
        blocks.extend(drawn)
        blocks.append(divider())

"""The preflight report: each check, its verdict and remedy, and "Launch anyway"."""

from __future__ import annotations

from collections.abc import Sequence

from bot import messages
from bot.mentions import escape
from bot.views.blocks import (
    MAX_BLOCK_ID,
    MAX_BLOCKS,
    MAX_BLOCKS_TEXT,
    MAX_SECTION_TEXT,
    Block,
    button,
    context,
    fit,
    section,
)
from bot.views.text import clip
from jobs.outbound.notify import PreflightMessage

LAUNCH_ANYWAY = "launch_anyway"
STAGE_DATA = "run_stage"
_CHECK_EMOJI = {"pass": ":white_check_mark:", "warn": ":warning:", "fail": ":x:"}


def preflight_report(msg: PreflightMessage) -> list[Block]:
    """Each check with its verdict and remedy; "Launch anyway" when warnings wait for it."""
    blocks: list[Block] = [section(f"*{escape(messages.preflight_title(msg.run_id))}*")]
    lines = []
    for check in msg.checks:
        icon = _CHECK_EMOJI.get(check.status, ":grey_question:")
        line = f"{icon} *{escape(check.name)}*: {escape(check.detail)}"
        if check.remedy and check.status != "pass":
            line += f"\n→ {escape(check.remedy)}"
        lines.append(line)
    blocks.extend(_check_sections(lines, [c.status for c in msg.checks]))
    facts = []
    if msg.estimate_usd is not None:
        facts.append(messages.estimated_cost(msg.estimate_usd))
    if msg.interval_s is not None:
        facts.append(messages.checkpoint_interval(msg.interval_s))
    if facts:
        blocks.append(context(escape(" ".join(facts))))
    confirm = msg.ok and msg.needs_confirmation
    blocks.append(section(escape(messages.preflight_verdict(msg, button=confirm))))
    if confirm:
        blocks.append(
            {
                "type": "actions",
                "block_id": clip(f"preflight:{msg.run_id}", MAX_BLOCK_ID),
                "elements": [
                    button(
                        "Launch anyway", action_id=LAUNCH_ANYWAY, value=msg.run_id, style="primary"
                    )
                ],
            }
        )
    elif msg.stage is not None and not msg.ok:
        blocks.append(
            {
                "type": "actions",
                "block_id": clip(f"stage:{msg.run_id}", MAX_BLOCK_ID),
                "elements": [button("Stage the data", action_id=STAGE_DATA, value=msg.run_id)],
            }
        )
    return fit(blocks)


def _check_sections(lines: Sequence[str], statuses: Sequence[str]) -> list[Block]:
    """One section per check while they fit in the blocks and in Slack's total text;
    when they do not, the failed and warned checks first, and how many were left out."""
    room = MAX_BLOCKS - 6  # title, facts, verdict, button, the "N more" line, a spare
    budget = MAX_BLOCKS_TEXT - 1500  # the title, facts and verdict
    clipped = [clip(line, MAX_SECTION_TEXT // 2) for line in lines]
    if len(clipped) > room or sum(len(line) for line in clipped) > budget:
        order = sorted(range(len(clipped)), key=lambda i: statuses[i] == "pass")
        clipped = [clipped[i] for i in order]
        statuses = [statuses[i] for i in order]
    out: list[Block] = []
    used = 0
    for index, line in enumerate(clipped):
        if len(out) == room or used + len(line) > budget:
            hidden = statuses[index:]
            passed = sum(1 for st in hidden if st == "pass")
            what = "checks" + (f" ({passed} passed)" if passed else "")
            out.append(context(messages.more_not_shown(len(hidden), what)))
            break
        out.append(section(line))
        used += len(line)
    return out

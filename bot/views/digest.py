"""The daily spend digest."""

from __future__ import annotations

from collections.abc import Sequence

from bot import messages
from bot.mentions import escape, mention
from bot.views.blocks import MAX_SECTION_TEXT, Block, context, section
from bot.views.text import channel_mention
from jobs.domain.format import percent, size, usd
from jobs.outbound.notify import DigestMessage


def digest(msg: DigestMessage) -> list[Block]:
    """The daily spend digest: totals as fields, then per run and per user."""
    f = msg.figures
    title = messages.digest_title(channel_mention(msg.channel), escape(str(f.get("date", ""))))
    fields = [
        f"*{str(f.get('day_label', 'yesterday')).capitalize()}*\n{usd(f.get('day_usd'))}",
        f"*Month to date*\n{usd(f.get('month_to_date_usd'))}",
        f"*Preemptions*\n{f.get('preemptions', 0)}",
        f"*Goodput*\n{percent(f.get('goodput'))}",
        f"*GPU-hours lost*\n{float(f.get('gpu_hours_lost') or 0):.2f}",
        f"*Instance-hours lost*\n{float(f.get('instance_hours_lost') or 0):.3f}",
    ]
    storage = f.get("storage")
    if storage:
        fields.append(
            f"*Storage*\n{usd(storage.get('usd'))} "
            f"(month to date {usd(storage.get('month_to_date_usd'))})"
        )
        fields.append(
            f"*Checkpoints kept*\n{size(storage.get('bytes_kept'))}, "
            f"{usd(storage.get('usd_per_month'))} a month"
        )
        staged = storage.get("staged") or {}
        if staged.get("copies"):
            fields.append(
                f"*Staged data*\n{size(staged.get('bytes_kept'))} in {staged['copies']} "
                f"cop{'y' if staged['copies'] == 1 else 'ies'}, "
                f"{usd(staged.get('usd_per_month'))} a month"
            )
    if f.get("kept_usd"):
        fields.append(f"*Kept failed instances*\n{usd(f.get('kept_usd'))}")
    blocks = [section(f":bar_chart: *{title}*", fields=fields)]
    badput = f.get("badput")
    if badput:
        head, *causes = messages.badput_lines(badput)
        blocks.append(
            section(
                f"*{escape(head.capitalize())}*\n" + _bullets([escape(c.strip()) for c in causes])
            )
        )
    runs = [escape(messages.digest_run_line(row)) for row in f.get("per_run", [])]
    if runs:
        blocks.append(section("*Per run*\n" + _bullets(runs)))
    kept = [escape(messages.storage_run_line(row)) for row in (storage or {}).get("per_run", [])]
    if kept:
        blocks.append(section("*Storage per run*\n" + _bullets(kept)))
    users = [
        f"{mention(str(row.get('user')))}: {usd(row.get('usd'))}" for row in f.get("per_user", [])
    ]
    if users:
        blocks.append(section("*Per user*\n" + _bullets(users)))
    if msg.chart_png:
        blocks.append(context(messages.digest_chart_in_thread()))
    return blocks


def _bullets(lines: Sequence[str], limit: int = MAX_SECTION_TEXT - 40) -> str:
    """Whole lines that fit in one section, then how many did not."""
    out: list[str] = []
    used = 0
    for index, line in enumerate(lines):
        item = f"• {line}"
        if used + len(item) + 1 > limit:
            out.append(messages.more_not_shown(len(lines) - index, "lines"))
            break
        out.append(item)
        used += len(item) + 1
    return "\n".join(out)

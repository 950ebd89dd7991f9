"""Block Kit views: valid shapes within Slack's limits, the right buttons, the same sentences."""

from __future__ import annotations

import json
import math
import re
from datetime import datetime, timezone
from typing import Any

import pytest

from bot import messages, plots, views
from jobs.outbound.notify import (
    AlertMessage,
    CheckLine,
    DigestMessage,
    PreflightMessage,
    RunCard,
    TextMessage,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
AT = datetime(2026, 3, 4, 12, 0, tzinfo=timezone.utc)

# --------------------------------------------------------------------------- validator

_TEXT_TYPES = {"mrkdwn", "plain_text"}


def _text(obj: Any, limit: int, *, plain_only: bool = False) -> str:
    assert isinstance(obj, dict), obj
    assert obj["type"] in ({"plain_text"} if plain_only else _TEXT_TYPES), obj
    text = obj["text"]
    assert isinstance(text, str) and 1 <= len(text) <= limit, (len(text), limit)
    return text


def _element(el: dict[str, Any]) -> None:
    assert len(el["action_id"]) <= 255
    if el["type"] == "button":
        _text(el["text"], 75, plain_only=True)
        assert isinstance(el["value"], str) and len(el["value"]) <= 2000
        assert el.get("style") in (None, "primary", "danger")
        if "confirm" in el:
            c = el["confirm"]
            _text(c["title"], 100, plain_only=True)
            _text(c["text"], 300)
            _text(c["confirm"], 30, plain_only=True)
            _text(c["deny"], 30, plain_only=True)
    elif el["type"] == "static_select":
        _text(el["placeholder"], 150, plain_only=True)
        assert 1 <= len(el["options"]) <= 100
        for option in el["options"]:
            _text(option["text"], 75, plain_only=True)
            assert 1 <= len(option["value"]) <= 150
    elif el["type"] == "plain_text_input":
        assert el.get("max_length", 3000) <= 3000
    else:
        raise AssertionError(f"unexpected element {el['type']}")


def assert_valid(blocks: list[dict[str, Any]], *, limit: int = 50) -> None:
    """Slack's Block Kit rules that a message or view would be refused for."""
    json.dumps(blocks)  # plain JSON, nothing else
    assert 1 <= len(blocks) <= limit, len(blocks)
    block_ids = [b["block_id"] for b in blocks if "block_id" in b]
    assert len(block_ids) == len(set(block_ids)), "block_ids must be unique"
    for block in blocks:
        assert len(block.get("block_id", "")) <= 255
        kind = block["type"]
        if kind == "section":
            _text(block["text"], 3000)
            fields = block.get("fields", [])
            assert len(fields) <= 10
            for f in fields:
                _text(f, 2000)
        elif kind == "header":
            _text(block["text"], 150, plain_only=True)
        elif kind == "context":
            assert 1 <= len(block["elements"]) <= 10
            for el in block["elements"]:
                _text(el, 2000)
        elif kind == "actions":
            assert 1 <= len(block["elements"]) <= 25
            ids = [el["action_id"] for el in block["elements"]]
            assert len(ids) == len(set(ids)), "action_ids must be unique in a block"
            for el in block["elements"]:
                _element(el)
        elif kind == "input":
            _text(block["label"], 2000, plain_only=True)
            _element(block["element"])
        elif kind == "divider":
            assert set(block) <= {"type", "block_id"}
        else:
            raise AssertionError(f"unexpected block type {kind}")


def actions(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [el for b in blocks if b["type"] == "actions" for el in b["elements"]]


def all_text(blocks: list[dict[str, Any]]) -> str:
    return json.dumps(blocks, ensure_ascii=False)


# --------------------------------------------------------------------------- messages


def card(**kw: Any) -> RunCard:
    base: dict[str, Any] = {
        "channel": "C0RUNS",
        "run_id": "r-1a2b",
        "spec_name": "gpt-small",
        "state": "RUNNING",
        "requester": "U0ADA",
        "attempt": 2,
        "step": 1200,
        "target_steps": 5000,
        "loss": 2.345678,
        "spent_usd": 40.0,
        "budget_usd": 800.0,
        "instance_id": "i-0abc",
        "zone": "us-east-1b",
    }
    return RunCard(**{**base, **kw})


def alert_msg(**kw: Any) -> AlertMessage:
    base: dict[str, Any] = {
        "channel": "C0RUNS",
        "thread_ts": "1700000000.000100",
        "alert_id": "a-77",
        "run_id": "r-1a2b",
        "rule": "divergent_loss",
        "severity": "critical",
        "state": "OPEN",
        "title": "Loss is NaN",
        "detail": "loss became NaN at step 1200; $40.00 spent so far",
        "hint": "lower the learning rate and resubmit from step 1000",
    }
    return AlertMessage(**{**base, **kw})


def test_run_card_shows_status_attempt_step_loss_spend_and_where() -> None:
    blocks = views.run_card(card())
    assert_valid(blocks)
    fields = [f["text"] for f in blocks[0]["fields"]]
    assert "*Status*\nrunning" in fields
    assert "*Attempt*\n2" in fields
    assert "*Step*\n1200 / 5000" in fields
    assert "*Loss*\n2.346" in fields
    assert "*Spend*\n$40.00 of $800.00 (5.0%)" in fields
    assert "*Instance*\ni-0abc in us-east-1b" in fields
    assert "<@U0ADA>" in blocks[0]["text"]["text"]


def test_run_card_shows_the_market_and_region_of_the_attempt() -> None:
    fallback = card(market="on-demand", region="us-west-2", zone="us-west-2a")
    blocks = views.run_card(fallback)
    assert_valid(blocks)
    fields = [f["text"] for f in blocks[0]["fields"]]
    assert "*Market*\non-demand in us-west-2" in fields
    assert "*Instance*\ni-0abc in us-west-2a" in fields
    assert "(on-demand in us-west-2)" in messages.run_card(fallback)
    assert "*Market*" not in all_text(views.run_card(card())), "no attempt yet: nothing said"


def test_run_card_before_launch_and_with_a_nan_loss() -> None:
    blocks = views.run_card(
        card(
            state="PREFLIGHT_FAILED",
            attempt=0,
            step=None,
            loss=math.nan,
            instance_id=None,
            budget_usd=None,
            reason="quota failed",
        )
    )
    assert_valid(blocks)
    text = all_text(blocks)
    assert "quota failed" in text and "preflight failed" in text
    assert "*Loss*\\nNaN" in text and "*Instance*\\nn/a" in text and "*Spend*\\n$40.00" in text


def test_preflight_report_with_warnings_offers_launch_anyway() -> None:
    msg = PreflightMessage(
        channel="C0RUNS",
        thread_ts="1700000000.000100",
        run_id="r-1a2b",
        checks=(
            CheckLine("quota", "pass", "8 of 8 A100 spot GPUs in us-east-1", "raise it"),
            CheckLine("capacity", "warn", "only us-east-1b offers p4d now", "allow another zone"),
            CheckLine("data locality", "fail", "bucket in eu-west-1", "copy the data to us-east-1"),
        ),
        ok=True,
        needs_confirmation=True,
        estimate_usd=123.4,
        interval_s=600.0,
    )
    blocks = views.preflight_report(msg)
    assert_valid(blocks)
    sections = [b["text"]["text"] for b in blocks if b["type"] == "section"]
    assert any(s.startswith(":white_check_mark: *quota*") and "raise it" not in s for s in sections)
    assert any(
        s.startswith(":warning: *capacity*") and "→ allow another zone" in s for s in sections
    )
    assert any(s.startswith(":x: *data locality*") and "→ copy the data" in s for s in sections)
    text = all_text(blocks)
    assert messages.estimated_cost(123.4) in text and messages.checkpoint_interval(600.0) in text
    [launch] = actions(blocks)
    assert (launch["action_id"], launch["value"]) == ("launch_anyway", "r-1a2b")


@pytest.mark.parametrize(("ok", "confirm"), [(True, False), (False, False), (False, True)])
def test_preflight_report_without_pending_warnings_has_no_button(ok: bool, confirm: bool) -> None:
    msg = PreflightMessage(
        channel="C",
        run_id="r-1",
        checks=(CheckLine("quota", "pass", "fine"),),
        ok=ok,
        needs_confirmation=confirm,
    )
    blocks = views.preflight_report(msg)
    assert_valid(blocks)
    assert actions(blocks) == []
    assert messages.preflight_verdict(msg) in all_text(blocks)


def test_open_alert_has_ack_snooze_stop_and_resubmit() -> None:
    blocks = views.alert(alert_msg(count=3))
    assert_valid(blocks)
    text = all_text(blocks)
    assert "CRITICAL" in text and "Loss is NaN" in text and "(×3)" in text
    assert "r-1a2b" in text and "$40.00 spent" in text and "lower the learning rate" in text
    by_id = {el["action_id"]: el for el in actions(blocks)}
    assert set(by_id) == {"alert_ack", "alert_snooze", "run_stop", "run_resubmit"}
    assert by_id["alert_ack"]["value"] == "a-77"
    assert by_id["run_stop"]["value"] == "r-1a2b" and by_id["run_stop"]["style"] == "danger"
    assert "confirm" in by_id["run_stop"]
    assert by_id["run_resubmit"]["value"] == "r-1a2b"
    snooze = by_id["alert_snooze"]
    assert snooze["type"] == "static_select"
    choices = [views.parse_snooze_value(o["value"]) for o in snooze["options"]]
    assert choices == [("a-77", "1h"), ("a-77", "4h"), ("a-77", "1d")]


def test_parse_snooze_value_rejects_anything_else() -> None:
    with pytest.raises(ValueError):
        views.parse_snooze_value("a-77|2y")
    with pytest.raises(ValueError):
        views.parse_snooze_value("4h")


def test_acknowledged_alert_has_no_buttons_and_says_who_and_when() -> None:
    blocks = views.alert(alert_msg(state="ACKED", acked_by="U0GRACE", acked_at=AT))
    assert_valid(blocks)
    assert actions(blocks) == []
    assert "Acknowledged by <@U0GRACE> at 12:00 UTC." in all_text(blocks)
    resolved = views.alert(alert_msg(state="RESOLVED"))
    assert actions(resolved) == [] and "Resolved." in all_text(resolved)


def test_snoozed_alert_keeps_its_buttons_and_says_until_when() -> None:
    blocks = views.alert(alert_msg(snoozed_until=AT))
    assert "Snoozed until 12:00 UTC." in all_text(blocks)
    assert {el["action_id"] for el in actions(blocks)} >= {"alert_ack"}


def test_team_alert_has_no_run_buttons() -> None:
    blocks = views.alert(alert_msg(run_id=None, rule="budget", severity="warning"))
    assert_valid(blocks)
    assert {el["action_id"] for el in actions(blocks)} == {"alert_ack", "alert_snooze"}


def test_escalation_mentions_the_group_in_blocks_and_notification() -> None:
    msg = alert_msg(escalate_to="S0ONCALL")
    blocks = views.alert(msg)
    assert_valid(blocks)
    assert "<!subteam^S0ONCALL>" in blocks[0]["text"]["text"]
    assert views.fallback_text(msg).startswith("<!subteam^S0ONCALL> ")
    named = views.alert(alert_msg(escalate_to="@oncall"))
    assert "Escalated to @oncall" in all_text(named)


def test_user_text_cannot_forge_mentions_or_links() -> None:
    msg = alert_msg(detail="<!channel> see <http://evil|here> & more", title="<@U0BOSS>")
    text = all_text(views.alert(msg))
    assert "<!channel>" not in text and "<@U0BOSS>" not in text and "<http" not in text
    assert "&lt;!channel&gt;" in text and "&amp; more" in text
    assert "<!channel>" not in views.fallback_text(msg)


def test_long_text_is_clipped_to_slack_limits() -> None:
    huge = "x" * 10_000
    assert_valid(views.alert(alert_msg(detail=huge, hint=huge, title=huge)))
    assert_valid(views.text_line(TextMessage(channel="C", kind="info", text=huge)))
    assert_valid(views.run_card(card(reason=huge, state="FAILED", spec_name=huge, zone=huge)))
    many = tuple(CheckLine(f"check {i}", "warn", huge[:500], "fix it") for i in range(200))
    blocks = views.preflight_report(
        PreflightMessage(channel="C", run_id="r", checks=many, ok=True, needs_confirmation=True)
    )
    assert_valid(blocks)
    assert actions(blocks)[0]["action_id"] == "launch_anyway", "the button survives clipping"
    assert len(views.fallback_text(TextMessage(channel="C", kind="info", text=huge))) <= 3000


def test_clip_never_cuts_an_entity_or_a_link() -> None:
    text = "a" * 8 + "&amp;" + "b" * 10
    for limit in range(9, 14):
        cut = views.clip(text, limit)
        assert len(cut) <= limit and cut.endswith("…")
        assert "&" not in cut or "&amp;" in cut
    linked = views.clip("see <@U0ADA> now", 9)
    assert "<" not in linked and linked == "see …"


def figures(runs: int = 2) -> dict[str, Any]:
    return {
        "date": "2026-03-03",
        "day_usd": 12.5,
        "day_label": "yesterday",
        "month_to_date_usd": 99.0,
        "preemptions": 3,
        "goodput": 0.93,
        "gpu_hours_lost": 1.5,
        "instance_hours_lost": 0.25,
        "per_run": [
            {
                "run_id": f"r-{i}",
                "spec": "tiny",
                "requester": "U0ADA",
                "usd": 1.0 + i,
                "preemptions": 1,
                "goodput": 0.9,
                "state": "RUNNING",
            }
            for i in range(runs)
        ],
        "per_user": [{"user": "U0ADA", "usd": 12.5}],
    }


def test_digest_shows_totals_runs_users_and_points_at_the_chart() -> None:
    msg = DigestMessage(channel="C0RUNS", figures=figures(), chart_png=PNG_MAGIC)
    blocks = views.digest(msg)
    assert_valid(blocks)
    text = all_text(blocks)
    assert "Daily spend digest for <#C0RUNS> (2026-03-03)" in text
    assert "*Yesterday*\\n$12.50" in text and "*Month to date*\\n$99.00" in text
    assert "*Goodput*\\n93.0%" in text and "*Preemptions*\\n3" in text
    assert messages.digest_run_line(figures()["per_run"][1]) in text
    assert "<@U0ADA>: $12.50" in text
    assert messages.digest_chart_in_thread() in text
    assert messages.digest_chart_in_thread() not in all_text(
        views.digest(DigestMessage(channel="C0RUNS", figures=figures()))
    )


def test_digest_with_a_thousand_runs_fits() -> None:
    blocks = views.digest(DigestMessage(channel="C0RUNS", figures=figures(1000)))
    assert_valid(blocks)
    assert "more lines not shown" in all_text(blocks)


def test_text_line_and_fallback_use_the_console_sentences() -> None:
    msg = TextMessage(channel="C", thread_ts="1.2", kind="preempted", text="Attempt 2 preempted")
    blocks = views.render(msg)
    assert_valid(blocks)
    assert blocks[0]["text"]["text"] == ":zap: Attempt 2 preempted"
    for m in (msg, card(), alert_msg(), DigestMessage(channel="C", figures=figures())):
        assert views.fallback_text(m) == views.escape(messages.render(m))
        assert_valid(views.render(m))


# --------------------------------------------------------------------------- views


def test_home_tab_lists_active_runs_and_open_alerts() -> None:
    view = views.home_tab([card(), card(run_id="r-2")], [alert_msg(), alert_msg(alert_id="a-78")])
    assert view["type"] == "home"
    assert_valid(view["blocks"], limit=100)
    text = all_text(view["blocks"])
    assert "Active runs" in text and "Open alerts" in text
    assert "r-2" in text and "a-78" in text
    acks = [el["value"] for el in actions(view["blocks"]) if el["action_id"] == "alert_ack"]
    assert acks == ["a-77", "a-78"]


def test_home_tab_when_empty_and_when_huge() -> None:
    empty = views.home_tab([], [])
    assert_valid(empty["blocks"], limit=100)
    text = all_text(empty["blocks"])
    assert messages.home_no_runs() in text and messages.home_no_alerts() in text

    runs = [card(run_id=f"r-{i}") for i in range(500)]
    alerts = [alert_msg(alert_id=f"a-{i}") for i in range(500)]
    huge = views.home_tab(runs, alerts)
    assert_valid(huge["blocks"], limit=100)
    text = all_text(huge["blocks"])
    assert "Open alerts" in text and "a-0" in text, "alerts keep room however many runs"
    assert "more runs not shown" in text and "more alerts not shown" in text


def test_launch_modal_picks_a_spec_and_takes_overrides() -> None:
    view = views.launch_modal(["tiny", "gpt-small"], private_metadata="C0RUNS")
    assert view["type"] == "modal" and view["callback_id"] == "launch_modal"
    assert len(view["title"]["text"]) <= 24 and view["submit"]["text"] == "Launch"
    assert view["private_metadata"] == "C0RUNS"
    assert_valid(view["blocks"], limit=100)
    spec, overrides, paste = view["blocks"]
    assert paste["elements"][0]["action_id"] == "paste_yaml"
    assert spec["element"]["type"] == "static_select"
    assert [o["value"] for o in spec["element"]["options"]] == ["tiny", "gpt-small"]
    assert overrides["element"]["type"] == "plain_text_input" and overrides["optional"] is True
    state = {
        "spec": {"spec": {"type": "static_select", "selected_option": {"value": "tiny"}}},
        "overrides": {"overrides": {"type": "plain_text_input", "value": " budget.usd=5 "}},
    }
    assert views.read_launch_modal(state) == ("tiny", "budget.usd=5")
    assert views.read_launch_modal({}) == (None, "")


def test_launch_modal_without_specs_says_how_to_add_one() -> None:
    view = views.launch_modal([])
    assert_valid(view["blocks"], limit=100)
    assert "submit" not in view and all(b["type"] != "input" for b in view["blocks"])
    assert "TRAINBOT_SPECS_DIR" in all_text(view["blocks"])


# --------------------------------------------------------------------------- plots


def test_loss_curve_png_marks_non_finite_points() -> None:
    steps = list(range(10))
    finite = plots.loss_curve_png(steps, [3.0 - 0.1 * s for s in steps], title="r-1")
    losses: list[float | None] = [3.0 - 0.1 * s for s in steps]
    losses[7], losses[8], losses[9] = math.nan, math.inf, None
    marked = plots.loss_curve_png(steps, losses, title="r-1")
    assert finite.startswith(PNG_MAGIC) and marked.startswith(PNG_MAGIC)
    assert marked != finite
    assert plots.loss_curve_png([1, 2], [math.nan, math.nan]).startswith(PNG_MAGIC)
    assert plots.loss_curve_png([], []).startswith(PNG_MAGIC)
    with pytest.raises(ValueError, match="one loss per step"):
        plots.loss_curve_png([1, 2], [1.0])


def test_digest_chart_is_the_one_the_digest_carries() -> None:
    carried = DigestMessage(channel="C", figures=figures(), chart_png=b"given")
    assert plots.digest_chart_png(carried) == b"given"
    drawn = plots.digest_chart_png(DigestMessage(channel="C", figures=figures()))
    assert drawn is not None and drawn.startswith(PNG_MAGIC)
    assert plots.digest_chart_png(DigestMessage(channel="C", figures={})) is None


# --------------------------------------------------------------------------- what must never reach a channel


@pytest.mark.parametrize(
    "forged", ["<!channel>", "<!here>", "<!everyone|all>", "<https://evil.example|click>", "<#C1>"]
)
def test_mention_turns_only_ids_into_mentions(forged: str) -> None:
    assert "<" not in views.mention(forged)
    assert views.mention("<@U0GRACE|grace>") == "<@U0GRACE>"
    assert views.mention("<!subteam^S0ONCALL|@ml-oncall>") == "<!subteam^S0ONCALL>"
    blocks = views.alert(alert_msg(escalate_to=forged))
    assert "<!" not in all_text(blocks) and "<http" not in all_text(blocks)


def test_clipped_notification_text_keeps_its_end() -> None:
    huge = alert_msg(detail="x" * 10_000)
    text = views.fallback_text(huge)
    assert len(text) <= views.MAX_FALLBACK_TEXT
    assert text.startswith("‼ CRITICAL [a-77]") and text.endswith("/train snooze a-77 1h")
    many = tuple(CheckLine(f"check {i}", "warn", "y" * 300, "fix it") for i in range(100))
    report = PreflightMessage(
        channel="C", run_id="r", checks=many, ok=True, needs_confirmation=True
    )
    assert views.fallback_text(report).endswith("Launch anyway: /train resubmit r")


def test_a_clipped_list_says_how_many_it_hides() -> None:
    many = tuple(CheckLine(f"check-{i}", "pass", "y" * 500) for i in range(80))
    blocks = views.preflight_report(
        PreflightMessage(channel="C", run_id="r", checks=many, ok=True, needs_confirmation=False)
    )
    text = all_text(blocks)
    shown = sum(f"check-{i}*" in text for i in range(80))
    hidden = int(re.search(r"…and (\d+) more checks", text).group(1))  # type: ignore[union-attr]
    assert shown + hidden == 80

    alerts = [alert_msg(alert_id=f"a-{i}") for i in range(150)]
    home = all_text(views.home_tab([], alerts, max_items=20)["blocks"])
    assert "…and 130 more alerts not shown" in home

    modal = views.launch_modal([f"spec-{i}" for i in range(130)])
    assert_valid(modal["blocks"], limit=100)
    assert "…and 30 more specs not shown" in all_text(modal["blocks"])

"""Alert rules: each fires when it should, stays quiet when it should not, and says why."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.rules import (
    AlertThresholds,
    AutoResubmit,
    Disk,
    DivergentLoss,
    LostHeartbeat,
    LowUtilisation,
    Obs,
    Preemption,
    RepeatedPreemptions,
    Rule,
    RunContext,
    Severity,
    Signal,
    TypedWindow,
    default_rules,
    evaluate_all,
)

NOW = 1_700_000_000.0
RUN = "r-test42"
GB = 1_000_000_000


def ctx(**changes: Any) -> RunContext:
    base = RunContext(
        run_id=RUN,
        last_heartbeat=None,
        preemption_times=(),
        attempt_number=1,
        last_committed_step=None,
        current_step=None,
    )
    return replace(base, **changes)


def metrics(t: float, step: int, loss: Any, *, wait: float | None = None) -> Obs:
    return Obs(
        time=t,
        type="metrics",
        data={
            "step": step,
            "loss": loss,
            "step_time_s": 0.5,
            "data_wait_fraction": wait,
            "metrics": {},
        },
    )


def system(
    t: float, *, gpu: float | None = None, used: int = 10 * GB, total: int = 100 * GB
) -> Obs:
    return Obs(
        time=t,
        type="system",
        data={"gpu_util": gpu, "gpu_count": 0 if gpu is None else 1, "disk_used": used,
              "disk_total": total},
    )  # fmt: skip


def losses(values: list[float], *, start: float = NOW - 1000) -> list[Obs]:
    return [metrics(start + i, 100 + i, v) for i, v in enumerate(values)]


def active(signals: list[Signal], key: str | None = None) -> list[Signal]:
    return [s for s in signals if not s.resolved and (key is None or s.key == key)]


def keyed(signals: list[Signal], key: str) -> list[Signal]:
    return [s for s in signals if s.key == key]


# --- divergent loss -------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "NaN", "Infinity"])
def test_non_finite_loss_is_critical_at_once(bad: Any) -> None:
    window = [metrics(NOW - 1, 1234, bad)]
    (signal,) = active(DivergentLoss().evaluate(window, now=NOW, ctx=ctx()))
    assert (signal.rule, signal.key, signal.severity) == (
        "divergent_loss",
        "nan",
        Severity.CRITICAL,
    )
    assert RUN in signal.title
    assert "1234" in signal.title
    assert "1234" in signal.detail


def test_nan_hint_names_the_last_checkpoint() -> None:
    window = losses([2.0, 1.9, math.nan])
    (signal,) = active(DivergentLoss().evaluate(window, now=NOW, ctx=ctx(last_committed_step=90)))
    assert "step 90" in signal.hint
    assert f"/train stop {RUN}" in signal.hint


def test_healthy_loss_raises_nothing() -> None:
    window = losses([3.0 - 0.05 * i for i in range(40)])
    signals = DivergentLoss().evaluate(window, now=NOW, ctx=ctx())
    assert active(signals) == []
    assert {s.key for s in signals} == {"spike", "trend"}  # both judged, both clear


def test_spike_for_m_points_is_critical_with_figures() -> None:
    window = losses([2.0] * 6 + [7.0, 7.5, 8.0])
    (signal,) = active(DivergentLoss().evaluate(window, now=NOW, ctx=ctx()), "spike")
    assert signal.severity is Severity.CRITICAL
    assert RUN in signal.title
    assert "7, 7.5, 8" in signal.detail
    assert "baseline 2" in signal.detail
    assert "steps 106–108" in signal.detail
    assert signal.data["step"] == 108


def test_spike_shorter_than_m_points_does_not_fire() -> None:
    window = losses([2.0] * 6 + [1.9, 7.0, 7.5])
    assert active(DivergentLoss().evaluate(window, now=NOW, ctx=ctx()), "spike") == []


def test_single_spike_then_recovery_does_not_fire() -> None:
    window = losses([2.0] * 6 + [9.0, 2.0, 2.0])
    signals = DivergentLoss().evaluate(window, now=NOW, ctx=ctx())
    assert active(signals, "spike") == []
    assert keyed(signals, "spike")[0].resolved


def test_spike_at_exactly_the_factor_does_not_fire() -> None:
    window = losses([2.0] * 6 + [6.0, 6.0, 6.0])
    assert active(DivergentLoss().evaluate(window, now=NOW, ctx=ctx()), "spike") == []
    window = losses([2.0] * 6 + [6.01, 6.01, 6.01])
    assert len(active(DivergentLoss().evaluate(window, now=NOW, ctx=ctx()), "spike")) == 1


def test_spike_needs_a_baseline() -> None:
    window = losses([2.0, 2.0, 7.0, 7.0, 7.0])
    assert keyed(DivergentLoss().evaluate(window, now=NOW, ctx=ctx()), "spike") == []


def test_spike_respects_configured_points_and_factor() -> None:
    rule = DivergentLoss(AlertThresholds(loss_spike_points=1, loss_spike_factor=2.0))
    window = losses([2.0] * 5 + [4.5])
    assert len(active(rule.evaluate(window, now=NOW, ctx=ctx()), "spike")) == 1


def test_rising_trend_is_a_warning() -> None:
    window = losses([1.0 + 0.06 * i for i in range(20)])  # 1.0 → 2.14
    (signal,) = active(DivergentLoss().evaluate(window, now=NOW, ctx=ctx()), "trend")
    assert signal.severity is Severity.WARNING
    assert RUN in signal.title
    assert "2.14" in signal.detail
    assert "minimum 1 " in signal.detail


def test_divergence_signals_are_one_incident_that_can_stop_the_run() -> None:
    # A spike at steps 106-108 that also makes a rising trend from the minimum at 100.
    window = losses([2.0] * 6 + [7.0, 7.5, 8.0] + [8.5 + i for i in range(11)])
    signals = DivergentLoss().evaluate(window, now=NOW, ctx=ctx())
    (trend,) = active(signals, "trend")
    assert {s.incident for s in signals} == {"divergence"}  # cleared ones too
    assert trend.stop_after_s == 1800.0 and trend.began_step == 100
    window = losses([2.0] * 6 + [7.0, 7.5, 8.0])
    (spike,) = active(DivergentLoss(AlertThresholds(stop_after="10m")).evaluate(
        window, now=NOW, ctx=ctx()), "spike")  # fmt: skip
    assert (spike.incident, spike.stop_after_s, spike.began_step) == ("divergence", 600.0, 106)


@pytest.mark.parametrize(("on_nan", "stop_after_s"), [("stop", 0.0), ("alert", None)])
def test_a_nan_asks_to_stop_at_once_unless_told_only_to_alert(
    on_nan: str, stop_after_s: float | None
) -> None:
    window = losses([2.0, 1.9, math.nan, math.nan])
    rule = DivergentLoss(AlertThresholds(on_nan=on_nan))  # type: ignore[arg-type]
    (signal,) = active(rule.evaluate(window, now=NOW, ctx=ctx()), "nan")
    assert (signal.stop_after_s, signal.began_step, signal.incident) == (
        stop_after_s, 102, "divergence",
    )  # fmt: skip


def test_slow_rise_below_the_ratio_is_not_a_trend() -> None:
    window = losses([1.0 + 0.02 * i for i in range(20)])  # 1.0 → 1.38
    assert active(DivergentLoss().evaluate(window, now=NOW, ctx=ctx()), "trend") == []


def test_trend_needs_trend_points() -> None:
    window = losses([1.0 + 0.1 * i for i in range(19)])
    assert keyed(DivergentLoss().evaluate(window, now=NOW, ctx=ctx()), "trend") == []


def test_missing_and_negative_losses_do_not_crash() -> None:
    window = [metrics(NOW - 30 + i, i, None) for i in range(5)]
    window += losses([-1.0 - 0.1 * i for i in range(25)])
    assert active(DivergentLoss().evaluate(window, now=NOW, ctx=ctx())) == []


# --- low utilisation ------------------------------------------------------------------


def gpu_window(
    util: float, *, wait: float | None, span: float = 300, every: float = 30
) -> list[Obs]:
    window: list[Obs] = []
    t = NOW - span
    while t <= NOW:
        window.append(system(t, gpu=util))
        window.append(metrics(t, int(t), 2.0, wait=wait))
        t += every
    return window


def test_one_slow_nodes_loader_is_named_in_a_multi_node_run() -> None:
    """Node 0 keeps its GPUs busy; node 1's idle, and its own data wait (sent with its
    system samples) says why: the alert is node 1's, and says so."""
    window = gpu_window(93.0, wait=0.02)
    t = NOW - 300
    while t <= NOW:
        obs = system(t, gpu=18.0)
        window.append(obs._replace(data={**obs.data, "node": 1, "data_wait_fraction": 0.7}))
        t += 30
    signals = LowUtilisation().evaluate(window, now=NOW, ctx=ctx())
    (slow,) = active(signals)
    assert slow.key == "gpu:node-1" and slow.data["node"] == 1
    assert slow.title.endswith("(node 1)") and "18%" in slow.title
    assert "data-wait 70% of step time" in slow.hint
    (fine,) = [s for s in signals if s.key == "gpu"]
    assert fine.resolved and fine.title.endswith("(node 0)")


def test_low_gpu_util_names_the_data_wait() -> None:
    signals = LowUtilisation().evaluate(gpu_window(22.0, wait=0.62), now=NOW, ctx=ctx())
    (signal,) = active(signals)
    assert (signal.rule, signal.key, signal.severity) == (
        "low_utilisation",
        "gpu",
        Severity.WARNING,
    )
    assert RUN in signal.title
    assert "22%" in signal.title
    assert "data-wait 62% of step time: the input pipeline is the bottleneck" in signal.hint
    assert "loader workers" in signal.hint


def test_low_gpu_util_with_little_data_wait_points_elsewhere() -> None:
    (signal,) = active(LowUtilisation().evaluate(gpu_window(22.0, wait=0.05), now=NOW, ctx=ctx()))
    assert "not the cause" in signal.hint
    assert "5%" in signal.hint


def test_low_gpu_util_without_data_wait_still_fires() -> None:
    (signal,) = active(LowUtilisation().evaluate(gpu_window(10.0, wait=None), now=NOW, ctx=ctx()))
    assert "data-wait not reported" in signal.detail


def test_one_low_sample_does_not_fire() -> None:
    window = [system(NOW - 5, gpu=3.0), metrics(NOW - 5, 1, 2.0, wait=0.9)]
    assert LowUtilisation().evaluate(window, now=NOW, ctx=ctx()) == []


def test_low_util_needs_the_window_covered() -> None:
    # Samples over the last 200 s only: the run has not been low for 300 s yet.
    window = gpu_window(10.0, wait=0.9, span=200)
    assert LowUtilisation().evaluate(window, now=NOW, ctx=ctx()) == []


def test_util_at_the_threshold_is_fine_and_resolves() -> None:
    signals = LowUtilisation().evaluate(gpu_window(40.0, wait=0.9), now=NOW, ctx=ctx())
    (signal,) = signals
    assert signal.resolved
    assert signal.key == "gpu"


def test_only_the_last_window_counts() -> None:
    old = [system(NOW - 1000 + 30 * i, gpu=5.0) for i in range(10)]  # low, long ago
    signals = LowUtilisation().evaluate(old + gpu_window(90.0, wait=0.1), now=NOW, ctx=ctx())
    assert [s.resolved for s in signals] == [True]


def test_cpu_run_with_high_data_wait_fires_the_same_rule() -> None:
    window = gpu_window(0.0, wait=0.7)
    window = [system(o.time) if o.type == "system" else o for o in window]  # gpu_util None
    (signal,) = active(LowUtilisation().evaluate(window, now=NOW, ctx=ctx()))
    assert (signal.rule, signal.key) == ("low_utilisation", "data-wait")
    assert RUN in signal.title
    assert "70%" in signal.title
    assert "data-wait 70% of step time: the input pipeline is the bottleneck" in signal.hint


def test_cpu_run_without_system_events_uses_data_wait() -> None:
    window = [o for o in gpu_window(0.0, wait=0.8) if o.type == "metrics"]
    assert len(active(LowUtilisation().evaluate(window, now=NOW, ctx=ctx()))) == 1


def test_cpu_run_at_half_data_wait_is_fine() -> None:
    window = [o for o in gpu_window(0.0, wait=0.5) if o.type == "metrics"]
    (signal,) = LowUtilisation().evaluate(window, now=NOW, ctx=ctx())
    assert signal.resolved
    assert signal.key == "data-wait"


def test_cpu_run_needs_the_window_covered() -> None:
    window = [metrics(NOW - 10 + i, i, 2.0, wait=0.95) for i in range(10)]
    assert LowUtilisation().evaluate(window, now=NOW, ctx=ctx()) == []


def test_none_utilisation_without_data_wait_raises_nothing() -> None:
    window = [system(NOW - 300 + 30 * i) for i in range(11)]
    assert LowUtilisation().evaluate(window, now=NOW, ctx=ctx()) == []


# --- disk -----------------------------------------------------------------------------


def test_disk_over_threshold_is_a_warning_with_figures() -> None:
    window = [system(NOW - 10, used=91 * GB)]
    (signal,) = Disk().evaluate(window, now=NOW, ctx=ctx())
    assert (signal.key, signal.severity, signal.resolved) == ("threshold", Severity.WARNING, False)
    assert RUN in signal.title
    assert "91.0%" in signal.detail
    assert "91.0 GB of 100.0 GB" in signal.detail


def test_disk_at_threshold_is_fine() -> None:
    (signal,) = Disk().evaluate([system(NOW, used=90 * GB)], now=NOW, ctx=ctx())
    assert signal.resolved


def test_disk_nearly_full_is_critical() -> None:
    (signal,) = Disk().evaluate([system(NOW, used=97 * GB)], now=NOW, ctx=ctx())
    assert signal.severity is Severity.CRITICAL


def test_disk_filling_fast_predicts_full() -> None:
    # 1 GB a minute from 50 GB: full in 45 min after the last sample at 55 GB... too slow.
    slow = [system(NOW - 300 + 60 * i, used=(50 + i) * GB) for i in range(6)]
    assert active(Disk().evaluate(slow, now=NOW, ctx=ctx())) == []
    # 2 GB a minute from 40 GB to 50 GB: 50 GB left, full in 25 min < 30 min.
    fast = [system(NOW - 300 + 60 * i, used=(40 + 2 * i) * GB) for i in range(6)]
    (signal,) = active(Disk().evaluate(fast, now=NOW, ctx=ctx()))
    assert signal.key == "full-in"
    assert signal.severity is Severity.WARNING
    assert "25 min" in signal.title
    assert RUN in signal.title
    assert "2.0 GB/min" in signal.detail
    assert signal.data["eta_s"] == pytest.approx(1500)


def test_disk_prediction_needs_samples() -> None:
    window = [system(NOW - 60, used=40 * GB), system(NOW, used=80 * GB)]
    assert keyed(Disk().evaluate(window, now=NOW, ctx=ctx()), "full-in") == []


def test_disk_shrinking_resolves_the_prediction() -> None:
    window = [system(NOW - 300 + 60 * i, used=(60 - 2 * i) * GB) for i in range(6)]
    (signal,) = keyed(Disk().evaluate(window, now=NOW, ctx=ctx()), "full-in")
    assert signal.resolved


def test_disk_without_a_total_is_ignored() -> None:
    assert Disk().evaluate([system(NOW, used=5, total=0)], now=NOW, ctx=ctx()) == []


# --- preemption, resubmit, repeated ---------------------------------------------------


def test_preemption_notice_is_a_warning_per_attempt() -> None:
    window = [Obs(NOW - 5, "preemption_notice", {"source": "aws-imds", "time_left_s": 120})]
    state = ctx(attempt_number=2, last_committed_step=1200, current_step=1340)
    (signal,) = Preemption().evaluate(window, now=NOW, ctx=state)
    assert (signal.key, signal.severity) == ("attempt-2", Severity.WARNING)
    assert RUN in signal.title
    assert "120 s" in signal.detail
    assert "aws-imds" in signal.detail
    assert "step 1200" in signal.hint
    assert "140 steps" in signal.hint


def test_notice_and_exit_of_one_attempt_are_one_signal() -> None:
    window = [
        Obs(NOW - 60, "preemption_notice", {"source": "gcp-metadata", "time_left_s": 30}),
        Obs(NOW - 30, "exit", {"code": 75, "reason": "preempted"}),
    ]
    (signal,) = Preemption().evaluate(window, now=NOW, ctx=ctx())
    assert "was preempted" in signal.title
    assert "code 75" in signal.detail


def test_an_end_seen_by_the_control_plane_says_what_it_saw() -> None:
    window = [Obs(NOW, "exit", {"reason": "preempted", "cause": "instance vanished"})]
    (signal,) = Preemption().evaluate(window, now=NOW, ctx=ctx())
    assert signal.detail == "the attempt ended: instance vanished"


def test_exit_code_75_counts_and_failures_do_not() -> None:
    assert len(Preemption().evaluate([Obs(NOW, "exit", {"code": 75})], now=NOW, ctx=ctx())) == 1
    failed = [Obs(NOW, "exit", {"code": 1, "reason": "failed"})]
    assert Preemption().evaluate(failed, now=NOW, ctx=ctx()) == []
    stopped = [Obs(NOW, "exit", {"code": 75, "reason": "stopped"})]
    assert Preemption().evaluate(stopped, now=NOW, ctx=ctx()) == []


def test_preemptions_of_earlier_attempts_keep_their_key() -> None:
    window = [
        Obs(NOW - 900, "exit", {"code": 75, "reason": "preempted", "attempt": 1}),
        Obs(NOW - 5, "preemption_notice", {"source": "aws-imds", "attempt": 2}),
    ]
    signals = Preemption().evaluate(window, now=NOW, ctx=ctx(attempt_number=2))
    assert [s.key for s in signals] == ["attempt-1", "attempt-2"]


def test_resubmitted_reports_the_lost_work() -> None:
    data = {"attempt": 3, "lost_steps": 340, "lost_seconds": 720.0, "zone": "us-east-1b"}
    (signal,) = AutoResubmit().evaluate([Obs(NOW, "resubmitted", data)], now=NOW, ctx=ctx())
    assert (signal.rule, signal.key, signal.severity) == (
        "auto_resubmit",
        "attempt-3",
        Severity.INFO,
    )
    assert RUN in signal.title
    assert "us-east-1b" in signal.title
    assert "340 steps" in signal.detail
    assert "12 min" in signal.detail


def test_repeated_preemptions_within_the_window_are_critical() -> None:
    times = (NOW - 3000, NOW - 1500, NOW - 60)
    (signal,) = RepeatedPreemptions().evaluate([], now=NOW, ctx=ctx(preemption_times=times))
    assert (signal.key, signal.severity) == ("repeated", Severity.CRITICAL)
    assert RUN in signal.title
    assert "3 times" in signal.title
    assert "zone" in signal.hint
    assert "on-demand" in signal.hint


def test_preemptions_spread_out_are_not_repeated() -> None:
    times = (NOW - 4000, NOW - 1500, NOW - 60)
    assert RepeatedPreemptions().evaluate([], now=NOW, ctx=ctx(preemption_times=times)) == []
    assert RepeatedPreemptions().evaluate([], now=NOW, ctx=ctx(preemption_times=times[1:])) == []


# --- budget: not a rule; the spend job alerts (tests/jobs/test_spend.py) ----------------


# --- heartbeat ------------------------------------------------------------------------


def test_lost_heartbeat_is_critical() -> None:
    (signal,) = LostHeartbeat().evaluate([], now=NOW, ctx=ctx(last_heartbeat=NOW - 300))
    assert (signal.key, signal.severity, signal.resolved) == ("heartbeat", Severity.CRITICAL, False)
    assert RUN in signal.title
    assert "300 s" in signal.detail or "5 min" in signal.detail


def test_heartbeat_at_the_deadline_is_fine() -> None:
    (signal,) = LostHeartbeat().evaluate([], now=NOW, ctx=ctx(last_heartbeat=NOW - 120))
    assert signal.resolved


def test_no_heartbeat_yet_is_not_lost() -> None:
    assert LostHeartbeat().evaluate([], now=NOW, ctx=ctx()) == []


# --- the set --------------------------------------------------------------------------


def test_default_rules_cover_every_rule_once() -> None:
    rules: list[Rule] = default_rules(AlertThresholds())
    assert [r.name for r in rules] == [
        "divergent_loss",
        "low_utilisation",
        "disk",
        "preemption",
        "auto_resubmit",
        "repeated_preemptions",
        "lost_heartbeat",
        "hung",
        "metric_threshold",
        "script_alert",
    ]


def test_evaluate_all_collects_every_rule() -> None:
    window = [metrics(NOW - 2, 10, math.nan), system(NOW - 1, used=95 * GB)]
    state = ctx(last_heartbeat=NOW - 1000)
    signals = active(evaluate_all(default_rules(AlertThresholds()), window, now=NOW, ctx=state))
    assert {(s.rule, s.key) for s in signals} == {
        ("divergent_loss", "nan"),
        ("disk", "threshold"),
        ("lost_heartbeat", "heartbeat"),
    }
    assert all(RUN in s.title for s in signals)


def test_alert_thresholds_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="trend_points"):
        AlertThresholds(trend_points=2)
    with pytest.raises(ValueError, match="disk_percent"):
        AlertThresholds(disk_percent=120)
    with pytest.raises(ValueError, match="heartbeat_deadline_s"):
        AlertThresholds(heartbeat_deadline_s=0)


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_a_spike_factor_must_be_above_one(factor: float) -> None:
    # At or below its baseline a loss has not spiked: such a factor would alert on noise.
    with pytest.raises(ValueError, match="loss_spike_factor"):
        AlertThresholds(loss_spike_factor=factor)
    assert AlertThresholds(loss_spike_factor=1.5).loss_spike_factor == 1.5


@pytest.mark.parametrize("fraction", [0.0, 1.01])
def test_a_data_wait_fraction_is_above_zero_and_at_most_one(fraction: float) -> None:
    with pytest.raises(ValueError, match="data_wait_fraction"):
        AlertThresholds(data_wait_fraction=fraction)


def test_a_data_wait_fraction_of_one_is_legal_and_never_fires() -> None:
    # A wait above the whole step time cannot happen, so 1 turns the CPU alert off.
    rule = LowUtilisation(AlertThresholds(data_wait_fraction=1.0))
    window = [o for o in gpu_window(0.0, wait=1.0) if o.type == "metrics"]
    assert active(rule.evaluate(window, now=NOW, ctx=ctx())) == []


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
)
_KEYS = st.sampled_from(
    ["step", "loss", "data_wait_fraction", "gpu_util", "disk_used", "disk_total", "attempt",
     "code", "reason", "source", "time_left_s", "lost_steps", "lost_seconds", "zone"]
)  # fmt: skip
_TYPES = st.sampled_from(
    ["metrics", "system", "preemption_notice", "exit", "resubmitted", "checkpoint_committed"]
)


@settings(max_examples=300, deadline=None, database=None)
@given(
    st.lists(
        st.builds(
            Obs,
            time=st.floats(min_value=NOW - 4000, max_value=NOW + 10),
            type=_TYPES,
            data=st.dictionaries(_KEYS, _VALUES, max_size=6),
        ),
        max_size=30,
    )
)
def test_malformed_payloads_never_crash_the_rules(window: list[Obs]) -> None:
    state = ctx(last_heartbeat=NOW - 10)
    for signal in evaluate_all(default_rules(AlertThresholds()), window, now=NOW, ctx=state):
        assert RUN in signal.title
        assert signal.rule and signal.key


def _mixed_window(rng: random.Random) -> list[Obs]:
    """Every kind of observation the rules read, in no particular order."""
    window: list[Obs] = []
    for i in range(120):
        t = NOW - 600 + i * 5
        window.append(metrics(t, 1000 + i, 2.0 if i < 110 else 9.0, wait=0.6))
        window.append(system(t, gpu=20.0, used=50 * GB + i * GB // 10))
    window.append(Obs(NOW - 30, "preemption_notice", {"source": "aws", "attempt": 1}))
    window.append(Obs(NOW - 20, "exit", {"code": 75, "reason": "preempted", "attempt": 1}))
    window.append(Obs(NOW - 10, "resubmitted", {"attempt": 2, "lost_steps": 40}))
    rng.shuffle(window)
    return window


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_typed_window_gives_the_signals_of_the_plain_window(seed: int) -> None:
    window = _mixed_window(random.Random(seed))
    groups: dict[str, list[Obs]] = {}
    for obs in window:
        groups.setdefault(obs.type, []).append(obs)
    rules = default_rules(AlertThresholds())
    state = ctx(last_heartbeat=NOW - 10, preemption_times=(NOW - 20,))

    expected = [rule.evaluate(window, now=NOW, ctx=state) for rule in rules]  # plain lists
    typed = TypedWindow.from_groups(groups)

    assert [rule.evaluate(typed, now=NOW, ctx=state) for rule in rules] == expected
    assert evaluate_all(rules, window, now=NOW, ctx=state) == [s for e in expected for s in e]
    assert active([s for e in expected for s in e])  # the window does make the rules speak
    assert sorted(typed, key=id) == sorted(window, key=id) and len(typed) == len(window)
    for kind, group in groups.items():
        assert typed.of_type(kind) == sorted(group, key=lambda o: o.time)
        assert TypedWindow(window).of_type(kind) == typed.of_type(kind)
    assert typed.of_type("checkpoint_committed") == []

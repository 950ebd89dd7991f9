"""Preemption: signals, the AWS and GCE metadata pollers over real HTTP, flush_fits, and the
notice a supervisor hands its child."""

from __future__ import annotations

import math
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest

from runner.errors import RunnerError
from runner.preemption import (
    ASSUMED_BANDWIDTH_BPS,
    UNANNOUNCED_SHARE,
    AwsSpotPoller,
    GcpPreemptedPoller,
    Notice,
    PreemptionConfigError,
    PreemptionFlag,
    SignalHandlers,
    SignalSetupError,
    choose_interval,
    daly_interval,
    flush_fits,
    flush_seconds,
    read_notice,
    start_pollers,
    write_notice,
)
from tests.fakes.metadata import FakeGceMetadata, FakeImds

pytestmark = pytest.mark.timeout(30)


def eventually(pred: Callable[[], bool], timeout: float = 3.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def notice(source: str = "stop", *, at: float = 100.0, deadline: float = 130.0) -> Notice:
    return Notice(source=source, reason="test", received_at=at, deadline=deadline)


@pytest.fixture
def saved_signals() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.calls.append(signum)


# --- the flag ---------------------------------------------------------------------------


def test_flag_keeps_the_first_notice_and_only_moves_the_deadline_earlier() -> None:
    flag = PreemptionFlag()
    assert not flag.is_set and flag.notice is None and flag.time_left() is None

    flag.set(notice("signal", at=100.0, deadline=130.0))
    flag.set(notice("aws", at=101.0, deadline=220.0))  # later deadline: ignored
    assert flag.notice == notice("signal", at=100.0, deadline=130.0)

    flag.set(notice("gcp", at=102.0, deadline=110.0))  # earlier deadline: taken
    merged = flag.notice
    assert merged is not None
    assert (merged.source, merged.received_at, merged.deadline) == ("signal", 100.0, 110.0)
    assert flag.is_set
    assert flag.time_left(now=104.0) == pytest.approx(6.0)
    assert flag.time_left(now=500.0) == 0.0


def test_notice_rejects_an_unknown_source() -> None:
    with pytest.raises(ValueError, match="azure"):
        notice("azure")


def test_wait_times_out_then_wakes_promptly_when_another_thread_sets() -> None:
    flag = PreemptionFlag()
    started = time.monotonic()
    assert flag.wait(0.1) is False
    assert time.monotonic() - started >= 0.09

    timer = threading.Timer(0.05, flag.set, args=(notice(),))
    timer.start()
    started = time.monotonic()
    assert flag.wait(5.0) is True
    assert time.monotonic() - started < 1.0
    timer.join()


# --- signals ----------------------------------------------------------------------------


def test_sigterm_sets_the_flag_and_the_original_handler_comes_back(saved_signals: None) -> None:
    original = Recorder()
    calls = original.calls
    signal.signal(signal.SIGTERM, original)
    flag = PreemptionFlag()
    threads_before = threading.active_count()

    with SignalHandlers(flag, window_s=30.0):
        assert signal.getsignal(signal.SIGTERM) is not original
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.wait(2.0)
        got = flag.notice
        assert got is not None
        assert (got.source, got.reason) == ("signal", "SIGTERM")
        assert got.deadline - got.received_at == pytest.approx(30.0)
        # The handler only recorded state: no original called, no thread, no exception.
        assert calls == []
        assert threading.active_count() == threads_before

    restored = signal.getsignal(signal.SIGTERM)
    assert restored is original
    os.kill(os.getpid(), signal.SIGTERM)
    assert eventually(lambda: calls == [signal.SIGTERM])


def test_a_signal_arriving_while_the_main_thread_waits_on_the_flag_does_not_deadlock(
    saved_signals: None,
) -> None:
    flag = PreemptionFlag()
    with SignalHandlers(flag, window_s=10.0):
        killer = threading.Timer(0.1, os.kill, args=(os.getpid(), signal.SIGTERM))
        killer.start()
        started = time.monotonic()
        assert flag.wait(5.0)
        assert time.monotonic() - started < 1.0
        killer.join()


def test_a_second_sigint_goes_to_the_original_handler(saved_signals: None) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    flag = PreemptionFlag()
    with SignalHandlers(flag, window_s=10.0):
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.wait(2.0)
        assert flag.notice is not None and flag.notice.reason == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(2.0)  # interrupted by the handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigint_after_sigterm_calls_a_custom_original_handler(saved_signals: None) -> None:
    original = Recorder()
    signal.signal(signal.SIGINT, original)
    flag = PreemptionFlag()
    with SignalHandlers(flag, window_s=10.0):
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.wait(2.0)
        os.kill(os.getpid(), signal.SIGINT)
        assert eventually(lambda: original.calls == [signal.SIGINT])
    assert flag.notice is not None and flag.notice.reason == "SIGTERM"


def test_installing_signal_handlers_off_the_main_thread_is_a_clear_error() -> None:
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            with SignalHandlers(PreemptionFlag(), window_s=1.0):
                pass
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=enter)
    worker.start()
    worker.join()
    assert len(errors) == 1
    assert isinstance(errors[0], SignalSetupError) and isinstance(errors[0], RunnerError)
    assert "main thread" in str(errors[0])


# --- AWS IMDSv2 -------------------------------------------------------------------------


def test_fake_imds_speaks_imdsv2() -> None:
    with FakeImds() as imds:
        put = urllib.request.Request(imds.url + "/latest/api/token", method="PUT")
        with pytest.raises(urllib.error.HTTPError) as no_ttl:
            urllib.request.urlopen(put, timeout=2)
        assert no_ttl.value.code == 400
        with pytest.raises(urllib.error.HTTPError) as no_token:
            urllib.request.urlopen(imds.url + "/latest/meta-data/spot/instance-action", timeout=2)
        assert no_token.value.code == 401


def test_aws_poller_sees_a_scheduled_interruption_and_takes_the_deadline_from_it() -> None:
    flag = PreemptionFlag()
    with FakeImds() as imds:
        poller = AwsSpotPoller(flag, base_url=imds.url, interval_s=0.05, window_s=120.0)
        poller.start()
        try:
            assert eventually(lambda: imds.action_gets >= 3)
            assert not flag.is_set

            at = float(int(time.time()) + 100)
            imds.schedule_interruption("terminate", at)
            scheduled = time.monotonic()
            assert flag.wait(2.0)
            assert time.monotonic() - scheduled < 1.0
            expected_deadline = time.monotonic() + (at - time.time())
        finally:
            poller.stop()
        got = flag.notice
        assert got is not None and got.source == "aws"
        assert "terminate" in got.reason and "Z" in got.reason
        assert got.deadline == pytest.approx(expected_deadline, abs=1.0)
        assert imds.gets_without_token == 0
        assert imds.token_puts == 1
        assert eventually(lambda: not poller.running)  # done once a notice is seen


def test_aws_unreadable_notice_time_falls_back_to_the_window() -> None:
    flag = PreemptionFlag()
    with FakeImds() as imds:
        imds.schedule_interruption("stop", "next tuesday")
        poller = AwsSpotPoller(flag, base_url=imds.url, interval_s=0.05, window_s=42.0)
        poller.start()
        try:
            assert flag.wait(2.0)
        finally:
            poller.stop()
    got = flag.notice
    assert got is not None and "stop" in got.reason
    assert got.deadline - got.received_at == pytest.approx(42.0)


def test_aws_poller_gets_a_new_token_after_a_401() -> None:
    flag = PreemptionFlag()
    with FakeImds() as imds:
        poller = AwsSpotPoller(flag, base_url=imds.url, interval_s=0.05)
        poller.start()
        try:
            assert eventually(lambda: imds.action_gets >= 2)
            imds.expire_tokens()
            assert eventually(lambda: imds.token_puts >= 2)
            imds.schedule_interruption("terminate", time.time() + 60)
            assert flag.wait(2.0)
        finally:
            poller.stop()
        assert imds.unauthorized >= 1
        assert imds.gets_without_token == 0


def test_aws_poller_renews_its_token_before_the_ttl_runs_out() -> None:
    flag = PreemptionFlag()
    with FakeImds() as imds:
        poller = AwsSpotPoller(flag, base_url=imds.url, interval_s=0.05, token_ttl_s=1)
        poller.start()
        try:
            assert eventually(lambda: imds.token_puts >= 2, timeout=3.0)
        finally:
            poller.stop()
        assert imds.unauthorized == 0
        assert not flag.is_set


def test_aws_poller_keeps_polling_through_server_errors() -> None:
    flag = PreemptionFlag()
    with FakeImds() as imds:
        imds.fail_next(5, status=500)
        imds.schedule_interruption("terminate", time.time() + 60)
        poller = AwsSpotPoller(flag, base_url=imds.url, interval_s=0.02)
        poller.start()
        try:
            assert flag.wait(3.0)
        finally:
            poller.stop()
        assert sum(1 for s in imds.seen if s.status == 500) == 5


def test_aws_poller_survives_an_unreachable_server_and_stops_promptly() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    flag = PreemptionFlag()
    poller = AwsSpotPoller(
        flag, base_url=f"http://127.0.0.1:{port}", interval_s=0.02, timeout_s=0.5
    )
    poller.start()
    time.sleep(0.2)
    assert poller.running and not flag.is_set
    started = time.monotonic()
    poller.stop()
    assert time.monotonic() - started < 1.0
    assert not poller.running


def test_aws_poller_stop_does_not_wait_out_the_interval() -> None:
    with FakeImds() as imds:
        poller = AwsSpotPoller(PreemptionFlag(), base_url=imds.url, interval_s=30.0)
        poller.start()
        assert eventually(lambda: imds.action_gets >= 1)
        started = time.monotonic()
        poller.stop()
        assert time.monotonic() - started < 0.5
        assert not poller.running


# --- GCE metadata -----------------------------------------------------------------------


def test_fake_gce_metadata_requires_the_flavor_header() -> None:
    with FakeGceMetadata() as gce:
        url = gce.url + "/computeMetadata/v1/instance/preempted"
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(url, timeout=2)
        assert missing.value.code == 403
        req = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(req, timeout=2) as resp:
            assert resp.read() == b"FALSE" and resp.headers["ETag"]


def test_gcp_poller_sees_preemption_promptly_through_a_long_poll() -> None:
    flag = PreemptionFlag()
    with FakeGceMetadata() as gce:
        poller = GcpPreemptedPoller(flag, base_url=gce.url, window_s=25.0, timeout_s=10.0)
        poller.start()
        try:
            assert gce.wait_pending(1)
            first_etag = gce._etag
            preempted_at = time.monotonic()
            gce.preempt()
            assert flag.wait(2.0)
            assert time.monotonic() - preempted_at < 0.5
        finally:
            poller.stop()
        got = flag.notice
        assert got is not None and got.source == "gcp"
        assert got.deadline - got.received_at == pytest.approx(25.0)
        paths = [s.path for s in gce.seen]
        assert "wait_for_change" not in paths[0]  # the current value first
        assert "wait_for_change=true" in paths[1] and f"last_etag={first_etag}" in paths[1]
        assert "timeout_sec=10" in paths[1]
        assert gce.forbidden == 0


def test_gcp_poller_stop_returns_promptly_while_a_long_poll_is_pending() -> None:
    with FakeGceMetadata() as gce:
        poller = GcpPreemptedPoller(PreemptionFlag(), base_url=gce.url, timeout_s=30.0)
        poller.start()
        assert gce.wait_pending(1)
        started = time.monotonic()
        poller.stop()
        assert time.monotonic() - started < 0.5
        assert not poller.running


def test_gcp_poller_polls_again_when_a_long_poll_times_out() -> None:
    flag = PreemptionFlag()
    with FakeGceMetadata() as gce:
        poller = GcpPreemptedPoller(flag, base_url=gce.url, timeout_s=1.0)
        poller.start()
        try:
            assert eventually(lambda: len(gce.seen) >= 2 and gce.pending >= 1, timeout=4.0)
            assert not flag.is_set
            gce.preempt()
            assert flag.wait(2.0)
        finally:
            poller.stop()
        assert all("timeout_sec=1" in s.path for s in gce.seen[1:])


def test_gcp_poller_backs_off_and_retries_after_errors() -> None:
    flag = PreemptionFlag()
    with FakeGceMetadata() as gce:
        gce.fail_next(3, status=503)
        poller = GcpPreemptedPoller(flag, base_url=gce.url, retry_s=0.02)
        poller.start()
        try:
            assert gce.wait_pending(1)
            gce.preempt()
            assert flag.wait(2.0)
        finally:
            poller.stop()
        assert [s.status for s in gce.seen[:3]] == [503, 503, 503]


def test_gcp_poller_sees_an_instance_already_preempted_at_start() -> None:
    flag = PreemptionFlag()
    with FakeGceMetadata() as gce:
        gce.preempt()
        poller = GcpPreemptedPoller(flag, base_url=gce.url)
        poller.start()
        try:
            assert flag.wait(2.0)
        finally:
            poller.stop()


# --- start_pollers ----------------------------------------------------------------------


def test_start_pollers_rejects_an_unknown_source_clearly() -> None:
    with pytest.raises(PreemptionConfigError) as err:
        start_pollers(PreemptionFlag(), sources="aws,azure", env={})
    assert "'azure'" in str(err.value) and "aws" in str(err.value) and "gcp" in str(err.value)
    with pytest.raises(PreemptionConfigError, match="none"):
        start_pollers(PreemptionFlag(), sources="none,aws", env={})


# "signal": a provider whose notice is SIGTERM alone (``Capabilities.preemption_source``).
@pytest.mark.parametrize("sources", ["", "none", " None ", "signal"])
def test_start_pollers_starts_nothing_for_local_runs(sources: str) -> None:
    with start_pollers(PreemptionFlag(), sources=sources, env={}) as pollers:
        assert pollers.pollers == ()


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"TRAINBOT_TERMINATION_WINDOW_S": "soon"}, "TRAINBOT_TERMINATION_WINDOW_S"),
        ({"TRAINBOT_TERMINATION_WINDOW_S": "-5"}, "positive"),
        ({"TRAINBOT_AWS_METADATA_URL": "ftp://example"}, "http://"),
    ],
)
def test_start_pollers_rejects_bad_settings_before_starting(
    env: dict[str, str], needle: str
) -> None:
    threads_before = threading.active_count()
    with pytest.raises(PreemptionConfigError, match=needle):
        start_pollers(PreemptionFlag(), sources="aws", env=env)
    assert threading.active_count() == threads_before


def test_start_pollers_runs_both_clouds_from_the_environment() -> None:
    flag = PreemptionFlag()
    with FakeImds() as imds, FakeGceMetadata() as gce:
        env = {
            "TRAINBOT_AWS_METADATA_URL": imds.url,
            "TRAINBOT_GCP_METADATA_URL": gce.url,
            "TRAINBOT_TERMINATION_WINDOW_S": "7",
        }
        with start_pollers(flag, sources="aws, gcp", env=env) as pollers:
            aws, gcp = pollers.pollers
            assert isinstance(aws, AwsSpotPoller) and isinstance(gcp, GcpPreemptedPoller)
            assert eventually(lambda: imds.action_gets >= 1)
            assert gce.wait_pending(1)
            gce.preempt()
            assert flag.wait(2.0)
        assert not any(p.running for p in pollers.pollers)
    got = flag.notice
    assert got is not None and got.source == "gcp"
    assert got.deadline - got.received_at == pytest.approx(7.0)


# --- flush_fits -------------------------------------------------------------------------


def test_flush_fits_compares_the_estimated_write_time_with_the_time_left() -> None:
    # 1 GB at a measured 100 MB/s: 1.5 x 10 s = 15 s. The measured write already holds
    # the store's fixed costs, so no wall-clock overhead is added to it.
    assert flush_fits(nbytes=10**9, bandwidth_bps=1e8, time_left_s=15.0)
    assert not flush_fits(nbytes=10**9, bandwidth_bps=1e8, time_left_s=14.9)
    assert flush_fits(nbytes=10**9, bandwidth_bps=1e8, time_left_s=10.0, safety=1.0)
    assert flush_fits(nbytes=0, bandwidth_bps=1e8, time_left_s=0.0)
    # The measured snapshot before the write (a device-to-host copy) is kept back too.
    assert not flush_fits(nbytes=10**9, bandwidth_bps=1e8, time_left_s=15.0, stall_s=0.5)
    assert flush_fits(nbytes=10**9, bandwidth_bps=1e8, time_left_s=15.5, stall_s=0.5)


def test_the_flush_margin_scales_with_the_measured_write() -> None:
    """Nothing in a measured estimate is a wall-clock constant: a write 30 times shorter
    keeps a margin 30 times shorter (what a time-compressed run needs to be judged fairly,
    and what a small checkpoint needs to train on through a 30 s window)."""
    big = flush_seconds(10**9, 1e8, stall_s=0.6)
    small = flush_seconds(10**9 // 30, 1e8, stall_s=0.02)
    assert big == pytest.approx(15.6) and small == pytest.approx(big / 30)
    # Before any measurement the cautious guess holds a fixed second for the requests.
    assert flush_seconds(0, None) == 1.0
    assert flush_seconds(0, None, overhead_s=0.0) == 0.0


def test_flush_fits_without_a_bandwidth_or_a_deadline() -> None:
    assert flush_fits(nbytes=10**12, bandwidth_bps=None, time_left_s=None)
    # Unmeasured: the cautious assumed bandwidth decides.
    one_gib = 1 << 30
    needed = 1.0 + 1.5 * one_gib / ASSUMED_BANDWIDTH_BPS
    assert flush_fits(nbytes=one_gib, bandwidth_bps=None, time_left_s=needed + 0.1)
    assert not flush_fits(nbytes=one_gib, bandwidth_bps=None, time_left_s=needed - 0.1)
    assert not flush_fits(nbytes=one_gib, bandwidth_bps=0.0, time_left_s=30.0)
    assert flush_fits(nbytes=10**6, bandwidth_bps=None, time_left_s=30.0)
    with pytest.raises(ValueError, match="bytes"):
        flush_fits(nbytes=-1, bandwidth_bps=1e8, time_left_s=10.0)


def test_the_interval_is_daly_for_the_stall_and_the_preemptions_that_lose_work() -> None:
    # No usable notice: every preemption loses the work since the last checkpoint.
    every = choose_interval(write_s=10.0, stall_s=0.5, mtbp_s=600.0, flush_fits_window=False)
    assert every.cost_s == 0.5 and every.mtbp_s == 600.0 and every.floor_s == 10.0
    assert every.interval_s == pytest.approx(math.sqrt(2 * 0.5 * 600) - 0.5)
    # The emergency checkpoint fits: only the unannounced share loses work.
    fits = choose_interval(write_s=10.0, stall_s=0.5, mtbp_s=600.0, flush_fits_window=True)
    assert fits.mtbp_s == pytest.approx(600.0 / UNANNOUNCED_SHARE)
    assert fits.interval_s == pytest.approx(daly_interval(0.5, 600.0 / UNANNOUNCED_SHARE))
    # One save in flight: never shorter than a write.
    slow = choose_interval(write_s=60.0, stall_s=0.5, mtbp_s=600.0, flush_fits_window=False)
    assert slow.interval_s == 60.0
    # No stall measured (an older runner): the save is taken as blocking for its write.
    blocking = choose_interval(write_s=10.0, stall_s=None, mtbp_s=600.0, flush_fits_window=False)
    assert blocking.cost_s == 10.0 and blocking.interval_s == daly_interval(10.0, 600.0)


def test_bad_interval_inputs_are_refused_clearly() -> None:
    with pytest.raises(RunnerError, match="write time must be positive"):
        choose_interval(write_s=0.0, stall_s=0.1, mtbp_s=600.0, flush_fits_window=True)
    with pytest.raises(RunnerError, match="unannounced_share"):
        choose_interval(
            write_s=1.0, stall_s=0.1, mtbp_s=600.0, flush_fits_window=True, unannounced_share=0
        )
    with pytest.raises(RunnerError, match="positive checkpoint time and MTBP"):
        daly_interval(1.0, float("inf"))


# --- the notice a supervisor hands its child ---------------------------------------------


def test_a_relayed_notice_keeps_its_deadline_across_processes(tmp_path: Path) -> None:
    """The file carries the deadline in Unix time: the reader gets the time left that the
    writer had, on its own monotonic clock, and the source and reason."""
    path = tmp_path / "notice.json"
    assert read_notice(path) is None  # nothing yet: the signal's own deadline stands
    now = time.monotonic()
    write_notice(path, Notice("aws", "instance-action", received_at=now - 4, deadline=now + 7))
    got = read_notice(path)
    assert got is not None and got.source == "aws" and got.reason == "instance-action"
    assert got.deadline - time.monotonic() == pytest.approx(7.0, abs=0.5)
    flag = PreemptionFlag()
    flag.set(Notice("signal", "SIGTERM", received_at=now, deadline=now + 120))
    flag.set(got)  # the relayed deadline is earlier: it wins
    left = flag.time_left()
    assert left is not None and left < 8.0
    assert flag.notice is not None and flag.notice.source == "signal"


def test_an_unreadable_relayed_notice_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "notice.json"
    for text in ("{", '{"source": "aws"}', '{"source": "moon", "reason": "", "deadline_unix": 1}'):
        path.write_text(text)
        assert read_notice(path) is None

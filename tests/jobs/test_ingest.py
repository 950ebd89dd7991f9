"""The runner events API in process: auth, idempotency, side effects, alert rules.

Every test runs on SQLite and, when ``TRAINBOT_TEST_POSTGRES_URL`` is set, PostgreSQL.
Batches are real wire bodies from :func:`runner.wire.encode_batch`.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session
from sqlmodel import select as sm_select

from jobs.database.models import Attempt, Checkpoint, EventRow, MetricBlock, Run, hash_token
from jobs.domain.lifecycle import AttemptState
from jobs.ingest import RECENT_OBS, IngestService
from jobs.ingest.writers import time_texts
from jobs.providers.gang import node_token
from jobs.rules import DivergentLoss, Rule, Signal
from runner.wire import NODE_SEQ_SPAN, encode_batch
from runner.wire import Event as WireEvent

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
T0 = NOW.timestamp() - 600
TOKEN = "tok-attempt-1"


class Clock:
    """A settable ``now`` for the service."""

    def __init__(self, at: datetime = NOW) -> None:
        self.at = at

    def __call__(self) -> datetime:
        return self.at


class Recorder:
    """Collects what the service hands to its callbacks."""

    def __init__(self) -> None:
        self.signals: list[tuple[str, list[Signal], datetime]] = []
        self.attempt_events: list[tuple[str, str, dict[str, Any]]] = []

    def on_signals(self, run_id: str, signals: list[Signal], now: datetime) -> None:
        self.signals.append((run_id, signals, now))

    def on_attempt_event(self, attempt_id: str, type_: str, data: dict[str, Any]) -> None:
        self.attempt_events.append((attempt_id, type_, data))

    def last(self, rule: str, key: str) -> Signal | None:
        """The signal of the latest evaluation for (rule, key), if it said anything."""
        _, batch, _ = self.signals[-1]
        return next((s for s in batch if s.rule == rule and s.key == key), None)

    def fired(self, rule: str, key: str) -> list[Signal]:
        return [
            s
            for _, batch, _ in self.signals
            for s in batch
            if s.rule == rule and s.key == key and not s.resolved
        ]


def add_run(
    engine: Engine,
    *,
    run_id: str = "r-1",
    attempt_id: str = "a-1",
    token: str | None = TOKEN,
    state: AttemptState = AttemptState.REQUESTED,
    number: int = 1,
    spec: dict[str, Any] | None = None,
) -> None:
    with Session(engine) as session:
        if session.get(Run, run_id) is None:
            session.add(
                Run(id=run_id, spec_name="tiny", spec=spec or {}, requester="U1", budget_usd=5.0)
            )
            session.flush()
        session.add(
            Attempt(
                id=attempt_id,
                run_id=run_id,
                number=number,
                state=state,
                provider="local",
                token_hash=hash_token(token) if token else None,
            )
        )
        session.commit()


def metrics(
    step: int, loss: float = 1.0, *, step_time_s: float = 0.1
) -> tuple[str, dict[str, Any]]:
    return "metrics", {
        "step": step,
        "loss": loss,
        "step_time_s": step_time_s,
        "data_wait_fraction": 0.05,
        "metrics": {"lr": 0.001},
    }


def system(gpu_util: float | None = 90.0) -> tuple[str, dict[str, Any]]:
    return "system", {
        "gpu_util": gpu_util,
        "gpu_count": 1,
        "disk_used": 10**9,
        "disk_total": 10**11,
        "disk_path": "/scratch",
    }


def body(
    items: Sequence[tuple[str, dict[str, Any]]],
    *,
    first_seq: int = 0,
    attempt: str = "a-1",
    run: str = "r-1",
    times: Sequence[float] | None = None,
    checked: bool = True,
) -> bytes:
    events = [
        WireEvent(
            attempt,
            first_seq + i,
            kind,
            times[i] if times is not None else T0 + first_seq + i,
            run,
            data,
        )
        for i, (kind, data) in enumerate(items)
    ]
    return encode_batch(events) if checked else unchecked(events)


def unchecked(events: Sequence[WireEvent]) -> bytes:
    """A body as encode_batch lays it out, without its checks: what a broken or
    mismatched runner could send."""
    first = events[0]
    items = [{"seq": e.seq, "type": e.type, "time": e.time, "data": e.data} for e in events]
    return json.dumps(
        {"v": 1, "attempt": first.attempt, "run": first.run, "events": items}
    ).encode()


def service(engine: Engine, recorder: Recorder | None = None, **kwargs: Any) -> IngestService:
    recorder = recorder or Recorder()
    kwargs.setdefault("now", Clock())
    kwargs.setdefault("attempt_token", {"a-1": TOKEN}.__getitem__)
    return IngestService(
        engine,
        on_signals=recorder.on_signals,
        on_attempt_event=recorder.on_attempt_event,
        **kwargs,
    )


@dataclass(frozen=True)
class Stored:
    """An event as the tables hold it: a row of ``events``, or a point of a metrics block
    (whose unix time is shown as a row's would be)."""

    seq: int
    type: str
    time: datetime
    data: dict[str, Any]


def stored_events(engine: Engine) -> list[Stored]:
    """Every stored event, rows and block points, in seq order."""
    with Session(engine) as session:
        found = [Stored(e.seq, e.type, e.time, e.data) for e in session.exec(sm_select(EventRow))]
        for block in session.exec(sm_select(MetricBlock)):
            assert block.count == len(block.seqs) == len(block.times) == len(block.data)
            assert (block.first_seq, block.last_seq) == (block.seqs[0], block.seqs[-1])
            found += [
                Stored(seq, "metrics", EPOCH + timedelta(seconds=time), data)
                for seq, time, data in zip(block.seqs, block.times, block.data, strict=True)
            ]
    return sorted(found, key=lambda e: e.seq)


def count_events(engine: Engine) -> int:
    events = stored_events(engine)
    assert len({e.seq for e in events}) == len(events), "a seq is stored twice"
    return len(events)


def event_at(engine: Engine, seq: int) -> Stored:
    (found,) = [e for e in stored_events(engine) if e.seq == seq]
    return found


def attempt_row(engine: Engine, attempt_id: str = "a-1") -> Attempt:
    with Session(engine) as session:
        attempt = session.get(Attempt, attempt_id)
        assert attempt is not None
        return attempt


def run_row(engine: Engine, run_id: str = "r-1") -> Run:
    with Session(engine) as session:
        run = session.get(Run, run_id)
        assert run is not None
        return run


AUTH = f"Bearer {TOKEN}"


def node_auth(node: int) -> str:
    """Node ``node``'s own bearer (each node of attempt a-1 sends with its own token)."""
    return f"Bearer {node_token(TOKEN, 'a-1', node)}"


# --- idempotency ----------------------------------------------------------------------


def test_a_batch_is_stored_once_and_a_retry_counts_as_duplicates(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    batch = body([metrics(i) for i in range(50)])

    first = svc.handle(AUTH, batch)
    retry = svc.handle(AUTH, batch)

    assert (first.status, first.body) == (200, {"accepted": 50, "duplicates": 0})
    assert (retry.status, retry.body) == (200, {"accepted": 0, "duplicates": 50})
    assert count_events(db_engine) == 50
    stored = event_at(db_engine, 7)
    assert stored.type == "metrics" and stored.data["step"] == 7
    assert stored.time == datetime.fromtimestamp(T0 + 7, tz=timezone.utc)


def test_overlapping_batches_store_only_the_new_events(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    svc.handle(AUTH, body([metrics(i) for i in range(10)]))

    overlap = svc.handle(AUTH, body([metrics(i) for i in range(5, 15)], first_seq=5))

    assert overlap.body == {"accepted": 5, "duplicates": 5}
    assert count_events(db_engine) == 15
    assert attempt_row(db_engine).last_seq == 14


def test_a_seq_repeated_inside_one_batch_is_stored_once(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    events = [
        WireEvent("a-1", seq, "metrics", T0 + i, "r-1", metrics(i)[1])
        for i, seq in enumerate([0, 1, 1, 2])
    ]

    result = svc.handle(AUTH, encode_batch(events))

    assert result.body == {"accepted": 3, "duplicates": 1}
    assert count_events(db_engine) == 3


def test_side_effects_happen_once_even_when_a_batch_is_retried(db_engine: Engine) -> None:
    add_run(db_engine)
    clock = Clock()
    recorder = Recorder()
    svc = service(db_engine, recorder, now=clock)
    # A NaN loss: the stream's divergence rule has something to say about this batch.
    batch = body([("started", {"pid": 7, "host": "h"}), metrics(3, loss=float("nan"))])
    svc.handle(AUTH, batch)
    assert len(recorder.signals) == 1
    clock.at = NOW + timedelta(minutes=5)

    svc.handle(AUTH, batch)

    assert attempt_row(db_engine).last_heartbeat == NOW
    assert [t for _, t, _ in recorder.attempt_events] == ["started"]
    assert len(recorder.signals) == 1  # rules run only for batches with new events


# --- tokens -----------------------------------------------------------------------------


def test_missing_or_unknown_tokens_get_401(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    refused = [None, "", "Bearer", "Basic dXNlcjpwYXNz", "Bearer not-a-token", f"Token {TOKEN}"]

    results = [svc.handle(authorization, body([metrics(0)])) for authorization in refused]

    assert [r.status for r in results] == [401] * len(refused)
    assert all(r.body["error"] for r in results)
    assert count_events(db_engine) == 0


def test_a_revoked_token_is_refused_at_once_despite_the_cache(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    assert svc.handle(AUTH, body([metrics(0)])).status == 200  # the token is now cached
    with db_engine.begin() as connection:
        connection.execute(text("UPDATE attempts SET token_hash = NULL WHERE id = 'a-1'"))

    refused = svc.handle(AUTH, body([metrics(1)], first_seq=1))

    assert refused.status == 401
    assert "revoked" in refused.body["error"]
    assert count_events(db_engine) == 1
    assert attempt_row(db_engine).last_seq == 0


def test_a_token_is_scoped_to_its_attempt(db_engine: Engine) -> None:
    add_run(db_engine)
    add_run(db_engine, attempt_id="a-2", token="tok-attempt-2", number=2)
    svc = service(db_engine)

    other_attempt = svc.handle(AUTH, body([metrics(0)], attempt="a-2"))
    other_run = svc.handle(AUTH, body([metrics(0)], run="r-other"))

    assert other_attempt.status == 403
    assert "scoped to its attempt" in other_attempt.body["error"]
    assert "a-1" in other_attempt.body["error"] and "a-2" in other_attempt.body["error"]
    assert other_run.status == 403
    assert count_events(db_engine) == 0


def test_the_token_is_never_logged(db_engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    with caplog.at_level("DEBUG"):
        svc.handle(AUTH, body([metrics(0)]))
        svc.handle(AUTH, b"{broken")
        svc.handle("Bearer wrong-token-value", body([metrics(0)]))

    assert TOKEN not in caplog.text
    assert "wrong-token-value" not in caplog.text


# --- malformed input ----------------------------------------------------------------------


MALFORMED = [
    (b"{not json", "not valid JSON"),
    (b"[]", "expected a JSON object"),
    (json.dumps({"v": 99, "attempt": "a-1", "run": "r-1", "events": []}).encode(), "v:"),
    (
        json.dumps(
            {
                "v": 1,
                "attempt": "a-1",
                "run": "r-1",
                "events": [{"seq": 0, "type": "metrics", "time": T0, "data": {"step": -1}}],
            }
        ).encode(),
        "events[0].data",
    ),
    (
        json.dumps(
            {
                "v": 1,
                "attempt": "a-1",
                "run": "r-1",
                "events": [{"seq": 2**63, "type": "heartbeat", "time": T0, "data": {"step": 1}}],
            }
        ).encode(),
        "events[0].seq",
    ),
    (
        json.dumps(
            {
                "v": 1,
                "attempt": "a-1",
                "run": "r-1",
                "events": [{"seq": 0, "type": "heartbeat", "time": 1e20, "data": {"step": 1}}],
            }
        ).encode(),
        "events[0].time",
    ),
]


def test_malformed_batches_get_400_and_change_nothing(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = service(db_engine)

    results = [(svc.handle(AUTH, raw), expected) for raw, expected in MALFORMED]

    for result, expected in results:
        assert result.status == 400
        assert expected in result.body["error"]
    assert count_events(db_engine) == 0
    assert attempt_row(db_engine).last_heartbeat is None
    assert svc.handle(AUTH, body([metrics(0)])).status == 200  # and the next batch is fine


def test_an_oversized_body_gets_413(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = service(db_engine, max_body_bytes=1000)

    result = svc.handle(AUTH, body([metrics(i) for i in range(50)]))

    assert result.status == 413
    assert "limit" in result.body["error"]
    assert count_events(db_engine) == 0


def test_a_database_failure_is_503_and_leaves_nothing_half_written(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    with db_engine.begin() as connection:
        connection.execute(text("DROP TABLE checkpoints"))
    batch = body(
        [
            metrics(10),
            ("checkpoint_committed", {"step": 10, "bytes": 1, "write_s": 0.1, "uri": "u"}),
        ]
    )

    result = svc.handle(AUTH, batch)

    assert result.status == 503
    assert count_events(db_engine) == 0
    assert attempt_row(db_engine).last_step is None


@pytest.mark.parametrize("table", ["events", "metric_blocks"])
def test_a_failing_events_insert_is_503_and_stores_nothing(db_engine: Engine, table: str) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    with db_engine.begin() as connection:
        if db_engine.dialect.name == "postgresql":
            connection.execute(
                text(
                    "CREATE FUNCTION no_room() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN RAISE EXCEPTION 'no room for events'; END $$"
                )
            )
            connection.execute(
                text(
                    f"CREATE TRIGGER no_room BEFORE INSERT ON {table} "
                    "FOR EACH ROW EXECUTE FUNCTION no_room()"
                )
            )
        else:
            connection.execute(
                text(
                    f"CREATE TRIGGER no_room BEFORE INSERT ON {table} "
                    "BEGIN SELECT RAISE(ABORT, 'no room for events'); END"
                )
            )
    # Rows and a block in one batch: whichever insert fails, neither is kept.
    items = [system() if i % 100 == 0 else metrics(i) for i in range(300)]

    result = svc.handle(AUTH, body(items))

    assert result.status == 503
    assert "not stored" in result.body["error"]
    assert count_events(db_engine) == 0
    assert attempt_row(db_engine).last_seq is None


def test_references_are_checked_again_once_a_batch_is_stored(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    assert svc.handle(AUTH, body([metrics(0)])).status == 200
    assert svc.handle("Bearer wrong", body([metrics(1)])).status == 401
    stray = text(
        "INSERT INTO events (attempt_id, run_id, seq, type, time, data, received_at) "
        "VALUES ('a-nobody', 'r-nobody', 1, 'metrics', :at, '{}', :at)"
    )

    with pytest.raises(IntegrityError), db_engine.begin() as connection:
        connection.execute(stray, {"at": NOW})

    if db_engine.dialect.name == "sqlite":
        with db_engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1


@pytest.mark.parametrize("size", [1, 3, 129, 255, 500, 1001])
def test_batches_of_any_size_store_every_event_once(db_engine: Engine, size: int) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    items = [system() if i % 7 == 3 else metrics(i) for i in range(size)]

    first = svc.handle(AUTH, body(items))
    overlap = svc.handle(AUTH, body([*items[size // 2 :], metrics(size)], first_seq=size // 2))

    assert first.body == {"accepted": size, "duplicates": 0}
    assert overlap.body == {"accepted": 1, "duplicates": size - size // 2}
    rows = [(e.seq, e.type) for e in stored_events(db_engine)]
    assert rows == [
        (i, "system" if i % 7 == 3 and i < size else "metrics") for i in range(size + 1)
    ]
    assert attempt_row(db_engine).last_seq == size


# --- side effects -----------------------------------------------------------------------


def test_started_moves_a_booting_attempt_to_running(db_engine: Engine) -> None:
    add_run(db_engine, state=AttemptState.REQUESTED)
    add_run(db_engine, attempt_id="a-2", token="t2", number=2, state=AttemptState.PROVISIONING)
    svc = service(db_engine)

    svc.handle(AUTH, body([("started", {"pid": 1, "host": "h"})]))
    svc.handle("Bearer t2", body([("started", {"pid": 1, "host": "h"})], attempt="a-2"))

    for attempt in (attempt_row(db_engine), attempt_row(db_engine, "a-2")):
        assert attempt.state == AttemptState.RUNNING
        assert attempt.started_at == datetime.fromtimestamp(T0, tz=timezone.utc)


def test_started_leaves_a_running_or_ended_attempt_as_it_is(db_engine: Engine) -> None:
    add_run(db_engine, state=AttemptState.RUNNING)
    add_run(db_engine, attempt_id="a-2", token="t2", number=2, state=AttemptState.PREEMPTED)
    svc = service(db_engine)

    running = svc.handle(AUTH, body([("started", {"pid": 1, "host": "h"})]))
    ended = svc.handle("Bearer t2", body([("started", {"pid": 1, "host": "h"})], attempt="a-2"))

    assert running.status == ended.status == 200
    assert attempt_row(db_engine).state == AttemptState.RUNNING
    assert attempt_row(db_engine, "a-2").state == AttemptState.PREEMPTED


def test_events_update_the_attempt_and_the_run(db_engine: Engine) -> None:
    add_run(db_engine, state=AttemptState.RUNNING)
    svc = service(db_engine)
    items = [
        ("restored", {"step": 100, "fallback_from": None, "restore_s": 1.5}),
        metrics(101, step_time_s=0.2),
        metrics(102, step_time_s=0.4),
        metrics(103, step_time_s=0.3),
        (
            "checkpoint_committed",
            {"step": 103, "bytes": 3_000_000, "write_s": 2.0, "uri": "s3://b/r-1/step-103"},
        ),
        ("heartbeat", {"step": 104}),
        ("preemption_notice", {"source": "aws", "time_left_s": 120.0}),
    ]

    result = svc.handle(AUTH, body(items))

    assert result.body == {"accepted": 7, "duplicates": 0}
    attempt = attempt_row(db_engine)
    assert attempt.last_heartbeat == NOW
    assert attempt.last_step == 104
    assert attempt.last_seq == 6
    assert attempt.step_time_s == pytest.approx(0.3)
    assert attempt.resumed_from_step == 100
    assert attempt.preemption_notice_at == datetime.fromtimestamp(T0 + 6, tz=timezone.utc)
    run = run_row(db_engine)
    assert run.last_step == 104
    assert run.last_committed_step == 103
    with Session(db_engine) as session:
        (checkpoint,) = session.exec(sm_select(Checkpoint)).all()
    assert (checkpoint.run_id, checkpoint.attempt_id, checkpoint.step) == ("r-1", "a-1", 103)
    assert checkpoint.uri == "s3://b/r-1/step-103"
    assert checkpoint.bytes == 3_000_000
    assert checkpoint.committed_at == datetime.fromtimestamp(T0 + 4, tz=timezone.utc)
    assert checkpoint.metrics == {"lr": 0.001, "loss": 1.0}


def test_run_steps_only_move_forward(db_engine: Engine) -> None:
    add_run(db_engine, state=AttemptState.RUNNING)
    add_run(db_engine, attempt_id="a-2", token="t2", number=2, state=AttemptState.RUNNING)
    svc = service(db_engine)
    commit = {"bytes": 1, "write_s": 0.1, "uri": "u"}
    svc.handle(AUTH, body([metrics(500), ("checkpoint_committed", {"step": 500, **commit})]))

    svc.handle(
        "Bearer t2",
        body([metrics(200), ("checkpoint_committed", {"step": 200, **commit})], attempt="a-2"),
    )

    run = run_row(db_engine)
    assert (run.last_step, run.last_committed_step) == (500, 500)
    assert attempt_row(db_engine, "a-2").last_step == 200


def test_lifecycle_events_reach_the_service_layer_once_and_in_order(db_engine: Engine) -> None:
    add_run(db_engine)
    recorder = Recorder()
    svc = service(db_engine, recorder)
    items = [
        ("started", {"pid": 1, "host": "h"}),
        metrics(1),
        ("log", {"level": "info", "message": "hello"}),
        ("log", {"level": "warning", "message": "nothing was synced"}),
        ("exit", {"code": 75, "reason": "preempted"}),
    ]

    svc.handle(AUTH, body(items))
    svc.handle(AUTH, body(items))

    # Info lines stay in the table; a runner's warning is for the people on the run.
    assert [(a, t) for a, t, _ in recorder.attempt_events] == [
        ("a-1", "started"),
        ("a-1", "log"),
        ("a-1", "exit"),
    ]
    assert recorder.attempt_events[1][2]["message"] == "nothing was synced"
    assert recorder.attempt_events[2][2] == {
        "code": 75,
        "reason": "preempted",
        "flush": None,
        "log_tail": None,
    }


def test_failing_callbacks_never_fail_the_batch(db_engine: Engine) -> None:
    add_run(db_engine)

    def broken(*args: Any) -> None:
        raise RuntimeError("service layer bug")

    svc = IngestService(db_engine, on_signals=broken, on_attempt_event=broken, now=Clock())

    result = svc.handle(AUTH, body([("started", {"pid": 1, "host": "h"}), metrics(1, math.nan)]))

    assert result.status == 200
    assert count_events(db_engine) == 2


# --- alert rules ---------------------------------------------------------------------------


def test_a_nan_loss_fires_within_the_same_call(db_engine: Engine) -> None:
    add_run(db_engine)
    recorder = Recorder()
    svc = service(db_engine, recorder)

    svc.handle(AUTH, body([metrics(1, 2.0), metrics(2, math.nan), metrics(3, 2.0)]))

    (nan,) = recorder.fired("divergent_loss", "nan")
    assert nan.data["step"] == 2
    run_id, _, now = recorder.signals[-1]
    assert (run_id, now) == ("r-1", NOW)
    stored = event_at(db_engine, 1)
    assert stored.data["loss"] == "NaN"  # standard JSON in the table, on both databases


def test_rules_are_evaluated_once_per_batch(db_engine: Engine) -> None:
    add_run(db_engine)
    calls: list[int] = []

    class Counting:
        name = "counting"

        def evaluate(self, window: Sequence[Any], *, now: float, ctx: Any) -> list[Signal]:
            calls.append(len(window))
            return []

    svc = service(db_engine, rules_for=lambda run: [Counting()])
    svc.handle(AUTH, body([metrics(i) for i in range(100)]))
    svc.handle(AUTH, body([metrics(i) for i in range(100, 150)], first_seq=100))

    assert calls == [100, 150]


def test_rules_for_gets_the_run_and_its_rules_are_used(db_engine: Engine) -> None:
    add_run(db_engine)
    seen: list[str] = []
    recorder = Recorder()

    def rules_for(run: Run) -> list[Rule]:
        seen.append(run.id)
        return [DivergentLoss()]

    svc = service(db_engine, recorder, rules_for=rules_for)
    svc.handle(AUTH, body([metrics(1, math.inf)]))
    svc.handle(AUTH, body([metrics(2, 1.0)], first_seq=1))

    assert seen == ["r-1"]  # built once with the window, then reused
    assert {s.rule for _, batch, _ in recorder.signals for s in batch} == {"divergent_loss"}


def test_the_spec_thresholds_configure_the_default_rules(db_engine: Engine) -> None:
    add_run(db_engine, spec={"alerts": {"loss_spike_factor": 1.5, "loss_spike_points": 1}})
    recorder = Recorder()
    svc = service(db_engine, recorder)

    svc.handle(AUTH, body([metrics(i, 1.0) for i in range(10)] + [metrics(10, 2.0)]))

    (spike,) = recorder.fired("divergent_loss", "spike")
    assert spike.data["step"] == 10


def test_the_window_is_rebuilt_from_the_table_after_a_restart(db_engine: Engine) -> None:
    add_run(db_engine)
    service(db_engine).handle(AUTH, body([metrics(i, 1.0) for i in range(20)]))

    recorder = Recorder()  # a new process: nothing in memory
    service(db_engine, recorder).handle(
        AUTH, body([metrics(i, 10.0) for i in range(20, 23)], first_seq=20)
    )

    (spike,) = recorder.fired("divergent_loss", "spike")
    assert spike.data["baseline"] == 1.0


def test_system_samples_are_not_crowded_out_by_a_flood_of_metrics(db_engine: Engine) -> None:
    add_run(db_engine)
    recorder = Recorder()
    svc = service(db_engine, recorder)
    start = NOW.timestamp() - 300
    seq = 0
    for minute in range(6):  # 6 minutes of 1,000 metrics and one idle-GPU sample each
        items = [system(gpu_util=5.0)] + [metrics(seq + i) for i in range(1, 1000)]
        times = [start + minute * 60 + i * 0.06 for i in range(1000)]
        assert svc.handle(AUTH, body(items, first_seq=seq, times=times)).status == 200
        seq += 1000

    low = recorder.last("low_utilisation", "gpu")
    assert low is not None and not low.resolved
    assert low.data["gpu_util"] == 5.0
    assert count_events(db_engine) == 6000


def test_a_nan_is_not_thinned_out_of_the_window(db_engine: Engine) -> None:
    add_run(db_engine)
    recorder = Recorder()
    svc = service(db_engine, recorder)
    svc.handle(AUTH, body([metrics(0, math.nan)]))
    later = [metrics(i, 1.0) for i in range(1, 3 * RECENT_OBS)]

    svc.handle(
        AUTH, body(later, first_seq=1, times=[T0 + i * 0.01 for i in range(1, 3 * RECENT_OBS)])
    )

    assert len(recorder.fired("divergent_loss", "nan")) == 2


# --- wide integers, exact times, stored data -------------------------------------------


def test_steps_seqs_and_sizes_past_32_bits_are_stored_as_they_are(db_engine: Engine) -> None:
    add_run(db_engine, state=AttemptState.RUNNING)
    svc = service(db_engine)
    # The top of node 0's seq range (past 32 bits; node 1's range starts just above).
    step, three_gib, seq = 3_000_000_000, 3 * 2**30, NODE_SEQ_SPAN - 3
    items = [
        ("restored", {"step": step - 10, "fallback_from": None, "restore_s": 1.0}),
        metrics(step),
        ("checkpoint_committed", {"step": step, "bytes": three_gib, "write_s": 9.0, "uri": "u"}),
    ]

    result = svc.handle(AUTH, body(items, first_seq=seq, times=[T0, T0 + 1, T0 + 2]))

    assert result.body == {"accepted": 3, "duplicates": 0}
    attempt = attempt_row(db_engine)
    assert (attempt.last_seq, attempt.last_step) == (seq + 2, step)
    assert attempt.resumed_from_step == step - 10
    run = run_row(db_engine)
    assert (run.last_step, run.last_committed_step) == (step, step)
    with Session(db_engine) as session:
        (checkpoint,) = session.exec(sm_select(Checkpoint)).all()
    assert (checkpoint.step, checkpoint.bytes) == (step, three_gib)
    assert event_at(db_engine, seq + 1).data["step"] == step


@pytest.mark.parametrize(
    ("item", "where"),
    [
        (("heartbeat", {"step": 2**63}), "events[0].data.step: 9223372036854775808 is above"),
        (
            ("checkpoint_committed", {"step": 1, "bytes": 2**64, "write_s": 1.0, "uri": "u"}),
            "events[0].data.bytes:",
        ),
    ],
)
def test_integers_past_64_bits_get_400(
    db_engine: Engine, item: tuple[str, dict[str, Any]], where: str
) -> None:
    add_run(db_engine)
    svc = service(db_engine)

    result = svc.handle(AUTH, body([item], checked=False))

    assert result.status == 400
    assert result.body["error"].startswith(where)
    assert count_events(db_engine) == 0


def test_a_range_error_names_the_first_offender_of_a_large_batch(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    items = [metrics(i) for i in range(300)]
    items[40] = system()
    items[120] = ("checkpoint_committed", {"step": 1, "bytes": 2**63, "write_s": 1.0, "uri": "u"})
    items[200] = metrics(2**64)
    events = [
        WireEvent("a-1", 2**63 if i == 250 else i, kind, T0 + i, "r-1", data)
        for i, (kind, data) in enumerate(items)
    ]

    first = svc.handle(AUTH, unchecked(events))
    second = svc.handle(AUTH, unchecked(events[121:]))
    third = svc.handle(AUTH, unchecked(events[201:]))

    assert first.status == second.status == third.status == 400
    assert first.body["error"].startswith(f"events[120].data.bytes: {2**63} is above")
    assert second.body["error"].startswith(f"events[79].data.step: {2**64} is above")
    assert third.body["error"].startswith(f"events[49].seq: {2**63} is above")
    assert count_events(db_engine) == 0


def test_extra_fields_keep_big_integers_and_any_text(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    kind, data = metrics(0)
    extra = {**data, "note": 10**30, "tokens": 2**63 + 5, "unit": "µs ✓ \u2028"}
    log = {"level": "info", "message": "ünïcödé 'quoted' \\ back\\slash \"q\" \t tab"}

    result = svc.handle(AUTH, body([(kind, extra), ("log", log)]))

    assert result.body == {"accepted": 2, "duplicates": 0}
    assert event_at(db_engine, 0).data == extra
    assert event_at(db_engine, 1).data == log


def test_event_times_keep_their_microseconds(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    whole = float(int(T0))
    times = [whole, whole + 0.5e-6, whole + 1.5e-6, whole + 0.9999996, whole + 1.000001, 0.25]
    epoch = datetime(1970, 1, 1, tzinfo=timezone.utc)
    beats = [("heartbeat", {"step": i}) for i in range(len(times))]

    svc.handle(AUTH, body(beats + [metrics(i) for i in range(len(times))], times=times + times))

    for seq, seconds in enumerate(times + times):
        assert event_at(db_engine, seq).time == epoch + timedelta(seconds=seconds)
    with Session(db_engine) as session:  # a block keeps the unix time exactly as sent
        assert session.exec(sm_select(MetricBlock)).one().times == times


def test_time_texts_are_what_sqlalchemy_writes_for_a_datetime() -> None:
    rng = random.Random(7)
    samples = [rng.uniform(0, 4e9) for _ in range(3000)]
    samples += [int(s * 1e6) / 1e6 + 5e-7 for s in samples[:1000]]  # near half a microsecond
    samples += [float(s) + f for s in range(1_700_000_000, 1_700_000_040) for f in (0.0, 1 - 1e-7)]
    naive_epoch = datetime(1970, 1, 1)

    texts = time_texts(samples)

    assert texts == [
        (naive_epoch + timedelta(seconds=s)).isoformat(" ", "microseconds") for s in samples
    ]
    assert time_texts([1.0], suffix="+00:00") == ["1970-01-01 00:00:01.000000+00:00"]


def test_stored_data_matches_each_event_when_a_retry_overlaps(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    svc.handle(AUTH, body([metrics(i, loss=float(i)) for i in range(0, 6)]))

    svc.handle(AUTH, body([metrics(i, loss=float(i)) for i in range(3, 10)], first_seq=3))

    for seq in range(10):
        stored = event_at(db_engine, seq).data
        assert (stored["step"], stored["loss"]) == (seq, float(seq))


def test_a_body_in_another_layout_is_stored_the_same(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    compact = body([metrics(0, math.nan), system(), ("log", {"level": "info", "message": "NaN"})])
    pretty = json.dumps(json.loads(compact), indent=1).encode()

    assert svc.handle(AUTH, pretty).body == {"accepted": 3, "duplicates": 0}

    assert event_at(db_engine, 0).data == {**json.loads(compact)["events"][0]["data"]}
    assert event_at(db_engine, 0).data["loss"] == "NaN"
    assert event_at(db_engine, 2).data == {"level": "info", "message": "NaN"}


def test_a_nan_in_the_thinned_part_of_a_large_batch_still_fires(db_engine: Engine) -> None:
    add_run(db_engine)
    recorder = Recorder()
    svc = service(db_engine, recorder)
    svc.handle(AUTH, body([metrics(i, 1.0) for i in range(10)]))
    losses = [math.nan if i == 5 else 1.0 for i in range(3 * RECENT_OBS)]
    times = [T0 + 10 + i * 0.01 for i in range(len(losses))]  # one thinning bucket

    svc.handle(
        AUTH, body([metrics(10 + i, x) for i, x in enumerate(losses)], first_seq=10, times=times)
    )
    svc.handle(AUTH, body([metrics(i, 1.0) for i in range(1000, 1010)], first_seq=1000))

    nan = recorder.fired("divergent_loss", "nan")
    assert len(nan) == 2  # the second batch and the third: the NaN stayed in the window
    assert {s.data["step"] for s in nan} == {15}


def _profiled(engine: Engine, **window: Any) -> list[str]:
    """An attempt with a profile window, and the list its due projections go to."""
    add_run(engine, state=AttemptState.RUNNING)
    with Session(engine) as session:
        attempt = session.get(Attempt, "a-1")
        assert attempt is not None
        attempt.started_at = datetime.fromtimestamp(T0, timezone.utc)
        for name, value in window.items():
            setattr(attempt, name, value)
        session.add(attempt)
        session.commit()
    return []


def test_the_end_of_a_profile_window_is_told_once(db_engine: Engine) -> None:
    due = _profiled(db_engine, profile_until_step=20)
    svc = service(db_engine, on_profile_due=due.append)
    bearer = f"Bearer {TOKEN}"
    assert svc.handle(bearer, body([metrics(s) for s in range(10)])).status == 200
    assert due == []
    assert svc.handle(bearer, body([metrics(s) for s in range(10, 21)], first_seq=10)).status == 200
    assert due == ["a-1"]
    # Later batches, and the same batch again, say nothing more.
    svc.handle(bearer, body([metrics(s) for s in range(10, 21)], first_seq=10))
    svc.handle(bearer, body([metrics(s) for s in range(21, 30)], first_seq=21))
    assert due == ["a-1"]
    with Session(db_engine) as session:
        attempt = session.get(Attempt, "a-1")
        assert attempt is not None and attempt.profiled_at == NOW


def test_a_profile_window_in_minutes_ends_by_the_events_time(db_engine: Engine) -> None:
    due = _profiled(db_engine, profile_until_s=120.0)
    svc = service(db_engine, on_profile_due=due.append)
    bearer = f"Bearer {TOKEN}"
    svc.handle(bearer, body([metrics(0)], times=[T0 + 119]))
    assert due == []
    svc.handle(bearer, body([metrics(1)], first_seq=1, times=[T0 + 121]))
    assert due == ["a-1"]


# --- the nodes of a multi-node attempt ------------------------------------------------------


def node_body(node: int, items: Sequence[tuple[str, dict[str, Any]]], *, first: int = 0) -> bytes:
    """A batch from node ``node`` of the attempt, numbered in its own seq range."""
    seq0 = node * NODE_SEQ_SPAN + first
    events = [
        WireEvent("a-1", seq0 + i, kind, T0 + first + i, "r-1", data)
        for i, (kind, data) in enumerate(items)
    ]
    return encode_batch(events, node=node)


def disk_sample(node: int, used: int) -> tuple[str, dict[str, Any]]:
    kind, data = system(None)
    return kind, {**data, "disk_used": used, "disk_total": 100, "node": node}


def test_a_second_nodes_events_are_stored_once_and_leave_the_runs_progress_to_node_0(
    db_engine: Engine,
) -> None:
    add_run(db_engine, state=AttemptState.RUNNING)
    recorder = Recorder()
    svc = service(db_engine, recorder)
    assert svc.handle(AUTH, body([metrics(1), metrics(2)])).status == 200
    node1 = [
        ("started", {"pid": 7, "host": "node-1"}),
        disk_sample(1, 10),
        ("preemption_notice", {"source": "aws", "time_left_s": 110.0}),
        ("exit", {"code": 75, "reason": "preempted"}),
    ]
    first = svc.handle(node_auth(1), node_body(1, node1))
    again = svc.handle(node_auth(1), node_body(1, node1))
    assert first.body == {"accepted": 4, "duplicates": 0}
    assert again.body == {"accepted": 0, "duplicates": 4}
    # Node 0's next batch is still taken as new: the high-water mark is node 0's.
    assert svc.handle(AUTH, body([metrics(3)], first_seq=2)).body["accepted"] == 1
    attempt = attempt_row(db_engine)
    assert attempt.last_seq == 2 and attempt.last_step == 3
    # A node's notice is the attempt's: the gang is being preempted.
    assert attempt.preemption_notice_at is not None
    # Only the notice is the service layer's: a node's exit does not end the attempt
    # (the gang's state does, through the provider), nor does its start move the run.
    assert [t for _, t, _ in recorder.attempt_events] == ["preemption_notice"]
    assert count_events(db_engine) == 7


def test_a_nodes_seqs_must_be_in_its_own_range(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    wrong = [WireEvent("a-1", 5, "heartbeat", T0, "r-1", {"step": None})]
    got = svc.handle(node_auth(2), encode_batch(wrong, node=2))
    assert got.status == 400
    assert f"node 2's events must have seqs from {2 * NODE_SEQ_SPAN}" in got.body["error"]
    assert count_events(db_engine) == 0


def test_node_0s_seqs_stay_below_node_1s_range(db_engine: Engine) -> None:
    """Node 0's token (a single-node attempt's only one) cannot take node 1's seqs: its
    events there would make node 1's own look like repeats, and be dropped."""
    add_run(db_engine, state=AttemptState.RUNNING)
    svc = service(db_engine)
    squatted = svc.handle(AUTH, body([disk_sample(1, 10)], first_seq=NODE_SEQ_SPAN, times=[T0]))
    assert squatted.status == 400
    assert f"node 0's events must have seqs from 0 to {NODE_SEQ_SPAN - 1}" in squatted.body["error"]
    assert count_events(db_engine) == 0
    # Node 1's first event, at the seq node 0 tried, is stored as new.
    assert svc.handle(node_auth(1), node_body(1, [disk_sample(1, 10)])).body == {
        "accepted": 1,
        "duplicates": 0,
    }


def test_a_full_disk_on_one_node_is_an_alert_that_names_it(db_engine: Engine) -> None:
    add_run(db_engine, state=AttemptState.RUNNING)
    recorder = Recorder()
    svc = service(db_engine, recorder)
    svc.handle(AUTH, body([system(None)]))  # node 0: 1 % full
    svc.handle(node_auth(1), node_body(1, [disk_sample(1, 97)]))
    (full,) = recorder.fired("disk", "threshold:node-1")
    assert full.title.endswith("(node 1)") and full.data["node"] == 1
    assert "97%" in full.title
    assert not recorder.fired("disk", "threshold")  # node 0 is fine

"""How many runner events per second the ingest API stores, rules evaluated, and how fast
a NaN loss becomes an alert.

In process, :meth:`jobs.ingest.IngestService.handle` is given real wire bodies
(:func:`runner.wire.encode_batch`, batches of 500 as the Reporter sends them) of a
realistic mix: mostly ``metrics``, a ``system`` sample and a heartbeat now and then, a
checkpoint per batch. The default alert rules are evaluated after every batch, as in
production. SQLite (a temporary file, migrated) and PostgreSQL (a fresh schema, when
``TRAINBOT_TEST_POSTGRES_URL`` is set) run side by side: rounds alternate between them,
and the median round is reported.

Alert latency: a run sends two ordinary batches, then one with a NaN loss in the middle;
measured from the start of ``handle()`` to ``on_signals`` receiving the divergent-loss
signal. Repeated on fresh runs; the worst is reported.

Where the time goes is measured too: decoding (``runner.wire.decode_batch_columns``,
what the service decodes with, alone on the same bodies) and the rules (timed inside the
service), per event; the rest is storing.

Goal: ``ratio = sqlite events/s ÷ 100,000 >= 1`` and alert latency <= 1 s; when
PostgreSQL ran, ``postgres_to_sqlite`` (PostgreSQL's events/s ÷ SQLite's, medians of the
same run) >= 0.5. Every PostgreSQL commit waits for the disk (an acknowledged batch survives
a crash of the server), and every batch of the mix carries a checkpoint (an upsert and the
run's update more than a batch of telemetry): the harder case for PostgreSQL.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url
from sqlmodel import Session

from jobs.database.db import make_engine, migrate
from jobs.database.models import Attempt, Run, hash_token
from jobs.domain.lifecycle import AttemptState
from jobs.ingest import IngestService
from jobs.rules import Rule, RunContext, Signal, default_rules
from jobs.spec import AlertThresholds
from runner.wire import Event, decode_batch_columns, encode_batch

GOAL_EVENTS_PER_S = 100_000.0
GOAL_ALERT_S = 1.0
GOAL_POSTGRES_TO_SQLITE = 0.5
POSTGRES_ENV = "TRAINBOT_TEST_POSTGRES_URL"


def log(message: str) -> None:
    """Progress on stderr: stdout's last line is the JSON result."""
    print(message, file=sys.stderr, flush=True)


# --- the workload ---------------------------------------------------------------------------


def make_bodies(
    *,
    attempt: str,
    run: str,
    batches: int,
    size: int,
    first_seq: int = 0,
    start: float,
    checkpoints: bool = True,
) -> list[bytes]:
    """Wire bodies of ``size`` events: per 100 events ~97 metrics, 2 system, 1 heartbeat,
    and one checkpoint per batch (``checkpoints=False``: a heartbeat in its place, a batch
    of telemetry only); 100 steps a second."""
    rng = random.Random(first_seq)
    bodies = []
    seq = first_seq
    for _ in range(batches):
        events = []
        for index in range(size):
            at = start + seq * 0.01
            step = seq
            data: dict[str, Any]
            if index == size // 2 and not checkpoints:
                kind, data = "heartbeat", {"step": step}
            elif index == size // 2:
                kind, data = (
                    "checkpoint_committed",
                    {
                        "step": step,
                        "bytes": 2_500_000_000,
                        "write_s": 4.2,
                        "uri": f"s3://b/{run}/{step}",
                    },
                )
            elif index % 50 == 7:
                kind, data = (
                    "system",
                    {
                        "gpu_util": 85.0 + rng.random() * 10,
                        "gpu_count": 8,
                        "disk_used": 40_000_000_000 + seq * 1000,
                        "disk_total": 500_000_000_000,
                        "disk_path": "/scratch",
                    },
                )
            elif index % 100 == 13:
                kind, data = "heartbeat", {"step": step}
            else:
                loss = 2.0 * math.exp(-seq / 50_000) + 0.3 + rng.gauss(0, 0.01)
                kind, data = (
                    "metrics",
                    {
                        "step": step,
                        "loss": loss,
                        "step_time_s": 0.01 + rng.random() * 0.001,
                        "data_wait_fraction": 0.05,
                        "metrics": {"lr": 3e-4, "grad_norm": 1.0 + rng.random()},
                    },
                )
            events.append(Event(attempt, seq, kind, at, run, data))
            seq += 1
        bodies.append(encode_batch(events))
    return bodies


def nan_body(*, attempt: str, run: str, first_seq: int, size: int, start: float) -> bytes:
    """One batch of metrics with a NaN loss in the middle."""
    events = []
    for index in range(size):
        seq = first_seq + index
        loss = math.nan if index == size // 2 else 0.5
        data = {
            "step": seq,
            "loss": loss,
            "step_time_s": 0.01,
            "data_wait_fraction": 0.05,
            "metrics": {},
        }
        events.append(Event(attempt, seq, "metrics", start + seq * 0.01, run, data))
    return encode_batch(events)


# --- one database ---------------------------------------------------------------------------


class TimedRule:
    """A rule that adds the time it takes to a shared total (the rules' share)."""

    def __init__(self, rule: Rule, total: list[float]) -> None:
        self.rule = rule
        self.name = rule.name
        self.total = total

    def evaluate(self, window: Sequence[Any], *, now: float, ctx: RunContext) -> list[Signal]:
        started = time.perf_counter()
        try:
            return self.rule.evaluate(window, now=now, ctx=ctx)
        finally:
            self.total[0] += time.perf_counter() - started


@dataclass
class Target:
    """One database under test."""

    name: str
    engine: Engine
    rules_s: list[float] = field(default_factory=lambda: [0.0])
    rates: list[float] = field(default_factory=list)
    telemetry_rates: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    seq: int = 0
    service: IngestService | None = None

    def add_attempt(self, run_id: str, attempt_id: str, token: str) -> None:
        with Session(self.engine) as session:
            session.add(Run(id=run_id, spec_name="bench", spec={}, requester="bench"))
            session.flush()
            session.add(
                Attempt(
                    id=attempt_id,
                    run_id=run_id,
                    number=1,
                    state=AttemptState.RUNNING,
                    provider="local",
                    token_hash=hash_token(token),
                )
            )
            session.commit()

    def rules_for(self, run: Run) -> list[Rule]:
        return [TimedRule(rule, self.rules_s) for rule in default_rules(AlertThresholds())]


def throughput_round(
    target: Target, bodies: Sequence[bytes], events: int, *, rates: list[float] | None = None
) -> float:
    assert target.service is not None
    started = time.perf_counter()
    for body in bodies:
        result = target.service.handle("Bearer bench-token", body)
        if result.status != 200 or result.body["duplicates"]:
            raise SystemExit(f"{target.name}: ingest answered {result.status} {result.body}")
    rate = events / (time.perf_counter() - started)
    (target.rates if rates is None else rates).append(rate)
    return rate


def alert_latency(target: Target, *, trial: int, size: int, start: float) -> float | None:
    """Seconds from handle() to the NaN alert on a fresh run; None if it never came."""
    run_id, attempt_id, token = f"r-lat-{trial}", f"a-lat-{trial}", f"lat-token-{trial}"
    target.add_attempt(run_id, attempt_id, token)
    fired: list[float] = []
    began = [0.0]

    def on_signals(run: str, signals: list[Signal], now: Any) -> None:
        if any(s.rule == "divergent_loss" and s.key == "nan" and not s.resolved for s in signals):
            fired.append(time.perf_counter() - began[0])

    service = IngestService(target.engine, on_signals=on_signals)
    warm = make_bodies(attempt=attempt_id, run=run_id, batches=2, size=size, start=start)
    for body in warm:
        service.handle(f"Bearer {token}", body)
    body = nan_body(attempt=attempt_id, run=run_id, first_seq=2 * size, size=size, start=start)
    began[0] = time.perf_counter()
    service.handle(f"Bearer {token}", body)
    return fired[0] if fired else None


# --- databases ------------------------------------------------------------------------------


@contextmanager
def sqlite_engine(parent: Path) -> Iterator[Engine]:
    directory = Path(tempfile.mkdtemp(prefix="trainbot-ingest-", dir=parent))
    engine = make_engine(f"sqlite:///{directory / 'bench.db'}")
    try:
        migrate(engine)
        yield engine
    finally:
        engine.dispose()
        shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def postgres_engine(url: str) -> Iterator[Engine]:
    """A fresh schema, dropped afterwards: the benchmark never touches existing tables."""
    schema = f"trainbot_bench_{uuid.uuid4().hex[:12]}"
    admin = make_engine(url)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    parsed = make_url(url)
    options = f"{parsed.query.get('options', '')} -csearch_path={schema}".strip()
    engine = make_engine(
        parsed.update_query_dict({"options": options}).render_as_string(hide_password=False)
    )
    try:
        migrate(engine)
        yield engine
    finally:
        engine.dispose()
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


# --- the run --------------------------------------------------------------------------------


def decode_us_per_event(bodies: Sequence[bytes], events: int) -> float:
    started = time.perf_counter()
    for body in bodies:
        decode_batch_columns(body)
    return (time.perf_counter() - started) / events * 1e6


def rounded(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer batches and rounds: < 1 minute")
    p.add_argument(
        "--batches", type=int, default=None, help="batches per round (default 40, 10 quick)"
    )
    p.add_argument("--batch-size", type=int, default=500, help="events per batch (default 500)")
    p.add_argument(
        "--repeats", type=int, default=None, help="rounds per database (default 5, 3 quick)"
    )
    p.add_argument("--alert-trials", type=int, default=None, help="NaN trials (default 5, 3 quick)")
    p.add_argument(
        "--dir", type=Path, default=Path(tempfile.gettempdir()), help="for the SQLite file"
    )
    args = p.parse_args(argv)
    args.batches = args.batches or (10 if args.quick else 40)
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.alert_trials = args.alert_trials or (3 if args.quick else 5)
    if min(args.batches, args.batch_size, args.repeats, args.alert_trials) < 1:
        p.error("--batches, --batch-size, --repeats and --alert-trials must be at least 1")
    if not args.dir.is_dir():
        p.error(f"--dir {args.dir} is not a directory")
    return args


def run(
    args: argparse.Namespace, targets: list[Target], postgres_note: str | None
) -> dict[str, Any]:
    size, batches = args.batch_size, args.batches
    per_round = size * batches
    start = time.time() - 3 * 3600
    for target in targets:
        target.add_attempt("r-bench", "a-bench", "bench-token")
        target.service = IngestService(target.engine, rules_for=target.rules_for)
    warm = make_bodies(attempt="a-bench", run="r-bench", batches=2, size=size, start=start)
    for target in targets:  # compile statements, build the window
        for body in warm:
            target.service.handle("Bearer bench-token", body)  # type: ignore[union-attr]
        target.seq = 2 * size
        target.rules_s[0] = 0.0
    decode_samples = []
    for round_ in range(args.repeats):
        for target in targets if round_ % 2 == 0 else reversed(targets):
            bodies = make_bodies(
                attempt="a-bench",
                run="r-bench",
                batches=batches,
                size=size,
                first_seq=target.seq,
                start=start,
            )
            target.seq += per_round
            rate = throughput_round(target, bodies, per_round)
            log(f"round {round_ + 1}: {target.name} {rate:,.0f} events/s")
            if target is targets[0]:
                decode_samples.append(decode_us_per_event(bodies, per_round))
    rules_s = targets[0].rules_s[0]
    # The same rounds with no checkpoint in any batch: what most batches of a real run
    # are (it checkpoints every few minutes). A figure, not the goal.
    for round_ in range(args.repeats):
        for target in targets if round_ % 2 == 0 else reversed(targets):
            bodies = make_bodies(
                attempt="a-bench",
                run="r-bench",
                batches=batches,
                size=size,
                first_seq=target.seq,
                start=start,
                checkpoints=False,
            )
            target.seq += per_round
            rate = throughput_round(target, bodies, per_round, rates=target.telemetry_rates)
            log(f"telemetry round {round_ + 1}: {target.name} {rate:,.0f} events/s")
    for target in targets:
        for trial in range(args.alert_trials):
            latency = alert_latency(target, trial=trial, size=size, start=start)
            target.latencies.append(math.inf if latency is None else latency)
        log(f"{target.name}: NaN alert after {max(target.latencies) * 1000:.1f} ms at worst")
    by_name = {t.name: t for t in targets}
    sqlite = by_name["sqlite"]
    sqlite_rate = statistics.median(sqlite.rates)
    total_events = per_round * args.repeats
    total_us = 1e6 / sqlite_rate
    decode_us = statistics.median(decode_samples)
    rules_us = rules_s / total_events * 1e6
    postgres = by_name.get("postgres")
    latency = max(sqlite.latencies)
    postgres_rate = statistics.median(postgres.rates) if postgres else None
    to_sqlite = None if postgres_rate is None else postgres_rate / sqlite_rate
    telemetry_to_sqlite = (
        statistics.median(postgres.telemetry_rates) / statistics.median(sqlite.telemetry_rates)
        if postgres
        else None
    )
    figures: dict[str, Any] = {
        "sqlite_events_per_s": rounded(sqlite_rate, 0),
        "postgres_events_per_s": rounded(postgres_rate, 0),
        "postgres_to_sqlite": rounded(to_sqlite, 3),
        "telemetry_only_events_per_s": {
            t.name: round(statistics.median(t.telemetry_rates)) for t in targets
        },
        "telemetry_only_postgres_to_sqlite": rounded(telemetry_to_sqlite, 3),
        "sqlite_rounds_events_per_s": [round(r) for r in sqlite.rates],
        "postgres_rounds_events_per_s": [round(r) for r in postgres.rates] if postgres else None,
        "alert_latency_s": None if math.isinf(latency) else round(latency, 4),
        "postgres_alert_latency_s": (
            round(max(postgres.latencies), 4)
            if postgres and not math.isinf(max(postgres.latencies))
            else None
        ),
        "sqlite_us_per_event": rounded(total_us, 2),
        "breakdown_us_per_event": {
            "decode_batch": rounded(decode_us, 2),
            "rules": rounded(rules_us, 2),
            "store_and_rest": rounded(max(total_us - decode_us - rules_us, 0.0), 2),
        },
        "batch_size": size,
        "batches_per_round": batches,
        "rounds": args.repeats,
    }
    if postgres_note:
        figures["postgres_skipped"] = postgres_note
    ratio = sqlite_rate / GOAL_EVENTS_PER_S
    met = (
        ratio >= 1.0
        and latency <= GOAL_ALERT_S
        and (to_sqlite is None or to_sqlite >= GOAL_POSTGRES_TO_SQLITE)
    )
    return {
        "bench": "ingest",
        "ratio": round(ratio, 4),
        "goal": 1.0,
        "goal_is": f"ratio >= 1.0 (sqlite events/s / {GOAL_EVENTS_PER_S:,.0f}) and "
        f"alert_latency_s <= {GOAL_ALERT_S} and, when PostgreSQL ran, postgres_to_sqlite "
        f">= {GOAL_POSTGRES_TO_SQLITE} (its events/s / sqlite's, same run)",
        "met": met,
        "figures": figures,
        "quick": bool(args.quick),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    url = os.environ.get(POSTGRES_ENV)
    with ExitStack() as stack:
        targets = [Target("sqlite", stack.enter_context(sqlite_engine(args.dir)))]
        note: str | None = None
        if not url:
            note = f"{POSTGRES_ENV} is not set"
        else:
            try:
                targets.append(Target("postgres", stack.enter_context(postgres_engine(url))))
            except Exception as exc:  # measure SQLite anyway, and say why not PostgreSQL
                note = f"PostgreSQL at {POSTGRES_ENV} is unusable: {type(exc).__name__}: {exc}"
                log(note)
        result = run(args, targets, note)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Two replicas of the control plane on PostgreSQL under a team's load, with the leader
killed in the middle.

What runs (nothing here is simulated but the runners' training and Slack's servers):

- **Two replicas**, each ``trainbot serve`` in a process of its own (the production
  server: waitress, the Bolt app at ``/slack/events``, the Slack notifier, the leader
  election), on one PostgreSQL database (a fresh schema, dropped at the end;
  ``TRAINBOT_TEST_POSTGRES_URL``, default ``postgresql://postgres@127.0.0.1:5432/test``),
  sharing a state directory as replicas on one machine do. Their Slack Web API is the
  local fake (:mod:`tests.fakes.slack_api`, through ``TRAINBOT_SLACK_API_URL``).
- **The runs**: each simulated runner has a run and a RUNNING attempt in the database,
  with its own hashed token and a real instance on the local provider (a ``sleep``
  process), so the leader's reconcile and spend jobs find the fleet they expect.
- **200 runners** (:mod:`bench._load_client`, a process of their own): one batch a
  second each, about 20 events, real wire bodies with the attempt's token, retried as
  the Reporter retries.
- **20 Slack commands a second** (another process): signed ``/train status`` from the
  runs' channels, each on a fresh connection; their replies go to a ``response_url``
  served here.
- **The balancer**: the clients alternate replicas themselves (round robin); a refused
  connection marks a replica down for 2 s and the request goes to the other at once, as
  a load balancer with passive health checks does (see :mod:`bench._load_client`).
- **The kill**: half-way through, the replica whose ``/metrics`` says it leads
  (``trainbot_scheduler_leader 1``) gets SIGKILL. The time to a new leader is from the
  kill to the new holder's ``acquired_at`` on the lease row. The load goes on for the
  full duration, and past it until there is a new leader.

It reports events lost (in a POST, not in the database once the runners have drained:
every seq below each runner's highest sent is looked up in ``events`` and
``metric_blocks``), 5xx answers, connection errors by kind (counted apart: the killed
replica's refused and broken connections), ingest and Slack acknowledgement latencies,
and the time to a new leader.

Goal: no event lost, no 5xx, Slack ack p99 <= 100 ms (Slack's deadline is 3 s), and a
new leader within the lease (the survivors try again the moment the dead leader's lease
runs out, so a kill just after a renewal is the worst case), plus 0.5 s for the database
round trips;
``ratio = ack p99 / 100 ms``. ``--quick``: 20 runners, 10 commands/s, 16 s, a 5 s lease.
The full mode uses the production lease (30 s).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, select
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session

from bench._ack_client import SECRET, TEAM, USER
from bench._common import BenchError, child_env, log, run
from bench.bench_ack_latency import Sink, summary
from bench.bench_ingest import postgres_engine
from jobs.database.models import Attempt, EventRow, MetricBlock, Run, hash_token, table_of, utcnow
from jobs.database.replica_tables import LEADER_LEASE, SchedulerLease
from jobs.domain.errors import TrainbotError
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.process.deps import load_secret
from jobs.process.settings import SHIPPED_SPECS_DIR
from jobs.providers.base import LaunchRequest, ResourceRequest
from jobs.providers.local import LocalProvider
from jobs.spec import load_spec
from tests.fakes.slack_api import FakeSlack

ROOT = Path(__file__).resolve().parent.parent
GOAL_ACK_P99_MS = 100.0
POSTGRES_ENV = "TRAINBOT_TEST_POSTGRES_URL"
DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
TOKEN = "xoxb-bench-load"
#: The runs are spread over channels of this many each (a team channel's active runs:
#: what ``/train status`` there lists); the commands come from every channel in turn.
RUNS_PER_CHANNEL = 4
#: Seconds a replica may take to start (imports, the lease, the Slack app's auth.test).
START_S = 60.0


@dataclass(frozen=True)
class Shape:
    runners: int
    events_per_batch: int
    commands_per_s: float
    duration_s: float
    lease_s: float


def parse_args(argv: list[str] | None) -> tuple[Shape, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="20 runners, 10 commands/s, 16 s")
    p.add_argument("--runners", type=int, default=None, help="simulated runners (200; 20 quick)")
    p.add_argument("--events-per-batch", type=int, default=20, help="events a batch (20)")
    p.add_argument(
        "--commands-per-s", type=float, default=None, help="Slack commands a second (20; 10 quick)"
    )
    p.add_argument("--duration-s", type=float, default=None, help="seconds of load (60; 16 quick)")
    p.add_argument(
        "--lease-s",
        type=float,
        default=None,
        help="the replicas' TRAINBOT_SCHEDULER_LEASE_S (30, the default; 5 quick)",
    )
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="scratch dir")
    args = p.parse_args(argv)
    shape = Shape(
        runners=args.runners or (20 if args.quick else 200),
        events_per_batch=args.events_per_batch,
        commands_per_s=args.commands_per_s or (10.0 if args.quick else 20.0),
        duration_s=args.duration_s or (16.0 if args.quick else 60.0),
        lease_s=args.lease_s or (5.0 if args.quick else 30.0),
    )
    if shape.runners < 1 or shape.events_per_batch < 1 or shape.commands_per_s <= 0:
        p.error("--runners, --events-per-batch and --commands-per-s must be positive")
    if shape.duration_s < 2:
        p.error("--duration-s must be at least 2 (the kill is half-way)")
    if shape.lease_s < 1:
        p.error("--lease-s must be at least 1 (TRAINBOT_SCHEDULER_LEASE_S's minimum)")
    if not args.dir.is_dir():
        p.error(f"--dir {args.dir} is not a directory")
    return shape, args


# --- the fleet -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fleet:
    #: Per runner: run, attempt, token (for the load client).
    runners: list[dict[str, str]]
    instances: list[str]
    channels: list[str]


def provision(
    engine: Engine, provider: LocalProvider, shape: Shape, *, lifetime_s: float, secret: bytes
) -> Fleet:
    """A RUNNING run and attempt per runner, each with a token and a live local instance.
    The tokens are the ones the replicas derive from ``secret`` (a replica refuses to start
    beside another when the live attempts' tokens are not its own)."""
    spec = load_spec("tiny", specs_dir=SHIPPED_SPECS_DIR).model_dump(mode="json")
    count = -(-shape.runners // RUNS_PER_CHANNEL)
    channels = [f"C0LOAD{k:03d}" for k in range(count)]
    runners, instances = [], []
    runs, attempts = [], []
    now = utcnow()
    for k in range(shape.runners):
        run_id, attempt_id = f"r-load-{k:04d}", f"a-load-{k:04d}"
        token = hmac.new(secret, attempt_id.encode(), hashlib.sha256).hexdigest()
        info = provider.launch(
            LaunchRequest(
                run_id=run_id,
                attempt_id=attempt_id,
                owner=USER,
                request=ResourceRequest(cloud="local", region="local", spot=False),
                zone="local-a",
                command=["sleep", str(int(lifetime_s))],
                spot=False,
            )
        )
        instances.append(info.instance_id)
        runs.append(
            Run(
                id=run_id,
                spec_name="tiny",
                spec=spec,
                state=RunState.RUNNING,
                requester=USER,
                channel=channels[k % len(channels)],
                created_at=now,
            )
        )
        attempts.append(
            Attempt(
                id=attempt_id,
                run_id=run_id,
                number=1,
                state=AttemptState.RUNNING,
                provider="local",
                region="local",
                zone=info.zone,
                instance_id=info.instance_id,
                spot=False,
                price_per_hour=1.0,
                token_hash=hash_token(token),
                created_at=now,
                started_at=now,
            )
        )
        runners.append({"run": run_id, "attempt": attempt_id, "token": token})
    with Session(engine) as session:
        session.add_all(runs)
        session.flush()  # the attempts' foreign key needs the runs first
        session.add_all(attempts)
        session.commit()
    return Fleet(runners, instances, channels)


def terminate_all(provider: LocalProvider, instances: list[str]) -> None:
    with ThreadPoolExecutor(8) as pool:
        for outcome in [pool.submit(provider.terminate, i) for i in instances]:
            try:
                outcome.result()
            except Exception as exc:  # one stuck instance must not keep the rest running
                log(f"terminating an instance: {exc}")


# --- the replicas ----------------------------------------------------------------------------

_URL = re.compile(r"control plane on (http://[^\s;]+).*health and metrics on (http://[^\s;]+)")
#: Straight to the replicas, whatever proxy the environment names.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Replica:
    """``trainbot serve`` in its own process."""

    def __init__(self, name: str, env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 -- closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bot.cli", "serve", "--host", "127.0.0.1", "--port", "0"],
            env=env,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.url = ""
        #: Its admin port (``/healthz``, ``/metrics``).
        self.admin_url = ""
        #: CPU seconds used when the load ended (or when it was killed).
        self.cpu_at_end: float | None = None

    def wait_until_up(self) -> None:
        """Until it says where it listens (it has migrated and run for the lease)."""
        self.url, self.admin_url = self._wait_for_url()

    def _wait_for_url(self) -> tuple[str, str]:
        lines: queue.Queue[str] = queue.Queue()
        assert self.process.stdout is not None
        stdout = self.process.stdout

        def read() -> None:
            for line in stdout:
                lines.put(line)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            try:
                found = _URL.search(lines.get(timeout=0.2))
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            if found:
                return found.group(1), found.group(2)
        tail = self.log_path.read_text(errors="replace")[-1500:]
        raise BenchError(f"replica {self.name} did not start within {START_S:.0f} s:\n{tail}")

    def leads(self) -> bool:
        """What its ``/metrics`` says: ``trainbot_scheduler_leader`` is 1 on the leader."""
        with _DIRECT.open(f"{self.admin_url}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name == "trainbot_scheduler_leader":
                return any(s.value == 1 for s in family.samples)
        raise BenchError(f"replica {self.name}'s /metrics has no trainbot_scheduler_leader")

    def cpu_s(self) -> float | None:
        """CPU seconds it has used so far (Linux ``/proc``), None where unknown."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self) -> float:
        """SIGKILL; when it was sent (unix time)."""
        self.cpu_at_end = self.cpu_s()
        self.process.send_signal(signal.SIGKILL)
        killed_at = time.time()
        self.process.wait()
        return killed_at

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (the replica drains), SIGKILL after ``timeout``; its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def log_problems(self) -> dict[str, Any]:
        """Its log's warnings and errors (JSON lines), the first few errors quoted."""
        counts = {"warning": 0, "error": 0}
        first: list[str] = []
        warnings: list[str] = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            level = str(record.get("level", "")).lower()
            if level in ("error", "critical"):
                counts["error"] += 1
                if len(first) < 3:
                    first.append(str(record.get("message", ""))[:200])
            elif level == "warning":
                counts["warning"] += 1
                if len(warnings) < 3:
                    warnings.append(str(record.get("message", ""))[:200])
        return {**counts, "first_errors": first, "first_warnings": warnings}


def replica_env(state: Path, database_url: str, fake: FakeSlack, lease_s: float) -> dict[str, str]:
    return child_env(
        {
            "PYTHONPATH": str(ROOT),
            "TRAINBOT_STATE_DIR": str(state),
            "TRAINBOT_DATABASE_URL": database_url,
            "TRAINBOT_NOTIFIER": "slack",
            "TRAINBOT_SLACK_SIGNING_SECRET": SECRET,
            "TRAINBOT_SLACK_BOT_TOKEN": TOKEN,
            "TRAINBOT_SLACK_API_URL": fake.api_url,
            "TRAINBOT_LAUNCHERS": USER,
            "TRAINBOT_SCHEDULER_LEASE_S": str(lease_s),
            "TRAINBOT_LOG_FORMAT": "json",
        }
    )


def lease(engine: Engine) -> SchedulerLease | None:
    with Session(engine, expire_on_commit=False) as session:
        return session.get(SchedulerLease, LEADER_LEASE)


def wait_for_new_leader(engine: Engine, old_token: int, timeout: float) -> SchedulerLease | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            row = lease(engine)
        except SQLAlchemyError:
            row = None
        if row is not None and row.token > old_token and row.expires_at > utcnow():
            return row
        time.sleep(0.05)
    return None


# --- the load --------------------------------------------------------------------------------


class LoadClient:
    """One ``bench._load_client`` process: configured, started, stopped, its result read."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench._load_client", kind],
            env=child_env({"PYTHONPATH": str(ROOT)}),
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def configure(self, config: dict[str, Any]) -> None:
        self._send(json.dumps(config))
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":
            code = self.process.poll()
            raise BenchError(f"the {self.kind} load client did not start (exit {code})")

    def _send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def go(self) -> None:
        self._send("go")

    def stop(self) -> dict[str, Any]:
        self._send("stop")
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        self.process.wait(timeout=60)
        if not line:
            raise BenchError(f"the {self.kind} load client died (exit {self.process.returncode})")
        result: dict[str, Any] = json.loads(line)
        return result

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def schema_of(engine: Engine) -> str | None:
    """The fresh schema :func:`bench.bench_ingest.postgres_engine` made (its search_path)."""
    options = engine.url.query.get("options", "")
    text = options if isinstance(options, str) else " ".join(options)
    return text.partition("search_path=")[2].split()[0] if "search_path=" in text else None


def stored_seqs(engine: Engine, attempts: list[str]) -> dict[str, set[int]]:
    """Every seq the database holds for each attempt, in both of its tables."""
    events, blocks = table_of(EventRow).c, table_of(MetricBlock).c
    found: dict[str, set[int]] = {a: set() for a in attempts}
    with engine.connect() as connection:
        for attempt_id, seq in connection.execute(
            select(events.attempt_id, events.seq).where(events.attempt_id.in_(attempts))
        ):
            found[attempt_id].add(int(seq))
        for attempt_id, seqs in connection.execute(
            select(blocks.attempt_id, blocks.seqs).where(blocks.attempt_id.in_(attempts))
        ):
            found[attempt_id].update(int(s) for s in seqs)
    return found


def accounting(runners: list[dict[str, Any]], stored: dict[str, set[int]]) -> dict[str, Any]:
    sent = lost = lost_acked = unknown = acked = 0
    for r in runners:
        have = stored[r["attempt"]]
        sent += r["sent_upto"]
        acked += r["acked_upto"]
        lost += sum(1 for s in range(r["sent_upto"]) if s not in have)
        lost_acked += sum(1 for s in range(r["acked_upto"]) if s not in have)
        unknown += sum(1 for s in have if s >= r["generated"])
    return {
        "events_sent": sent,
        "events_acknowledged": acked,
        "events_stored": sum(len(s) for s in stored.values()),
        "events_lost": lost,
        "events_lost_after_ack": lost_acked,
        "events_stored_never_sent": unknown,
        "events_unacknowledged_at_end": sum(r["pending"] for r in runners),
        "duplicates_answered": sum(r["duplicates"] for r in runners),
        "runners_stopped": [r["stopped"] for r in runners if r["stopped"]][:3],
    }


def unreplied(
    acked: dict[str, str], paths: list[str], urls: list[str], replicas: list[Replica]
) -> dict[str, int]:
    """Per replica, the commands it acknowledged whose work never replied."""
    replied = {path.rsplit("/", 1)[-1] for path in paths}
    names = {r.url: r.name for r in replicas}
    missing = {names[url]: 0 for url in urls}
    for number, url in acked.items():
        if number not in replied:
            missing[names[url]] += 1
    return missing


def traffic(result: dict[str, Any], *, kill_at: float | None) -> dict[str, Any]:
    statuses = {int(k): v for k, v in result["statuses"].items()}
    latencies = result["latencies"]
    after = sorted(t - kill_at for t, _ in result["incidents"]) if kill_at else []
    return {
        "answers": sum(statuses.values()),
        "statuses": result["statuses"],
        "http_5xx": sum(v for k, v in statuses.items() if k >= 500),
        "connection_errors": result["connection_errors"],
        "incidents_s_after_kill": [round(after[0], 2), round(after[-1], 2)] if after else None,
        "by_replica": result["by_replica"],
        "latency_ms": summary(latencies) if latencies else None,
    }


# --- the benchmark ---------------------------------------------------------------------------


def measure(shape: Shape, root: Path, engine: Engine, database_url: str) -> dict[str, Any]:
    with ExitStack() as stack:
        state = root / "state"
        secret = load_secret(state)  # one secret for both replicas, made before either starts
        fake = FakeSlack(tokens=[TOKEN], post_interval_s=0.01, burst=50, team_id=TEAM).start()
        stack.callback(fake.close)
        sink = Sink()
        stack.callback(sink.close)
        provider = LocalProvider(state / "local")
        stack.callback(provider.close)
        started = time.monotonic()
        fleet = provision(
            engine, provider, shape, lifetime_s=4 * shape.duration_s + 600, secret=secret
        )
        alive = list(fleet.instances)
        stack.callback(lambda: terminate_all(provider, alive))  # on the way out, at worst
        log(f"{shape.runners} runs and instances in {time.monotonic() - started:.1f} s")
        env = replica_env(state, database_url, fake, shape.lease_s)
        replicas: list[Replica] = []
        exits: dict[str, int | None] = {}

        def stop_replicas() -> None:
            for r in replicas:
                exits[r.name] = r.stop()

        stack.callback(stop_replicas)
        for name in ("replica-a", "replica-b"):  # a first, so that it leads
            replicas.append(Replica(name, env, root / f"{name}.log"))
            replicas[-1].wait_until_up()
        log(f"replicas at {', '.join(r.url for r in replicas)}")
        urls = [r.url for r in replicas]
        configs = {
            "runners": {
                "replicas": urls,
                "events_per_batch": shape.events_per_batch,
                "runners": fleet.runners,
            },
            "slack": {
                "replicas": urls,
                "commands_per_s": shape.commands_per_s,
                "channels": fleet.channels,
                "response_url": sink.url,
            },
        }
        clients = {kind: LoadClient(kind) for kind in configs}
        for kind, client in clients.items():
            stack.callback(client.close)
            client.configure(configs[kind])
        load_before = os.getloadavg()[0]
        for client in clients.values():
            client.go()
        start, start_wall = time.monotonic(), time.time()
        time.sleep(shape.duration_s / 2)
        leaders = [r for r in replicas if r.leads()]
        if len(leaders) != 1:
            raise BenchError(f"{len(leaders)} replicas say they lead half-way; expected one")
        leader = leaders[0]
        before = lease(engine)
        assert before is not None
        load_at_kill = os.getloadavg()[0]
        killed_at = leader.kill()
        log(f"killed {leader.name} (the leader, fencing token {before.token}) with SIGKILL")
        bound_s = shape.lease_s + 0.5
        new = wait_for_new_leader(engine, before.token, timeout=bound_s + shape.lease_s + 10)
        takeover_s = None if new is None else new.acquired_at.timestamp() - killed_at
        survivor = next(r for r in replicas if r is not leader)
        log(f"new leader after {takeover_s} s" if new else "no new leader")
        end = start + shape.duration_s
        time.sleep(max(0.0, end - time.monotonic()))
        load_s = time.monotonic() - start
        results = {kind: client.stop() for kind, client in clients.items()}
        survivor.cpu_at_end = survivor.cpu_s()
        survivor_leads = survivor.leads()
        load_after = os.getloadavg()[0]
        stop_replicas()
        replicas_stopped = list(replicas)
        replicas.clear()
        stored = stored_seqs(engine, [r["attempt"] for r in fleet.runners])
        terminate_all(provider, alive)
        alive.clear()
        running = sum(not i.state.is_terminal() for i in provider.list_instances())
        api_calls = Counter(call.method for call in fake.calls)
        stack.close()
    ingest = results["runners"]
    slack = results["slack"]
    lost_replies = unreplied(slack["acked"], sink.paths, urls, replicas_stopped)
    return {
        "shape": shape.__dict__,
        "schema": schema_of(engine),
        "load_s": round(load_s, 1),
        **accounting(ingest["runners"], stored),
        "ingest": {
            **traffic(ingest, kill_at=killed_at),
            "delivery_ms": summary(ingest["deliveries"]) if ingest["deliveries"] else None,
            "events_per_s": round(sum(r["acked_upto"] for r in ingest["runners"]) / load_s, 1),
        },
        "slack": {
            **traffic(slack, kill_at=killed_at),
            "commands": slack["sent"],
            "replies": sink.count,
            "acknowledged_without_reply": lost_replies,
            "web_api_calls": dict(sorted(api_calls.items())),
        },
        "failover": {
            "killed": leader.name,
            "killed_at_s": round(killed_at - start_wall, 1),
            "lease_s": shape.lease_s,
            "takeover_s": None if takeover_s is None else round(takeover_s, 2),
            "takeover_bound_s": round(bound_s, 2),
            "takeover_within_lease": takeover_s is not None and takeover_s <= shape.lease_s,
            "new_leader_token": None if new is None else new.token,
            "survivor_leads": survivor_leads,
        },
        "replica_exit_codes": exits,
        # Who got how much of the machine: the replicas until the load ended (the
        # killed one until its kill), the load clients in all.
        "cpu_s": {
            **{r.name: r.cpu_at_end for r in replicas_stopped},
            **{f"{kind}_client": results[kind]["cpu_s"] for kind in results},
        },
        "instances_left_running": running,
        "replica_logs": {r.name: r.log_problems() for r in replicas_stopped},
        "load_average_1min": {
            "before": round(load_before, 2),
            "at_kill": round(load_at_kill, 2),
            "after": round(load_after, 2),
        },
    }


def _check(name: str, value: float | None, goal: str, met: bool) -> dict[str, Any]:
    return {"check": name, "value": value, "goal": goal, "met": bool(met)}


def checks(fig: dict[str, Any]) -> list[dict[str, Any]]:
    failover = fig["failover"]
    ack = fig["slack"]["latency_ms"]
    ack_p99 = ack["p99_ms"] if ack else None
    http_5xx = fig["ingest"]["http_5xx"] + fig["slack"]["http_5xx"]
    takeover = failover["takeover_s"]
    return [
        _check("events lost", fig["events_lost"], "== 0", fig["events_lost"] == 0),
        _check("5xx answers", http_5xx, "== 0", http_5xx == 0),
        _check(
            "Slack ack p99 (ms)",
            ack_p99,
            f"<= {GOAL_ACK_P99_MS:.0f}",
            ack_p99 is not None and ack_p99 <= GOAL_ACK_P99_MS,
        ),
        _check(
            "time to a new leader (s)",
            takeover,
            f"<= {failover['takeover_bound_s']} (the lease + 0.5 s)",
            takeover is not None and takeover <= failover["takeover_bound_s"],
        ),
    ]


@contextmanager
def scratch(parent: Path) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="trainbot-load-", dir=parent))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    shape, args = parse_args(argv)
    url = os.environ.get(POSTGRES_ENV) or DEFAULT_POSTGRES
    with ExitStack() as stack:
        root = stack.enter_context(scratch(args.dir))
        try:
            engine = stack.enter_context(postgres_engine(url))
        except (SQLAlchemyError, TrainbotError) as exc:
            reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
            raise BenchError(
                f"PostgreSQL is not usable at {url} ({reason}): start it, or set "
                f"{POSTGRES_ENV} to a PostgreSQL URL"
            ) from None
        schema_url = engine.url.render_as_string(hide_password=False)
        figures = measure(shape, root, engine, schema_url)
    result = checks(figures)
    ack = figures["slack"]["latency_ms"]
    ratio = ack["p99_ms"] / GOAL_ACK_P99_MS if ack else None
    doc = {
        "bench": "load",
        "ratio": None if ratio is None else round(ratio, 4),
        "goal": 1.0,
        "goal_is": (
            f"ratio <= 1.0 (Slack ack p99 <= {GOAL_ACK_P99_MS:.0f} ms), no event lost, no 5xx "
            "answer, and a new leader within the lease (+ 0.5 s)"
        ),
        "met": all(c["met"] for c in result),
        "checks": result,
        "figures": figures,
        "quick": bool(args.quick),
        "when": datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    sys.stdout.flush()
    print(json.dumps(doc), flush=True)


if __name__ == "__main__":
    sys.exit(run(main))

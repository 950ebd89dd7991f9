"""How fast ``/train`` is acknowledged over real HTTP, with a training run going on.

Slack gives an app 3 s to answer a slash command and shows an error after that; trainbot
acknowledges first and works afterwards (on a pool of its own), so the answer should take
a few milliseconds however slow the work. This measures it the way Slack sees it:

- **HTTP**: the control plane as ``trainbot serve`` runs it (its WSGI server, the Bolt
  app mounted at ``/slack/events`` by :func:`bot.slack_wsgi.attach`, SQLite, the Slack
  notifier), with Web API calls going to the local fake Slack
  (:mod:`tests.fakes.slack_api`). Each round, a load generator in its own process (like
  Slack, :mod:`bench._ack_client`) sends 50 ``/train status`` commands at once, each on
  its own connection, signed, with a fresh trigger id, and times each from the request
  sent to the whole answer read. Every command's work (the database, the reply to its
  ``response_url``) really runs after its acknowledgement, competing for the CPU; the
  next burst waits until every reply of the last one has arrived.
- **Bolt in process**: the same signed bodies handed to ``App.dispatch(BoltRequest(…))``
  of the same app, 50 at once: what Bolt itself costs (verification, routing, running
  the ack function on its executor and waiting for it), with no HTTP and no server.

Meanwhile a real training run goes on on the same machine: the tiny example
(``runner.examples.tiny``, torch on CPU, no step delay) launched through the control
plane on the local provider, exactly as a user's ``/train launch`` starts one: at the
provider's default CPU priority (``TRAINBOT_LOCAL_NICE``, 10 below the control plane's,
reported as ``training_nice``), reporting its telemetry to the same server. Rounds of
the two contenders alternate (the order flips every round) because the machine is noisy.

The commands' work waits for the acknowledgements (:mod:`bot.workpool`), so it is not
free: ``replies_done_ms`` is how long after each burst was sent the last of its 50
replies arrived, for both contenders.

Goal: ``ratio = HTTP p99 ÷ 100 ms <= 1`` (Slack's own deadline is 3,000 ms), met in
five ``--quick`` runs of five rounds each (``p99_ms_by_round`` lists each round's p99).
The server is the control plane's own (waitress, :mod:`jobs.web.server`); a change of server
is judged against runs of the previous code taken in the same sitting, alternating with
the new. The last line of stdout is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slack_bolt import BoltRequest

from bench._ack_client import CHANNEL, SECRET, TEAM, USER, burst
from bot.slack_notifier import SlackNotifier
from bot.slack_wsgi import SlackFrontEnd, attach
from jobs.domain.lifecycle import RunState
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings
from jobs.usecases import service
from jobs.usecases.service import Actor
from tests.fakes.slack_api import FakeSlack

GOAL_P99_MS = 100.0
#: Rounds of ``--quick``: the goal is judged over five quick runs of five rounds each.
QUICK_ROUNDS = 5
SLACK_DEADLINE_MS = 3000.0
TOKEN = "xoxb-bench"
#: The training run: the tiny example, long enough to outlast the benchmark, flat out.
TRAINING = "command=python -m runner.examples.tiny --steps 1000000 --step-delay 0"


class BenchError(Exception):
    """The benchmark could not run; the message says what to fix."""


def log(message: str) -> None:
    """Progress on stderr: stdout's last line is the JSON result."""
    print(message, file=sys.stderr, flush=True)


class Client:
    """The load generator process, driven from here."""

    def __init__(self, url: str, response_url: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("_ack_client.py")), url, response_url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def burst(self, n: int) -> tuple[list[float], int]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{n}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise BenchError(f"the load generator died (exit {self.process.poll()})")
        result = json.loads(line)
        return [float(x) for x in result["latencies"]], int(result["failures"])

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


# --- the setup ---------------------------------------------------------------------------------


class Sink:
    """Slack's response_url endpoint: counts the replies the commands' work sends."""

    def __init__(self) -> None:
        self.count = 0
        #: The path of each reply, in order of arrival.
        self.paths: list[str] = []
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    outer.count += 1
                    outer.paths.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/commands/{TEAM}/1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Setup:
    cp: ControlPlane
    front: SlackFrontEnd
    fake: FakeSlack
    notifier: SlackNotifier
    run_id: str
    sink: Sink
    #: Commands sent so far (each one's work ends with a reply to the sink).
    sent: int = 0

    @property
    def url(self) -> str:
        assert self.cp.server is not None
        return f"{self.cp.server.url}/slack/events"


@contextmanager
def control_plane(root: Path, *, training: bool) -> Iterator[Setup]:
    """``trainbot serve`` with Slack, a fake Slack, and (optionally) a training run."""
    fake = FakeSlack(tokens=[TOKEN], post_interval_s=0.05, burst=5, team_id=TEAM).start()
    notifier = SlackNotifier(fake.client(TOKEN), min_interval_s=0.05)
    sink = Sink()
    settings = load_settings(
        {
            "TRAINBOT_STATE_DIR": str(root / "state"),
            "TRAINBOT_INGEST_PORT": "0",
            "TRAINBOT_NOTIFIER": "slack",
            "TRAINBOT_SLACK_SIGNING_SECRET": SECRET,
            "TRAINBOT_SLACK_BOT_TOKEN": TOKEN,
            "TRAINBOT_LOCAL_TERMINATION_WINDOW_S": "2",
        }
    )
    cp = ControlPlane(settings, notifier=notifier, scheduler=False)
    front = attach(cp, client=fake.client(TOKEN), notifier=notifier)
    cp.start()
    run_id = ""
    try:
        if training:
            run_id = start_training(cp)
        yield Setup(cp, front, fake, notifier, run_id, sink)
    finally:
        if run_id:
            try:
                service.stop(cp.deps, run_id, Actor(user=USER, channel=CHANNEL, is_admin=True))
            except Exception as exc:  # it may have ended on its own
                log(f"stopping the training run: {exc}")
        front.close()
        for instance in cp.deps.provider.list_instances():  # leave no training behind
            if not instance.state.is_terminal():
                cp.deps.provider.terminate(instance.instance_id)
        cp.close()
        notifier.close(timeout=5)
        fake.close()
        sink.close()


def start_training(cp: ControlPlane) -> str:
    """Launch the tiny example on the local provider; return once it reports telemetry."""
    actor = Actor(user=USER, channel=CHANNEL)
    run = service.submit(
        cp.deps, spec_name="tiny", overrides=["dry_run.enabled=false", TRAINING], actor=actor
    )
    waiting = {RunState.AWAITING_CONFIRMATION, RunState.LAUNCHING, RunState.PREFLIGHT_FAILED}
    state = service.wait_for(cp.deps, run.id, waiting, timeout_s=60)
    if state == RunState.AWAITING_CONFIRMATION:  # no dry run: preflight warns
        service.confirm(cp.deps, run.id, actor)
    elif state != RunState.LAUNCHING:
        raise BenchError(f"the training run {run.id} did not pass preflight ({state.value})")
    state = service.wait_for(cp.deps, run.id, {RunState.RUNNING}, timeout_s=120)
    if state != RunState.RUNNING:
        raise BenchError(f"the training run {run.id} is {state.value}, not running")
    deadline = time.monotonic() + 60
    while events_accepted(cp) == 0:
        if time.monotonic() > deadline:
            raise BenchError(f"the training run {run.id} sent no telemetry in 60 s")
        time.sleep(0.2)
    log(f"training run {run.id} is going")
    return run.id


def events_accepted(cp: ControlPlane) -> int:
    accepted = cp.app.metrics.value("trainbot_ingest_events_total", {"result": "accepted"})
    return int(accepted or 0)


# --- measuring ---------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def summary(latencies: list[float]) -> dict[str, float]:
    ms = [x * 1000 for x in latencies]
    return {
        "p50_ms": round(percentile(ms, 50), 2),
        "p99_ms": round(percentile(ms, 99), 2),
        "max_ms": round(max(ms), 2),
        "mean_ms": round(statistics.fmean(ms), 2),
    }


def measure(setup: Setup, *, rounds: int, concurrency: int) -> dict[str, Any]:
    client = Client(setup.url, setup.sink.url)

    def in_process(body: bytes, headers: dict[str, str]) -> int:
        request = BoltRequest(body=body.decode(), headers=dict(headers.items()))
        return setup.front.app.dispatch(request).status

    contenders: dict[str, Callable[[int], tuple[list[float], int]]] = {
        "http": client.burst,
        "bolt_dispatch": lambda n: burst(n, in_process, response_url=setup.sink.url),
    }
    try:
        for run_burst in contenders.values():  # warm up: thread pools at full size, imports
            run_burst(concurrency)
            setup.sent += concurrency
            drain(setup)
        latencies: dict[str, list[float]] = {name: [] for name in contenders}
        round_p99: dict[str, list[float]] = {name: [] for name in contenders}
        replies_done: dict[str, list[float]] = {name: [] for name in contenders}
        failures = dict.fromkeys(contenders, 0)
        events_before = events_accepted(setup.cp)
        started = time.monotonic()
        for index in range(rounds):
            order = list(contenders) if index % 2 == 0 else list(reversed(contenders))
            for name in order:
                sent_at = time.monotonic()
                got, failed = contenders[name](concurrency)
                setup.sent += concurrency
                latencies[name] += got
                round_p99[name].append(summary(got)["p99_ms"])
                failures[name] += failed
                drain(setup)
                replies_done[name].append(time.monotonic() - sent_at)
            log(
                f"round {index + 1}/{rounds}: http p99 "
                f"{summary(latencies['http'])['p99_ms']:.1f} ms, bolt p99 "
                f"{summary(latencies['bolt_dispatch'])['p99_ms']:.1f} ms"
            )
        elapsed = time.monotonic() - started
        events = events_accepted(setup.cp) - events_before
    finally:
        client.close()
    return {
        "http": {**summary(latencies["http"]), "requests": len(latencies["http"])},
        "bolt_dispatch": {
            **summary(latencies["bolt_dispatch"]),
            "requests": len(latencies["bolt_dispatch"]),
        },
        "replies_done_ms": {
            name: {
                "p50": round(percentile(done, 50) * 1000, 1),
                "max": round(max(done) * 1000, 1),
            }
            for name, done in replies_done.items()
        },
        "p99_ms_by_round": round_p99,
        "failures": failures,
        "commands": setup.sent,
        "replies": setup.sink.count,
        "training_events_during": events,
        "training_events_per_s": round(events / elapsed, 1) if elapsed > 0 else None,
    }


def drain(setup: Setup, timeout: float = 30.0) -> None:
    """Wait for the work behind the last burst (its replies) so bursts do not overlap."""
    deadline = time.monotonic() + timeout
    while setup.sink.count < setup.sent and time.monotonic() < deadline:
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="5 rounds (under a minute)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 20, or 5 quick)")
    p.add_argument("--concurrency", type=int, default=50, help="requests at once (default 50)")
    p.add_argument(
        "--no-training", action="store_true", help="measure without a training run (for comparison)"
    )
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="scratch dir")
    args = p.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else QUICK_ROUNDS if args.quick else 20
    if rounds < 1 or args.concurrency < 1:
        p.error("--rounds and --concurrency must be at least 1")
    if not args.dir.is_dir():
        p.error(f"--dir {args.dir} is not a directory")
    root = Path(tempfile.mkdtemp(prefix="trainbot-ack-", dir=args.dir))
    try:
        with control_plane(root, training=not args.no_training) as setup:
            figures = measure(setup, rounds=rounds, concurrency=args.concurrency)
            figures["training_run"] = setup.run_id or None
            figures["training_nice"] = setup.cp.settings.local_nice if setup.run_id else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    http_p99 = figures["http"]["p99_ms"]
    bolt_p99 = figures["bolt_dispatch"]["p99_ms"]
    figures["http_over_bolt_p99"] = round(http_p99 / bolt_p99, 2) if bolt_p99 > 0 else None
    figures["slack_deadline_ms"] = SLACK_DEADLINE_MS
    figures["concurrency"] = args.concurrency
    figures["rounds"] = rounds
    ok = sum(figures["failures"].values()) == 0
    ratio = http_p99 / GOAL_P99_MS
    doc = {
        "bench": "ack_latency",
        "ratio": round(ratio, 4),
        "goal": 1.0,
        "goal_is": f"ratio <= 1.0 (HTTP p99 <= {GOAL_P99_MS:.0f} ms)",
        "met": ok and ratio <= 1.0,
        "figures": figures,
        "quick": bool(args.quick),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
    }
    sys.stdout.flush()
    print(json.dumps(doc), flush=True)


def run() -> int:
    try:
        main()
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(run())

"""The load generators of ``bench_load.py``: the runners' side and Slack's side of the wire.

Each kind runs in a process of its own (``python -m bench._load_client runners|slack``),
as the instances and Slack are other machines, so their threads share no interpreter
with the replicas or with each other. The configuration comes as one JSON line on
stdin (it holds the runners' tokens, which must not show in ``ps``); then ``go`` starts
the load and ``stop`` ends it. The process prints ``ready`` once set up and, at the end,
one JSON line with what it saw.

Both kinds reach the two replicas through :class:`Balancer`, the clients' own round
robin, standing in for the team's load balancer (with passive health checks, as nginx's
``max_fails``/``fail_timeout`` or an L4 balancer behave): each request goes to the next
replica; a connection that fails (refused, reset by a dying listener, timed out) marks
that replica down for :data:`DOWN_S` and the request goes to the other at once (nothing
was sent, so any balancer retries it); a connection that breaks after the request was
sent is an error the client sees. After ``stop`` a runner still holding events sends
them at once, with its backoff started again, for up to :data:`DRAIN_S`.

A simulated runner does what :class:`runner.telemetry.Reporter` does, without its disk
spool: events are numbered per attempt, shipped once a second as one batch (real wire
bodies, :func:`runner.wire.encode_batch`, the attempt's own bearer token), and a batch
that got no answer, a 5xx, a 408 or a 429 is sent again, with whatever was emitted
meanwhile, after the Reporter's backoff (0.25 s, doubling, jittered, at most 30 s); 401
and 403 stop the runner, 400/413/422 drop the batch. One batch in flight per runner, so
everything below the highest seq sent went out at least once.

A Slack command is one signed ``/train status`` form POST on a fresh connection, as
Slack sends them, timed from the moment it was due (so a stalled client does not hide a
stalled server) to the whole answer read; Slack does not retry a slash command, and one
whose connection broke, or that took over 3 s, failed.
"""

from __future__ import annotations

import http.client
import itertools
import json
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from bench._ack_client import command_body, signed
from runner.wire import Event, encode_batch

#: Seconds a replica whose connection was refused is skipped (then tried again).
DOWN_S = 2.0
#: The Reporter's timeout, first backoff, backoff cap and batch limit.
INGEST_TIMEOUT_S = 5.0
BASE_BACKOFF_S = 0.25
MAX_BACKOFF_S = 30.0
BATCH_MAX = 500
#: Slack shows the user an error when the acknowledgement takes longer.
SLACK_DEADLINE_S = 3.0
#: After ``stop``, how long the runners may take to deliver what they still hold.
DRAIN_S = 30.0


class Failed(Exception):
    """No HTTP answer: ``kind`` is ``no_replica`` (none took the connection), ``reset``
    or ``timeout`` (after the request was sent)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


@dataclass
class Tally:
    """What one process saw; its methods are called from many threads."""

    latencies: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    #: Connection errors by kind (``refused`` counts each refused connect, failed over).
    connection_errors: Counter[str] = field(default_factory=Counter)
    #: (unix time, what) of every connection error and 5xx, for the timeline.
    incidents: list[tuple[float, str]] = field(default_factory=list)
    by_replica: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def connection_error(self, kind: str) -> None:
        with self.lock:
            self.connection_errors[kind] += 1
            self.incidents.append((time.time(), kind))

    def answer(self, replica: str, status: int, latency: float) -> None:
        with self.lock:
            self.statuses[status] += 1
            self.by_replica[replica] += 1
            self.latencies.append(latency)
            if status >= 500:
                self.incidents.append((time.time(), f"http {status}"))

    def as_json(self) -> dict[str, Any]:
        return {
            "latencies": self.latencies,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "connection_errors": dict(self.connection_errors),
            "incidents": self.incidents,
            "by_replica": dict(self.by_replica),
        }


class Balancer:
    """Round robin over the replicas, skipping one whose connection was just refused."""

    def __init__(self, urls: list[str], tally: Tally) -> None:
        self.urls = urls
        self._tally = tally
        self._turn = itertools.count()
        self._down_until = [0.0] * len(urls)
        self._lock = threading.Lock()

    def _order(self) -> list[int]:
        with self._lock:
            first = next(self._turn) % len(self.urls)
            now = time.monotonic()
            turns = [(first + k) % len(self.urls) for k in range(len(self.urls))]
            return sorted(turns, key=lambda i: self._down_until[i] > now)  # live ones first

    def _down(self, index: int) -> None:
        with self._lock:
            self._down_until[index] = time.monotonic() + DOWN_S

    def post(
        self, path: str, body: bytes, headers: dict[str, str], *, timeout: float
    ) -> tuple[str, int, bytes]:
        """(replica, status, body) of the first replica that takes the connection.

        A failure to connect (refused, reset by a dying listener, timed out) sent
        nothing, so the next replica is tried at once, as a balancer does; each is
        counted. A failure after the request went out raises :class:`Failed`.
        """
        for index in self._order():
            url = self.urls[index]
            parts = urlsplit(url)
            connection = http.client.HTTPConnection(
                parts.hostname or "127.0.0.1", parts.port, timeout=timeout
            )
            try:
                try:
                    connection.connect()
                except OSError as exc:
                    self._down(index)
                    self._tally.connection_error(_connect_error(exc))
                    continue
                try:
                    connection.request("POST", path, body=body, headers=headers)
                    response = connection.getresponse()
                    answer = response.read()
                except TimeoutError as exc:
                    raise Failed("timeout") from exc
                except (OSError, http.client.HTTPException) as exc:
                    self._down(index)
                    raise Failed("reset") from exc
                return url, response.status, answer
            finally:
                connection.close()
        raise Failed("no_replica")  # every one failed to connect (each counted above)


def _connect_error(exc: OSError) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, TimeoutError):
        return "connect_timeout"
    return "connect_reset"


def _wait(until: float, stop: threading.Event | None = None) -> None:
    delay = until - time.monotonic()
    if delay > 0:
        if stop is None:
            time.sleep(delay)
        else:
            stop.wait(delay)


# --- runners ---------------------------------------------------------------------------------


@dataclass
class Runner:
    """One simulated runner: its attempt, its token, and how far it got."""

    run: str
    attempt: str
    token: str
    #: Events generated, not yet acknowledged.
    pending: list[Event] = field(default_factory=list)
    #: Every seq below this was in at least one POST.
    sent_upto: int = 0
    #: Every seq below this was acknowledged.
    acked_upto: int = 0
    next_seq: int = 0
    step: int = 0
    batches: int = 0
    stopped: str | None = None
    #: Events the server answered as already stored (a retry of a stored batch).
    duplicates: int = 0
    deliveries: list[float] = field(default_factory=list)

    def emit(self, now: float, count: int, *, rng: random.Random) -> None:
        """One second's events, like a runner at ``count`` steps a second: metrics for
        each step, a system sample every 10 s, a heartbeat every 30 s and a checkpoint
        every 60 s (the system and heartbeat replacing a step's metrics)."""
        self.batches += 1
        for index in range(count):
            self.step += 1
            at = now - (count - index) / count
            kind, data = "metrics", self._metrics(rng)
            if index == count - 1 and self.batches % 10 == 0:
                kind, data = "system", _system(rng, self.step)
            elif index == count - 2 and self.batches % 30 == 0:
                kind, data = "heartbeat", {"step": self.step}
            elif index == count - 3 and self.batches % 60 == 0:
                kind, data = "checkpoint_committed", _checkpoint(self.run, self.step)
            self.pending.append(Event(self.attempt, self.next_seq, kind, at, self.run, data))
            self.next_seq += 1

    def _metrics(self, rng: random.Random) -> dict[str, Any]:
        return {
            "step": self.step,
            "loss": 2.0 / (1 + self.step / 5000) + 0.3 + rng.gauss(0, 0.005),
            "step_time_s": 0.05 + rng.random() * 0.002,
            "data_wait_fraction": 0.04,
            "metrics": {"lr": 3e-4, "grad_norm": 1.0 + rng.random()},
        }


def _system(rng: random.Random, step: int) -> dict[str, Any]:
    return {
        "gpu_util": 88.0 + rng.random() * 8,
        "gpu_count": 8,
        "disk_used": 40_000_000_000 + step * 1000,
        "disk_total": 500_000_000_000,
        "disk_path": "/scratch",
    }


def _checkpoint(run: str, step: int) -> dict[str, Any]:
    return {
        "step": step,
        "bytes": 2_500_000_000,
        "write_s": 4.2,
        "uri": f"file:///ckpt/{run}/{step}",
    }


class Runners:
    """Every simulated runner, a thread each, ticking once a second at its own phase."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.tally = Tally()
        self.balancer = Balancer(config["replicas"], self.tally)
        self.events_per_batch = int(config["events_per_batch"])
        self.runners = [Runner(r["run"], r["attempt"], r["token"]) for r in config["runners"]]
        self.stopping = threading.Event()
        self.drain_deadline = 0.0

    def run(self, start: float) -> None:
        threads = [
            threading.Thread(target=self._loop, args=(r, start + i / len(self.runners), i))
            for i, r in enumerate(self.runners)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def stop(self) -> None:
        self.drain_deadline = time.monotonic() + DRAIN_S
        self.stopping.set()

    def _loop(self, runner: Runner, first_tick: float, seed: int) -> None:
        try:
            self._deliver(runner, first_tick, seed)
        except Exception as exc:  # the result says so, rather than a thread dying quietly
            runner.stopped = f"load client error: {type(exc).__name__}: {exc}"

    def _deliver(self, runner: Runner, first_tick: float, seed: int) -> None:
        rng = random.Random(seed)
        tick, retry_at, failures, drained_once = first_tick, 0.0, 0, False
        since = 0.0  # when the batch in delivery was first sent
        while True:
            if self.stopping.is_set():
                if not runner.pending or runner.stopped or time.monotonic() > self.drain_deadline:
                    return
                # The load is over: what is held goes now, with the Reporter's backoff
                # again from its start (a Reporter asleep for 30 s would get there later).
                if failures and not drained_once:
                    failures, retry_at, drained_once = 0, 0.0, True
                _wait(retry_at)
            else:
                _wait(min(tick, retry_at) if runner.pending else tick, self.stopping)
                now = time.monotonic()
                if now >= tick and not self.stopping.is_set():
                    runner.emit(time.time(), self.events_per_batch, rng=rng)
                    tick += 1.0
                if runner.stopped or now < retry_at or not runner.pending:
                    continue
            batch = runner.pending[:BATCH_MAX]
            if not since:
                since = time.monotonic()
            runner.sent_upto = max(runner.sent_upto, batch[-1].seq + 1)
            outcome = self._send(runner, batch)
            if outcome == "acked":
                del runner.pending[: len(batch)]
                runner.acked_upto = batch[-1].seq + 1
                runner.deliveries.append(time.monotonic() - since)
                since, failures, retry_at = 0.0, 0, 0.0
            elif outcome == "retry":
                failures += 1
                ceiling = min(MAX_BACKOFF_S, BASE_BACKOFF_S * 2 ** min(failures - 1, 30))
                retry_at = time.monotonic() + random.uniform(ceiling / 2, ceiling)
            elif outcome == "drop":
                del runner.pending[: len(batch)]
                since = 0.0
            else:
                runner.stopped = outcome
                return

    def _send(self, runner: Runner, batch: list[Event]) -> str:
        body = encode_batch(batch)
        headers = {
            "Authorization": f"Bearer {runner.token}",
            "Content-Type": "application/json",
        }
        started = time.perf_counter()
        try:
            replica, status, answer = self.balancer.post(
                "/v1/events", body, headers, timeout=INGEST_TIMEOUT_S
            )
        except Failed as exc:
            self.tally.connection_error(exc.kind)
            return "retry"
        self.tally.answer(replica, status, time.perf_counter() - started)
        if 200 <= status < 300:
            runner.duplicates += int(json.loads(answer).get("duplicates", 0))
            return "acked"
        if status in (401, 403):
            return f"refused with HTTP {status}: {answer[:200].decode(errors='replace')}"
        if status in (400, 413, 422):
            return "drop"
        return "retry"

    def result(self) -> dict[str, Any]:
        return {
            **self.tally.as_json(),
            "runners": [
                {
                    "attempt": r.attempt,
                    "sent_upto": r.sent_upto,
                    "acked_upto": r.acked_upto,
                    "generated": r.next_seq,
                    "pending": len(r.pending),
                    "duplicates": r.duplicates,
                    "stopped": r.stopped,
                }
                for r in self.runners
            ],
            "deliveries": [d for r in self.runners for d in r.deliveries],
        }


# --- Slack -----------------------------------------------------------------------------------


class Slack:
    """``/train status`` at a steady rate, from the runs' channels in turn."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.tally = Tally()
        self.balancer = Balancer(config["replicas"], self.tally)
        self.rate = float(config["commands_per_s"])
        self.channels: list[str] = config["channels"]
        self.response_url: str = config["response_url"]
        self.stopping = threading.Event()
        self.sent = 0
        #: Command number -> the replica that acknowledged it (answered 200).
        self.acked: dict[int, str] = {}

    def stop(self) -> None:
        self.stopping.set()

    def run(self, start: float) -> None:
        with ThreadPoolExecutor(max_workers=32) as pool:
            for k in itertools.count():
                due = start + k / self.rate
                _wait(due, self.stopping)
                if self.stopping.is_set():
                    break
                pool.submit(self._command, k, due, self.channels[k % len(self.channels)])
                self.sent += 1

    def _command(self, number: int, due: float, channel: str) -> None:
        """Command ``number``; its reply goes to ``{response_url}/{number}``."""
        body = command_body("status", f"{self.response_url}/{number}", channel=channel)
        headers = signed(body, now=time.time())
        try:
            replica, status, _ = self.balancer.post(
                "/slack/events", body, headers, timeout=SLACK_DEADLINE_S
            )
        except Failed as exc:
            self.tally.connection_error(exc.kind)
            return
        self.tally.answer(replica, status, time.monotonic() - due)
        if status == 200:
            with self.tally.lock:
                self.acked[number] = replica

    def result(self) -> dict[str, Any]:
        return {**self.tally.as_json(), "sent": self.sent, "acked": self.acked}


# --- the process -----------------------------------------------------------------------------


def main(kind: str) -> None:
    config = json.loads(sys.stdin.readline())
    load: Runners | Slack = Runners(config) if kind == "runners" else Slack(config)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    start = time.monotonic()
    worker = threading.Thread(target=load.run, args=(start,))
    worker.start()
    sys.stdin.readline()  # "stop", or the parent went away
    load.stop()
    worker.join()
    print(json.dumps({**load.result(), "cpu_s": time.process_time()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

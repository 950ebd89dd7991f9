"""The load generator of ``bench_ack_latency.py``: Slack's side of the wire.

It runs in its own process, as Slack does, so its threads do not share an interpreter
(or a GIL) with the server it measures, and it imports nothing but the standard library,
so it starts at once. One burst per line on stdin (the number of requests), one JSON
line per burst on stdout: each request's latency in seconds and how many failed.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable
from urllib.parse import urlencode, urlsplit

SECRET = "bench-signing-secret"
TEAM = "T0BENCH"
CHANNEL = "C0BENCH"
USER = "U0BENCH"


# --- the requests ----------------------------------------------------------------------------


def signed(body: bytes, *, now: float) -> dict[str, str]:
    """Slack's v0 signature headers for ``body``."""
    ts = str(int(now))
    base = b"v0:" + ts.encode() + b":" + body
    digest = hmac.new(SECRET.encode(), base, hashlib.sha256).hexdigest()
    return {
        "Content-Type": "application/x-www-form-urlencoded",
        "X-Slack-Request-Timestamp": ts,
        "X-Slack-Signature": f"v0={digest}",
    }


def command_body(text: str, response_url: str, *, channel: str = CHANNEL) -> bytes:
    """A /train form body with a fresh trigger id (so each one is a new command)."""
    return urlencode(
        {
            "token": "legacy",
            "team_id": TEAM,
            "team_domain": "bench",
            "channel_id": channel,
            "channel_name": "bench",
            "user_id": USER,
            "user_name": "bench",
            "command": "/train",
            "text": text,
            "api_app_id": "A0BENCH",
            "trigger_id": f"trg-{uuid.uuid4().hex}",
            "response_url": response_url,
        }
    ).encode()


def burst(
    n: int, send: Callable[[bytes, dict[str, str]], int], *, response_url: str
) -> tuple[list[float], int]:
    """``n`` requests released together; their latencies (s) and how many failed."""
    bodies = [command_body("status", response_url) for _ in range(n)]
    now = time.time()
    headers = [signed(b, now=now) for b in bodies]
    barrier = threading.Barrier(n)
    latencies: list[float] = []
    failures = 0
    lock = threading.Lock()

    def one(i: int) -> None:
        nonlocal failures
        barrier.wait()
        started = time.perf_counter()
        try:
            status = send(bodies[i], headers[i])
        except Exception:
            status = 0
        took = time.perf_counter() - started
        with lock:
            latencies.append(took)
            if status != 200:
                failures += 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, failures


def post(url: str, body: bytes, headers: dict[str, str]) -> int:
    """One POST on a fresh connection, as Slack makes them; the status once all is read."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
    try:
        connection.request("POST", parts.path, body=body, headers=headers)
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def client_loop(url: str, response_url: str) -> None:
    """Serve bursts until stdin closes."""
    for line in sys.stdin:
        n = int(line)
        latencies, failures = burst(
            n, lambda body, headers: post(url, body, headers), response_url=response_url
        )
        print(json.dumps({"latencies": latencies, "failures": failures}), flush=True)


if __name__ == "__main__":
    client_loop(sys.argv[1], sys.argv[2])

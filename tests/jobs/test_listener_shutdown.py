"""A listener's shutdown when its loop can no longer be reached.

Once in 2,500 tests a fresh-clone run saw ``Listening.shutdown`` raise ``OSError: [Errno
9] Bad file descriptor``: the loop's wake-up pipe was closed (waitress's loop closes it on
a hang-up or an error of the pipe), so pulling it failed and nothing was closed. Shutting
down must still close the port and never raise."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING

import pytest

from jobs.web.http_listener import Limits, listen
from tests.waiting import wait_until

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

LIMITS = Limits(
    threads=1,
    connection_limit=16,
    channel_timeout_s=30.0,
    request_deadline_s=30.0,
    max_connections_per_client=0,
    max_request_body_size=1 << 16,
)


def _hello(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "5")])
    return [b"hello"]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return conn.recv(100).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_listener_whose_loop_cannot_be_reached_still_shuts_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    listening = listen(_hello, "127.0.0.1", 0, name="probe", limits=LIMITS)
    assert _answers(listening.port)
    idle = socket.create_connection(("127.0.0.1", listening.port), timeout=5)
    mine = idle.getsockname()
    wait_until(
        lambda: any(getattr(c, "addr", None) == mine for c in list(listening._map.values())),
        timeout=10,
        what="the loop to accept the idle connection",
    )
    # What the loop does on a hang-up of its wake-up pipe.
    listening._listeners[0].trigger.close()
    with caplog.at_level(logging.WARNING, logger="jobs.web.http_listener"):
        listening.shutdown(1.0)  # raised OSError (EBADF) before
    assert "its loop cannot be reached" in caplog.text
    # Closed from the shutting-down thread; the kernel lets the port go once the loop's
    # poll (a second at most) returns the descriptors it was watching.
    wait_until(lambda: _refused(listening.port), timeout=10, what="the port to close")
    idle.settimeout(5)
    try:
        ended = idle.recv(1)  # its connection was closed too: the end of the stream...
    except ConnectionResetError:
        ended = b""  # ...or a reset
    finally:
        idle.close()
    assert ended == b""

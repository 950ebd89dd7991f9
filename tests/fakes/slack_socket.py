"""Slack's Socket Mode endpoint on 127.0.0.1: a WebSocket server speaking Slack's protocol.

How Socket Mode works, and what this fake does at each step:

1. The app calls ``apps.connections.open`` with its app-level token; the fake Web API
   (:class:`tests.fakes.slack_api.FakeSlack`, with this server attached) answers
   ``{"ok": true, "url": "ws://127.0.0.1:<port>/link/?ticket=<one-time>&app_id=…"}``.
2. The app opens that URL: an HTTP/1.1 ``GET`` with ``Upgrade: websocket``
   (RFC 6455 §4). The server checks the handshake and the ticket (used once, as
   Slack's are), answers ``101 Switching Protocols`` with the ``Sec-WebSocket-Accept``
   derived from the client's key, then sends Slack's ``hello`` message.
3. Slack sends each request as a JSON *envelope* in a text frame: ``envelope_id``,
   ``type`` (``slash_commands``, ``interactive``, ``events_api``), ``payload`` and
   ``accepts_response_payload``. The app acknowledges by sending back
   ``{"envelope_id": …, "payload": …}`` within 3 s.
4. ``{"type": "disconnect", "reason": "refresh_requested"}`` asks the app to connect
   again (through ``apps.connections.open``) before the old connection is dropped.

Frames follow RFC 6455 §5: the client's are masked (an unmasked one is a protocol
error: close 1002), the server's are not; pings are answered with pongs carrying the
same data; fragmented messages are reassembled; a close is answered with a close. Tests
send envelopes (:meth:`FakeSocketMode.send_envelope`, :meth:`FakeSocketMode.slash_command`),
wait for their acknowledgements (:meth:`FakeSocketMode.wait_ack`) and see every
connection (:attr:`FakeSocketMode.connections`): when it opened, what it received, and
when and how it ended.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.fakes.loopback import ClosedOnExit
from tests.fakes.slack_api import FakeSlack

__all__ = ["FakeSocketMode", "SocketConnection"]

#: RFC 6455 §1.3: appended to the client's key before hashing.
_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_TEXT, _BINARY, _CLOSE, _PING, _PONG, _CONTINUATION = 0x1, 0x2, 0x8, 0x9, 0xA, 0x0
#: Frames larger than this are refused (close 1009); Slack's are a few kilobytes.
_MAX_FRAME = 1 << 20


class _ProtocolError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass
class SocketConnection:
    """One WebSocket connection from the app, as the server saw it."""

    ticket: str
    opened_at: float
    #: Every JSON message the app sent, in order (acknowledgements, mostly).
    received: list[dict[str, Any]] = field(default_factory=list)
    #: Pings the app sent (each answered with a pong).
    pings: int = 0
    #: Set when the connection has ended, however it ended.
    ended: threading.Event = field(default_factory=threading.Event)
    #: How it ended: "close frame" (the app sent a close), "eof" (the app closed the
    #: socket), "server" (closed from this side), or "protocol error: …".
    end_reason: str | None = None
    #: The status code of the app's close frame, if it sent one.
    close_code: int | None = None
    _sock: socket.socket | None = field(default=None, repr=False)
    _send_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def send_json(self, message: dict[str, Any]) -> None:
        """Send a text frame (unmasked, as a server must)."""
        self._send_frame(_TEXT, json.dumps(message).encode("utf-8"))

    def close(self, code: int = 1000, reason: str = "") -> None:
        """Close from the server's side: a close frame, then the socket."""
        try:
            self._send_frame(_CLOSE, struct.pack("!H", code) + reason.encode("utf-8"))
        except OSError:
            pass
        self._end("server")

    def _send_frame(self, opcode: int, payload: bytes) -> None:
        sock = self._sock
        if sock is None:
            raise OSError("the connection has ended")
        with self._send_lock:
            sock.sendall(_frame(opcode, payload))

    def _end(self, reason: str) -> None:
        if self.end_reason is None:
            self.end_reason = reason
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.ended.set()


class FakeSocketMode(ClosedOnExit):
    """Slack's Socket Mode WebSocket server; attaches itself to ``fake``'s
    ``apps.connections.open``. Use as a context manager."""

    def __init__(self, fake: FakeSlack, *, app_id: str = "A0TRAIN") -> None:
        self.fake = fake
        self.app_id = app_id
        self.cond = threading.Condition()
        #: Every connection that completed the handshake, oldest first.
        self.connections: list[SocketConnection] = []
        #: Handshakes refused, with why ("bad ticket", "not a websocket upgrade", …).
        self.refused: list[str] = []
        self._tickets: set[str] = set()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self.port = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> FakeSocketMode:
        listener = socket.create_server(("127.0.0.1", 0))
        self.port = listener.getsockname()[1]
        self._listener = listener
        accept = threading.Thread(target=self._accept_loop, name="fake-socket-mode", daemon=True)
        accept.start()
        self._threads.append(accept)
        self.fake.socket_mode = self
        return self

    def close(self) -> None:
        if self.fake.socket_mode is self:
            self.fake.socket_mode = None
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        for connection in list(self.connections):
            if not connection.ended.is_set():
                connection.close(1001, "server going away")

    def __enter__(self) -> FakeSocketMode:
        return self.start() if self._listener is None else self

    def open_url(self) -> str:
        """A fresh one-time URL, as ``apps.connections.open`` answers."""
        ticket = uuid.uuid4().hex
        with self.cond:
            self._tickets.add(ticket)
        return f"ws://127.0.0.1:{self.port}/link/?ticket={ticket}&app_id={self.app_id}"

    # ------------------------------------------------------------------ test controls

    def wait_connected(self, count: int = 1, timeout: float = 10.0) -> SocketConnection:
        """The ``count``-th connection, once it has been made (and greeted)."""
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.connections) >= count, timeout):
                raise AssertionError(
                    f"no connection number {count} within {timeout} s "
                    f"(got {len(self.connections)}; refused: {self.refused})"
                )
            return self.connections[count - 1]

    @property
    def current(self) -> SocketConnection:
        """The newest connection that has not ended."""
        with self.cond:
            live = [c for c in self.connections if not c.ended.is_set()]
        if not live:
            raise AssertionError("no open Socket Mode connection")
        return live[-1]

    def send_envelope(
        self,
        type_: str,
        payload: dict[str, Any],
        *,
        accepts_response_payload: bool = True,
        connection: SocketConnection | None = None,
    ) -> str:
        """Send a request as Slack does; returns its envelope id."""
        envelope_id = str(uuid.uuid4())
        envelope = {
            "envelope_id": envelope_id,
            "type": type_,
            "payload": payload,
            "accepts_response_payload": accepts_response_payload,
            "retry_attempt": 0,
            "retry_reason": "",
        }
        (connection or self.current).send_json(envelope)
        return envelope_id

    def slash_command(self, payload: dict[str, Any], **kwargs: Any) -> str:
        """Send a slash command's payload (the same fields as its HTTP form)."""
        return self.send_envelope("slash_commands", payload, **kwargs)

    def request_refresh(self, connection: SocketConnection | None = None) -> None:
        """Ask the app to reconnect, as Slack does every few hours."""
        (connection or self.current).send_json(
            {
                "type": "disconnect",
                "reason": "refresh_requested",
                "debug_info": {"host": "fake-socket-mode"},
            }
        )

    def acks(self, envelope_id: str) -> list[dict[str, Any]]:
        """Every acknowledgement of ``envelope_id``, on any connection."""
        with self.cond:
            return [
                m
                for c in self.connections
                for m in c.received
                if m.get("envelope_id") == envelope_id
            ]

    def wait_ack(self, envelope_id: str, timeout: float = 3.0) -> dict[str, Any]:
        """The app's acknowledgement of ``envelope_id``; Slack waits 3 s for it."""
        with self.cond:
            if not self.cond.wait_for(lambda: bool(self.acks(envelope_id)), timeout):
                raise AssertionError(f"envelope {envelope_id} was not acknowledged in {timeout} s")
        return self.acks(envelope_id)[0]

    # ------------------------------------------------------------------ serving

    def _accept_loop(self) -> None:
        while True:
            listener = self._listener
            if listener is None:
                return
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(30)
        reader = _Reader(sock)
        try:
            ticket = self._handshake(sock, reader)
        except (OSError, _ProtocolError) as exc:
            with self.cond:
                self.refused.append(str(exc))
                self.cond.notify_all()
            sock.close()
            return
        sock.settimeout(None)
        connection = SocketConnection(ticket=ticket, opened_at=time.monotonic(), _sock=sock)
        connection.send_json(
            {
                "type": "hello",
                "num_connections": 1,
                "debug_info": {"host": "fake-socket-mode", "approximate_connection_time": 18060},
                "connection_info": {"app_id": self.app_id},
            }
        )
        with self.cond:
            self.connections.append(connection)
            self.cond.notify_all()
        self._receive(connection, reader)
        with self.cond:
            self.cond.notify_all()

    def _handshake(self, sock: socket.socket, reader: _Reader) -> str:
        """RFC 6455 §4.2: check the opening handshake, answer 101; the ticket used."""
        head = reader.until(b"\r\n\r\n", limit=16384).decode("latin-1")
        request_line, *header_lines = head.split("\r\n")
        headers: dict[str, str] = {}
        for line in header_lines:
            if ":" in line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        parts = request_line.split(" ")
        problem = None
        if len(parts) != 3 or parts[0] != "GET" or not parts[2].startswith("HTTP/1.1"):
            problem = f"not an HTTP/1.1 GET: {request_line!r}"
        elif headers.get("upgrade", "").lower() != "websocket":
            problem = "not a websocket upgrade"
        elif "upgrade" not in headers.get("connection", "").lower():
            problem = "no Connection: Upgrade"
        elif headers.get("sec-websocket-version") != "13":
            problem = f"websocket version {headers.get('sec-websocket-version')!r}, not 13"
        elif not _valid_key(headers.get("sec-websocket-key", "")):
            problem = "no valid Sec-WebSocket-Key"
        ticket = ""
        if problem is None:
            url = urlsplit(parts[1])
            ticket = (parse_qs(url.query).get("ticket") or [""])[0]
            with self.cond:
                if url.path.rstrip("/") != "/link" or ticket not in self._tickets:
                    problem = "bad ticket"
                else:
                    self._tickets.discard(ticket)  # one connection per ticket
        if problem is not None:
            body = problem.encode("utf-8")
            sock.sendall(
                b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\n"
                + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            raise _ProtocolError(1002, problem)
        accept = base64.b64encode(
            hashlib.sha1(headers["sec-websocket-key"].encode("ascii") + _GUID).digest()
        ).decode("ascii")
        sock.sendall(
            (
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n"
            ).encode("ascii")
        )
        return ticket

    def _receive(self, connection: SocketConnection, reader: _Reader) -> None:
        message = bytearray()
        message_opcode: int | None = None
        while True:
            try:
                fin, opcode, payload = _read_frame(reader)
            except _ProtocolError as exc:
                connection.end_reason = f"protocol error: {exc.reason}"
                connection.close(exc.code, exc.reason)
                return
            except (OSError, EOFError):
                connection._end("eof")
                return
            if opcode == _PING:
                connection.pings += 1
                try:
                    connection._send_frame(_PONG, payload)
                except OSError:
                    pass
            elif opcode == _PONG:
                continue
            elif opcode == _CLOSE:
                if len(payload) >= 2:
                    connection.close_code = struct.unpack("!H", payload[:2])[0]
                try:
                    connection._send_frame(_CLOSE, payload[:2])
                except OSError:
                    pass
                connection._end("close frame")
                return
            else:
                if opcode == _CONTINUATION:
                    if message_opcode is None:
                        connection.end_reason = "protocol error: a stray continuation"
                        connection.close(1002, "continuation without a first frame")
                        return
                else:
                    if message_opcode is not None:
                        connection.end_reason = "protocol error: an interleaved message"
                        connection.close(1002, "new message inside a fragmented one")
                        return
                    message_opcode = opcode
                message += payload
                if fin:
                    self._deliver(connection, message_opcode, bytes(message))
                    message = bytearray()
                    message_opcode = None

    def _deliver(self, connection: SocketConnection, opcode: int, data: bytes) -> None:
        if opcode != _TEXT:
            connection.close(1003, "Slack's messages are JSON text")
            return
        try:
            message = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            connection.close(1007, "not JSON")
            return
        with self.cond:
            connection.received.append(message if isinstance(message, dict) else {"raw": message})
            self.cond.notify_all()


class _Reader:
    """Buffered reads of exact sizes from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()

    def _fill(self) -> None:
        chunk = self._sock.recv(65536)
        if not chunk:
            raise EOFError("the peer closed the connection")
        self._buffer += chunk

    def exactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            self._fill()
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    def until(self, marker: bytes, *, limit: int) -> bytes:
        while marker not in self._buffer:
            if len(self._buffer) > limit:
                raise _ProtocolError(1009, "handshake too long")
            self._fill()
        end = self._buffer.index(marker) + len(marker)
        out = bytes(self._buffer[:end])
        del self._buffer[:end]
        return out


def _read_frame(reader: _Reader) -> tuple[bool, int, bytes]:
    """One client frame (RFC 6455 §5.2): (FIN, opcode, unmasked payload)."""
    first, second = reader.exactly(2)
    fin = bool(first & 0x80)
    if first & 0x70:
        raise _ProtocolError(1002, "reserved bits set without an extension")
    opcode = first & 0x0F
    if opcode not in (_CONTINUATION, _TEXT, _BINARY, _CLOSE, _PING, _PONG):
        raise _ProtocolError(1002, f"unknown opcode {opcode:#x}")
    if not second & 0x80:
        raise _ProtocolError(1002, "a client frame must be masked")
    length = second & 0x7F
    if length == 126:
        length = struct.unpack("!H", reader.exactly(2))[0]
    elif length == 127:
        length = struct.unpack("!Q", reader.exactly(8))[0]
    if opcode >= _CLOSE and (length > 125 or not fin):
        raise _ProtocolError(1002, "control frames are short and never fragmented")
    if length > _MAX_FRAME:
        raise _ProtocolError(1009, f"frame of {length} bytes is too big")
    mask = reader.exactly(4)
    data = reader.exactly(length)
    return fin, opcode, bytes(b ^ mask[i % 4] for i, b in enumerate(data))


def _frame(opcode: int, payload: bytes) -> bytes:
    """One unmasked, final server frame."""
    head = bytes([0x80 | opcode])
    n = len(payload)
    if n < 126:
        head += bytes([n])
    elif n < 1 << 16:
        head += bytes([126]) + struct.pack("!H", n)
    else:
        head += bytes([127]) + struct.pack("!Q", n)
    return head + payload


def _valid_key(key: str) -> bool:
    """RFC 6455 §4.1: the key is 16 random bytes, base64-encoded."""
    try:
        return len(base64.b64decode(key, validate=True)) == 16
    except ValueError:
        return False

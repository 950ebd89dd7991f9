"""One hardened waitress listener: its own socket map, loop thread and thread pool.

:func:`jobs.web.server.serve` runs two of these, the public port (Slack, runner ingest) and
the admin port (``/healthz``, ``/readyz``, ``/metrics``); nothing one does can hold the
other up, because they share no loop, no connection count and no thread.

waitress parses requests on one asynchronous loop and hands the application complete
requests only, so a slow client holds a socket, never a thread. What waitress alone does
not bound, and this listener does:

- **A deadline for the whole request.** waitress closes a connection after a stretch of
  *silence*; a client that sends one header line every few seconds is never silent and
  kept its socket forever. Here every request's head and body must arrive within
  ``request_deadline_s`` of its first byte (of the connection's opening, for the first
  request), or the connection is closed. A request being answered is never cut off.
- **Connections per client address.** Past ``max_connections_per_client`` from one
  address, a new connection is closed at once, before anything is read: one client
  cannot take the connection limit for itself. 0 turns the cap off (behind a proxy every
  client has the proxy's address).
- **The connection limit, without a lock-out.** waitress stops accepting at its limit,
  so whoever holds the limit locks everyone else out until they let go. Here, at the
  limit, a new connection takes the place of the connection whose unfinished request
  arrives slowest (bytes a second since its first byte, counting the bytes the kernel
  already holds for it, so that a loop busy with a flood, which has not read a steady
  upload's latest pieces, does not take it for a slow one; a connection not read from
  yet is spared for a moment, and idle keep-alive ones go last): a client that sends its
  request at once, or uploads a batch at any real link's pace, is never the slowest
  while tricklers hold slots, so tricklers from many addresses are evicted and the limit
  costs the clients who behave nothing but a reconnect of an idle socket. A flood that
  reconnects faster than the loop reads a new connection's first bytes still wins; the
  admin port, another listener, answers the probes all the same.
"""

from __future__ import annotations

import array
import bisect
import errno
import heapq
import json
import logging
import resource
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer
from waitress.task import ErrorTask, ThreadedTaskDispatcher

try:
    import fcntl
    import termios

    #: The ioctl that says how many received bytes wait unread in a socket (Linux, macOS).
    _FIONREAD: int | None = termios.FIONREAD
except (ImportError, AttributeError):  # Windows: pace from the bytes read alone
    _FIONREAD = None

if TYPE_CHECKING:
    from wsgiref.types import WSGIApplication

__all__ = ["Limits", "Listening", "listen"]

log = logging.getLogger(__name__)

_JSON_TYPE = "application/json"
#: Descriptors kept free above the connection limit: the database, log files, the
#: listeners, the runner subprocesses' pipes.
_SPARE_DESCRIPTORS = 256
#: Bytes every unfinished request is counted as having sent at its start, so that a
#: connection accepted a moment ago, whose request has not been read yet, is not the
#: slowest: its pace starts high and falls only if its bytes do not follow.
_PACE_PRIOR_BYTES = 1024
#: Seconds a connection accepted but not yet read from is spared eviction (while any
#: connection that has been read from is slower): a flood's accepts must not evict the
#: connections accepted just before them, whose requests the loop has not read yet.
_UNHEARD_GRACE_S = 1.0
#: Seconds accepting pauses when the process is out of descriptors.
_DESCRIPTOR_PAUSE_S = 0.5
#: Connections accepted in one turn of the loop, at most.
_ACCEPTS_PER_TURN = 64
#: A client refused again within this many seconds is not logged again.
_REFUSAL_LOG_S = 60.0


@dataclass(frozen=True)
class Limits:
    """What one listener allows; each bound is explained in the module docstring."""

    #: Threads running the application (requests answered at once).
    threads: int
    #: Connections held at once; at the limit the oldest unfinished one is evicted.
    connection_limit: int
    #: Seconds of silence (idle keep-alive, or a response nobody reads) before a close.
    channel_timeout_s: float
    #: Seconds a request's head and body may take to arrive, from its first byte.
    request_deadline_s: float
    #: Connections at once from one client address; 0: no cap.
    max_connections_per_client: int
    #: Bodies over this many bytes are refused 413 from their headers, unread.
    max_request_body_size: int
    #: How often the deadlines and the silence are checked, in seconds.
    cleanup_interval_s: float = 1.0


class _JsonErrorTask(ErrorTask):
    """waitress's own refusals (broken HTTP, a body over the cap) as the routes' JSON."""

    def execute(self) -> None:
        error = self.request.error
        if error.code == 413:
            cap = self.channel.adj.max_request_body_size
            message = (
                f"the request body is over this server's {cap}-byte limit; "
                "send fewer events per batch"
            )
        else:
            message = f"{error.reason}: {error.body}"
        body = json.dumps({"error": message}).encode("utf-8")
        self.status = f"{error.code} {error.reason}"
        self.response_headers.append(("Content-Type", _JSON_TYPE))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)
        # One line per broken client; the request line may be garbage, so it is not logged.
        log.info("refused a request from %s: %s (%s)", self.channel.addr[0], self.status, message)


class _Channel(HTTPChannel):
    """A connection that knows when its unfinished request began."""

    error_task_class = _JsonErrorTask
    server: _Listener

    def __init__(self, server: _Listener, sock: Any, addr: Any, adj: Adjustments, map: Any) -> None:
        super().__init__(server, sock, addr, adj, map=map)
        #: When the request being received began (the connection's opening for the
        #: first one); None while no request is partly received.
        self.request_since: float | None = self.creation_time
        #: Bytes of it received so far (its pace decides who is evicted at the limit).
        self.request_bytes = 0
        #: Whether anything has been read from it yet.
        self.heard = False
        self.client = addr[0] if isinstance(addr, tuple) else str(addr)
        self._counted = False

    def received(self, data: bytes) -> bool:
        if self.request_since is None and self.request is None:
            self.request_since = time.time()
            self.request_bytes = 0
        before = self.request
        self.request_bytes += len(data)
        self.heard = True
        result = bool(super().received(data))
        if self.request is None:
            self.request_since = None  # every request received is complete
        elif before is not None and self.request is not before:
            self.request_since = time.time()  # a pipelined one began in this read
            self.request_bytes = 0
        return result

    def service(self) -> None:
        super().service()
        if self.request is not None:
            # A pipelined request waited behind this one: its clock starts now.
            self.request_since = time.time()

    def count(self) -> None:
        self._counted = True
        self.server.clients[self.client] += 1

    def del_channel(self, map: Any = None) -> None:
        super().del_channel(map)
        if self._counted:
            self._counted = False
            self.server.release(self.client)


class _Listener(TcpWSGIServer):
    """waitress's TCP server with the deadline, the per-client cap and eviction."""

    channel_class = _Channel
    next_channel_cleanup: float = 0.0

    def __init__(
        self,
        app: WSGIApplication,
        socket_map: dict[int, Any],
        *,
        name: str,
        limits: Limits,
        dispatcher: ThreadedTaskDispatcher,
        adj: Adjustments,
        sockinfo: Any,
    ) -> None:
        self.name = name
        self.limits = limits
        #: Connections open per client address (only addresses with one or more).
        self.clients: Counter[str] = Counter()
        self._refusals_logged: dict[str, float] = {}
        self._paused_until = 0.0
        super().__init__(app, socket_map, dispatcher=dispatcher, adj=adj, sockinfo=sockinfo)

    def readable(self) -> bool:
        now = time.time()
        if now >= self.next_channel_cleanup:
            self.next_channel_cleanup = now + self.limits.cleanup_interval_s
            self.maintenance(now)
        if now < self._paused_until:
            return False  # out of descriptors a moment ago: let some close first
        return bool(self.accepting)  # at the limit, accepting evicts (handle_accept)

    def maintenance(self, now: float) -> None:
        """Close the connections past their request deadline or silent too long."""
        late = now - self.limits.request_deadline_s
        silent = now - self.limits.channel_timeout_s
        for channel in list(self.active_channels.values()):
            if channel.requests or channel.will_close:
                continue  # a request being answered is never cut off
            since = channel.request_since
            if (since is not None and since < late) or channel.last_activity < silent:
                channel.will_close = True

    def handle_accept(self) -> None:
        # Every connection waiting, not one per turn of the loop: a turn polls every
        # socket, and a backlog of a flood's reconnects must not make a runner wait
        # that many turns.
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                pair = self.accept()
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    # Polling a listener that cannot accept would spin the loop.
                    self._paused_until = time.time() + _DESCRIPTOR_PAUSE_S
                    log.warning("%s port: out of file descriptors; pausing accepts", self.name)
                return  # else the client left before it was accepted
            if pair is None:
                return  # none left waiting
            self._take(*pair)

    def _take(self, conn: Any, addr: Any) -> None:
        client = addr[0] if isinstance(addr, tuple) else str(addr)
        cap = self.limits.max_connections_per_client
        if cap and self.clients[client] >= cap:
            self._refuse(conn, client, f"it already holds {cap} connections")
            return
        if len(self._map) >= self.limits.connection_limit and not self._evict():
            self._refuse(conn, client, "every connection is answering a request")
            return
        try:
            self.set_socket_options(conn)
        except OSError:
            conn.close()
            return
        channel = self.channel_class(self, conn, addr, self.adj, map=self._map)
        channel.count()

    def release(self, client: str) -> None:
        self.clients[client] -= 1
        if self.clients[client] <= 0:
            del self.clients[client]

    def _evict(self) -> bool:
        """Make room: close the connections whose unfinished requests arrive slowest
        (:func:`_pace`), then the ones not read from yet, then the longest idle ones; a
        twentieth of the limit at once, so that a flood costs one scan per twenty
        connections, not one each. False when every connection is answering or sending
        a response."""
        candidates = [
            channel
            for channel in self.active_channels.values()
            if not (channel.requests or channel.total_outbufs_len or channel.close_when_flushed)
        ]
        victims = _slowest(candidates, max(1, self.limits.connection_limit // 20), time.time())
        for victim in victims:
            victim.handle_close()
        return bool(victims)

    def _refuse(self, conn: Any, client: str, why: str) -> None:
        conn.close()
        now = time.monotonic()
        if now - self._refusals_logged.get(client, -_REFUSAL_LOG_S) < _REFUSAL_LOG_S:
            return
        if len(self._refusals_logged) > 1000:
            self._refusals_logged.clear()
        self._refusals_logged[client] = now
        log.warning(
            "%s port: refused connections from %s: %s (logged once a minute)",
            self.name,
            client,
            why,
        )


def _pace(channel: _Channel, now: float, unread: int) -> tuple[int, float, float]:
    """How fast ``channel``'s unfinished request arrives, slowest first: bytes a second
    since it began, :data:`_PACE_PRIOR_BYTES` and ``unread`` (the bytes the kernel holds
    for it) included; then the connections not read from yet, then the idle ones."""
    since = channel.request_since
    if since is None:
        return (2, channel.last_activity, 0.0)  # idle between requests
    if not channel.heard and now - channel.creation_time < _UNHEARD_GRACE_S:
        # Accepted a moment ago, in this turn of the loop perhaps: not read yet.
        return (1, channel.creation_time, 0.0)
    sent = channel.request_bytes + unread + _PACE_PRIOR_BYTES
    return (0, sent / max(now - since, 0.001), since)


def _slowest(channels: list[_Channel], room: int, now: float) -> list[_Channel]:
    """The ``room`` channels that :func:`_pace` puts first.

    The loop reads a connection a ``recv`` at a time, and one busy with a flood can
    leave a steady upload's latest pieces unread: what the kernel holds counts as
    received. Asking costs a system call, which hands the interpreter to other threads
    (a slow scan when the application's threads are busy), so it is asked only of the
    channels that the bytes read alone put first, until no channel left, whatever it
    holds, can be slower than those found: the bytes held only raise a pace."""
    by_read = [(_pace(channel, now, 0), n, channel) for n, channel in enumerate(channels)]
    heapq.heapify(by_read)
    found: list[tuple[tuple[int, float, float], int, _Channel]] = []
    while by_read and (len(found) < room or by_read[0][0] < found[-1][0]):
        key, n, channel = heapq.heappop(by_read)
        if key[0] == 0:
            key = _pace(channel, now, _unread_bytes(channel.socket))
        bisect.insort(found, (key, n, channel))
        del found[room:]
    return [channel for _, _, channel in found]


def _unread_bytes(sock: Any) -> int:
    """Bytes received for ``sock`` that wait in the kernel, unread; 0 where it cannot say."""
    if _FIONREAD is None:
        return 0
    held = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), _FIONREAD, held, True)
    except (OSError, ValueError):  # closed meanwhile
        return 0
    return held[0]


def _ensure_descriptors(wanted: int) -> int:
    """Raise the soft descriptor limit toward ``wanted``; the connections it allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(16, soft - _SPARE_DESCRIPTORS)


@dataclass(frozen=True)
class Listening:
    """A running listener: where it listens, and how to stop it."""

    #: ``http://host:port``.
    url: str
    #: The bound port (the real one when 0 was asked for).
    port: int
    _listeners: list[_Listener]
    _map: dict[int, Any]
    _dispatcher: ThreadedTaskDispatcher
    _thread: threading.Thread
    _stopped: threading.Event = field(default_factory=threading.Event)

    @property
    def accepting(self) -> bool:
        """Whether it takes new connections (False once shutting down)."""
        return not self._stopped.is_set() and self._thread.is_alive()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop accepting, let the requests being answered finish (up to ``timeout``),
        then close every connection and the threads."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        deadline = time.monotonic() + timeout
        closed = threading.Event()

        def stop_accepting() -> None:
            for listener in self._listeners:
                listener.accepting = False
                listener.del_channel()
                listener.socket.close()
            closed.set()

        if not self._in_loop(stop_accepting):
            stop_accepting()
        closed.wait(max(0.0, deadline - time.monotonic()))
        dispatcher = self._dispatcher
        while time.monotonic() < deadline:
            with dispatcher.lock:
                if not dispatcher.queue and dispatcher.active_count <= 0:
                    break
            time.sleep(0.01)

        def close_all() -> None:
            for each in list(self._map.values()):
                if isinstance(each, HTTPChannel):
                    each.handle_close()  # also frees its buffers (temporary files)
                else:
                    each.close()
            self._map.clear()

        if not self._in_loop(close_all):
            close_all()  # the loop cannot be told: its sockets are closed from here
        self._thread.join(max(0.1, deadline - time.monotonic()))
        dispatcher.shutdown(cancel_pending=True, timeout=max(0.1, deadline - time.monotonic()))

    def _in_loop(self, thunk: Callable[[], None]) -> bool:
        """Run ``thunk`` on the listener's loop thread (the only one that may touch sockets).

        False where the loop cannot be reached: its wake-up pipe is closed (the loop
        closes it on a hang-up or an error of the pipe), so nothing pulled would run."""
        trigger = self._listeners[0].trigger
        try:
            if trigger._closed:  # waitress's own flag: the pipe's descriptors are gone
                raise OSError(errno.EBADF, "the listener's wake-up pipe is closed")
            trigger.pull_trigger(thunk)
        except OSError as exc:
            with trigger.lock:  # what was queued will never run
                trigger.thunks.clear()
            log.warning(
                "port %d: its loop cannot be reached (%s); closing its sockets from here",
                self.port,
                exc.strerror or exc,
            )
            return False
        return True


def listen(app: WSGIApplication, host: str, port: int, *, name: str, limits: Limits) -> Listening:
    """Serve ``app`` on ``host:port`` on a loop thread of its own; ``port=0`` picks one."""
    connection_limit = min(limits.connection_limit, _ensure_descriptors(limits.connection_limit))
    if connection_limit < limits.connection_limit:
        log.warning(
            "%s port: the descriptor limit (ulimit -n) allows %d connections, not %d",
            name,
            connection_limit,
            limits.connection_limit,
        )
        limits = Limits(**{**limits.__dict__, "connection_limit": connection_limit})
    adj = Adjustments(
        host=host,
        port=port,
        threads=limits.threads,
        connection_limit=limits.connection_limit,
        channel_timeout=limits.channel_timeout_s,
        cleanup_interval=limits.cleanup_interval_s,
        max_request_body_size=limits.max_request_body_size,
        asyncore_use_poll=True,  # no select() limit of 1,024 descriptors
        log_socket_errors=False,
        expose_tracebacks=False,
        ident="trainbot",
    )
    dispatcher = ThreadedTaskDispatcher()
    dispatcher.set_thread_count(limits.threads)
    socket_map: dict[int, Any] = {}
    listeners = [
        _Listener(
            app,
            socket_map,
            name=name,
            limits=limits,
            dispatcher=dispatcher,
            adj=adj,
            sockinfo=sockinfo,
        )
        for sockinfo in adj.listen
    ]
    bound = int(listeners[0].effective_port)  # waitress gives a str for some sockets
    thread = threading.Thread(target=listeners[0].run, name=f"http-{name}", daemon=True)
    thread.start()
    shown = f"[{host}]" if ":" in host else host
    return Listening(
        url=f"http://{shown}:{bound}",
        port=bound,
        _listeners=listeners,
        _map=socket_map,
        _dispatcher=dispatcher,
        _thread=thread,
    )

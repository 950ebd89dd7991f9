"""AWS at the network edge: moto's server on 127.0.0.1, and an S3 that always refuses.

Tests talk to these over real HTTP with the real boto3 client, so request signing,
retries, XML parsing and error codes are all exercised.
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
from moto.server import ThreadedMotoServer


class MotoServer:
    """moto's threaded server on a free port of 127.0.0.1."""

    def __init__(self) -> None:
        # Port 0: the kernel picks a free port, so parallel sessions never collide.
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint_url = ""

    def start(self) -> str:
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        return self.endpoint_url

    def stop(self) -> None:
        self._server.stop()


def create_bucket(endpoint_url: str, *, prefix: str = "test") -> str:
    """A new, uniquely named bucket on the server; returns its name."""
    name = f"{prefix}-{uuid.uuid4().hex[:16]}"
    client = boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1")
    client.create_bucket(Bucket=name)
    return name


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (connecting is refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _RefusingHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    status = 403
    code = "AccessDenied"

    def _refuse(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{self.code}</Code><Message>refused by the test</Message>"
            "<RequestId>fake</RequestId></Error>"
        ).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _refuse

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def refusing_s3(*, status: int = 403, code: str = "AccessDenied") -> Iterator[str]:
    """An S3 endpoint that answers every request with one error; yields its URL."""
    handler = type("Handler", (_RefusingHandler,), {"status": status, "code": code})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

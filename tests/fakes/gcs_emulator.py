"""Cloud Storage at the network edge: gcp-storage-emulator on 127.0.0.1, and a GCS that
always refuses.

The emulator runs as a subprocess (its own interpreter, as a real service would be) and
tests talk to it over real HTTP with the real google-cloud-storage client and the JSON
API, through ``STORAGE_EMULATOR_HOST`` (or ``GCSStore(emulator_host=…)``).

What the emulator does not do, and the store does not need from it: it cancels no
resumable session (``DELETE`` answers 501), names no answer of a batch (``Content-ID``),
and serves one request at a time. Those paths are covered by unit tests of the parts.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import requests

from tests.fakes.loopback import QuietHandler, read_body, reply_json, serving

#: The fake project the emulator's buckets belong to.
PROJECT = "trainbot-test"


# The emulator's own entry point, less one cost: after every write it serialises the
# metadata of every object it holds (pure-Python JSON), which makes writing n objects take
# O(n^2) time (a thousand small objects took 100 s). In memory that copy is never read
# back (it exists to reload a data directory), so it is skipped.
_MAIN = """
import sys
from gcp_storage_emulator import storage
from gcp_storage_emulator.__main__ import main

_save = storage.Storage._write_config_to_file


def _write_config_to_file(self):
    if not self._use_memory_fs:
        _save(self)


storage.Storage._write_config_to_file = _write_config_to_file
main(sys.argv[1:])
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class GcsEmulator:
    """gcp-storage-emulator, in memory, on a free port of 127.0.0.1."""

    def __init__(self) -> None:
        self.host = ""
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> str:
        """Start it and wait until it answers; returns its address (``http://127.0.0.1:N``)."""
        for _ in range(3):  # the port is free when picked; another process may take it
            port = _free_port()
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _MAIN,
                    "start",
                    "--host=127.0.0.1",
                    f"--port={port}",
                    "--in-memory",
                    "--quiet",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            self.host = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + timeout
            while self._proc.poll() is None and time.monotonic() < deadline:
                try:
                    if requests.get(self.host + "/", timeout=1).ok:
                        return self.host
                except requests.ConnectionError:
                    time.sleep(0.05)
            self.stop()
        raise RuntimeError("gcp-storage-emulator did not start: is it installed (pip install)?")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()

    def wipe(self) -> None:
        """Drop every object and every unfinished upload session, keeping the buckets."""
        requests.get(f"{self.host}/wipe", params={"keep-buckets": "true"}, timeout=10)


_shared: GcsEmulator | None = None
_users = 0


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[str]:
    """One emulator for the whole session (however many modules import this fixture);
    yields its address for ``STORAGE_EMULATOR_HOST``."""
    global _shared, _users
    if _shared is None:
        emulator = GcsEmulator()
        emulator.start()
        _shared = emulator
    _users += 1
    try:
        yield _shared.host
    finally:
        _users -= 1
        if _users == 0 and _shared is not None:
            _shared.stop()
            _shared = None


def create_bucket(host: str, *, prefix: str = "test") -> str:
    """A new, uniquely named bucket on the emulator, without soft delete (as checkpoint
    buckets should be: deleted checkpoints would bill for a week); returns its name."""
    name = f"{prefix}-{uuid.uuid4().hex[:16]}"
    requests.post(
        f"{host}/storage/v1/b", params={"project": PROJECT}, json={"name": name}, timeout=10
    ).raise_for_status()
    requests.patch(
        f"{host}/storage/v1/b/{name}",
        json={"softDeletePolicy": {"retentionDurationSeconds": 0}},
        timeout=10,
    ).raise_for_status()
    return name


class _RefusingHandler(QuietHandler):
    protocol_version = "HTTP/1.1"

    def _refuse(self) -> None:
        read_body(self)
        refusal = {
            "code": 403,
            "message": "refused by the test: the caller does not have permission",
            "errors": [{"reason": "forbidden", "domain": "global"}],
        }
        reply_json(self, 403, {"error": refusal})

    do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = _refuse


@contextmanager
def refusing_gcs() -> Iterator[str]:
    """A Cloud Storage JSON API that answers 403 to everything; yields its address."""
    with serving(_RefusingHandler) as url:
        yield url

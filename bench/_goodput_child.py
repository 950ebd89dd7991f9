"""The training process of bench_goodput: a loop whose costs are known and scaled.

Each step is ``--step-s`` seconds of simulated accelerator work (a sleep: the host waits
for the device, so several runs share two cores without slowing each other's steps)
plus a real in-place update of the state, ``--state-mb`` MiB of float32 that the session
checkpoints through the real asynchronous writer. The store is the run's real store
behind a bandwidth limit (``--store-mbps``): the local directory stands for an object
store whose upload and download speed is scaled by the same time-compression factor as
everything else, so a checkpoint's write and restore take the time they would at scale.

Configured through the environment like any run (``TRAINBOT_*``, set by the control
plane or the dry run). The session's own ``checkpoint_committed`` events carry the write
time and the stall of every save, which the benchmark's accounting reads.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from runner.errors import RunnerError
from runner.preemption import PreemptionFlag
from runner.session import Session, SessionConfig
from runner.store import ObjectInfo, Store, WriteStream, run_store

MiB = 1 << 20


class _Pace:
    """Sleeps so that bytes pass at no more than ``bps`` from the first transfer on.

    The clock starts when the first transfer starts (:meth:`begin`), not when it ends: the
    local copy stands for bytes arriving from the network, which at scale overlaps the
    transfer; counting it after the simulated transfer would charge it twice.
    """

    def __init__(self, bps: float) -> None:
        self.bps = bps
        self.start: float | None = None
        self.done = 0

    def begin(self) -> None:
        if self.start is None:
            self.start = time.perf_counter()

    def __call__(self, nbytes: int) -> None:
        """``nbytes`` more have passed since :meth:`begin`: wait for them to be due."""
        assert self.start is not None, "begin() comes first"
        now = time.perf_counter()
        self.done += nbytes
        due = self.start + self.done / self.bps
        if due > now:
            time.sleep(due - now)


class _SlowWrite:
    def __init__(self, inner: WriteStream, bps: float) -> None:
        self.inner = inner
        self.pace = _Pace(bps)

    def write(self, data: bytes | memoryview, /) -> int:
        self.pace.begin()
        n = self.inner.write(data)
        self.pace(len(data))
        return n

    def close(self) -> None:
        self.inner.close()

    def abort(self) -> None:
        self.inner.abort()


class _SlowRead:
    def __init__(self, inner: BinaryIO, bps: float) -> None:
        self.inner = inner
        self.pace = _Pace(bps)

    def read(self, n: int = -1) -> bytes:
        self.pace.begin()
        data = self.inner.read(n)
        self.pace(len(data))
        return data

    def readinto(self, buf: Any) -> int:
        self.pace.begin()
        n: int = self.inner.readinto(buf)  # type: ignore[attr-defined]
        self.pace(n or 0)
        return n

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> _SlowRead:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType
    ) -> None:
        self.close()


class ThrottledStore:
    """A store whose large objects move at a fixed bandwidth (small ones at full speed).

    With ``notice_jitter`` (sigma > 0), from the preemption notice on (``noticed()``) its
    uploads go ``f`` times slower, ``f`` lognormal(0, sigma) drawn once at the notice: the
    host's network throttled as it is taken away, or many preempted hosts writing to one
    bucket at once. Its reads and everything before the notice keep the fixed bandwidth.
    """

    def __init__(
        self,
        inner: Store,
        bps: float,
        *,
        noticed: Callable[[], bool] | None = None,
        notice_jitter: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.bps = bps
        self._noticed = noticed
        self._sigma = notice_jitter
        self._rng = rng or random.Random()
        #: The slowdown drawn at the notice; None before it.
        self.notice_factor: float | None = None

    def _write_bps(self) -> float:
        if self._sigma <= 0 or self._noticed is None or not self._noticed():
            return self.bps
        if self.notice_factor is None:
            self.notice_factor = self._rng.lognormvariate(0.0, self._sigma)
        return self.bps / self.notice_factor

    def open_write(self, key: str) -> WriteStream:
        return _SlowWrite(self.inner.open_write(key), self._write_bps())

    def put_bytes(self, key: str, data: bytes) -> None:
        self.inner.put_bytes(key, data)

    def open_read(self, key: str) -> BinaryIO:
        return _SlowRead(self.inner.open_read(key), self.bps)  # type: ignore[return-value]

    def get_bytes(self, key: str) -> bytes:
        return self.inner.get_bytes(key)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, keys: Sequence[str]) -> int:
        return self.inner.delete(keys)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)


class Weights:
    """The model and optimizer state, as one flat tensor of the size asked for."""

    def __init__(self, nbytes: int) -> None:
        self.t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"w": self.t}

    def load_state_dict(self, state: dict[str, torch.Tensor], /) -> None:
        self.t.copy_(state["w"])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench._goodput_child", description=__doc__)
    p.add_argument("--steps", type=int, required=True, help="steps of the whole run")
    p.add_argument("--step-s", type=float, required=True, help="seconds of work per step")
    p.add_argument("--state-mb", type=float, required=True, help="MiB of state to checkpoint")
    p.add_argument("--store-mbps", type=float, required=True, help="store bandwidth, MiB/s")
    p.add_argument(
        "--notice-jitter",
        type=float,
        default=0.0,
        help="from the preemption notice on, uploads go f times slower, f lognormal(0, "
        "SIGMA) drawn once per attempt (seeded by the attempt id; default 0: no jitter)",
    )
    p.add_argument(
        "--up-dir",
        type=Path,
        help="write the Unix time at which this process had imported what it runs to "
        "DIR/<TRAINBOT_ATTEMPT_ID> (the benchmark's clock for the attempt starts there)",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.step_s <= 0 or args.state_mb <= 0 or args.store_mbps <= 0:
        p.error("--steps, --step-s, --state-mb and --store-mbps must be positive")
    return args


def mark_up(up_dir: Path, at: float) -> None:
    """Say when this process was up: its interpreter started and torch and the runner
    imported. Written whole (a rename), as the benchmark polls for it."""
    attempt = os.environ.get("TRAINBOT_ATTEMPT_ID", "local")
    up_dir.mkdir(parents=True, exist_ok=True)
    tmp = up_dir / f".{attempt}.tmp"
    tmp.write_text(repr(at))
    tmp.replace(up_dir / attempt)


def main(argv: Sequence[str] | None = None) -> int:
    up_at = time.time()  # this module's imports (torch, the runner) are done
    args = parse_args(argv)
    if args.up_dir is not None:
        mark_up(args.up_dir, up_at)
    weights = Weights(int(args.state_mb * MiB))
    try:
        config = SessionConfig.from_env()
        store = run_store(config.checkpoint_uri, config.checkpoint_prefix or config.run_id)
        flag = PreemptionFlag()
        throttled = ThrottledStore(
            store,
            args.store_mbps * MiB,
            noticed=lambda: flag.is_set,
            notice_jitter=args.notice_jitter,
            rng=random.Random(os.environ.get("TRAINBOT_ATTEMPT_ID", "local")),
        )
        session = Session(config, store=throttled, flag=flag)
    except RunnerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The session restores this handler when it ends: a SIGTERM that arrives after that (the
    # supervisor forwards the notice it also got) must not kill the process on its way out.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with session as s:
        s.track(weights=weights)
        for step in s.steps(args.steps):
            time.sleep(args.step_s)
            weights.t[step % weights.t.numel()] += 1.0
            s.log(loss=1.0 / (1 + step))
    return s.exit_code


if __name__ == "__main__":
    sys.exit(main())

"""What every runner benchmark shares: options, the state it checkpoints, timing, output.

The benchmarks run as scripts (``python bench/bench_x.py --quick``), so they put the
repository root on ``sys.path`` before importing this module. Every figure is produced by
running the contenders side by side in one process tree, interleaved and repeated (the
order flips every round), with a sync and a pause before each, because the machines these
run on are noisy; medians are reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner.errors import RunnerError

MiB = 1 << 20
#: Model + optimizer state in full mode and in quick mode.
FULL_MB = 1024
QUICK_MB = 128
#: Hidden layers of the MLP whose state is checkpointed.
LAYERS = 8


class BenchError(Exception):
    """A benchmark could not run; the message says what to fix."""


@dataclass(frozen=True)
class Options:
    """Command-line options common to every benchmark."""

    #: Smaller state and fewer repeats: under a minute on two cores.
    quick: bool
    #: Bytes of model + optimizer state to checkpoint.
    size_bytes: int
    #: Rounds of each contender (interleaved).
    repeats: int
    #: Directory under which the benchmark makes (and removes) its temporary directory.
    parent_dir: Path


def parse_args(
    description: str,
    argv: Sequence[str] | None = None,
    *,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> tuple[Options, argparse.Namespace]:
    """The common options, and the namespace with whatever ``extra`` added."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help=f"{QUICK_MB} MiB state, 3 rounds")
    p.add_argument(
        "--size-mb",
        type=float,
        default=None,
        help=f"MiB of model + optimizer state (default {FULL_MB}, or {QUICK_MB} with --quick)",
    )
    p.add_argument("--repeats", type=int, default=None, help="rounds (default 6, or 3 quick)")
    p.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where to write (a temporary directory inside it is removed at the end)",
    )
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    size_mb = args.size_mb if args.size_mb is not None else QUICK_MB if args.quick else FULL_MB
    repeats = args.repeats if args.repeats is not None else 3 if args.quick else 6
    if not (math.isfinite(size_mb) and size_mb > 0):
        p.error(f"--size-mb must be a positive number, got {size_mb}")
    if repeats < 1:
        p.error(f"--repeats must be at least 1, got {repeats}")
    if not args.dir.is_dir():
        p.error(f"--dir {args.dir} is not a directory")
    opts = Options(
        quick=bool(args.quick),
        size_bytes=int(size_mb * MiB),
        repeats=repeats,
        parent_dir=args.dir.resolve(),
    )
    return opts, args


# ----------------------------------------------------------------------------- the state


class Mlp(nn.Module):
    """A plain MLP: enough like a real model (many tensors, weights and biases) to
    checkpoint, and cheap to run one step of on a CPU."""

    def __init__(self, width: int, *, layers: int = LAYERS, device: str | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, device=device) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class Never:
    """A checkpoint policy that is never due: the benchmark decides when to save."""

    def should_save(self, *, step: int, now: float, last_step: int, last_time: float) -> bool:
        return False


def width_for(size_bytes: int, *, layers: int = LAYERS) -> int:
    """MLP width whose fp32 params plus Adam's two moments come to about ``size_bytes``."""
    params = size_bytes / 3 / 4  # params are a third of the bytes, 4 bytes each
    return max(8, int(math.sqrt(params / layers)))


def build_model(size_bytes: int, *, seed: int = 0) -> tuple[Mlp, torch.optim.Adam]:
    """A model and an Adam optimizer whose state was filled by one real step."""
    torch.manual_seed(seed)
    width = width_for(size_bytes)
    model = Mlp(width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = model(torch.randn(4, width)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def build_skeleton(size_bytes: int) -> tuple[Mlp, torch.optim.Adam]:
    """The same model, allocated but not initialised, with an empty optimizer: what a
    process that is about to restore builds (random init would be wasted work)."""
    model = Mlp(width_for(size_bytes), device="meta").to_empty(device="cpu")
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def training_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def tensor_bytes(state: Any) -> int:
    """Bytes held in the tensors of a nested state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(tensor_bytes(v) for v in state)
    return 0


# ----------------------------------------------------------------------------- the disk


@contextlib.contextmanager
def temp_dir(parent: Path, name: str) -> Iterator[Path]:
    """A fresh directory under ``parent``, removed with everything in it on the way out."""
    path = Path(tempfile.mkdtemp(prefix=f"trainbot-{name}-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def disk_of(path: Path) -> str:
    """The device and file system ``path`` lives on, from /proc/mounts (Linux)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return f"unknown ({platform.system()})"
    best: tuple[str, str, str] | None = None
    target = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        source, mount, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) >= len(best[1])):
            best = (source, mount, fstype)
    if best is None:
        return "unknown"
    return f"{best[0]} ({best[2]}) on {best[1]}"


_DD_SECONDS = re.compile(r"copied, ([0-9.]+) s")


def dd_write(path: Path, nbytes: int, *, source: Path | None = None) -> float:
    """Seconds ``dd`` takes to write ``nbytes`` to a new file and fdatasync it: the raw
    sequential write bandwidth of the disk. It writes zeros from /dev/zero, or the bytes of
    ``source`` (see :func:`random_source`). The file is removed afterwards."""
    cmd = [
        "dd",
        f"if={source or '/dev/zero'}",
        f"of={path}",
        "bs=16M",
        f"count={nbytes}",
        "iflag=count_bytes",
        "conv=fdatasync",
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise BenchError("dd is not installed: install coreutils to run this benchmark") from exc
    finally:
        path.unlink(missing_ok=True)
    found = _DD_SECONDS.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise BenchError(f"dd failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    return float(found.group(1))


@contextlib.contextmanager
def random_source(fallback_dir: Path, nbytes: int) -> Iterator[Path]:
    """A file of ``nbytes`` random bytes, in memory (/dev/shm) where there is room, for dd
    to write real data: some virtual disks store zeros faster than anything else, which
    makes /dev/zero overstate the bandwidth a checkpoint gets. Removed on the way out."""
    shm = Path("/dev/shm")
    parent = fallback_dir
    with contextlib.suppress(OSError):
        if shm.is_dir() and shutil.disk_usage(shm).free > 2 * nbytes:
            parent = shm
    fd, name = tempfile.mkstemp(prefix="trainbot-bench-random-", dir=parent)
    path = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            left = nbytes
            while left:
                n = min(left, 64 * MiB)
                f.write(torch.randint(0, 256, (n,), dtype=torch.uint8).numpy().data)
                left -= n
        yield path
    finally:
        path.unlink(missing_ok=True)


def child_env(overrides: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without any ``TRAINBOT_*`` setting, plus ``overrides``:
    a benchmark's training process must not report to, or write into, a real run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINBOT_")}
    env.update(overrides)
    return env


def settle(opts: Options) -> None:
    """Between two contenders: flush what the last one left dirty (and the discards of the
    files it deleted), then pause, so that no contender pays for the one before it."""
    os.sync()
    time.sleep(0.2 if opts.quick else 1.0)


def drop_page_cache() -> bool:
    """Ask the kernel to drop clean cached pages (root only); False when not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


# ----------------------------------------------------------------------------- results


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def emit(
    name: str,
    *,
    ratio: float | None,
    goal: float,
    op: str,
    figures: dict[str, Any],
    opts: Options,
    checks: Sequence[Mapping[str, Any]] = (),
) -> None:
    """Print the result as the last line: ``ratio`` is judged against ``goal`` with ``op``
    ("<=" or ">="); ``met`` is false when the ratio could not be measured, or when one of
    ``checks`` (more goals, each with its own ``met``) is not met."""
    if op not in ("<=", ">="):
        raise ValueError(f"op must be '<=' or '>=', got {op!r}")
    met = ratio is not None and (ratio <= goal if op == "<=" else ratio >= goal)
    met = met and all(bool(c["met"]) for c in checks)
    doc = {
        "bench": name,
        "ratio": rounded(ratio),
        "goal": goal,
        "goal_is": f"ratio {op} {goal}",
        "met": met,
        **({"checks": [dict(c) for c in checks]} if checks else {}),
        "figures": figures,
        "quick": opts.quick,
        "size_mib": round(opts.size_bytes / MiB, 1),
        "repeats": opts.repeats,
        "machine": machine(),
    }
    sys.stdout.flush()
    print(json.dumps(doc), flush=True)


def run(main: Callable[[], None]) -> int:
    """Run a benchmark's main; a known failure is one line on stderr, not a traceback."""
    try:
        main()
    except (BenchError, RunnerError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted; temporary files removed", file=sys.stderr, flush=True)
        return 130
    return 0


def log(message: str) -> None:
    """Progress for the human watching; stderr, so stdout's last line stays the JSON."""
    print(message, file=sys.stderr, flush=True)

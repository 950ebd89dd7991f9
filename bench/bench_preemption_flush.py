"""How long an emergency checkpoint takes, from SIGTERM to the committed manifest.

Contenders, interleaved and repeated:

- ours: a real training process (``bench/_flush_child.py``) holds the model + Adam state
  in a ``Session`` whose policy never saves. Once its loop runs, this process sends it
  SIGTERM and notes the time; the child's loop sees the flag between steps, flushes a
  checkpoint (snapshot, shards with sha256, fdatasync, manifest) and prints the time
  the commit returned. The termination window is 120 s, so ``flush_fits`` lets it flush.
  This is the child's first save, so its staging buffers are allocated during the flush.
- raw: ``dd if=/dev/zero bs=16M conv=fdatasync`` of as many bytes as the checkpoint holds;
- raw_random: the same with random bytes from a file in memory, because some virtual
  disks store zeros faster than real data (reported, not judged).

Goal: flush <= 1.25 x raw (zeros).
"""

from __future__ import annotations

import contextlib
import json
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    BenchError,
    MiB,
    child_env,
    dd_write,
    disk_of,
    emit,
    log,
    median,
    parse_args,
    random_source,
    rounded,
    run,
    settle,
    temp_dir,
)
from runner import EXIT_PREEMPTED
from runner.checkpoint import MANIFEST, step_dir

GOAL = 1.25
CHILD = Path(__file__).resolve().parent / "_flush_child.py"
READY_TIMEOUT_S = 300.0
WINDOW_S = 120


def _readline(proc: subprocess.Popen[str], deadline: float) -> str:
    assert proc.stdout is not None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError("the training process did not answer in time")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            line = proc.stdout.readline()
            if not line:
                raise BenchError(f"the training process exited with {proc.wait()} early")
            return line.strip()


def flush_once(root: Path, size_mb: float) -> dict[str, Any]:
    """One training process, one SIGTERM, one emergency checkpoint; its timings."""
    env = child_env(
        {
            "TRAINBOT_CHECKPOINT_URI": str(root),
            "TRAINBOT_RUN_ID": "flush",
            "TRAINBOT_TERMINATION_WINDOW_S": str(WINDOW_S),
        }
    )
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), "--size-mb", str(size_mb)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        start = time.monotonic()
        if _readline(proc, start + READY_TIMEOUT_S) != "ready":
            raise BenchError("the training process printed something other than 'ready'")
        time.sleep(0.2)  # let it settle into its loop
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        report = json.loads(_readline(proc, time.monotonic() + READY_TIMEOUT_S))
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code != EXIT_PREEMPTED or report["committed_step"] != report["step"]:
        raise BenchError(
            f"the emergency checkpoint was not committed (exit {code}, report {report})"
        )
    manifest = root / "flush" / step_dir(report["step"]) / MANIFEST
    if not manifest.is_file():
        raise BenchError(f"{manifest} is missing after a reported commit")
    report["flush_s"] = report["committed_at"] - sent
    report["manifest_after_s"] = manifest.stat().st_mtime - sent
    shutil.rmtree(root / "flush")
    return report


def main(argv: list[str] | None = None) -> None:
    opts, _ = parse_args(__doc__ or "", argv)
    size_mb = opts.size_bytes / MiB
    log(f"preemption flush: {size_mb:.0f} MiB state, {opts.repeats} rounds")
    flushes: list[dict[str, Any]] = []
    raw: dict[str, list[float]] = {"raw": [], "raw_random": []}
    with temp_dir(opts.parent_dir, "bench-flush") as root, contextlib.ExitStack() as stack:
        noise: Path | None = None
        for r in range(opts.repeats):
            order = ["ours", "raw", "raw_random"]
            # Round 1 starts with ours, so the checkpoint's size is known before any dd.
            for contender in order if r % 2 == 0 else order[::-1]:
                settle(opts)
                if contender == "ours":
                    flushes.append(flush_once(root, size_mb))
                    continue
                nbytes = flushes[-1]["bytes"]
                if contender == "raw_random" and noise is None:
                    noise = stack.enter_context(random_source(root, nbytes))
                src = noise if contender == "raw_random" else None
                raw[contender].append(dd_write(root / "dd.bin", nbytes, source=src))
            f = flushes[-1]
            log(
                f"  round {r + 1}: flush {f['flush_s']:.3f}s (snapshot {f['stall_s']:.3f}s, "
                f"write {f['write_s']:.3f}s), raw {raw['raw'][-1]:.3f}s, "
                f"raw random {raw['raw_random'][-1]:.3f}s"
            )
    flush_s = median([f["flush_s"] for f in flushes])
    raw_s = median(raw["raw"])
    raw_random_s = median(raw["raw_random"])
    emit(
        "preemption_flush",
        ratio=flush_s / raw_s,
        goal=GOAL,
        op="<=",
        figures={
            "checkpoint_bytes": flushes[-1]["bytes"],
            "flush_s": rounded(flush_s),
            "raw_write_s": rounded(raw_s),
            "raw_random_write_s": rounded(raw_random_s),
            "ratio_vs_raw_random": rounded(flush_s / raw_random_s),
            "flush_snapshot_s": rounded(median([f["stall_s"] for f in flushes])),
            "flush_write_s": rounded(median([f["write_s"] for f in flushes])),
            "flush_all_s": [rounded(f["flush_s"]) for f in flushes],
            "manifest_mtime_after_sigterm_s": [rounded(f["manifest_after_s"]) for f in flushes],
            "raw_all_s": [rounded(v) for v in raw["raw"]],
            "raw_random_all_s": [rounded(v) for v in raw["raw_random"]],
            "termination_window_s": WINDOW_S,
            "disk": disk_of(opts.parent_dir),
        },
        opts=opts,
    )


if __name__ == "__main__":
    sys.exit(run(main))

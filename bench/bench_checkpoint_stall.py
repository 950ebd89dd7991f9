"""How long the training loop is blocked by one checkpoint.

Contenders, interleaved and repeated on the same model + Adam state:

- ours: ``CheckpointWriter.save`` until it returns (the loop copies tensors into staging
  buffers that are reused from save to save, so a warm-up save comes first);
- sync: ``torch.save`` of the same state into a file, then ``fsync``: a loop that saves
  without a background writer blocks for all of it;
- dcp: ``torch.distributed.checkpoint.async_save`` (single process, no process group,
  default stager) until it returns, after a warm-up save of its own.

Each background write is waited for (untimed) before the next contender starts, so every
timing starts from an idle disk. Goal: ours <= 1/10 of sync.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    build_model,
    disk_of,
    emit,
    log,
    median,
    parse_args,
    rounded,
    run,
    settle,
    temp_dir,
    tensor_bytes,
    training_state,
)
from runner.checkpoint import CheckpointWriter, step_dir
from runner.store import LocalStore

GOAL = 0.1


def _sync_save(state: Any, path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


class _Dcp:
    """DCP's async_save in one process; None and a reason when it cannot run here."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.error: str | None = None
        self._n = 0
        try:
            import torch.distributed.checkpoint as dcp

            self._dcp: Any = dcp
        except Exception as exc:  # an optional torch component: report, do not fail
            self._dcp = None
            self.error = f"torch.distributed.checkpoint unavailable: {exc}"

    def stall(self, state: Any) -> float | None:
        if self._dcp is None:
            return None
        self._n += 1
        target = self.root / f"dcp-{self._n}"
        try:
            with warnings.catch_warnings():
                # "torch.distributed is ... uninitialized, assuming ... a single process"
                warnings.simplefilter("ignore", UserWarning)
                t0 = time.perf_counter()
                fut = self._dcp.async_save(state, checkpoint_id=str(target))
                stall = time.perf_counter() - t0
                fut.result()
        except Exception as exc:
            self._dcp = None
            self.error = f"async_save failed: {type(exc).__name__}: {exc}"
            return None
        finally:
            shutil.rmtree(target, ignore_errors=True)
        return stall


def main(argv: list[str] | None = None) -> None:
    opts, _ = parse_args(__doc__ or "", argv)
    model, opt = build_model(opts.size_bytes)
    state = training_state(model, opt)
    nbytes = tensor_bytes(state)
    log(f"checkpoint stall: {nbytes / 2**20:.0f} MiB state, {opts.repeats} rounds")
    with temp_dir(opts.parent_dir, "bench-stall") as root:
        store = LocalStore(root / "ours")
        writer = CheckpointWriter(store)
        dcp = _Dcp(root)
        step = 0

        def ours() -> float:
            nonlocal step
            step += 1
            t0 = time.perf_counter()
            fut = writer.save(step, state)
            stall = time.perf_counter() - t0
            fut.result()
            shutil.rmtree(root / "ours" / step_dir(step), ignore_errors=True)
            return stall

        def sync() -> float:
            path = root / "sync.pt"
            try:
                return _sync_save(state, path)
            finally:
                path.unlink(missing_ok=True)

        try:
            ours()  # allocates the staging buffers once, as the first save of a run does
            dcp.stall(state)  # DCP's own first-call costs
            times: dict[str, list[float]] = {"ours": [], "sync": [], "dcp": []}
            contenders: list[tuple[str, Callable[[], float | None]]] = [
                ("ours", ours),
                ("sync", sync),
                ("dcp", lambda: dcp.stall(state)),
            ]
            for r in range(opts.repeats):
                order = contenders if r % 2 == 0 else contenders[::-1]
                for name, run in order:
                    settle(opts)
                    got = run()
                    if got is not None:
                        times[name].append(got)
                log(
                    f"  round {r + 1}: "
                    + ", ".join(f"{n} {v[-1]:.3f}s" for n, v in times.items() if v)
                )
        finally:
            writer.close()
    ours_s = median(times["ours"])
    sync_s = median(times["sync"])
    dcp_s = median(times["dcp"]) if times["dcp"] else None
    emit(
        "checkpoint_stall",
        ratio=ours_s / sync_s,
        goal=GOAL,
        op="<=",
        figures={
            "state_bytes": nbytes,
            "ours_stall_s": rounded(ours_s),
            "sync_save_fsync_s": rounded(sync_s),
            "dcp_async_save_stall_s": rounded(dcp_s),
            "dcp_error": dcp.error,
            "ratio_vs_async": rounded(ours_s / dcp_s) if dcp_s else None,
            "ours_stall_all_s": [rounded(v) for v in times["ours"]],
            "sync_all_s": [rounded(v) for v in times["sync"]],
            "dcp_all_s": [rounded(v) for v in times["dcp"]],
            "disk": disk_of(opts.parent_dir),
        },
        opts=opts,
    )


if __name__ == "__main__":
    sys.exit(run(main))

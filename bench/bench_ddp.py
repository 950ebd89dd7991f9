"""What a two-rank DDP run pays for the runner: the stop/save vote and the checkpoint stall.

The tiny_ddp model (``runner.examples.tiny``'s transformer, width 64, batch 8 a rank)
trains under ``torchrun`` with gloo on CPU (``bench/_ddp_child.py``), with 2 ranks and
with 1, interleaved (the order flips every round):

- vote share: the median time of the one ``all_reduce(MAX)`` the session adds after each
  step, over the median step time, at 2 ranks. Goal: <= 1 %.
- stall per rank: the median time a save blocks the loop (the snapshot into staging
  buffers; the write runs behind), the slowest rank's, at 2 ranks against 1.

    python bench/bench_ddp.py --quick
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    BenchError,
    child_env,
    emit,
    log,
    median,
    parse_args,
    rounded,
    run,
    temp_dir,
)

CHILD = Path(__file__).resolve().parent / "_ddp_child.py"
GOAL = 0.01


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(nproc: int, *, steps: int, saves: int, ckpt: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
        "--master-port", str(_free_port()), str(CHILD), str(steps), str(saves), str(ckpt),
    ]  # fmt: skip
    env = child_env({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = done.stderr[-2000:]
        raise BenchError(f"torchrun with {nproc} ranks failed ({done.returncode}): {tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def main() -> None:
    opts, _ = parse_args(__doc__ or "")
    steps, saves = (40, 5) if opts.quick else (200, 10)
    rounds = 1 if opts.quick else opts.repeats
    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    with temp_dir(opts.parent_dir, "bench-ddp") as tmp:
        for r in range(rounds):
            for nproc in (2, 1) if r % 2 == 0 else (1, 2):
                res = _launch(nproc, steps=steps, saves=saves, ckpt=tmp / f"ck-{r}-{nproc}")
                log(
                    f"  round {r + 1}, {nproc} rank(s): step {res['step_s'] * 1e3:.1f} ms, "
                    f"vote {res['vote_s'] * 1e6:.0f} us, stall {res['stall_s'] * 1e3:.1f} ms"
                )
                runs[nproc].append(res)
    step2 = median([r["step_s"] for r in runs[2]])
    vote2 = median([r["vote_s"] for r in runs[2]])
    stall1 = median([r["stall_s"] for r in runs[1]])
    stall2 = median([r["stall_s"] for r in runs[2]])
    share = vote2 / step2 if step2 > 0 else None
    figures = {
        "step_s_2_ranks": rounded(step2, 5),
        "vote_s_2_ranks": rounded(vote2, 6),
        "vote_share": rounded(share),
        "step_s_1_rank": rounded(median([r["step_s"] for r in runs[1]]), 5),
        "stall_s_1_rank": rounded(stall1, 5),
        "stall_s_2_ranks": rounded(stall2, 5),
        "stall_ratio_2_vs_1": rounded(stall2 / stall1 if stall1 > 0 else None),
        "steps": steps,
        "saves": saves,
        "rounds": rounds,
    }
    emit("ddp", ratio=share, goal=GOAL, op="<=", figures=figures, opts=opts)


if __name__ == "__main__":
    sys.exit(run(main))

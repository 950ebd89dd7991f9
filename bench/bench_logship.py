"""What shipping the command's output to the store costs the training loop.

Contenders, interleaved and repeated, each a real ``Supervisor`` around the same child:

- direct: the child writes to the runner's stdout (a file), as before logs were shipped;
- shipped: its output goes through the pipe to the runner, which echoes it to that file
  and ships it to a local store in gzip segments (:mod:`runner.logship`), unbuffered
  (the supervisor sets ``PYTHONUNBUFFERED`` so that a crash's lines keep their order).

The child does a couple of milliseconds of arithmetic per step (a small step: the share
of a line's cost is larger than on a GPU) and prints one line per step, as a training
script does; it measures its own step time (median). Goal: shipped <= 1.05 × direct. Also
reported, not judged: the cost per line of a child that only prints (bulk output).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit, log, median, parse_args, rounded, run, temp_dir
from runner.logship import LogShipper
from runner.store import LocalStore
from runner.supervisor import Supervisor
from runner.telemetry import NullSink

GOAL = 1.05

CHILD = textwrap.dedent(
    """
    import json, random, sys, time
    steps, bulk, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    # A step of pure-Python arithmetic (about 2 ms): no torch import in every round.
    w = [random.random() for _ in range(4096)]
    times = []
    for step in range(steps):
        t = time.perf_counter()
        loss = 0.0
        for _ in range(8):
            loss += sum(a * b for a, b in zip(w, w[1:]))
        print(f"step {step} loss {loss:.5f} lr 1e-3 tokens/s 123456.7")
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(bulk):
        print(f"{i:08d} some bulk output of a chatty data loader, 64 characters")
    bulk_s = time.perf_counter() - t
    times.sort()
    json.dump({"step_s": times[len(times) // 2], "bulk_s": bulk_s}, open(out, "w"))
    """
)


@contextmanager
def stdout_to(path: Path) -> Iterator[None]:
    """fd 1 (the runner's stdout, which the child or the echo writes) into a file, so this
    process's stdout keeps only the result."""
    sys.stdout.flush()
    saved = os.dup(1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(fd)
        os.close(saved)


def once(work: Path, mode: str, *, steps: int, bulk: int, round_: int) -> dict[str, float]:
    script = work / "child.py"
    out = work / f"{mode}-{round_}.json"
    logs = None
    if mode == "shipped":
        store = LocalStore(work / "store")
        logs = LogShipper(lambda: store, attempt=f"a-{round_}")
    with stdout_to(work / f"{mode}.out"):
        code = Supervisor(
            [sys.executable, str(script), str(steps), str(bulk), str(out)],
            sink=NullSink(),
            install_signals=False,
            scratch_dir=work,
            sample_s=3600,
            logs=logs,
            env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
        ).run()
    if code != 0:
        raise RuntimeError(f"the child exited {code}; see {work / f'{mode}.out'}")
    return dict(json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> None:
    opts, _ = parse_args(__doc__ or "", argv)
    steps, bulk = (500, 20_000) if opts.quick else (3000, 200_000)
    results: dict[str, list[dict[str, float]]] = {"direct": [], "shipped": []}
    with temp_dir(opts.parent_dir, "logship") as work:
        (work / "child.py").write_text(CHILD)
        for r in range(opts.repeats):
            order = ["direct", "shipped"] if r % 2 == 0 else ["shipped", "direct"]
            for mode in order:
                results[mode].append(once(work, mode, steps=steps, bulk=bulk, round_=r))
                log(f"round {r} {mode}: {results[mode][-1]}")
    step = {m: median([x["step_s"] for x in v]) for m, v in results.items()}
    line = {m: median([x["bulk_s"] for x in v]) / bulk for m, v in results.items()}
    emit(
        "logship",
        ratio=step["shipped"] / step["direct"],
        goal=GOAL,
        op="<=",
        figures={
            "steps": steps,
            "direct_step_s": rounded(step["direct"], 6),
            "shipped_step_s": rounded(step["shipped"], 6),
            "bulk_lines": bulk,
            "direct_per_line_us": rounded(line["direct"] * 1e6, 2),
            "shipped_per_line_us": rounded(line["shipped"] * 1e6, 2),
        },
        opts=opts,
    )


if __name__ == "__main__":
    sys.exit(run(main))

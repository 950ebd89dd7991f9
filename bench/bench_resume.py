"""How long a restarted training process takes to get back to training.

A checkpoint of the model + Adam state is written once through a ``Session``. Then,
interleaved and repeated:

- ours: a new process (``bench/_resume_child.py``) imports torch and the runner, creates
  a ``Session`` (which starts reading the newest checkpoint: list, manifest, shards read
  and sha256-verified), builds the model skeleton meanwhile, restores through the session
  (waits for the read, ``load_state_dict``) and prints the time of its first step;
  measured from just before this process spawns it;
- raw: a new process imports torch and reads the same files (shards and meta.pt) into
  memory, and prints the time it is done.

Before each run the page cache is dropped (root only; otherwise both run on a warm cache
and the output says so), then a throwaway process imports python, torch and the runner
and builds a tiny model skeleton and optimizer (which makes torch import the modules it
loads lazily), so that the checkpoint files are read cold and the libraries warm, for
both contenders. Goal: ours <= 1.5 x raw.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    BenchError,
    MiB,
    Never,
    build_model,
    child_env,
    disk_of,
    drop_page_cache,
    emit,
    log,
    median,
    parse_args,
    rounded,
    run,
    temp_dir,
)
from runner.checkpoint import MANIFEST, list_committed, read_manifest, step_dir
from runner.session import Session, SessionConfig
from runner.store import run_store

GOAL = 1.5
RUN_ID = "resume"
CHILD = Path(__file__).resolve().parent / "_resume_child.py"
RAW_READ = """
import sys, time
import torch
imported = time.time()
for path in sys.argv[1:]:
    with open(path, "rb", buffering=0) as f:
        data = f.read()
print(imported, time.time(), flush=True)
"""
ROOT = Path(__file__).resolve().parent.parent
#: Run after the page cache is dropped: every library either contender loads, including
#: the modules torch imports lazily the first time a model skeleton and an optimizer are
#: built (torch._refs, torch._dynamo), so that only the checkpoint files are read cold.
WARM_LIBS = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import torch, runner.session
from bench._common import build_skeleton
build_skeleton(1 << 20)
"""
TIMEOUT_S = 600.0


def _extra(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--keep-page-cache",
        action="store_true",
        help="do not drop the page cache (it affects everything on the machine)",
    )


def write_checkpoint(root: Path, size_bytes: int) -> list[Path]:
    """One committed checkpoint of the state, written the way a run writes it."""
    model, opt = build_model(size_bytes)
    config = SessionConfig(run_id=RUN_ID, checkpoint_uri=str(root))
    with Session(config, decision=Never(), install_signals=False) as s:
        s.track(model=model, optimizer=opt)
        for _ in s.steps(1):
            pass
    if s.exit_code != 0:
        raise BenchError(f"writing the checkpoint failed (exit code {s.exit_code})")
    store = run_store(str(root), RUN_ID)
    (entry,) = list_committed(store)
    manifest = read_manifest(store, entry.step)
    step = root / RUN_ID / step_dir(entry.step)
    return [step / f.name for f in manifest.files] + [step / MANIFEST]


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Spawn ``cmd``; the time just before spawning and its stdout's last line."""
    spawned = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise BenchError(f"{cmd[1]} exited with {done.returncode}: {done.stderr[-500:]}")
    return spawned, done.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> None:
    opts, args = parse_args(__doc__ or "", argv, extra=_extra)
    log(f"resume: {opts.size_bytes / MiB:.0f} MiB state, {opts.repeats} rounds")
    ours: list[dict[str, Any]] = []
    raw_s: list[float] = []
    raw_imported_s: list[float] = []
    cold: bool | None = None
    with temp_dir(opts.parent_dir, "bench-resume") as root:
        files = write_checkpoint(root, opts.size_bytes)
        nbytes = sum(p.stat().st_size for p in files)
        env = child_env({"TRAINBOT_CHECKPOINT_URI": str(root), "TRAINBOT_RUN_ID": RUN_ID})

        def prepare() -> bool:
            if args.keep_page_cache or not drop_page_cache():
                return False
            subprocess.run([sys.executable, "-c", WARM_LIBS], check=True, env=env)
            return True

        for r in range(opts.repeats):
            for contender in ("ours", "raw") if r % 2 == 0 else ("raw", "ours"):
                dropped = prepare()
                cold = dropped if cold is None else cold and dropped
                if contender == "ours":
                    spawned, line = _run([sys.executable, str(CHILD), str(opts.size_bytes)], env)
                    got = json.loads(line)
                    ours.append({k: v - spawned for k, v in got.items() if k.endswith("_at")})
                else:
                    paths = [str(p) for p in files]
                    spawned, line = _run([sys.executable, "-c", RAW_READ, *paths], env)
                    imported_at, done_at = (float(v) for v in line.split())
                    raw_imported_s.append(imported_at - spawned)
                    raw_s.append(done_at - spawned)
            o = ours[-1]
            log(
                f"  round {r + 1}: ours {o['first_step_at']:.3f}s (imports {o['imported_at']:.3f}"
                f", model {o['built_at']:.3f}, restored {o['restored_at']:.3f}), "
                f"raw {raw_s[-1]:.3f}s"
            )
    ours_s = median([o["first_step_at"] for o in ours])
    raw = median(raw_s)
    # The runner's own part: what is left of the restore once the model is built (the rest
    # of the read overlapped with building it) against the read alone.
    restore_only = median([o["restored_at"] - o["built_at"] for o in ours])
    read_only = median([d - i for d, i in zip(raw_s, raw_imported_s, strict=True)])
    emit(
        "resume",
        ratio=ours_s / raw,
        goal=GOAL,
        op="<=",
        figures={
            "checkpoint_bytes": nbytes,
            "ours_to_first_step_s": rounded(ours_s),
            "raw_read_s": rounded(raw),
            "ours_imports_done_s": rounded(median([o["imported_at"] for o in ours])),
            "ours_model_built_s": rounded(median([o["built_at"] for o in ours])),
            "ours_restored_s": rounded(median([o["restored_at"] for o in ours])),
            "ours_restore_only_s": rounded(restore_only),
            "raw_imports_done_s": rounded(median(raw_imported_s)),
            "raw_read_only_s": rounded(read_only),
            "ratio_restore_vs_read": rounded(restore_only / read_only),
            "ours_all_s": [rounded(o["first_step_at"]) for o in ours],
            "raw_all_s": [rounded(v) for v in raw_s],
            "page_cache": "dropped before each run, libraries re-warmed" if cold else "warm cache",
            "disk": disk_of(opts.parent_dir),
        },
        opts=opts,
    )


if __name__ == "__main__":
    sys.exit(run(main))

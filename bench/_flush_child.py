"""The training process of bench_preemption_flush: a Session whose checkpoint policy is
never due, so the only checkpoint it writes is the emergency flush after SIGTERM.

Configured through the environment like a real run (``TRAINBOT_CHECKPOINT_URI``,
``TRAINBOT_RUN_ID``, ``TRAINBOT_TERMINATION_WINDOW_S``). Prints ``ready`` once the loop
runs, and after the loop ends one JSON line with the wall-clock time the flush committed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import MiB, Never, build_model
from runner.session import Session

#: Seconds of one "training step": short, so the loop sees the signal at once.
STEP_S = 0.002


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mb", type=float, required=True)
    args = p.parse_args()
    model, opt = build_model(int(args.size_mb * MiB))
    with Session.from_env(decision=Never()) as s:
        s.track(model=model, optimizer=opt)
        for step in s.steps(1 << 62):
            if step == 0:
                print("ready", flush=True)
            time.sleep(STEP_S)
        committed_at = time.time()
    info = s.writer.last_commit
    print(
        json.dumps(
            {
                "committed_at": committed_at,
                "exit_code": s.exit_code,
                "step": s.step,
                "committed_step": s.committed_step,
                "bytes": info.bytes if info else None,
                "stall_s": info.stall_s if info else None,
                "write_s": info.write_s if info else None,
            }
        ),
        flush=True,
    )
    return s.exit_code


if __name__ == "__main__":
    sys.exit(main())

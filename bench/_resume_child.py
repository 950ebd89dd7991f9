"""The training process of bench_resume: start, create a Session (which starts reading the
newest checkpoint), build the model, restore through the Session, and print the
wall-clock time of the first step.

Configured through the environment like a real run (``TRAINBOT_CHECKPOINT_URI``,
``TRAINBOT_RUN_ID``). Its one line of output is JSON: when the imports were done, the
model built, the restore done, and the first step reached.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import Never, build_skeleton
from runner.session import Session


def main() -> int:
    imported = time.time()
    # The recommended order: the session first, so that it reads the checkpoint while
    # the model and optimizer are built.
    with Session.from_env(decision=Never()) as s:
        model, opt = build_skeleton(int(sys.argv[1]))  # bytes of state, as the parent built it
        built = time.time()
        s.track(model=model, optimizer=opt)
        s.restore()
        restored = time.time()
        for step in s.steps(1 << 62):
            first = time.time()
            print(
                json.dumps(
                    {
                        "imported_at": imported,
                        "built_at": built,
                        "restored_at": restored,
                        "first_step_at": first,
                        "step": step,
                    }
                ),
                flush=True,
            )
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())

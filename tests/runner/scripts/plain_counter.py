"""A plain training script (no trainbot API, standard library only) for exec tests.

Its "model" is a hash chain over the steps, so a run that resumes correctly ends with the
same state as one that never stopped. It saves ``ckpt-{step}.json`` into
``$TRAINBOT_CHECKPOINT_DIR`` every ``--every`` steps, slowly (half, a pause, the rest),
resumes from the newest one it finds, and has no SIGTERM handler. It writes what it is
doing to ``--progress`` so a test can choose the moment of a notice; its last line of
output is JSON: ``step``, ``state``, ``resumed_from``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import time
from pathlib import Path


def say(progress: Path, text: str) -> None:
    tmp = progress.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, progress)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--write-s", type=float, default=0.3)
    p.add_argument("--progress", type=Path, required=True)
    args = p.parse_args()
    root = Path(os.environ["TRAINBOT_CHECKPOINT_DIR"])
    found = [
        (int(m.group(1)), f) for f in root.glob("ckpt-*.json") if (m := re.search(r"(\d+)", f.name))
    ]
    step, state = 0, hashlib.sha256(b"seed").hexdigest()
    if found:
        doc = json.loads(max(found)[1].read_text())
        step, state = doc["step"], doc["state"]
    resumed_from = step
    say(args.progress, f"running {step}")
    while step < args.steps:
        time.sleep(args.step_s)
        state = hashlib.sha256(f"{state}:{step}".encode()).hexdigest()
        step += 1
        say(args.progress, f"running {step}")
        if step % args.every == 0 and step < args.steps:
            body = json.dumps({"step": step, "state": state}).encode()
            with open(root / f"ckpt-{step}.json", "wb") as f:
                f.write(body[: len(body) // 2])
                f.flush()
                say(args.progress, f"writing {step}")
                time.sleep(args.write_s)
                f.write(body[len(body) // 2 :])
            say(args.progress, f"wrote {step}")
    print(json.dumps({"step": step, "state": state, "resumed_from": resumed_from}), flush=True)


if __name__ == "__main__":
    main()

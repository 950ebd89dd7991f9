"""A training script that crashes once, as a transient NCCL or driver fault does.

Usage: ``crash_once.py STEPS CRASH_AT CODE``. It saves a checkpoint every 5 steps with
the trainbot session. An attempt that starts from nothing exits with ``CODE`` at step
``CRASH_AT`` (its last line of output names the fault); one that resumed from a
checkpoint runs to ``STEPS``. Its last line of output then is JSON: ``step`` and
``resumed_from``.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from torch import nn

from runner.session import EverySteps, Session


def main() -> int:
    steps, crash_at, code = (int(a) for a in sys.argv[1:4])
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with Session.from_env(decision=EverySteps(5)) as s:
        s.track(model=model, optimizer=opt)
        resumed_from = s.restore()
        for step in s.steps(steps):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            s.log(loss=float(loss))
            time.sleep(0.02)
            if resumed_from == 0 and step + 1 == crash_at:
                print(f"NCCL watchdog: collective timed out at step {step + 1}", file=sys.stderr)
                raise SystemExit(code)  # through the session: its checkpoint write lands
    print(json.dumps({"step": s.step, "resumed_from": resumed_from}), flush=True)
    return s.exit_code


if __name__ == "__main__":
    sys.exit(main())

"""A training script that hangs, as a collective waiting for a rank that died does.

Usage: ``hang_after.py STEPS HANG_AT``. It trains a tiny model with the trainbot session,
saving every 10 steps, and after step ``HANG_AT`` blocks for good in ``wait_for_peers``
(a lock nobody releases, held in C: the stop signal's handler runs, the wait goes on).
"""

from __future__ import annotations

import sys
import threading
import time

import torch
from torch import nn

from runner.session import EverySteps, Session


def wait_for_peers(barrier: threading.Lock) -> None:
    barrier.acquire()  # the peer that would release it is gone


def main() -> int:
    steps, hang_at = (int(a) for a in sys.argv[1:3])
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with Session.from_env(decision=EverySteps(10)) as s:
        s.track(model=model, optimizer=opt)
        s.restore()
        for step in s.steps(steps):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            s.log(loss=loss.item())
            time.sleep(0.01)
            if step + 1 == hang_at:
                print(f"step {step + 1}: waiting for the other ranks", flush=True)
                barrier = threading.Lock()
                barrier.acquire()
                wait_for_peers(barrier)
    return s.exit_code


if __name__ == "__main__":
    sys.exit(main())

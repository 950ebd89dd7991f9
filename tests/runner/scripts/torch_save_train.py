"""A plain torch training script: ``torch.save`` of model and optimizer into
``ckpt-{step}.pt`` every ``--every`` steps, resuming from the newest file it finds.

Nothing in it knows about trainbot except where checkpoints go (``--ckpt-dir``, by
default ``$TRAINBOT_CHECKPOINT_DIR``). Prints ``resumed from step N`` first and a JSON
line with the final ``step`` last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

import torch
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", type=Path, default=os.environ.get("TRAINBOT_CHECKPOINT_DIR"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--step-s", type=float, default=0.02)
    args = p.parse_args()
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    found = sorted(
        (int(m.group(1)), f)
        for f in args.ckpt_dir.glob("ckpt-*.pt")
        if (m := re.search(r"(\d+)", f.name))
    )
    if found:
        ckpt = torch.load(found[-1][1], weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        step = ckpt["step"]
    print(f"resumed from step {step}", flush=True)
    g = torch.Generator().manual_seed(step)
    while step < args.steps:
        x = torch.randn(16, 8, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        time.sleep(args.step_s)
        if step % args.every == 0:
            torch.save(
                {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                args.ckpt_dir / f"ckpt-{step}.pt",
            )
    print(json.dumps({"step": step}), flush=True)


if __name__ == "__main__":
    main()

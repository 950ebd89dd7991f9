"""A small FSDP (``fully_shard``) model under torchrun, gloo on CPU, checkpointed through
the session's sharded state (``torch.distributed.checkpoint``).

    TRAINBOT_CHECKPOINT_URI=… torchrun --nproc-per-node 2 tests/runner/scripts/fsdp_train.py

Rank 0's last line is JSON: the world size, the step the run restored (0: none) and the
sha256 of the whole state (parameters and Adam's moments, gathered) right after that
restore, the step it ended at and the same digest there. ``--fresh-local`` lets it resume
at another world size; ``--dim`` changes the model's width (a checkpoint of another
width cannot be loaded). On a RunnerError the line is ``{"error": …}`` and the exit 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from runner.distributed import DistributedSession
from runner.distributed.sharded import Sharded
from runner.errors import RunnerError
from runner.session import EverySteps, SessionConfig


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 over the full (unsharded) parameters and optimizer state: a collective."""
    options = StateDictOptions(full_state_dict=True)
    params, optim = get_state_dict(model, (opt,), options=options)
    h = hashlib.sha256()

    def add(name: str, value: Any) -> None:
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            h.update(value.detach().cpu().contiguous().numpy().tobytes())
        else:
            h.update(repr(value).encode())

    for name in sorted(params):
        add(name, params[name])
    for name in sorted(optim["state"]):
        for key in sorted(optim["state"][name]):
            add(f"{name}.{key}", optim["state"][name][key])
    return h.hexdigest()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--fresh-local", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, args.dim), nn.ReLU(), nn.Linear(args.dim, 4))
        fully_shard(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(100 + rank)
        session = DistributedSession(
            SessionConfig.from_env(),
            decision=EverySteps(args.every),
            fresh_local_on_resize=args.fresh_local,
        )
        restored: tuple[int, str] | None = None
        try:
            with session as s:
                s.track_sharded(train=Sharded(model, opt))
                for _ in s.steps(args.steps):
                    if restored is None:
                        restored = (s.step, digest(model, opt))
                    x = torch.randn(4, 8, generator=data)
                    loss = model(x).square().mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                final = digest(model, opt)
        except RunnerError as exc:
            if rank == 0:
                print(json.dumps({"error": str(exc)}), flush=True)
            return 2
        if rank == 0:
            result = {
                "world": dist.get_world_size(),
                "restored_step": restored[0] if restored else None,
                "restored_sha256": restored[1] if restored else None,
                "step": s.step,
                "sha256": final,
                "exit_code": s.exit_code,
            }
            print(json.dumps(result), flush=True)
        return s.exit_code
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

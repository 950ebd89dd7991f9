"""The tiny example under DistributedDataParallel, one process per rank.

    TRAINBOT_CHECKPOINT_URI=/tmp/ckpt torchrun --nproc-per-node 2 -m runner.examples.tiny_ddp

gloo on CPU, NCCL when CUDA is there. Each rank draws its own batches (its data position
is its own, in its part of every checkpoint); the model, optimizer and schedule are the
same on every rank and saved once, by rank 0. A SIGTERM to any rank stops every rank at
the same step, with a checkpoint, and all exit 75; run again, it resumes bit-exactly.
Rank 0's last line of output is a JSON object with ``step``, the ``params_sha256`` of its
parameters and, per rank, the step it stopped at and its exit code.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from runner.distributed import DistributedSession
from runner.errors import RunnerError
from runner.examples.tiny import (
    Batches,
    TinyTransformer,
    make_corpus,
    make_optimizer,
    print_result,
    session_for,
    train_step,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun … -m runner.examples.tiny_ddp", description=__doc__)
    p.add_argument("--steps", type=int, default=200, help="total training steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=8, help="batch per rank")
    p.add_argument("--dim", type=int, default=64, help="model width")
    p.add_argument("--checkpoint-every", type=int, default=None, help="steps between saves")
    p.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step")
    return p.parse_args(argv)


def _init() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return torch.device("cuda", local)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = _init()
    rank = dist.get_rank()
    try:
        try:
            session = session_for(args, DistributedSession)
        except RunnerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return _train(args, session, device, rank)
    finally:
        dist.destroy_process_group()


def _train(
    args: argparse.Namespace, session: DistributedSession, device: torch.device, rank: int
) -> int:
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    model = TinyTransformer(dim=args.dim).to(device)
    ddp = DistributedDataParallel(model)
    torch.manual_seed(args.seed + 7919 * rank)  # each rank its own dropout
    opt, sched = make_optimizer(model, lr=args.lr, steps=args.steps)
    data = Batches(make_corpus(args.seed), batch=args.batch, seed=args.seed * 1000 + rank)
    loss_value = float("nan")
    with session as s:
        s.track(model=model, optimizer=opt, scheduler=sched)
        s.track_local(data=data)
        for _ in s.steps(args.steps):
            x, y = s.next_batch(data)
            loss_value = train_step(ddp, opt, sched, (x.to(device), y.to(device)))
            s.log(loss=loss_value, lr=float(sched.get_last_lr()[0]))
            if args.step_delay:
                time.sleep(args.step_delay)
        ranks: list[Any] = [None] * dist.get_world_size()
        mine = {"rank": rank, "step": s.step, "stop_reason": s.stop_reason}
        dist.all_gather_object(ranks, mine)
    # Every rank's exit code is settled once the session has closed (rank 0's commit).
    if rank == 0:
        print_result(s, model, loss_value, world_size=len(ranks), ranks=ranks)
    return s.exit_code


if __name__ == "__main__":
    sys.exit(main())

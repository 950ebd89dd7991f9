"""One rank of bench_ddp: train the tiny_ddp model, timing each step and each vote, then
time the checkpoint stall of a few saves. Rank 0 prints one JSON line."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from runner.distributed import Gang, Vote
from runner.distributed.parts import RankWriter
from runner.examples.tiny import VOCAB, Batches, TinyTransformer, make_corpus
from runner.state import capture_rng
from runner.store import run_store


def main() -> None:
    steps, saves, ckpt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dim = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    voting = (sys.argv[5] if len(sys.argv) > 5 else "vote") == "vote"
    dist.init_process_group("gloo")
    gang = Gang.current()
    torch.manual_seed(0)
    model = TinyTransformer(dim=dim)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = Batches(make_corpus(0), batch=8, seed=gang.rank)
    loss_fn = nn.CrossEntropyLoss()
    step_s: list[float] = []
    vote_s: list[float] = []
    total_s: list[float] = []
    last = time.perf_counter()
    for i in range(steps + 5):
        t0 = time.perf_counter()
        x, y = next(data)
        loss = loss_fn(ddp(x).reshape(-1, len(VOCAB)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        if voting:
            gang.agree(Vote())  # what the session adds after every step
        t2 = time.perf_counter()
        if i >= 5:  # warm-up steps are not counted
            step_s.append(t1 - t0)
            vote_s.append(t2 - t1)
            total_s.append(t2 - last)  # one whole iteration, the next one's wait included
        last = t2
    writer = RankWriter(
        run_store(ckpt, "bench"),
        rank=gang.rank,
        world_size=gang.world_size,
        nonce=gang.nonce(),
        part_timeout_s=60,
    )
    stall_s: list[float] = []
    for k in range(saves):
        state = {
            "step": k,
            "objects": {"model": model.state_dict(), "optimizer": opt.state_dict()},
            "local": {"objects": {"data": data.state_dict()}, "rng": capture_rng()},
        }
        gang.barrier()
        t0 = time.perf_counter()
        writer.save(k, state)
        stall_s.append(time.perf_counter() - t0)
        writer.wait()
        gang.barrier()
    writer.close()
    stalls: list[float] = [0.0] * gang.world_size
    dist.all_gather_object(stalls, statistics.median(stall_s))
    if gang.rank == 0:
        doc = {
            "world_size": gang.world_size,
            "step_s": statistics.median(step_s),
            "vote_s": statistics.median(vote_s),
            "total_s": statistics.median(total_s),
            "voting": voting,
            "stall_s": max(stalls),
        }
        print(json.dumps(doc), flush=True)


if __name__ == "__main__":
    try:
        main()
    finally:
        # Once main's objects are gone: DDP's reducer, freed after its process group was
        # destroyed, can wait for gloo for good at exit.
        dist.destroy_process_group()

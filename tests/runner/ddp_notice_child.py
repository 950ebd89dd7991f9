"""One rank of a two-rank gloo gang noticed mid-run while its store slows down (a
process of test_distributed's held-exit test; not a test module).

Every rank trains, saves at step 5 at the store's normal pace, and at ``--notice-at`` sets
its own notice with a ``--window-s`` deadline (as a SIGTERM to the whole process group
would) and slows its uploads ``--slowdown`` times: the flush then outlasts the window.
The rank writes what its session emitted, with when (``time.monotonic()``, one clock
for the whole machine), and its deadline, to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch.distributed as dist

from runner.distributed import DistributedSession
from runner.preemption import Notice, PreemptionFlag
from runner.session import EverySteps, SessionConfig
from runner.store import LocalStore
from tests.runner.paced_store import PacedStore
from tests.runner.stand_ins import Recorder, Weights

#: Uploads before the notice: 1 MiB in 1/16 s.
BPS = 16 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--init", required=True, help="the gloo group's file")
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--floats", type=int, default=1 << 18, help="the replicated state")
    parser.add_argument("--own-floats", type=int, default=1 << 18, help="each rank's own")
    parser.add_argument("--notice-at", type=int, default=8)
    parser.add_argument("--window-s", type=float, default=2.0)
    parser.add_argument("--slowdown", type=float, default=80.0)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=rank, world_size=world)
    store = PacedStore(LocalStore(Path(args.store)), BPS)
    sink = Recorder()
    session = DistributedSession(
        SessionConfig(run_id="ddp", checkpoint_uri=args.store, window_s=args.window_s),
        sink=sink,
        store=store,
        flag=PreemptionFlag(),
        decision=EverySteps(5),
        install_signals=False,
    )
    weights, own = Weights(args.floats), Weights(args.own_floats)
    deadline = 0.0
    with session as s:
        s.track(weights=weights)
        s.track_local(own=own)
        for step in s.steps(1000):
            weights.t[step] += 1.0
            own.t[step] += float(rank + 1)
            time.sleep(0.05)
            if step == args.notice_at:
                store.slowdown = args.slowdown
                now = time.monotonic()
                deadline = now + args.window_s
                s.flag.set(Notice("signal", "test", received_at=now, deadline=deadline))
    closed = time.monotonic()
    Path(args.out).write_text(
        json.dumps(
            {
                "rank": rank,
                "deadline": deadline,
                "closed": closed,
                "exit_code": session.exit_code,
                "events": [
                    {"type": t, "data": d, "at": at}
                    for (t, d), at in zip(sink.events, sink.times, strict=True)
                ],
            },
            default=str,
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A tiny real model: a character-level transformer on generated arithmetic text.

    TRAINBOT_CHECKPOINT_URI=/tmp/ckpt python -m runner.examples.tiny --steps 200

It trains on two CPU cores in seconds, uses the session API, and so survives SIGTERM:
it flushes a checkpoint, exits with 75, and run again resumes bit-exactly. Its last line
of output is a JSON object with ``step`` and ``params_sha256``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from runner.errors import RunnerError
from runner.session import EverySteps, Session

S = TypeVar("S", bound=Session)

VOCAB = "0123456789+=. \n"
CONTEXT = 32


def make_corpus(seed: int, n_lines: int = 4000) -> torch.Tensor:
    """Lines like "12+7=19." from a fixed generator: the data the package makes."""
    g = torch.Generator().manual_seed(seed + 1_000_003)
    a = torch.randint(0, 100, (n_lines,), generator=g)
    b = torch.randint(0, 100, (n_lines,), generator=g)
    text = "".join(f"{x}+{y}={x + y}.\n" for x, y in zip(a.tolist(), b.tolist(), strict=True))
    return torch.tensor([VOCAB.index(c) for c in text], dtype=torch.long)


class Batches:
    """Random windows of the corpus; its position is part of the checkpoint."""

    def __init__(
        self, corpus: torch.Tensor, *, batch: int, seed: int, delay_s: float = 0.0
    ) -> None:
        self.corpus = corpus
        self.batch = batch
        self.delay_s = delay_s
        self.generator = torch.Generator().manual_seed(seed)
        self.served = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)  # a slow input pipeline, for the utilisation alert
        hi = len(self.corpus) - CONTEXT - 1
        starts = torch.randint(0, hi, (self.batch,), generator=self.generator)
        x = torch.stack([self.corpus[s : s + CONTEXT] for s in starts.tolist()])
        y = torch.stack([self.corpus[s + 1 : s + CONTEXT + 1] for s in starts.tolist()])
        self.served += 1
        return x, y

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "served": self.served}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.served = int(state["served"])


class TinyTransformer(nn.Module):
    def __init__(self, *, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), dim)
        self.pos = nn.Parameter(torch.zeros(CONTEXT, dim))
        block = nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=4 * dim, dropout=0.1, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, len(VOCAB))
        mask = torch.triu(torch.full((CONTEXT, CONTEXT), float("-inf")), diagonal=1)
        self.mask: torch.Tensor
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(h)


def params_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def session_for(args: argparse.Namespace, cls: type[S]) -> S:
    """The example's session, saving every ``--checkpoint-every`` steps if given."""
    decision = EverySteps(args.checkpoint_every) if args.checkpoint_every else None
    return cls.from_env(decision=decision)


def print_result(s: Session, model: nn.Module, loss: float, **extra: Any) -> None:
    """The last line of output: where the run stopped, and a digest of its parameters."""
    result = {
        "step": s.step,
        "params_sha256": params_sha256(model),
        "loss": loss if math.isfinite(loss) else None,
        "exit_code": s.exit_code,
        "stop_reason": s.stop_reason,
        **extra,
    }
    print(json.dumps(result), flush=True)


def make_optimizer(
    model: nn.Module, *, lr: float, steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with a linear warm-up over the first tenth of the steps, then a cosine decay."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    return opt, sched


def train_step(
    net: nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    batch: tuple[torch.Tensor, torch.Tensor],
) -> float:
    """One step of next-character prediction; its loss."""
    x, y = batch
    net.train()
    loss = nn.functional.cross_entropy(net(x).reshape(-1, len(VOCAB)), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.item())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runner.examples.tiny", description=__doc__)
    p.add_argument("--steps", type=int, default=300, help="total training steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (5.0 diverges)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dim", type=int, default=64, help="model width")
    p.add_argument("--checkpoint-every", type=int, default=None, help="steps between saves")
    p.add_argument("--data-delay", type=float, default=0.0, help="seconds to stall each batch")
    p.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step")
    p.add_argument(
        "--scratch-fill-mb", type=float, default=0.0, help="MB of logs written to scratch per step"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The session first: it starts reading the newest checkpoint while the model is built.
    try:
        session = session_for(args, Session)
    except RunnerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    model = TinyTransformer(dim=args.dim)
    opt, sched = make_optimizer(model, lr=args.lr, steps=args.steps)
    data = Batches(
        make_corpus(args.seed), batch=args.batch, seed=args.seed, delay_s=args.data_delay
    )
    scratch_dir = os.environ.get("TRAINBOT_SCRATCH_DIR") or "."
    scratch = Path(scratch_dir) if args.scratch_fill_mb else None
    loss_value = float("nan")
    with session as s:
        s.track(model=model, optimizer=opt, scheduler=sched, data=data)
        for _ in s.steps(args.steps):
            loss_value = train_step(model, opt, sched, s.next_batch(data))
            s.log(loss=loss_value, lr=float(sched.get_last_lr()[0]))
            if args.step_delay:
                time.sleep(args.step_delay)
            if scratch is not None:
                with open(scratch / "train.log", "ab") as f:
                    f.write(b"x" * int(args.scratch_fill_mb * 1e6))
    print_result(s, model, loss_value)
    return s.exit_code


if __name__ == "__main__":
    sys.exit(main())

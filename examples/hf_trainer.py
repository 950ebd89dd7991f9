"""An ordinary Hugging Face Trainer script, with nothing of trainbot in it.

A tiny GPT-2 built from a config (random weights: nothing is downloaded) learns a
synthetic counting sequence on the CPU. It writes ``checkpoint-N/`` folders into its
output directory every ``--save-steps`` steps and, started again, resumes from the
newest one it finds there, the way Hugging Face's own example scripts do
(``get_last_checkpoint``). Under trainbot the output directory is the spec's
``checkpoint.sync_dir`` (``$TRAINBOT_CHECKPOINT_DIR``): the runner syncs the folders to
the store, puts the newest back on a new instance, and reads the loss from the
``trainer_state.json`` each folder holds.

    python examples/hf_trainer.py --max-steps 200 --save-steps 20
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint


class Counting(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sequences ``k, k+1, k+2, …`` modulo the vocabulary: learnable in a few steps."""

    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.n, self.length, self.vocab = n, length, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(self.length) + i) % self.vocab
        return {"input_ids": ids, "labels": ids.clone()}


class Pace(TrainerCallback):
    """Makes each step last at least ``step_s`` (a demo's stand-in for a real model)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def on_step_end(self, args: object, state: object, control: object, **_: object) -> None:
        time.sleep(self.step_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", default=os.environ.get("TRAINBOT_CHECKPOINT_DIR", "out"))
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3, help="the peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=0, help="steps to ramp up to --lr")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--step-s", type=float, default=0.0, help="sleep after each step")
    args = p.parse_args()

    vocab = 32
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=args.warmup_steps,
        logging_steps=1,
        save_steps=args.save_steps,
        save_total_limit=2,
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Counting(4096, 16, vocab),
        callbacks=[Pace(args.step_s)] if args.step_s > 0 else [],
    )
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    print(f"resuming from {last}" if last else "starting from step 0", flush=True)
    trainer.train(resume_from_checkpoint=last)
    print(f"finished at step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()

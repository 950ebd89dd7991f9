"""An ordinary PyTorch Lightning script: ModelCheckpoint writes
``epoch=E-step=S.ckpt`` into ``--ckpt-dir`` (by default ``$TRAINBOT_CHECKPOINT_DIR``)
every ``--every`` steps, and a restart resumes with ``ckpt_path`` set to the newest one
found there, as a user would write it. Prints ``resumed from step N`` when training
starts and a JSON line with the final ``step`` last. With ``--csv`` it logs its loss
with a ``CSVLogger`` under the same directory (``lightning_logs/version_0/metrics.csv``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.step_s = step_s

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        time.sleep(self.step_s)
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_start(self) -> None:
        print(f"resumed from step {self.trainer.global_step}", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def newest(ckpt_dir: Path) -> str | None:
    found = [
        (int(m.group(1)), f)
        for f in ckpt_dir.glob("*.ckpt")
        if (m := re.search(r"step=(\d+)", f.name))
    ]
    return str(max(found)[1]) if found else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", type=Path, default=os.environ.get("TRAINBOT_CHECKPOINT_DIR"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--step-s", type=float, default=0.02)
    p.add_argument("--csv", action="store_true", help="log the loss to metrics.csv")
    args = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(args.ckpt_dir, flush_logs_every_n_steps=10) if args.csv else False,
        log_every_n_steps=5,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.every, save_top_k=-1)
        ],
    )
    trainer.fit(Regression(args.step_s), data, ckpt_path=newest(args.ckpt_dir))
    print(json.dumps({"step": trainer.global_step}), flush=True)


if __name__ == "__main__":
    main()

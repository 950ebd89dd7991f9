"""A save given up for a newer one (the notice's): nothing of it is committed, it is not
reported as a failure, and the next save goes through; its progress is visible while it
runs."""

from __future__ import annotations

from pathlib import Path

import torch

from runner.checkpoint import CheckpointWriter, CommitInfo, list_committed
from runner.store import LocalStore
from tests.runner.paced_store import PacedStore


def test_a_cancelled_save_commits_nothing_and_the_next_one_lands(tmp_path: Path) -> None:
    store = PacedStore(LocalStore(tmp_path / "r"), bps=8 << 20)  # 8 MiB in about 1 s
    failures: list[int] = []
    commits: list[CommitInfo] = []
    writer = CheckpointWriter(
        store,
        chunk_bytes=256 << 10,
        on_commit=commits.append,
        on_error=lambda step, exc: failures.append(step),
    )
    state = {"w": torch.zeros(2 << 20)}
    writer.save(1, state)
    assert writer.progress() is not None and writer.progress().step == 1  # type: ignore[union-attr]
    assert writer.cancel()
    store.slowdown = 0.01  # the next save at full speed
    writer.save(2, state).result(timeout=60)
    writer.close()
    assert [e.step for e in list_committed(store)] == [2]
    assert [c.step for c in commits] == [2] and failures == []
    assert writer.progress() is None and not writer.cancel()

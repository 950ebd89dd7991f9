"""Restoring through a Session: the checkpoint is read while the model is built (prefetch),
falls back past corruption with a message, and leaves no thread behind."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from runner.checkpoint import (
    CheckpointWriter,
    Prefetch,
    PrefetchCancelled,
    load_checkpoint,
    read_manifest,
    restore_latest,
    step_dir,
)
from runner.errors import CheckpointError, NoCheckpointError
from runner.session import EverySteps, Session, SessionConfig
from runner.state import state_digest
from runner.store import LocalStore
from runner.telemetry import FileSink

RUN = "r-restore"
READ_THREADS = ("ckpt-prefetch", "ckpt-read")


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def session(root: Path, **kwargs: Any) -> Session:
    config = SessionConfig(run_id=RUN, checkpoint_uri=str(root))
    return Session(config, install_signals=False, **kwargs)


def run_to(root: Path, steps: int, *, every: int) -> str:
    """Train to ``steps`` through a session checkpointing every ``every`` steps; the digest
    of the model + optimizer state at the end."""
    with session(root, decision=EverySteps(every)) as s:
        model, opt = build()
        s.track(model=model, optimizer=opt)
        for _ in s.steps(steps):
            train(model, opt)
    assert s.exit_code == 0
    return state_digest({"m": model.state_dict(), "o": opt.state_dict()})


def store_of(root: Path) -> LocalStore:
    return LocalStore(root / RUN)


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def read_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(READ_THREADS)]


def test_session_restores_what_it_read_while_the_model_was_built(tmp_path: Path) -> None:
    saved = run_to(tmp_path, 6, every=3)
    with session(tmp_path) as s:
        assert s.prefetch is not None and s.prefetch.wait(timeout=60)
        # The shards are gone from the store: only the prefetched copy can restore them.
        for shard in (tmp_path / RUN / step_dir(6)).glob("shard-*"):
            shard.unlink()
        model, opt = build(seed=1)
        s.track(model=model, optimizer=opt)
        assert s.restore() == 6
        assert s.prefetch is None
        assert state_digest({"m": model.state_dict(), "o": opt.state_dict()}) == saved


def test_session_created_after_the_model_restores_the_same(tmp_path: Path) -> None:
    saved = run_to(tmp_path, 4, every=2)
    for prefetch in (True, False):
        model, opt = build(seed=2)
        with session(tmp_path, prefetch=prefetch) as s:
            s.track(model=model, optimizer=opt)
            assert s.restore() == 4
        assert state_digest({"m": model.state_dict(), "o": opt.state_dict()}) == saved


def test_corrupt_prefetched_checkpoint_falls_back_with_a_message(tmp_path: Path) -> None:
    run_to(tmp_path, 2, every=2)
    older = state_digest(restore_latest(store_of(tmp_path)).state)
    run_to(tmp_path, 4, every=2)  # resumes from 2, commits 4
    shard = tmp_path / RUN / step_dir(4) / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    log = tmp_path / "events.jsonl"
    with session(tmp_path, sink=FileSink(log)) as s:
        model, opt = build()
        s.track(model=model, optimizer=opt)
        assert s.restore() == 2
        assert state_digest(s.state()["objects"]) == state_digest(
            restore_latest(store_of(tmp_path)).state["objects"]
        )
    assert state_digest(restore_latest(store_of(tmp_path)).state) == older
    got = events(log)
    warnings = [e["data"]["message"] for e in got if e["type"] == "log"]
    assert any("step 4 is corrupt" in w and "checksum mismatch" in w for w in warnings)
    (restored,) = [e["data"] for e in got if e["type"] == "restored"]
    assert restored["step"] == 2 and restored["fallback_from"] == 4


def test_no_usable_checkpoint_is_a_clear_error_after_prefetch(tmp_path: Path) -> None:
    run_to(tmp_path, 2, every=2)
    (tmp_path / RUN / step_dir(2) / "meta.pt").write_bytes(b"garbage")
    with session(tmp_path) as s:
        model, opt = build()
        s.track(model=model, optimizer=opt)
        with pytest.raises(CheckpointError, match=r"no usable checkpoint.*step 2"):
            s.restore()
    assert read_threads() == []


def test_checkpoint_committed_after_the_prefetch_is_the_one_restored(tmp_path: Path) -> None:
    run_to(tmp_path, 2, every=2)
    with session(tmp_path) as s:
        assert s.prefetch is not None and s.prefetch.wait(timeout=60)
        newer = run_to(tmp_path, 5, every=5)  # another process commits step 5 meanwhile
        model, opt = build()
        s.track(model=model, optimizer=opt)
        assert s.restore() == 5
        assert state_digest({"m": model.state_dict(), "o": opt.state_dict()}) == newer


def test_empty_store_restores_step_zero_with_prefetch(tmp_path: Path) -> None:
    with session(tmp_path / "empty") as s:
        model, opt = build()
        s.track(model=model, optimizer=opt)
        assert s.restore() == 0
    with pytest.raises(NoCheckpointError):
        Prefetch(store_of(tmp_path / "empty")).take()


def test_session_closed_without_restore_leaves_no_thread(tmp_path: Path) -> None:
    store = store_of(tmp_path)
    writer = CheckpointWriter(store, shard_bytes=4 << 20)
    writer.save(1, {"w": torch.randn(12 << 20)}).result()  # 48 MiB in 12 shards
    writer.close()
    for _ in range(3):
        s = session(tmp_path)
        s.close()
        assert s.prefetch is None
        assert read_threads() == []


def test_cancelled_read_stops_and_says_so(tmp_path: Path) -> None:
    store = store_of(tmp_path)
    writer = CheckpointWriter(store)
    writer.save(1, {"w": torch.randn(1 << 16)}).result()
    writer.close()
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(PrefetchCancelled, match="cancelled"):
        load_checkpoint(store, read_manifest(store, 1), cancel=cancel)
    prefetch = Prefetch(store)
    prefetch.close()
    assert prefetch.take() is None, "a closed prefetch hands nothing over"
    assert read_threads() == []


def test_missing_shard_is_a_clear_error_and_no_read_outlives_it(tmp_path: Path) -> None:
    store = store_of(tmp_path)
    writer = CheckpointWriter(store, shard_bytes=1 << 20)
    state = {f"w{i}": torch.randn(1 << 18) for i in range(6)}  # 1 MiB each, one per shard
    writer.save(1, state).result()
    writer.close()
    (tmp_path / RUN / step_dir(1) / "shard-00003.bin").unlink()
    with pytest.raises(CheckpointError, match=r"shard missing or unreadable.*shard-00003"):
        load_checkpoint(store, read_manifest(store, 1), chunk_bytes=64 << 10)
    assert read_threads() == []


@pytest.mark.parametrize("chunk", [4096, 10_000, 1 << 20])
def test_any_chunk_size_reads_the_same_state(tmp_path: Path, chunk: int) -> None:
    store = store_of(tmp_path)
    writer = CheckpointWriter(store, shard_bytes=64 << 10)
    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(12_345, generator=g), "b": torch.randn(33, 7, generator=g)}
    writer.save(1, state).result()
    writer.close()
    got = load_checkpoint(store, read_manifest(store, 1), chunk_bytes=chunk)
    assert state_digest(got) == state_digest(state)


def test_shard_longer_than_its_manifest_falls_back(tmp_path: Path) -> None:
    store = store_of(tmp_path)
    writer = CheckpointWriter(store)
    writer.save(1, {"w": torch.ones(1000)}).result()
    writer.save(2, {"w": torch.full((1000,), 2.0)}).result()
    writer.close()
    with open(tmp_path / RUN / step_dir(2) / "shard-00000.bin", "ab") as f:
        f.write(b"\0" * 4096)
    restored = restore_latest(store)
    assert restored.step == 1 and torch.equal(restored.state["w"], torch.ones(1000))
    assert "is longer" in restored.skipped[0][1]

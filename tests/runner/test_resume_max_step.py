"""``TRAINBOT_RESUME_MAX_STEP``: a run resubmitted "from step N" restores the newest
committed checkpoint at or before N, not the newest of all (a later one is the diverged
run's), through the session API and through ``exec --sync-dir``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from runner.layout import copy_step, list_committed, read_manifest
from runner.session import EverySteps, Session, SessionConfig
from runner.store import LocalStore
from runner.supervisor import Supervisor
from runner.sync import CheckpointSync
from runner.telemetry import FileSink
from tests.runner.stand_ins import Counter, Recorder

RUN = "r-diverged"


def _train_to_30(root: Path) -> None:
    """Checkpoints at steps 10, 20 and 30."""
    config = SessionConfig(run_id=RUN, checkpoint_uri=str(root))
    with Session(config, install_signals=False, decision=EverySteps(10), prefetch=False) as s:
        counter = Counter()
        s.track(counter=counter)
        for step in s.steps(30):
            counter.step = step + 1
    assert [e.step for e in list_committed(LocalStore(root / RUN))] == [10, 20, 30]


@pytest.mark.parametrize(("max_step", "expected"), [("20", 20), ("25", 20), ("30", 30), ("", 30)])
def test_a_session_restores_the_newest_checkpoint_at_or_before_the_max_step(
    tmp_path: Path, max_step: str, expected: int
) -> None:
    _train_to_30(tmp_path)
    events_file = tmp_path / "events.jsonl"
    env = {
        "TRAINBOT_RUN_ID": RUN,
        "TRAINBOT_CHECKPOINT_URI": str(tmp_path),
        "TRAINBOT_RESUME_MAX_STEP": max_step,
    }
    config = SessionConfig.from_env(env)
    assert config.resume_max_step == (int(max_step) if max_step else None)
    with Session(config, install_signals=False, sink=FileSink(events_file)) as s:
        # The prefetch reads the newest of all: it is not used with a maximum.
        assert (s.prefetch is None) == bool(max_step)
        counter = Counter()
        s.track(counter=counter)
        assert s.restore() == expected
        assert counter.step == expected
    restored = [
        json.loads(line)
        for line in events_file.read_text().splitlines()
        if json.loads(line)["type"] == "restored"
    ]
    assert [e["data"]["step"] for e in restored] == [expected]


def test_a_session_writes_past_the_restored_step_in_a_copy_of_its_own(tmp_path: Path) -> None:
    """The control plane copies step 20 into the new run's own directory; the new run's
    later checkpoints are the newest there, and the diverged run's steps stay untouched."""
    _train_to_30(tmp_path)
    new = "r-resumed"
    copy_step(LocalStore(tmp_path / RUN), LocalStore(tmp_path / new), 20)
    env = {
        "TRAINBOT_RUN_ID": new,
        "TRAINBOT_CHECKPOINT_URI": str(tmp_path),
        "TRAINBOT_RESUME_MAX_STEP": "20",
    }
    config = SessionConfig.from_env(env)
    with Session(config, install_signals=False, decision=EverySteps(5)) as s:
        counter = Counter()
        s.track(counter=counter)
        assert s.restore() == 20
        for step in s.steps(25):
            counter.step = step + 1
    assert [e.step for e in list_committed(LocalStore(tmp_path / new))] == [20, 25]
    assert [e.step for e in list_committed(LocalStore(tmp_path / RUN))] == [10, 20, 30]
    # Without the maximum (a later attempt), the newest of its own is the one it wrote.
    with Session(
        SessionConfig(run_id=new, checkpoint_uri=str(tmp_path)), install_signals=False
    ) as s:
        counter = Counter()
        s.track(counter=counter)
        assert s.restore() == 25 and counter.step == 25


def test_a_copied_step_is_whole_or_absent_and_a_retry_keeps_it(tmp_path: Path) -> None:
    _train_to_30(tmp_path)
    src, dst = LocalStore(tmp_path / RUN), LocalStore(tmp_path / "r-copy")
    manifest = copy_step(src, dst, 20)
    assert read_manifest(dst, 20) == manifest == read_manifest(src, 20)
    assert copy_step(src, dst, 20) == manifest  # a retried copy changes nothing
    assert [e.step for e in list_committed(dst)] == [20]


def _files_store(tmp_path: Path) -> LocalStore:
    """File checkpoints ckpt-10.pt, ckpt-20.pt, ckpt-30.pt committed by a sync."""
    sync = CheckpointSync(store=LocalStore(tmp_path / "ck"), root=tmp_path / "written")
    sync.root.mkdir()
    for step in (10, 20, 30):
        (sync.root / f"ckpt-{step}.pt").write_bytes(f"state at {step}".encode())
    sync.poll(now=0.0, final=True)
    assert [e.step for e in list_committed(sync.store)] == [10, 20, 30]
    return sync.store


@pytest.mark.parametrize(("max_step", "expected"), [(20, 20), (29, 20), (None, 30)])
def test_a_sync_restores_the_newest_file_checkpoint_at_or_before_the_max_step(
    tmp_path: Path, max_step: int | None, expected: int
) -> None:
    store = _files_store(tmp_path)
    fresh = CheckpointSync(store=store, root=tmp_path / "instance-2")
    restored = fresh.restore(max_step=max_step)
    assert restored is not None and restored.step == expected
    assert restored.names == (f"ckpt-{expected}.pt",)
    assert [p.name for p in fresh.root.iterdir()] == [f"ckpt-{expected}.pt"]
    # Steps the store holds are never committed over, restored or not.
    assert fresh.done == {10, 20, 30}


def test_exec_sync_dir_restores_the_max_step_from_its_environment(tmp_path: Path) -> None:
    store = _files_store(tmp_path)
    sync = CheckpointSync(store=store, root=tmp_path / "instance-2")
    sink = Recorder()
    script = "import os, sys; print(sorted(os.listdir(os.environ['TRAINBOT_CHECKPOINT_DIR'])))"
    code = Supervisor(
        [sys.executable, "-c", script],
        sink=sink,
        env={"TRAINBOT_RESUME_MAX_STEP": "25", "PATH": "/usr/bin:/bin"},
        sync=sync,
        scratch_dir=tmp_path,
        install_signals=False,
    ).run()
    assert code == 0
    logs = [d["message"] for t, d in sink.events if t == "log"]
    assert "restored step 20: ckpt-20.pt" in logs
    assert (sync.root / "ckpt-20.pt").read_bytes() == b"state at 20"
    assert not (sync.root / "ckpt-30.pt").exists()

"""Retention: which checkpoints a prune keeps, and that it never loses the newest."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runner.checkpoint import CheckpointEntry, CheckpointWriter, list_committed, step_dir
from runner.errors import RunnerError
from runner.retention import RetentionPolicy, prune, select_deletions
from runner.store import LocalStore


def entries(*steps: int, now: float = 1000.0, age: float = 10.0) -> list[CheckpointEntry]:
    # Older steps are older: step s was committed (max - s) * age seconds ago.
    top = max(steps)
    return [CheckpointEntry(step=s, committed_at=now - (top - s) * age) for s in steps]


def test_keep_last() -> None:
    assert select_deletions(entries(1, 2, 3, 4, 5), RetentionPolicy(keep_last=2), now=1000) == {
        1,
        2,
        3,
    }


def test_keep_every_k_steps_as_well() -> None:
    policy = RetentionPolicy(keep_last=1, keep_every_steps=20)
    got = select_deletions(entries(10, 20, 30, 40, 50), policy, now=1000)
    assert got == {10, 30}


def test_keep_best_by_metric() -> None:
    metrics = {1: {"loss": 0.5}, 2: {"loss": 0.2}, 3: {"loss": 0.9}, 4: {"loss": None}, 5: {}}
    policy = RetentionPolicy(keep_last=1, keep_best_metric="loss", keep_best_mode="min")
    assert select_deletions(entries(1, 2, 3, 4, 5), policy, now=1000, metrics=metrics) == {1, 3, 4}
    policy = RetentionPolicy(
        keep_last=1, keep_best_metric="loss", keep_best_mode="max", keep_best_count=2
    )
    assert select_deletions(entries(1, 2, 3, 4, 5), policy, now=1000, metrics=metrics) == {2, 4}


def test_max_age_never_deletes_the_newest() -> None:
    policy = RetentionPolicy(keep_last=5, max_age_s=15)
    # Ages: step 3 -> 0 s, 2 -> 10 s, 1 -> 20 s.
    assert select_deletions(entries(1, 2, 3), policy, now=1000) == {1}
    # Everything is ancient: the newest still survives.
    assert select_deletions(entries(1, 2, 3), policy, now=10_000) == {1, 2}


def test_protected_steps_survive_every_rule() -> None:
    # The checkpoint an open alert offers to resubmit from: kept past keep_last and max age.
    policy = RetentionPolicy(keep_last=1, max_age_s=15, protect=frozenset({2}))
    assert select_deletions(entries(1, 2, 3, 4, 5), policy, now=1000) == {1, 3, 4}
    # A protected step that is not there protects nothing else.
    policy = RetentionPolicy(keep_last=1, protect=frozenset({9}))
    assert select_deletions(entries(1, 2, 3), policy, now=1000) == {1, 2}


def test_nothing_to_prune() -> None:
    assert select_deletions([], RetentionPolicy(), now=0) == set()


@pytest.mark.parametrize(
    "kwargs",
    [{"keep_last": 0}, {"keep_every_steps": 0}, {"keep_best_mode": "best"}, {"max_age_s": -1}],
)
def test_bad_policies_are_rejected(kwargs: dict) -> None:
    with pytest.raises(RunnerError):
        RetentionPolicy(**kwargs)


def _store_with(tmp_path: Path, steps: list[int]) -> LocalStore:
    store = LocalStore(tmp_path / "ck")
    writer = CheckpointWriter(store)
    for s in steps:
        writer.save(s, {"w": torch.full((10,), float(s))}, metrics={"loss": 1.0 / s}).result()
    writer.close()
    return store


def test_prune_deletes_whole_steps_and_torn_saves(tmp_path: Path) -> None:
    store = _store_with(tmp_path, [10, 20, 30, 40])
    torn = tmp_path / "ck" / step_dir(25)
    torn.mkdir()
    (torn / "shard-00000.bin").write_bytes(b"x" * 100)
    in_flight = tmp_path / "ck" / step_dir(50)  # newer than the newest commit: may be in flight
    in_flight.mkdir()
    (in_flight / "shard-00000.bin").write_bytes(b"y")
    preview = prune(store, RetentionPolicy(keep_last=2), now=time.time(), dry_run=True)
    assert preview.deleted == (10, 20) and preview.torn == (25,) and preview.objects == 0
    assert [e.step for e in list_committed(store)] == [10, 20, 30, 40]
    result = prune(store, RetentionPolicy(keep_last=2), now=time.time())
    assert result.deleted == (10, 20) and result.kept == (30, 40) and result.torn == (25,)
    assert result.bytes_freed >= 100
    assert [e.step for e in list_committed(store)] == [30, 40]
    assert not (tmp_path / "ck" / step_dir(10)).exists()
    assert not torn.exists() and in_flight.exists()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runner.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_checkpoints_cli_list_verify_prune(tmp_path: Path) -> None:
    store = _store_with(tmp_path, [1, 2, 3, 4])
    uri = store.uri
    listed = _cli("checkpoints", "list", uri, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[0]["metrics"] == {"loss": 1.0}
    table = _cli("checkpoints", "list", uri)
    assert "STEP" in table.stdout and "loss=0.25" in table.stdout

    assert _cli("checkpoints", "verify", uri).returncode == 0
    shard = tmp_path / "ck" / step_dir(3) / "shard-00000.bin"
    shard.write_bytes(b"\0" * shard.stat().st_size)
    bad = _cli("checkpoints", "verify", uri)
    assert bad.returncode == 1 and "step 3: checksum mismatch" in bad.stdout
    assert "step 4: ok" in bad.stdout

    pruned = _cli("checkpoints", "prune", uri, "--keep-last", "1", "--keep-best", "loss:max")
    assert pruned.returncode == 0, pruned.stderr
    assert "deleted 2 checkpoint(s) [2, 3]" in pruned.stdout
    assert [e.step for e in list_committed(store)] == [1, 4]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["checkpoints", "list", "ftp://x/y"], "unsupported checkpoint URI scheme"),
        (["checkpoints", "prune", "/tmp/x", "--keep-best", "loss:best"], "METRIC[:min|max"),
        (["checkpoints", "prune", "/tmp/x", "--max-age", "soon"], "not a duration"),
        (["dry-run", "--checkpoint-uri", "/tmp/x"], "no command given"),
    ],
)
def test_cli_bad_input_is_a_clear_error(args: list[str], message: str) -> None:
    result = _cli(*args)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr

"""Checkpoints: format, atomic commit, fallback past corruption, clear errors."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from runner.checkpoint import (
    MANIFEST,
    CheckpointWriter,
    commit_files,
    download_files,
    list_committed,
    load_checkpoint,
    read_manifest,
    restore_latest,
    step_dir,
    verify,
)
from runner.errors import BadURIError, CheckpointError, NoCheckpointError, StoreError
from runner.state import capture_rng, restore_rng, state_digest
from runner.store import LocalStore, open_store


def sample_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 8, generator=g)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "ints": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "rng": capture_rng(),
        "np": np.arange(5, dtype=np.float32),
        "meta": {"epoch": 2, "name": "x", "pair": (1, 2.5), "none": None},
    }


def test_round_trip_is_bit_identical(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    state = sample_state()
    writer = CheckpointWriter(store, shard_bytes=1024)  # force several shards
    info = writer.save(10, state, metrics={"loss": 1.25, "bad": float("nan")}).result()
    writer.close()
    assert info.step == 10 and info.bytes > 0
    manifest = read_manifest(store, 10)
    assert manifest.metrics == {"loss": 1.25, "bad": None}
    assert len([f for f in manifest.files if f.name.startswith("shard-")]) > 1
    restored = restore_latest(store)
    assert restored.step == 10 and restored.skipped == []
    assert state_digest(restored.state) == state_digest(state)
    assert restored.state["meta"]["pair"] == (1, 2.5)
    assert restored.state["bf16"].dtype == torch.bfloat16
    # RNG states restored from a checkpoint drive the generators exactly as before.
    restore_rng(restored.state["rng"])
    a = torch.rand(3)
    restore_rng(state["rng"])
    assert torch.equal(a, torch.rand(3))


NUMPY_RNG = """
import json, sys
import torch
from runner.state import capture_rng, restore_rng
imported = "numpy.random" in sys.modules  # numpy 2 imports it lazily, numpy 1 with numpy
first = capture_rng()
out = {"imported": imported, "captured": "numpy" in first,
       "imported_after": "numpy.random" in sys.modules}
import numpy.random
numpy.random.seed(7)
state = capture_rng()
a = numpy.random.rand(3).tolist()
numpy.random.rand(5)
restore_rng(state)
out["same_draws"] = numpy.random.rand(3).tolist() == a
print(json.dumps(out))
"""


def test_numpy_rng_is_captured_once_numpy_random_is_imported() -> None:
    # A fresh interpreter: whether numpy.random is imported depends on what ran before.
    out = subprocess.run(
        [sys.executable, "-c", NUMPY_RNG],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["captured"] == got["imported"], "captured only if something imported it"
    assert got["imported_after"] == got["imported"], "capturing does not import it"
    assert got["same_draws"], "once imported, its draws are restored"


def test_manifest_is_written_last_and_lists_checksums(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    writer = CheckpointWriter(store)
    writer.save(1, sample_state()).result()
    writer.close()
    doc = json.loads((tmp_path / step_dir(1) / MANIFEST).read_text())
    assert doc["step"] == 1 and doc["format"].startswith("trainbot-checkpoint/")
    names = {f["name"] for f in doc["files"]}
    on_disk = {p.name for p in (tmp_path / step_dir(1)).iterdir()} - {MANIFEST}
    assert names == on_disk
    manifest_mtime = (tmp_path / step_dir(1) / MANIFEST).stat().st_mtime_ns
    for name in names:
        assert (tmp_path / step_dir(1) / name).stat().st_mtime_ns <= manifest_mtime
    for f in doc["files"]:
        assert (
            len(f["sha256"]) == 64
            and f["size"] == (tmp_path / step_dir(1) / f["name"]).stat().st_size
        )


def test_shards_hashed_beside_their_writes_carry_the_sha256_of_their_bytes(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path)
    writer = CheckpointWriter(store, shard_bytes=3 << 20, chunk_bytes=1 << 16)
    g = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn(1 << 19, generator=g) for i in range(3)}  # 2 MiB each
    writer.save(1, state).result()
    writer.close()
    files = read_manifest(store, 1).files
    assert len([f for f in files if f.name.startswith("shard-")]) == 3
    for f in files:
        data = (tmp_path / step_dir(1) / f.name).read_bytes()
        assert f.sha256 == hashlib.sha256(data).hexdigest(), f.name
    assert hash_threads() == []


def hash_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ckpt-write-hash")]


def test_at_most_one_save_in_flight_and_staging_is_not_shared(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    writer = CheckpointWriter(store)
    t = torch.zeros(1000)
    futures = []
    for step in range(1, 6):
        t.fill_(step)
        futures.append(writer.save(step, {"t": t}))
        t.fill_(-1)  # mutating after save() must not leak into the checkpoint
    writer.close()
    assert [f.result().step for f in futures] == [1, 2, 3, 4, 5]
    for step in range(1, 6):
        state = load_checkpoint(store, read_manifest(store, step))
        assert torch.equal(state["t"], torch.full((1000,), float(step)))


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["manifest", "checksum", "missing-shard", "truncated", "meta"])
def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path: Path, damage: str) -> None:
    store = LocalStore(tmp_path)
    writer = CheckpointWriter(store)
    good, bad = sample_state(1), sample_state(2)
    writer.save(5, good).result()
    writer.save(9, bad).result()
    writer.close()
    sd = tmp_path / step_dir(9)
    shard = sd / "shard-00000.bin"
    if damage == "manifest":
        (sd / MANIFEST).write_text("{not json")
    elif damage == "checksum":
        _corrupt(shard)
    elif damage == "missing-shard":
        shard.unlink()
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-10])
    else:
        _corrupt(sd / "meta.pt")
    restored = restore_latest(store)
    assert restored.step == 5
    assert state_digest(restored.state) == state_digest(good)
    assert restored.skipped and restored.skipped[0][0] == 9
    assert verify(store, 9) and not verify(store, 5)
    # The good checkpoint is still there and untouched.
    assert [e.step for e in list_committed(store)] == [5, 9]


def test_every_checkpoint_damaged_is_a_clear_error(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    writer = CheckpointWriter(store)
    writer.save(3, sample_state()).result()
    writer.close()
    (tmp_path / step_dir(3) / MANIFEST).write_text('{"format": "other"}')
    with pytest.raises(CheckpointError, match=r"no usable checkpoint.*step 3: corrupt manifest"):
        restore_latest(store)


def test_empty_store_has_no_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(NoCheckpointError, match="no committed checkpoint"):
        restore_latest(LocalStore(tmp_path / "nothing"))


def test_step_without_manifest_does_not_exist(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    writer = CheckpointWriter(store)
    writer.save(2, sample_state()).result()
    writer.close()
    torn = tmp_path / step_dir(7)
    torn.mkdir()
    (torn / "shard-00000.bin").write_bytes(b"half")
    assert [e.step for e in list_committed(store)] == [2]
    assert restore_latest(store).step == 2


@pytest.mark.parametrize("uri", ["", "ftp://host/x", "s3://", "file://otherhost/x"])
def test_bad_uri_is_a_clear_error(uri: str) -> None:
    with pytest.raises(BadURIError):
        open_store(uri)


def test_unwritable_store_keeps_previous_checkpoint(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "ck")
    writer = CheckpointWriter(store)
    writer.save(1, sample_state()).result()
    errors: list[tuple[int, Exception]] = []
    # Make the next step directory impossible to create: a file stands in its place.
    (tmp_path / "ck" / step_dir(2)).write_bytes(b"in the way")
    bad = CheckpointWriter(store, on_error=lambda s, e: errors.append((s, e)))
    with pytest.raises(StoreError, match="cannot create"):
        bad.save(2, sample_state()).result()
    bad.close()
    writer.close()
    assert errors and errors[0][0] == 2
    assert hash_threads() == [], "a failed write ends its hashing too"
    assert restore_latest(store).step == 1


def test_files_checkpoint_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "out" / "epoch-3"
    (src / "sub").mkdir(parents=True)
    (src / "weights.bin").write_bytes(os.urandom(3000))
    (src / "sub" / "opt.bin").write_bytes(b"abc")
    store = LocalStore(tmp_path / "store")
    info = commit_files(store, 3, src, metrics={"loss": 0.5})
    manifest = read_manifest(store, 3)
    assert info.bytes == 3003 and manifest.kind == "files" and manifest.label == "epoch-3"
    target = download_files(store, manifest, tmp_path / "restore")
    assert (target / "weights.bin").read_bytes() == (src / "weights.bin").read_bytes()
    assert (target / "sub" / "opt.bin").read_bytes() == b"abc"
    with pytest.raises(CheckpointError, match="files"):
        load_checkpoint(store, manifest)


#: Imports torch once, then forks one writer per line it reads (``<root> <first step>``):
#: each round kills a fresh process mid-write without paying the interpreter's and
#: torch's start again (seconds a round on a busy machine). The forked writer says
#: ``ready <pid>`` and saves a stream of checkpoints until it is killed; the parent reaps
#: it and says how it ended (``ended <signal>``).
WRITER_ZYGOTE = textwrap.dedent(
    """
    import os, sys, torch
    from runner.checkpoint import CheckpointWriter
    from runner.store import LocalStore
    for line in sys.stdin:
        root, first = line.split()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                writer = CheckpointWriter(
                    LocalStore(root), shard_bytes=4 << 20, chunk_bytes=1 << 20
                )
                t = torch.empty(3 << 20)  # 12 MiB, several shards
                os.write(1, f"ready {os.getpid()}\\n".encode())
                step = int(first)
                while True:
                    step += 1
                    t.fill_(float(step))
                    writer.save(step, {"t": t, "step": step})
            finally:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        print("ended", os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1, flush=True)
    """
)


@pytest.mark.slow
def test_kill_9_during_writes_never_loads_a_torn_checkpoint(tmp_path: Path) -> None:
    """Kill -9 at random points of a stream of checkpoint writes; restore gets the newest
    complete checkpoint, and its content is exactly what that step saved."""
    rng = random.Random(1234)
    root = tmp_path / "ck"
    zygote = subprocess.Popen(
        [sys.executable, "-c", WRITER_ZYGOTE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path.cwd())},
    )
    assert zygote.stdin is not None and zygote.stdout is not None
    try:
        for _round in range(6):
            zygote.stdin.write(f"{root} {_round * 100_000}\n")
            zygote.stdin.flush()
            ready, pid = zygote.stdout.readline().split()
            assert ready == "ready"
            time.sleep(rng.uniform(0.05, 0.6))
            os.kill(int(pid), signal.SIGKILL)
            assert zygote.stdout.readline().split() == ["ended", str(int(signal.SIGKILL))]
            store = LocalStore(root)
            committed = [e.step for e in list_committed(store)]
            if not committed:
                continue
            restored = restore_latest(store)
            assert restored.skipped == []
            assert restored.step == committed[-1]
            assert restored.state["step"] == restored.step
            assert torch.equal(restored.state["t"], torch.full((3 << 20,), float(restored.step)))
    finally:
        zygote.kill()
        zygote.wait()
    assert list_committed(LocalStore(root)), "no checkpoint was ever committed"

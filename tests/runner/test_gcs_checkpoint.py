"""Checkpoints in Cloud Storage (gcp-storage-emulator): the ``checkpoints`` commands,
``exec --sync-dir``, and the tiny example preempted again and again under ``exec``
ending bit-identical to an uninterrupted run. The checkpoint round trip itself (resumable writes, restore, fallback, prune) is in the
store contract, for every store.

Processes find the emulator the standard way, through ``STORAGE_EMULATOR_HOST``.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from runner import EXIT_PREEMPTED, EXIT_SUCCEEDED
from runner.checkpoint import (
    CheckpointWriter,
    list_committed,
    read_manifest,
)
from runner.store.gcs import GCSStore
from tests.fakes.gcs_emulator import create_bucket, gcs_emulator
from tests.fakes.ingest import FakeIngest
from tests.runner.tinyproc import (
    ROOT,
    TINY,
    first_line_then_stop,
    preempt_once_synced,
    run_tiny,
    tiny_env,
)

__all__ = ["gcs_emulator"]  # the session's emulator, a fixture

EXEC = [sys.executable, "-m", "runner.cli", "exec"]


def _env(tmp_path: Path, host: str, uri: str, run_id: str, **extra: str) -> dict[str, str]:
    env = tiny_env(tmp_path, run_id=run_id, TRAINBOT_CHECKPOINT_URI=uri, **extra)
    env["STORAGE_EMULATOR_HOST"] = host
    return env


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runner.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_local_store_never_imports_the_gcs_client(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        from runner.store import open_store
        store = open_store({str(tmp_path / "ck")!r})
        store.put_bytes("k", b"v")
        assert store.get_bytes("k") == b"v"
        loaded = sorted(m for m in sys.modules if m.startswith(("google", "runner.store.gcs")))
        print(loaded)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_checkpoints_commands_work_on_gs(tmp_path: Path, gcs_emulator: str) -> None:
    bucket = create_bucket(gcs_emulator)
    uri = f"gs://{bucket}/team/r-cli"
    env = _env(tmp_path, gcs_emulator, f"gs://{bucket}/team", "r-cli")
    store = GCSStore(bucket, "team/r-cli", emulator_host=gcs_emulator)
    writer = CheckpointWriter(store)
    for step in (1, 2, 3):
        writer.save(step, {"w": torch.full((1000,), float(step))}, metrics={"loss": 1 / step})
    writer.close()

    listed = _cli(["checkpoints", "list", "--json", uri], env)
    assert listed.returncode == 0, listed.stderr
    assert [row["step"] for row in json.loads(listed.stdout)] == [1, 2, 3]
    verified = _cli(["checkpoints", "verify", uri], env)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.splitlines() == ["step 1: ok", "step 2: ok", "step 3: ok"]
    pruned = _cli(["checkpoints", "prune", "--keep-last", "1", uri], env)
    assert pruned.returncode == 0, pruned.stderr
    assert "deleted 2 checkpoint(s) [1, 2]" in pruned.stdout
    assert [e.step for e in list_committed(store)] == [3]

    missing = _cli(["checkpoints", "list", "gs://no-such-bucket-7e1/x"], env)
    assert missing.returncode != 0
    assert "bucket no-such-bucket-7e1 does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr


FILE_WRITER = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    root = pathlib.Path(os.environ["TRAINBOT_CHECKPOINT_DIR"])
    existing = sorted(root.glob("epoch-*"), key=lambda p: int(p.name.split("-")[1]))
    start = int(existing[-1].name.split("-")[1]) if existing else 0
    print("start", start, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    for epoch in range(start + 1, 1000):
        time.sleep(0.2)
        d = root / f"epoch-{epoch}"
        d.mkdir(parents=True)
        (d / "weights.bin").write_bytes(bytes([epoch % 256]) * 100_000)
    """
)


@pytest.mark.slow
def test_exec_sync_dir_syncs_to_gs_and_restores_on_a_new_instance(
    tmp_path: Path, gcs_emulator: str
) -> None:
    bucket = create_bucket(gcs_emulator)
    env = _env(tmp_path, gcs_emulator, f"gs://{bucket}/ck", "r-files")
    env.pop("TRAINBOT_EVENTS_FILE")
    sync = tmp_path / "instance-1" / "ckpt"
    script = [sys.executable, "-c", FILE_WRITER]
    proc = subprocess.Popen(
        [*EXEC, "--sync-dir", str(sync), "--settle", "0.3", "--", *script],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    err = preempt_once_synced(proc, sync)
    assert proc.returncode == EXIT_PREEMPTED, err
    store = GCSStore(bucket, "ck/r-files", emulator_host=gcs_emulator)
    steps = [e.step for e in list_committed(store)]
    assert steps and steps == sorted(steps)
    assert read_manifest(store, steps[-1]).kind == "files"

    # A new instance (an empty disk) gets the newest folder back before the script starts.
    sync2 = tmp_path / "instance-2" / "ckpt"
    proc = subprocess.Popen(
        [*EXEC, "--sync-dir", str(sync2), "--", *script],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first_line = first_line_then_stop(proc)
    assert first_line.strip() == f"start {steps[-1]}"
    restored = sync2 / f"epoch-{steps[-1]}" / "weights.bin"
    assert restored.read_bytes() == bytes([steps[-1] % 256]) * 100_000


@pytest.mark.slow
def test_tiny_preempted_under_exec_on_gs_ends_bit_identical_and_prunes(
    tmp_path: Path, gcs_emulator: str
) -> None:
    steps = 40
    # Slow steps, so that telemetry (relayed by `exec`, about a second late) lags a few
    # steps behind, not the whole run: each attempt is preempted part of the way in.
    base = ["--steps", str(steps), "--seed", "7", "--checkpoint-every", "10", "--step-delay", "0.1"]
    straight = run_tiny(base, tiny_env(tmp_path / "straight"))
    assert straight.code == EXIT_SUCCEEDED, straight.stderr
    assert straight.result is not None

    bucket = create_bucket(gcs_emulator)
    store = GCSStore(bucket, "ck/r-gcs", emulator_host=gcs_emulator)
    rng = random.Random(5)
    preempted: list[int] = []
    with FakeIngest(token="tok").start() as ingest:
        for attempt in range(1, 8):
            env = _env(
                tmp_path,
                gcs_emulator,
                f"gs://{bucket}/ck",
                "r-gcs",
                TRAINBOT_INGEST_URL=ingest.url,
                TRAINBOT_TOKEN="tok",
                TRAINBOT_ATTEMPT_ID=f"r-gcs-{attempt}",
                TRAINBOT_SPOOL_DIR=str(tmp_path / f"spool-{attempt}"),
            )
            env.pop("TRAINBOT_EVENTS_FILE")
            proc = subprocess.Popen(
                [*EXEC, "--", sys.executable, "-m", "runner.examples.tiny", *TINY, *base],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            # Preempt the first two attempts a few steps in: the SIGTERM goes to `exec`.
            if len(preempted) < 2:
                target = rng.randint(1, 3)

                def stepped(attempt: int = attempt, target: int = target, proc: Any = proc) -> bool:
                    return (
                        sum(
                            1
                            for e in ingest.accepted
                            if e.type == "metrics" and e.attempt == f"r-gcs-{attempt}"
                        )
                        >= target
                        or proc.poll() is not None
                    )

                assert ingest.wait_for(stepped, timeout=60)
                proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=90)
            if proc.returncode == EXIT_SUCCEEDED:
                break
            assert proc.returncode == EXIT_PREEMPTED, err
            # The flush on the notice is committed in the bucket, manifest last.
            newest = list_committed(store)[-1].step
            assert read_manifest(store, newest).step == newest
            preempted.append(newest)
        else:
            pytest.fail("the preempted run never finished")
    assert len(preempted) >= 2, "the test should preempt the run several times"
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1])
    assert result["step"] == steps
    assert result["params_sha256"] == straight.result["params_sha256"]

    # Retention prunes in the bucket, through the same command the scheduler's job runs.
    committed = [e.step for e in list_committed(store)]
    assert len(committed) >= 3 and committed[-1] == steps
    pruned = _cli(["checkpoints", "prune", "--keep-last", "2", store.uri], env)
    assert pruned.returncode == 0, pruned.stderr
    assert [e.step for e in list_committed(store)] == committed[-2:]
    # The run's own output is shipped under logs/ beside its checkpoints (runner.logship).
    kept = {
        int(o.key.split("/")[0].removeprefix("step-"))
        for o in store.list()
        if o.key.startswith("step-")
    }
    assert kept == set(committed[-2:]), "a pruned step leaves no object behind"
    verified = _cli(["checkpoints", "verify", store.uri], env)
    assert verified.returncode == 0, verified.stdout + verified.stderr

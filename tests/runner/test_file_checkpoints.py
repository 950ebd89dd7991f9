"""``exec --sync-dir`` syncs checkpoint *files* (``ckpt-50.pt``, Lightning's
``epoch=0-step=100.ckpt``), not only folders, and says so when nothing could be synced.

The end-to-end tests preempt an unmodified script after it wrote a checkpoint, then start
it again on an empty directory (a new instance) and check the step it resumes from.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from runner import EXIT_PREEMPTED, EXIT_SUCCEEDED
from runner.layout import list_committed, read_manifest
from runner.store import LocalStore
from runner.sync import FILES_LABEL, CheckpointSync, file_step
from tests.runner.stand_ins import Recorder, supervising
from tests.runner.tinyproc import preempt_when, tiny_env

EXEC = [sys.executable, "-m", "runner.cli", "exec"]
SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("ckpt-50.pt", 50),
        ("epoch=0-step=100.ckpt", 100),
        ("epoch=3-step=1200-v1.ckpt", 1200),
        ("model_500.bf16.safetensors", 500),
        ("optim-500.pt", 500),
        ("global_step300.pt", 300),
        ("0042.pt", 42),
        ("model.pt", None),
        ("last.ckpt", None),
        (".ckpt-50.pt", None),  # hidden: someone's temporary file
        ("ckpt-50.pt.tmp", None),
        ("ckpt-50.pt.partial", None),
        ("1b4e28ba-2fa1-11d2-883f-0016d3cca427", None),  # a temporary name
    ],
)
def test_which_files_hold_a_step(name: str, step: int | None) -> None:
    assert file_step(name) == step


def _sync(tmp: Path, settle_s: float = 0.2) -> CheckpointSync:
    return CheckpointSync(store=LocalStore(tmp / "ck"), root=tmp / "sync", settle_s=settle_s)


def test_files_of_one_step_settle_and_commit_together_and_restore_by_name(
    tmp_path: Path,
) -> None:
    sync = _sync(tmp_path)
    sync.root.mkdir()
    (sync.root / "model-10.pt").write_bytes(b"m" * 100)
    (sync.root / "optim-10.pt").write_bytes(b"o" * 50)
    (sync.root / "model.pt").write_bytes(b"x")
    assert sync.poll(now=0.0) == []  # first sight
    assert sync.poll(now=0.1) == []  # not settled yet
    (sync.root / "ckpt-20.pt").write_bytes(b"c" * 10)
    [info] = sync.poll(now=0.3)
    assert info.step == 10 and info.bytes == 150
    manifest = read_manifest(sync.store, 10)
    assert manifest.kind == "files" and manifest.label == FILES_LABEL
    assert [f.name for f in manifest.files] == ["model-10.pt", "optim-10.pt"]
    assert [c.step for c in sync.poll(now=0.6)] == [20]
    assert sync.ignored == {"model.pt"}

    fresh = CheckpointSync(store=sync.store, root=tmp_path / "instance-2")
    restored = fresh.restore()
    assert restored is not None and restored.step == 20 and restored.names == ("ckpt-20.pt",)
    assert (fresh.root / "ckpt-20.pt").read_bytes() == b"c" * 10
    assert fresh.done == {10, 20}


def test_a_file_the_script_still_has_open_is_not_committed_when_it_dies(tmp_path: Path) -> None:
    """The script dies (not by a notice) while writing ckpt-7.pt, after ckpt-5.pt: the torn
    file is left out, the finished one is committed although it had not settled yet."""
    sync = _sync(tmp_path, settle_s=60.0)
    script = (
        "import os, pathlib, time\n"
        "root = pathlib.Path(os.environ['TRAINBOT_CHECKPOINT_DIR'])\n"
        "(root / 'ckpt-5.pt').write_bytes(b'done' * 100)\n"
        "f = open(root / 'ckpt-7.pt', 'wb'); f.write(b'half'); f.flush()\n"
        "time.sleep(0.5)\n"
        "os._exit(1)\n"
    )
    env = tiny_env(tmp_path)
    env.pop("TRAINBOT_EVENTS_FILE")
    sink = Recorder()
    sup = supervising(script, sink, env=env, sync=sync, poll_s=0.05)
    assert sup.run() == 1
    assert [e.step for e in list_committed(sync.store)] == [5]
    assert sync.torn == {"ckpt-7.pt"}


def test_a_script_that_writes_nothing_syncable_is_told_so(tmp_path: Path) -> None:
    sync = _sync(tmp_path)
    script = (
        "import os, pathlib\n"
        "pathlib.Path(os.environ['TRAINBOT_CHECKPOINT_DIR'], 'model.pt').write_bytes(b'x')\n"
    )
    env = tiny_env(tmp_path)
    env.pop("TRAINBOT_EVENTS_FILE")
    sink = Recorder()
    code = supervising(script, sink, env=env, sync=sync).run()
    assert code == EXIT_SUCCEEDED
    warnings = [d["message"] for t, d in sink.events if t == "log" and d["level"] == "warning"]
    assert len(warnings) == 1
    assert "no checkpoint was synced" in warnings[0] and "model.pt" in warnings[0]
    assert "ckpt-500.pt" in warnings[0]  # and what to do instead
    assert sink.events[-1] == ("exit", {"code": 0, "reason": "succeeded"})


# --- unmodified scripts, preempted and resumed on a new instance -------------------------


def _preempt_after_a_checkpoint(
    script: list[str], env: Mapping[str, str], sync_dir: Path, store: LocalStore, *, at: int
) -> int:
    """Run under exec until a checkpoint of step >= ``at`` is committed, then SIGTERM
    the process group; the newest committed step."""
    proc = subprocess.Popen(
        [*EXEC, "--sync-dir", str(sync_dir), "--settle", "0.3", "--", *script],
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    code, _, err = preempt_when(
        proc,
        lambda: any(e.step >= at for e in list_committed(store)),
        what=f"a checkpoint of step {at}",
        timeout=120,
        poll_s=0.05,
    )
    assert code == EXIT_PREEMPTED, err
    return list_committed(store)[-1].step


def _resumed_from(script: list[str], env: Mapping[str, str], sync_dir: Path) -> int:
    """Start again on an empty directory; the step the script says it resumed from."""
    proc = subprocess.Popen(
        [*EXEC, "--sync-dir", str(sync_dir), "--", *script],
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = ""
    deadline = time.monotonic() + 120
    while not line.startswith("resumed from step") and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert line.startswith("resumed from step"), err[-3000:]
    return int(line.split()[-1])


def _env(tmp: Path, run_id: str) -> dict[str, str]:
    env = tiny_env(tmp, run_id=run_id)
    env.pop("TRAINBOT_EVENTS_FILE")
    return env


@pytest.mark.slow  # importing torch twice: 10-20 s on a busy machine
def test_a_torch_save_script_resumes_on_a_new_instance(tmp_path: Path) -> None:
    env = _env(tmp_path, "r-torch")
    store = LocalStore(tmp_path / "ck" / "r-torch")
    script = [sys.executable, str(SCRIPTS / "torch_save_train.py"), "--steps", "100000"]
    step = _preempt_after_a_checkpoint(script, env, tmp_path / "instance-1" / "ckpt", store, at=20)
    manifest = read_manifest(store, step)
    assert manifest.label == FILES_LABEL and [f.name for f in manifest.files] == [f"ckpt-{step}.pt"]
    sync2 = tmp_path / "instance-2" / "ckpt"
    assert _resumed_from(script, env, sync2) == step
    assert (sync2 / f"ckpt-{step}.pt").is_file()


@pytest.mark.slow  # importing lightning takes seconds, twice
def test_a_lightning_script_resumes_on_a_new_instance(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    env = _env(tmp_path, "r-lightning")
    store = LocalStore(tmp_path / "ck" / "r-lightning")
    script = [sys.executable, str(SCRIPTS / "lightning_train.py"), "--steps", "100000"]
    step = _preempt_after_a_checkpoint(script, env, tmp_path / "instance-1" / "ckpt", store, at=20)
    names = [f.name for f in read_manifest(store, step).files]
    assert names == [f"epoch=0-step={step}.ckpt"]
    sync2 = tmp_path / "instance-2" / "ckpt"
    assert _resumed_from(script, env, sync2) == step
    assert (sync2 / names[0]).is_file()

"""Scripts without the session API (issue 27, point 7): metrics read from what the
frameworks write, the Trainer's checkpoint folders synced when whole, the last look at a
notice, and the dry run of a script that writes its own checkpoints.

The files are written here as Hugging Face Trainer 5 and Lightning's CSVLogger write
them (the layout of ``trainer_state.json`` and ``metrics.csv``); the real Trainer runs in
tests/jobs/test_hf_trainer.py. Importing Lightning takes seconds, so its CSV is written
by hand in its format.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from runner import EXIT_PREEMPTED
from runner.dryrun import run_dry_run
from runner.frameworks import FrameworkMetrics, hf_points, lightning_points
from runner.layout import list_committed
from runner.preemption import Notice, PreemptionFlag
from runner.store import LocalStore
from runner.supervisor import Supervisor
from runner.sync import CheckpointSync
from tests.runner.stand_ins import Recorder, supervising
from tests.runner.tinyproc import tiny_env


def trainer_state(steps: range, *, nan_at: int | None = None, eval_at: int | None = None) -> str:
    """A trainer_state.json as Trainer writes it (json.dumps: NaN as a bare NaN)."""
    history: list[dict[str, Any]] = []
    for s in steps:
        loss = math.nan if s == nan_at else 3.0 - s / 100
        history.append(
            {"epoch": s / 512, "grad_norm": 0.8, "learning_rate": 1e-3, "loss": loss, "step": s}
        )
        if s == eval_at:
            history.append({"epoch": s / 512, "eval_loss": 2.5, "step": s})
    history.append({"epoch": 1.0, "step": steps[-1], "train_loss": 2.9, "train_runtime": 1.5})
    state = {"global_step": steps[-1], "log_history": history, "max_steps": 1000}
    return json.dumps(state, indent=2, sort_keys=True)


def hf_folder(root: Path, step: int, *, state: bool = True, mtime: float | None = None) -> Path:
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * 256)
    (folder / "optimizer.pt").write_bytes(b"o" * 128)
    if state:
        path = folder / "trainer_state.json"
        path.write_text(trainer_state(range(1, step + 1)))
        if mtime is not None:
            os.utime(path, (mtime, mtime))
    return folder


def test_trainer_state_log_history_becomes_points() -> None:
    step, points = hf_points(trainer_state(range(1, 6), nan_at=4, eval_at=5))
    assert step == 5
    assert [p.step for p in points] == [1, 2, 3, 4, 5]  # the summary entry is not a step
    assert points[0].loss == pytest.approx(2.99)
    assert points[0].metrics == {"epoch": 1 / 512, "grad_norm": 0.8, "learning_rate": 1e-3}
    assert math.isnan(points[3].loss or 0.0)  # a NaN loss stays NaN: the divergence rule's
    assert points[4].loss == pytest.approx(2.95) and points[4].metrics["eval_loss"] == 2.5
    with pytest.raises(ValueError, match="log_history"):
        hf_points('{"global_step": 3}')


def test_lightning_csv_rows_become_points_and_a_torn_last_line_waits() -> None:
    text = (
        "epoch,step,train_loss,val_loss\n"
        "0,49,2.5,\n"
        "0,99,2.25,\n"
        "0,99,,2.4\n"  # validation at the same step: one point
        "1,149,nan,\n"
        "1,19"  # being written
    )
    points = lightning_points(text)
    assert [p.step for p in points] == [49, 99, 149]
    assert points[0].loss == 2.5 and points[0].metrics == {"epoch": 0.0, "train_loss": 2.5}
    assert points[1].loss == 2.25 and points[1].metrics["val_loss"] == 2.4
    assert math.isnan(points[2].loss or 0.0)


def test_each_step_is_sent_once_with_the_step_time_measured_between_writes(
    tmp_path: Path,
) -> None:
    t0 = time.time() - 100
    hf_folder(tmp_path, 10, mtime=t0)
    reader = FrameworkMetrics(tmp_path)
    first = reader.poll(now=0.0)
    assert [d["step"] for _, d in first] == list(range(1, 11))
    assert all(math.isnan(d["step_time_s"]) for _, d in first)  # nothing to measure against
    assert reader.poll(now=0.5) == []  # under every_s: not even looked at

    hf_folder(tmp_path, 20, mtime=t0 + 2.0)
    second = reader.poll(now=1.5)
    assert [d["step"] for _, d in second] == list(range(11, 21))
    assert all(d["step_time_s"] == pytest.approx(0.2) for _, d in second)
    # Spread over the interval they ran in, the last at the file's write.
    assert second[-1][0] == pytest.approx(t0 + 2.0) and second[0][0] == pytest.approx(t0 + 0.2)
    assert second[0][1]["loss"] == pytest.approx(2.89)
    assert reader.poll(now=3.0, force=True) == []

    # A Lightning CSV beside it, a few folders down, is read too; then a torn state file
    # is skipped until it is whole.
    csv = tmp_path / "lightning_logs" / "version_0" / "metrics.csv"
    csv.parent.mkdir(parents=True)
    csv.write_text("epoch,step,train_loss\n0,25,1.5\n")
    assert [(d["step"], d["loss"]) for _, d in reader.poll(now=4.5)] == [(25, 1.5)]
    torn = hf_folder(tmp_path, 30, state=False) / "trainer_state.json"
    torn.write_text(trainer_state(range(1, 31))[:200])
    assert reader.poll(now=6.0) == []
    torn.write_text(trainer_state(range(1, 31)))
    assert [d["step"] for _, d in reader.poll(now=7.5)] == list(range(26, 31))

    # A new attempt resumed from step 30 does not send the restored history again.
    assert FrameworkMetrics(tmp_path, after_step=30).poll(now=0.0) == []


def _sync(tmp: Path, *, settle_s: float, name: str = "out") -> CheckpointSync:
    root = tmp / name
    root.mkdir()
    return CheckpointSync(store=LocalStore(tmp / f"ck-{name}"), root=root, settle_s=settle_s)


def test_a_trainer_folder_is_whole_once_its_state_is_written(tmp_path: Path) -> None:
    sync = _sync(tmp_path, settle_s=0.0)
    hf_folder(sync.root, 10, state=False)  # model and optimizer written, the state not yet

    def nobody() -> set[str]:
        return set()

    for now in (0.0, 1.0, 2.0):
        assert sync.poll(now=now, open_paths=nobody) == []
    assert sync.poll(now=3.0, final=True, clean=False) == []
    assert sync.torn == {"checkpoint-10"}
    # With its state written and closed it is committed at once, without settling.
    slow = _sync(tmp_path, settle_s=3600.0, name="slow")
    hf_folder(slow.root, 20)
    [info] = slow.poll(now=0.0, open_paths=nobody)
    assert info.step == 20
    # ... but not while the script still holds a file of it open.
    open_state = str((hf_folder(slow.root, 30) / "trainer_state.json").resolve())
    assert slow.poll(now=1.0, open_paths=lambda: {open_state}) == []
    assert [c.step for c in slow.poll(now=2.0, open_paths=nobody)] == [30]


def test_the_notice_commits_closed_files_at_once_and_not_open_ones(tmp_path: Path) -> None:
    sync = _sync(tmp_path, settle_s=3600.0)
    (sync.root / "epoch=0-step=40.ckpt").write_bytes(b"c" * 64)
    (sync.root / "epoch=0-step=50.ckpt").write_bytes(b"half")
    writing = {str((sync.root / "epoch=0-step=50.ckpt").resolve())}
    assert sync.poll(now=0.0, open_paths=lambda: writing) == []  # not settled, no notice
    [info] = sync.poll(now=0.1, open_paths=lambda: writing, notice=True)
    assert info.step == 40
    assert [e.step for e in list_committed(sync.store)] == [40]


HF_LIKE = """\
import json, os, pathlib, sys, time
root = pathlib.Path(os.environ["TRAINBOT_CHECKPOINT_DIR"])
found = sorted(int(p.name.split("-")[1]) for p in root.glob("checkpoint-*"))
start = found[-1] if found else 0
print(f"resuming from {start}", flush=True)
history = json.loads((root / f"checkpoint-{start}" / "trainer_state.json").read_text())[
    "log_history"] if start else []
for step in range(start + 1, start + 11):
    time.sleep(0.02)
    history.append({"loss": 3.0 / step, "learning_rate": 0.001, "step": step})
    if step % 5 == 0:
        d = root / f"checkpoint-{step}"
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"w" * 100)
        state = {"global_step": step, "log_history": history}
        (d / "trainer_state.json").write_text(json.dumps(state))
"""


def test_a_script_logging_like_the_trainer_reports_its_loss_and_resumes(tmp_path: Path) -> None:
    """Under the supervisor, twice on fresh folders: the second attempt says it restored
    step 10 and sends only the steps after it."""
    env = tiny_env(tmp_path)
    env.pop("TRAINBOT_EVENTS_FILE")
    store = LocalStore(tmp_path / "ck" / "r-test")
    sinks = []
    for n in (1, 2):
        sink = Recorder()
        sync = CheckpointSync(store=store, root=tmp_path / f"out{n}", settle_s=60.0)
        code = Supervisor(
            [sys.executable, "-c", HF_LIKE], sink=sink, sync=sync, install_signals=False, env=env
        ).run()
        assert code == 0
        sinks.append(sink)
    first, second = ([d for t, d in s.events if t == "metrics"] for s in sinks)
    assert [d["step"] for d in first] == list(range(1, 11))
    assert first[0]["loss"] == 3.0 and first[0]["metrics"] == {"learning_rate": 0.001}
    assert [d["step"] for d in second] == list(range(11, 21))
    assert [d["step"] for t, d in sinks[1].events if t == "restored"] == [10]
    assert [e.step for e in list_committed(store)] == [5, 10, 15, 20]


FILE_SAVER = """\
import os, pathlib, sys, time
root = pathlib.Path(os.environ["TRAINBOT_CHECKPOINT_DIR"])
found = sorted(int(p.name[5:-3]) for p in root.glob("ckpt-*.pt"))
step = found[-1] if found and sys.argv[1] == "resume" else 0
while True:
    step += 1
    time.sleep(0.05)
    if step % 4 == 0:
        (root / f"ckpt-{step}.pt").write_bytes(str(step).encode() * 100)
"""


@pytest.mark.parametrize("mode", ["resume", "start-over"])
def test_the_dry_run_of_a_sync_dir_script(tmp_path: Path, mode: str) -> None:
    """Synced, killed, restored on a fresh folder: one that resumes passes with its
    figures; one that starts over fails, saying so."""
    env = tiny_env(tmp_path)
    report = run_dry_run(
        [sys.executable, "-c", FILE_SAVER, mode],
        checkpoint_uri=str(tmp_path / "ck"),
        run_id="r-test-dry-run",
        timeout_s=60.0,
        env=env,
        sync=True,
    )
    if mode == "start-over":
        assert not report.ok
        [problem] = report.problems
        assert "the checkpoint of step 4: it started over" in problem
        assert f"after the restore of step {report.steps_before_kill}" in problem
        return
    assert report.ok, report.problems
    assert report.steps_before_kill >= 8 and report.steps_before_kill % 4 == 0
    assert report.steps_after_restore == 4  # its next checkpoint
    assert report.saved_sha256 == report.restored_sha256 is not None
    assert report.checkpoint_bytes == len(str(report.steps_before_kill)) * 100
    assert report.write_s is not None and report.restore_s is not None
    assert report.step_time_s is not None and 0.04 < report.step_time_s < 1.0
    assert report.daly_interval_s is not None


@pytest.mark.slow  # importing lightning takes seconds
def test_a_lightning_scripts_csv_loss_is_sent(tmp_path: Path) -> None:
    """Lightning's own CSVLogger, under the supervisor: its train_loss is the loss."""
    pytest.importorskip("lightning")
    env = tiny_env(tmp_path)
    env.pop("TRAINBOT_EVENTS_FILE")
    sink = Recorder()
    sync = CheckpointSync(store=LocalStore(tmp_path / "ck"), root=tmp_path / "out", settle_s=0.5)
    script = Path(__file__).parent / "scripts" / "lightning_train.py"
    command = [sys.executable, str(script), "--steps", "30", "--step-s", "0", "--csv"]
    code = Supervisor(command, sink=sink, sync=sync, install_signals=False, env=env).run()
    assert code == 0
    metrics = [d for t, d in sink.events if t == "metrics"]
    assert [d["step"] for d in metrics] == [4, 9, 14, 19, 24, 29]  # every 5 steps
    assert all(isinstance(d["loss"], float) and d["loss"] > 0 for d in metrics)
    assert all("epoch" in d["metrics"] for d in metrics)
    assert [e.step for e in list_committed(sync.store)] == [10, 20, 30]


#: Told to stop, it replaces its older checkpoint (as save_top_k=1 does at a last save).
WRITES_THEN_WAITS = """\
import os, pathlib, signal, time
root = pathlib.Path(os.environ["TRAINBOT_CHECKPOINT_DIR"])
(root / "epoch=0-step=40.ckpt").write_bytes(b"c" * 64)
f = open(root / "epoch=0-step=50.ckpt", "wb"); f.write(b"half"); f.flush()
def stop(*_):
    (root / "epoch=0-step=40.ckpt").unlink()
    os._exit(1)
signal.signal(signal.SIGTERM, stop)
(root / "written").touch()
time.sleep(60)
"""


def test_at_the_notice_what_is_whole_is_synced_before_the_script_is_stopped(
    tmp_path: Path,
) -> None:
    """A checkpoint far from settled (an hour's settle) is committed when the notice
    comes, before the script is signalled, because the script has closed it (the script
    then deletes it); the one it still writes is not."""
    env = tiny_env(tmp_path)
    env.pop("TRAINBOT_EVENTS_FILE")
    sync = CheckpointSync(store=LocalStore(tmp_path / "ck"), root=tmp_path / "out", settle_s=3600)
    flag = PreemptionFlag()

    def notice_once_written() -> None:
        deadline = time.monotonic() + 60
        while not (sync.root / "written").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        now = time.monotonic()
        flag.set(Notice(source="aws", reason="test", received_at=now, deadline=now + 120))

    notifier = threading.Thread(target=notice_once_written)
    notifier.start()
    sink = Recorder()
    code = supervising(WRITES_THEN_WAITS, sink, env=env, sync=sync, flag=flag, poll_s=0.05).run()
    notifier.join()
    assert code == EXIT_PREEMPTED
    assert [e.step for e in list_committed(sync.store)] == [40]
    types = [t for t, _ in sink.events]
    assert types.index("checkpoint_committed") < types.index("exit")

"""Checkpoints across ranks: parts, rank 0's commit, agreed restore, agreed stops.

The fast tests run a one-rank gloo group in this process and write the other rank's part
as that rank would; the slow one runs the DDP example under torchrun with two ranks and
preempts one of them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from runner.checkpoint import list_committed, read_manifest, verify
from runner.distributed import DistributedSession, Gang, WorldSizeError, part_dir
from runner.distributed.parts import GangWriter, PartWriter
from runner.errors import CheckpointError
from runner.session import EverySteps, SessionConfig
from runner.session.notice import REPORT_S
from runner.state import capture_rng
from runner.store import run_store

ROOT = Path(__file__).resolve().parents[2]


class Counter:
    """A rank's own state: how far it has read."""

    def __init__(self) -> None:
        self.served = 0

    def state_dict(self) -> dict[str, Any]:
        return {"served": self.served}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.served = int(state["served"])


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gang]:
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        yield Gang.current()
    finally:
        dist.destroy_process_group()


def _train(config: SessionConfig, steps: int, **kw: Any) -> tuple[DistributedSession, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = Counter()
    session = DistributedSession(config, decision=EverySteps(2), install_signals=False, **kw)
    with session as s:
        s.track(model=model, optimizer=opt)
        s.track_local(data=data)
        for _ in s.steps(steps):
            data.served += 1
            loss = model(torch.randn(3, 4)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return session, model


def test_torn_part_is_not_restored(tmp_path: Path, one_rank: Gang) -> None:
    config = SessionConfig(checkpoint_uri=str(tmp_path), run_id="r")
    first, _ = _train(config, 4)
    assert first.exit_code == 0
    store = run_store(str(tmp_path), "r")
    assert [e.step for e in list_committed(store)] == [2, 4]
    shard = tmp_path / "r" / "step-0000000004" / part_dir(0) / "shard-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[3] ^= 0xFF
    shard.write_bytes(raw)
    assert verify(store, 4) and "rank-00000/shard-00000.bin" in verify(store, 4)[0]
    assert verify(store, 2) == []

    events = tmp_path / "events.jsonl"
    again = SessionConfig(checkpoint_uri=str(tmp_path), run_id="r", events_file=str(events))
    second, _ = _train(again, 4)
    restored = [e["data"] for e in _events(events) if e["type"] == "restored"]
    assert restored == [{"step": 2, "fallback_from": 4, "restore_s": restored[0]["restore_s"]}]
    assert second.exit_code == 0
    assert verify(store, 4) == []  # step 4 written again, whole


def test_step_commits_only_once_every_part_is_in(tmp_path: Path) -> None:
    store = run_store(str(tmp_path), "r")
    state = {"step": 3, "objects": {"w": torch.arange(6.0)}}
    part0 = PartWriter(store, rank=0, world_size=2, nonce="n1")
    part0.save(3, {"step": 3, "objects": {"data": {"served": 3}}})
    part0.wait()
    gang = GangWriter(store, world_size=2, nonce="n1", part_timeout_s=0.3)
    with pytest.raises(CheckpointError, match="rank 1's part is missing"):
        gang.save(3, state).result()
    assert list_committed(store) == []

    # A part another attempt left at this step is not this attempt's.
    stale = PartWriter(store, rank=1, world_size=2, nonce="old")
    stale.save(3, {"step": 3, "objects": {"data": {"served": 99}}})
    stale.wait()
    with pytest.raises(CheckpointError, match="another attempt"):
        gang.save(3, state).result()
    assert list_committed(store) == []

    part1 = PartWriter(store, rank=1, world_size=2, nonce="n1")
    part1.save(3, {"step": 3, "objects": {"data": {"served": 3}}})
    part1.wait()
    info = gang.save(3, state).result()
    assert [e.step for e in list_committed(store)] == [3]
    assert verify(store, 3) == []
    names = {f.name for f in read_manifest(store, 3).files}
    assert {"meta.pt", "rank-00000/part.json", "rank-00001/meta.pt"} <= names
    assert info.bytes == sum((tmp_path / "r" / "step-0000000003" / n).stat().st_size for n in names)
    for w in (part0, stale, part1, gang):
        w.close()


def test_world_size_change(tmp_path: Path, one_rank: Gang) -> None:
    """A two-rank checkpoint resumed by one rank: a clear error, unless opted in."""
    store = run_store(str(tmp_path), "r")
    torch.manual_seed(1)
    saved = nn.Linear(4, 2)
    writers = [PartWriter(store, rank=r, world_size=2, nonce="n") for r in (0, 1)]
    for r, w in enumerate(writers):
        w.save(6, {"step": 6, "objects": {"data": {"served": 10 + r}}, "rng": capture_rng()})
        w.wait()
    gang = GangWriter(store, world_size=2, nonce="n", part_timeout_s=5)
    gang.save(6, {"step": 6, "objects": {"model": saved.state_dict()}}).result()
    config = SessionConfig(checkpoint_uri=str(tmp_path), run_id="r")

    with pytest.raises(WorldSizeError, match="saved by 2 ranks and this run has 1"):
        _resume(config, fresh=False)
    model, data, session = _resume(config, fresh=True)
    assert session.step == 6
    assert torch.equal(model.state_dict()["weight"], saved.state_dict()["weight"])
    assert data.served == 0  # the rank's own state as the script built it
    gang.close()
    for w in writers:
        w.close()


def _resume(config: SessionConfig, *, fresh: bool) -> tuple[nn.Module, Counter, DistributedSession]:
    model, data = nn.Linear(4, 2), Counter()
    session = DistributedSession(config, install_signals=False, fresh_local_on_resize=fresh)
    with session as s:
        s.track(model=model)
        s.track_local(data=data)
        s.restore()
    return model, data, session


# -- two ranks under torchrun


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _gone(pids: list[int], *, within_s: float) -> bool:
    """Whether every process in ``pids`` has ended (and been reaped) within the time."""
    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _torchrun(
    tmp: Path,
    launch: int,
    *,
    sigterm_rank: int | None = None,
    after_s: float = 0.0,
    sig: signal.Signals = signal.SIGTERM,
) -> dict[str, Any]:
    """One launch of the DDP example on two ranks; ``sig`` to ``sigterm_rank`` once it
    trains. Its result line, or (no line: a rank was killed) what is known of it."""
    events = tmp / f"events-{launch}.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINBOT_")}
    env.update(
        PYTHONPATH=str(ROOT),
        TRAINBOT_RUN_ID="ddp",
        TRAINBOT_CHECKPOINT_URI=str(tmp / "ck"),
        TRAINBOT_EVENTS_FILE=str(events),
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(_free_port()), "-m", "runner.examples.tiny_ddp",
        "--steps", "40", "--dim", "32", "--checkpoint-every", "7", "--step-delay", "0.03",
    ]  # fmt: skip
    # Into files, not pipes: nobody reads a pipe while the test waits to send the signal.
    out_path, err_path = tmp / f"out-{launch}.txt", tmp / f"err-{launch}.txt"
    with open(out_path, "w") as out_f, open(err_path, "w") as err_f:
        proc = subprocess.Popen(cmd, env=env, stdout=out_f, stderr=err_f, cwd=tmp)
    if sigterm_rank is not None:
        rank_file = events if sigterm_rank == 0 else Path(f"{events}.rank-{sigterm_rank}")
        deadline = time.monotonic() + 180
        pid = None
        while time.monotonic() < deadline and proc.poll() is None:
            seen = _events(rank_file)
            started = [e for e in seen if e["type"] == "started"]
            if started and any(e["type"] == "metrics" for e in seen):
                pid = int(started[-1]["data"]["pid"])
                break
            time.sleep(0.05)
        time.sleep(after_s)
        if pid is not None and proc.poll() is None:
            os.kill(pid, sig)
    proc.wait(timeout=240)
    out, err = out_path.read_text(), err_path.read_text()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    pids = [
        int(e["data"]["pid"])
        for f in (events, Path(f"{events}.rank-1"))
        for e in _events(f)
        if e["type"] == "started"
    ]
    if sig == signal.SIGKILL:
        return {"returncode": proc.returncode, "pids": pids, "stderr": err}
    assert lines, f"no result line (rc {proc.returncode}):\n{err[-3000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    exits = [
        e["data"]["code"]
        for f in (events, Path(f"{events}.rank-1"))
        for e in _events(f)
        if e["type"] == "exit"
    ]
    result["exit_codes"] = exits
    return result


@pytest.mark.slow
@pytest.mark.timeout(900)  # five torchrun launches of three processes each
def test_sigterm_to_one_rank_stops_both_and_resumes_bit_exactly(tmp_path: Path) -> None:
    (tmp_path / "clean").mkdir()
    (tmp_path / "pre").mkdir()
    clean = _torchrun(tmp_path / "clean", 0)
    assert clean["exit_code"] == 0 and clean["step"] == 40

    rng = random.Random(16)
    # A rank lost without notice (SIGKILL, as a lost node): the other rank does not hang
    # in its next collective, nothing of the job is left running, and the launches below
    # resume from the newest step that was committed before it.
    killed = _torchrun(tmp_path / "pre", 0, sigterm_rank=1, after_s=0.5, sig=signal.SIGKILL)
    assert killed["returncode"] != 0 and len(killed["pids"]) == 2, killed["stderr"][-2000:]
    assert _gone(killed["pids"], within_s=30), "a rank outlived its job"
    kept = [e.step for e in list_committed(run_store(str(tmp_path / "pre" / "ck"), "ddp"))]
    preempted_at: list[int] = []
    for launch in range(1, 8):
        if len(preempted_at) >= 2:
            result = _torchrun(tmp_path / "pre", launch)
        else:
            rank = rng.randrange(2)
            result = _torchrun(tmp_path / "pre", launch, sigterm_rank=rank, after_s=rng.random())
        steps = {r["step"] for r in result["ranks"]}
        assert len(steps) == 1, f"the ranks stopped at different steps: {result['ranks']}"
        if result["exit_code"] == 0:
            break
        assert result["exit_code"] == 75 and result["exit_codes"] == [75, 75], result
        assert {r["stop_reason"] for r in result["ranks"]} == {"preempted"}
        preempted_at.append(result["step"])
    assert len(preempted_at) >= 2, preempted_at
    assert result["step"] == 40
    assert result["params_sha256"] == clean["params_sha256"]
    first_restore = next(
        e["data"]["step"]
        for e in _events(tmp_path / "pre" / "events-1.jsonl")
        if e["type"] == "restored"
    )
    assert first_restore == (kept[-1] if kept else 0)


# -- sharded state (FSDP) through torch.distributed.checkpoint


def _fsdp(ck: Path, ranks: int, *args: str) -> dict[str, Any]:
    """``tests/runner/scripts/fsdp_train.py`` under torchrun on ``ranks`` processes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINBOT_")}
    env.update(
        PYTHONPATH=str(ROOT),
        TRAINBOT_RUN_ID="fsdp",
        TRAINBOT_CHECKPOINT_URI=str(ck),
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
        "--master-port", str(_free_port()),
        str(ROOT / "tests" / "runner" / "scripts" / "fsdp_train.py"), *args,
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ck.parent)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no result line (rc {done.returncode}):\n{done.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    result["returncode"] = done.returncode
    return result


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_saves_on_two_ranks_and_resumes_on_one_and_on_two(tmp_path: Path) -> None:
    """FSDP's shards go through torch.distributed.checkpoint into each rank's part; a
    restore at another world size is resharded by DCP, to the bit (the full parameters
    and Adam's moments, gathered)."""
    ck = tmp_path / "ck"
    two = _fsdp(ck, 2, "--steps", "6", "--every", "3")
    assert (two["world"], two["restored_step"], two["step"], two["exit_code"]) == (2, 0, 6, 0)
    manifest = read_manifest(run_store(str(ck), "fsdp"), 6)
    parts = {f.name.split("/")[0] for f in manifest.files if "/" in f.name}
    assert parts == {"rank-00000", "rank-00001"}, "each rank's shards are in its own part"

    one = _fsdp(ck, 1, "--steps", "8", "--every", "3", "--fresh-local")
    assert (one["world"], one["restored_step"], one["step"]) == (1, 6, 8)
    assert one["restored_sha256"] == two["sha256"]

    again = _fsdp(ck, 2, "--steps", "10", "--every", "3", "--fresh-local")
    assert (again["world"], again["restored_step"], again["step"]) == (2, 8, 10)
    assert again["restored_sha256"] == one["sha256"]

    # A checkpoint DCP cannot load into this model (another width): said, not a traceback.
    wider = _fsdp(ck, 2, "--steps", "12", "--dim", "32", "--fresh-local")
    assert wider["returncode"] != 0
    assert "could not be loaded into this run's sharded state" in wider["error"]
    assert "Size mismatch" in wider["error"]
    # Another world size without --fresh-local: each rank's own state cannot be split.
    stuck = _fsdp(ck, 1, "--steps", "12")
    assert "saved by 2 ranks and this run has 1" in stuck["error"]


# -- a preempted gang's exit


def _gang_noticed(tmp: Path, *, window_s: float, own_floats: int) -> list[dict[str, Any]]:
    """Two ranks (processes of ddp_notice_child.py) noticed at the same step, their store
    slowing down so that the flush outlasts the window: what each rank emitted, and when."""
    init = tmp / "pg-init"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINBOT_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", WORLD_SIZE="2", GLOO_SOCKET_IFNAME="lo")
    procs = []
    for rank in range(2):
        cmd = [
            sys.executable, "-m", "tests.runner.ddp_notice_child", "--init", str(init),
            "--store", str(tmp / "ck"), "--out", str(tmp / f"rank-{rank}.json"),
            "--window-s", str(window_s), "--own-floats", str(own_floats),
        ]  # fmt: skip
        err = open(tmp / f"err-{rank}.txt", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(cmd, env={**env, "RANK": str(rank)}, stderr=err), err))
    for proc, err in procs:
        proc.wait(timeout=120)
        err.close()
    out = []
    for rank, (proc, _) in enumerate(procs):
        assert proc.returncode == 0, (tmp / f"err-{rank}.txt").read_text()[-3000:]
        out.append(json.loads((tmp / f"rank-{rank}.json").read_text()))
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "own_floats",
    [1 << 18, 1 << 16],
    ids=["every-part-slow", "parts-land-the-step-does-not"],
)
def test_a_preempted_gang_sends_each_ranks_exit_before_the_deadline(
    tmp_path: Path, own_floats: int
) -> None:
    """A flush that outlasts the window must not hold the exit (and its flush report)
    past the kill on any rank: rank 0's commit waits for every rank's part, and the ranks
    meet at the end, but the instance is killed at the deadline whatever they wait for.
    With small parts, rank 0's own part lands in the window and the step's replicated
    state does not: the wait for both together ends by the deadline (it once waited the
    time left for each in turn)."""
    window_s = 2.0
    ranks = _gang_noticed(tmp_path, window_s=window_s, own_floats=own_floats)
    for r in ranks:
        [exit_event] = [e for e in r["events"] if e["type"] == "exit"]
        assert exit_event["data"]["code"] == 75 and r["exit_code"] == 75, exit_event
        before = r["deadline"] - exit_event["at"]
        # Most of the report's time (REPORT_S, 0.4 s) is left for the exit to leave.
        assert before > REPORT_S / 2, (r["rank"], before, exit_event["data"])
        report = exit_event["data"]["flush"]
        assert report["notice_step"] == 9 and report["committed_step"] == 5, report
        assert not report["flushes"][0]["landed"], report
        # The write went on after the exit: the processes ended once it was done.
        assert r["closed"] > r["deadline"], (r["closed"], r["deadline"])

"""The code archive ``trainbot-runner pack`` makes, and the environment archive's fallbacks
(runner.code, runner.setup): deterministic packs, a corrupt code archive refused, a
corrupt or missing environment archive rebuilt by setup."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.code import CodeError, fetch_archive, pack
from runner.setup import ENV_DIR, SetupFailed, SetupPlan, environment_key, prepare_environment
from runner.store import open_store


def _tree(root: Path) -> None:
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('hi')\n")
    (root / "pkg" / "model.py").write_text("X = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    for junk in (".git/HEAD", ".venv/bin/python", "pkg/__pycache__/model.pyc", "data/big.bin"):
        (root / junk).parent.mkdir(parents=True, exist_ok=True)
        (root / junk).write_text("not packed")
    (root / ".trainbotignore").write_text("# data stays out\ndata/\n")


def test_pack_is_deterministic_and_content_addressed(tmp_path: Path) -> None:
    store = tmp_path / "store"
    one, two = tmp_path / "one", tmp_path / "two"
    _tree(one)
    _tree(two)
    os.utime(two / "train.py", (1, 1))  # other times and another folder: the same archive
    uri = pack(one, str(store))
    assert pack(two, str(store)) == uri
    name = uri.rsplit("/", 1)[1]
    assert name == f"code-{hashlib.sha256((store / name).read_bytes()).hexdigest()}.tar.gz"
    out = tmp_path / "out"
    fetch_archive(uri, out)
    found = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert found == [".trainbotignore", "pkg/model.py", "run.sh", "train.py"]
    assert os.access(out / "run.sh", os.X_OK)
    # The command line prints the spec's line.
    done = subprocess.run(
        [sys.executable, "-m", "runner.cli", "pack", str(one), str(store)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == f"code.archive: {uri}"
    (two / "train.py").write_text("print('changed')\n")
    assert pack(two, str(store)) != uri


def test_the_control_planes_pack_command_is_the_runners(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``trainbot pack DIR STORE`` packs as ``trainbot-runner pack`` does (the same
    archive, the same spec line); a folder that is not there is one line, no traceback."""
    from bot.cli import main

    src = tmp_path / "src"
    _tree(src)
    store = f"file://{tmp_path / 'store'}"
    assert main(["pack", str(src), store]) == 0
    out, _ = capsys.readouterr()
    assert out == f"code.archive: {pack(src, store)}\n"
    assert main(["pack", str(tmp_path / "nowhere"), store]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"trainbot: {tmp_path / 'nowhere'} is not a directory: give the folder that holds "
        "your code\n"
    )


def test_a_code_archive_is_read_with_the_instances_own_credentials(
    tmp_path: Path, moto_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an instance whose checkpoint store signs with the broker's credentials (its
    run's prefix only), the code archive, outside that prefix, is read as the training
    script reads its data: with the instance's own (here moto's static ones)."""
    from tests.fakes.moto_server import create_bucket

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_server)
    src = tmp_path / "src"
    _tree(src)
    uri = pack(src, f"s3://{create_bucket(moto_server, prefix='code')}/code")
    # No control plane to broker anything: a brokered read would fail.
    monkeypatch.setenv("TRAINBOT_STORE_CREDENTIALS", "broker")
    monkeypatch.delenv("TRAINBOT_INGEST_URL", raising=False)
    digest = fetch_archive(uri, tmp_path / "out")
    assert uri.endswith(f"/code-{digest}.tar.gz")
    assert (tmp_path / "out" / "train.py").read_text() == "print('hi')\n"


def test_a_corrupt_code_archive_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _tree(src)
    uri = pack(src, str(tmp_path / "store"))
    blob = tmp_path / "store" / uri.rsplit("/", 1)[1]
    blob.write_bytes(blob.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(CodeError, match="corrupt"):
        fetch_archive(uri, tmp_path / "out")


@pytest.mark.parametrize("unpacker", ["gnu-tar", "tarfile"])
def test_the_environment_falls_back_to_setup_when_its_archive_is_corrupt_or_gone(
    tmp_path: Path, unpacker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With GNU tar (fed as the archive downloads) and without it (Python's tarfile)."""
    runs = tmp_path / "runs.txt"
    store = open_store(tmp_path / "store")
    environ = dict(os.environ)  # setup's own PATH, whatever the runner's is
    if unpacker == "tarfile":  # a machine without tar: the runner's PATH finds none
        (tmp_path / "no-tar").mkdir()
        monkeypatch.setenv("PATH", str(tmp_path / "no-tar"))

    def plan(code: Path) -> SetupPlan:
        code.mkdir(parents=True, exist_ok=True)
        (code / "requirements.txt").write_text("nothing\n")
        return SetupPlan(
            commands=(f"mkdir -p built && echo $PWD > built/where && echo x >> {runs}",),
            code_dir=code,
            cache=True,
            paths=("built",),
        )

    first = prepare_environment(plan(tmp_path / "i1"), environ, store=lambda: store)
    assert first.how == "ran" and runs.read_text().count("x") == 1
    second = plan(tmp_path / "i2")
    assert prepare_environment(second, environ, store=lambda: store).how == "restored"
    # The restored files' absolute paths moved to the new code directory.
    assert (second.code_dir / "built" / "where").read_text().strip() == str(second.code_dir)
    key = environment_key(second)
    archive = tmp_path / "store" / ENV_DIR / f"{key}.tar.gz"
    archive.write_bytes(archive.read_bytes()[:-5] + b"xxxxx")
    third = prepare_environment(plan(tmp_path / "i3"), environ, store=lambda: store)
    assert third.how == "ran" and third.why is not None and "corrupt" in third.why
    archive.unlink()
    (tmp_path / "store" / ENV_DIR / f"{key}.json").unlink()
    fourth = prepare_environment(plan(tmp_path / "i4"), environ, store=lambda: store)
    assert fourth.how == "ran" and runs.read_text().count("x") == 3
    # Another requirements file is another key: setup runs.
    fifth = plan(tmp_path / "i5")
    (fifth.code_dir / "requirements.txt").write_text("something else\n")
    assert environment_key(fifth) != key


def test_a_failing_setup_command_says_which_with_its_last_lines(tmp_path: Path) -> None:
    plan = SetupPlan(commands=("echo one", "echo two; echo broken >&2; exit 4"), code_dir=tmp_path)
    with pytest.raises(SetupFailed, match="'echo two; echo broken >&2; exit 4' exited 4") as info:
        prepare_environment(plan, os.environ, store=None)
    assert info.value.tail.splitlines()[-2:] == ["two", "broken"]


def test_the_dry_run_runs_setup_in_the_code_and_says_how_long_it_took(tmp_path: Path) -> None:
    from runner import env as contract
    from runner.dryrun import run_dry_run

    src = tmp_path / "src"
    src.mkdir()
    (src / "check.py").write_text(
        "import os, sys\nsys.exit(0 if os.path.exists('built-by-setup') else 3)\n"
    )
    uri = pack(src, str(tmp_path / "store"))
    env = dict(os.environ) | contract.render(
        {
            contract.CODE_ARCHIVE: uri,
            contract.CODE_DIR: tmp_path / "code",
            contract.SETUP: ["touch built-by-setup"],
        }
    )
    report = run_dry_run(
        [sys.executable, "check.py"],
        checkpoint_uri=str(tmp_path / "ck"),
        run_id="r-code-dry-run",
        steps=1,
        timeout_s=60,
        env=env,
        log_path=tmp_path / "dry-run.log",
    )
    assert report.setup_s is not None and report.setup_s >= 0
    assert any("setup ran in" in line for line in report.setup)
    # It ran in the code directory, after setup (a plain script: it reports nothing).
    assert "the command exited 0 without reporting anything" in report.problems[0]
    assert "touch built-by-setup" in (tmp_path / "dry-run.log").read_text()
    assert any(line.startswith("  code and setup") for line in report.lines())


def test_a_notice_during_setup_ends_the_attempt_preempted_not_failed(tmp_path: Path) -> None:
    import threading
    import time

    from runner import EXIT_PREEMPTED
    from runner import env as contract
    from runner.preemption import Notice, PreemptionFlag
    from runner.setup import Workspace
    from runner.supervisor import Supervisor
    from runner.telemetry import NullSink

    environ = dict(os.environ) | contract.render({contract.SETUP: ["echo installing; sleep 30"]})
    workspace = Workspace.from_env(environ | {contract.CODE_DIR.name: str(tmp_path)})
    assert workspace is not None
    flag = PreemptionFlag()
    sup = Supervisor(
        [sys.executable, "-c", "print('never runs')"],
        sink=NullSink(),
        flag=flag,
        env=environ,
        install_signals=False,
        workspace=workspace,
    )
    now = time.monotonic()
    notice = Notice(source="signal", reason="test", received_at=now, deadline=now + 30)
    threading.Timer(0.5, flag.set, args=(notice,)).start()
    started = time.monotonic()
    assert sup.run() == EXIT_PREEMPTED
    assert time.monotonic() - started < 10  # the setup's sleep was ended, not waited for
    assert sup.child is None

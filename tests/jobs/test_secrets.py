"""Issue 26, point 1, on the local provider: a secret in the admin's directory reaches the
training process's environment and nothing else; one that is missing fails preflight
naming it; one that disappears before the launch fails the attempt as its own end."""

from __future__ import annotations

import gzip
import json
import logging
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlmodel import select

from bot.slack_notifier import SlackNotifier
from jobs.database.db import session_scope
from jobs.database.models import Attempt, Run
from jobs.domain.errors import SpecError
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import CallbackJournal
from jobs.process.bootstrap import ControlPlane
from jobs.spec import parse_spec
from jobs.usecases import service
from tests.fakes.slack_api import FakeSlack
from tests.jobs.test_control_plane import ADA, run_state, settings_for, wait_until
from tests.paths import ROOT

VALUE = "s3cr3t-Value-9f1c2e"

#: The training command: exits 0 only when the variable holds the secret (comparing it
#: with a digest, so that not even the test's own command line holds the value), and
#: says so without printing it.
TRAIN = """\
import hashlib, os, sys
got = os.environ.get("MY_TOKEN")
ok = got is not None and hashlib.sha256(got.encode()).hexdigest() == sys.argv[1]
print("secret ok" if ok else "secret wrong", flush=True)
sys.exit(0 if ok else 3)
"""


def test_a_secret_reference_is_validated_with_a_clear_error() -> None:
    spec = parse_spec(
        {
            "command": "python train.py",
            "secrets": {
                "WANDB_API_KEY": "aws-sm://trainbot/wandb",
                "HF_TOKEN": "gcp-sm://projects/team-1/secrets/hf",
                "DB_PASSWORD": "local://db",
            },
        },
        name="refs",
    )
    assert spec.secrets["HF_TOKEN"] == "gcp-sm://projects/team-1/secrets/hf/versions/latest"
    for bad, said in [
        ("vault://x", "is not a secret reference: write aws-sm://NAME"),
        ("local://../etc/passwd", "a local secret is a file name"),
        ("gcp-sm://hf", "gcp-sm://projects/PROJECT/secrets/SECRET"),
        ("aws-sm://", "an AWS secret's name"),
    ]:
        with pytest.raises(SpecError, match=said):
            parse_spec({"command": "x", "secrets": {"A": bad}}, name="bad")
    with pytest.raises(SpecError, match="A is set in both env and secrets"):
        parse_spec({"command": "x", "env": {"A": "1"}, "secrets": {"A": "local://a"}}, name="b")
    with pytest.raises(SpecError, match="reserved"):
        parse_spec({"command": "x", "secrets": {"TRAINBOT_TOKEN": "local://a"}}, name="b")


@pytest.fixture
def plane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[ControlPlane, list[dict], FakeSlack, Path]]:
    import hashlib

    secrets = tmp_path / "admin-secrets"
    secrets.mkdir()
    (secrets / "token").write_text(VALUE + "\n")
    monkeypatch.setenv("TRAINBOT_LOCAL_SECRETS_DIR", str(secrets))
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "train.py").write_text(TRAIN)
    digest = hashlib.sha256(VALUE.encode()).hexdigest()
    for name, ref in (("uses-secret", "local://token"), ("missing", "local://nope")):
        (specs / f"{name}.yaml").write_text(
            textwrap.dedent(
                f"""\
                command: python {specs / "train.py"} {digest}
                secrets:
                  MY_TOKEN: {ref}
                env:
                  PLAIN: visible
                dry_run:
                  enabled: false
                """
            )
        )
    records: list[dict] = []
    slack = FakeSlack(
        tokens=["xoxb-test"], post_interval_s=0.01, burst=100, whole_second_retry_after=False
    ).start()
    journal = CallbackJournal(lambda t, run, data: records.append({"type": t, "run": run, **data}))
    settings = settings_for(tmp_path / "state", TRAINBOT_SPECS_DIR=str(specs))
    cp = ControlPlane(
        settings,  # type: ignore[arg-type]
        notifier=SlackNotifier(slack.client("xoxb-test")),
        journal=journal,
        scheduler=False,
    )
    try:
        with cp:
            yield cp, records, slack, secrets
        cp.deps.provider.close()  # type: ignore[attr-defined]
    finally:
        slack.close()


def _attempts(cp: ControlPlane, run_id: str) -> list[Attempt]:
    with session_scope(cp.deps.engine) as session:
        rows = session.exec(select(Attempt).where(Attempt.run_id == run_id)).all()
        return sorted(rows, key=lambda a: a.number)


def _reason(cp: ControlPlane, run_id: str) -> str:
    with session_scope(cp.deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None
        return run.reason or ""


def _files_holding(root: Path, value: bytes) -> list[str]:
    """The files under ``root`` holding ``value``, gzipped ones (the log segments) read
    through."""
    found = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            if path.suffix == ".gz":
                data = gzip.decompress(data)
            if value in data:
                found.append(str(path))
    return found


def test_a_local_secret_reaches_the_command_and_nothing_else(  # type: ignore[no-untyped-def]
    plane, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.DEBUG)
    cp, records, slack, secrets = plane

    # 1. It reaches the training process: the command exits 0 only if it holds it.
    run = service.submit(cp.deps, spec_name="uses-secret", overrides=[], actor=ADA)
    wait_until(lambda: run_state(cp, run.id) == RunState.AWAITING_CONFIRMATION, what="preflight")
    checks = {r["check"]: r for r in records if r["type"] == "preflight_check"}
    assert checks["secrets"]["status"] == "pass" and "MY_TOKEN" in checks["secrets"]["detail"]
    service.confirm(cp.deps, run.id, ADA)
    wait_until(lambda: run_state(cp, run.id).is_terminal(), timeout=60, what="the run")
    assert run_state(cp, run.id) == RunState.SUCCEEDED, _reason(cp, run.id)

    # 2. Gone between preflight and launch: the attempt fails as its own end, naming it.
    second = service.submit(cp.deps, spec_name="uses-secret", overrides=[], actor=ADA)
    wait_until(
        lambda: run_state(cp, second.id) == RunState.AWAITING_CONFIRMATION, what="preflight 2"
    )
    (secrets / "token").rename(tmp_path / "moved-away")
    service.confirm(cp.deps, second.id, ADA)
    wait_until(lambda: run_state(cp, second.id).is_terminal(), timeout=60, what="the failure")
    assert run_state(cp, second.id) == RunState.FAILED
    (attempt,) = _attempts(cp, second.id)
    assert attempt.state == AttemptState.FAILED  # not a preemption
    assert attempt.end_reason is not None
    assert attempt.end_reason.startswith("secret unavailable: secret MY_TOKEN (local://token)")
    assert not any(r["type"] == "preempted" for r in records)

    # 3. Missing at preflight: the check fails, naming it and what to do; nothing launches.
    third = service.submit(cp.deps, spec_name="missing", overrides=[], actor=ADA)
    wait_until(lambda: run_state(cp, third.id).is_terminal(), what="preflight 3")
    assert run_state(cp, third.id) == RunState.PREFLIGHT_FAILED
    failed = [r for r in records if r["type"] == "preflight_check" and r["run"] == third.id]
    (check,) = [r for r in failed if r["check"] == "secrets"]
    assert check["status"] == "fail"
    assert "MY_TOKEN (local://nope): there is no file nope" in check["detail"]
    assert "an admin writes the secret to" in check["remedy"]
    assert _attempts(cp, third.id) == []

    # The value is in no database row, log line, journal record, chat message or file
    # the control plane and its instances wrote (their logs, events, stores).
    value = VALUE.encode()
    state = tmp_path / "state"
    assert any(b"secret ok" in p.read_bytes() for p in state.rglob("output.log"))
    assert list(state.rglob("*.log.gz")) and (state / "trainbot.db").exists()
    assert _files_holding(state, value) == []
    assert VALUE not in repr(records)
    assert VALUE not in caplog.text
    wait_until(  # the thread heard of the end (the notifier posts in the background)
        lambda: any("secret unavailable" in repr(c.args) for c in slack.calls),
        what="the post about the failed attempt",
    )
    posted = [call.args for call in slack.calls]
    assert VALUE not in repr(posted)


def test_the_dry_run_reads_the_secrets_as_the_run_will(tmp_path: Path) -> None:
    """runner.dryrun gives the command its secrets (preflight sends it the references);
    one it cannot read is a problem of the dry run, named, before anything runs."""
    import hashlib
    import sys

    from runner.dryrun import run_dry_run

    folder = tmp_path / "admin-secrets"
    folder.mkdir()
    (folder / "token").write_text(VALUE)
    script = tmp_path / "train.py"
    script.write_text(
        "import hashlib, os, sys\n"
        "from runner.examples.tiny import main\n"
        f"if hashlib.sha256(os.environ['MY_TOKEN'].encode()).hexdigest() != {hashlib.sha256(VALUE.encode()).hexdigest()!r}:\n"
        "    sys.exit(3)\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(ROOT),
        "TRAINBOT_LOCAL_SECRETS_DIR": str(folder),
        "TRAINBOT_SECRETS": json.dumps({"MY_TOKEN": "local://token"}),
    }
    command = [sys.executable, str(script), "--steps", "40", "--dim", "8", "--batch", "4"]
    log = tmp_path / "dry-run.log"
    report = run_dry_run(
        command,
        checkpoint_uri=str(tmp_path / "ckpt"),
        run_id="r-dry",
        steps=2,
        timeout_s=120,
        env=env,
        log_path=log,
    )
    assert report.problems == [], report.problems
    assert VALUE not in log.read_text() and VALUE not in repr(report)
    env["TRAINBOT_SECRETS"] = json.dumps({"MY_TOKEN": "local://gone"})
    missing = run_dry_run(
        command, checkpoint_uri=str(tmp_path / "ckpt"), run_id="r-dry", steps=2, env=env
    )
    (problem,) = missing.problems
    assert problem.startswith("secret MY_TOKEN (local://gone) could not be read: no file gone")

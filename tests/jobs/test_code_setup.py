"""The team's code and its environment on the instance, end to end on the local provider
(issue 25, points 1 to 3): a git repository served over loopback HTTP, pinned at submit,
checked out by the runner on each fresh instance directory; ``setup`` installing from a
package index served on loopback; preflight's dry run running setup and the script (which
saves and restores through the session API) in the pinned commit; the environment it built restored by the next attempt
instead of rebuilt, and rebuilt when the requirements change; a failing setup is a setup
failure with its last lines in the thread; a missing ref is refused at submit."""

from __future__ import annotations

import io
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlmodel import select

from bot.console import ConsoleNotifier
from jobs.database.db import session_scope
from jobs.database.models import Attempt, Run
from jobs.domain.errors import SpecError
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import CallbackJournal
from jobs.process.bootstrap import ControlPlane
from jobs.usecases import service
from runner.logship import read_tail
from runner.store import run_store
from tests.fakes.code_servers import GitRepo, build_wheel, serve_directory, write_simple_index
from tests.jobs.test_control_plane import ADA, run_state, settings_for, wait_until

#: The team's training script, as a team writes one: it saves and restores through the
#: runner's session API (so preflight's dry run can kill it and check the restore), and
#: says which commit it runs (the checkout is detached: ``.git/HEAD`` holds the commit) and
#: which version of the package setup installed it sees.
TRAIN = """\
import pathlib, sys, time
import torch
import tinydep
from runner.session import EverySteps, Session

commit = pathlib.Path(".git/HEAD").read_text().strip()
total = int(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with Session.from_env(decision=EverySteps(5)) as s:
    s.track(model=model, optimizer=opt)
    s.restore()
    print(f"train.py at {commit} with tinydep {tinydep.VERSION} from step {s.step}", flush=True)
    for step in s.steps(total):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        s.log(loss=float(loss))
        time.sleep(0.1)
print("finished" if s.stop_reason == "finished" else f"stopped: {s.stop_reason}", flush=True)
sys.exit(s.exit_code)
"""


class Team:
    """The team's repository, its package index and its specs, served on loopback."""

    def __init__(self, root: Path, base: str, repo: GitRepo) -> None:
        self.root = root
        self.base = base
        self.repo = repo
        self.specs = root / "specs"
        self.specs.mkdir()
        self.setup_runs = root / "setup-runs.txt"

    def spec(self, name: str, *, setup: list[str], steps: int = 60) -> None:
        # Who ran setup: an attempt, or preflight's dry run (which has no attempt).
        marker = f"echo ${{TRAINBOT_ATTEMPT_ID:-dry-run}} >> {self.setup_runs}"
        lines = "".join(f"  - {command!r}\n" for command in [*setup, marker])
        (self.specs / f"{name}.yaml").write_text(
            textwrap.dedent(
                f"""\
                command: python train.py {steps}
                code:
                  repo: {self.repo.url(self.base)}
                  ref: main
                env:
                  PIP_INDEX_URL: {self.base}/simple/
                  PIP_FIND_LINKS: ""
                dry_run:
                  steps: 3
                resubmit:
                  backoff_s: 0
                setup:
                """
            )
            + lines
        )

    def attempts_that_ran_setup(self) -> list[str]:
        if not self.setup_runs.exists():
            return []
        return self.setup_runs.read_text().split()


@pytest.fixture
def team(tmp_path: Path) -> Iterator[Team]:
    repo = GitRepo(tmp_path)
    wheels = [
        build_wheel(tmp_path / "wheels", "tinydep", version, f"VERSION = {version!r}\n")
        for version in ("1.0", "2.0")
    ]
    write_simple_index(repo.served, wheels)
    with serve_directory(repo.served) as base:
        yield Team(tmp_path, base, repo)


@pytest.fixture
def plane(team: Team) -> Iterator[tuple[ControlPlane, list[dict], io.StringIO]]:
    records: list[dict] = []
    out = io.StringIO()
    journal = CallbackJournal(lambda t, run, data: records.append({"type": t, "run": run, **data}))
    settings = settings_for(team.root / "state", TRAINBOT_SPECS_DIR=str(team.specs))
    cp = ControlPlane(
        settings,  # type: ignore[arg-type]
        notifier=ConsoleNotifier(out),
        journal=journal,
        scheduler=False,
    )
    with cp:
        yield cp, records, out
    for inst in cp.deps.provider.list_instances():
        if not inst.state.is_terminal():
            cp.deps.provider.terminate(inst.instance_id)
    cp.deps.provider.close()  # type: ignore[attr-defined]


def _attempts(cp: ControlPlane, run_id: str) -> list[Attempt]:
    with session_scope(cp.deps.engine) as session:
        return list(
            session.exec(
                select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number)
            ).all()
        )


def _stored_spec(cp: ControlPlane, run_id: str) -> dict:
    with session_scope(cp.deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None
        return dict(run.spec)


def _dry_run_result(cp: ControlPlane, run_id: str) -> dict:
    with session_scope(cp.deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None and run.preflight is not None
        [found] = [r for r in run.preflight["results"] if r["name"] == "dry_run"]
        return dict(found)


def _log(cp: ControlPlane, run_id: str, attempt: Attempt) -> str:
    with session_scope(cp.deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None
        store = run_store(run.checkpoint_uri or "", run.checkpoint_prefix or run.id)
    found = read_tail(store, attempt.id, 0, max_bytes=1 << 20)
    return found.text if found is not None else ""


@pytest.mark.slow
def test_pinned_code_setup_restored_environment_and_a_moved_ref(team: Team, plane) -> None:  # type: ignore[no-untyped-def]
    cp, records, out = plane
    first = team.repo.commit({"train.py": TRAIN, "requirements.txt": "tinydep==1.0\n"})
    team.spec("team", setup=["pip install -q -r requirements.txt"])
    run = service.submit(cp.deps, spec_name="team", overrides=[], actor=ADA)
    # Pinned at submit: a push to main from here on does not move this run.
    assert _stored_spec(cp, run.id)["code"]["commit"] == first
    wait_until(
        lambda: run_state(cp, run.id) == RunState.AWAITING_CONFIRMATION,
        timeout=90,
        what="preflight",
    )
    # Preflight's dry run ran setup, then the script, in the pinned commit's checkout: the
    # script itself says which commit and which tinydep it saw, and it restored for real.
    dry = _dry_run_result(cp, run.id)
    assert dry["status"] != "fail", dry["detail"]
    assert dry["detail"].startswith("code and setup ready in "), dry["detail"]
    assert any(line.startswith(f"code {first[:12]} in ") for line in dry["data"]["setup"])
    assert any(line.startswith("setup ran in ") for line in dry["data"]["setup"])
    dry_log = (cp.deps.settings.state_dir / "preflight" / run.id / "dry-run.log").read_text()
    assert f"train.py at {first} with tinydep 1.0 from step 0" in dry_log
    assert team.attempts_that_ran_setup() == ["dry-run"]
    service.confirm(cp.deps, run.id, ADA)
    wait_until(lambda: any(r["type"] == "checkpoint_committed" for r in records), what="a commit")
    one = _attempts(cp, run.id)[0]
    assert team.attempts_that_ran_setup() == ["dry-run", one.id]
    cp.deps.provider.preempt(one.instance_id)  # type: ignore[attr-defined]
    wait_until(
        lambda: (
            len(_attempts(cp, run.id)) == 2
            and _attempts(cp, run.id)[1].state == AttemptState.RUNNING
        ),
        what="attempt 2 to start its command",
    )
    two = _attempts(cp, run.id)[1]
    assert two.instance_id != one.instance_id  # a fresh instance directory
    # Attempt 2 restored the environment from the store instead of running setup.
    assert team.attempts_that_ran_setup() == ["dry-run", one.id]

    wait_until(
        lambda: any(r["type"] == "resumed" and r["attempt"] == 2 for r in records),
        what="attempt 2 to resume from attempt 1's checkpoint",
    )

    # The team pushes new requirements; the run is stopped and moved to the new commit.
    second = team.repo.commit({"requirements.txt": "tinydep==2.0\n"}, message="tinydep 2")
    service.stop(cp.deps, run.id, ADA)
    wait_until(lambda: _attempts(cp, run.id)[-1].state.is_terminal(), what="the stop")
    wait_until(
        lambda: "with tinydep 1.0 from step" in _log(cp, run.id, two), what="attempt 2's log"
    )
    log_two = _log(cp, run.id, two)
    assert "environment restored from the store" in log_two
    assert f"code {first[:12]}" in log_two
    assert "from step 0" not in log_two  # it resumed
    assert f"train.py at {first} with tinydep 1.0 from step" in log_two
    moved = service.resubmit(cp.deps, run.id, ADA, overrides=["code.ref=main"])
    assert _stored_spec(cp, moved.id)["code"]["commit"] == second
    assert f"code: {first[:7]} → {second[:7]}" in out.getvalue()
    wait_until(lambda: run_state(cp, moved.id).is_terminal(), timeout=90, what="the end")
    assert run_state(cp, moved.id) == RunState.SUCCEEDED
    three = _attempts(cp, moved.id)[0]
    # A changed requirements file: a new key, so setup ran again, and installed 2.0.
    assert team.attempts_that_ran_setup() == ["dry-run", one.id, three.id]
    log_three = _log(cp, moved.id, three)
    assert f"train.py at {second} with tinydep 2.0 from step" in log_three
    assert "finished" in log_three
    assert "from step 0" not in log_three


@pytest.mark.slow
def test_a_failing_setup_ends_the_attempt_as_a_setup_failure(team: Team, plane) -> None:  # type: ignore[no-untyped-def]
    cp, records, out = plane
    team.repo.commit({"train.py": TRAIN, "requirements.txt": "tinydep==9.9\n"})
    team.spec(
        "broken", setup=["echo installing the broken set", "pip install -q -r requirements.txt"]
    )
    # Without the dry run, whose setup would fail the same way: the attempt's is under test.
    run = service.submit(
        cp.deps, spec_name="broken", overrides=["dry_run.enabled=false"], actor=ADA
    )
    wait_until(lambda: run_state(cp, run.id) == RunState.AWAITING_CONFIRMATION, what="preflight")
    service.confirm(cp.deps, run.id, ADA)
    wait_until(lambda: run_state(cp, run.id).is_terminal(), timeout=90, what="the failure")
    assert run_state(cp, run.id) == RunState.FAILED
    (attempt,) = _attempts(cp, run.id)
    assert attempt.state == AttemptState.FAILED
    assert attempt.end_reason is not None and attempt.end_reason.startswith("setup failed:")
    assert "pip install -q -r requirements.txt" in attempt.end_reason
    assert not any(r["type"] == "preempted" for r in records)  # not a preemption
    thread = out.getvalue()
    assert "setup failed" in thread
    # The setup's last lines, pip's own complaint among them, are in the thread.
    assert "tinydep==9.9" in thread


def test_a_ref_that_does_not_exist_is_refused_at_submit(team: Team, plane) -> None:  # type: ignore[no-untyped-def]
    cp, _, _ = plane
    team.repo.commit({"train.py": TRAIN}, message="first")
    team.spec("team", setup=[])
    with pytest.raises(
        SpecError, match=r"code.ref 'no-such-branch' is not a branch, tag or commit"
    ):
        service.submit(cp.deps, spec_name="team", overrides=["code.ref=no-such-branch"], actor=ADA)
    unreachable = "code.repo=http://127.0.0.1:9/gone.git"
    with pytest.raises(SpecError, match="cannot read the code repository"):
        service.submit(cp.deps, spec_name="team", overrides=[unreachable], actor=ADA)
    with session_scope(cp.deps.engine) as session:
        assert session.exec(select(Run)).first() is None  # nothing was created


def test_preflights_dry_run_runs_in_the_code_after_setup_and_says_how_long(tmp_path: Path) -> None:
    """Preflight's dry run gets the run's code and setup, as the launch does: the script
    exists only in the archive and passes only where setup ran; the check says how long
    the code and setup took."""
    from jobs.preflight import DryRunCheck, PreflightContext, resource_request
    from jobs.preflight.report import Status
    from jobs.providers.local import LocalProvider
    from jobs.spec import parse_spec
    from runner.code import pack
    from tests.jobs.test_control_plane import ROOT

    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text(
        "import os, sys\n"
        "if not os.path.exists('built-by-setup'):\n"
        "    sys.exit('setup did not run here')\n"
        "from runner.examples.tiny import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    archive = pack(src, f"file://{tmp_path / 'store'}")
    job = parse_spec(
        {
            "command": "python train.py",
            "code": {"archive": archive},
            "setup": "touch built-by-setup",
            "dry_run": {"steps": 2},
        },
        name="coded",
    )
    with LocalProvider(tmp_path / "state", gpu_names=[]) as local:
        ctx = PreflightContext(
            spec=job,
            run_id="r-coded",
            provider=local,
            request=resource_request(job, local),
            checkpoint_uri=str(tmp_path / "ck"),
            mtbp_s=3600.0,
            env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
            workdir=tmp_path / "work",
        )
        got = DryRunCheck(timeout_s=120).run(ctx, prior={})
    assert got.status is not Status.FAIL, got.detail
    assert got.detail.startswith("code and setup ready in "), got.detail

"""An unmodified Hugging Face Trainer script through the control plane (issue 27, point 7).

``examples/hf_trainer.py`` knows nothing of trainbot: a tiny GPT-2 from a config (no
download), ``checkpoint-N/`` folders in its output directory, resumed with
``get_last_checkpoint``. On the local provider, with ``checkpoint.sync_dir`` as that
directory: preflight's dry run passes (synced, killed, restored on a fresh folder,
continued past the synced step), the loss read from ``trainer_state.json`` reaches the
run card, a learning rate warmed up far too high raises the divergence alert, a
preemption resumes from the synced checkpoint, and ``/train logs`` reads the output
after the instance directory is gone. The two runs go side by side.
"""

from __future__ import annotations

import shutil

import pytest
from sqlmodel import select

from bot.dispatch import dispatch
from jobs.database.db import session_scope
from jobs.database.metrics import run_metrics
from jobs.database.models import Alert, Run
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.process.bootstrap import ControlPlane
from jobs.runs.cards import card
from jobs.usecases import service
from tests.jobs.test_aws_control_plane import run_row
from tests.jobs.test_control_plane import (
    ADA,
    _preempted_then_resubmitted,
    _started,
    run_state,
)
from tests.jobs.test_restarts import Plane, plane  # noqa: F401 (the fixture)
from tests.paths import ROOT
from tests.waiting import wait_until

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

EXAMPLE = ROOT / "examples" / "hf_trainer.py"
#: Every 10 steps a checkpoint-N/ folder; 50 ms a step, so a preemption lands mid-run.
TRAIN = f"python {EXAMPLE} --max-steps 100000 --save-steps 10 --step-s 0.05"
COMMON = (
    "checkpoint.sync_dir=out",
    "resubmit.backoff_s=0",
    "env.OMP_NUM_THREADS=1",
    "env.HF_HUB_OFFLINE=1",
)


def _card_loss(cp: ControlPlane, run_id: str) -> float | None:
    with session_scope(cp.deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None
        return card(session, run).loss


def _alert_kinds(cp: ControlPlane, run_id: str) -> set[str]:
    with session_scope(cp.deps.engine) as session:
        rows = session.exec(select(Alert).where(Alert.run_id == run_id)).all()
        return {f"{a.rule}:{a.key}" for a in rows}


def _steps(cp: ControlPlane, run_id: str, attempt_id: str) -> list[int]:
    with session_scope(cp.deps.engine) as session:
        points = run_metrics(session.connection(), run_id, attempt_id=attempt_id)
        return [int(p.data["step"]) for p in points]


@pytest.mark.slow  # two Trainer processes in the dry run, three in the runs: ~40 s
def test_an_unmodified_hf_trainer_script_is_first_class(plane: Plane) -> None:  # noqa: F811
    cp, _, notes = plane
    run = service.submit(
        cp.deps, spec_name="tiny", overrides=[f"command={TRAIN}", *COMMON], actor=ADA
    ).id
    # Side by side: a peak learning rate of 10 after 40 warm-up steps diverges.
    hot = service.submit(
        cp.deps,
        spec_name="tiny",
        overrides=[f"command={TRAIN} --lr 10 --warmup-steps 40", *COMMON, "dry_run.enabled=false"],
        actor=ADA,
    ).id
    wait_until(lambda: run_state(cp, hot) == RunState.AWAITING_CONFIRMATION, what="preflight")
    service.confirm(cp.deps, hot, ADA)

    # Preflight's dry run: synced, killed, restored on a fresh folder, continued.
    wait_until(lambda: run_state(cp, run) != RunState.PREFLIGHT, timeout=120, what="the dry run")
    report = notes.preflight(run)
    [dry] = [c for c in report.checks if c.name == "dry_run"]
    assert dry.status == "pass", dry.detail
    assert "restored bit-identical" in dry.detail and "steps at" in dry.detail
    assert "the script saves on its own schedule" in dry.detail
    # Every check passed, so it launches without asking.
    assert run_state(cp, run) not in (RunState.PREFLIGHT_FAILED, RunState.AWAITING_CONFIRMATION)

    # The divergence alert, from the loss the runner read in trainer_state.json.
    wait_until(
        lambda: any(k.startswith("divergent_loss:") for k in _alert_kinds(cp, hot)),
        timeout=90,
        what="the divergence alert",
    )
    service.stop(cp.deps, hot, ADA)

    # The loss reaches the card; a checkpoint folder is synced; then a preemption.
    wait_until(lambda: _card_loss(cp, run) is not None, timeout=90, what="a loss on the card")
    loss = _card_loss(cp, run)
    assert loss is not None and 0 < loss < 10
    wait_until(lambda: (run_row(cp, run).last_committed_step or 0) >= 20, timeout=90, what="sync")
    first = _started(cp, run, 1)
    assert first is not None and first.instance_id is not None
    # The step time comes from two writes of trainer_state.json seen by the supervisor's
    # poll: on a loaded machine the sync can be reported before it (a CI run failed so).
    wait_until(
        lambda: (a := _started(cp, run, 1)) is not None and a.step_time_s is not None,
        timeout=90,
        what="a step time",
    )
    cp.deps.provider.preempt(first.instance_id)  # type: ignore[attr-defined]
    one, two = _preempted_then_resubmitted(cp, run)
    assert one.state == AttemptState.PREEMPTED
    # Its step time, measured between two writes of trainer_state.json (the profile's and
    # the measured interval's input): at least the script's 50 ms pause.
    assert one.step_time_s is not None and 0.05 <= one.step_time_s < 5, one.step_time_s
    synced = run_row(cp, run).last_committed_step
    assert synced is not None and synced >= 20 and synced % 10 == 0
    assert two.resumed_from_step == synced
    # It continues past the synced step, and its metrics start after it (the restored
    # trainer_state.json's history is not sent again).
    wait_until(
        lambda: max(_steps(cp, run, two.id), default=0) > synced,
        timeout=90,
        what="attempt 2's steps",
    )
    assert min(_steps(cp, run, two.id)) == synced + 1
    assert max(_steps(cp, run, one.id)) >= synced

    service.stop(cp.deps, run, ADA)
    wait_until(lambda: run_state(cp, run).is_terminal(), timeout=60, what="the stop")
    provider = cp.deps.provider
    assert two.instance_id is not None
    wait_until(
        lambda: provider.status(two.instance_id).state.is_terminal(),  # type: ignore[arg-type]
        what="the instance ended",
    )
    instance_dir = provider.log_path(two.instance_id).parent  # type: ignore[attr-defined]
    shutil.rmtree(instance_dir, ignore_errors=True)
    assert not instance_dir.exists()
    reply = dispatch(cp.deps, f"logs {run} 2", ADA, markup="plain")
    assert f"checkpoint-{synced}" in reply.text, reply.text[-2000:]
    assert "resuming from" in reply.text

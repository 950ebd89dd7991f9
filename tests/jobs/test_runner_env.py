"""The environment a launch hands the runner (jobs.runs.launch.runner_env): the spec's own
``env`` untouched, and every ``TRAINBOT_*`` variable one the runner's contract declares
and reads back (runner.env)."""

from __future__ import annotations

import sys

from jobs.database.models import Attempt, Run
from jobs.process.deps import Deps
from jobs.runs.launch import runner_env
from jobs.spec import parse_spec
from runner import env as contract
from runner.session.config import SessionConfig

#: What a person may put in a spec's env: any text, and the one tunable runner knob.
SPEC_ENV = {
    "TRICKY": "a b 'c' \"d\" $HOME ; e=f",
    "LR": "0.1",
    "EMPTY": "",
    "TRAINBOT_SYSTEM_SAMPLE_S": "2.5",
}


def test_the_spec_env_passes_through_and_every_runner_variable_is_the_contracts(
    deps: Deps,
) -> None:
    spec = parse_spec(
        {
            "name": "tiny",
            "command": [sys.executable, "-c", "pass"],
            "env": SPEC_ENV,
            "checkpoint": {"every_steps": 50, "train_through_notice": True},
        },
        name="tiny",
    )
    run = Run(id="r-env", spec_name="tiny", spec=spec.model_dump(mode="json"), requester="ada")
    run.checkpoint_interval_s = 600.0
    attempt = Attempt(run_id=run.id, number=1, provider="local", resumed_from_step=20)

    env = runner_env(deps, run, attempt, spec)

    assert {k: env[k] for k in SPEC_ENV} == SPEC_ENV
    ours = {k for k in env if k.startswith("TRAINBOT_")}
    assert ours <= set(contract.VARS), ours - set(contract.VARS)
    assert contract.missing_required(env) == []
    values = contract.parse(env)
    assert values["TRAINBOT_RUN_ID"] == "r-env"
    assert values["TRAINBOT_ATTEMPT_ID"] == attempt.id
    assert values["TRAINBOT_CHECKPOINT_INTERVAL_S"] == 600.0
    assert values["TRAINBOT_CHECKPOINT_EVERY_STEPS"] == 50
    assert values["TRAINBOT_TRAIN_THROUGH_NOTICE"] is True
    assert values["TRAINBOT_RESUME_MAX_STEP"] == 20
    assert values["TRAINBOT_SYSTEM_SAMPLE_S"] == 2.5
    window = deps.provider.capabilities.termination_window_s
    assert values["TRAINBOT_TERMINATION_WINDOW_S"] == window
    assert "TRAINBOT_PREEMPTION_SOURCES" not in env  # the local provider's notice is SIGTERM
    config = SessionConfig.from_env(env)
    assert (config.run_id, config.every_s, config.window_s) == ("r-env", 600.0, window)

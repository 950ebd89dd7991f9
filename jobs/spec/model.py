"""The job spec: one pydantic model, with a default for everything but the command."""

from __future__ import annotations

import shlex
from typing import Annotated

from pydantic import BeforeValidator, Field, field_validator

from jobs.spec.env import Env
from jobs.spec.sections import (
    AlertThresholds,
    BudgetPolicy,
    CheckpointPolicy,
    DryRun,
    Notify,
    Profile,
    Resources,
    ResubmitPolicy,
    Retention,
    Section,
)


def _split_command(value: object) -> object:
    if value is None:
        raise ValueError("is required: give the program to run, e.g. python train.py")
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise ValueError(f"cannot split the command line ({exc}); check its quotes") from None
    return value


class JobSpec(Section):
    """One kind of training run. Stored on the run as ``model_dump(mode="json")``."""

    #: The spec's name; defaults to the file name without ``.yaml``.
    name: str = Field(min_length=1)
    description: str = ""
    #: The training command, run by the runner's supervisor. A string is split like a shell.
    command: Annotated[list[str], BeforeValidator(_split_command)] = Field(min_length=1)
    #: Extra environment variables for the training process.
    #: Names are shell identifiers; ``TRAINBOT_*`` ones are trainbot's own (``TUNABLE_ENV`` aside).
    env: Env = Field(default_factory=dict)
    resources: Resources = Field(default_factory=Resources)
    #: Where the dataset lives; the data-locality check compares its region.
    data_uri: str | None = None
    checkpoint: CheckpointPolicy = Field(default_factory=CheckpointPolicy)
    retention: Retention = Field(default_factory=Retention)
    budget: BudgetPolicy = Field(default_factory=BudgetPolicy)
    #: Stop the run after this many hours of wall time across attempts.
    max_hours: float | None = Field(default=None, gt=0)
    resubmit: ResubmitPolicy = Field(default_factory=ResubmitPolicy)
    alerts: AlertThresholds = Field(default_factory=AlertThresholds)
    notify: Notify = Field(default_factory=Notify)
    dry_run: DryRun = Field(default_factory=DryRun)
    profile: Profile = Field(default_factory=Profile)

    @field_validator("command")
    @classmethod
    def _non_blank_program(cls, value: list[str]) -> list[str]:
        if not value or not value[0].strip():
            raise ValueError("the command is empty: give the program to run, e.g. python train.py")
        return value

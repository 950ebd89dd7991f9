"""The job spec: one pydantic model, with a default for everything but the command."""

from __future__ import annotations

import shlex
import unicodedata
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field, ValidationInfo, field_validator

from jobs.spec.env import FROM_PEOPLE, Env, Secrets
from jobs.spec.origin import SpecOrigin
from jobs.spec.sections import (
    AlertThresholds,
    BudgetPolicy,
    CheckpointPolicy,
    Code,
    Debug,
    DryRun,
    Notify,
    Profile,
    Resources,
    ResubmitPolicy,
    Retention,
    Section,
    SetupCache,
    SetupCommands,
)
from runner.container import check_image_ref


def _image_ref(value: str | None) -> str | None:
    return None if value is None else check_image_ref(value)


def _split_command(value: object) -> object:
    if value is None:
        raise ValueError("is required: give the program to run, e.g. python train.py")
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise ValueError(f"cannot split the command line ({exc}); check its quotes") from None
    return value


#: Characters that change how the text around them is ordered (embeddings, overrides,
#: isolates, marks): in a name or description they make a run read as another.
_BIDI_CONTROLS = frozenset(
    "\u061c\u200e\u200f"  # Arabic letter mark, left-to-right and right-to-left marks
    "\u202a\u202b\u202c\u202d\u202e"  # embeddings, pop, overrides
    "\u2066\u2067\u2068\u2069"  # isolates
)
#: Letters and marks that draw nothing, though not in a format or control category.
_INVISIBLE = frozenset("\u034f\u115f\u1160\u17b4\u17b5\u180e\u2800\u3164\uffa0")
#: Categories a name may not hold: format (zero-width, bidi, soft hyphen), control,
#: line and paragraph separators, private use, unassigned, surrogates.
_HIDDEN_CATEGORIES = frozenset({"Cf", "Cc", "Zl", "Zp", "Co", "Cn", "Cs"})


def _char_name(char: str) -> str:
    return f"U+{ord(char):04X} ({unicodedata.name(char, 'unnamed')})"


def hidden_character(text: str, *, strict: bool) -> str | None:
    """The first character of ``text`` a reader cannot see or that reorders what follows,
    described (``U+202E (RIGHT-TO-LEFT OVERRIDE)``); None when there is none. ``strict``
    (a name) also refuses every format, control and invisible character and any space but
    the plain one; otherwise (free text) only the direction controls."""
    for char in text:
        if char in _BIDI_CONTROLS:
            return _char_name(char)
        if not strict:
            continue
        category = unicodedata.category(char)
        invisible = char in _INVISIBLE or 0xFE00 <= ord(char) <= 0xFE0F
        odd_space = category == "Zs" and char != " "
        if category in _HIDDEN_CATEGORIES or invisible or odd_space:
            return _char_name(char)
    return None


def _from_people(info: ValidationInfo) -> bool:
    return bool((info.context or {}).get(FROM_PEOPLE))


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
    #: Secrets for the training process: variable name → a reference to a secret store
    #: (``aws-sm://NAME``, ``gcp-sm://projects/P/secrets/S``, ``local://NAME``). Only the
    #: reference is stored; the runner reads the value on the instance (runner.secrets).
    secrets: Secrets = Field(default_factory=dict, max_length=50)
    #: The container image the command runs in (docker on cloud instances, podman on the
    #: local provider), with the code, the scratch disk and the GPUs mounted; the runner
    #: stays outside it. ``None``: the command runs on the machine image
    #: (``resources.image_id``, which is another thing).
    image: Annotated[str | None, AfterValidator(_image_ref)] = None
    #: The run's code (a git repository at a ref, or a packed archive); ``None``: the
    #: command finds its files on the machine image.
    code: Code | None = None
    #: Shell commands run in the code directory before the command (``pip install -r
    #: requirements.txt``); their output is in the run's logs, and a failure ends the
    #: attempt as a setup failure.
    setup: SetupCommands = Field(default_factory=list, max_length=50)
    setup_cache: SetupCache = Field(default_factory=SetupCache)
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
    debug: Debug = Field(default_factory=Debug)
    #: Where trainbot read this spec (a directory, a repository at a commit, pasted text):
    #: set by trainbot when it loads the spec, never by the spec itself.
    origin: SpecOrigin | None = None

    @field_validator("name")
    @classmethod
    def _visible_name(cls, value: str, info: ValidationInfo) -> str:
        # What people write; a stored run's spec still loads (it was accepted then).
        found = hidden_character(value, strict=True) if _from_people(info) else None
        if found is not None:
            raise ValueError(
                f"contains {found}, which is invisible or reverses the text around it, so "
                "the run would read as another in chat: remove it (letters, digits, "
                "punctuation and plain spaces are fine)"
            )
        return value

    @field_validator("origin")
    @classmethod
    def _origin_is_trainbots(cls, value: SpecOrigin | None, info: ValidationInfo) -> object:
        if value is not None and _from_people(info):
            raise ValueError(
                "is set by trainbot (where it read the spec, and at which commit): remove it"
            )
        return value

    @field_validator("description")
    @classmethod
    def _no_direction_controls(cls, value: str, info: ValidationInfo) -> str:
        found = hidden_character(value, strict=False) if _from_people(info) else None
        if found is not None:
            raise ValueError(
                f"contains {found}, which reverses the text around it in chat: remove it"
            )
        return value

    @field_validator("secrets")
    @classmethod
    def _secrets_apart_from_env(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        both = sorted(set(value) & set(info.data.get("env") or {}))
        if both:
            raise ValueError(
                f"{', '.join(both)} is set in both env and secrets: keep the secret, "
                "and remove it from env"
            )
        return value

    @field_validator("setup")
    @classmethod
    def _setup_outside_image(cls, value: list[str], info: ValidationInfo) -> list[str]:
        image = info.data.get("image")
        if value and image:
            raise ValueError(
                f"setup does not run inside the image yet ({image}): install what it "
                "installs in the image itself (RUN pip install -r requirements.txt in its "
                "Dockerfile), or remove image to run setup on the machine image"
            )
        return value

    @field_validator("command")
    @classmethod
    def _non_blank_program(cls, value: list[str]) -> list[str]:
        if not value or not value[0].strip():
            raise ValueError("the command is empty: give the program to run, e.g. python train.py")
        return value

"""The spec's ``env``: shell-identifier names, text values, and the names trainbot keeps."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated

from pydantic import AfterValidator, BeforeValidator, ValidationInfo

from runner import env as contract
from runner.secrets import parse_ref

if TYPE_CHECKING:
    from jobs.spec.model import JobSpec

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: Variables trainbot sets for the runner itself (run id, token, checkpoint prefix, URIs):
#: a spec that set one could point a run at another run's checkpoints or events.
RESERVED_ENV_PREFIX = "TRAINBOT_"
#: Runner knobs under that prefix that only tune the run itself, so a spec may set them.
TUNABLE_ENV = frozenset(name for name, var in contract.VARS.items() if var.tunable)
#: Validation context key: set by :func:`jobs.spec.parse_spec`, which validates what people
#: wrote, and not by re-validation of a stored spec (a resubmit stores the checkpoint prefix).
FROM_PEOPLE = "from_people"


#: The spec section whose values are never shown: ``env`` holds credentials as often as
#: hyperparameters (the chat front end masks it the same way, ``bot.command_types``).
SECRET_SECTION = "env"


_SECRET_KEY = re.compile(r"\s*env\b[\w.\-]*", re.IGNORECASE)


def is_secret_path(path: str) -> bool:
    """Whether a dotted key path points into ``env``."""
    return _SECRET_KEY.match(path) is not None


def shown_override(text: str) -> str:
    """An override as a message may quote it: ``env.KEY=…`` for an ``env`` value (and
    only the key of ``env`` text that is not key=value at all)."""
    found = _SECRET_KEY.match(text)
    if found is None:
        return text
    key, sep, _ = text.partition("=")
    return f"{key}=…" if sep else f"{found.group(0)}…"


def _stringify_env(value: object) -> object:
    # YAML reads OMP_NUM_THREADS: 4 as a number; the process environment wants text.
    if isinstance(value, Mapping):
        return {key: _env_text(item) for key, item in value.items()}
    return value


def _env_text(item: object) -> object:
    if isinstance(item, bool):
        return "true" if item else "false"
    if isinstance(item, int | float):
        return str(item)
    return item


def _env_name(name: str, info: ValidationInfo) -> str:
    if not _ENV_NAME.fullmatch(name):
        raise ValueError(
            "is not an environment variable name: use letters, digits and '_', "
            "not starting with a digit"
        )
    context = info.context or {}
    if (
        context.get(FROM_PEOPLE)
        and name.upper().startswith(RESERVED_ENV_PREFIX)
        and name not in TUNABLE_ENV
    ):
        raise ValueError(
            f"is reserved: trainbot sets {RESERVED_ENV_PREFIX}* variables itself (the run id, "
            "its token, the checkpoint prefix and URIs); remove it from env, or rename it"
        )
    return name


def _env_value(value: str) -> str:
    if "\x00" in value:
        raise ValueError("contains a NUL byte, which no process environment can hold: remove it")
    return value


EnvName = Annotated[str, AfterValidator(_env_name)]
EnvValue = Annotated[str, AfterValidator(_env_value)]
#: The type of ``JobSpec.env``.
Env = Annotated[dict[EnvName, EnvValue], BeforeValidator(_stringify_env)]


def _secret_ref(value: str) -> str:
    return str(parse_ref(value))  # raises ValueError with the grammar in its words


#: A secret's reference (``aws-sm://…``, ``gcp-sm://…``, ``local://…``), normalised.
SecretRefText = Annotated[str, AfterValidator(_secret_ref)]
#: The type of ``JobSpec.secrets``: variable name → reference. The references are not
#: secret; the values are read on the instance only (:mod:`runner.secrets`).
Secrets = dict[EnvName, SecretRefText]


def secrets_env(spec: JobSpec, *, local: bool, aws_region: str | None = None) -> dict[str, str]:
    """The references the runner resolves on the instance, never a value; for the local
    provider, the admin's secrets directory (its instances are this machine)."""
    if not spec.secrets:
        return {}
    return contract.render(
        {
            contract.SECRETS: dict(spec.secrets),
            contract.LOCAL_SECRETS_DIR: contract.LOCAL_SECRETS_DIR.get() if local else None,
            contract.AWS_SECRETS_REGION: aws_region,
        }
    )


def code_env(spec: JobSpec, *, local: bool) -> dict[str, str]:
    """The run's code (the commit pinned at submit, or its archive) and its setup, for the
    runner to make ready before the command (:mod:`runner.setup`). The deploy key's path
    is this machine's: it goes only to instances that are this machine (local)."""
    code = spec.code
    cache = spec.setup_cache
    return contract.render(
        {
            contract.CODE_REPO: code.repo if code else None,
            contract.CODE_COMMIT: code.commit if code else None,
            contract.CODE_ARCHIVE: code.archive if code else None,
            contract.SETUP: list(spec.setup) or None,
            contract.SETUP_VENV: cache.venv if code is not None and spec.setup else None,
            contract.SETUP_CACHE: (cache.enabled and bool(spec.setup)) or None,
            contract.SETUP_CACHE_PATHS: list(cache.paths) or None,
            contract.SETUP_KEY_FILES: list(cache.key_files) or None,
            contract.MACHINE_IMAGE: spec.resources.image_id,
            contract.GIT_SSH_KEY_FILE: contract.GIT_SSH_KEY_FILE.get() if local else None,
        }
    ) | image_env(spec, local=local)


def image_env(spec: JobSpec, *, local: bool) -> dict[str, str]:
    """The spec's container image (:mod:`runner.container`): podman where the instance
    is this machine (the local provider), docker on the cloud images."""
    if spec.image is None:
        return {}
    return contract.render(
        {
            contract.IMAGE: spec.image,
            contract.CONTAINER_RUNTIME: "podman" if local else "docker",
            contract.CONTAINER_GPUS: spec.resources.accelerator is not None or None,
        }
    )

"""The base of a provider's own settings class (``TRAINBOT_AWS_*``, ``TRAINBOT_GCP_*``).

Each provider owns the settings only it reads, in its package (``aws/settings.py``,
``gcp/settings.py``), read from the same environment as the process settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from jobs.providers.base import ProviderError

__all__ = ["ProviderSettings"]

S = TypeVar("S", bound="ProviderSettings")


class ProviderSettings(BaseModel):
    """Fields are read from ``PREFIX`` + the field's name upper-cased; empty is unset."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: ``TRAINBOT_AWS_``: the prefix of the variables this class reads.
    PREFIX: ClassVar[str] = ""

    @classmethod
    def env_name(cls, field: str) -> str:
        return f"{cls.PREFIX}{field.upper()}"

    @classmethod
    def from_env(cls: type[S], env: Mapping[str, str] | None = None) -> S:
        """The settings in ``env`` (default: ``os.environ``); a bad value raises
        ProviderError naming its variable and what it takes."""
        source = os.environ if env is None else env
        by_upper = {key.upper(): value for key, value in source.items()}
        values = {}
        for field in cls.model_fields:
            raw = by_upper.get(cls.env_name(field))
            if raw is not None and raw.strip() != "":
                values[field] = raw.strip()
        try:
            return cls(**values)
        except ValidationError as exc:
            problems = []
            for error in exc.errors():
                field = str(error["loc"][0]) if error["loc"] else ""
                problems.append(f"{cls.env_name(field)}={values.get(field)!r}: {error['msg']}")
            raise ProviderError("; ".join(problems)) from None

"""A training command's output as chat shows it (``/train logs``, a failure's message).

What a script prints may quote its configuration and environment, secrets included: the
run's ``env`` values, and whatever looks like a credential (the patterns of
:class:`jobs.process.logs.RedactSecrets`), are replaced before any of it reaches a person.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jobs.process.logs import RedactSecrets


def env_values(spec: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The values of a stored spec's ``env``: secrets wherever they are shown."""
    env = (spec or {}).get("env")
    return tuple(str(v) for v in env.values()) if isinstance(env, Mapping) else ()


def redact_output(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with ``secrets`` and anything that looks like a credential replaced."""
    return RedactSecrets(secrets).redact(text)

"""Errors raised by the control plane on purpose.

Every message is written for the person who has to act on it: it says what happened,
to which run or setting, and what to do next. Front ends show ``str(error)`` as is and
never a traceback, so a message must make sense on its own.
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = [
    "CLIP_CHARS",
    "ConflictError",
    "DatabaseError",
    "IllegalTransition",
    "NotFound",
    "PermissionDenied",
    "SettingsError",
    "SpecError",
    "TrainbotError",
    "clip",
    "describe_validation_error",
]


class TrainbotError(Exception):
    """Root of every error the control plane raises on purpose."""


class SettingsError(TrainbotError):
    """A ``TRAINBOT_*`` environment variable is missing, malformed or inconsistent.

    ``problems`` holds one line per bad variable, each starting with the variable's name.
    """

    def __init__(self, message: str, *, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems: list[str] = problems if problems is not None else [message]


class SpecError(TrainbotError):
    """A job spec could not be found, parsed or validated.

    ``problems`` holds ``(key_path, message)`` pairs; ``key_path`` is the dotted path
    into the spec (``budget.usd``), or ``""`` when the problem is the file as a whole.
    """

    def __init__(self, message: str, *, problems: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.problems: list[tuple[str, str]] = problems if problems is not None else []

    @property
    def key_paths(self) -> list[str]:
        """The dotted key paths the problems are about, in order."""
        return [path for path, _ in self.problems]


class IllegalTransition(TrainbotError):
    """A run or attempt was asked to move to a state its state machine does not allow."""

    def __init__(self, message: str, *, current: str, target: str) -> None:
        super().__init__(message)
        self.current = current
        self.target = target


class NotFound(TrainbotError):
    """A run, attempt, alert or spec that was named does not exist."""


class PermissionDenied(TrainbotError):
    """The person or runner asking is not allowed to do this."""


class ConflictError(TrainbotError):
    """The change collides with existing state (a duplicate key, a concurrent update)."""


class DatabaseError(TrainbotError):
    """The database could not be reached, is locked, or is at an unknown schema revision."""


class FencedOut(DatabaseError):
    """This replica lost the scheduler lease after its scheduled work began; the new
    leader's reconcile redoes whatever the refused call left undone."""


#: The most characters of someone's input that an error message quotes.
CLIP_CHARS = 80

#: The longest phrase describe_validation_error returns, whatever pydantic said.
_PHRASE_CHARS = 400

# Bounded at every level, so even a value nested ten thousand deep is never rendered whole.
_SHORT = reprlib.Repr()
_SHORT.maxlevel = 3
_SHORT.maxdict = _SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = _SHORT.maxfrozenset = 8
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = CLIP_CHARS


def clip(value: object, *, limit: int = CLIP_CHARS) -> str:
    """``repr(value)``, cut to about ``limit`` characters, for quoting input in a message.

    Input comes from chat and spec files, so it can be any size; an error that echoes it
    whole lets one message be megabytes. The cut says how big the value really was.
    """
    size: int | None = None
    if isinstance(value, str | bytes):
        text = repr(value[: limit + 1])
        size, unit = len(value), "character" if isinstance(value, str) else "byte"
        short = len(value) <= limit and len(text) <= limit + 2
    else:
        try:
            text = _SHORT.repr(value)
        except Exception:  # an int past Python's digit limit, a broken __repr__
            text = f"<{type(value).__name__}>"
        if isinstance(value, list | tuple | dict | set):
            size, unit = len(value), "item"
        short = len(text) <= limit and "..." not in text
    if short:
        return text
    if size is None:
        return f"{text[:limit]}…"
    return f"{text[:limit]}… ({size} {unit}{'' if size == 1 else 's'})"


def _cut(phrase: str) -> str:
    return phrase if len(phrase) <= _PHRASE_CHARS else f"{phrase[:_PHRASE_CHARS]}…"


# Plain-English replacements for pydantic's error types. Anything not listed keeps
# pydantic's own message, which is already specific.
_EXPECTED = {
    "int_parsing": "expected a whole number",
    "int_type": "expected a whole number",
    "int_from_float": "expected a whole number",
    "float_parsing": "expected a number",
    "float_type": "expected a number",
    "bool_parsing": "expected true or false",
    "bool_type": "expected true or false",
    "string_type": "expected text",
    "list_type": "expected a list",
    "dict_type": "expected a mapping of keys to values",
    "model_type": "expected a mapping of keys to values",
    "model_attributes_type": "expected a mapping of keys to values",
    "missing": "is required",
    "too_short": "needs at least {min_length} item(s)",
    "too_long": "takes at most {max_length} item(s)",
    "string_too_short": "must not be empty",
}

_BOUNDS = {
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
}


def _number(value: Any) -> Any:
    # pydantic reports the bound of a float field as 0.0; people write 0.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def describe_validation_error(error: Any, *, with_value: bool = True) -> str:
    """One pydantic error (an item of ``ValidationError.errors()``) as a fix-it phrase.

    Settings and specs both report validation problems; one wording keeps them alike.
    The phrase carries no location; callers prefix the variable name or key path.
    ``with_value`` appends the offending input, ``(got -5)``, clipped by :func:`clip`,
    for callers that do not show it themselves.
    """
    return _cut(_describe(error, got=f" (got {clip(error.get('input'))})" if with_value else ""))


def _describe(error: Any, *, got: str) -> str:
    kind = str(error.get("type", ""))
    ctx = error.get("ctx") or {}
    if kind == "value_error":
        message = str(ctx.get("error", error.get("msg", "")))
        return message.removeprefix("Value error, ")
    if kind == "literal_error":
        expected = str(ctx.get("expected", ""))
        return f"expected one of {expected}{got}"
    if kind == "enum":
        return f"expected one of {ctx.get('expected', '')}{got}"
    if kind in _BOUNDS:
        bounds = {key: _number(value) for key, value in ctx.items()}
        return f"{_BOUNDS[kind].format(**bounds)}{got}"
    if kind in _EXPECTED:
        phrase = _EXPECTED[kind].format(**ctx) if ctx else _EXPECTED[kind]
        return phrase if kind == "missing" else f"{phrase}{got}"
    return str(error.get("msg", kind))

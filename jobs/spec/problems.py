"""Validation errors as messages: each problem with its full key path, unknown keys with
the nearest known one."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel

from jobs.domain.errors import CLIP_CHARS, clip, describe_validation_error
from jobs.spec.env import is_secret_path
from jobs.spec.model import JobSpec


def _model_at(path: Sequence[Any]) -> type[BaseModel] | None:
    """The spec section a location points into, for suggesting key names."""
    model: type[BaseModel] = JobSpec
    for part in path:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        nested = _section_type(field.annotation)
        if nested is None:
            return None
        model = nested
    return model


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _section_type(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _section_type(arg)
            if found is not None:
                return found
    return None


def short_path(path: str) -> str:
    """A key path as shown in a message: whole unless someone wrote an absurd one."""
    return path if len(path) <= CLIP_CHARS else f"{path[:CLIP_CHARS]}… ({len(path)} characters)"


def dotted(loc: Sequence[Any]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def describe_problem(error: Any) -> tuple[str, str]:
    loc = tuple(error["loc"])
    if loc and loc[-1] == "[key]":  # a bad mapping key (an env name): report the key's path
        loc = loc[:-1]
    path = dotted(loc)
    if error["type"] == "extra_forbidden":
        section = _model_at(loc[:-1])
        # ``origin`` is trainbot's record of where it read the spec, never a key to write.
        known = [k for k in (section.model_fields if section else ()) if k != "origin"]
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        if close:
            hint = f" (did you mean {dotted((*loc[:-1], close[0]))!r}?)"
        else:
            hint = f"; known keys here: {', '.join(known)}" if known else ""
        return path, f"unknown key {clip(path)}{hint}"
    # An env value is never echoed back: it may be a credential.
    message = describe_validation_error(error, with_value=not is_secret_path(path))
    return path, (f"{short_path(path)}: {message}" if path else message)

"""Inline overrides, ``key.path=value`` with a YAML value, applied to a spec's mapping."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from jobs.domain.errors import CLIP_CHARS, SpecError, clip
from jobs.spec.env import is_secret_path, shown_override
from jobs.spec.problems import short_path
from jobs.spec.strict_yaml import MAX_OVERRIDE_CHARS, MAX_OVERRIDE_NODES, load_yaml


def _parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    path = key.split(".")
    quoted = clip(shown_override(text))  # never an env value: it may be a credential
    if not sep or not all(part.strip() for part in path):
        raise SpecError(
            f"override {quoted} is not key.path=value: write it like budget.usd=800",
            problems=[(key, "not key.path=value")],
        )
    if len(text) > MAX_OVERRIDE_CHARS:
        raise SpecError(
            f"override {quoted} is too long (the most is {MAX_OVERRIDE_CHARS:,} "
            "characters): put large data in a file and give its path or URI instead",
            problems=[(key, "too long")],
        )
    try:
        value = (
            load_yaml(raw, where="in overrides", max_nodes=MAX_OVERRIDE_NODES)
            if raw.strip()
            else None
        )
    except SpecError as exc:
        raise SpecError(
            f"override {quoted}: {exc}",
            problems=[(key, message) for _, message in exc.problems],
        ) from None
    except (yaml.YAMLError, ValueError):
        plain = len(text) <= CLIP_CHARS and text.isprintable() and not is_secret_path(key)
        example = f"{key}='{raw}'" if plain else "key.path='…'"
        raise SpecError(
            f"override {quoted}: the value is not valid YAML; quote it, e.g. {example}",
            problems=[(key, "value is not valid YAML")],
        ) from None
    return [part.strip() for part in path], value


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A deep copy of ``data`` with each ``key.path=value`` applied in order.

    Values are YAML (``800`` is a number, ``true`` a boolean, ``[a, b]`` a list). Keys
    are not checked here; validation names unknown ones with the override they came from.
    """
    result: dict[str, Any] = _deep_copy(data)
    for text in overrides:
        path, value = _parse_override(text)
        node = result
        for depth, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(path[: depth + 1])
                shown = short_path(where)
                raise SpecError(
                    f"override {clip(shown_override(text))}: {shown} is a value, not a "
                    "section, so it has "
                    f"no key {clip(path[depth + 1])}; set {shown}=… instead",
                    problems=[(where, "is a value, not a section")],
                )
            node = child
        node[path[-1]] = value
    return result


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _deep_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_deep_copy(item) for item in value]
    return value

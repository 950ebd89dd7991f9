"""Specs from files, from mappings with overrides, and from the copy stored on a run."""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError

from jobs.domain.errors import SpecError, clip, describe_validation_error
from jobs.spec.env import FROM_PEOPLE, shown_override
from jobs.spec.model import JobSpec
from jobs.spec.overrides import apply_overrides
from jobs.spec.problems import describe_problem, dotted
from jobs.spec.sections import Section
from jobs.spec.strict_yaml import MAX_SPEC_FILE_CHARS, MAX_SPEC_FILE_NODES, load_yaml

log = logging.getLogger(__name__)

_SPEC_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
#: Problems listed in one error message; the rest are counted.
_MAX_LISTED = 10


def list_specs(specs_dir: Path) -> list[str]:
    """Names of the specs in a directory, sorted."""
    if not specs_dir.is_dir():
        raise SpecError(
            f"the specs directory {specs_dir} does not exist: create it, or point "
            "TRAINBOT_SPECS_DIR at the directory that holds your <name>.yaml files"
        )
    return sorted({p.stem for p in specs_dir.iterdir() if p.suffix in (".yaml", ".yml")})


def _find_spec_file(name: str, specs_dir: Path) -> Path:
    if not _SPEC_NAME.fullmatch(name):
        raise SpecError(
            f"{clip(name)} is not a spec name: names are letters, digits, '.', '_' and '-' "
            f"(a file in {specs_dir} is <name>.yaml)"
        )
    for suffix in (".yaml", ".yml"):
        candidate = specs_dir / f"{name}{suffix}"
        if candidate.is_file():
            return candidate
    available = list_specs(specs_dir)
    close = difflib.get_close_matches(name, available, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    listing = ", ".join(available) if available else "none"
    raise SpecError(
        f"no spec named {clip(name)} in {specs_dir}.{hint} Available: {listing}. "
        f"To add one, create {specs_dir / (name[:80] + '.yaml')}."
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read the spec file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{path} is not UTF-8 text: save it as UTF-8") from None
    return spec_mapping(text, where=str(path))


def spec_mapping(text: str, *, where: str) -> dict[str, Any]:
    """A spec file's text as a mapping, within the file bounds; ``where`` names it."""
    path = where
    if len(text) > MAX_SPEC_FILE_CHARS:
        raise SpecError(
            f"{path} is too big ({len(text):,} characters, the most is "
            f"{MAX_SPEC_FILE_CHARS:,}): a spec describes a run; keep data in files it names"
        )
    try:
        data = load_yaml(text, where="in a spec file", max_nodes=MAX_SPEC_FILE_NODES)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}", problems=exc.problems) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(f"{path} is not valid YAML{where}: {clip(problem, limit=200)}") from None
    except ValueError as exc:
        raise SpecError(f"{path} holds a value that cannot be read: {clip(str(exc))}") from None
    if data is None:
        raise SpecError(f"{path} is empty: a spec needs at least a command")
    if not isinstance(data, dict):
        raise SpecError(f"{path} must be a mapping of keys to values, not {type(data).__name__}")
    return data


def parse_spec(
    data: Mapping[str, Any],
    *,
    name: str,
    overrides: Sequence[str] = (),
    source: str | None = None,
) -> JobSpec:
    """Validate a spec given as a mapping, after applying inline overrides.

    ``name`` is the default for the spec's ``name`` key; ``source`` (a file) is named in
    errors. Every problem is reported at once, each with its full key path (the message
    lists the first few). This is the validation of what people wrote, so it also
    refuses what only trainbot may set (``TRAINBOT_*`` env).
    """
    merged = apply_overrides(data, overrides)
    merged.setdefault("name", name)
    try:
        return JobSpec.model_validate(merged, context={FROM_PEOPLE: True})
    except ValidationError as exc:
        override_paths = [(text, text.partition("=")[0].strip()) for text in overrides]
        problems: list[tuple[str, str]] = []
        lines: list[str] = []
        for error in exc.errors():
            path, line = describe_problem(error)
            for text, key in override_paths:
                if path and (path == key or key.startswith(path + ".") or path.startswith(key)):
                    line += f" (from override {clip(shown_override(text))})"
                    break
            problems.append((path, line))
            lines.append(line)
        where = f" ({source})" if source else ""
        if len(lines) == 1:
            message = f"spec {clip(name)}{where} is invalid: {lines[0]}"
        else:
            listing = "\n".join(f"  - {line}" for line in lines[:_MAX_LISTED])
            if len(lines) > _MAX_LISTED:
                listing += f"\n  - and {len(lines) - _MAX_LISTED} more"
            message = f"spec {clip(name)}{where} has {len(lines)} problems:\n{listing}"
        raise SpecError(message, problems=problems) from None


def load_spec(
    name_or_path: str | Path, *, specs_dir: Path, overrides: Sequence[str] = ()
) -> JobSpec:
    """Load, override and validate a spec.

    A ``str`` is a spec *name*, looked up as ``<name>.yaml`` in ``specs_dir`` and never
    as a path, because names arrive from chat; a :class:`~pathlib.Path` is a file, for
    the command line. Raises :class:`SpecError` saying what to fix.
    """
    if isinstance(name_or_path, Path):
        path = name_or_path
        if not path.is_file():
            raise SpecError(f"there is no spec file at {path}: check the path")
        name = path.stem
    else:
        name = name_or_path.strip()
        path = _find_spec_file(name, specs_dir)
    return parse_spec(_read_yaml(path), name=name, overrides=overrides, source=str(path))


def spec_from_text(
    text: str, *, name: str, overrides: Sequence[str] = (), where: str | None = None
) -> JobSpec:
    """A spec file's text sent by the command-line client (``trainbot launch
    spec.yaml``) or pasted into the Slack modal: read, bounded and validated exactly as a
    file in the specs directory. ``where`` names it in errors (default: the file sent)."""
    where = where or f"the spec file sent ({clip(name)}.yaml)"
    return parse_spec(spec_mapping(text, where=where), name=name, overrides=overrides, source=where)


# --- the spec stored on a run ---------------------------------------------------------

_S = TypeVar("_S", bound=Section)


def stored_section(stored: object, section: type[_S], *, run_id: str | None = None) -> _S:
    """One section of the spec stored on a run (``Run.spec``), or that section's defaults.

    The stored spec was validated at submit, but a row from an older trainbot or one
    written by hand may not validate now. Watching a run (its alerts, its budget) must
    not stop because of that, so a section that does not validate is replaced by its
    defaults, with a warning. Launching needs the whole spec: validate ``JobSpec`` then.
    """
    key = next(name for name, field in JobSpec.model_fields.items() if field.annotation is section)
    data = stored.get(key) if isinstance(stored, Mapping) else None
    if data is None:
        return section()
    try:
        return section.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{dotted((key, *error['loc']))}: {describe_validation_error(error)}"
            for error in exc.errors()
        )
        log.warning(
            "run %s: the stored spec's %s section is unusable (%s); using its defaults",
            run_id or "?",
            key,
            problems,
        )
        return section()

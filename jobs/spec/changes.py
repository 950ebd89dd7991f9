"""What a resubmit may change in a run's spec, the spec it makes, and what changed.

A resubmit resumes a run's checkpoints, so what decides *where* they are and *who* hears
about the run stays as it was launched: the checkpoint root, the channel, the budget's
hard cap (``budget.usd=`` raises the budget by the existing, recorded path). The changes
are validated exactly as a launch's overrides are (:func:`jobs.spec.parse_spec`: reserved
``TRAINBOT_*`` env, the bounds of every value, the size of an override), so a resubmit
is no way around them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jobs.domain.errors import SpecError, clip
from jobs.spec.env import is_secret_path
from jobs.spec.load import parse_spec
from jobs.spec.model import JobSpec
from jobs.spec.origin import SpecOrigin

__all__ = [
    "CHANGEABLE",
    "HIDDEN",
    "TOP_LEVEL_CHANGES",
    "Change",
    "apply_changes",
    "change_record",
    "changed_paths",
    "checks_for",
    "hidden_change",
]

#: Spec keys a resubmit may change: a section with None takes any key under it, a set
#: only the keys it names.
CHANGEABLE: Mapping[str, frozenset[str] | None] = {
    "command": frozenset(),
    "env": None,
    "max_hours": frozenset(),
    "data_uri": frozenset(),
    "description": frozenset(),
    "resources": frozenset(
        {
            "region",
            "regions",
            "zones",
            "instance_type",
            "accelerator",
            "spot",
            "on_demand_fallback",
            "disk_gb",
            "allow_cross_region_data",
        }
    ),
    "checkpoint": frozenset({"interval", "every_steps", "train_through_notice"}),
    "resubmit": None,
    "alerts": None,
    "retention": None,
    "profile": None,
    # Another commit (or archive) of the run's code, resumed from its newest checkpoint.
    "code": frozenset({"ref", "archive"}),
    "setup": frozenset(),
    "setup_cache": None,
    # Another container image (a fixed tag), resumed from the newest checkpoint.
    "image": frozenset(),
}
#: The keys of :data:`CHANGEABLE` that are values, not sections.
TOP_LEVEL_CHANGES = tuple(k for k, v in CHANGEABLE.items() if v == frozenset())

#: Why the keys a resubmit may not change stay as they are.
_WHY_NOT = {
    "checkpoint.uri": "the run resumes its checkpoints where they are",
    "notify": "the run keeps reporting where it was launched",
    "budget": "budget.usd= is the budget setting a resubmit takes; the rest of the budget "
    "(its hard cap, its thresholds) stays as launched",
    "dry_run": "the dry run is part of a launch's preflight, not of a resubmit",
    "name": "the run keeps its spec's name",
    "resources.cloud": "a run stays with the provider it was launched on",
    "code.commit": "trainbot pins it from code.ref at the resubmit: set code.ref=<sha> to "
    "move the run to that commit",
    "code.repo": "a resubmit resumes the run's checkpoints with its own repository's code "
    "(code.ref= moves it to another commit); launch a new run for another repository",
}

#: (dotted key, old value, new value); an ``env`` value is :data:`HIDDEN` (None: unset).
Change = tuple[str, Any, Any]
#: What :func:`changed_paths` gives for an ``env`` value: credentials live there as often
#: as hyperparameters, and a change is posted to a thread and kept in the journal.
HIDDEN = "…"


def _refusal(key: str) -> str | None:
    """Why ``key`` may not change on a resubmit; None when it may."""
    parts = key.split(".")
    for depth in (2, 1):
        why = _WHY_NOT.get(".".join(parts[:depth]))
        if why is not None and len(parts) >= depth:
            return why
    allowed = CHANGEABLE.get(parts[0], frozenset())
    if parts[0] not in CHANGEABLE:
        return "a resubmit does not change it"
    if allowed == frozenset():
        return None if len(parts) == 1 else f"{parts[0]} is a value, not a section"
    if allowed is None or len(parts) == 1 or parts[1] in allowed:
        return None
    return "a resubmit does not change it"


def apply_changes(stored: Mapping[str, Any], overrides: Sequence[str], *, name: str) -> JobSpec:
    """The run's stored spec with ``overrides`` applied, validated as a launch's are.

    A new region without new zones drops the old zones (they belong to the old region);
    ``resources.region`` and ``resources.regions`` replace each other."""
    for text in overrides:
        key = text.partition("=")[0].strip()
        why = _refusal(key)
        if why is not None:
            raise SpecError(
                f"{clip(key)} cannot change on a resubmit: {why}. A resubmit changes "
                "command, env.*, resources (region, regions, zones, instance_type, "
                "accelerator, spot …), data_uri, max_hours, checkpoint.interval, "
                "resubmit.*, alerts.*, retention.*, profile.*, code.ref, code.archive, "
                "setup, setup_cache.* and image",
                problems=[(key, why)],
            )
    keys = {text.partition("=")[0].strip() for text in overrides}
    base = {k: v for k, v in stored.items() if k != "name"}
    resources = dict(base.get("resources") or {})
    if keys & {"resources.region", "resources.regions"}:
        resources.pop("regions", None)
        resources.pop("region", None)
        if "resources.zones" not in keys:
            resources.pop("zones", None)
    base["resources"] = resources
    # Where the spec was read is trainbot's record, not something people wrote: kept as is.
    origin = base.pop("origin", None)
    spec = parse_spec(base, name=name, overrides=overrides)
    if origin is None:
        return spec
    return spec.model_copy(update={"origin": SpecOrigin.model_validate(origin)})


def changed_paths(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """Every dotted key whose value differs between two spec dumps, sorted; the values of
    ``env`` keys are :data:`HIDDEN`, so no caller can show one."""
    found: list[Change] = []

    def walk(prefix: str, a: Any, b: Any) -> None:
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            for key in sorted(set(a) | set(b)):
                walk(f"{prefix}.{key}" if prefix else str(key), a.get(key), b.get(key))
        elif a != b and is_secret_path(prefix):
            found.append((prefix, _hide(a), _hide(b)))
        elif a != b:
            found.append((prefix, a, b))

    walk("", old, new)
    return found


def _hide(value: Any) -> Any:
    return None if value is None else HIDDEN


def hidden_change(change: Change) -> str | None:
    """``changed``, ``added`` or ``removed`` for a change whose values are not shown (an
    ``env`` key); None for one that may be shown."""
    key, old, new = change
    if not is_secret_path(key):
        return None
    return "added" if old is None else "removed" if new is None else "changed"


def change_record(change: Change) -> dict[str, Any]:
    """A change as the journal keeps it: the key and old → new, or for an ``env`` key the
    key and what happened to it."""
    key, old, new = change
    what = hidden_change(change)
    return {"key": key, "old": old, "new": new} if what is None else {"key": key, "change": what}


def checks_for(changes: Sequence[Change]) -> tuple[str, ...]:
    """The preflight checks a set of changes needs again: a move (region, zones,
    instance type, market, dataset) asks quota, capacity and data locality again; another
    container image, the image check; a change of the command or the environment needs
    none of them."""
    moved = any(key.startswith("resources.") or key == "data_uri" for key, _, _ in changes)
    imaged = any(key == "image" for key, _, _ in changes)
    return (("quota", "capacity", "data") if moved else ()) + (("image",) if imaged else ())

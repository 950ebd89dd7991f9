"""Job specs: one YAML file per kind of run, overridable inline (``budget.usd=800``).

A spec is everything about a run that a person chooses: what to execute, on what,
where checkpoints go and how long they are kept, what it may cost, when to resubmit,
when to alert. It is one pydantic model with defaults for everything but the command;
unknown keys are errors, because a misspelt ``budgte:`` silently ignored is a run
with no budget. Durations are parsed by :func:`runner.duration.parse_duration` and
stored as seconds (``float``). A run stores its spec; :func:`stored_section` reads
the parts of it that watching a run needs.
"""

from __future__ import annotations

import difflib
import logging
import re
import shlex
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from jobs.errors import CLIP_CHARS, SpecError, clip, describe_validation_error
from runner.duration import parse_duration

__all__ = [
    "Accelerator",
    "AlertThresholds",
    "BudgetPolicy",
    "CheckpointPolicy",
    "DryRun",
    "JobSpec",
    "KeepBest",
    "Notify",
    "Resources",
    "ResubmitPolicy",
    "Retention",
    "apply_overrides",
    "list_specs",
    "load_spec",
    "parse_spec",
    "stored_section",
]

log = logging.getLogger(__name__)

_SPEC_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_ACCELERATOR_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: Variables trainbot sets for the runner itself (run id, token, checkpoint prefix, URIs):
#: a spec that set one could point a run at another run's checkpoints or events.
RESERVED_ENV_PREFIX = "TRAINBOT_"
#: Runner knobs under that prefix that only tune the run itself, so a spec may set them.
TUNABLE_ENV = frozenset({"TRAINBOT_SYSTEM_SAMPLE_S"})
#: Validation context key: set by :func:`parse_spec`, which validates what people wrote,
#: and not by re-validation of a stored spec (a resubmit stores the checkpoint prefix).
_FROM_PEOPLE = "from_people"

# What one YAML document may expand to. Aliases are refused outright (a few hundred
# characters of them expand to gigabytes); these bound what plain YAML can build.
MAX_OVERRIDE_CHARS = 64 * 1024
MAX_OVERRIDE_NODES = 10_000
MAX_SPEC_FILE_CHARS = 1024 * 1024
MAX_SPEC_FILE_NODES = 100_000
MAX_YAML_DEPTH = 32
#: Problems listed in one error message; the rest are counted.
_MAX_LISTED = 10


Duration = Annotated[float, BeforeValidator(parse_duration)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Accelerator(_Section):
    """Accelerators per instance, written ``TYPE:COUNT`` in a spec (``A100:8``)."""

    #: Provider's name for the device (``A100``, ``H100``, ``nvidia-l4``).
    type: str
    #: Devices per instance.
    count: int = Field(default=1, ge=1, le=16)

    def __str__(self) -> str:
        return f"{self.type}:{self.count}"


def _parse_accelerator(value: object) -> object:
    if not isinstance(value, str):
        return value
    text = value.strip()
    type_, sep, count_text = text.partition(":")
    if not _ACCELERATOR_TYPE.fullmatch(type_):
        raise ValueError(f"expected TYPE:COUNT such as A100:8 or L4:1 (got {clip(value)})")
    if not sep:
        return {"type": type_, "count": 1}
    try:
        count = int(count_text)
    except ValueError:
        raise ValueError(
            f"the count after ':' must be a whole number, as in A100:8 (got {clip(value)})"
        ) from None
    if not 1 <= count <= 16:
        raise ValueError(f"the accelerator count must be between 1 and 16 (got {clip(value)})")
    return {"type": type_, "count": count}


class Resources(_Section):
    """Where and on what the run executes."""

    #: Which provider runs it.
    cloud: Literal["local", "aws", "gcp"] = "local"
    #: Region; ``None`` lets the capacity check pick one.
    region: str | None = None
    #: Zones to try, in order; empty means every zone of the region, ranked by capacity.
    zones: list[str] = Field(default_factory=list)
    #: Accelerators per instance; ``None`` for CPU-only.
    accelerator: Annotated[Accelerator | None, BeforeValidator(_parse_accelerator)] = None
    #: Exact instance type; ``None`` lets the provider pick the cheapest that fits.
    instance_type: str | None = None
    #: Instances launched together (multi-node); spend is per instance.
    instances: int = Field(default=1, ge=1)
    #: Scratch disk of each instance, in GB (logs and local checkpoints fill it).
    disk_gb: float = Field(default=100.0, gt=0)
    #: Spot/preemptible capacity (the point of trainbot); ``False`` pays on-demand prices.
    spot: bool = True
    #: Launch on-demand when no zone has spot capacity.
    on_demand_fallback: bool = False

    @model_validator(mode="after")
    def _zones_in_region(self) -> Resources:
        if self.region:
            strays = [zone for zone in self.zones if not zone.startswith(self.region)]
            if strays:
                raise ValueError(
                    f"zone {clip(strays[0])} is not in region {clip(self.region)}: fix the zone, "
                    "or change the region"
                )
        return self


class CheckpointPolicy(_Section):
    """When checkpoints are written, and where."""

    #: Root URI; ``None`` uses the control plane's ``TRAINBOT_CHECKPOINT_URI``.
    uri: str | None = None
    #: Seconds between checkpoints, or ``"auto"`` for Daly's optimum from the dry run's
    #: checkpoint time and the provider's preemption rate.
    interval: float | Literal["auto"] = "auto"
    #: Also checkpoint every N steps; the first of the two triggers wins.
    every_steps: int | None = Field(default=None, ge=1)
    #: On a preemption notice, train on through the provider's window and write the
    #: emergency checkpoint just before the deadline, while it still fits with a margin
    #: (the window is paid for either way); off: write it at once and exit.
    train_through_notice: bool = False

    @field_validator("interval", mode="before")
    @classmethod
    def _auto_or_duration(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        seconds = parse_duration(value)
        if seconds <= 0:
            raise ValueError(f"must be 'auto' or a duration above zero (got {clip(value)})")
        return seconds

    @property
    def interval_s(self) -> float | None:
        """The interval in seconds, or ``None`` when it is to be chosen automatically."""
        return None if self.interval == "auto" else float(self.interval)


class KeepBest(_Section):
    """Keep the checkpoints with the best value of one reported metric."""

    metric: str = Field(min_length=1)
    mode: Literal["min", "max"] = "min"
    count: int = Field(default=1, ge=1)


class Retention(_Section):
    """Which checkpoints survive cleanup. The newest committed one always does."""

    keep_last: int = Field(default=3, ge=1)
    #: Keep every checkpoint whose step is a multiple of this.
    keep_every_steps: int | None = Field(default=None, ge=1)
    keep_best: KeepBest | None = None
    #: Delete checkpoints older than this (seconds), unless another rule keeps them.
    max_age: Duration | None = Field(default=None, gt=0)


class BudgetPolicy(_Section):
    """What the run may cost, and what happens as it spends (the spec's ``budget``)."""

    #: Dollars; ``None`` makes preflight's cost estimate the alerting budget.
    usd: float | None = Field(default=None, gt=0)
    #: Percentages of the budget that alert once each.
    thresholds: list[int] = Field(default_factory=lambda: [50, 80, 100])
    #: Stop the run when spend reaches an explicit ``usd`` (not an estimate).
    hard_cap: bool = True

    @field_validator("thresholds")
    @classmethod
    def _sorted_percentages(cls, value: list[int]) -> list[int]:
        for percent in value:
            if not 1 <= percent <= 1000:
                raise ValueError(f"thresholds are percentages from 1 to 1000 (got {clip(percent)})")
        return sorted(set(value))

    @property
    def caps_spend(self) -> bool:
        """The hard cap applies: only to a budget written here, never to an estimate."""
        return self.hard_cap and self.usd is not None

    @property
    def alert_percentages(self) -> list[int]:
        """The thresholds that alert; a hard cap always alerts at 100 % (it stops there)."""
        return sorted({*self.thresholds, 100}) if self.caps_spend else list(self.thresholds)


class ResubmitPolicy(_Section):
    """What happens after a preemption or a lost instance (the spec's ``resubmit``)."""

    #: Attempts in all, the first included.
    max_attempts: int = Field(default=10, ge=1)
    #: Wait before relaunching.
    backoff_s: Duration = Field(default=30.0, ge=0)
    #: Try the next zone when the current one has no capacity.
    zone_failover: bool = True
    #: Try other regions once every zone of this one has failed.
    region_failover: bool = False
    #: Switch to on-demand after this many preemptions; ``None`` stays on spot.
    on_demand_after_preemptions: int | None = Field(default=None, ge=1)


class AlertThresholds(_Section):
    """Per-run thresholds for the alert rules."""

    #: A loss above this many times its moving baseline is a spike...
    loss_spike_factor: float = Field(default=3.0, gt=1)
    #: ...when it lasts this many consecutive points.
    loss_spike_points: int = Field(default=3, ge=1)
    #: Points in the least-squares fit that detects a rising loss.
    trend_points: int = Field(default=20, ge=3)
    #: Device utilisation below this percentage...
    low_util_percent: float = Field(default=40.0, ge=0, le=100)
    #: ...for this long alerts.
    low_util_window_s: Duration = Field(default=300.0, gt=0)
    #: Scratch disk use above this percentage alerts...
    disk_percent: float = Field(default=90.0, gt=0, le=100)
    #: ...and so does a growth rate that fills it within this horizon.
    disk_horizon_s: Duration = Field(default=1800.0, gt=0)
    #: This many preemptions...
    repeated_preemptions: int = Field(default=3, ge=1)
    #: ...within this window alert as repeated preemptions.
    repeated_window_s: Duration = Field(default=3600.0, gt=0)
    #: No event from the runner for this long is a lost heartbeat.
    heartbeat_deadline_s: Duration = Field(default=120.0, gt=0)
    #: Without a GPU, a mean data-wait fraction above this is an input-bound run.
    data_wait_fraction: float = Field(default=0.5, gt=0, le=1)


class Notify(_Section):
    """Where the run reports."""

    #: Channel for the run's thread; ``None`` is the channel it was launched from.
    channel: str | None = None
    #: Who is paged when a critical alert stays unacknowledged (Slack user group).
    oncall_group: str | None = None


class DryRun(_Section):
    """The preflight dry run: a few steps, a checkpoint, a kill, a restore, two more steps."""

    enabled: bool = True
    #: Steps before the checkpoint-and-kill.
    steps: int = Field(default=20, ge=1)
    #: URI of a small data sample; ``None`` uses ``data_uri``.
    sample: str | None = None
    #: Run it on this machine's CPU instead of a cheap cloud instance.
    local: bool = True


def _split_command(value: object) -> object:
    if value is None:
        raise ValueError("is required: give the program to run, e.g. python train.py")
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise ValueError(f"cannot split the command line ({exc}); check its quotes") from None
    return value


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
        context.get(_FROM_PEOPLE)
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


class JobSpec(_Section):
    """One kind of training run. Stored on the run as ``model_dump(mode="json")``."""

    #: The spec's name; defaults to the file name without ``.yaml``.
    name: str = Field(min_length=1)
    description: str = ""
    #: The training command, run by the runner's supervisor. A string is split like a shell.
    command: Annotated[list[str], BeforeValidator(_split_command)] = Field(min_length=1)
    #: Extra environment variables for the training process.
    #: Names are shell identifiers; ``TRAINBOT_*`` ones are trainbot's own (``TUNABLE_ENV`` aside).
    env: Annotated[dict[EnvName, EnvValue], BeforeValidator(_stringify_env)] = Field(
        default_factory=dict
    )
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

    @field_validator("command")
    @classmethod
    def _non_blank_program(cls, value: list[str]) -> list[str]:
        if not value or not value[0].strip():
            raise ValueError("the command is empty: give the program to run, e.g. python train.py")
        return value


# --- the spec stored on a run ---------------------------------------------------------

_S = TypeVar("_S", bound=_Section)


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
            f"{_dotted((key, *error['loc']))}: {describe_validation_error(error)}"
            for error in exc.errors()
        )
        log.warning(
            "run %s: the stored spec's %s section is unusable (%s); using its defaults",
            run_id or "?",
            key,
            problems,
        )
        return section()


# --- loading --------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """A safe loader that refuses duplicate keys, anchors and aliases, and bounds size.

    A duplicate key silently keeps the last value. Aliases let a few hundred characters
    expand to gigabytes (a billion-laughs list), so they are refused as soon as the
    first anchor is seen, before anything is built; the node and depth limits bound what
    plain YAML can build (and keep a deeply nested value from exhausting the stack).
    """

    def __init__(self, text: str, *, where: str, max_nodes: int) -> None:
        super().__init__(text)
        #: Ends refusals: ``in overrides``, ``in a spec file``.
        self.where = where
        self.max_nodes = max_nodes
        self._nodes = 0
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event = self.peek_event()
        line = event.start_mark.line + 1
        name = getattr(event, "anchor", None)
        if name is not None:
            sign = "*" if isinstance(event, yaml.AliasEvent) else "&"
            label = name if len(name) <= 20 else f"{name[:20]}…"
            raise SpecError(
                f"anchors (&name) and aliases (*name) are not allowed {self.where}: write "
                f"the value out (found {sign}{label} on line {line})",
                problems=[("", f"anchor or alias on line {line}")],
            )
        self._nodes += 1
        if self._nodes > self.max_nodes:
            raise SpecError(
                f"the value is too big: more than {self.max_nodes:,} items {self.where}; "
                "put large data in a file and give its path or URI instead",
                problems=[("", f"more than {self.max_nodes:,} items")],
            )
        if self._depth >= MAX_YAML_DEPTH:
            raise SpecError(
                f"the value is nested more than {MAX_YAML_DEPTH} levels deep (line {line}); "
                "flatten it",
                problems=[("", f"nested more than {MAX_YAML_DEPTH} levels deep")],
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise SpecError(
                f"duplicate key {clip(key)} on line {line}: keep one of them",
                problems=[(str(key), f"duplicate key on line {line}")],
            )
        seen.add(key)
    loader.flatten_mapping(node)
    return dict(loader.construct_pairs(node))


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _mapping_without_duplicates,
)


def _load_yaml(text: str, *, where: str, max_nodes: int) -> Any:
    """One YAML document through :class:`_StrictLoader`.

    Raises ``SpecError`` for what the loader refuses, ``yaml.YAMLError`` for bad syntax,
    and ``ValueError`` for a scalar Python cannot hold (an integer past its digit limit,
    a date such as 2024-02-30).
    """
    loader = _StrictLoader(text, where=where, max_nodes=max_nodes)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


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
    if len(text) > MAX_SPEC_FILE_CHARS:
        raise SpecError(
            f"{path} is too big ({len(text):,} characters, the most is "
            f"{MAX_SPEC_FILE_CHARS:,}): a spec describes a run; keep data in files it names"
        )
    try:
        data = _load_yaml(text, where="in a spec file", max_nodes=MAX_SPEC_FILE_NODES)
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


def _parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    path = key.split(".")
    if not sep or not all(part.strip() for part in path):
        raise SpecError(
            f"override {clip(text)} is not key.path=value: write it like budget.usd=800",
            problems=[(key, "not key.path=value")],
        )
    if len(text) > MAX_OVERRIDE_CHARS:
        raise SpecError(
            f"override {clip(text)} is too long (the most is {MAX_OVERRIDE_CHARS:,} "
            "characters): put large data in a file and give its path or URI instead",
            problems=[(key, "too long")],
        )
    try:
        value = (
            _load_yaml(raw, where="in overrides", max_nodes=MAX_OVERRIDE_NODES)
            if raw.strip()
            else None
        )
    except SpecError as exc:
        raise SpecError(
            f"override {clip(text)}: {exc}",
            problems=[(key, message) for _, message in exc.problems],
        ) from None
    except (yaml.YAMLError, ValueError):
        plain = len(text) <= CLIP_CHARS and text.isprintable()
        example = f"{key}='{raw}'" if plain else "key.path='…'"
        raise SpecError(
            f"override {clip(text)}: the value is not valid YAML; quote it, e.g. {example}",
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
                shown = _short(where)
                raise SpecError(
                    f"override {clip(text)}: {shown} is a value, not a section, so it has "
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


def _short(path: str) -> str:
    """A key path as shown in a message: whole unless someone wrote an absurd one."""
    return path if len(path) <= CLIP_CHARS else f"{path[:CLIP_CHARS]}… ({len(path)} characters)"


def _dotted(loc: Sequence[Any]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _problem(error: Any) -> tuple[str, str]:
    loc = tuple(error["loc"])
    if loc and loc[-1] == "[key]":  # a bad mapping key (an env name): report the key's path
        loc = loc[:-1]
    path = _dotted(loc)
    if error["type"] == "extra_forbidden":
        section = _model_at(loc[:-1])
        known = list(section.model_fields) if section else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        if close:
            hint = f" (did you mean {_dotted((*loc[:-1], close[0]))!r}?)"
        else:
            hint = f"; known keys here: {', '.join(known)}" if known else ""
        return path, f"unknown key {clip(path)}{hint}"
    message = describe_validation_error(error)
    return path, (f"{_short(path)}: {message}" if path else message)


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
        return JobSpec.model_validate(merged, context={_FROM_PEOPLE: True})
    except ValidationError as exc:
        override_paths = [(text, text.partition("=")[0].strip()) for text in overrides]
        problems: list[tuple[str, str]] = []
        lines: list[str] = []
        for error in exc.errors():
            path, line = _problem(error)
            for text, key in override_paths:
                if path and (path == key or key.startswith(path + ".") or path.startswith(key)):
                    line += f" (from override {clip(text)})"
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

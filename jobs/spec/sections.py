"""The spec's sections: code, setup cache, resources, checkpoint, retention, budget,
resubmit, alerts, notify, dry run and profile, each a frozen pydantic model that refuses
unknown keys."""

from __future__ import annotations

import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from jobs.domain.errors import clip
from jobs.providers import PROVIDERS, known_names
from runner import env as contract
from runner.duration import parse_duration

_ACCELERATOR_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

Duration = Annotated[float, BeforeValidator(parse_duration)]


class Section(BaseModel):
    """A part of the spec: frozen, and a misspelt key is an error, never ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


_SCP_LIKE = re.compile(r"^[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:[^/].*$")
_REPO_SCHEMES = ("https", "http", "ssh", "git", "file")
_ARCHIVE_SCHEMES = ("s3", "gs", "file")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class Code(Section):
    """The run's code: a git repository at a ref, pinned to one commit when the run is
    submitted, or an archive ``trainbot-runner pack`` made. The runner puts it in the
    instance's code directory, where setup and the command run."""

    #: A git URL: ``https://host/org/repo.git``, or ``git@host:org/repo.git`` for a
    #: private repository (read with the admin's deploy key, TRAINBOT_GIT_SSH_KEY_FILE).
    repo: str | None = Field(default=None, min_length=1, max_length=500)
    #: A branch, a tag or a full commit sha; ``None``: the repository's default branch.
    ref: str | None = Field(default=None, min_length=1, max_length=250)
    #: The commit ``ref`` named at submit, set by trainbot: every attempt and node checks
    #: it out. A resubmit with ``code.ref=…`` moves the run to another one.
    commit: str | None = None
    #: Or: a packed archive, ``s3://…``, ``gs://…`` or ``file:///…`` (``trainbot-runner
    #: pack DIR STORE_URI`` makes one and prints this line).
    archive: str | None = Field(default=None, min_length=1, max_length=1000)

    @field_validator("repo")
    @classmethod
    def _git_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        text = value.strip()
        if _SCP_LIKE.fullmatch(text):
            return text
        parts = urlsplit(text)
        if parts.scheme not in _REPO_SCHEMES or not (parts.netloc or parts.scheme == "file"):
            raise ValueError(
                f"expected a git URL such as https://github.com/org/repo.git or "
                f"git@github.com:org/repo.git (got {clip(value)})"
            )
        if parts.password is not None or (parts.scheme in ("http", "https") and parts.username):
            raise ValueError(
                "holds a credential: a spec and its messages are seen by the whole channel. "
                "Use an ssh URL (git@host:org/repo.git); an admin sets the deploy key "
                "(TRAINBOT_GIT_SSH_KEY_FILE)"
            )
        return text

    @field_validator("commit")
    @classmethod
    def _full_sha(cls, value: str | None) -> str | None:
        if value is not None and not _COMMIT.fullmatch(value.strip().lower()):
            raise ValueError(
                f"expected a 40-character commit sha (got {clip(value)}); to choose a commit, "
                "set code.ref"
            )
        return value.strip().lower() if value is not None else None

    @field_validator("archive")
    @classmethod
    def _store_uri(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value.strip())
        if parts.scheme not in _ARCHIVE_SCHEMES or not parts.path.strip("/"):
            raise ValueError(
                f"expected s3://…, gs://… or file:///… naming a .tar.gz (got {clip(value)}); "
                "`trainbot-runner pack DIR STORE_URI` makes one and prints the line to use"
            )
        return value.strip()

    @model_validator(mode="after")
    def _one_source(self) -> Code:
        if (self.repo is None) == (self.archive is None):
            raise ValueError(
                "give code.repo (with code.ref) or code.archive, one of the two"
                if self.repo is None
                else "code.repo and code.archive are both set: keep one"
            )
        if self.archive is not None and (self.ref is not None or self.commit is not None):
            raise ValueError("code.ref and code.commit go with code.repo, not code.archive")
        return self


def _setup_commands(value: object) -> object:
    if isinstance(value, str):
        return [value] if value.strip() else []
    return [] if value is None else value


#: The setup commands: one shell command, or a list run in order.
SetupCommands = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=4000)]], BeforeValidator(_setup_commands)
]


class SetupCache(Section):
    """What setup builds, archived to the run's store and restored by the next attempt
    instead of running setup again (keyed by a hash of the setup commands, the
    requirement and lock files, the machine image and the Python version)."""

    enabled: bool = True
    #: The virtual environment the runner makes in the code directory before setup,
    #: active for setup and the command (it sees the image's packages); ``null``: none.
    venv: str | None = Field(default=".venv", min_length=1, max_length=300)
    #: More paths setup builds that the archive holds (relative: in the code directory).
    paths: list[str] = Field(default_factory=list, max_length=20)
    #: More files (globs, in the code directory) whose contents key the archive, beside
    #: requirements*.txt, pyproject.toml, setup.py/cfg, *.lock, environment.yml.
    key_files: list[str] = Field(default_factory=list, max_length=20)

    @field_validator("venv")
    @classmethod
    def _inside(cls, value: str | None) -> str | None:
        if value is not None and (value.startswith("/") or ".." in value.split("/")):
            raise ValueError(f"a path inside the code directory, such as .venv (got {clip(value)})")
        return value


class Accelerator(Section):
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


class Resources(Section):
    """Where and on what the run executes."""

    #: Which provider runs it, by its registry name (``jobs.providers``): one the control
    #: plane configures (``TRAINBOT_PROVIDERS``); ``None`` runs on its default provider.
    cloud: str | None = None
    #: Region; ``None`` runs in the provider's default region. A one-region shorthand for
    #: ``regions``: after validation it is always the first of ``regions``.
    region: str | None = Field(default=None, exclude=True)
    #: Regions to run in, in order of preference: an attempt moves to the next once every
    #: zone of this one is out of capacity (its quota and data locality checked first).
    regions: list[str] = Field(default_factory=list)
    #: Zones to try, in order; a region none of whose zones is listed uses every zone it
    #: has, ranked by capacity.
    zones: list[str] = Field(default_factory=list)
    #: Accelerators per instance; ``None`` for CPU-only.
    accelerator: Annotated[Accelerator | None, BeforeValidator(_parse_accelerator)] = None
    #: Exact instance type; ``None`` lets the provider pick the cheapest that fits.
    instance_type: str | None = None
    #: Machine image the instances boot: an AMI id or ``resolve:ssm:<parameter>`` on
    #: AWS, an image or image-family URL on GCP; ``None`` uses the provider's (its
    #: admin's setting, else a GPU-ready default). Preflight checks it exists there.
    image_id: str | None = Field(default=None, min_length=1, max_length=300)
    #: Instances launched together as one gang (nodes of one torchrun job, placed close
    #: together by the provider); spend and quota count each.
    instances: int = Field(default=1, ge=1, le=64)
    #: Processes torchrun starts on each node; None: one per accelerator (one on a CPU
    #: instance) for a multi-node run, and the command as it is on one instance.
    processes_per_node: int | None = Field(default=None, ge=1, le=64)
    #: Scratch disk of each instance, in GB (logs and local checkpoints fill it).
    disk_gb: float = Field(default=100.0, gt=0)
    #: Spot/preemptible capacity (the point of trainbot); ``False`` pays on-demand prices.
    spot: bool = True
    #: Launch on-demand when no allowed zone of any region has spot capacity; the attempt
    #: after it tries spot again.
    on_demand_fallback: bool = False
    #: Let an attempt run in a region other than its dataset's (``data_uri``) or its
    #: checkpoint store's; off, such a region is skipped, since every epoch would read the
    #: data, and every save write, across regions. A multi- or dual-region bucket is in
    #: every region it covers.
    allow_cross_region_data: bool = False

    @field_validator("cloud", mode="after")
    @classmethod
    def _registered_cloud(cls, value: str | None) -> str | None:
        if value is None:
            return None
        name = value.strip().lower()
        if name not in PROVIDERS:
            raise ValueError(
                f"expected one of {known_names()} (got {clip(value)}); leave it out for "
                "the control plane's default provider"
            )
        return name

    @model_validator(mode="before")
    @classmethod
    def _one_way_to_name_regions(cls, data: object) -> object:
        """``region`` is shorthand for a one-element ``regions``; both at once is ambiguous."""
        if not isinstance(data, dict):
            return data
        region, regions = data.get("region"), data.get("regions")
        if region is not None and regions:
            raise ValueError(
                f"resources.region ({clip(region)}) and resources.regions ({clip(regions)}) "
                "are both set: keep one (region is shorthand for a one-element regions list; "
                "inline, set resources.region=null next to resources.regions=[…])"
            )
        if region is not None:
            return {**data, "regions": [region]}
        if regions and isinstance(regions, list) and isinstance(regions[0], str):
            return {**data, "region": regions[0]}
        return data

    @property
    def under_torchrun(self) -> bool:
        """The command runs under torchrun: on several nodes, or with processes_per_node."""
        return self.instances > 1 or self.processes_per_node is not None

    @property
    def nproc_per_node(self) -> int:
        """Processes torchrun starts on each node: as set, else one per accelerator."""
        return self.processes_per_node or (self.accelerator.count if self.accelerator else 1)

    @model_validator(mode="after")
    def _zones_in_region(self) -> Resources:
        if len(set(self.regions)) != len(self.regions):
            raise ValueError(f"resources.regions lists a region twice ({clip(self.regions)})")
        if self.regions:
            strays = [z for z in self.zones if self.region_of_zone(z) is None]
            if strays:
                where = (
                    f"region {clip(self.regions[0])}"
                    if len(self.regions) == 1
                    else f"any of the regions {clip(self.regions)}"
                )
                raise ValueError(
                    f"zone {clip(strays[0])} is not in {where}: fix the zone, or change the region"
                )
        return self

    def region_of_zone(self, zone: str) -> str | None:
        """Which of ``regions`` holds ``zone`` (zone names start with their region's)."""
        found = [r for r in self.regions if zone.startswith(r)]
        return max(found, key=len) if found else None

    def zones_in(self, region: str) -> list[str]:
        """The listed zones of ``region``; empty: any zone of it. With no region named
        (the provider's default), every listed zone."""
        if not self.regions:
            return list(self.zones)
        return [z for z in self.zones if self.region_of_zone(z) == region]


class CheckpointPolicy(Section):
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
    #: For a script that writes its own checkpoints (no session API): the directory it
    #: writes them into ($TRAINBOT_CHECKPOINT_DIR), synced to the store and filled from it
    #: on a new instance (``trainbot-runner exec --sync-dir``). Relative: on the
    #: instance's scratch volume.
    sync_dir: str | None = Field(default=None, min_length=1)

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


class KeepBest(Section):
    """Keep the checkpoints with the best value of one reported metric."""

    metric: str = Field(min_length=1)
    mode: Literal["min", "max"] = "min"
    count: int = Field(default=1, ge=1)


class Retention(Section):
    """Which checkpoints survive cleanup. The newest committed one always does."""

    keep_last: int = Field(default=3, ge=1)
    #: Keep every checkpoint whose step is a multiple of this.
    keep_every_steps: int | None = Field(default=None, ge=1)
    keep_best: KeepBest | None = None
    #: Delete checkpoints older than this (seconds), unless another rule keeps them.
    max_age: Duration | None = Field(default=None, gt=0)


class BudgetPolicy(Section):
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
        """The hard cap applies: only to a budget written here (or raised by a resubmit,
        which writes it here), never to an estimate. The one definition of "capped"."""
        return self.hard_cap and self.usd is not None

    @property
    def alert_percentages(self) -> list[int]:
        """The thresholds that alert; a hard cap always alerts at 100 % (it stops there)."""
        return sorted({*self.thresholds, 100}) if self.caps_spend else list(self.thresholds)


class ResubmitPolicy(Section):
    """What happens after a preemption, a lost instance, a launch refused for lack of
    capacity, or an attempt that exits with an error (the spec's ``resubmit``).

    The three are counted apart: waiting for capacity uses no attempt; preemptions do not
    use up a run unless ``max_preemptions`` says so; an error fails the run unless its
    exit code is listed in ``recover_on_exit_codes`` (a restart, at most
    ``max_restarts_on_errors`` of them)."""

    #: Deprecated and ignored: it counted capacity refusals and preemptions alike, so a
    #: run gave up in a busy zone. Use ``max_preemptions`` (a ceiling on preemptions),
    #: ``max_restarts_on_errors`` and ``wait_for_capacity``. Accepted so that existing
    #: specs and every stored spec (which carry it) still load; left out of new dumps.
    max_attempts: int | None = Field(default=None, ge=1, exclude=True)
    #: Wait before relaunching, and the first wait between tries for capacity.
    backoff_s: Duration = Field(default=30.0, ge=0)
    #: How long a run waits for capacity when no allowed zone (of any allowed region)
    #: takes it: tried again with a backoff (from ``backoff_s``, doubling, at most 10
    #: minutes, jittered), until this long after the first refusal. Waiting costs nothing
    #: and uses no attempt. ``0``: one pass over the zones, then the run fails.
    wait_for_capacity: Duration = Field(default=6 * 3600.0, ge=0, le=30 * 86400)
    #: The most preemptions a run resumes from: the one after fails it. ``None`` (the
    #: default): a preempted run always resumes (its budget and ``max_hours`` bound it).
    max_preemptions: int | None = Field(default=None, ge=0)
    #: Restarts after an attempt exits with a code listed in ``recover_on_exit_codes``,
    #: each from the newest checkpoint; the next such exit fails the run.
    max_restarts_on_errors: int = Field(default=2, ge=0, le=100)
    #: Exit codes of a transient fault (an NCCL timeout's abort, 134; a driver's Xid)
    #: that restart the attempt. Empty (the default): any error fails the run at once,
    #: since a bug in the script would only fail again.
    recover_on_exit_codes: tuple[int, ...] = Field(default=(), max_length=50)
    #: Try the next zone when the current one has no capacity.
    zone_failover: bool = True
    #: Deprecated and ignored: listing several ``resources.regions`` is what turns region
    #: failover on. Kept only because every stored spec carries it (specs are stored as
    #: ``model_dump``, and sections refuse unknown keys); left out of new dumps.
    region_failover: bool = Field(default=False, exclude=True)
    #: Switch to on-demand after this many preemptions; ``None`` stays on spot.
    on_demand_after_preemptions: int | None = Field(default=None, ge=1)
    #: The most an instance-hour may cost, in USD: an attempt waits (first launch,
    #: resubmit, after a preemption) until the provider's price is at or below it, and a
    #: scheduled job launches it then. ``None``: launch at any price.
    max_price: float | None = Field(default=None, gt=0, le=10_000)


class HungWatch(Section):
    """A hung run: heartbeats go on, the step stands still (the spec's ``alerts.hung``)."""

    #: The step standing still for this many times its recent median step time...
    factor: float = Field(default=contract.HANG_FACTOR.default, gt=1, le=10_000)
    #: ...and at least this long is a hung run; a run that pauses longer between steps
    #: (a long evaluation, a large checkpoint) sets a longer floor.
    floor: Duration = Field(default=contract.HANG_FLOOR_S.default, gt=0, le=7 * 24 * 3600)
    #: Stop the run (with a last checkpoint sync) when nobody acknowledges the alert
    #: within this long; ``None``: only alert.
    stop_after: Duration | None = Field(default=None, ge=0)


class MetricThreshold(Section):
    """An alert on a reported metric: ``{metric: val_loss, above: 2.5, for: 5m}``."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    #: ``loss``, ``step_time_s``, ``data_wait_fraction`` or a metric the script logs.
    metric: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_./:-]+$")
    #: Alert while the metric is above this...
    above: float | None = None
    #: ...or below this.
    below: float | None = None
    #: ...for this long without a break (0: at the first point); at most the hour of
    #: metrics the rules keep per run (``jobs.ingest.windows.WINDOW_SPAN_S``).
    for_s: Duration = Field(default=0.0, ge=0, le=3600, alias="for")
    severity: Literal["info", "warning", "critical"] = "warning"

    @model_validator(mode="after")
    def _one_side(self) -> MetricThreshold:
        if (self.above is None) == (self.below is None):
            raise ValueError(
                f"give the threshold of {self.metric} one of above or below "
                "(as in {metric: val_loss, above: 2.5, for: 5m})"
            )
        return self


class AlertThresholds(Section):
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
    #: A NaN or infinite loss stops the run after a flush ("stop"), or only alerts.
    on_nan: Literal["stop", "alert"] = "stop"
    #: A divergence (loss spike or rising trend) nobody acknowledges for this long
    #: stops the run: it is burning budget and producing nothing.
    stop_after: Duration = Field(default=1800.0, gt=0)
    #: A rule firing again this soon after its alert resolved reopens that alert.
    quiet_period: Duration = Field(default=900.0, ge=0)
    #: An alert reopened more than this many times...
    flap_count: int = Field(default=3, ge=1)
    #: ...within this window is flapping: said once, not repeated.
    flap_window: Duration = Field(default=600.0, gt=0)
    #: When a step standing still is a hung run, and whether to stop it.
    hung: HungWatch = HungWatch()
    #: Alerts on reported metrics, each over a value for a while.
    thresholds: list[MetricThreshold] = Field(default_factory=list, max_length=20)


class Notify(Section):
    """Where the run reports."""

    #: Channel for the run's thread; ``None`` is the channel it was launched from.
    channel: str | None = None
    #: Who is paged when a critical alert stays unacknowledged (Slack user group).
    oncall_group: str | None = None


class DryRun(Section):
    """The preflight dry run: a few steps, a checkpoint, a kill, a restore, two more steps."""

    enabled: bool = True
    #: Steps before the checkpoint-and-kill.
    steps: int = Field(default=20, ge=1)
    #: URI of a small data sample; ``None`` uses ``data_uri``.
    sample: str | None = None
    #: On a cloud provider, launch no instance: the check warns with the
    #: ``trainbot-runner dry-run`` command to run on your own machine. (With the local
    #: provider the dry run is always a local process.)
    local: bool = False
    #: The cloud instance type it runs on; ``cpu``: the cheapest CPU type, for a script
    #: that runs without a GPU; ``None``: the cheapest type of the run's accelerator with
    #: the fewest of them (or of CPU types, for a CPU run), from the provider's catalog.
    #: A named type must be on the admin's list (``TRAINBOT_DRY_RUN_INSTANCE_TYPES``),
    #: and any type within ``TRAINBOT_DRY_RUN_MAX_USD_PER_HOUR``; preflight refuses the
    #: rest before launching anything (``jobs.preflight.dry_run_limits``). What the
    #: instance costs counts against the run's budget.
    instance_type: str | None = Field(default=None, max_length=64, pattern=r"^[a-z0-9][a-z0-9.-]*$")
    #: How long preflight waits for the cloud instance's report (boot, install, both
    #: phases) before it fails the check and terminates the instance. The wait holds no
    #: background worker, and ``/train stop`` ends it at once.
    timeout: Duration = Field(default=1800.0, gt=0, le=6 * 3600)


class Profile(Section):
    """Profile the start of a real run on its own instance, project the whole run from
    it, and ask before spending past the budget (the spec's ``profile``).

    The window is ``steps`` steps or ``minutes`` of the first attempt, whichever ends
    first; with neither, one epoch (the command's ``--steps`` divided by its
    ``--epochs``), else a tenth of ``--steps``, else ten minutes.
    """

    enabled: bool = True
    #: Steps to profile, counted from where the attempt starts.
    steps: int | None = Field(default=None, ge=1)
    #: Minutes of the attempt to profile, counted from its launch.
    minutes: float | None = Field(default=None, gt=0, le=24 * 60)
    #: Stop at a checkpoint and ask (Continue or Stop) when the projection passes the
    #: budget or ``max_hours``, or the input pipeline starves the device; ``false`` only
    #: posts the projection.
    ask: bool = True


class Debug(Section):
    """Help for looking into a failure (the spec's ``debug``)."""

    #: Keep a failed attempt's instance running this long (``30m``) for a person to
    #: connect to, instead of terminating it; billed as the attempt was. Preemptions and
    #: stops are never kept. At most the admin's ``TRAINBOT_KEEP_FAILED_INSTANCE_MAX_S``
    #: (seconds); ``None`` or 0: off.
    keep_failed_instance: Duration | None = Field(default=None, ge=0, le=7 * 24 * 3600)

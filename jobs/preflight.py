"""Preflight: the five questions that end runs early, asked before anything is paid for.

Quota, capacity, data locality, a real checkpoint round trip, and cost. Each check is a
small object behind :class:`Check`; it returns a :class:`CheckResult` that says what it
found (with figures) and, when it warns or fails, what to do. Checks run in order and
see the results before them (the budget needs the dry run's step time), so a check that
cannot answer says so instead of guessing.

Nothing here formats chat text or touches the database: :func:`run_preflight` returns a
:class:`PreflightReport`, the service decides the run's next state from ``ok`` and
``needs_confirmation``, and :meth:`PreflightReport.to_message` hands the front ends data.

The runner (and so torch) is imported only when a dry run or Daly's formula is needed,
so the control plane imports this module without the ``runner`` extra.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote, urlparse

from jobs.errors import TrainbotError
from jobs.format import duration, size, usd
from jobs.notify import CheckLine, PreflightMessage
from jobs.providers.base import (
    PASSTHROUGH_ENV,
    Provider,
    ProviderError,
    ResourceRequest,
    ZoneCapacity,
)
from jobs.providers.local import REGION as LOCAL_REGION
from jobs.spec import JobSpec
from runner.errors import RunnerError
from runner.preemption import IntervalChoice, choose_interval

if TYPE_CHECKING:
    from runner.dryrun import DryRunReport

__all__ = [
    "DEFAULT_REGIONS",
    "DEFAULT_SPOT_MTBP_S",
    "DRY_RUN_PID_FILE",
    "BudgetCheck",
    "CapacityCheck",
    "Check",
    "CheckResult",
    "DataLocalityCheck",
    "DryRunCheck",
    "PreflightContext",
    "PreflightReport",
    "QuotaCheck",
    "Status",
    "assumed_mtbp_s",
    "checkpoint_interval",
    "default_checks",
    "dry_run_command",
    "interval_choice",
    "resource_request",
    "run_preflight",
    "target_steps",
]

log = logging.getLogger(__name__)

#: Mean time between preemptions assumed for spot capacity when nothing better is known.
#: Published spot interruption rates are mostly under 5 % a month per instance, but the
#: GPU types people want are reclaimed far more often; 6 hours keeps Daly's interval short.
DEFAULT_SPOT_MTBP_S = 6 * 3600.0

#: The region a run goes to when its spec names none. The Provider protocol answers
#: quota and capacity for one region at a time, so "pick a region" means this default.
DEFAULT_REGIONS: Mapping[str, str] = {
    "local": LOCAL_REGION,
    "aws": "us-east-1",
    "gcp": "us-central1",
}

#: In a run's preflight directory: the running dry run's process group, so a control
#: plane restarted after a crash can end it (``runner.dryrun.end_stale_dry_run``).
DRY_RUN_PID_FILE = "dry-run.pid"

#: Command-line flags whose value is the run's total number of steps (argparse style).
_STEP_FLAGS = ("--steps", "--max-steps", "--max_steps")


class Status(str, enum.Enum):
    """A check's verdict. WARN waits for a person to say "launch anyway"."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class CheckResult:
    """One check's answer, written for the person deciding whether to launch."""

    #: "quota", "capacity", "data", "dry_run", "budget".
    name: str
    status: Status
    #: What was found, with figures.
    detail: str
    #: What to do; always set when the status is WARN or FAIL.
    remedy: str = ""
    #: Figures for later checks and the report; JSON-able.
    data: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status is not Status.PASS and not self.remedy.strip():
            raise ValueError(f"the {self.name} check gave {self.status.value} without a remedy")

    def as_dict(self) -> dict[str, Any]:
        """The result as JSON-able data, for the journal's ``preflight_check`` event."""
        return {
            "name": self.name,
            "status": self.status.value,
            "detail": self.detail,
            "remedy": self.remedy,
            "data": dict(self.data),
        }


@dataclass(frozen=True)
class PreflightContext:
    """What every check of one run's preflight shares."""

    spec: JobSpec
    run_id: str
    provider: Provider
    #: The spec's resources in the provider's vocabulary (see :func:`resource_request`).
    request: ResourceRequest
    #: Root of the real checkpoint store; the dry run writes under ``{run_id}-dry-run``.
    checkpoint_uri: str
    #: Mean seconds between preemptions assumed for the provider (see :func:`assumed_mtbp_s`).
    mtbp_s: float
    #: Environment for the dry run's process on top of a minimal one (``PYTHONPATH`` …).
    env: Mapping[str, str]
    #: Where dry-run scratch goes.
    workdir: Path

    def __post_init__(self) -> None:
        if not self.mtbp_s > 0 or not math.isfinite(self.mtbp_s):
            raise ValueError(f"mtbp_s must be a positive number of seconds (got {self.mtbp_s})")

    @property
    def dry_run_id(self) -> str:
        """The dry run's namespace in the checkpoint store, apart from the run's own."""
        return f"{self.run_id}-dry-run"


class Check(Protocol):
    """One preflight question."""

    name: str

    def run(self, ctx: PreflightContext, *, prior: Mapping[str, CheckResult]) -> CheckResult:
        """Answer it; ``prior`` holds the results of the checks that ran before, by name."""
        ...


# -- quota and capacity ------------------------------------------------------------------


class QuotaCheck:
    """The quota for the exact type in the exact region covers the request.

    New cloud accounts start with a GPU quota of 0, and raising it takes days, so this
    is the first thing to know.
    """

    name: str = "quota"

    def run(self, ctx: PreflightContext, *, prior: Mapping[str, CheckResult]) -> CheckResult:
        quota = ctx.provider.quota(ctx.request)
        data = asdict(quota)
        if quota.ok:
            return CheckResult(self.name, Status.PASS, quota.detail, data=data)
        what = _describe_request(ctx.request)
        return CheckResult(
            self.name,
            Status.FAIL,
            f"{quota.detail} — not enough for {what} "
            f"({quota.used:g} used + {quota.needed:g} needed > limit {quota.limit:g} {quota.unit})",
            quota.remedy
            or f"raise the {quota.unit} quota in {ctx.request.region}, or ask for fewer",
            data=data,
        )


class CapacityCheck:
    """Which zones offer the type now, ranked: capacity is a separate question from quota.

    With ``resources.on_demand_fallback`` and no spot capacity anywhere, it asks again
    for on-demand capacity and warns that the run will pay on-demand prices. Where the
    provider can ask whether a launch in the best zone would be allowed without starting
    anything (``check_launch_permissions``, EC2's ``DryRun``), it asks: a missing
    credential or IAM permission found here costs a minute, found at launch a failed run.
    """

    name: str = "capacity"

    def run(self, ctx: PreflightContext, *, prior: Mapping[str, CheckResult]) -> CheckResult:
        req = ctx.request
        zones = ctx.provider.capacity(req)
        available = _ranked(zones)
        what = _describe_request(req)
        if not available and req.spot and ctx.spec.resources.on_demand_fallback:
            on_demand = ctx.provider.capacity(replace(req, spot=False))
            ranked = _ranked(on_demand)
            refused = self._launch_refused(ctx, replace(req, spot=False), on_demand)
            if refused is not None:
                return refused
            if ranked:
                names = ", ".join(z.zone for z in ranked)
                return CheckResult(
                    self.name,
                    Status.WARN,
                    f"no zone of {req.region} has spot capacity for {what} now; "
                    f"on-demand capacity in {names}",
                    "launch anyway to run on demand at on-demand prices (the budget check "
                    "uses them), or wait and run preflight again for spot capacity",
                    data=_capacity_data(on_demand, ranked, on_demand=True),
                )
        if not available:
            found = "; ".join(f"{z.zone}: {z.detail}" for z in zones if z.detail) or "none listed"
            return CheckResult(
                self.name,
                Status.FAIL,
                f"no zone of {req.region} offers {what} now ({found}); capacity is a separate "
                "question from quota: a quota that allows it does not mean a zone has it free",
                "try again later, list other zones or another region in resources.region/"
                "resources.zones, pick another accelerator type, or set "
                "resources.on_demand_fallback=true",
                data=_capacity_data(zones, available, on_demand=False),
            )
        refused = self._launch_refused(ctx, req, zones)
        if refused is not None:
            return refused
        data = _capacity_data(zones, available, on_demand=False)
        listing = ", ".join(_zone_text(z) for z in available)
        missing = [z for z in req.zones if z not in {a.zone for a in available}]
        if missing:
            return CheckResult(
                self.name,
                Status.WARN,
                f"{what}: only {listing} of the requested zones "
                f"{', '.join(req.zones)} offer it now; {', '.join(missing)} do not",
                f"the launch will use {available[0].zone}; drop {', '.join(missing)} from "
                "resources.zones, or leave zones empty to let the ranking choose",
                data=data,
            )
        return CheckResult(
            self.name, Status.PASS, f"{what} available now in {listing} (best first)", data=data
        )

    def _launch_refused(
        self, ctx: PreflightContext, req: ResourceRequest, zones: Sequence[ZoneCapacity]
    ) -> CheckResult | None:
        """A FAIL when the provider says a launch in the best zone would be refused."""
        ranked = _ranked(zones)
        if not ctx.provider.capabilities.permission_probe or not ranked:
            return None
        try:
            ctx.provider.check_launch_permissions(req, zone=ranked[0].zone)
        except ProviderError as exc:
            return CheckResult(
                self.name,
                Status.FAIL,
                f"{_describe_request(req)} is available in {ranked[0].zone}, but a launch "
                f"there would be refused: {exc}",
                "grant the control plane what the message names, then run preflight again",
                data={
                    **_capacity_data(zones, ranked, on_demand=not req.spot),
                    "launch_refused": str(exc),
                },
            )
        return None


def _ranked(zones: Sequence[ZoneCapacity]) -> list[ZoneCapacity]:
    """Available zones, highest score first; the provider's order breaks ties."""
    available = [z for z in zones if z.available]
    return sorted(available, key=lambda z: -z.score if z.score is not None else math.inf)


def _capacity_data(
    zones: Sequence[ZoneCapacity], ranked: Sequence[ZoneCapacity], *, on_demand: bool
) -> dict[str, Any]:
    return {
        "zones": [z.zone for z in ranked],
        "all": [asdict(z) for z in zones],
        "on_demand": on_demand,
    }


def _zone_text(zone: ZoneCapacity) -> str:
    return zone.zone if zone.score is None else f"{zone.zone} (score {zone.score:g})"


# -- data locality -----------------------------------------------------------------------


class DataLocalityCheck:
    """The dataset is in the accelerators' region.

    Reading a dataset across regions is slow (the GPUs wait on input) and billed per
    gigabyte, every epoch. A local path is checked for existence only when the provider's
    instances run on this machine: with a cloud provider the control plane never looks at
    its own disk for a path from a spec, which would tell a chat user what files it has.
    Relative paths are taken from the control plane's working directory, where local
    instances start.
    """

    name: str = "data"

    def run(self, ctx: PreflightContext, *, prior: Mapping[str, CheckResult]) -> CheckResult:
        uri = ctx.spec.data_uri
        if uri is None:
            return CheckResult(self.name, Status.PASS, "no dataset declared (data_uri is unset)")
        region = ctx.request.region
        data: dict[str, Any] = {"uri": uri, "region": region}
        parsed = urlparse(uri)
        if parsed.scheme in ("", "file"):
            path = Path(unquote(parsed.path) if parsed.scheme == "file" else uri)
            if not ctx.provider.capabilities.runs_on_this_machine:
                data["path"] = str(path)
                return CheckResult(
                    self.name,
                    Status.WARN,
                    f"data_uri {uri} is a path on the instance; it cannot be checked from here",
                    f"make sure the {ctx.provider.name} image has {path}, or stage the data "
                    f"into a bucket in {region} and set data_uri to it",
                    data=data,
                )
            path = path.expanduser()
            data["path"] = str(path)
            if not path.exists():
                return CheckResult(
                    self.name,
                    Status.FAIL,
                    f"the dataset path {path.resolve()} does not exist on this machine",
                    f"create or copy the data to {path.resolve()}, or fix data_uri in the spec",
                    data=data,
                )
            return CheckResult(
                self.name, Status.PASS, f"dataset {path} is on this machine", data=data
            )
        bucket_region = ctx.provider.bucket_region(uri)
        data["bucket_region"] = bucket_region
        if bucket_region is None:
            return CheckResult(
                self.name,
                Status.WARN,
                f"cannot tell which region holds {uri} (the {ctx.provider.name} provider "
                "cannot see that bucket)",
                f"check that {uri} is in {region}; if not, stage the data into a bucket in "
                f"{region} to avoid cross-region reads",
                data=data,
            )
        if bucket_region != region:
            return CheckResult(
                self.name,
                Status.FAIL,
                f"the dataset {uri} is in {bucket_region} but the accelerators run in "
                f"{region}: every read would cross regions (slow, and billed per GB)",
                f"stage the data into a bucket in {region} and point data_uri at it, or set "
                f"resources.region={bucket_region} if the accelerators are available there",
                data=data,
            )
        return CheckResult(self.name, Status.PASS, f"dataset {uri} is in {region}", data=data)


# -- dry run -----------------------------------------------------------------------------


class DryRunCheck:
    """The real command through a checkpoint round trip, where the provider allows it.

    Only a provider whose instances run on this machine (``capabilities.
    runs_on_this_machine``: the local provider) gets a dry run here, on this machine's CPU.
    With a cloud provider the control plane runs nothing: its machine holds the Slack
    secrets, the cloud credentials and the database, and the command comes from chat.
    Until dry runs go to a cheap cloud instance, the check then warns with the exact
    ``trainbot-runner dry-run`` command a person can run on their own machine, and the
    budget and the checkpoint interval do without its figures, as with
    ``dry_run.enabled=false``. ``dry_run.local`` cannot change that.

    Where it runs, it runs ``spec.dry_run.steps`` steps, commits a checkpoint to the real
    store under ``{run_id}-dry-run``, is killed, restored, verified bit-identical and run
    two more steps (``runner.dryrun``). The process gets the spec's ``env``, the context's
    ``env``, ``TRAINBOT_DATA_URI`` (``dry_run.sample``, else ``data_uri``) so a script can
    read a small sample, and ``TRAINBOT_SCRATCH_DIR`` under the context's workdir. The
    directory of this interpreter comes first on ``PATH``, so ``python`` in a command is
    the one that has the runner installed. On success the dry-run checkpoints are deleted;
    on failure they are kept for inspection.
    """

    name: str = "dry_run"

    def __init__(self, *, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s

    def run(self, ctx: PreflightContext, *, prior: Mapping[str, CheckResult]) -> CheckResult:
        settings = ctx.spec.dry_run
        if not settings.enabled:
            return CheckResult(
                self.name,
                Status.WARN,
                "the dry run is disabled (dry_run.enabled=false): checkpoint and restore are "
                "untested, and there is no step time for the cost estimate",
                "set dry_run.enabled=true, unless this command is known to restore correctly",
                data={"skipped": True},
            )
        if not ctx.provider.capabilities.runs_on_this_machine:
            return self._not_here(ctx)
        try:
            from runner.dryrun import run_dry_run
        except ImportError as exc:
            return CheckResult(
                self.name,
                Status.FAIL,
                f"the dry run cannot start here: {exc}",
                "install the runner's dependencies next to the control plane "
                "(pip install 'trainbot[runner]'), or set dry_run.enabled=false",
            )
        try:
            report = run_dry_run(
                ctx.spec.command,
                checkpoint_uri=ctx.checkpoint_uri,
                run_id=ctx.dry_run_id,
                steps=settings.steps,
                mtbp_s=ctx.mtbp_s,
                timeout_s=self.timeout_s,
                env=self._environment(ctx),
                log_path=ctx.workdir / "dry-run.log",
                pid_file=ctx.workdir / DRY_RUN_PID_FILE,
            )
        except RunnerError as exc:
            return CheckResult(
                self.name,
                Status.FAIL,
                f"the dry run could not start: {exc}",
                f"check that the checkpoint store {ctx.checkpoint_uri} is reachable and "
                "writable from the control plane, then run preflight again",
            )
        result = self.evaluate(report, ctx)
        if result.status is not Status.FAIL:
            self._clean_up(ctx)
        return result

    def _not_here(self, ctx: PreflightContext) -> CheckResult:
        """The WARN for a provider whose instances are elsewhere: what a person can run."""
        command = dry_run_command(ctx)
        names = ", ".join(sorted(ctx.spec.env))
        with_env = f", with the spec's env ({names}) set as the run has it" if names else ""
        return CheckResult(
            self.name,
            Status.WARN,
            f"the dry run did not run: with the {ctx.provider.name} provider the control "
            "plane never runs a spec's command on its own machine, and dry runs on a cloud "
            "instance are not available yet; checkpoint and restore are untested, and there "
            "is no step time for the cost estimate",
            "run the dry run on your own machine, with the runner installed and access to "
            f"the checkpoint store: `{command}`{with_env}; launch anyway once it passes",
            data={"skipped": True, "reason": "not_on_this_machine", "command": command},
        )

    def evaluate(self, report: DryRunReport, ctx: PreflightContext) -> CheckResult:
        """Judge a dry run's report for this context's provider (its termination window)."""
        data: dict[str, Any] = asdict(report)
        where = f"{ctx.checkpoint_uri.rstrip('/')}/{ctx.dry_run_id}"
        data["store"] = where
        if not report.ok:
            problems = "; ".join(report.problems) or "it did not complete"
            return CheckResult(
                self.name,
                Status.FAIL,
                f"the dry run of `{' '.join(ctx.spec.command)}` failed: {problems}",
                "fix the training script so it saves and restores all of its state through "
                "the session API (runner.session.Session), run it with `trainbot-runner "
                f"dry-run -- …` until it passes, then run preflight again; its checkpoints "
                f"are kept in {where}",
                data=data,
            )
        window = _termination_window_s(ctx)
        fits = _emergency_fits(report, window) if window is not None else None
        choice = interval_choice(
            write_s=report.write_s,
            stall_s=report.stall_s,
            mtbp_s=ctx.mtbp_s,
            flush_fits_window=bool(fits),
        )
        interval = checkpoint_interval(
            ctx.spec,
            write_s=report.write_s,
            stall_s=report.stall_s,
            mtbp_s=ctx.mtbp_s,
            flush_fits_window=bool(fits),
        )
        data["interval_s"] = interval
        if choice is not None:
            data["interval_cost_s"] = choice.cost_s
            data["interval_mtbp_s"] = choice.mtbp_s
            data["interval_floor_s"] = choice.floor_s
        stall = f", stalling the loop {duration(report.stall_s)}" if report.stall_s else ""
        figures = (
            f"{report.steps_before_kill} steps at {duration(report.step_time_s)} a step; "
            f"checkpoint {size(report.checkpoint_bytes)} written in {duration(report.write_s)}"
            f"{stall}, restored bit-identical in {duration(report.restore_s)}; "
            f"checkpoint interval {_interval_text(ctx.spec, interval, choice)}"
        )
        if window is None:
            return CheckResult(self.name, Status.PASS, figures, data=data)
        data["termination_window_s"] = window
        data["emergency_fits_window"] = fits
        if fits:
            return CheckResult(
                self.name,
                Status.PASS,
                f"{figures}; an emergency checkpoint fits the {duration(window)} "
                "termination window",
                data=data,
            )
        return CheckResult(
            self.name,
            Status.WARN,
            f"{figures}; an emergency checkpoint of {size(report.checkpoint_bytes)} does not "
            f"fit the {ctx.provider.name} provider's {duration(window)} termination window, so a "
            "preemption loses the work since the last scheduled checkpoint",
            "make checkpoints smaller (shard them, drop what can be recomputed) or faster "
            "(a store in the same region), or accept losing up to one checkpoint interval "
            "per preemption",
            data=data,
        )

    @staticmethod
    def _environment(ctx: PreflightContext) -> dict[str, str]:
        env = {k: os.environ[k] for k in PASSTHROUGH_ENV if k in os.environ}
        interpreter_dir = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join(p for p in (interpreter_dir, env.get("PATH")) if p)
        env.update(ctx.spec.env)
        env.update(ctx.env)
        sample = ctx.spec.dry_run.sample or ctx.spec.data_uri
        if sample:
            env["TRAINBOT_DATA_URI"] = sample
        scratch = ctx.workdir / ctx.dry_run_id
        scratch.mkdir(parents=True, exist_ok=True)
        env["TRAINBOT_SCRATCH_DIR"] = str(scratch)
        return env

    @staticmethod
    def _clean_up(ctx: PreflightContext) -> None:
        """Delete the dry run's checkpoints: nobody resumes from them, and they cost storage."""
        from runner.checkpoint import delete_steps, scan
        from runner.store import run_store

        try:
            store = run_store(ctx.checkpoint_uri, ctx.dry_run_id)
            found = scan(store)
            delete_steps(store, found, set(found.objects))
        except RunnerError as exc:
            log.warning("run %s: could not delete the dry run's checkpoints: %s", ctx.run_id, exc)


def dry_run_command(ctx: PreflightContext) -> str:
    """The shell command that runs this context's dry run: the spec's command, quoted,
    after ``trainbot-runner dry-run``'s flags, with the data sample the dry run would get.

    The spec's ``env`` is left out: its values may be tokens, and this text is posted in
    the run's thread; the caller names the variables instead.
    """
    settings = ctx.spec.dry_run
    sample = settings.sample or ctx.spec.data_uri
    prefix = ["env", f"TRAINBOT_DATA_URI={sample}"] if sample else []
    return shlex.join(
        [
            *prefix,
            "trainbot-runner",
            "dry-run",
            "--steps",
            str(settings.steps),
            "--mtbp",
            f"{ctx.mtbp_s:g}",
            "--checkpoint-uri",
            ctx.checkpoint_uri,
            "--run-id",
            ctx.dry_run_id,
            "--",
            *ctx.spec.command,
        ]
    )


def _termination_window_s(ctx: PreflightContext) -> float | None:
    """Seconds between the provider's preemption notice and the kill; None when unknown.

    The provider's own figure, else the runner's default for a cloud of the provider's
    name (what the runner on its instances assumes); never the spec's ``resources.cloud``.
    """
    return ctx.provider.capabilities.termination_window_s


def _emergency_fits(report: DryRunReport, window_s: float) -> bool:
    from runner.preemption import flush_fits

    nbytes = report.checkpoint_bytes or 0
    write_s = report.write_s or 0.0
    return flush_fits(
        nbytes=nbytes,
        bandwidth_bps=nbytes / write_s if write_s > 0 else None,
        time_left_s=window_s,
    )


def interval_choice(
    *,
    write_s: float | None,
    stall_s: float | None,
    mtbp_s: float,
    flush_fits_window: bool,
) -> IntervalChoice | None:
    """The ``"auto"`` interval and its figures (:func:`runner.preemption.choose_interval`):
    Daly's √(2CM) − C with C the stall of a save (the writer is asynchronous), floored at
    the write time, and M the mean time between preemptions that lose work. None without
    a measured write time."""
    if write_s is None or not write_s > 0:
        return None
    return choose_interval(
        write_s=write_s, stall_s=stall_s, mtbp_s=mtbp_s, flush_fits_window=flush_fits_window
    )


def checkpoint_interval(
    spec: JobSpec,
    *,
    write_s: float | None,
    mtbp_s: float,
    stall_s: float | None = None,
    flush_fits_window: bool = False,
) -> float | None:
    """Seconds between checkpoints: the spec's, or for ``"auto"`` :func:`interval_choice`'s.

    ``None`` when the spec says ``"auto"`` and there is no measured write time. Without a
    measured stall, C is the write time (a synchronous save).
    """
    fixed = spec.checkpoint.interval_s
    if fixed is not None:
        return fixed
    choice = interval_choice(
        write_s=write_s, stall_s=stall_s, mtbp_s=mtbp_s, flush_fits_window=flush_fits_window
    )
    return None if choice is None else choice.interval_s


def _interval_text(spec: JobSpec, interval: float | None, choice: IntervalChoice | None) -> str:
    if interval is None:
        return "unknown (no checkpoint time measured)"
    if spec.checkpoint.interval_s is not None or choice is None:
        return f"{duration(interval)} (from the spec)"
    floor = " (the write time: one save at a time)" if interval <= choice.floor_s else ""
    return (
        f"{duration(interval)}{floor}: Daly's optimum for {duration(choice.cost_s)} lost per "
        f"save and a preemption losing work every {duration(choice.mtbp_s)}"
    )


# -- budget ------------------------------------------------------------------------------


class BudgetCheck:
    """The estimated cost against ``budget.usd``; the estimate becomes the alert budget.

    Estimate = price × instances × expected hours. The price is the provider's spot price
    (on-demand when the run is not spot, or falls back to it) in the best zone found by
    the capacity check. Expected hours come from the dry run's step time × the target
    steps, read from the command's ``--steps N`` (or ``--max-steps``); the spec has no
    step count of its own. To that is added the first-order overhead of checkpointing and
    preemptions (Daly): C/τ for writing, and (τ/2 + R)/M of work redone after each
    preemption on spot, for interval τ, write time C, restore time R and mean time between
    preemptions M. ``max_hours`` caps the hours, and stands in for them (an upper bound)
    when the command gives no step count or there is no step time. The step time comes
    from a CPU dry run, so for GPU runs the estimate is conservative.
    """

    name: str = "budget"

    def run(self, ctx: PreflightContext, *, prior: Mapping[str, CheckResult]) -> CheckResult:
        spec = ctx.spec
        dry = prior.get("dry_run")
        dry_data = dry.data if dry is not None and dry.status is not Status.FAIL else {}
        capacity = prior.get("capacity")
        zones = list(capacity.data.get("zones", [])) if capacity is not None else []
        on_demand = not ctx.request.spot or (
            capacity is not None and bool(capacity.data.get("on_demand"))
        )
        quote = ctx.provider.price(ctx.request, zone=zones[0] if zones else None)
        hourly = quote.on_demand_usd_per_hour if on_demand else quote.spot_usd_per_hour
        instances = spec.resources.instances
        interval = _number(dry_data.get("interval_s"))
        if interval is None:
            interval = checkpoint_interval(
                spec, write_s=_number(dry_data.get("write_s")), mtbp_s=ctx.mtbp_s
            )
        hours, basis = self._expected_hours(ctx, dry_data, interval=interval, spot=not on_demand)
        estimate = None if hours is None else hourly * instances * hours
        cap_usd = None if spec.max_hours is None else hourly * instances * spec.max_hours
        kind = "on-demand" if on_demand else "spot"
        price_text = f"{usd(hourly)}/h {kind} × {instances} instance(s)"
        data: dict[str, Any] = {
            "estimate_usd": estimate,
            "expected_hours": hours,
            "usd_per_hour": hourly,
            "price_kind": kind,
            "price_source": quote.source,
            "instances": instances,
            "interval_s": interval,
            "max_hours_usd": cap_usd,
            "budget_usd": spec.budget.usd,
            "basis": basis,
        }
        budget = spec.budget.usd
        if estimate is None:
            detail = f"cannot estimate the cost ({basis}); price {price_text}"
            if budget is not None:
                return CheckResult(
                    self.name,
                    Status.PASS,
                    f"{detail}; budget.usd {usd(budget)} alerts at {_percentages(spec)}",
                    data=data,
                )
            return CheckResult(
                self.name,
                Status.WARN,
                f"{detail}; no budget.usd either, so nothing alerts on spend",
                "set budget.usd, or give the command --steps N or the spec max_hours so "
                "preflight can estimate the cost and alert on it",
                data=data,
            )
        detail = f"estimate {usd(estimate)}: {price_text} × {hours:.2f} h ({basis})"
        if budget is None:
            return CheckResult(
                self.name,
                Status.PASS,
                f"{detail}; no budget.usd, so the estimate becomes the run's budget alert "
                f"({_percentages(spec)})",
                data=data,
            )
        warnings: list[str] = []
        remedies: list[str] = []
        if estimate > budget:
            stop = math.floor(100 * budget / estimate)
            warnings.append(f"the estimate is above budget.usd {usd(budget)}")
            if spec.budget.hard_cap:
                remedies.append(
                    f"raise budget.usd to at least {usd(estimate)}, or expect the hard cap to "
                    f"stop the run at about {stop}% of its work"
                )
            else:
                remedies.append(
                    f"raise budget.usd to at least {usd(estimate)}: without a hard cap the run "
                    "will overspend, with alerts only"
                )
        if cap_usd is not None and cap_usd > budget and not math.isclose(cap_usd, estimate):
            warnings.append(
                f"max_hours {spec.max_hours:g} h allows {usd(cap_usd)}, above budget.usd "
                f"{usd(budget)}"
            )
            remedies.append(
                f"lower max_hours to {budget / (hourly * instances):.1f} h or raise budget.usd "
                f"to {usd(cap_usd)} so the two limits agree"
            )
        if warnings:
            return CheckResult(
                self.name,
                Status.WARN,
                f"{detail}; " + "; ".join(warnings),
                "; ".join(remedies),
                data=data,
            )
        return CheckResult(
            self.name,
            Status.PASS,
            f"{detail}; within budget.usd {usd(budget)} ({100 * estimate / budget:.0f}%)",
            data=data,
        )

    @staticmethod
    def _expected_hours(
        ctx: PreflightContext,
        dry_data: Mapping[str, Any],
        *,
        interval: float | None,
        spot: bool,
    ) -> tuple[float | None, str]:
        """Hours the run is expected to take, and how that was worked out, in words."""
        spec = ctx.spec
        steps = target_steps(spec.command)
        step_time = _number(dry_data.get("step_time_s"))
        if steps is None or step_time is None:
            missing = "no --steps N in the command" if steps is None else "no dry-run step time"
            if spec.max_hours is None:
                return None, f"{missing} and no max_hours"
            return spec.max_hours, f"{missing}: max_hours as the upper bound"
        write_s = _number(dry_data.get("write_s")) or 0.0
        cost_s = _number(dry_data.get("interval_cost_s")) or write_s
        lossy_mtbp_s = _number(dry_data.get("interval_mtbp_s")) or ctx.mtbp_s
        restore_s = _number(dry_data.get("restore_s")) or 0.0
        flush_s = write_s if dry_data.get("emergency_fits_window") else 0.0
        overhead = 0.0
        if interval is not None and interval > 0:
            overhead += cost_s / interval
            if spot:
                # Every preemption costs a flush (if it fits) and a restore; those that
                # lose work also lose half an interval on average.
                overhead += (flush_s + restore_s) / ctx.mtbp_s + interval / 2 / lossy_mtbp_s
        hours = steps * step_time * (1 + overhead) / 3600
        basis = (
            f"{steps} steps × {duration(step_time)} from the dry run, "
            f"+{100 * overhead:.1f}% for checkpoints and preemptions"
        )
        if spec.max_hours is not None and hours > spec.max_hours:
            return spec.max_hours, f"{basis}, capped by max_hours"
        return hours, basis


def target_steps(command: Sequence[str]) -> int | None:
    """The run's total steps from ``--steps N`` / ``--steps=N`` (last one wins), if given."""
    found: int | None = None
    for i, arg in enumerate(command):
        flag, eq, value = arg.partition("=")
        if flag not in _STEP_FLAGS:
            continue
        if not eq:
            value = command[i + 1] if i + 1 < len(command) else ""
        try:
            steps = int(value)
        except ValueError:
            continue
        if steps > 0:
            found = steps
    return found


# -- running them ------------------------------------------------------------------------


def default_checks(*, dry_run_timeout_s: float = 600.0) -> list[Check]:
    """The five checks, in the order their answers are needed."""
    return [
        QuotaCheck(),
        CapacityCheck(),
        DataLocalityCheck(),
        DryRunCheck(timeout_s=dry_run_timeout_s),
        BudgetCheck(),
    ]


@dataclass(frozen=True)
class PreflightReport:
    """Every check's result, and the figures the service keeps for the run."""

    results: tuple[CheckResult, ...]
    #: The budget check's cost estimate (USD), the run's alert budget without budget.usd.
    estimate_usd: float | None = None
    #: The chosen checkpoint interval in seconds (the spec's, or Daly's for "auto").
    interval_s: float | None = None
    #: Hours the estimate assumes.
    expected_hours: float | None = None

    @property
    def ok(self) -> bool:
        """No check failed."""
        return all(r.status is not Status.FAIL for r in self.results)

    @property
    def needs_confirmation(self) -> bool:
        """Nothing failed, but a warning waits for a person's "launch anyway"."""
        return self.ok and any(r.status is Status.WARN for r in self.results)

    def result(self, name: str) -> CheckResult | None:
        """The named check's result, if it ran."""
        return next((r for r in self.results if r.name == name), None)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form, to store on the run."""
        return {
            "ok": self.ok,
            "needs_confirmation": self.needs_confirmation,
            "estimate_usd": self.estimate_usd,
            "interval_s": self.interval_s,
            "expected_hours": self.expected_hours,
            "results": [r.as_dict() for r in self.results],
        }

    def to_message(self, *, channel: str, thread_ts: str | None, run_id: str) -> PreflightMessage:
        """The report as the message the front ends render in the run's thread."""
        return PreflightMessage(
            channel=channel,
            thread_ts=thread_ts,
            run_id=run_id,
            checks=tuple(
                CheckLine(name=r.name, status=r.status.value, detail=r.detail, remedy=r.remedy)
                for r in self.results
            ),
            ok=self.ok,
            needs_confirmation=self.needs_confirmation,
            estimate_usd=self.estimate_usd,
            interval_s=self.interval_s,
        )


def run_preflight(
    ctx: PreflightContext,
    checks: Sequence[Check] | None = None,
    *,
    on_result: Callable[[CheckResult], None] | None = None,
) -> PreflightReport:
    """Run every check in order, so the person sees all the problems at once.

    A check that raises becomes a FAIL carrying the error's message (the traceback goes
    to the log, never to the user). ``on_result`` is called after each check, for
    progress and the journal's ``preflight_check`` events.
    """
    results: dict[str, CheckResult] = {}
    ordered: list[CheckResult] = []
    for check in default_checks() if checks is None else checks:
        try:
            result = check.run(ctx, prior=dict(results))
        except Exception as exc:  # any failure of a check is reported as a FAIL
            result = _crashed(check.name, exc, run_id=ctx.run_id)
        results[result.name] = result
        ordered.append(result)
        if on_result is not None:
            on_result(result)
    budget = results.get("budget")
    dry = results.get("dry_run")
    interval = _number(budget.data.get("interval_s")) if budget is not None else None
    if interval is None and dry is not None:
        interval = _number(dry.data.get("interval_s"))
    if interval is None:
        interval = ctx.spec.checkpoint.interval_s
    return PreflightReport(
        results=tuple(ordered),
        estimate_usd=_number(budget.data.get("estimate_usd")) if budget is not None else None,
        interval_s=interval,
        expected_hours=_number(budget.data.get("expected_hours")) if budget is not None else None,
    )


def _crashed(name: str, exc: Exception, *, run_id: str) -> CheckResult:
    if isinstance(exc, (TrainbotError, RunnerError)):
        log.warning("run %s: preflight check %s failed: %s", run_id, name, exc)
        remedy = "fix what the message says, then run preflight again"
    else:
        log.exception("run %s: preflight check %s crashed", run_id, name)
        remedy = (
            "this looks like a bug or an outage: run preflight again, and if it repeats, "
            "report it with the control plane's log"
        )
    message = str(exc).strip() or type(exc).__name__
    return CheckResult(
        name, Status.FAIL, f"the {name} check could not finish: {message}", remedy, data={}
    )


# -- building a context ------------------------------------------------------------------


def resource_request(spec: JobSpec, *, spot: bool | None = None) -> ResourceRequest:
    """The spec's resources in the provider's terms; no region means the cloud's default.
    ``spot`` overrides the spec's market (an on-demand fallback attempt)."""
    res = spec.resources
    acc = res.accelerator
    return ResourceRequest(
        cloud=res.cloud,
        region=res.region or DEFAULT_REGIONS[res.cloud],
        zones=tuple(res.zones),
        accelerator_type=acc.type if acc is not None else None,
        accelerator_count=acc.count if acc is not None else 0,
        instance_type=res.instance_type,
        spot=res.spot if spot is None else spot,
    )


def assumed_mtbp_s(provider: Provider) -> float:
    """Mean seconds between preemptions to plan for: the provider's declared mean (the
    local provider's configured one), else :data:`DEFAULT_SPOT_MTBP_S`."""
    return provider.capabilities.mean_time_between_preemptions_s or DEFAULT_SPOT_MTBP_S


# -- formatting --------------------------------------------------------------------------


def _describe_request(req: ResourceRequest) -> str:
    if req.accelerator_count > 0:
        thing = f"{req.accelerator_count} × {req.accelerator_type or 'GPU'}"
    elif req.instance_type:
        thing = req.instance_type
    else:
        thing = f"{req.cpus or 1} CPU core(s)"
    return f"{thing} ({'spot' if req.spot else 'on-demand'}, {req.region})"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _percentages(spec: JobSpec) -> str:
    return "/".join(str(p) for p in spec.budget.thresholds) + " %"

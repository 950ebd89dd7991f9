"""The dry run check: the real command through a checkpoint round trip.

Only a provider whose instances run on this machine gets a dry run here, as a local
process; with a cloud provider the control plane runs nothing from a spec and launches a
cheap instance for it instead (:mod:`jobs.preflight.cloud_dry_run`), or, with
``dry_run.local=true``, warns with the exact ``trainbot-runner dry-run`` command a
person can run (:func:`dry_run_command`).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.domain.format import duration, size
from jobs.preflight.findings import DryRunFindings
from jobs.preflight.interval import checkpoint_interval, interval_choice, interval_text
from jobs.preflight.report import CheckResult, PreflightContext, PreflightPlan, Status
from jobs.providers.base import PASSTHROUGH_ENV
from jobs.spec.env import code_env, secrets_env
from runner.errors import RunnerError
from runner.preemption import flush_fits

if TYPE_CHECKING:
    from runner.dryrun_report import DryRunReport

__all__ = ["DRY_RUN_PID_FILE", "DryRunCheck", "dry_run_command"]

log = logging.getLogger(__name__)

#: In a run's preflight directory: the running dry run's process group, so a control
#: plane restarted after a crash can end it (``runner.dryrun.end_stale_dry_run``).
DRY_RUN_PID_FILE = "dry-run.pid"


class DryRunCheck:
    """The real command through a checkpoint round trip.

    ``dry_run.steps`` steps, a checkpoint committed to the real store under
    ``{run_id}-dry-run``, killed, restored, verified bit-identical, two more steps
    (``runner.dryrun``): on this machine's CPU where ``capabilities.runs_on_this_machine``
    (the local provider), else on a cheap instance of the cloud (``ctx.cloud``), never on
    the control plane. With ``dry_run.local`` on a cloud, or a control plane instances
    cannot report to, it warns with the command a person can run. The dry run's
    checkpoints are deleted on success and kept on failure. Why: docs/architecture.md,
    "Preflight".
    """

    name: str = "dry_run"

    def __init__(self, *, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s

    def run(self, ctx: PreflightContext, *, prior: PreflightPlan) -> CheckResult:
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
            if settings.local or ctx.cloud is None:
                return self._not_here(ctx)
            # On a cheap instance of the run's cloud (jobs.preflight.cloud_dry_run).
            result = ctx.cloud.run(ctx, judge=lambda report: self.evaluate(report, ctx))
            if result.status is not Status.FAIL:
                self._clean_up(ctx)
            return result
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
                sync=ctx.spec.checkpoint.sync_dir is not None,
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
        why = (
            "dry_run.local=true launches no instance for it"
            if ctx.spec.dry_run.local
            else "no cloud instance could be launched for it here (these checks run outside "
            "a started control plane, so an instance would have nowhere to report)"
        )
        return CheckResult(
            self.name,
            Status.WARN,
            f"the dry run did not run: with the {ctx.provider.name} provider the control "
            f"plane never runs a spec's command on its own machine, and {why}; checkpoint "
            "and restore are untested, and there is no step time for the cost estimate",
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
            how = (
                "save its checkpoints into $TRAINBOT_CHECKPOINT_DIR and resume from the "
                "newest one found there"
                if ctx.spec.checkpoint.sync_dir is not None
                else "save and restore all of its state through the session API "
                "(runner.session.Session)"
            )
            return CheckResult(
                self.name,
                Status.FAIL,
                f"the dry run of `{' '.join(ctx.spec.command)}` failed: {problems}",
                f"fix the training script so it {how}, run it with `trainbot-runner "
                f"dry-run -- …` until it passes, then run preflight again; its checkpoints "
                f"are kept in {where}",
                data=data,
            )
        window: float | None = ctx.provider.capabilities.termination_window_s
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
        found = DryRunFindings(
            step_time_s=report.step_time_s,
            checkpoint_bytes=report.checkpoint_bytes,
            write_s=report.write_s,
            stall_s=report.stall_s,
            restore_s=report.restore_s,
            interval_s=interval,
            interval_cost_s=choice.cost_s if choice is not None else None,
            interval_mtbp_s=choice.mtbp_s if choice is not None else None,
            interval_floor_s=choice.floor_s if choice is not None else None,
            termination_window_s=window,
            emergency_fits_window=fits,
        )
        data.update(found.as_data())
        stall = f", stalling the loop {duration(report.stall_s)}" if report.stall_s else ""
        figures = (
            f"{report.steps_before_kill} steps at {duration(report.step_time_s)} a step; "
            f"checkpoint {size(report.checkpoint_bytes)} written in {duration(report.write_s)}"
            f"{stall}, restored bit-identical in {duration(report.restore_s)}; "
            f"checkpoint interval {interval_text(ctx.spec, interval, choice)}"
        )
        if ctx.spec.checkpoint.sync_dir is not None:
            # The runner cannot move a plain script's saves: the script's own setting does.
            figures += (
                " (the script saves on its own schedule: set its save interval, such as "
                "save_steps or every_n_train_steps, near it)"
            )
        if report.setup_s is not None:
            figures = f"code and setup ready in {duration(report.setup_s)}; {figures}"
        if report.sample_objects is not None:
            figures += (
                f"; the data sample {report.sample_uri} is readable from the instance "
                f"({report.sample_objects} objects, {size(report.sample_bytes)})"
            )
        if window is None:
            return CheckResult(self.name, Status.PASS, figures, data=data, finding=found)
        if fits:
            return CheckResult(
                self.name,
                Status.PASS,
                f"{figures}; an emergency checkpoint fits the {duration(window)} "
                "termination window",
                data=data,
                finding=found,
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
            finding=found,
        )

    @staticmethod
    def _environment(ctx: PreflightContext) -> dict[str, str]:
        env = {k: os.environ[k] for k in PASSTHROUGH_ENV if k in os.environ}
        interpreter_dir = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join(p for p in (interpreter_dir, env.get("PATH")) if p)
        env.update(ctx.spec.env)
        # The run's code and setup: the dry run runs them in the pinned commit, as the run will.
        env.update(code_env(ctx.spec, local=True))
        env.update(secrets_env(ctx.spec, local=True))  # references: read by the runner
        env.update(ctx.env)
        sample = ctx.spec.dry_run.sample or ctx.spec.data_uri
        if sample:
            env["TRAINBOT_DATA_URI"] = sample
        scratch = ctx.workdir / ctx.dry_run_id
        scratch.mkdir(parents=True, exist_ok=True)
        env["TRAINBOT_SCRATCH_DIR"] = str(scratch)
        if ctx.spec.resources.under_torchrun:
            env["TRAINBOT_TORCHRUN"] = "1"  # the dry run: one process under torchrun
        return env

    @staticmethod
    def _clean_up(ctx: PreflightContext) -> None:
        """Delete the dry run's checkpoints: nobody resumes from them, and they cost storage."""
        from runner.layout import delete_steps, scan
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
    sample = ctx.spec.dry_run.sample or ctx.spec.data_uri
    prefix = ["env", f"TRAINBOT_DATA_URI={sample}"] if sample else []
    return shlex.join([*prefix, *dry_run_args(ctx)])


def dry_run_args(ctx: PreflightContext, *, timeout_s: float | None = None) -> list[str]:
    """``trainbot-runner dry-run``'s words for this context, the spec's command last."""
    timeout = ["--timeout", f"{timeout_s:g}"] if timeout_s is not None else []
    sync_dir = ctx.spec.checkpoint.sync_dir
    sync = ["--sync-dir", sync_dir] if sync_dir is not None else []
    return [
        "trainbot-runner",
        "dry-run",
        "--steps",
        str(ctx.spec.dry_run.steps),
        "--mtbp",
        f"{ctx.mtbp_s:g}",
        *timeout,
        *sync,
        "--checkpoint-uri",
        ctx.checkpoint_uri,
        "--run-id",
        ctx.dry_run_id,
        "--",
        *ctx.spec.command,
    ]


def _emergency_fits(report: DryRunReport, window_s: float) -> bool:
    nbytes = report.checkpoint_bytes or 0
    write_s = report.write_s or 0.0
    return flush_fits(
        nbytes=nbytes,
        bandwidth_bps=nbytes / write_s if write_s > 0 else None,
        time_left_s=window_s,
    )

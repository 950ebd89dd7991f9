"""Running the checks: the default eight in order, each failure reported, never raised."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from jobs.domain.errors import TrainbotError
from jobs.preflight.budget import BudgetCheck
from jobs.preflight.capacity import CapacityCheck
from jobs.preflight.data import DataLocalityCheck
from jobs.preflight.dry_run import DryRunCheck
from jobs.preflight.image import ImageCheck
from jobs.preflight.quota import QuotaCheck
from jobs.preflight.report import (
    Check,
    CheckResult,
    PreflightContext,
    PreflightPlan,
    PreflightReport,
    Status,
)
from jobs.preflight.secrets import SecretsCheck
from jobs.preflight.shape import InstanceShapeCheck
from runner.errors import RunnerError

__all__ = ["default_checks", "run_preflight"]

log = logging.getLogger(__name__)


def default_checks(*, dry_run_timeout_s: float = 600.0) -> list[Check]:
    """The eight checks, in the order their answers are needed."""
    return [
        QuotaCheck(),
        CapacityCheck(),
        InstanceShapeCheck(),
        DataLocalityCheck(),
        SecretsCheck(),
        ImageCheck(),
        DryRunCheck(timeout_s=dry_run_timeout_s),
        BudgetCheck(),
    ]


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
    plan = PreflightPlan()
    ordered: list[CheckResult] = []
    for check in default_checks() if checks is None else checks:
        try:
            result = check.run(ctx, prior=plan)
        except Exception as exc:  # any failure of a check is reported as a FAIL
            result = _crashed(check.name, exc, run_id=ctx.run_id)
        plan = plan.then(result)
        ordered.append(result)
        if on_result is not None:
            on_result(result)
    cost = plan.cost
    return PreflightReport(
        results=tuple(ordered),
        estimate_usd=cost.estimate_usd if cost is not None else None,
        interval_s=plan.interval_s(ctx.spec),
        expected_hours=cost.expected_hours if cost is not None else None,
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

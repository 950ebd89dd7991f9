"""Preflight: the questions that end runs early, asked before anything is paid for.

Quota, capacity, one larger instance before several small ones, data locality (the
dataset and the checkpoint store), a real checkpoint round trip, and cost; each check is
a small object behind :class:`Check`, run in order by :func:`run_preflight`. The design
and its reasons: docs/architecture.md, "Preflight".
"""

from __future__ import annotations

from jobs.preflight.budget import BudgetCheck
from jobs.preflight.capacity import CapacityCheck
from jobs.preflight.cloud_dry_run import (
    CloudDryRun,
    end_dry_run,
    end_open_dry_runs,
    end_stale_dry_runs,
    live_dry_run_ids,
    stop_dry_runs,
)
from jobs.preflight.data import DataLocalityCheck
from jobs.preflight.dry_run import DRY_RUN_PID_FILE, DryRunCheck, dry_run_command
from jobs.preflight.dry_run_limits import DryRunLimits
from jobs.preflight.findings import CapacityFindings, CostEstimate, DryRunFindings, Finding
from jobs.preflight.interval import (
    DEFAULT_SPOT_MTBP_S,
    assumed_mtbp_s,
    checkpoint_interval,
    interval_choice,
    resource_request,
    target_steps,
)
from jobs.preflight.quota import QuotaCheck
from jobs.preflight.report import (
    Check,
    CheckResult,
    PreflightContext,
    PreflightPlan,
    PreflightReport,
    Status,
)
from jobs.preflight.run import default_checks, run_preflight
from jobs.preflight.shape import InstanceShapeCheck, one_larger_instance

__all__ = [
    "DEFAULT_SPOT_MTBP_S",
    "DRY_RUN_PID_FILE",
    "BudgetCheck",
    "CapacityCheck",
    "CapacityFindings",
    "Check",
    "CheckResult",
    "CloudDryRun",
    "CostEstimate",
    "DataLocalityCheck",
    "DryRunCheck",
    "DryRunFindings",
    "DryRunLimits",
    "Finding",
    "InstanceShapeCheck",
    "PreflightContext",
    "PreflightPlan",
    "PreflightReport",
    "QuotaCheck",
    "Status",
    "assumed_mtbp_s",
    "checkpoint_interval",
    "default_checks",
    "dry_run_command",
    "end_dry_run",
    "end_open_dry_runs",
    "end_stale_dry_runs",
    "interval_choice",
    "live_dry_run_ids",
    "one_larger_instance",
    "resource_request",
    "run_preflight",
    "stop_dry_runs",
    "target_steps",
]

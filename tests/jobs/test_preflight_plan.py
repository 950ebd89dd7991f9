"""The typed plan the preflight checks hand each other, and its stored form.

A check reads an earlier check's finding (:class:`CapacityFindings`,
:class:`DryRunFindings`, :class:`CostEstimate`) from the :class:`PreflightPlan` it is
given; the stored JSON stays what the card, ``/train status`` and older rows hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs.database.models import Run
from jobs.preflight import (
    BudgetCheck,
    CapacityCheck,
    CapacityFindings,
    CheckResult,
    CostEstimate,
    DryRunCheck,
    DryRunFindings,
    PreflightContext,
    PreflightPlan,
    Status,
    run_preflight,
)
from jobs.providers.base import ZoneCapacity
from jobs.runs.launch import measured_write_env
from runner.dryrun_report import DryRunReport
from tests.jobs.test_preflight import CloudAnswers, context, spec

MEASURED = DryRunReport(
    ok=True,
    steps_before_kill=8,
    steps_after_restore=2,
    step_time_s=0.5,
    checkpoint_bytes=4_000_000,
    write_s=2.0,
    stall_s=0.25,
    restore_s=1.0,
    mtbp_s=3600.0,
)

#: The keys a passing dry run's stored data held before the plan was typed.
STORED_KEYS = {
    "store",
    "interval_s",
    "interval_cost_s",
    "interval_mtbp_s",
    "interval_floor_s",
    "termination_window_s",
    "emergency_fits_window",
    *json.loads(MEASURED.to_json()),
}


@dataclass
class MeasuredDryRun:
    """The dry run check's verdict on a fixed report, as if the runner had sent it."""

    name: str = "dry_run"
    report: DryRunReport = field(default_factory=lambda: MEASURED)

    def run(self, ctx: PreflightContext, *, prior: PreflightPlan) -> CheckResult:
        return DryRunCheck().evaluate(self.report, ctx)


@dataclass
class Reader:
    """A later check: keeps the plan it was given."""

    name: str = "reader"
    seen: list[PreflightPlan] = field(default_factory=list)

    def run(self, ctx: PreflightContext, *, prior: PreflightPlan) -> CheckResult:
        self.seen.append(prior)
        return CheckResult(self.name, Status.PASS, "read")


def cloud() -> CloudAnswers:
    return CloudAnswers(
        spot_zones=[
            ZoneCapacity("us-east-1a", True, 3.0),
            ZoneCapacity("us-east-1b", True, 9.0),
        ]
    )


def job(**fields: Any) -> Any:
    return spec(
        command="python train.py --steps 7200",
        resources={"cloud": "aws", "region": "us-east-1", "accelerator": "A100:1"},
        **fields,
    )


def test_later_checks_get_earlier_findings_typed(tmp_path: Path) -> None:
    provider = cloud()
    ctx = context(tmp_path, job(), provider)
    reader = Reader()
    report = run_preflight(ctx, [CapacityCheck(), MeasuredDryRun(), BudgetCheck(), reader])
    (plan,) = reader.seen
    assert isinstance(plan, PreflightPlan) and list(plan) == ["capacity", "dry_run", "budget"]
    assert plan.capacity == CapacityFindings("us-east-1", ("us-east-1b", "us-east-1a"), False)
    dry = plan.dry_run
    assert dry is not None and (dry.step_time_s, dry.write_s, dry.stall_s) == (0.5, 2.0, 0.25)
    assert dry.interval_s is not None and dry.interval_mtbp_s is not None
    assert dry.termination_window_s == 120.0 and dry.emergency_fits_window is True
    cost = plan.cost
    assert isinstance(cost, CostEstimate)
    # The budget priced the capacity check's best zone with the dry run's interval.
    assert provider.priced_zones == ["us-east-1b"]
    assert cost.interval_s == dry.interval_s and cost.price_kind == "spot"
    assert cost.estimate_usd is not None and cost.expected_hours is not None
    assert (report.interval_s, report.estimate_usd, report.expected_hours) == (
        cost.interval_s,
        cost.estimate_usd,
        cost.expected_hours,
    )


def test_the_stored_results_keep_their_shape_and_read_back_the_same(tmp_path: Path) -> None:
    ctx = context(tmp_path, job(), cloud())
    report = run_preflight(ctx, [CapacityCheck(), MeasuredDryRun(), BudgetCheck()])
    stored = json.loads(json.dumps(report.as_dict()))
    by_name = {r["name"]: r["data"] for r in stored["results"]}
    assert set(by_name["dry_run"]) == STORED_KEYS
    assert set(by_name["capacity"]) == {"zones", "all", "on_demand", "region"}
    assert set(by_name["budget"]) == {
        "estimate_usd",
        "expected_hours",
        "usd_per_hour",
        "price_kind",
        "price_source",
        "instances",
        "interval_s",
        "max_hours_usd",
        "budget_usd",
        "basis",
    }
    assert stored["interval_s"] == by_name["budget"]["interval_s"]
    # What the checks handed on is what the stored JSON reads back as.
    found = {r.name: r.finding for r in report.results}
    assert DryRunFindings.stored(stored) == found["dry_run"]
    assert CapacityFindings.from_data(by_name["capacity"]) == found["capacity"]
    assert CostEstimate.from_data(by_name["budget"]) == found["budget"]
    # Results built from data alone (a test's, an older row's) give the same plan.
    rebuilt = PreflightPlan.of(
        {n: CheckResult(n, Status.PASS, "stored", data=d) for n, d in by_name.items()}
    )
    assert (rebuilt.capacity, rebuilt.dry_run, rebuilt.cost) == (
        found["capacity"],
        found["dry_run"],
        found["budget"],
    )


def test_an_older_row_is_read_leniently() -> None:
    """A report stored before the interval's figures existed, with a field of the wrong
    type: what is there is read, the rest is missing."""
    old = {
        "ok": True,
        "interval_s": 600,
        "results": [
            {"name": "quota", "status": "pass", "detail": "ok", "remedy": "", "data": {}},
            {
                "name": "dry_run",
                "status": "pass",
                "detail": "measured",
                "remedy": "",
                "data": {"step_time_s": 1, "checkpoint_bytes": 1000, "write_s": "2s"},
            },
        ],
    }
    found = DryRunFindings.stored(old)
    assert found == DryRunFindings(step_time_s=1.0, checkpoint_bytes=1000)
    assert found.write_bandwidth_bps is None
    assert DryRunFindings.stored(None) == DryRunFindings() == DryRunFindings.stored({})


def test_the_launch_reads_the_measured_write_from_the_findings() -> None:
    def run(data: dict[str, Any]) -> Run:
        return Run(
            spec_name="t",
            spec={},
            requester="U1",
            preflight={"results": [{"name": "dry_run", "data": data}]},
        )

    measured = run({"checkpoint_bytes": 4_000_000, "write_s": 2.0, "stall_s": 0.25})
    assert measured_write_env(measured) == {
        "TRAINBOT_MEASURED_WRITE_BPS": "2000000",
        "TRAINBOT_MEASURED_STALL_S": "0.250000",
    }
    assert measured_write_env(run({"checkpoint_bytes": 4_000_000, "write_s": 0})) == {}
    assert measured_write_env(run({"skipped": True})) == {}


def test_a_failed_dry_run_hands_nothing_on(tmp_path: Path) -> None:
    failed = DryRunReport(ok=False, step_time_s=0.5, write_s=2.0, problems=["restore differed"])
    ctx = context(tmp_path, job(max_hours=3), cloud())
    report = run_preflight(ctx, [MeasuredDryRun(report=failed), BudgetCheck()])
    dry, budget = report.results
    assert dry.status is Status.FAIL and dry.finding is None
    assert PreflightPlan.of({"dry_run": dry}).dry_run is None
    assert isinstance(budget.finding, CostEstimate) and budget.finding.expected_hours == 3
    assert "max_hours as the upper bound" in (budget.finding.basis or "")

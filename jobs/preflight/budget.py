"""The budget check: the estimated cost against ``budget.usd``.

The estimate becomes the run's alert budget when the spec sets none. It needs the
capacity check's best zone and the dry run's step time, so it runs last.
"""

from __future__ import annotations

import math

from jobs.domain.format import duration, usd
from jobs.preflight.findings import CapacityFindings, CostEstimate, DryRunFindings
from jobs.preflight.interval import checkpoint_interval, target_steps
from jobs.preflight.regions import request_for
from jobs.preflight.report import CheckResult, PreflightContext, PreflightPlan, Status
from jobs.spec import JobSpec

__all__ = ["BudgetCheck"]


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

    def run(self, ctx: PreflightContext, *, prior: PreflightPlan) -> CheckResult:
        """``prior`` may also be a plain mapping of results by name (a test's)."""
        plan = PreflightPlan.of(prior)
        spec = ctx.spec
        dry = plan.dry_run or DryRunFindings()
        capacity = plan.capacity or CapacityFindings()
        on_demand = not ctx.request.spot or capacity.on_demand
        # Priced where the capacity check found room: with several regions, maybe not the first.
        region = capacity.region
        req = request_for(ctx, region) if region is not None else ctx.request
        quote = ctx.provider.price(req, zone=capacity.best_zone)
        hourly = quote.on_demand_usd_per_hour if on_demand else quote.spot_usd_per_hour
        instances = spec.resources.instances
        interval = dry.interval_s
        if interval is None:
            interval = checkpoint_interval(spec, write_s=dry.write_s, mtbp_s=ctx.mtbp_s)
        hours, basis = self._expected_hours(ctx, dry, interval=interval, spot=not on_demand)
        estimate = None if hours is None else hourly * instances * hours
        cap_usd = None if spec.max_hours is None else hourly * instances * spec.max_hours
        kind = "on-demand" if on_demand else "spot"
        price_text = f"{usd(hourly)}/h {kind} × {instances} instance(s)"
        found = CostEstimate(
            estimate_usd=estimate,
            expected_hours=hours,
            usd_per_hour=hourly,
            price_kind=kind,
            price_source=quote.source,
            instances=instances,
            interval_s=interval,
            max_hours_usd=cap_usd,
            budget_usd=spec.budget.usd,
            basis=basis,
        )
        data = found.as_data()
        budget = spec.budget.usd
        if estimate is None:
            detail = f"cannot estimate the cost ({basis}); price {price_text}"
            if budget is not None:
                return CheckResult(
                    self.name,
                    Status.PASS,
                    f"{detail}; budget.usd {usd(budget)} alerts at {_percentages(spec)}",
                    data=data,
                    finding=found,
                )
            return CheckResult(
                self.name,
                Status.WARN,
                f"{detail}; no budget.usd either, so nothing alerts on spend",
                "set budget.usd, or give the command --steps N or the spec max_hours so "
                "preflight can estimate the cost and alert on it",
                data=data,
                finding=found,
            )
        detail = f"estimate {usd(estimate)}: {price_text} × {hours:.2f} h ({basis})"
        if budget is None:
            return CheckResult(
                self.name,
                Status.PASS,
                f"{detail}; no budget.usd, so the estimate becomes the run's budget alert "
                f"({_percentages(spec)})",
                data=data,
                finding=found,
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
                finding=found,
            )
        return CheckResult(
            self.name,
            Status.PASS,
            f"{detail}; within budget.usd {usd(budget)} ({100 * estimate / budget:.0f}%)",
            data=data,
            finding=found,
        )

    @staticmethod
    def _expected_hours(
        ctx: PreflightContext,
        dry: DryRunFindings,
        *,
        interval: float | None,
        spot: bool,
    ) -> tuple[float | None, str]:
        """Hours the run is expected to take, and how that was worked out, in words."""
        spec = ctx.spec
        steps = target_steps(spec.command)
        step_time = dry.step_time_s
        if steps is None or step_time is None:
            missing = "no --steps N in the command" if steps is None else "no dry-run step time"
            if spec.max_hours is None:
                return None, f"{missing} and no max_hours"
            return spec.max_hours, f"{missing}: max_hours as the upper bound"
        write_s = dry.write_s or 0.0
        cost_s = dry.interval_cost_s or write_s
        lossy_mtbp_s = dry.interval_mtbp_s or ctx.mtbp_s
        restore_s = dry.restore_s or 0.0
        flush_s = write_s if dry.emergency_fits_window else 0.0
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


def _percentages(spec: JobSpec) -> str:
    return "/".join(str(p) for p in spec.budget.thresholds) + " %"

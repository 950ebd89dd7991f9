"""What every preflight check shares: the context it reads, the verdict it gives, and
the report the service stores on the run.

Nothing here formats chat text or touches the database; the front ends render
:meth:`PreflightReport.to_message`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from jobs.domain.locations import dry_run_prefix
from jobs.outbound.notify import CheckLine, PreflightMessage
from jobs.preflight.findings import CapacityFindings, CostEstimate, DryRunFindings, Finding
from jobs.providers.base import Provider, ResourceRequest
from jobs.spec import JobSpec

if TYPE_CHECKING:
    from jobs.preflight.cloud_dry_run import CloudDryRun

__all__ = [
    "Check",
    "CheckResult",
    "PreflightContext",
    "PreflightPlan",
    "PreflightReport",
    "Status",
    "describe_request",
    "number",
]


class Status(str, enum.Enum):
    """A check's verdict. WARN waits for a person to say "launch anyway"."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class CheckResult(CheckLine):
    """One check's answer: the line people read (``name`` "quota", "capacity", "data",
    "dry_run", "budget"; ``detail`` what was found, with figures; ``remedy`` what to do,
    always set on WARN and FAIL), with its verdict as a :class:`Status` and the figures
    later checks and the report read."""

    status: Status
    #: Figures for the report and the database; JSON-able.
    data: Mapping[str, Any] = field(default_factory=dict)
    #: What later checks and the launch read, typed (its ``as_data()`` is in ``data``);
    #: None for a check nothing reads.
    finding: Finding | None = None

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


class StagingLookup(Protocol):
    """What the data check asks of staging (:class:`jobs.staging.runs.StagingView`)."""

    def offer(self, source: str, region: str) -> str | None:
        """How to copy ``source`` into ``region``'s staging bucket, with its size, cost
        and time; None when no copy can be offered there."""
        ...


@dataclass(frozen=True)
class PreflightContext:
    """What every check of one run's preflight shares."""

    spec: JobSpec
    run_id: str
    provider: Provider
    #: The spec's resources in the provider's vocabulary (see ``resource_request``).
    request: ResourceRequest
    #: Root of the real checkpoint store; the dry run writes under ``{run_id}-dry-run``.
    checkpoint_uri: str
    #: Mean seconds between preemptions assumed for the provider (see ``assumed_mtbp_s``).
    mtbp_s: float
    #: Environment for the dry run's process on top of a minimal one (``PYTHONPATH`` …).
    env: Mapping[str, str]
    #: Where dry-run scratch goes.
    workdir: Path
    #: With a cloud provider: what launching the dry run on a cheap instance needs (the
    #: database, tokens, the URL instances report to); None: the check cannot, and warns.
    cloud: CloudDryRun | None = None
    #: Staging (None: no staging bucket is set, and a dataset in another region is
    #: offered no copy).
    staging: StagingLookup | None = None

    def __post_init__(self) -> None:
        if not self.mtbp_s > 0 or not math.isfinite(self.mtbp_s):
            raise ValueError(f"mtbp_s must be a positive number of seconds (got {self.mtbp_s})")

    @property
    def dry_run_id(self) -> str:
        """The dry run's namespace in the checkpoint store, apart from the run's own."""
        return dry_run_prefix(self.run_id)


_F = TypeVar("_F", CapacityFindings, DryRunFindings, CostEstimate)


@dataclass(frozen=True, eq=False)
class PreflightPlan(Mapping[str, CheckResult]):
    """What the checks run so far found: a check reads an earlier one's finding here,
    typed (:attr:`capacity`, :attr:`dry_run`, :attr:`cost`), never from its ``data``.

    Also the mapping of those results by name, for a check that only asks what ran.
    """

    results: Mapping[str, CheckResult] = field(default_factory=dict)

    @classmethod
    def of(cls, prior: Mapping[str, CheckResult]) -> PreflightPlan:
        """The plan of ``prior``: itself when it is one, else a plain mapping of results
        by name (results built by hand are read from their ``data``)."""
        return prior if isinstance(prior, PreflightPlan) else cls(dict(prior))

    def then(self, result: CheckResult) -> PreflightPlan:
        """The plan once ``result`` is in."""
        return PreflightPlan({**self.results, result.name: result})

    def __getitem__(self, name: str) -> CheckResult:
        return self.results[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def _found(self, kind: type[_F], *, failed: bool = True) -> _F | None:
        result = self.results.get(kind.check)
        if result is None or (result.status is Status.FAIL and not failed):
            return None
        if isinstance(result.finding, kind):
            return result.finding
        return kind.from_data(result.data)

    @property
    def capacity(self) -> CapacityFindings | None:
        """Where the capacity check found room (also when it failed: a refused launch
        still names the zone it would have used); None before it ran."""
        return self._found(CapacityFindings)

    @property
    def dry_run(self) -> DryRunFindings | None:
        """What the dry run measured; None when it did not run or failed. A skipped dry
        run measured nothing: every figure is None."""
        return self._found(DryRunFindings, failed=False)

    @property
    def cost(self) -> CostEstimate | None:
        """The budget check's estimate; None before it ran."""
        return self._found(CostEstimate)

    def interval_s(self, spec: JobSpec) -> float | None:
        """The checkpoint interval chosen: the budget check's, else the dry run's, else
        the spec's (None for ``"auto"`` with nothing measured)."""
        cost, dry = self.cost, self.dry_run
        if cost is not None and cost.interval_s is not None:
            return cost.interval_s
        if dry is not None and dry.interval_s is not None:
            return dry.interval_s
        return spec.checkpoint.interval_s


class Check(Protocol):
    """One preflight question."""

    name: str

    def run(self, ctx: PreflightContext, *, prior: PreflightPlan) -> CheckResult:
        """Answer it; ``prior`` holds what the checks that ran before found."""
        ...


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
                CheckLine(r.name, r.status.value, r.detail, r.remedy) for r in self.results
            ),
            ok=self.ok,
            needs_confirmation=self.needs_confirmation,
            estimate_usd=self.estimate_usd,
            interval_s=self.interval_s,
            stage=next((str(r.data["stage"]) for r in self.results if r.data.get("stage")), None),
        )


def describe_request(req: ResourceRequest, *, where: str | None = None) -> str:
    """The request in a few words: what, which market, where (``where``, else its region)."""
    if req.accelerator_count > 0:
        thing = f"{req.accelerator_count} × {req.accelerator_type or 'GPU'}"
    elif req.instance_type:
        thing = req.instance_type
    else:
        thing = f"{req.cpus or 1} CPU core(s)"
    return f"{thing} ({'spot' if req.spot else 'on-demand'}, {where or req.region})"


def number(value: Any) -> float | None:
    """A finite number from a result's JSON-able data; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None

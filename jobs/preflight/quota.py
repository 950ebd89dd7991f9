"""The quota check: the exact type's quota in the exact region covers the request.

New cloud accounts start with a GPU quota of 0, and raising it takes days, so this is
the first thing to know. With several ``resources.regions`` each is asked: the run can
fail over to any region whose quota covers it, so one is enough.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from jobs.preflight.regions import region_requests, said_list
from jobs.preflight.report import (
    CheckResult,
    PreflightContext,
    PreflightPlan,
    Status,
    describe_request,
)
from jobs.providers.base import ProviderError, QuotaInfo, ResourceRequest

__all__ = ["QuotaCheck"]


class QuotaCheck:
    """The quota for the exact type covers the request in at least one listed region."""

    name: str = "quota"

    def run(self, ctx: PreflightContext, *, prior: PreflightPlan) -> CheckResult:
        requests = region_requests(ctx)
        if len(requests) == 1:
            return self._one(ctx.provider.quota(requests[0]), requests[0])
        answers: dict[str, QuotaInfo | ProviderError] = {}
        for req in requests:
            try:
                answers[req.region] = ctx.provider.quota(req)
            except ProviderError as exc:  # one region's silence does not decide for all
                answers[req.region] = exc
        quotas = {r: a for r, a in answers.items() if isinstance(a, QuotaInfo)}
        if not quotas:
            raise next(a for a in answers.values() if isinstance(a, ProviderError))
        usable = [r for r, q in quotas.items() if q.ok]
        refused = [r for r in answers if r not in usable]
        lines = "; ".join(_line(r, a) for r, a in answers.items())
        what = describe_request(requests[0], where=said_list(list(answers), word="or"))
        first = quotas[usable[0]] if usable else next(iter(quotas.values()))
        data: dict[str, Any] = {
            **asdict(first),
            "usable_regions": usable,
            "regions": {
                r: asdict(a) if isinstance(a, QuotaInfo) else {"error": str(a)}
                for r, a in answers.items()
            },
        }
        if usable:
            detail = f"the quota covers {what} in {said_list(usable)}"
            if refused:
                detail += f", not in {said_list(refused)} (the run goes where it does)"
            return CheckResult(self.name, Status.PASS, f"{detail}: {lines}", data=data)
        remedies = [q.remedy for q in quotas.values() if q.remedy]
        return CheckResult(
            self.name,
            Status.FAIL,
            f"no region of resources.regions has the quota for {what}: {lines}",
            "; or ".join(remedies)
            or f"raise the {first.unit} quota in one of {said_list(list(answers))}, ask for "
            "fewer, or list another region in resources.regions",
            data=data,
        )

    def _one(self, quota: QuotaInfo, req: ResourceRequest) -> CheckResult:
        data = asdict(quota)
        if quota.ok:
            return CheckResult(self.name, Status.PASS, quota.detail, data=data)
        return CheckResult(
            self.name,
            Status.FAIL,
            f"{quota.detail} — not enough for {describe_request(req)} ({_shortfall(quota)})",
            quota.remedy
            or f"raise the {quota.unit} quota in {req.region}, ask for fewer, or list another "
            "region in resources.regions",
            data=data,
        )


def _shortfall(quota: QuotaInfo) -> str:
    return f"{quota.used:g} used + {quota.needed:g} needed > limit {quota.limit:g} {quota.unit}"


def _line(region: str, answer: QuotaInfo | ProviderError) -> str:
    if isinstance(answer, ProviderError):
        return f"{region}: cannot tell ({answer})"
    if answer.ok:
        return f"{region}: {answer.detail}"
    return f"{region}: {answer.detail} — not enough ({_shortfall(answer)})"

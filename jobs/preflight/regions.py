"""The regions a run may go to, each with its request: preflight asks every one.

A spec listing several ``resources.regions`` fails over between them
(:mod:`jobs.runs.placement`), so a check passes when any of them can take the run, and
says which can, which cannot, and why. The requests are built as the launch builds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from jobs.preflight.interval import request_in
from jobs.preflight.report import PreflightContext
from jobs.providers.base import ResourceRequest

__all__ = ["region_requests", "request_for", "said_list"]


def region_requests(ctx: PreflightContext, *, spot: bool | None = None) -> list[ResourceRequest]:
    """One request per region of ``resources.regions``, in the spec's order (for the
    market ``spot``, by default the context's). With one region or none, the context's
    own request, so a caller's request stands."""
    market = ctx.request.spot if spot is None else spot
    if len(ctx.spec.resources.regions) <= 1:
        return [replace(ctx.request, spot=market)]
    return [request_for(ctx, region, spot=market) for region in ctx.spec.resources.regions]


def request_for(ctx: PreflightContext, region: str, *, spot: bool | None = None) -> ResourceRequest:
    """The request in ``region``: the context's own for its region, else the launch's."""
    market = ctx.request.spot if spot is None else spot
    if region == ctx.request.region and len(ctx.spec.resources.regions) <= 1:
        return replace(ctx.request, spot=market)
    return request_in(ctx.spec, region, spot=market, provider=ctx.provider)


def said_list(names: Sequence[str], *, word: str = "and") -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    if len(names) <= 1:
        return "".join(names)
    return f"{', '.join(names[:-1])} {word} {names[-1]}"

"""Waiting for a price: ``resubmit.max_price`` holds an attempt back until it is met.

Every launch of a run with a price limit (its first, a resubmit's, the one after a
preemption) asks the provider's price for the zone the placement chose, and for the
region's other available zones when the placement may move; the cheapest at or below
the limit gets the attempt. When none is, no attempt is made: the run keeps its state
(LAUNCHING or RECOVERING), records what it waits for in ``Run.price_wait`` (the card
shows it), and the scheduled price job (:func:`jobs.runs.relaunch.watch_prices`)
launches it once the price drops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from datetime import datetime

from sqlmodel import Session

from jobs.database.models import Run
from jobs.preflight.interval import request_in
from jobs.process.deps import Deps
from jobs.providers.base import ProviderError
from jobs.runs.cards import refresh_card, say
from jobs.runs.placement import Placement
from jobs.spec import JobSpec

__all__ = ["PriceWait", "gate", "waiting_text"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PriceWait:
    """No allowed zone is at or below the limit now."""

    #: The limit, USD per instance-hour.
    limit: float
    #: The lowest price seen, and where; None when the provider could not say.
    price: float | None
    zone: str | None


def waiting_text(limit: float, price: float | None, zone: str | None) -> str:
    """What the card says while a run waits: "waiting for ≤ $1.20/h, now $1.45/h in …"."""
    if price is None:
        return f"waiting for ≤ ${limit:.2f}/h; the price is unknown right now"
    return f"waiting for ≤ ${limit:.2f}/h, now ${price:.2f}/h in {zone or 'the default zone'}"


def gate(deps: Deps, spec: JobSpec, placement: Placement) -> Placement | PriceWait:
    """The placement at a zone whose price meets ``resubmit.max_price`` (itself when it
    has no limit), or what the run waits for."""
    limit = spec.resubmit.max_price
    if limit is None:
        return placement
    zones: list[str | None] = [placement.zone]
    provider = deps.provider_named(placement.provider or deps.provider.name)
    request = request_in(spec, placement.region, spot=placement.spot, provider=provider)
    if spec.resubmit.zone_failover and placement.spot:
        try:
            ranked = provider.capacity(request)
        except ProviderError as exc:
            log.warning("capacity lookup for the price limit failed: %s", exc)
            ranked = []
        zones += [z.zone for z in ranked if z.available and z.zone != placement.zone]
    quotes: list[tuple[float, str | None]] = []
    for zone in zones:
        try:
            quote = provider.price(request, zone=zone)
        except ProviderError as exc:
            log.warning("price lookup in %s failed: %s", zone or placement.region, exc)
            continue
        price = quote.spot_usd_per_hour if placement.spot else quote.on_demand_usd_per_hour
        quotes.append((price, zone))
    if not quotes:
        return PriceWait(limit=limit, price=None, zone=None)
    price, zone = min(quotes, key=lambda q: q[0])
    if price > limit:
        return PriceWait(limit=limit, price=price, zone=zone or placement.region)
    return placement if zone == placement.zone else replace(placement, zone=zone)


def wait(deps: Deps, session: Session, run: Run, found: PriceWait, *, now: datetime) -> None:
    """Record that ``run`` waits for its price; said in its thread when it starts waiting
    or the price it waits on moves, and always on its card."""
    before = run.price_wait or {}
    text = waiting_text(found.limit, found.price, found.zone)
    run.price_wait = {
        "limit": found.limit,
        "price": found.price,
        "zone": found.zone,
        "since": before.get("since") or now.isoformat(),
    }
    run.reason = text
    run.updated_at = now
    session.add(run)
    if before.get("price") != found.price or before.get("zone") != found.zone or not before:
        deps.journal.record(
            "price_wait", run.id, limit=found.limit, price=found.price, zone=found.zone
        )
        say(deps, run, "info", f"{run.id} is {text}; it launches once the price is met.")
        refresh_card(deps, session, run)


def met(deps: Deps, run: Run, placement: Placement) -> None:
    """The run waited and the price is met: clear the wait, and say so."""
    if run.price_wait is None:
        return
    limit = run.price_wait.get("limit")
    deps.journal.record("price_met", run.id, limit=limit, zone=placement.zone)
    say(
        deps,
        run,
        "info",
        f"The price in {placement.zone or placement.region} is at or below "
        f"${float(limit or 0):.2f}/h: launching {run.id}.",
    )
    run.price_wait = None
    run.reason = None

"""Keeping a failed attempt's instance for a person to look at (``debug.keep_failed_instance``).

A failed attempt's instance normally goes at once. With the option set, it is kept
running until a stored deadline, billed as the attempt was (:mod:`jobs.spend.accrual`
adds its time as spend records of the attempt), and the run's thread says how to
connect. The attempt stays FAILED with its token revoked, the run stays where the
failure put it: a kept instance is no attempt, so nothing launches, resumes or counts
hours on it. It ends by ``/train release`` (its owner or an admin) or by the scheduled
reconcile once its deadline passes, which a restarted control plane reads from the row.
Preempted, lost and stopped attempts are never kept: there is nothing of theirs to see.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlmodel import Session, col, select

from jobs.database.db import session_scope
from jobs.database.models import Attempt, KeptInstance, Run
from jobs.domain.actor import Actor, may_touch
from jobs.domain.errors import ConflictError
from jobs.domain.format import clock, duration, usd
from jobs.domain.lifecycle import RunState
from jobs.process.deps import Deps
from jobs.process.settings import Settings
from jobs.providers.base import InstanceNotFound, InstanceState, ProviderError
from jobs.providers.gang import node_ids
from jobs.runs.cards import refresh_card, say
from jobs.runs.fence import check_fence
from jobs.runs.rows import get_run
from jobs.spec import BudgetPolicy, Debug, JobSpec, stored_section
from jobs.spend import run_spent

log = logging.getLogger(__name__)


def keep_seconds(settings: Settings, run: Run) -> tuple[float, float | None]:
    """How long to keep the run's failed instances, and what the spec asked when the
    admin's maximum cut it (else None); 0: not kept."""
    asked = stored_section(run.spec, Debug, run_id=run.id).keep_failed_instance or 0.0
    ceiling = settings.keep_failed_instance_max_s
    if asked > ceiling:
        return ceiling, asked
    return asked, None


def instance_keep_s(settings: Settings, spec: JobSpec) -> int | None:
    """What an attempt's boot script is told to keep its instance up after a failure
    (``TRAINBOT_KEEP_FAILED_S``): the spec's time within the admin's maximum, whole
    seconds; None: not kept. The control plane still decides, and terminates it."""
    asked = spec.debug.keep_failed_instance or 0.0
    seconds = int(min(asked, settings.keep_failed_instance_max_s))
    return seconds if seconds > 0 else None


#: Runs ended on purpose (a person's stop, the budget cap) before their runner's failure
#: came in: the failure is the stop's, and nothing is kept.
_ENDED_ON_PURPOSE = (RunState.STOPPED, RunState.BUDGET_EXCEEDED)


def keep_failed(deps: Deps, session: Session, run: Run, attempt: Attempt, *, now: datetime) -> bool:
    """In the transaction that ends ``attempt`` as FAILED: keep its instance when the
    spec asks to, and say in the run's thread how to connect. True: kept (the caller
    leaves it running)."""
    if attempt.instance_id is None or run.state in _ENDED_ON_PURPOSE:
        return False
    seconds, asked = keep_seconds(deps.settings, run)
    if seconds <= 0:
        if asked:
            say(deps, run, "info", _off_text(attempt, asked))
        return False
    row = KeptInstance(
        attempt_id=attempt.id,
        run_id=run.id,
        provider=attempt.provider,
        instance_id=attempt.instance_id,
        zone=attempt.zone,
        kept_at=now,
        until=now + timedelta(seconds=seconds),
        price_per_hour=attempt.price_per_hour,
        instances=attempt.instances,
    )
    row.connect = connect_hint(deps.settings, row)
    session.add(row)
    deps.journal.record(
        "instance_kept",
        run.id,
        attempt=attempt.number,
        instance=attempt.instance_id,
        until=row.until.isoformat(),
    )
    say(deps, run, "info", kept_text(row, attempt_number=attempt.number, cut=asked))
    return True


def kept_text(row: KeptInstance, *, attempt_number: int, cut: float | None = None) -> str:
    """The thread's line for a kept instance: what it costs, until when, how to connect,
    how to end it."""
    seconds = (row.until - row.kept_at).total_seconds()
    price = (
        f"{usd((row.price_per_hour or 0.0) * row.instances)}/h"
        if row.price_per_hour is not None
        else "its usual price"
    )
    cut_text = f" ({duration(cut)} asked, cut to the admin's maximum)" if cut else ""
    return (
        f"Attempt {attempt_number}'s instance {row.instance_id} is kept running for you to "
        f"look at, for {duration(seconds)}{cut_text}, until {clock(row.until)}, billed at "
        f"{price}. Connect: `{row.connect}`. "
        f"End it sooner with `/train release {row.run_id}`."
    )


def _off_text(attempt: Attempt, asked: float) -> str:
    return (
        f"Attempt {attempt.number}'s instance is not kept ({duration(asked)} asked): the "
        "admin has turned debug.keep_failed_instance off (TRAINBOT_KEEP_FAILED_INSTANCE_MAX_S=0)."
    )


def _aws_hint(settings: Settings, node: str, zone: str | None) -> str:
    # An instance outside the provider's home region carries it: ``REGION/i-…``.
    region, sep, raw = node.rpartition("/")
    if not sep:
        region = settings.aws_region or (zone[:-1] if zone else "")
    return shlex.join(
        ["aws", "ssm", "start-session", "--target", raw, *(["--region", region] if region else [])]
    )


def _gcp_hint(settings: Settings, node: str, zone: str | None) -> str:
    # GCP instance ids are ``ZONE/NAME``.
    in_zone, _, name = node.partition("/")
    words = ["gcloud", "compute", "ssh", name or in_zone, "--zone", in_zone if name else zone or ""]
    if settings.gcp_project:
        words += ["--project", settings.gcp_project]
    return shlex.join(words)


def _local_hint(settings: Settings, node: str, zone: str | None) -> str:
    # The local provider's instances are directories under the state directory.
    return shlex.join(["cd", str(settings.state_dir / "local" / node)])


#: How a person reaches one instance (one node of a gang), per provider.
CONNECT: dict[str, Callable[[Settings, str, str | None], str]] = {
    "aws": _aws_hint,
    "gcp": _gcp_hint,
    "local": _local_hint,
}


def connect_hint(settings: Settings, row: KeptInstance) -> str:
    """The command that connects to a kept instance; for a gang, one per node."""
    hint = CONNECT.get(row.provider)
    nodes = node_ids(row.instance_id)
    if hint is None:
        return f"{row.provider} instance {row.instance_id}"
    if len(nodes) == 1:
        return hint(settings, nodes[0], row.zone)
    return "; ".join(f"node {rank}: {hint(settings, n, row.zone)}" for rank, n in enumerate(nodes))


def live_kept(session: Session) -> list[KeptInstance]:
    """The instances kept now (not yet ended), oldest first."""
    return list(
        session.exec(
            select(KeptInstance)
            .where(col(KeptInstance.ended_at).is_(None))
            .order_by(col(KeptInstance.kept_at))
        ).all()
    )


def kept_attempt_ids(session: Session) -> set[str]:
    """The attempts whose instance is kept: their instances are no orphans."""
    return {row.attempt_id for row in live_kept(session)}


def release(deps: Deps, run_id: str, actor: Actor) -> list[KeptInstance]:
    """``/train release <run>``: end the run's kept instances now (its owner or an admin)."""
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        may_touch(actor, run)
        rows = [r for r in live_kept(session) if r.run_id == run.id]
        if not rows:
            raise ConflictError(
                f"{run.id} has no kept instance: only a failed attempt's instance is kept, "
                "when its spec sets debug.keep_failed_instance"
            )
    return [r for r in (_end(deps, row, by=actor.user) for row in rows) if r is not None]


#: The states of a kept instance that ended without us: its keeping (and billing) ends.
_GONE = (InstanceState.PREEMPTED, InstanceState.TERMINATED, InstanceState.LOST)


def expire_kept(deps: Deps, *, now: datetime) -> int:
    """Terminate the kept instances whose time is up (the scheduled reconcile), and end
    the keeping of those that went on their own (reclaimed, terminated outside
    trainbot), so they bill no more; how many ended."""
    with session_scope(deps.engine) as session:
        rows = live_kept(session)
        capped = {row.run_id for row in rows if _at_hard_cap(session, row.run_id)}
    ended = 0
    for row in rows:
        if row.until <= now:
            ended += _end(deps, row, by="time") is not None
        elif row.run_id in capped:
            ended += _end(deps, row, by="budget") is not None
        elif _gone(deps, row):
            ended += _end(deps, row, by="gone") is not None
    return ended


def _at_hard_cap(session: Session, run_id: str) -> bool:
    """Whether the run's spend (its kept instances' included) reached its hard cap: a
    kept instance bills, and the cap holds for it as it held for the attempts."""
    run = session.get(Run, run_id)
    if run is None or run.budget_usd is None:
        return False
    if not stored_section(run.spec, BudgetPolicy, run_id=run.id).caps_spend:
        return False
    return run_spent(session, run.id) >= run.budget_usd


def _gone(deps: Deps, row: KeptInstance) -> bool:
    """Whether a kept instance is no more (a failed runner's process that ended is still
    there to look at: its instance, or the local provider's directory)."""
    try:
        return deps.provider_named(row.provider).status(row.instance_id).state in _GONE
    except InstanceNotFound:
        return True
    except ProviderError as exc:
        log.info("status of kept instance %s: %s", row.instance_id, exc)
        return False


#: Why a kept instance ended, by its ``ended_by`` (else a person released it).
_WHY = {"time": "its time is up", "budget": "the run's spend reached its hard budget cap"}


def _end(deps: Deps, row: KeptInstance, *, by: str) -> KeptInstance | None:
    """Terminate a kept instance and record its end (its spend stops there); None when it
    could not be terminated now (reconcile tries again) or another call ended it."""
    done, mine = deps.claim_termination(row.instance_id)
    if not mine:
        done.wait()
    else:
        try:
            check_fence(deps, None, action=f"the termination of kept instance {row.instance_id}")
            deps.provider_named(row.provider).terminate(row.instance_id)
        except InstanceNotFound:
            pass  # gone already: its spend ends now all the same
        except ProviderError as exc:
            log.warning("terminating kept instance %s failed (retried): %s", row.instance_id, exc)
            return None
        finally:
            deps.release_termination(row.instance_id)
    now = deps.clock()
    with session_scope(deps.engine) as session:
        kept = session.get(KeptInstance, row.attempt_id, with_for_update=True)
        if kept is None or kept.ended_at is not None:
            return None
        kept.ended_at = max(now, kept.kept_at)
        kept.ended_by = by
        session.add(kept)
        run = session.get(Run, kept.run_id)
        held = duration((kept.ended_at - kept.kept_at).total_seconds())
        deps.journal.record(
            "kept_instance_ended", kept.run_id, instance=kept.instance_id, by=by, held=held
        )
        if run is not None:
            if by == "gone":
                text = f"Kept instance {kept.instance_id} ended outside trainbot after {held}."
            else:
                why = _WHY.get(by, f"released by {by}")
                text = f"Kept instance {kept.instance_id} is terminated ({why}) after {held}."
            say(deps, run, "info", text)
            refresh_card(deps, session, run)
        session.flush()
        session.expunge(kept)
        return kept

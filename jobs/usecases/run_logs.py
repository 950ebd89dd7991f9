"""What a run's training command printed, for ``/train logs``: read from the run's store,
where every runner ships its command's output (:mod:`runner.logship`), so that it is
there on every provider after the instance is gone.

A live attempt on a provider that can read its instance's output directly (the local
one) is read there first: that is newer than the last segment uploaded. An attempt whose
output never reached the store falls back to the instance's own log where the provider
still has it. An attempt that never started says why, from its row.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from sqlmodel import col, select

from jobs.database.db import session_scope
from jobs.database.models import Attempt
from jobs.domain.actor import Actor, may_see
from jobs.domain.errors import NotFound, SpecError
from jobs.domain.locations import check_prefix, checkpoint_root
from jobs.domain.output import env_values, redact_output
from jobs.process.deps import Deps
from jobs.providers import gang
from jobs.providers.base import InstanceNotFound, ProviderError
from jobs.runs.rows import checkpoint_prefix, get_run
from runner.errors import RunnerError
from runner.logship import LogTail, log_prefix, read_tail
from runner.store import run_store

log = logging.getLogger(__name__)

#: How much of the output's end is read from the store: more than a reply shows, so the
#: front end chooses what fits.
READ_BYTES = 256 << 10
#: Lines asked of a provider that reads the instance itself.
INSTANCE_LINES = 400


@dataclass(frozen=True)
class RunLog:
    """The end of one attempt's output on one node."""

    run_id: str
    attempt: int
    node: int
    #: The attempt's state and why it ended ("FAILED: runner exited 1 (failed)").
    state: str
    #: The last lines, oldest first; "" when there are none (``note`` says why).
    text: str
    #: Whether there is earlier output than ``text`` holds.
    cut: bool = False
    #: Where the whole output is (the store's folder of this node's segments), if known.
    location: str | None = None
    #: "store" or "instance": where ``text`` was read.
    source: str = "store"
    #: Why there is no output, or what to know about it.
    note: str | None = None


@dataclass(frozen=True)
class _Target:
    run_id: str
    number: int
    attempt_id: str
    state: str
    live: bool
    instance_id: str | None
    provider: str
    nodes: int
    root: str | None
    prefix: str | None
    secrets: tuple[str, ...]


def run_log(
    deps: Deps, run_id: str, actor: Actor, *, attempt: int | None = None, node: int = 0
) -> RunLog:
    """The end of the output of attempt ``attempt`` (the newest that started) of a run,
    on node ``node``. :class:`NotFound` when there is no such attempt or node."""
    target = _target(deps, run_id, actor, attempt=attempt, node=node)
    location = None
    store = None
    if target.root is not None and target.prefix is not None:
        try:
            store = run_store(target.root, target.prefix)
            location = f"{store.uri.rstrip('/')}/{log_prefix(target.attempt_id, node)}"
        except RunnerError as exc:
            log.warning("cannot open the store of %s for its logs: %s", run_id, exc)
    base = RunLog(
        run_id=target.run_id,
        attempt=target.number,
        node=node,
        state=target.state,
        text="",
        location=location,
    )
    if target.live:
        live = _from_instance(deps, target, node)
        if live is not None:
            text = redact_output(live, target.secrets)
            return replace(base, text=text, source="instance", cut=True)
    tail: LogTail | None = None
    problem = None
    if store is not None:
        try:
            tail = read_tail(store, target.attempt_id, node, max_bytes=READ_BYTES)
        except RunnerError as exc:
            problem = str(exc)
    if tail is not None:
        note = None
        if tail.missing:
            note = (
                f"{tail.missing} segment(s) of its output were deleted to keep its log within "
                "the runner's bound: the start and the newest are kept"
            )
        text = redact_output(tail.text, target.secrets)
        return replace(base, text=text, cut=tail.cut, note=note)
    fallback = _from_instance(deps, target, node)
    if fallback is not None:
        text = redact_output(fallback, target.secrets)
        return replace(base, text=text, source="instance", cut=True)
    if problem is not None:
        note = f"its log could not be read from the store: {problem}"
    elif target.live:
        note = (
            "nothing it printed has reached the store yet: the runner uploads its output "
            "every 30 s and when it exits"
        )
    else:
        note = (
            "it left no output in the store: the command printed nothing, its runner predates "
            "log shipping, or the instance died before the first upload"
        )
    return replace(base, note=note)


def _target(deps: Deps, run_id: str, actor: Actor, *, attempt: int | None, node: int) -> _Target:
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        may_see(actor, run)
        rows = session.exec(
            select(Attempt).where(Attempt.run_id == run.id).order_by(col(Attempt.number).desc())
        ).all()
        if not rows:
            raise NotFound(f"{run.id} has no attempt yet, so no logs")
        if attempt is None:
            # The newest that started; else the newest, which then says why it did not.
            row = next((a for a in rows if a.instance_id is not None), rows[0])
        else:
            found = [a for a in rows if a.number == attempt]
            if not found:
                raise NotFound(
                    f"{run.id} has no attempt {attempt}: its attempts are 1 to {rows[0].number}"
                )
            row = found[0]
        if row.instance_id is None:
            raise NotFound(_never_started(run.id, row, rows))
        if node >= max(row.instances, 1):
            raise NotFound(
                f"attempt {row.number} of {run.id} ran on {row.instances} node(s): "
                f"name a node from 0 to {row.instances - 1}"
            )
        try:
            root: str | None = checkpoint_root(
                run.checkpoint_uri,
                default=deps.settings.checkpoint_uri,
                allowed=deps.settings.checkpoint_locations,
            )
            prefix: str | None = check_prefix(checkpoint_prefix(run))
        except SpecError as exc:
            log.warning("no store for the logs of %s: %s", run.id, exc)
            root = prefix = None
        state = row.state.value + (f": {row.end_reason}" if row.end_reason else "")
        return _Target(
            run_id=run.id,
            number=row.number,
            attempt_id=row.id,
            state=state,
            live=not row.state.is_terminal(),
            instance_id=row.instance_id,
            provider=row.provider,
            nodes=row.instances,
            root=root,
            prefix=prefix,
            secrets=env_values(run.spec),
        )


def _never_started(run_id: str, row: Attempt, rows: Sequence[Attempt]) -> str:
    """Why an attempt has no output: its launch failed (the provider's answer, where it
    tried) or is still under way. ``rows``: the run's attempts, newest first; the launches
    refused before this one, since the last that started, are where else it tried."""
    market = "spot" if row.spot else "on-demand"
    where = ", ".join(x for x in (row.zone, row.region) if x) or "no zone"
    kind = f" {row.instance_type}" if row.instance_type else ""
    tried = f"tried {market}{kind} in {where} on {row.provider}"
    before = []
    for earlier in rows:
        if earlier.number >= row.number:
            continue
        if earlier.instance_id is not None:
            break
        before.append(f"{earlier.zone or earlier.region or '?'} (attempt {earlier.number})")
    if before:
        tried += f"; before it, {', '.join(reversed(before))}"
    if row.state.is_terminal():
        why = row.end_reason or row.state.value.lower()
        return f"attempt {row.number} of {run_id} never started: {why} ({tried})"
    return f"attempt {row.number} of {run_id} has not started yet: it is launching ({tried})"


def _from_instance(deps: Deps, target: _Target, node: int) -> str | None:
    """The output as the provider reads it on the instance, where it can; None otherwise."""
    try:
        provider = deps.provider_named(target.provider)
    except ProviderError:
        return None
    if not provider.capabilities.instance_logs or target.instance_id is None:
        return None
    ids = gang.node_ids(target.instance_id)
    if node >= len(ids):
        return None
    try:
        return provider.instance_log(ids[node], lines=INSTANCE_LINES)
    except (InstanceNotFound, ProviderError):
        return None

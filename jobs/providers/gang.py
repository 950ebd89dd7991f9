"""Multi-node attempts: N instances launched as one gang, which the control plane sees
as one instance.

An attempt keeps one instance id. A gang's is its nodes' ids joined by ``+`` in node
rank order (``i-0a+i-0b``), so reconcile, the end of an attempt and the run card need no
idea of nodes: ``status`` of a gang is its nodes' states combined, ``terminate`` ends
every node, ``list_instances`` shows each gang once. A provider's own methods do the
per-node work; these helpers do the rest, the same for every provider.

How the nodes find each other: node 0 is launched first, and its private address (which
every cloud's launch call returns) goes into the others' environment, with the port
torchrun's static rendezvous listens on. No rendezvous service of ours: the nodes do not
need the control plane to be up to find each other, and ``torchrun --node-rank`` makes
the ranks the same at every launch. Each node gets a token of its own
(:func:`node_token`): the control plane's ingest takes a node's events only as that
node, so a node after the first cannot report the run's progress or its end. All or
nothing: a node that cannot be had terminates the ones already launched, and the
launch's error (no capacity: try the next zone) is the gang's.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import re
import signal
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime, timezone

from jobs.providers.base import (
    TAG_NODE,
    InstanceInfo,
    InstanceNotFound,
    InstanceState,
    InstanceStatus,
    LaunchRequest,
    ProviderError,
)
from runner import EXIT_PREEMPTED
from runner import env as contract

__all__ = [
    "GANG_SEP",
    "MASTER_PORT",
    "combine",
    "gang_id",
    "group",
    "launch",
    "node_ids",
    "node_request",
    "node_token",
    "parse_node_token",
    "status",
    "terminate",
]

log = logging.getLogger(__name__)

#: Joins a gang's node ids into its instance id; no cloud's instance ids contain it.
GANG_SEP = "+"
#: The port torchrun's static rendezvous (its TCP store) listens on, on node 0: torchrun's
#: own default.
MASTER_PORT = 29500


#: The variable that holds an instance's runner token (``runner.cli`` reads it).
TOKEN_ENV = contract.TOKEN.name
_NODE_TOKEN = re.compile(r"n([1-9][0-9]{0,3})\.([A-Za-z0-9-]{1,64})\.([0-9a-f]{64})")


def node_token(attempt_token: str, attempt_id: str, rank: int) -> str:
    """Node ``rank``'s runner token: node 0 holds the attempt's own; node k ≥ 1 holds
    ``n{k}.{attempt id}.{HMAC(attempt token, rank)}``.

    Only a holder of the attempt's token (node 0, or the control plane, which derives it
    from its secret) can make a node's token, and one node's token gives no other's.
    The attempt id inside lets the control plane find the attempt before it reads the
    batch (``/v1/credentials`` has no batch); nothing for a node is stored.
    """
    if rank == 0:
        return attempt_token
    mac = hmac.new(attempt_token.encode(), f"node {rank}".encode(), hashlib.sha256)
    return f"n{rank}.{attempt_id}.{mac.hexdigest()}"


def parse_node_token(token: str) -> tuple[int, str] | None:
    """``(rank, attempt id)`` of a token shaped like a node's (k ≥ 1), else None. Says
    nothing of whether it is genuine: compare it with :func:`node_token`."""
    match = _NODE_TOKEN.fullmatch(token)
    return None if match is None else (int(match.group(1)), match.group(2))


def node_ids(instance_id: str) -> list[str]:
    """The node ids of an instance id: one for a plain instance, N for a gang."""
    return instance_id.split(GANG_SEP)


def gang_id(ids: Sequence[str]) -> str:
    """The instance id of a gang whose nodes are ``ids``, in node rank order."""
    return GANG_SEP.join(ids)


def node_request(
    req: LaunchRequest, rank: int, *, master_addr: str, master_port: int
) -> LaunchRequest:
    """The launch of node ``rank`` of ``req``'s gang: its own idempotency key (node 0
    keeps the attempt's, so a one-node attempt launches as it always did), its own
    runner token (:func:`node_token`: node 0 keeps the attempt's), and the variables
    ``trainbot-runner exec`` starts torchrun with."""
    key = req.idempotency_key or req.attempt_id
    env = dict(req.env)
    if TOKEN_ENV in env:
        env[TOKEN_ENV] = node_token(env[TOKEN_ENV], req.attempt_id, rank)
    env |= contract.render(
        {
            contract.NNODES: req.nodes,
            contract.NODE_RANK: rank,
            contract.MASTER_ADDR: master_addr,
            contract.MASTER_PORT: master_port,
        }
    )
    return replace(
        req, env=env, node_rank=rank, idempotency_key=key if rank == 0 else f"{key}-n{rank}"
    )


def launch(
    one: Callable[[LaunchRequest], InstanceInfo],
    req: LaunchRequest,
    *,
    terminate_one: Callable[[str], None],
    master_port: int = MASTER_PORT,
    loopback: bool = False,
) -> InstanceInfo:
    """Launch ``req.nodes`` nodes with ``one`` (the provider's launch of one instance),
    node 0 first; all or none. ``loopback``: every node is on this machine (the local
    provider), so node 0 is reached at 127.0.0.1."""
    if req.nodes < 2:
        return one(req)
    launched: list[InstanceInfo] = []
    try:
        # Node 0 listens: it reaches its own store through the loopback.
        first = one(node_request(req, 0, master_addr="127.0.0.1", master_port=master_port))
        launched.append(first)
        address = "127.0.0.1" if loopback else first.address
        if not address:
            raise ProviderError(
                f"node 0 of attempt {req.attempt_id} ({first.instance_id}) has no private "
                "address yet, so the other nodes could not reach it; the launch is retried"
            )
        for rank in range(1, req.nodes):
            node = node_request(req, rank, master_addr=address, master_port=master_port)
            launched.append(one(node))
    except ProviderError as exc:
        if launched:
            ids = ", ".join(i.instance_id for i in launched)
            log.warning(
                "gang of attempt %s: node %d of %d could not launch (%s); terminating %s",
                req.attempt_id,
                len(launched),
                req.nodes,
                exc,
                ids,
            )
            _each(terminate_one, [i.instance_id for i in launched])
        raise
    return _as_one(launched)


def _as_one(nodes: Sequence[InstanceInfo]) -> InstanceInfo:
    """One InstanceInfo for a gang's nodes, node 0's fields with the gang's id and state."""
    first = nodes[0]
    combined = combine(
        gang_id([n.instance_id for n in nodes]),
        [InstanceStatus(n.instance_id, n.state, "") for n in nodes],
    )
    return replace(first, instance_id=combined.instance_id, state=combined.state)


def status(
    one: Callable[[str], InstanceStatus], instance_id: str, *, window_s: float = 0.0
) -> InstanceStatus:
    """``one`` for a plain instance; the combined state of a gang's nodes for a gang.
    ``window_s``: the provider's termination window (see :func:`combine`)."""
    ids = node_ids(instance_id)
    if len(ids) == 1:
        return one(instance_id)
    nodes: list[InstanceStatus] = []
    missing = 0
    for nid in ids:
        try:
            nodes.append(one(nid))
        except InstanceNotFound:
            missing += 1
            nodes.append(InstanceStatus(nid, InstanceState.TERMINATED, "the instance is gone"))
    if missing == len(ids):
        raise InstanceNotFound(f"no node of {instance_id} exists", instance_id=instance_id)
    return combine(instance_id, nodes, window_s=window_s)


def _lost(node: InstanceStatus) -> bool:
    """A node that ended without notice and not by its own failure: killed from outside
    (SIGKILL, a vanished process) or terminated by someone other than the gang's end."""
    if node.state is InstanceState.TERMINATED:
        return True
    killed = (None, -signal.SIGKILL, 128 + signal.SIGKILL)  # unrecorded, or SIGKILL
    return node.state is InstanceState.FAILED and node.exit_code in killed


def combine(
    instance_id: str,
    nodes: Sequence[InstanceStatus],
    *,
    window_s: float = 0.0,
    now: datetime | None = None,
) -> InstanceStatus:
    """A gang's state from its nodes' (node rank order).

    While no node has ended, the gang runs (or is pending). Once one has ended other than
    by succeeding, the gang cannot go on: every rank is in the same collectives. Then,
    in this order, the first node that was preempted makes it PREEMPTED; one that was lost
    (killed from outside, terminated while the others ran) LOST, which resumes like a
    preemption; every node terminated TERMINATED; else FAILED, with the failed node's
    exit code. A gang has SUCCEEDED once every node has.

    A node preempted with a clean exit (75: its part of the last step is written) leaves
    the others running for up to ``window_s`` after its notice: they heard it through
    the ranks' stop vote and are flushing their parts, and node 0 commits the step once
    every part is in. Ending the gang at once would terminate node 0 before that commit.
    Node 0's own exit ends the attempt as soon as it has committed.
    """
    ended = [(r, n) for r, n in enumerate(nodes) if n.state.is_terminal()]
    bad = [(r, n) for r, n in ended if n.state is not InstanceState.SUCCEEDED]
    running = len(ended) < len(nodes)
    if running and bad and all(_flushed(n, window_s, now) for _, n in bad):
        rank, node = bad[0]
        return InstanceStatus(
            instance_id,
            InstanceState.RUNNING,
            f"node {rank} ({node.instance_id}) was preempted and flushed its part; the "
            "other nodes are flushing theirs",
            preempted_at=node.preempted_at,
        )
    if not bad:
        if len(ended) == len(nodes):
            return InstanceStatus(
                instance_id, InstanceState.SUCCEEDED, "every node's command exited 0", exit_code=0
            )
        states = {n.state for n in nodes if not n.state.is_terminal()}
        state = next(
            (s for s in (InstanceState.UNKNOWN, InstanceState.PENDING) if s in states),
            InstanceState.RUNNING,
        )
        done = [r for r, _ in ended]
        reason = f"{len(nodes)} nodes {state.value}"
        if done:
            reason += f"; node {', '.join(map(str, done))} finished, the others still run"
        return InstanceStatus(instance_id, state, reason)

    def said(
        rank: int, node: InstanceStatus, state: InstanceState, why: str = ""
    ) -> InstanceStatus:
        return InstanceStatus(
            instance_id,
            state,
            f"node {rank} ({node.instance_id}): {node.reason}{why}",
            exit_code=node.exit_code,
            preempted_at=node.preempted_at,
        )

    for rank, node in bad:
        if node.state is InstanceState.PREEMPTED:
            return said(rank, node, InstanceState.PREEMPTED)
    if all(n.state is InstanceState.TERMINATED for _, n in bad) and len(bad) == len(nodes):
        return said(*bad[0], InstanceState.TERMINATED)
    for rank, node in bad:
        if _lost(node):
            why = "; the node was lost, so the gang resumes from its last committed step"
            return replace(said(rank, node, InstanceState.LOST, why), exit_code=EXIT_PREEMPTED)
    rank, node = bad[0]
    return said(rank, node, InstanceState.FAILED)


def _flushed(node: InstanceStatus, window_s: float, now: datetime | None) -> bool:
    """A node preempted that exited 75 less than ``window_s`` after its notice."""
    if node.state is not InstanceState.PREEMPTED or node.exit_code != EXIT_PREEMPTED:
        return False
    if node.preempted_at is None or window_s <= 0:
        return False
    now = now or datetime.now(timezone.utc)
    return (now - node.preempted_at).total_seconds() < window_s


def terminate(terminate_one: Callable[[str], None], instance_id: str) -> None:
    """End every node of the instance, at once (a node's end may wait out a grace)."""
    _each(terminate_one, node_ids(instance_id))


def _each(terminate_one: Callable[[str], None], ids: Sequence[str]) -> None:
    if len(ids) == 1:
        terminate_one(ids[0])
        return
    errors: list[str] = []

    def one(nid: str) -> None:
        try:
            terminate_one(nid)
        except InstanceNotFound:
            pass
        except ProviderError as exc:
            errors.append(f"{nid}: {exc}")

    with ThreadPoolExecutor(max_workers=min(len(ids), 16)) as pool:
        list(pool.map(one, ids))
    if errors:
        raise ProviderError("could not terminate every node: " + "; ".join(errors))


def group(instances: Iterable[InstanceInfo]) -> list[InstanceInfo]:
    """``list_instances``' answer with each gang's nodes as one instance (those that carry
    TAG_NODE), in the order of each gang's first node."""
    out: list[InstanceInfo | list[InstanceInfo]] = []
    gangs: dict[str, list[InstanceInfo]] = {}
    for info in instances:
        if TAG_NODE not in info.tags or not info.attempt_id:
            out.append(info)
            continue
        nodes = gangs.get(info.attempt_id)
        if nodes is None:
            nodes = gangs[info.attempt_id] = []
            out.append(nodes)
        nodes.append(info)

    def rank(info: InstanceInfo) -> float:
        try:
            return int(info.tags[TAG_NODE])
        except ValueError:
            return math.inf

    return [
        item if isinstance(item, InstanceInfo) else _as_one(sorted(item, key=rank)) for item in out
    ]

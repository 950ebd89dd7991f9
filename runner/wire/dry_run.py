"""What a cloud dry run's instance tells the control plane: ``POST /v1/dry-run``.

A dry run on a cloud instance (``trainbot-runner dry-run`` started by the instance's
boot script) has no attempt and sends no event batches: it reports where it stands, with
its own token, a few times in all: ``started`` once the runner runs, ``saved`` once the
first phase committed its checkpoint, and ``finished`` with the report
(:class:`runner.dryrun.DryRunReport` as a dict), after which the control plane
terminates the instance.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from runner.errors import WireError
from runner.wire.schema import WIRE_VERSION, json_safe

__all__ = [
    "DRY_RUN_PHASES",
    "DRY_RUN_ROUTE",
    "MAX_BODY_BYTES",
    "DryRunPost",
    "decode_dry_run_post",
    "encode_dry_run_post",
]

#: The control plane's route, beside ``/v1/events``.
DRY_RUN_ROUTE = "/v1/dry-run"
Phase = Literal["started", "saved", "finished"]
DRY_RUN_PHASES: tuple[str, ...] = ("started", "saved", "finished")
#: A report is a few dozen figures; anything near this is not one.
MAX_BODY_BYTES = 64 * 1024


class DryRunPost(msgspec.Struct, forbid_unknown_fields=True):
    """One report of the dry run's instance."""

    v: int
    #: The dry run's id (the control plane's ``DryRunInstance.id``); the token's scope.
    dry_run: str
    phase: Phase
    #: With ``finished``: the report's fields; non-finite floats stay the wire's strings
    #: (JSON columns take no NaN), :func:`runner.wire.restore_floats` turns them back.
    report: dict[str, Any] | None = None


def encode_dry_run_post(dry_run: str, phase: str, report: dict[str, Any] | None = None) -> bytes:
    """The body for ``phase`` (one of :data:`DRY_RUN_PHASES`)."""
    if phase not in DRY_RUN_PHASES:
        raise WireError(f"dry-run phase {phase!r} is not one of {', '.join(DRY_RUN_PHASES)}")
    doc = {"v": WIRE_VERSION, "dry_run": dry_run, "phase": phase}
    if report is not None:
        doc["report"] = json_safe(report)
    return msgspec.json.encode(doc)


def decode_dry_run_post(body: bytes) -> DryRunPost:
    """Parse and check a body; raises WireError saying what is wrong with it."""
    if len(body) > MAX_BODY_BYTES:
        raise WireError(f"a dry-run report of {len(body)} bytes is over {MAX_BODY_BYTES}")
    try:
        post = msgspec.json.decode(body, type=DryRunPost)
    except msgspec.DecodeError as exc:
        raise WireError(f"not a dry-run report: {exc}") from None
    if post.v != WIRE_VERSION:
        raise WireError(f"dry-run report version {post.v}; this control plane reads {WIRE_VERSION}")
    if (post.phase == "finished") != (post.report is not None):
        raise WireError("a report comes with the 'finished' phase, and only with it")
    return post

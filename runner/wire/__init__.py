"""The telemetry wire format, shared by the runner and the control plane.

A batch is the body of one ``POST`` to the ingest API: ``{"v": 1, "attempt", "run",
"events": [{"seq", "type", "time", "data"}, …], "node"}`` (``node`` only from the
nodes after the first of a multi-node attempt), its events' payloads described once, by
the msgspec structs of :mod:`runner.wire.schema`. It lives in ``runner/`` because the
runner never imports ``jobs/``. The design: ``docs/architecture.md``, "The wire format".
"""

from runner.wire.checks import encode_batch, event_from_wire, event_to_wire, validate_payload
from runner.wire.decode import Batch, decode_batch, decode_batch_columns, decode_batch_with_json
from runner.wire.dry_run import (
    DRY_RUN_ROUTE,
    DryRunPost,
    decode_dry_run_post,
    encode_dry_run_post,
)
from runner.wire.schema import (
    EVENT_TYPES,
    EXIT_REASONS,
    MAX_UNIX_TIME,
    NODE_SEQ_SPAN,
    PAYLOADS,
    WIRE_VERSION,
    Event,
    json_safe,
    restore_floats,
)

__all__ = [
    "DRY_RUN_ROUTE",
    "EVENT_TYPES",
    "EXIT_REASONS",
    "MAX_UNIX_TIME",
    "NODE_SEQ_SPAN",
    "PAYLOADS",
    "WIRE_VERSION",
    "Batch",
    "DryRunPost",
    "Event",
    "decode_batch",
    "decode_batch_columns",
    "decode_batch_with_json",
    "decode_dry_run_post",
    "encode_batch",
    "encode_dry_run_post",
    "event_from_wire",
    "event_to_wire",
    "json_safe",
    "restore_floats",
    "validate_payload",
]

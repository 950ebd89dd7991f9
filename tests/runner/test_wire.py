"""The telemetry wire format: round trips, non-finite floats, and every kind of bad batch."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runner.errors import WireError
from runner.wire import (
    EVENT_TYPES,
    WIRE_VERSION,
    Event,
    decode_batch,
    decode_batch_columns,
    decode_batch_with_json,
    encode_batch,
    json_safe,
    validate_payload,
)
from runner.wire.decode import _decode_general, _decode_typed
from runner.wire.schema import ALERT_TITLE_MAX, STACKS_TEXT_MAX

PAYLOADS: dict[str, dict[str, Any]] = {
    "metrics": {
        "step": 10,
        "loss": 2.5,
        "step_time_s": 0.31,
        "data_wait_fraction": 0.2,
        "metrics": {"lr": 0.001, "acc": 0.5},
    },
    "system": {
        "gpu_util": 87.5,
        "gpu_count": 8,
        "disk_used": 10**12,
        "disk_total": 2 * 10**12,
        "disk_path": "/scratch",
        "node": 0,
        "data_wait_fraction": None,
    },
    "checkpoint_committed": {
        "step": 100,
        "bytes": 123456789,
        "write_s": 4.2,
        "uri": "s3://bucket/run-1/step-0000000100",
        "stall_s": 0.05,
        "interval_s": None,
    },
    "checkpoint_failed": {"step": 100, "error": "S3 SlowDown"},
    "restored": {"step": 100, "fallback_from": 200, "restore_s": 3.0},
    "preemption_notice": {"source": "aws", "time_left_s": 118.0},
    "exit": {
        "code": 75,
        "reason": "preempted",
        "flush": {
            "notice_step": 120,
            "window_s": 118.0,
            "used_s": 117.2,
            "flushes": [
                {"step": 120, "started_s": 0.01, "landed": True, "write_s": 9.5},
                {"step": 180, "started_s": 101.0, "landed": False, "write_s": None},
            ],
            "committed_step": 120,
            "trained_on_steps": 60,
            "given_up_steps": 60,
            "summary": "flushed step 120; step 180 did not land in time",
        },
        "log_tail": "step 180\nRuntimeError: loss <nan> & rising",
    },
    "heartbeat": {"step": None},
    "log": {"level": "warning", "message": "data loader slow"},
    "dry_run": {"report": {"step_time_s": 0.3, "checkpoint_bytes": 1024, "ok": True}},
    "started": {"pid": 4242, "host": "ip-10-0-0-1"},
    "alert": {
        "title": "val_loss stuck",
        "text": "no better in 3 evals",
        "severity": "warning",
        "step": 7,
    },
    "stacks": {"step": 50, "stalled_s": 61.5, "processes": 1, "text": 'File "t.py", line 9'},
}


def make_events(*, attempt: str = "att-1", run: str = "run-1") -> list[Event]:
    return [
        Event(attempt=attempt, seq=i, type=t, time=1_700_000_000.0 + i, run=run, data=d)
        for i, (t, d) in enumerate(sorted(PAYLOADS.items()))
    ]


def body(events: Any, **top: Any) -> bytes:
    obj: dict[str, Any] = {"v": WIRE_VERSION, "attempt": "att-1", "run": "run-1", "events": events}
    obj.update(top)
    return json.dumps(obj).encode()


def wire_event(seq: int = 0, type: str = "heartbeat", **data: Any) -> dict[str, Any]:
    payload = dict(PAYLOADS[type])
    payload.update(data)
    return {"seq": seq, "type": type, "time": 1.0, "data": payload}


def test_every_type_has_a_sample() -> None:
    assert set(PAYLOADS) == EVENT_TYPES


def test_alert_and_stacks_are_bounded() -> None:
    long_title = wire_event(0, "alert", title="x" * (ALERT_TITLE_MAX + 1))
    with pytest.raises(WireError, match=f"title: expected at most {ALERT_TITLE_MAX} characters"):
        decode_batch(body([long_title]))
    with pytest.raises(WireError, match="severity: expected one of critical, info, warning"):
        decode_batch(body([wire_event(0, "alert", severity="page-everyone")]))
    with pytest.raises(WireError, match="title: expected a non-empty string"):
        decode_batch(body([wire_event(0, "alert", title="")]))
    with pytest.raises(WireError, match=f"text: expected at most {STACKS_TEXT_MAX} characters"):
        decode_batch(body([wire_event(0, "stacks", text="y" * (STACKS_TEXT_MAX + 1))]))
    # An older runner's alert without a step is read (the field has a default).
    old = wire_event(0, "alert")
    del old["data"]["step"]
    assert decode_batch(body([old]))[0].data["step"] is None


def test_round_trip_of_every_type() -> None:
    events = make_events()
    raw = encode_batch(events)
    top = json.loads(raw)
    assert top["v"] == 1 and top["attempt"] == "att-1" and top["run"] == "run-1"
    assert set(top["events"][0]) == {"seq", "type", "time", "data"}
    assert decode_batch(raw) == events


def test_nan_and_infinity_survive_as_standard_json() -> None:
    event = Event(
        attempt="a",
        seq=0,
        type="metrics",
        time=1.0,
        run="r",
        data={
            "step": 1,
            "loss": math.nan,
            "step_time_s": math.inf,
            "data_wait_fraction": None,
            "metrics": {"grad_norm": -math.inf, "ok": 1.0},
            "extra": {"nested": [math.nan, "text"]},
        },
    )
    raw = encode_batch([event])

    def strict(name: str) -> None:
        raise AssertionError(f"non-standard JSON literal {name}")

    json.loads(raw, parse_constant=strict)
    assert b'"NaN"' in raw and b'"Infinity"' in raw and b'"-Infinity"' in raw
    data = decode_batch(raw)[0].data
    assert math.isnan(data["loss"])
    assert data["step_time_s"] == math.inf
    assert data["metrics"]["grad_norm"] == -math.inf
    assert math.isnan(data["extra"]["nested"][0]) and data["extra"]["nested"][1] == "text"


def test_declared_strings_stay_strings() -> None:
    event = Event("a", 0, "log", 1.0, "r", {"level": "info", "message": "NaN"})
    assert decode_batch(encode_batch([event]))[0].data["message"] == "NaN"


def test_numbers_are_normalised_and_extras_pass_through() -> None:
    data = validate_payload(
        "metrics",
        {
            "step": 3,
            "loss": Fraction(1, 2),
            "step_time_s": 1,
            "data_wait_fraction": 0,
            "metrics": {},
            "tokens": 99,
        },
    )
    assert data["loss"] == 0.5 and isinstance(data["step_time_s"], float)
    assert data["tokens"] == 99


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (b"{not json", "body: not valid JSON"),
        (b"[1, 2]", "body: expected a JSON object"),
        (
            b'{"v": 1, "attempt": "a", "run": "r", "events": [{"seq": 0, "type": "metrics",'
            b' "time": 1, "data": {"step": 1, "loss": NaN}}]}',
            "body: NaN",
        ),
        (body([wire_event()], v=2), "v: unsupported wire version 2"),
        (body([wire_event()], v=True), "v: unsupported wire version"),
        (json.dumps({"attempt": "a", "run": "r", "events": []}).encode(), "v: missing"),
        (json.dumps({"v": 1, "attempt": "a", "run": "r"}).encode(), "events: missing"),
        (body([wire_event()], attempt=""), "attempt: expected a non-empty string"),
        (body([wire_event()], run=7), "run: expected a non-empty string"),
        (body({"seq": 0}), "events: expected a list"),
        (body([]), "events: the batch is empty"),
        (body([wire_event(), 5]), "events[1]: expected an object"),
        (body([{"seq": 0, "type": "heartbeat", "data": {}}]), "events[0].time: missing"),
        (
            body([wire_event(0), wire_event(1, "metrics", step="3")]),
            "events[1].data.step: expected an integer",
        ),
        (body([wire_event(0, "metrics", step=True)]), "events[0].data.step: expected an integer"),
        (
            body([wire_event(0, "metrics", step=-1)]),
            "events[0].data.step: expected an integer >= 0",
        ),
        (
            body(
                [
                    wire_event(0),
                    {**wire_event(1), "data": {"step": None}},
                    wire_event(2, "restored", restore_s="slow"),
                ]
            ),
            "events[2].data.restore_s: expected a number",
        ),
        (
            body(
                [wire_event(0), {"seq": 1, "type": "metrics", "time": 1.0, "data": {"loss": 1.0}}]
            ),
            "events[1].data.step: missing",
        ),
        (body([{**wire_event(0), "type": "gossip"}]), "events[0].type: unknown event type"),
        (body([wire_event(-1)]), "events[0].seq: expected an integer >= 0"),
        (body([wire_event(1.5)]), "events[0].seq: expected an integer"),  # type: ignore[arg-type]
        (body([{**wire_event(0), "time": "noon"}]), "events[0].time: expected a number"),
        (body([{**wire_event(0), "time": "NaN"}]), "events[0].time: expected unix seconds"),
        (body([{**wire_event(0), "data": [1]}]), "events[0].data: expected an object"),
        (
            body([wire_event(0), {**wire_event(1), "attempt": "other"}]),
            "events[1].attempt: 'other' differs",
        ),
        (
            body([wire_event(0, "system", gpu_util=150)]),
            "events[0].data.gpu_util: expected a number in",
        ),
        (
            body([wire_event(0, "metrics", data_wait_fraction=1.5)]),
            "events[0].data.data_wait_fraction",
        ),
        (
            body([wire_event(0, "metrics", metrics={"acc": "high"})]),
            "events[0].data.metrics.acc: expected a number",
        ),
        (
            body([wire_event(0, "exit", reason="exploded")]),
            "events[0].data.reason: expected one of",
        ),
        (body([wire_event(0, "dry_run", report=[])]), "events[0].data.report: expected an object"),
        (body([wire_event(0, "log", message=None)]), "events[0].data.message: expected a string"),
    ],
)
def test_malformed_batches_name_the_field(raw: bytes, where: str) -> None:
    with pytest.raises(WireError) as info:
        decode_batch(raw)
    assert str(info.value).startswith(where.split(":")[0])
    assert where in str(info.value)


def test_too_many_events() -> None:
    raw = body([wire_event(i) for i in range(4)])
    assert len(decode_batch(raw, max_events=4)) == 4
    with pytest.raises(WireError, match=r"^events: 4 events in one batch, more than 3"):
        decode_batch(raw, max_events=3)


def test_encode_refuses_mixed_attempts_and_runs() -> None:
    events = make_events()
    mixed = [events[0], Event("att-2", 1, "heartbeat", 1.0, "run-1", {"step": 1})]
    with pytest.raises(WireError, match=r"^events\[1\]\.attempt: 'att-2' differs"):
        encode_batch(mixed)
    mixed = [events[0], Event("att-1", 1, "heartbeat", 1.0, "run-2", {"step": 1})]
    with pytest.raises(WireError, match=r"^events\[1\]\.run: 'run-2' differs"):
        encode_batch(mixed)
    with pytest.raises(WireError, match="empty"):
        encode_batch([])


def test_encode_validates_events() -> None:
    good = make_events()[0]
    bad = Event("att-1", 1, "checkpoint_committed", 1.0, "run-1", {"step": 1, "bytes": 2})
    with pytest.raises(WireError, match=r"^events\[1\]\.data\.write_s: missing"):
        encode_batch([good, bad])
    with pytest.raises(WireError, match=r"^events\[0\]\.seq"):
        encode_batch([Event("att-1", -5, "heartbeat", 1.0, "run-1", {"step": 1})])
    with pytest.raises(WireError, match="not JSON-able"):
        encode_batch([Event("att-1", 0, "heartbeat", 1.0, "run-1", {"step": 1, "x": object()})])


# --- decode_batch_columns / decode_batch_with_json: the ingest API's decoders --------------


def compact(events: Any, **top: Any) -> bytes:
    """A body laid out as encode_batch writes it (compact separators)."""
    obj: dict[str, Any] = {"v": WIRE_VERSION, "attempt": "att-1", "run": "run-1", "events": events}
    obj.update(top)
    return json.dumps(obj, separators=(",", ":")).encode()


def metrics_event(seq: int, **data: Any) -> dict[str, Any]:
    return {
        "seq": seq,
        "type": "metrics",
        "time": 1.5 + seq,
        "data": {**PAYLOADS["metrics"], **data},
    }


def test_with_json_gives_the_events_and_their_data_texts() -> None:
    events = make_events()
    raw = encode_batch(events)

    decoded, texts = decode_batch_with_json(raw)

    assert decoded == events == decode_batch(raw)
    assert [json.loads(t) for t in texts] == [json_safe(e.data) for e in events]


def test_columns_hold_what_the_events_hold() -> None:
    events = make_events()

    batch = decode_batch_columns(encode_batch(events))

    assert (batch.attempt, batch.run, len(batch)) == ("att-1", "run-1", len(events))
    assert batch.events() == events
    assert [batch.event(i) for i in range(len(batch))] == events
    picked = batch.select([3, 1])
    assert picked.events() == [events[3], events[1]]
    assert picked.texts == [batch.texts[3], batch.texts[1]]


def test_a_json_array_is_the_texts_joined_on_either_path() -> None:
    def metrics(step: int, loss: float) -> Event:
        data = {"step": step, "loss": loss, "step_time_s": 0.5, "data_wait_fraction": 0.1}
        return Event("a", step, "metrics", 1.0 + step, "r", {**data, "metrics": {"lr": 1e-3}})

    events = [metrics(i, 1.0 / (i + 1)) for i in range(4)]
    fast = decode_batch_columns(encode_batch(events))
    general = decode_batch_columns(encode_batch([*events, metrics(4, math.nan)]))  # "NaN"
    assert fast.given_texts is None and general.given_texts is not None

    for batch in (fast, general):
        positions = [2, 0, 3]
        array = batch.json_array(positions)
        assert array == "[" + ",".join(batch.texts[i] for i in positions) + "]"
        assert json.loads(array) == [json.loads(batch.texts[i]) for i in positions]
    assert fast.texts == general.texts[:4]
    assert json.loads(general.json_array([4]))[0]["loss"] == "NaN"


def test_with_json_keeps_nan_as_the_wire_string() -> None:
    data = {"step": 1, "loss": math.nan, "step_time_s": 1, "data_wait_fraction": None}
    raw = encode_batch([Event("a", 0, "metrics", 1.0, "r", {**data, "metrics": {}})])

    (event,), texts = decode_batch_with_json(raw)

    assert math.isnan(event.data["loss"]) and event.data["step_time_s"] == 1.0
    assert json.loads(texts[0])["loss"] == "NaN"


def test_other_layouts_decode_to_the_same_events_and_texts() -> None:
    events = make_events()
    raw = encode_batch(events)
    pretty = json.dumps(json.loads(raw), indent=2).encode()
    escaped = raw.replace(b'"attempt":"att-1"', b'"attempt":"att\\u002d1"')
    reordered = raw.replace(b'{"v":1,"attempt":"att-1",', b'{"attempt":"att-1","v":1,')
    _, expected = decode_batch_with_json(raw)

    for other in (pretty, escaped, reordered, raw + b"\n", b"\xef\xbb\xbf" + raw):
        assert other != raw
        decoded, texts = decode_batch_with_json(other)
        assert decoded == events
        assert [json.loads(t) for t in texts] == [json.loads(t) for t in expected]


@pytest.mark.parametrize(
    "data",
    [
        {},  # as the runner sends it
        {"loss": None, "data_wait_fraction": None, "metrics": {}},
        {"loss": 1, "step_time_s": 2, "metrics": {"acc": 1}},  # ints where floats go
        {"loss": "NaN", "metrics": {"grad_norm": "-Infinity"}},
        {"note": "extra fields pass through", "nested": {"x": [1, "Infinity"]}},
        {"data_wait_fraction": 1},
    ],
)
def test_every_metrics_payload_decodes_as_validate_payload_checks_it(data: dict[str, Any]) -> None:
    sent = {**PAYLOADS["metrics"], **data}
    raw = compact([metrics_event(0, **data), metrics_event(1)])

    batch = decode_batch_columns(raw)

    expected = validate_payload("metrics", sent)
    assert json.dumps(json_safe(batch.data[0]), sort_keys=True) == json.dumps(
        json_safe(expected), sort_keys=True
    )
    assert json.loads(batch.texts[0]) == sent  # "NaN" kept as sent; 1 as 1.0


@pytest.mark.parametrize(
    "data",
    [{}, {"gpu_util": None}, {"gpu_util": 50}, {"disk_used": 0, "gpu_count": 0}, {"x": 1}],
)
def test_every_system_payload_decodes_as_validate_payload_checks_it(data: dict[str, Any]) -> None:
    sent = {**PAYLOADS["system"], **data}
    raw = compact([{"seq": 0, "type": "system", "time": 2.5, "data": sent}])

    batch = decode_batch_columns(raw)

    assert batch.data[0] == validate_payload("system", sent)
    assert json.loads(batch.texts[0]) == sent


def test_extra_numbers_keep_their_size_and_declared_integers_are_64_bit() -> None:
    huge = 10**25
    raw = compact([metrics_event(0, note=huge), metrics_event(1, big=-(2**63) - 1)])

    batch = decode_batch_columns(raw)

    assert batch.data[0]["note"] == huge and type(batch.data[0]["note"]) is int
    assert json.loads(batch.texts[0])["note"] == huge
    assert json.loads(batch.texts[1])["big"] == -(2**63) - 1
    # A declared integer lands in a 64-bit column: the schema refuses a larger one.
    with pytest.raises(WireError, match=rf"^events\[0\]\.data\.step: {2**64 + 1} is above"):
        decode_batch_columns(compact([metrics_event(0, step=2**64 + 1)]))


def test_what_only_the_json_module_accepted_is_refused_with_the_reason() -> None:
    # 1e999 was infinity to json.loads, and a lone surrogate a str there; the wire is
    # standard JSON, as encode_batch writes it, and says where the problem is.
    raw = compact([metrics_event(0, loss=2.0), {**wire_event(1, "log"), "time": 3.0}])
    infinite = raw.replace(b'"loss":2.0', b'"loss":1e999')
    lone = raw.replace(b'"data loader slow"', b'"half \\ud800 a pair"')

    with pytest.raises(WireError, match=r"^body: .*the number at events\[0\]\.data.* out of range"):
        decode_batch_columns(infinite)
    with pytest.raises(WireError, match=r"^body: not valid JSON"):
        decode_batch_columns(lone)


def test_texts_keep_non_ascii_strings() -> None:
    data = {"level": "info", "message": "ünïcödé \u2028 ✓"}
    raw = encode_batch([Event("a", 0, "log", 1.0, "r", data)])

    (event,), texts = decode_batch_with_json(raw)

    assert event.data == data and json.loads(texts[0]) == data


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (compact([wire_event(0, "metrics", step="3")]), "events[0].data.step: expected an integer"),
        (
            compact([wire_event(0, "metrics", step=True)]),
            "events[0].data.step: expected an integer",
        ),
        (
            compact([wire_event(0), wire_event(1, "metrics", step=-1)]),
            "events[1].data.step: expected an integer >= 0",
        ),
        (compact([{**wire_event(0), "type": "gossip"}]), "events[0].type: unknown event type"),
        (compact([{**wire_event(0), "type": ["metrics"]}]), "events[0].type: unknown event type"),
        (
            compact([wire_event(0, "exit", reason=["failed"])]),
            "events[0].data.reason: expected one of",
        ),
        (
            compact([wire_event(0, "metrics", loss=10**400)]),
            "events[0].data.loss: expected a number in a float's range",
        ),
        (
            compact([wire_event(0, "metrics", loss="high")]),
            "events[0].data.loss: expected a number",
        ),
        (
            compact([wire_event(0, "metrics", metrics={"acc": None})]),
            "events[0].data.metrics.acc: expected a number",
        ),
        (compact([{**wire_event(0), "time": -1}]), "events[0].time: expected unix seconds"),
        (
            compact([{**wire_event(0), "time": 1.5}]).replace(b":1.5,", b":1e999,"),
            "body: not valid JSON for the wire: the number at events[0].time is out of range",
        ),
        (compact([{**wire_event(0), "data": None}]), "events[0].data: expected an object"),
        (compact([wire_event(0), wire_event(1)])[:-3] + b"}", "body: not valid JSON"),
        (compact([wire_event(0)]) + b"{}", "body: not valid JSON"),
        (compact([wire_event(0, "metrics", loss=2.0)]).replace(b"2.0", b"NaN"), "body: NaN"),
        (compact([wire_event(0)]).replace(b'"seq":0', b'"seq":' + b"9" * 5000), "body: not valid"),
    ],
)
def test_with_json_reports_what_decode_batch_reports(raw: bytes, where: str) -> None:
    with pytest.raises(WireError) as ours:
        decode_batch_with_json(raw)
    with pytest.raises(WireError) as reference:
        decode_batch(raw)

    assert str(ours.value) == str(reference.value)
    assert str(ours.value).startswith(where.split(":")[0])
    assert where in str(ours.value)


def test_with_json_honours_max_events() -> None:
    raw = encode_batch([Event("a", i, "heartbeat", 1.0, "r", {"step": i}) for i in range(4)])

    assert len(decode_batch_with_json(raw, max_events=4)[0]) == 4
    with pytest.raises(WireError, match=r"^events: 4 events in one batch, more than 3"):
        decode_batch_with_json(raw, max_events=3)


def test_values_python_cannot_convert_are_wire_errors_too() -> None:
    payload = {"step": 1, "bytes": 1, "write_s": 10**400, "uri": "u"}
    with pytest.raises(WireError, match=r"^data\.write_s: expected a number in a float's range"):
        validate_payload("checkpoint_committed", payload)
    with pytest.raises(WireError, match=r"^type: unknown event type \['metrics'\]"):
        validate_payload(["metrics"], {})  # type: ignore[arg-type]


# --- the fast path and the general path agree --------------------------------------------

_ODD_VALUES: st.SearchStrategy[Any] = st.sampled_from(
    [None, True, False, -1, 0, 1, 7, 1.5, -0.0, 0.25, 100.0, 101.0, 2**63 - 1, 2**63, 2**64,
     -(2**63) - 1, 1e308, "NaN", "Infinity", "x", "", [], {}, {"a": 1}, {"a": "NaN"}]
)  # fmt: skip


@st.composite
def _events(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from([*sorted(EVENT_TYPES), "gossip"]))
    data: dict[str, Any] = dict(PAYLOADS.get(kind, {}))
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2]))):
        action = draw(st.sampled_from(["set", "drop", "extra"]))
        if action == "set" and data:
            data[draw(st.sampled_from(sorted(data)))] = draw(_ODD_VALUES)
        elif action == "drop" and data:
            del data[draw(st.sampled_from(sorted(data)))]
        elif action == "extra":
            data["extra"] = draw(_ODD_VALUES)
    event: dict[str, Any] = {
        "seq": draw(st.integers(0, 10**6) if draw(st.integers(0, 9)) else _ODD_VALUES),
        "type": kind,
        "time": draw(
            st.one_of(st.floats(0, 2e9), st.integers(0, 2**40))
            if draw(st.integers(0, 9))
            else _ODD_VALUES
        ),
        "data": data,
    }
    if not draw(st.integers(0, 9)):
        event["attempt"] = draw(st.sampled_from(["att-1", "other"]))
    return event


@settings(max_examples=400, deadline=None, database=None)
@given(st.lists(_events(), min_size=1, max_size=4), st.sampled_from([1, 1, 1, 1.0, 2, True]))
# Found in one suite run of 400 examples, then again at 100,000: an integer sent for a
# float field, one a float cannot hold exactly; the general path's text kept the integer.
@example(
    [
        {
            "seq": 0,
            "type": "metrics",
            "time": 0.0,
            "data": {**PAYLOADS["metrics"], "loss": -(2**63) - 1},
        }
    ],
    1,
)
def test_the_fast_path_accepts_only_what_the_general_path_accepts(
    events: list[dict[str, Any]], version: Any
) -> None:
    raw = compact(events, v=version)

    fast = _decode_typed(raw, 10_000)
    try:
        general = _decode_general(raw, 10_000)
    except WireError:
        assert fast is None
        return
    if fast is None:  # the general path takes what the fast path leaves
        return
    assert (fast.attempt, fast.run, fast.seqs, fast.types) == (
        general.attempt,
        general.run,
        general.seqs,
        general.types,
    )
    assert repr(fast.times) == repr(general.times)  # the same values of the same types
    assert repr(fast.data) == repr(general.data)
    assert [json.loads(t) for t in fast.texts] == [json.loads(t) for t in general.texts]


@pytest.mark.parametrize(
    ("kind", "field", "sent"),
    [
        ("metrics", "loss", -(2**63) - 1),
        ("metrics", "step_time_s", 2**64 + 1),
        ("metrics", "metrics", {"lr": 2**53 + 1}),
        ("stacks", "stalled_s", 2**63 - 1),
        ("checkpoint_committed", "interval_s", 2**53 + 1),
    ],
)
def test_an_integer_sent_for_a_float_is_stored_as_the_float_on_either_path(
    kind: str, field: str, sent: Any
) -> None:
    """A float cannot hold these integers exactly: the value is the float they round to,
    and each path's text decodes to that value, not to the integer sent."""
    event = wire_event(0, kind, **{field: sent})
    fast = _decode_typed(compact([event]), 10)
    general = _decode_general(compact([event]), 10)
    # An extra field sends the event down the general path in the service too.
    extra = decode_batch_columns(compact([{**event, "data": {**event["data"], "x": 1}}]))
    assert fast is not None and extra.given_texts is not None

    value = json_safe(fast.data[0][field])
    assert value != sent and value == json.loads(json.dumps(sent), parse_int=float)
    for batch in (fast, general, extra):
        assert batch.data[0][field] == fast.data[0][field]
        assert json.loads(batch.texts[0])[field] == value
    assert json.loads(fast.texts[0]) == json.loads(general.texts[0])


def test_the_fast_path_takes_what_the_runner_sends() -> None:
    raw = encode_batch([e for e in make_events() if e.type != "dry_run"])

    fast = _decode_typed(raw, 10_000)

    assert fast is not None and fast.events() == decode_batch(raw)
    assert len(fast) == len(EVENT_TYPES) - 1


def test_a_field_added_later_may_be_missing_on_either_path() -> None:
    """``checkpoint_committed.stall_s`` came after the first runners: a batch without it
    (an older runner, a script's own files) still decodes, the field as None."""
    older = wire_event(0, "checkpoint_committed")
    del older["data"]["stall_s"]
    raw = body([older])
    fast = _decode_typed(raw, 10)
    general = _decode_general(raw, 10)
    assert fast is not None and fast.data[0]["stall_s"] is None
    assert general.data[0]["stall_s"] is None
    assert validate_payload("checkpoint_committed", older["data"])["stall_s"] is None
    measured = decode_batch(body([wire_event(0, "checkpoint_committed", stall_s=0.25)]))
    assert measured[0].data["stall_s"] == 0.25
    with pytest.raises(WireError, match=r"events\[0\]\.data\.stall_s"):
        decode_batch(body([wire_event(0, "checkpoint_committed", stall_s=-1.0)]))
    # So is the "auto" interval in effect (newer still): missing is None, zero is refused.
    del older["data"]["interval_s"]
    assert decode_batch(body([older]))[0].data["interval_s"] is None
    moved = decode_batch(body([wire_event(0, "checkpoint_committed", interval_s=2.5)]))
    assert moved[0].data["interval_s"] == 2.5
    with pytest.raises(WireError, match=r"events\[0\]\.data\.interval_s"):
        decode_batch(body([wire_event(0, "checkpoint_committed", interval_s=0.0)]))
    # A field every runner sends is still required.
    with pytest.raises(
        WireError,
        match=r"data\.write_s: missing \(checkpoint_committed events "
        r"need step, bytes, write_s, uri\)",
    ):
        validate_payload("checkpoint_committed", {"step": 1, "bytes": 2, "uri": "x"})

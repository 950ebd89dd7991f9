"""Thresholds on reported metrics (issue 27, point 6): ``alerts.thresholds`` in the spec.

``{metric: val_loss, above: 2.5, for: 5m}`` through the real ingest path (wire batches
to the service ``jobs.process.bootstrap.build_ingest`` wires, the alert tables behind it): the
alert opens once the metric has been past its line for the duration, not a second
before, and resolves when it comes back. Time is the control plane's clock (``Deps.clock``)
and the events' own times, both set by the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from jobs import alerts
from jobs.database.db import session_scope
from jobs.database.models import Alert, Run
from jobs.domain.errors import SpecError
from jobs.ingest import IngestService
from jobs.process.bootstrap import build_ingest
from jobs.process.deps import Deps
from jobs.process.settings import Settings
from jobs.spec import spec_from_text
from runner.wire import Event, encode_batch
from tests.jobs.local_plane import Clock, local_deps
from tests.jobs.test_rule_triggers import TOKEN, running_attempt

T0 = datetime(2026, 12, 6, 9, 0, tzinfo=UTC)
SPEC = """
command: [python, train.py]
alerts:
  thresholds:
    - {metric: val_loss, above: 2.5, for: 5m, severity: critical}
    - {metric: loss, below: 0.001}
"""


@pytest.fixture
def deps(settings: Settings, db_engine: Engine, tmp_path: Path) -> Iterator[Deps]:
    with local_deps(settings, db_engine, tmp_path, clock=Clock(T0)) as made:
        yield made


class Runner:
    """One attempt's runner sending metrics batches, the control plane's clock with it."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.run_id, self.attempt_id = running_attempt(deps)
        spec = spec_from_text(SPEC, name="tiny")
        with session_scope(deps.engine) as session:
            run = session.get(Run, self.run_id)
            assert run is not None
            run.spec = spec.model_dump(mode="json")  # as submit stores it
            session.add(run)
        self.ingest: IngestService = build_ingest(deps)
        self.seq = 0

    def at(self, seconds: float, *, val_loss: float, loss: float = 1.0) -> None:
        """One metrics event ``seconds`` after T0, arriving then."""
        self.deps.clock.now = T0 + timedelta(seconds=seconds)  # type: ignore[attr-defined]
        data: dict[str, Any] = {
            "step": self.seq,
            "loss": loss,
            "step_time_s": 0.5,
            "data_wait_fraction": 0.0,
            "metrics": {"val_loss": val_loss},
        }
        when = T0.timestamp() + seconds
        event = Event(self.attempt_id, self.seq, "metrics", when, self.run_id, data)
        assert self.ingest.handle(f"Bearer {TOKEN}", encode_batch([event])).status == 200
        self.seq += 1

    def alert(self, metric: str) -> Alert | None:
        with session_scope(self.deps.engine) as session:
            for alert in alerts.open_alerts(session, run_id=self.run_id):
                if alert.rule == "metric_threshold" and alert.key.startswith(f"{metric}:"):
                    session.expunge(alert)
                    return alert
        return None


def test_a_threshold_fires_after_its_duration_and_not_before(deps: Deps) -> None:
    runner = Runner(deps)
    runner.at(0, val_loss=2.0)
    runner.at(60, val_loss=2.7)  # past the line from here on
    runner.at(200, val_loss=2.9)
    runner.at(359, val_loss=3.1)  # 299 s past it
    assert runner.alert("val_loss") is None
    runner.at(360, val_loss=3.0)  # 300 s: for: 5m is met
    fired = runner.alert("val_loss")
    assert fired is not None and fired.severity == "CRITICAL"
    assert fired.title == f"val_loss of run {runner.run_id} is above 2.5 for 5 min"
    assert "val_loss 3 at step 4; above 2.5 since step 1" in fired.detail

    # Back under the line: resolved.
    runner.at(420, val_loss=2.4)
    assert runner.alert("val_loss") is None
    # Past it again: the clock starts over, a short excursion says nothing.
    runner.at(480, val_loss=2.8)
    runner.at(700, val_loss=2.8)
    assert runner.alert("val_loss") is None


def test_a_threshold_without_a_duration_fires_at_once_on_a_top_level_metric(deps: Deps) -> None:
    runner = Runner(deps)
    runner.at(0, val_loss=1.0, loss=0.5)
    assert runner.alert("loss") is None
    runner.at(10, val_loss=1.0, loss=0.0005)
    fired = runner.alert("loss")
    assert fired is not None and fired.severity == "WARNING"
    assert fired.title == f"loss of run {runner.run_id} is below 0.001"


def test_a_threshold_says_what_is_missing() -> None:
    bad = "command: [python, t.py]\nalerts:\n  thresholds: [{metric: val_loss, for: 5m}]\n"
    with pytest.raises(SpecError, match="give the threshold of val_loss one of above or below"):
        spec_from_text(bad, name="tiny")
    too_long = "command: [python, t.py]\nalerts:\n  thresholds: [{metric: x, above: 1, for: 2h}]\n"
    with pytest.raises(SpecError, match=r"alerts\.thresholds\[0\]\.for: must be at most 3600"):
        spec_from_text(too_long, name="tiny")
    inline = spec_from_text(
        "command: [python, t.py]\n",
        name="tiny",
        overrides=["alerts.thresholds=[{metric: val_loss, above: 2.5, for: 90s}]"],
    )
    [threshold] = inline.alerts.thresholds
    assert (threshold.metric, threshold.above, threshold.for_s) == ("val_loss", 2.5, 90.0)

"""The load benchmark still runs end to end and still speaks its output format.

Run as a script on the smallest load (10 runners, 5 commands a second, 5 s, a 2 s lease):
two real ``trainbot serve`` replicas on PostgreSQL, the leader killed half-way. Latencies
at this size mean nothing, so ``met`` and the timings are not checked; what must hold
at any size is: every event a runner sent is stored, none twice or out of nowhere, the
killed leader is replaced and the survivor stops cleanly, and nothing is left behind.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy import text

from jobs.database.db import make_engine
from tests.bench.running import last_line

SMALLEST = [
    "--quick",
    "--runners",
    "10",
    "--commands-per-s",
    "5",
    "--duration-s",
    "5",
    "--lease-s",
    "2",
]
POSTGRES_ENV = "TRAINBOT_TEST_POSTGRES_URL"


@pytest.mark.slow
@pytest.mark.postgres
def test_bench_load_prints_its_figures_as_the_last_line(tmp_path: Path) -> None:
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        pytest.skip(
            f"{POSTGRES_ENV} is not set: the load benchmark runs two replicas on PostgreSQL; "
            "set it to a URL such as postgresql://postgres@127.0.0.1:5432/test"
        )
    result = last_line(
        "bench_load.py", *SMALLEST, "--dir", str(tmp_path), bench="load", goal=1.0, timeout=150
    )
    assert result["met"] == all(c["met"] for c in result["checks"])
    assert [c["check"] for c in result["checks"]] == [
        "events lost",
        "5xx answers",
        "Slack ack p99 (ms)",
        "time to a new leader (s)",
    ]
    fig = result["figures"]
    assert fig["shape"]["runners"] == 10
    # Every runner sent, and everything sent is in the database once the runners drained.
    assert fig["events_sent"] >= 10 * 20
    assert fig["events_lost"] == 0
    assert fig["events_lost_after_ack"] == 0
    assert fig["events_stored_never_sent"] == 0
    assert fig["events_stored"] == fig["events_sent"] == fig["events_acknowledged"]
    assert fig["runners_stopped"] == []
    assert fig["ingest"]["answers"] > 0 and fig["slack"]["answers"] > 0
    assert fig["slack"]["commands"] > 0
    # The replicas' Slack client went to the fake (TRAINBOT_SLACK_API_URL), not to Slack.
    assert fig["slack"]["web_api_calls"].get("auth.test", 0) >= 1
    # The leader was killed and replaced; the survivor leads and drains on SIGTERM.
    failover = fig["failover"]
    assert failover["killed"] == "replica-a"
    assert isinstance(failover["takeover_s"], float)
    assert failover["survivor_leads"] is True
    assert fig["replica_exit_codes"] == {"replica-a": -9, "replica-b": 0}
    assert fig["instances_left_running"] == 0
    assert set(fig["load_average_1min"]) == {"before", "at_kill", "after"}
    # Nothing left behind: the scratch directory, and the schema.
    assert list(tmp_path.iterdir()) == []
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            left = connection.execute(
                text("SELECT 1 FROM information_schema.schemata WHERE schema_name = :s"),
                {"s": fig["schema"]},
            ).all()
    finally:
        engine.dispose()
    assert left == []


def test_bench_load_rejects_a_bad_option_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.bench_load import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--duration-s", "1"])

    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--duration-s must be at least 2" in err
    assert "Traceback" not in err

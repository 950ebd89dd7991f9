"""Storage as a line item and badput by cause, against a history computed by hand.

The history is written as the control plane records it (attempts, runner event rows,
metric blocks, checkpoint rows, spend records by the real accrual) on real SQLite and
PostgreSQL; the figures are the digest's, the final summary's and the cleanup's.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import Engine
from sqlmodel import Session, select

from bot import messages, replies
from bot.console import ConsoleNotifier
from bot.views.digest import digest as digest_blocks
from jobs.background.tasks import prune_run, run_summary
from jobs.database.db import session_scope
from jobs.database.models import Attempt, Checkpoint, EventRow, MetricBlock, Run
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import DigestMessage
from jobs.process.deps import Deps
from jobs.process.settings import Settings, load_settings
from jobs.providers.local import LocalProvider
from jobs.spend import accrue, digest_figures, spend_chart_png
from jobs.spend.storage import BILLED_GB, storage_price
from runner.checkpoint import CheckpointWriter
from runner.store import run_store
from tests.fakes import aws as fake_aws
from tests.jobs.local_plane import local_deps

GIB = BILLED_GB
NOW = datetime(2024, 5, 15, 13, 0, tzinfo=timezone.utc)


def utc(day: int, hour: int, minute: int = 0, second: int = 0) -> datetime:
    return datetime(2024, 5, day, hour, minute, second, tzinfo=timezone.utc)


def event(seq: int, attempt: str, run: str, type_: str, at: datetime, **data: Any) -> EventRow:
    return EventRow(attempt_id=attempt, run_id=run, seq=seq, type=type_, time=at, data=data)


def metrics(attempt: str, run: str, points: list[tuple[datetime, float, float]]) -> MetricBlock:
    """One block of metrics points: (time, step_time_s, data_wait_fraction)."""
    return MetricBlock(
        attempt_id=attempt,
        run_id=run,
        first_seq=100,
        last_seq=100 + len(points) - 1,
        count=len(points),
        first_time=points[0][0],
        last_time=points[-1][0],
        seqs=[100 + i for i in range(len(points))],
        times=[p[0].timestamp() for p in points],
        data=[
            {"step": i, "loss": 1.0, "step_time_s": p[1], "data_wait_fraction": p[2], "metrics": {}}
            for i, p in enumerate(points)
        ],
    )


def checkpoint(run: str, attempt: str | None, step: int, uri: str, gib: float, **kw: Any) -> Any:
    return Checkpoint(
        run_id=run, attempt_id=attempt, step=step, uri=f"{uri}/step-{step:010d}",
        bytes=int(gib * GIB), **kw,
    )  # fmt: skip


def history(engine: Engine) -> None:
    """The history the figures below are computed from by hand (the day is 14 May, UTC).

    r-1 (C-ml, A100:8, checkpoints in s3://ckpt, us-east-1):
    - a-1, spot at $10/h, 10:00-14:00, preempted with 300 steps of 2 s lost. Its runner
      started at 10:05 and restored at 10:10 after 120 s of restore; it committed at
      11:00, 12:00 and 13:00 with stalls of 3, 3 and 4 s; its metrics waited on data
      10 % and 30 % of two 2 s steps.
    - a-2, on-demand at $30/h where spot is $10/h, from 20:00, still running; restored at
      20:06 after 60 s.
    - checkpoints of 10 GiB at 11:00 (deleted at 23:00), 12:00 and 13:00.
    r-2 (C-ml): 1 GiB in a local directory since 14 00:00.
    r-3 (C-ml, gcp, europe-west1, no attempt yet): 5 GiB in gs://eu since 14 00:00.
    r-9 (another channel): 100 GiB in S3, and an attempt: none of it counts in C-ml.
    """
    rows: list[Any] = [
        Run(id="r-1", spec_name="gpt", requester="U-alice", channel="C-ml",
            spec={"resources": {"accelerator": {"type": "A100", "count": 8}}},
            state=RunState.RUNNING, created_at=utc(14, 9), checkpoint_uri="s3://ckpt"),
        Run(id="r-2", spec_name="tiny", requester="U-bob", channel="C-ml", spec={},
            state=RunState.SUCCEEDED, created_at=utc(13, 9)),
        Run(id="r-3", spec_name="eu", requester="U-carol", channel="C-ml",
            spec={"resources": {"cloud": "gcp", "regions": ["europe-west1"]}},
            state=RunState.STOPPED, created_at=utc(13, 9)),
        Run(id="r-9", spec_name="big", requester="U-dave", channel="C-other", spec={},
            state=RunState.RUNNING, created_at=utc(13, 9)),
        Attempt(id="a-1", run_id="r-1", number=1, provider="aws", region="us-east-1",
                spot=True, price_per_hour=10.0, spot_price_per_hour=10.0,
                started_at=utc(14, 10), ended_at=utc(14, 14), state=AttemptState.PREEMPTED,
                last_step=1300, lost_steps=300, step_time_s=2.0, lost_seconds=600.0),
        Attempt(id="a-2", run_id="r-1", number=2, provider="aws", region="us-east-1",
                spot=False, price_per_hour=30.0, spot_price_per_hour=10.0,
                started_at=utc(14, 20), state=AttemptState.RUNNING),
        Attempt(id="z-1", run_id="r-9", number=1, provider="aws", region="us-east-1",
                spot=True, price_per_hour=50.0, spot_price_per_hour=50.0,
                started_at=utc(14, 1), ended_at=utc(14, 2), state=AttemptState.SUCCEEDED),
    ]  # fmt: skip
    rows += [
        event(1, "a-1", "r-1", "started", utc(14, 10, 5), pid=1, host="h"),
        event(2, "a-1", "r-1", "restored", utc(14, 10, 10), step=1000, fallback_from=None,
              restore_s=120.0),
        event(3, "a-1", "r-1", "checkpoint_committed", utc(14, 11), step=1100, bytes=1,
              write_s=30.0, stall_s=3.0, uri="s3://ckpt/r-1/step-0000001100"),
        event(4, "a-1", "r-1", "checkpoint_committed", utc(14, 12), step=1200, bytes=1,
              write_s=30.0, stall_s=3.0, uri="s3://ckpt/r-1/step-0000001200"),
        # A runner that does not measure the stall (a script's own files) sends None.
        event(5, "a-1", "r-1", "checkpoint_committed", utc(14, 12, 30), step=1250, bytes=1,
              write_s=30.0, stall_s=None, uri="s3://ckpt/r-1/step-0000001250"),
        event(6, "a-1", "r-1", "checkpoint_committed", utc(14, 13), step=1300, bytes=1,
              write_s=30.0, stall_s=4.0, uri="s3://ckpt/r-1/step-0000001300"),
        metrics("a-1", "r-1", [(utc(14, 11), 2.0, 0.1), (utc(14, 12), 2.0, 0.3)]),
        event(1, "a-2", "r-1", "started", utc(14, 20, 5), pid=2, host="h"),
        event(2, "a-2", "r-1", "restored", utc(14, 20, 6), step=1300, fallback_from=None,
              restore_s=60.0),
        checkpoint("r-1", "a-1", 1100, "s3://ckpt/r-1", 10, committed_at=utc(14, 11),
                   deleted_at=utc(14, 23)),
        checkpoint("r-1", "a-1", 1200, "s3://ckpt/r-1", 10, committed_at=utc(14, 12)),
        checkpoint("r-1", "a-1", 1300, "s3://ckpt/r-1", 10, committed_at=utc(14, 13)),
        checkpoint("r-2", None, 10, "/var/ckpt/r-2", 1, committed_at=utc(14, 0)),
        checkpoint("r-3", None, 10, "gs://eu/r-3", 5, committed_at=utc(14, 0)),
        checkpoint("r-9", None, 10, "s3://other/r-9", 100, committed_at=utc(14, 0)),
    ]  # fmt: skip
    with session_scope(engine) as session:
        for row in rows:
            session.add(row)
            session.flush()
        accrue(session, now=NOW)


def the_day(engine: Engine) -> dict[str, Any]:
    with Session(engine) as session:
        return digest_figures(session, channel="C-ml", now=NOW, tz=timezone.utc)


# By hand, in instance-seconds (one instance each):
# a-1: start-up 10:00 to 10:08 (the restore's 120 s end at 10:10) = 480; restore 120;
#      stalls 3 + 3 + 4 = 10 (the unmeasured one counts nothing); lost work 300 × 2 = 600;
#      training 10:10-14:00 = 13800, of which 13800 - 10 - 600 = 13190 waited
#      (0.1 × 2 + 0.3 × 2) / 4 = 20 %: 2638. All at $10/h.
# a-2: start-up 20:00-20:05 = 300, restore 60, at its spot share ($10 of $30 an hour);
#      the premium is $20/h for the 4 h it ran on the 14th: $80, 2/3 of 14400 s.
A1 = 10.0 / 3600
A2_SPOT = 10.0 / 3600
EXPECTED = {
    "startup": (780, 480 * A1 + 300 * A2_SPOT),
    "restore": (180, 120 * A1 + 60 * A2_SPOT),
    "checkpoint_stall": (10, 10 * A1),
    "lost_work": (600, 600 * A1),
    "data_wait": (2638, 2638 * A1),
    "on_demand_premium": (9600, 80.0),
}


def test_the_digest_splits_badput_by_cause_as_computed_by_hand(db_engine: Engine) -> None:
    history(db_engine)
    badput = the_day(db_engine)["badput"]
    got = {row["name"]: (row["instance_hours"], row["usd"]) for row in badput["categories"]}
    assert list(got) == list(EXPECTED)
    for name, (seconds, usd) in EXPECTED.items():
        assert got[name] == (round(seconds / 3600, 4), round(usd, 4)), name
    assert badput["instance_hours"] == round((780 + 180 + 10 + 600 + 2638) / 3600, 4)
    total = sum(usd for _, usd in EXPECTED.values())
    assert badput["usd"] == round(total, 4)
    # Paid on the 14th: a-1 4 h at $10, a-2 4 h at $30 (r-9 is another channel's).
    assert badput["paid_usd"] == 160.0
    assert badput["share"] == round(total / 160.0, 4)
    assert badput["premium_unknown"] == 0


def test_the_digest_shows_storage_beside_compute_as_computed_by_hand(db_engine: Engine) -> None:
    history(db_engine)
    got = the_day(db_engine)
    storage = got["storage"]
    s3, gcs = 0.023 / 730, 0.02 / 730  # USD per GiB-hour: us-east-1, europe-west1
    # r-1: 10 GiB for 12 h (until its deletion at 23:00), 12 h and 11 h; r-3: 5 GiB for
    # 24 h; r-2's local directory costs nothing.
    r1_day = 10 * (12 + 12 + 11) * s3
    r3_day = 5 * 24 * gcs
    assert storage["usd"] == round(r1_day + r3_day, 4)
    assert storage["bytes_kept"] == (20 + 1 + 5) * GIB
    assert storage["usd_per_month"] == round(20 * 0.023 + 5 * 0.02, 4)
    # The month to date runs on to 13:00 on the 15th: 13 h more of r-1's two and r-3's.
    month = 10 * (12 + 25 + 24) * s3 + 5 * 37 * gcs
    assert storage["month_to_date_usd"] == round(month, 4)
    rows = {row["run_id"]: row for row in storage["per_run"]}
    assert [row["run_id"] for row in storage["per_run"]] == ["r-1", "r-3", "r-2"]
    assert (rows["r-1"]["store"], rows["r-1"]["region"]) == ("s3", "us-east-1")
    assert rows["r-1"]["usd"] == round(r1_day, 4) and rows["r-1"]["bytes_kept"] == 20 * GIB
    assert (rows["r-3"]["store"], rows["r-3"]["region"], rows["r-3"]["usd_per_month"]) == (
        "gcs",
        "europe-west1",
        0.1,
    )
    assert (rows["r-2"]["store"], rows["r-2"]["usd"], rows["r-2"]["usd_per_month"]) == (
        "local",
        0.0,
        0.0,
    )
    # Compute stays its own line: a-1's 4 h at $10 and a-2's 4 h at $30.
    assert got["day_usd"] == 160.0


def test_the_digest_text_blocks_and_chart_carry_both(db_engine: Engine) -> None:
    history(db_engine)
    figures = the_day(db_engine)
    chart = spend_chart_png(figures)
    assert chart.startswith(b"\x89PNG")
    msg = DigestMessage(channel="C-ml", figures=figures, chart_png=chart)
    text = messages.digest(msg)
    assert (
        "storage $0.01 yesterday" in text and "27.9 GB of checkpoints kept, $0.56 a month" in text
    )
    assert "badput $91.69 (57.3% of compute), 1.17 instance-hours:" in text
    assert (
        "on-demand premium: $80.00" in text and "work lost to preemptions: $1.67 (0.17 h)" in text
    )
    assert "r-1 keeps 21.5 GB in s3 (us-east-1): $0.46 a month" in text
    blocks = str(digest_blocks(msg))
    assert "*Storage*" in blocks and "$0.56 a month" in blocks
    assert "idle, waiting for data: $7.33 (0.73 h)" in blocks
    # Without badput figures (an older digest's), the chart still draws.
    assert spend_chart_png({"per_run": [], "per_day": []}).startswith(b"\x89PNG")


def test_an_on_demand_attempt_without_a_spot_price_is_counted_as_unknown(
    db_engine: Engine,
) -> None:
    history(db_engine)
    with session_scope(db_engine) as session:
        attempt = session.get(Attempt, "a-2")
        assert attempt is not None
        attempt.spot_price_per_hour = None  # priced before trainbot recorded it
        session.add(attempt)
    badput = the_day(db_engine)["badput"]
    got = {row["name"]: row["usd"] for row in badput["categories"]}
    # Its time is then valued at what it paid, and its premium is left out, and said so.
    assert got["on_demand_premium"] == 0.0 and badput["premium_unknown"] == 1
    assert got["startup"] == round(480 * A1 + 300 * 30 / 3600, 4)
    assert "1 on-demand attempt(s) with no recorded spot price" in "\n".join(
        messages.badput_lines(badput)
    )


@pytest.fixture
def deps(db_engine: Engine, settings: Settings, tmp_path: Path) -> Iterator[Deps]:
    with local_deps(settings, db_engine, tmp_path, clock=lambda: utc(15, 0)) as made:
        yield made


def test_the_final_summary_splits_the_runs_badput_and_its_storage(
    db_engine: Engine, deps: Deps
) -> None:
    history(db_engine)
    summary = run_summary(deps, "r-1")  # at 15 00:00: the same span as the digest's day
    rows = summary["badput"]["categories"]
    got = {row["name"]: (row["instance_hours"], row["usd"]) for row in rows}
    for name, (seconds, usd) in EXPECTED.items():
        assert got[name] == (round(seconds / 3600, 4), round(usd, 4)), name
    storage = summary["storage"]
    assert storage["bytes_kept"] == 20 * GIB and storage["usd_per_month"] == 0.46
    assert storage["usd"] == round(10 * (12 + 12 + 11) * 0.023 / 730, 4)


def test_storage_prices_come_from_the_dated_table() -> None:
    east = storage_price("s3://b/x", "us-east-1")
    assert (east.store, east.usd_per_gb_month) == ("s3", 0.023) and "2024-06-01" in east.source
    assert storage_price("s3://b/x", "us-west-1").usd_per_gb_month == 0.026
    unknown = storage_price("gs://b/x", "mars-north1")
    assert unknown.region == "us-central1" and "us-central1's price" in unknown.source
    assert storage_price("/var/ckpt", "us-east-1").usd_per_gb_month == 0.0
    assert storage_price("file:///var/ckpt", None).store == "local"
    # A scheme no store opens is never priced as another store's (a local disk's $0): it
    # says it is not priced.
    odd = storage_price("az://container/ckpt", "westeurope")
    assert (odd.store, odd.usd_per_gb_month) == ("unknown", 0.0)
    assert "not priced" in odd.source and "az://" in odd.source


def test_cleanup_reports_the_bytes_and_dollars_a_month_it_freed(
    moto_server: str, monkeypatch: pytest.MonkeyPatch, db_engine: Engine, tmp_path: Path
) -> None:
    """A real prune of a run's checkpoints in S3 (moto), in us-west-1 at $0.026/GB-month."""
    bucket = fake_aws.unique_bucket(moto_server, region="us-west-1", prefix="ckpt")
    monkeypatch.setenv("TRAINBOT_S3_ENDPOINT_URL", moto_server)
    root = f"s3://{bucket}"
    settings = load_settings(
        {"TRAINBOT_STATE_DIR": str(tmp_path / "state"), "TRAINBOT_CHECKPOINT_URI": root}
    )
    writer = CheckpointWriter(run_store(root, "r-c"))
    for step in (10, 20, 30):
        writer.save(step, {"w": torch.full((1 << 18,), float(step))}, metrics={}).result()
    writer.close()
    with session_scope(db_engine) as session:
        session.add(
            Run(id="r-c", spec_name="tiny", requester="U-a", channel="C-ml",
                spec={"name": "tiny", "command": ["python", "train.py"],
                      "retention": {"keep_last": 1}}, checkpoint_uri=root,
                state=RunState.SUCCEEDED, last_committed_step=30)
        )  # fmt: skip
        session.flush()
        session.add(
            Attempt(id="a-c", run_id="r-c", number=1, provider="aws", region="us-west-1",
                    state=AttemptState.SUCCEEDED)
        )  # fmt: skip
        session.flush()
        for step in (10, 20, 30):
            session.add(
                checkpoint("r-c", "a-c", step, f"{root}/r-c", 0.001, committed_at=utc(14, 0))
            )
    deps = Deps(
        settings=settings,
        engine=db_engine,
        provider=LocalProvider(tmp_path / "local"),
        notifier=ConsoleNotifier(io.StringIO()),
        clock=lambda: NOW,
    )
    try:
        preview = prune_run(deps, "r-c", dry_run=True)
        summary = prune_run(deps, "r-c")
    finally:
        deps.close()
    assert summary["deleted"] == [10, 20] and summary["kept"] == [30]
    freed = summary["bytes_freed"]
    assert freed > 2 * 4 * (1 << 18)  # two steps of a 1 MiB tensor and their manifests
    assert summary["usd_per_month_freed"] == pytest.approx(freed / GIB * 0.026)
    assert "us-west-1" in summary["storage_price"]
    assert preview["usd_per_month_freed"] == summary["usd_per_month_freed"]
    text = replies.cleanup(summary)
    assert f"({freed:,} bytes, ${freed / GIB * 0.026:.4f} a month)" in text
    with Session(db_engine) as session:
        found = session.exec(select(Checkpoint).where(Checkpoint.run_id == "r-c")).all()
        rows = {c.step: c.deleted_at for c in found}
    assert rows[10] == NOW and rows[20] == NOW and rows[30] is None

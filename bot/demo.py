"""``trainbot demo``: the whole product on one machine, with no cloud and no Slack.

Real pieces throughout: the control plane with SQLite, its HTTP ingest API and its
scheduler; the local spot provider running ``trainbot-runner exec`` around a real torch
model on CPU; a local checkpoint store; the terminal as the chat. The demo types the
same `/train` commands a person would, preempts an instance the way a cloud does
(SIGTERM, then SIGKILL after the window), and waits for each part of the story to
happen, failing loudly if one does not.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO
from zoneinfo import ZoneInfo

from bot import messages
from bot.console import ConsoleNotifier, Shell
from jobs.background import tasks
from jobs.database.db import session_scope
from jobs.database.models import Alert, Attempt, Run
from jobs.domain import format as fmt
from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import FanoutJournal, JsonlJournal
from jobs.process.bootstrap import ControlPlane
from jobs.process.deps import Deps
from jobs.process.settings import load_settings
from jobs.providers import gang
from jobs.runs import active_attempt
from jobs.usecases.service import wait_for

#: The event types a complete story contains (README: "Demo events").
STORY = (
    "preflight_check",
    "launched",
    "checkpoint_committed",
    "preemption_notice",
    "preempted",
    "resubmitted",
    "resumed",
    "alert_opened",
    "alert_acknowledged",
    "budget_threshold",
    "cleanup",
    "digest",
    "run_finished",
)


#: How long the diverging run's alert may go unacknowledged before trainbot stops it:
#: at once, in the demo (the next escalation pass, within 5 s), since a loss spike can
#: settle within seconds and the story is the stop, not the wait.
DIVERGE_STOP_AFTER = "1s"


class DemoError(Exception):
    """A part of the story did not happen."""


class Story:
    """The journal the demo watches: every record, and a way to wait for one."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._cond = threading.Condition()

    def record(self, type: str, run: str | None, /, **data: Any) -> None:
        with self._cond:
            self.records.append({"type": type, "run": run, **data})
            self._cond.notify_all()

    def wait(self, what: str, pred: Callable[[dict[str, Any]], bool], timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = next((r for r in self.records if pred(r)), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DemoError(f"timed out after {timeout:.0f} s waiting for {what}")
                self._cond.wait(min(left, 0.5))


class Progress:
    """Numbered headings with elapsed time, so a person sees where the story is."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.total = total
        self.out = out
        self.start = time.monotonic()
        self.n = 0

    def step(self, title: str) -> None:
        self.n += 1
        elapsed = time.monotonic() - self.start
        print(
            f"\n━━ [{self.n}/{self.total}] {title}  ({elapsed:5.1f} s)",
            file=self.out,
            flush=True,
        )


def _settings(state_dir: Path) -> Any:
    return load_settings(
        {
            "TRAINBOT_STATE_DIR": str(state_dir),
            "TRAINBOT_INGEST_PORT": "0",
            # The slow-input run's $0.10 budget reaches its hard cap after 40 s of this
            # price: the demo's longest wait, since that run's cap ends its story. Long
            # enough for its low-utilisation and disk alerts to come first (about 10 s
            # after its training starts), short enough not to keep a person waiting.
            "TRAINBOT_LOCAL_PRICE_PER_HOUR_USD": "9",
            "TRAINBOT_LOCAL_TERMINATION_WINDOW_S": "30",
            "TRAINBOT_ASSUMED_MTBP_S": "120",
            "TRAINBOT_ESCALATION_DELAY_S": "600",
            "TRAINBOT_HEARTBEAT_DEADLINE_S": "120",
            "TRAINBOT_LOCAL_CORES": "8",
            # The story is the training runs' progress, and the demo has no chat front end
            # to keep responsive: its runs get full priority, so its pace does not depend
            # on what else the machine is doing.
            "TRAINBOT_LOCAL_NICE": "0",
        }
    )


def run_demo(
    *,
    events: Path | None = None,
    state_dir: Path | None = None,
    timeout_s: float = 900.0,
    out: TextIO | None = None,
) -> int:
    out = out or sys.stdout
    own_dir = state_dir is None
    root = Path(tempfile.mkdtemp(prefix="trainbot-demo-")) if state_dir is None else state_dir
    story = Story()
    journals: list[Any] = [story]
    jsonl = JsonlJournal(events) if events is not None else None
    if jsonl is not None:
        journals.append(jsonl)
    notifier = ConsoleNotifier(out, channel="#ml-training")
    progress = Progress(14, out)
    try:
        with ControlPlane(
            _settings(root),
            notifier=notifier,
            journal=FanoutJournal(*journals),
            scheduler_intervals={"reconcile": 2, "spend": 2, "escalation": 5},
        ) as cp:
            _story(cp, story, progress, out, timeout_s=timeout_s)
        return 0
    except DemoError as exc:
        print(f"\ndemo FAILED: {exc}", file=out, flush=True)
        return 1
    finally:
        if jsonl is not None:
            jsonl.close()
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)


def _story(
    cp: ControlPlane, story: Story, progress: Progress, out: TextIO, *, timeout_s: float
) -> None:
    deps = cp.deps
    shell = Shell(deps, user="ada", channel="#ml-training", out=out)
    t = min(timeout_s, 300.0)
    # The digest covers the day the demo began, even when it ends after midnight.
    began = datetime.now(ZoneInfo(deps.settings.timezone)).date()

    def of(run: str, type_: str, **match: Any) -> Callable[[dict[str, Any]], bool]:
        return lambda r: (
            r["run"] == run and r["type"] == type_ and all(r.get(k) == v for k, v in match.items())
        )

    progress.step("Submit the example spec: /train launch tiny")
    run1 = _launch(deps, shell, "/train launch tiny", t, confirm=False)

    progress.step("Preflight: quota, capacity, data, a real dry run, budget")
    for check in ("quota", "capacity", "data", "dry_run", "budget"):
        story.wait(f"the {check} check", of(run1, "preflight_check", check=check), t)
    _confirm_if_asked(deps, shell, run1, t)

    progress.step("Launch on the local spot provider; checkpoints are committed")
    story.wait("the launch", of(run1, "launched"), t)
    _wait_count(story, "two committed checkpoints", of(run1, "checkpoint_committed"), 2, t)

    progress.step("A preemption: SIGTERM, the 30 s window, an emergency flush")
    with session_scope(deps.engine) as session:
        attempt = active_attempt(session, run1)
        assert attempt is not None and attempt.instance_id is not None
        instance = attempt.instance_id
    deps.provider.preempt(instance)  # type: ignore[attr-defined]
    story.wait("the runner's preemption notice", of(run1, "preemption_notice"), t)
    preempted = story.wait("the preempted attempt", of(run1, "preempted"), t)
    print(
        f"   committed step {preempted['committed_step']}, lost {preempted['lost_steps']} step(s)",
        file=out,
    )

    progress.step("Automatic resubmit; the run resumes at the committed step")
    resub = story.wait("the resubmit", of(run1, "resubmitted"), t)
    resumed = story.wait("the resume", of(run1, "resumed"), t)
    if resumed["step"] != resub["resume_from_step"]:
        raise DemoError(f"resumed at step {resumed['step']}, expected {resub['resume_from_step']}")

    progress.step("Three more runs at once: two nodes, a diverging loss, a slow input")
    # A team launches several runs side by side; so does the demo, and each of the next
    # steps follows one of them. Each launch is typed first and confirmed once its own
    # preflight (dry run included) has settled, so their preflights run together.
    # stop_after is 30 min by default; the demo cannot wait that long.
    lines = (
        "/train launch tiny-ddp",
        f"/train launch diverge alerts.stop_after={DIVERGE_STOP_AFTER}",
        # Its budget is below the estimate: preflight warns and waits for a person.
        "/train launch slow-input",
    )
    run4, run2, run3 = (_launch(deps, shell, line, t, confirm=False) for line in lines)
    for run in (run4, run2, run3):
        _confirm_if_asked(deps, shell, run, t)

    progress.step("The two-node run: preempting one node stops both; the gang resumes")
    _two_nodes(deps, story, run4, of, out, t)

    progress.step("The second run diverges; nobody acknowledges it, so trainbot stops it")
    opened = story.wait(
        "the divergent-loss alert", of(run2, "alert_opened", rule="divergent_loss"), t
    )
    stopped = story.wait(
        "trainbot to stop the diverging run", of(run2, "run_finished", by="trainbot"), t
    )
    print(f"   {stopped.get('reason', '')}", file=out)
    # The on-call comes back, sees the stop and the resubmit offer, and takes it over.
    shell.run_line(f"/train ack {opened['alert_id']}")
    story.wait("the acknowledgement", of(run2, "alert_acknowledged"), t)

    progress.step("The slow input pipeline: low utilisation, named by its data-wait")
    low = story.wait(
        "the low-utilisation alert", of(run3, "alert_opened", rule="low_utilisation"), t
    )
    print(f"   {low.get('title', '')}", file=out)

    progress.step("A small scratch volume fills: the disk alert")
    disk = story.wait("the disk alert", of(run3, "alert_opened", rule="disk"), t)
    print(f"   {disk.get('title', '')}", file=out)

    progress.step("Budget thresholds: 50 %, 80 %, then the hard cap")
    for pct in (50, 80, 100):
        story.wait(f"the {pct} % threshold", of(run3, "budget_threshold", threshold=pct), t)
    story.wait("the hard cap", of(run3, "run_finished", state="BUDGET_EXCEEDED"), t)
    # The cap stops the instance the way /train stop does: its runner flushes a last
    # checkpoint and reports it before the attempt ends. Cleanup and the summary come
    # after that, so they see the checkpoint.
    _wait_until_ended(deps, run3, t)

    for run in (run1, run2, run4):
        story.wait(f"{run} to finish", of(run, "run_finished"), t)

    progress.step("Cleanup prunes old checkpoints by retention")
    for summary in tasks.cleanup_job(deps):
        if summary.get("deleted"):
            print(
                f"   {summary['run_id']}: deleted {len(summary['deleted'])}, "
                f"kept {summary['kept']}",
                file=out,
            )
    story.wait("a cleanup", lambda r: r["type"] == "cleanup", 5)

    progress.step("The daily spend digest (today's, so far)")
    # The scheduled digest reports yesterday; the demo's runs happened on the day it began.
    tasks.digest_job(deps, day=began)
    story.wait("the digest", lambda r: r["type"] == "digest", 5)

    progress.step("Final summary")
    for run in (run1, run2, run3, run4):
        summary = tasks.run_summary(deps, run)
        with session_scope(deps.engine) as session:
            row = session.get(Run, run)
            summary["reason"] = row.reason if row is not None else None
        deps.journal.record("summary", run, **summary)  # the events file has it too
        print(
            f"   {run}: {summary['state'].lower()}, spent ${summary['spent_usd']:.4f}, "
            f"{summary['attempts']} attempt(s), {summary['preemptions']} preemption(s), "
            f"goodput {fmt.percent(summary['goodput'])}, lost {summary['lost_steps']} step(s) "
            f"({summary['lost_s']:.1f} s), checkpoints kept {summary['checkpoints_kept']}",
            file=out,
        )
        if summary["state"] == RunState.STOPPED.value and summary["reason"]:
            print(f"     {summary['reason']}", file=out)
        for line in messages.badput_lines(summary["badput"]):
            print(f"     {line}", file=out)
    with session_scope(deps.engine) as session:
        acked = session.query(Alert).filter(Alert.acked_by.is_not(None)).count()  # type: ignore[union-attr]
        attempts = session.query(Attempt).count()
    seen = {r["type"] for r in story.records}
    missing = [name for name in STORY if name not in seen]
    if missing:
        raise DemoError(f"the story is missing {', '.join(missing)}")
    print(
        f"\nDemo complete: {len(story.records)} events, {attempts} attempts, "
        f"{acked} alert(s) acknowledged. Every step of the story happened.",
        file=out,
        flush=True,
    )


def _two_nodes(
    deps: Deps,
    story: Story,
    run: str,
    of: Callable[..., Callable[[dict[str, Any]], bool]],
    out: TextIO,
    t: float,
) -> None:
    """``tiny-ddp`` (``run``) on two local nodes: node 1 is preempted, both stop at one
    step, and the gang is resubmitted and resumes there."""
    story.wait("the gang's launch", of(run, "launched"), t)
    story.wait("the gang's first checkpoint", of(run, "checkpoint_committed"), t)
    with session_scope(deps.engine) as session:
        attempt = active_attempt(session, run)
        assert attempt is not None and attempt.instance_id is not None
        nodes = gang.node_ids(attempt.instance_id)
    deps.provider.preempt(nodes[-1])  # type: ignore[attr-defined]
    preempted = story.wait("the gang's preemption", of(run, "preempted"), t)
    resub = story.wait("the gang's resubmit", of(run, "resubmitted"), t)
    resumed = story.wait("the gang's resume", of(run, "resumed"), t)
    if resumed["step"] != resub["resume_from_step"]:
        raise DemoError(
            f"the gang resumed at step {resumed['step']}, expected {resub['resume_from_step']}"
        )
    print(
        f"   node {len(nodes) - 1} of {len(nodes)} preempted: both stopped at step "
        f"{preempted['committed_step']}; the new gang resumed there",
        file=out,
    )


def _launch(deps: Deps, shell: Shell, line: str, timeout: float, *, confirm: bool = True) -> str:
    """Type a launch and return its run's id; with ``confirm``, wait for preflight and
    press "Launch anyway" if it asks (a busy machine's slower dry run can put the
    estimate above a demo spec's budget)."""
    reply = shell.run_line(line)
    if reply is None or reply.run_id is None:
        raise DemoError(f"{line!r} started no run")
    if confirm:
        _confirm_if_asked(deps, shell, reply.run_id, timeout)
    return reply.run_id


def _confirm_if_asked(deps: Deps, shell: Shell, run_id: str, timeout: float) -> None:
    settled = set(RunState) - {RunState.PENDING, RunState.PREFLIGHT}
    if wait_for(deps, run_id, settled, timeout_s=timeout) == RunState.AWAITING_CONFIRMATION:
        shell.run_line(f"/train resubmit {run_id}")  # "Launch anyway"


def _wait_until_ended(deps: Deps, run_id: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with session_scope(deps.engine) as session:
            if active_attempt(session, run_id) is None:
                return
        if time.monotonic() > deadline:
            raise DemoError(f"timed out waiting for {run_id}'s instance to shut down")
        time.sleep(0.2)


def _wait_count(
    story: Story, what: str, pred: Callable[[dict[str, Any]], bool], n: int, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while sum(1 for r in list(story.records) if pred(r)) < n:
        if time.monotonic() > deadline:
            raise DemoError(f"timed out waiting for {what}")
        time.sleep(0.2)

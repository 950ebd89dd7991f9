"""Goodput of a long run under random preemptions, on the real control plane, time-compressed.

The whole product runs as ``trainbot demo`` runs it: a :class:`~jobs.bootstrap.ControlPlane`
on SQLite with its ingest API and scheduler, the local spot provider, ``trainbot-runner
exec`` around a training process that uses the session API (``bench/_goodput_child.py``).
A run of a fixed number of steps is submitted with ``checkpoint.interval: auto``, so the
interval is what preflight chooses (:func:`runner.preemption.choose_interval`): Daly's
√(2CM) − C with C the stall of a save measured by the dry run, floored at its write time,
and M the mean time between the preemptions that lose work: ``TRAINBOT_ASSUMED_MTBP_S``
when the emergency checkpoint does not fit the window, that ÷ the share assumed to come
without a usable notice when it does. The provider preempts it at random
(exponential gaps, mean M, seeded) until it finishes: every preemption is a real SIGTERM,
termination window and SIGKILL, every resubmit a real relaunch and restore.

Time compression. Every simulated duration is its real-scale value divided by
``--compression`` k: the mean time between preemptions (600 s at scale), the step (the
child sleeps, as a host waits for its accelerator), the checkpoint's write and restore
(the store is a local directory behind a bandwidth limit that stands for an object
store), the termination window. What is not simulated cannot be compressed: starting
the runner's processes (two interpreters importing torch, seconds each), their teardown,
and the control plane noticing an end. They are measured per attempt and ``goodput``
counts them at their wall length (a second of them is a second at scale, every other
wall second is k); ``goodput_wall`` counts every wall second as it fell. Preemption gaps
run from the moment the training process is up (its ``started`` event), so that the
uncompressed start does not eat the compressed time between preemptions. The accounting
is ``bench/_goodput_ledger.py``.

Two regimes, each its own control plane, one after the other:

- ``notice`` (the headline): AWS's 120 s termination window; the runner's emergency
  checkpoint fits, so a preemption costs the flush and the restart, not the steps;
- ``no-notice``: a window of ~0, the instance killed at once (a lost host, or a
  checkpoint too big for the window): a preemption loses the work since the last commit.
  This is the failure Daly's formula is about.

In each, side by side and facing the same preemption gaps (the n-th attempt of every run
draws the same one): ``auto`` (preflight's choice), ``short`` (÷10), ``long`` (×10) and
``daly-stall`` (Daly's interval for the stall probed before the runs and M counting every
preemption: what ``auto`` chooses when there is no notice). Which C belongs in Daly's
formula: the time one checkpoint takes away from training. The asynchronous writer
blocks only while it copies the state (the stall); the write runs beside the next steps,
and only bounds the interval from below (one save in flight).

Goal (the issue "The control plane"): ``auto``'s goodput in the headline regime >= 97 %,
with its interval within 10 % of Daly's optimum for the checkpoint cost measured in the
run: max(write, Daly(C, M)) with C and the write the medians of the run's own periodic
saves, and M the one preflight's rule used. ``ratio`` = goodput ÷ 0.97.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlmodel import col, select

from bench._common import BenchError, log, machine, rounded, temp_dir
from bench._goodput_ledger import AttemptRow, RunEvent, account
from jobs import tasks
from jobs.bootstrap import ControlPlane
from jobs.db import session_scope
from jobs.errors import TrainbotError
from jobs.lifecycle import RunState
from jobs.metrics import run_metrics
from jobs.models import Attempt, Event, Run
from jobs.notify import CallbackJournal, Message, MessageRef
from jobs.providers.base import ProviderError
from jobs.providers.local import LocalProvider
from jobs.service import Actor, confirm, stop, submit, wait_for
from jobs.settings import load_settings
from runner.checkpoint import CheckpointWriter
from runner.errors import RunnerError
from runner.preemption import daly_interval
from runner.store import LocalStore

GOAL = 0.97
INTERVAL_TOLERANCE = 0.10
HEADLINE = "notice"
ACTOR = Actor(user="bench", channel="#bench")
#: The smallest termination window the settings accept: a kill at once.
NO_WINDOW_S = 0.001
MiB = 1 << 20


# ----------------------------------------------------------------------------- the scenario


@dataclass(frozen=True)
class Scenario:
    """The simulated run: real-scale seconds, and the factor they are divided by."""

    #: Mean time between preemptions at scale.
    mtbp_s: float
    #: Seconds to write (and to read back) one checkpoint at scale: sets the store's speed.
    checkpoint_s: float
    #: Seconds of one training step at scale.
    step_s: float
    #: Seconds of training the run holds at scale.
    progress_s: float
    #: Termination window at scale of the ``notice`` regime.
    window_s: float
    #: Real-scale seconds per wall second.
    compression: float
    #: MiB of state checkpointed (its copy is the stall, measured, not simulated).
    state_mb: float
    seed: int
    #: The spec's ``checkpoint.train_through_notice``: train on through the window and
    #: flush just before the deadline, instead of flushing at once.
    train_through: bool = True

    def wall(self, seconds: float) -> float:
        return seconds / self.compression

    @property
    def steps(self) -> int:
        return max(1, round(self.progress_s / self.step_s))

    @property
    def store_mbps(self) -> float:
        return self.state_mb / self.wall(self.checkpoint_s)


@dataclass(frozen=True)
class Contender:
    """One run: the interval rule it checkpoints by."""

    name: str
    #: Multiple of the interval preflight chose for ``auto``; None for auto itself.
    factor: float | None = None
    #: Daly's interval for the measured stall instead.
    stall_daly: bool = False


CONTENDERS = (
    Contender("auto"),
    Contender("short", factor=0.1),
    Contender("long", factor=10.0),
    Contender("daly-stall", stall_daly=True),
)


@dataclass(frozen=True)
class Regime:
    name: str
    #: Termination window in wall seconds.
    window_wall_s: float


# ----------------------------------------------------------------------------- plumbing


class QuietNotifier:
    """Counts the chat messages instead of showing them (the Notifier protocol)."""

    def __init__(self) -> None:
        self.posted = 0
        self._lock = threading.Lock()

    def post(self, msg: Message) -> MessageRef:
        with self._lock:
            self.posted += 1
            return MessageRef(channel=msg.channel, ts=f"{self.posted}.000")

    def update(self, ref: MessageRef, msg: Message) -> None:
        return None


class ControlPlaneLog(logging.Handler):
    """The control plane's warnings and errors as one line each on stderr; errors are
    also kept for the result, because a benchmark that hides them measures nothing."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = f"{record.name}: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            line += f" ({type(exc).__name__}: {exc})"
        if record.levelno >= logging.ERROR:
            self.errors.append(line)
        log(f"  [{record.levelname.lower()}] {line}")


class Preemptor:
    """Preempts every attempt of the given runs after an exponential gap from its start.

    Each run draws from its own generator with the same seed, so the n-th attempt of every
    run waits the same time: the contenders face the same preemptions.
    """

    def __init__(self, cp: ControlPlane, *, mtbp_s: float, seed: int) -> None:
        provider = cp.deps.provider
        if not isinstance(provider, LocalProvider):
            raise BenchError("the goodput benchmark needs the local provider")
        self.cp = cp
        self.provider = provider
        self.mtbp_s = mtbp_s
        self.seed = seed
        self._rngs: dict[str, random.Random] = {}
        #: attempt id -> (run id, when the preemption is due, epoch seconds)
        self.due: dict[str, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-preemptor", daemon=True)

    def watch(self, run_id: str) -> None:
        self._rngs[run_id] = random.Random(self.seed)

    def __enter__(self) -> Preemptor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self._poll()
            except Exception as exc:  # a crashed preemptor would silently end the test
                log(f"  preemptor: {type(exc).__name__}: {exc}")

    def _poll(self) -> None:
        runs = list(self._rngs)
        if not runs:
            return
        with session_scope(self.cp.deps.engine) as session:
            rows = session.exec(
                select(Event.attempt_id, Event.run_id, Event.time, Attempt.instance_id)
                .join(Attempt, col(Attempt.id) == col(Event.attempt_id))
                .where(Event.type == "started", col(Event.run_id).in_(runs))
                .order_by(col(Attempt.number))
            ).all()
        for attempt_id, run_id, started, instance_id in rows:
            if attempt_id in self.due or instance_id is None:
                continue
            gap = self._rngs[run_id].expovariate(1.0 / self.mtbp_s)
            at = started.timestamp() + gap
            self.due[attempt_id] = (run_id, max(at, time.time()))
            self.provider.schedule_preemption(
                instance_id, at=datetime.fromtimestamp(at, tz=timezone.utc)
            )


def measure_stall(state_mb: float, root: Path, *, repeats: int = 5) -> float:
    """Median seconds a save of this much state blocks the loop (the writer's own clock)."""
    import torch

    state = {"w": torch.zeros(max(1, int(state_mb * MiB) // 4), dtype=torch.float32)}
    stalls = []
    writer = CheckpointWriter(LocalStore(root / "stall-probe"))
    try:
        for step in range(repeats + 1):
            info = writer.save(step + 1, state).result()
            if step:  # the first allocates the staging buffers, as the first save of a run
                stalls.append(info.stall_s)
    finally:
        writer.close()
    return statistics.median(stalls)


# ----------------------------------------------------------------------------- one regime


def _settings(root: Path, regime: Regime, scenario: Scenario) -> Any:
    return load_settings(
        {
            "TRAINBOT_STATE_DIR": str(root),
            "TRAINBOT_SPECS_DIR": str(root / "specs"),
            "TRAINBOT_INGEST_PORT": "0",
            "TRAINBOT_LOCAL_TERMINATION_WINDOW_S": f"{regime.window_wall_s:.6f}",
            "TRAINBOT_ASSUMED_MTBP_S": f"{scenario.wall(scenario.mtbp_s):.6f}",
            "TRAINBOT_LOCAL_PRICE_PER_HOUR_USD": "1",
            "TRAINBOT_LOCAL_CORES": "64",
            # Each local instance stands for a machine of its own: it does not yield the
            # CPU to other work here, as the demo's niced instances do for Slack's sake.
            "TRAINBOT_LOCAL_NICE": "0",
            "TRAINBOT_HEARTBEAT_DEADLINE_S": "3600",
            "TRAINBOT_ESCALATION_DELAY_S": "3600",
        }
    )


def _write_spec(root: Path, scenario: Scenario) -> None:
    command = (
        f"python -m bench._goodput_child --steps {scenario.steps}"
        f" --step-s {scenario.wall(scenario.step_s):.6f}"
        f" --state-mb {scenario.state_mb:g} --store-mbps {scenario.store_mbps:.3f}"
    )
    spec = {
        "description": "bench_goodput: a long run under random preemptions, time-compressed",
        "command": command,
        "resources": {"cloud": "local", "spot": True, "disk_gb": 1},
        "checkpoint": {"interval": "auto", "train_through_notice": scenario.train_through},
        "retention": {"keep_last": 2},
        "budget": {"usd": 1_000_000},
        "resubmit": {"max_attempts": 1000, "backoff_s": 0.1},
        "dry_run": {"steps": 5, "local": True},
    }
    (root / "specs").mkdir(parents=True, exist_ok=True)
    (root / "specs" / "goodput.yaml").write_text(json.dumps(spec, indent=1))  # JSON is YAML


def run_regime(
    scenario: Scenario,
    regime: Regime,
    contenders: Sequence[Contender],
    *,
    root: Path,
    stall_s: float,
    cap_s: float,
) -> dict[str, Any]:
    """Run every contender in one control plane; return the per-run figures."""
    _write_spec(root, scenario)
    settings = _settings(root, regime, scenario)
    mtbp = scenario.wall(scenario.mtbp_s)
    # The interval each attempt was launched with: "auto" follows the run's measured cost.
    launched: dict[str, float | None] = {}

    def note(type_: str, run_id: str | None, data: dict[str, Any]) -> None:
        if type_ == "launched":
            launched[str(data["attempt_id"])] = data.get("checkpoint_interval_s")

    with ControlPlane(
        settings,
        notifier=QuietNotifier(),
        journal=CallbackJournal(note),
        scheduler_intervals={"reconcile": 0.5, "spend": 10, "escalation": 3600, "cleanup": 2},
    ) as cp:
        try:
            with Preemptor(cp, mtbp_s=mtbp, seed=scenario.seed) as preemptor:
                runs, intervals, rule = _launch(
                    cp, preemptor, contenders, mtbp=mtbp, stall_s=stall_s
                )
                log(
                    f"  {regime.name}: intervals "
                    + ", ".join(f"{n} {v:.3f}s" for n, v in intervals.items())
                    + f"; M {mtbp:.1f}s, window {regime.window_wall_s:g}s"
                )
                horizon = _wait_all(cp.deps, runs, started=time.monotonic(), cap_s=cap_s)
                for name, run_id in runs.items():
                    if not _state(cp, run_id).is_terminal():
                        log(f"  {regime.name}/{name}: stopped at the horizon ({horizon:.0f}s)")
                        stop(cp.deps, run_id, ACTOR, reason="benchmark horizon")
                _wait_attempts_closed(cp.deps, list(runs.values()), timeout_s=30)
                due = dict(preemptor.due)
            figures = {
                name: _figures(
                    cp.deps,
                    run_id,
                    scenario=scenario,
                    regime=regime,
                    interval=intervals[name],
                    due=due,
                    launched=launched,
                )
                for name, run_id in runs.items()
            }
            figures["auto"]["rule"] = rule
            return figures
        finally:
            _terminate_leftovers(cp)


def _state(cp: ControlPlane, run_id: str) -> RunState:
    with session_scope(cp.deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None
        return run.state


def _rule(preflight: dict[str, Any] | None) -> dict[str, Any]:
    """What preflight's interval rule used, from the dry run's result on the run."""
    for result in (preflight or {}).get("results", []):
        if result.get("name") == "dry_run":
            data = result.get("data") or {}
            keys = ("stall_s", "write_s", "emergency_fits_window", "interval_s")
            out = {k: data.get(k) for k in keys}
            out.update(
                cost_s=data.get("interval_cost_s"),
                mtbp_s=data.get("interval_mtbp_s"),
                floor_s=data.get("interval_floor_s"),
            )
            return out
    return {}


def _launch(
    cp: ControlPlane,
    preemptor: Preemptor,
    contenders: Sequence[Contender],
    *,
    mtbp: float,
    stall_s: float,
) -> tuple[dict[str, str], dict[str, float], dict[str, Any]]:
    """Submit auto, wait for preflight's interval, then submit the others at theirs."""
    deps = cp.deps
    auto = submit(deps, spec_name="goodput", overrides=[], actor=ACTOR)
    preemptor.watch(auto.id)
    past_preflight = {RunState.LAUNCHING, RunState.RUNNING, RunState.AWAITING_CONFIRMATION}
    state = wait_for(
        deps, auto.id, past_preflight | {s for s in RunState if s.is_terminal()}, timeout_s=180
    )
    with session_scope(deps.engine) as session:
        row = session.get(Run, auto.id)
        assert row is not None
        chosen, preflight = row.checkpoint_interval_s, row.preflight
    if state == RunState.AWAITING_CONFIRMATION:
        confirm(deps, auto.id, ACTOR)  # a warning (the budget, say) is not the point here
    elif state not in past_preflight:
        raise BenchError(
            f"the auto run's preflight ended {state.value}: "
            + json.dumps(preflight, default=str)[:600]
        )
    if not chosen:
        raise BenchError("preflight chose no checkpoint interval for checkpoint=auto")
    rule = _rule(preflight)
    runs, intervals = {"auto": auto.id}, {"auto": float(chosen)}
    for c in contenders:
        if c.factor is None and not c.stall_daly:
            continue
        interval = daly_interval(stall_s, mtbp) if c.stall_daly else chosen * (c.factor or 1)
        # Its interval is given, so its dry run would prove nothing new: skipped, which
        # is a warning that waits for "launch anyway".
        run = submit(
            deps,
            spec_name="goodput",
            overrides=[f"checkpoint.interval={interval:.6f}", "dry_run.enabled=false"],
            actor=ACTOR,
        )
        preemptor.watch(run.id)
        if (
            wait_for(deps, run.id, {RunState.AWAITING_CONFIRMATION}, timeout_s=60)
            == RunState.AWAITING_CONFIRMATION
        ):
            confirm(deps, run.id, ACTOR)
        runs[c.name], intervals[c.name] = run.id, interval
    return runs, intervals, rule


def _wait_all(deps: Any, runs: dict[str, str], *, started: float, cap_s: float) -> float:
    """Until every run ends; once auto has, the others get a quarter of its time more."""
    deadline = started + cap_s
    auto_done: float | None = None
    last_note = time.monotonic()
    while True:
        with session_scope(deps.engine) as session:
            states = {n: session.get(Run, r).state for n, r in runs.items()}  # type: ignore[union-attr]
            steps = {n: session.get(Run, r).last_step for n, r in runs.items()}  # type: ignore[union-attr]
        now = time.monotonic()
        if all(s.is_terminal() for s in states.values()):
            return now - started
        if auto_done is None and states["auto"].is_terminal():
            auto_done = now
            deadline = min(deadline, now + 0.25 * (now - started))
        if now >= deadline:
            return now - started
        if now - last_note >= 15:
            last_note = now
            log("    " + ", ".join(f"{n} {states[n].value.lower()}@{steps[n]}" for n in runs))
        time.sleep(0.25)


def _wait_attempts_closed(deps: Any, run_ids: list[str], *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with session_scope(deps.engine) as session:
            attempts = session.exec(select(Attempt).where(col(Attempt.run_id).in_(run_ids))).all()
            if all(a.state.is_terminal() for a in attempts):
                return
        time.sleep(0.2)
    log("  some attempts did not close in time; their figures use the time now")


def _terminate_leftovers(cp: ControlPlane) -> None:
    """Nothing this benchmark started outlives it, whatever ended the regime."""
    provider = cp.deps.provider
    for info in provider.list_instances():
        if not info.state.is_terminal():
            try:
                provider.terminate(info.instance_id)
            except ProviderError as exc:
                log(f"  could not terminate {info.instance_id}: {exc}")


# ----------------------------------------------------------------------------- figures


def _ts(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def _figures(
    deps: Any,
    run_id: str,
    *,
    scenario: Scenario,
    regime: Regime,
    interval: float,
    due: dict[str, tuple[str, float]],
    launched: dict[str, float | None],
) -> dict[str, Any]:
    """One run's figures, from its attempt rows and its runner's events."""
    with session_scope(deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None
        state, last_committed = run.state, run.last_committed_step or 0
        attempts = [
            AttemptRow(a.id, a.number, _ts(a.started_at), _ts(a.ended_at), a.state.value)
            for a in session.exec(select(Attempt).where(Attempt.run_id == run_id)).all()
        ]
        events = [
            RunEvent(e.attempt_id, e.type, e.time.timestamp(), dict(e.data))
            for e in session.exec(
                select(Event).where(
                    Event.run_id == run_id,
                    col(Event.type).in_(["started", "restored", "checkpoint_committed", "exit"]),
                )
            ).all()
        ]
        events += [  # metrics are stored by the batch (jobs.metrics)
            RunEvent(p.attempt_id, "metrics", p.time, p.data)
            for p in run_metrics(session.connection(), run_id)
        ]
    summary = tasks.run_summary(deps, run_id)
    finished = state == RunState.SUCCEEDED
    figures = account(
        attempts,
        events,
        kept_steps=scenario.steps if finished else last_committed,
        compression=scenario.compression,
        killed_at={a: at + regime.window_wall_s for a, (_, at) in due.items()},
        now=time.time(),
        default_step_s=scenario.wall(scenario.step_s),
    )
    # Each attempt's interval, weighted by its paid time: what the run checkpointed at.
    spans = [
        (launched.get(a.id) or interval, (a.ended or time.time()) - a.launched)
        for a in sorted(attempts, key=lambda a: a.number)
        if a.launched is not None
    ]
    paid = sum(w for _, w in spans)
    weighted = sum(i * w for i, w in spans) / paid if paid > 0 else interval
    return {
        "interval_s": rounded(weighted),
        "preflight_interval_s": rounded(interval),
        "interval_by_attempt_s": [rounded(i) for i, _ in spans],
        "state": state.value,
        "finished": finished,
        **figures,
        "goodput_system": summary.get("goodput"),
        "lost_steps_system": summary.get("lost_steps"),
    }


# ----------------------------------------------------------------------------- main


def _daly_check(scenario: Scenario, auto: dict[str, Any]) -> dict[str, Any]:
    """The chosen interval against Daly's optimum for the costs measured in the run.

    The chosen interval is the run's, weighted by each attempt's paid time: preflight's
    for the first attempt, then the one the control plane moved to once the run had
    measured its own saves. The judged optimum is max(write, Daly(C, M)): C and the write
    are the medians of the run's own periodic saves (not the dry run's), and M is the
    one preflight's rule used (every preemption without a usable notice; a share of them
    with one). ``daly_write_s`` is the old rule, Daly(write, every preemption), for
    reference.
    """
    mtbp = scenario.wall(scenario.mtbp_s)
    rule = auto.get("rule") or {}
    rule_mtbp = rule.get("mtbp_s") or mtbp
    chosen = float(auto["interval_s"])
    stall, write = auto.get("stall_s_median"), auto.get("write_s_median")
    out: dict[str, Any] = {
        "chosen_interval_s": rounded(chosen),
        "mtbp_s": rounded(mtbp),
        "rule_mtbp_s": rounded(rule_mtbp),
        "rule_cost_s": rule.get("cost_s"),
        "rule_floor_s": rule.get("floor_s"),
        "emergency_fits_window": rule.get("emergency_fits_window"),
        "run_stall_s": stall,
        "run_write_s": write,
        "daly_stall_s": None,
        "error_vs_daly_stall": None,
        "daly_write_s": None,
        "error_vs_daly_write": None,
    }
    if stall and write:
        optimum = max(float(write), daly_interval(float(stall), rule_mtbp))
        out["daly_stall_s"] = rounded(optimum)
        out["error_vs_daly_stall"] = rounded(chosen / optimum - 1)
        first = auto.get("preflight_interval_s")
        out["preflight_interval_s"] = first
        out["error_of_preflight_interval"] = rounded(float(first) / optimum - 1) if first else None
    if write:
        old = daly_interval(float(write), mtbp)
        out["daly_write_s"] = rounded(old)
        out["error_vs_daly_write"] = rounded(chosen / old - 1)
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="the notice regime only, 60x compression: about a minute",
    )
    p.add_argument("--compression", type=float, default=None, help="default 30, quick 60")
    p.add_argument("--mtbp-s", type=float, default=600.0, help="at scale (default 600)")
    p.add_argument("--checkpoint-s", type=float, default=10.0, help="write time at scale")
    p.add_argument("--step-s", type=float, default=3.0, help="one step at scale")
    p.add_argument(
        "--progress-s",
        type=float,
        default=None,
        help="seconds of training in the run, at scale (default 3000, quick 900)",
    )
    p.add_argument("--window-s", type=float, default=120.0, help="notice window at scale")
    p.add_argument("--state-mb", type=float, default=32.0, help="MiB of state (its copy stalls)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--train-through",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="checkpoint.train_through_notice of the runs (default on; --no-train-through "
        "flushes at the notice and exits)",
    )
    p.add_argument(
        "--contenders",
        default=",".join(c.name for c in CONTENDERS),
        help="comma-separated runs side by side; auto is required (default: all)",
    )
    p.add_argument(
        "--regimes",
        default=None,
        help="comma-separated: notice,no-notice (default both; quick: notice)",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir()),
        help="where the state and the store go (default /dev/shm: the store is simulated)",
    )
    args = p.parse_args(argv)
    args.compression = args.compression or (60.0 if args.quick else 30.0)
    args.progress_s = args.progress_s or (900.0 if args.quick else 3000.0)
    args.regimes = args.regimes or ("notice" if args.quick else "notice,no-notice")
    for name in ("compression", "mtbp_s", "checkpoint_s", "step_s", "progress_s", "state_mb"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            p.error(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if args.window_s < 0:
        p.error("--window-s must be 0 or more")
    unknown = set(args.regimes.split(",")) - {"notice", "no-notice"}
    if unknown:
        p.error(f"--regimes: unknown {', '.join(sorted(unknown))}; use notice,no-notice")
    if not args.dir.is_dir():
        p.error(f"--dir {args.dir} is not a directory")
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    known = {c.name for c in CONTENDERS}
    if "auto" not in names or set(names) - known:
        p.error(f"--contenders: give auto and any of {', '.join(sorted(known - {'auto'}))}")
    args.contenders = [c for c in CONTENDERS if c.name in names]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    scenario = Scenario(
        mtbp_s=args.mtbp_s,
        checkpoint_s=args.checkpoint_s,
        step_s=args.step_s,
        progress_s=args.progress_s,
        window_s=args.window_s,
        compression=args.compression,
        state_mb=args.state_mb,
        seed=args.seed,
        train_through=args.train_through,
    )
    regimes = [
        Regime(
            name,
            max(NO_WINDOW_S, scenario.wall(scenario.window_s)) if name == "notice" else NO_WINDOW_S,
        )
        for name in args.regimes.split(",")
    ]
    # Each regime gets at most this long: the auto run needs about progress ÷ goodput plus
    # a process start per attempt, which a busy machine makes slow.
    cap_s = 2 * scenario.wall(scenario.progress_s) + 60
    log(
        f"goodput: {scenario.steps} steps of {scenario.wall(scenario.step_s) * 1000:.0f} ms, "
        f"M {scenario.wall(scenario.mtbp_s):.1f} s, compression {scenario.compression:g}×, "
        f"checkpoint {scenario.state_mb:g} MiB at {scenario.store_mbps:.0f} MiB/s"
    )
    out: dict[str, Any] = {}
    load_before = os.getloadavg()[0]
    cp_log = ControlPlaneLog()
    logging.getLogger().addHandler(cp_log)
    with temp_dir(args.dir, "bench-goodput") as root:
        stall_s = measure_stall(scenario.state_mb, root)
        log(f"  stall of one save, measured here: {stall_s * 1000:.1f} ms")
        for regime in regimes:
            out[regime.name] = run_regime(
                scenario,
                regime,
                args.contenders,
                root=root / regime.name,
                stall_s=stall_s,
                cap_s=cap_s,
            )
            for name, fig in out[regime.name].items():
                log(
                    f"  {regime.name}/{name}: goodput {fig['goodput']} "
                    f"(wall {fig['goodput_wall']}), {fig['preemptions']} preemptions, "
                    f"interval {fig['interval_s']}s, finished {fig['finished']}"
                )
    headline = out.get(HEADLINE) or next(iter(out.values()))
    auto = headline["auto"]
    check = _daly_check(scenario, auto)
    goodput = auto["goodput"]
    error = check.get("error_vs_daly_stall")
    met = (
        goodput is not None
        and goodput >= GOAL
        and error is not None
        and abs(error) <= INTERVAL_TOLERANCE
    )
    doc = {
        "bench": "goodput",
        "ratio": rounded(goodput / GOAL) if goodput is not None else None,
        "goal": GOAL,
        "goal_is": (
            "goodput of auto >= 0.97 and |interval / max(write, Daly(stall, M of the rule))"
            " - 1| <= 0.10, stall and write measured in the run"
        ),
        "met": met,
        "figures": {
            "goodput": goodput,
            "goodput_by_run": {
                regime: {name: fig["goodput"] for name, fig in runs.items()}
                for regime, runs in out.items()
            },
            "headline_regime": HEADLINE if HEADLINE in out else next(iter(out)),
            "daly": check,
            "scenario": {
                "compression": scenario.compression,
                "mtbp_s_at_scale": scenario.mtbp_s,
                "checkpoint_s_at_scale": scenario.checkpoint_s,
                "step_s_at_scale": scenario.step_s,
                "progress_s_at_scale": scenario.progress_s,
                "window_s_at_scale": scenario.window_s,
                "steps": scenario.steps,
                "state_mb": scenario.state_mb,
                "store_mib_s": rounded(scenario.store_mbps, 1),
                "seed": scenario.seed,
                "train_through_notice": scenario.train_through,
                "stall_probe_s": rounded(stall_s),
            },
            # Other work on the machine slows the uncompressed process starts most.
            "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "control_plane_errors": len(cp_log.errors),
            "control_plane_error_kinds": sorted(set(cp_log.errors))[:5],
            "regimes": out,
        },
        "quick": bool(args.quick),
        "machine": machine(),
    }
    sys.stdout.flush()
    print(json.dumps(doc), flush=True)


def _run() -> int:
    try:
        main()
    except (BenchError, RunnerError, TrainbotError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted; temporary files removed", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(_run())

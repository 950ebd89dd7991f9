"""Goodput of a long run under random preemptions, on the real control plane, time-compressed.

The whole product runs as ``trainbot demo`` runs it: a :class:`~jobs.process.bootstrap.ControlPlane`
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
wall second is k); ``goodput_wall`` counts every wall second as it fell. The training
process's own start (the interpreter, importing torch and the runner) is part of that
start-up: the child marks when it is up (``--up-dir``). Preemption gaps run from that
mark, so that the uncompressed start does not eat the compressed time between
preemptions. The accounting is ``bench/_goodput_ledger.py``.

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

Two scenarios: ``base`` (the options; M = 10 minutes by default, both regimes) and ``1h``
(M = one hour, 3 hours of training, the notice regime).

The ceiling (issue 12, item 8). Goodput is judged against the best any checkpointing
design could do with the costs measured in the same run, in seconds at scale:

    S = S0 + S1  start-up: launch to the training process up (S0, 1x) plus up to the
                 first step less the restore (S1); medians over attempts
    R            restore: ``restored.restore_s`` of the resumed attempts, median
    W            write: ``checkpoint_committed.write_s``, median
    C            stall: ``stall_s`` of the periodic saves, median
    w            the notice window, as the regime configures it
    P            the training the run holds: its steps at their measured time (the
                 median of the finished runs' progress, as the ledger counts it)
    M            the mean time between preemptions

Each cost is the lowest of the side-by-side runs' medians (a contender's own waste does
not lower its bar); a cost no run measured is the store's configured transfer time.

    ceiling = P / (P·(1 + c) + (N + 1)·S + N·(R + L) + W)

- Every attempt pays S, every resumed one R: a process must start and the state must be
  read back. They are added, not overlapped: the ledger counts S at 1x and R at k x, so
  an overlap of the two could not be credited consistently here (a design that read the
  checkpoint while its process starts would gain at most min(S, R) per resumed attempt).
- L, work lost per preemption. With a notice whose window fits the flush (W <= w), the
  newest state that can be committed before the kill was snapshotted at least W before
  it: L = W, whether the loop stops at the notice or trains on through the window
  (training through turns the rest of the window into progress, which is why the ideal
  does it, but cannot save the last W). No periodic save is needed then (c = 0): the
  insurance the runner buys against unannounced preemptions (``UNANNOUNCED_SHARE``) is
  a design choice this scenario does not reward, and shows as the gap. Without a usable
  notice (W > w), the ideal saves every τ = max(W, Daly(C, M)) and a kill loses on
  average τ/2 + W (half an interval, plus the save still in flight): L = τ/2 + W, c = C/τ.
- The final W: a run's last state must be committed, once.
- N, the preemptions. Judged (``ceiling``): the ideal design replays the run's own gaps
  (the n-th attempt of every run draws the same one) with train-through, and N is what it
  met; it needs no more attempts than any real design, so a lucky draw lifts the ceiling
  as much as the goodput. ``ceiling_expected`` puts E[N] instead: the notices are a
  Poisson process on each attempt's clock since it is up, which runs for S1, R, the
  training and L, less the window trained through (Wald):
  E[N] = (P·(1 + c) + S1 + W) / (M + w' − S1 − R − L), w' = w when the flush fits, else 0.
- Not counted: process teardown, the control plane noticing an end, redone steps with a
  notice, stalls with a notice, the flush's safety margins. They are the design's, and
  ``beyond_ceiling`` says how much each cost (shares of the run's paid time at scale).

Goal: in the notice regime of every scenario run, ``auto``'s goodput ÷ ceiling >= 0.99
(``ratio``: the headline's, base/notice/auto); in ``1h`` also goodput >= 97 %; and (base)
``auto``'s interval within 10 % of Daly's optimum for the checkpoint cost measured in the
run: max(write, Daly(C, M)) with C and the write the medians of the run's own periodic
saves, and M the one preflight's rule used. ``checks`` lists each with its value.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlmodel import col, select

from bench._common import BenchError, log, machine, rounded, temp_dir
from bench._goodput_ledger import (
    PREEMPTED,
    AttemptRow,
    RunEvent,
    account,
    periodic_stalls,
    split_attempt,
)
from jobs.background import tasks
from jobs.database.db import session_scope
from jobs.database.metrics import run_metrics
from jobs.database.models import Attempt, EventRow, Run
from jobs.domain.errors import TrainbotError
from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import CallbackJournal, Message, MessageRef
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings
from jobs.providers import local
from jobs.providers.base import ProviderError
from jobs.providers.local import LocalProvider
from jobs.usecases.service import Actor, confirm, stop, submit, wait_for
from runner.checkpoint import CheckpointWriter
from runner.errors import RunnerError
from runner.preemption import daly_interval
from runner.store import LocalStore

#: Goodput ÷ ceiling of the auto run in the notice regime of every scenario.
GOAL = 0.99
#: Goodput ÷ ceiling of the auto run in the notice-jitter regime (issue 29).
JITTER_GOAL = 0.98
#: The default sigma of the notice-jitter regime's slowdown at the notice.
NOTICE_JITTER = 0.5
REGIMES = ("notice", "no-notice", "notice-jitter")
#: Absolute goodput of the auto run in the 1h scenario.
HOUR_GOAL = 0.97
INTERVAL_TOLERANCE = 0.10
SCENARIOS = ("base", "1h")
HOUR_MTBP_S = 3600.0
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
    #: From the notice on, uploads go f times slower, f lognormal(0, this) drawn once
    #: per attempt (``notice-jitter``); 0: the store keeps its speed.
    notice_jitter: float = 0.0


# ----------------------------------------------------------------------------- the ceiling


def preemption_gaps(seed: int, mean_s: float) -> Iterator[float]:
    """The seconds from each attempt's start to its preemption notice, attempt by attempt.

    The preemptor draws every run's gaps from this, and the ceiling replays them: the
    n-th attempt of every run, and of the ideal design, meets the same gap.
    """
    rng = random.Random(seed)
    while True:
        yield rng.expovariate(1.0 / mean_s)


@dataclass(frozen=True)
class Costs:
    """What one operation costs, measured in the run, in seconds at scale."""

    #: Launch to the training process up (its ``started`` event). Before the preemption
    #: clock starts, and not simulated: a wall second is a second at scale.
    launch_s: float
    #: ``started`` to the first step, less the restore: building the model, the session.
    setup_s: float
    #: Reading the newest checkpoint back into the process (``restored.restore_s``).
    restore_s: float
    #: Writing one checkpoint, snapshot to commit (``checkpoint_committed.write_s``).
    write_s: float
    #: The loop blocked per save (``checkpoint_committed.stall_s``): Daly's C.
    stall_s: float

    @property
    def startup_s(self) -> float:
        """Process start to first step, less the restore."""
        return self.launch_s + self.setup_s


@dataclass(frozen=True)
class Ceiling:
    """The goodput no checkpointing design can beat, given the costs and the gaps."""

    #: Progress ÷ paid time of the ideal design replaying the run's own preemption gaps.
    goodput: float
    #: The same formula with the expected number of preemptions instead.
    goodput_expected: float
    #: Preemptions the ideal design met (it needs no more attempts than any other).
    preemptions: int
    preemptions_expected: float
    #: Whether the last flush fits the notice window (W <= window).
    flush_fits: bool
    #: Work lost per preemption beyond the restart (L): W, or τ/2 + W without a notice.
    lost_per_preemption_s: float
    #: Stall per second of training (c): 0 with a usable notice, C/τ without.
    overhead: float
    #: The ideal periodic interval τ (no usable notice only).
    interval_s: float | None
    #: The ideal design's paid time, by the ledger's parts (seconds at scale).
    parts_s: Mapping[str, float]


def ceiling(
    costs: Costs,
    *,
    progress_s: float,
    mtbp_s: float,
    window_s: float,
    gaps: Iterable[float],
    max_attempts: int = 10_000,
) -> Ceiling:
    """The best goodput any design reaches with these costs (see the module docstring).

    ``gaps``: seconds from each attempt's ``started`` to its notice, at scale.
    """
    s0, s1, r, w, c0 = (
        costs.launch_s,
        costs.setup_s,
        costs.restore_s,
        costs.write_s,
        costs.stall_s,
    )
    fits = window_s >= w
    if fits:
        # Every preemption is announced and the flush fits: no periodic save is needed;
        # the newest state that can be committed before the kill is w old.
        tau, c, lost, window = None, 0.0, w, window_s
    else:
        # No usable notice: periodic saves at Daly's interval (never under w, one in
        # flight), and a kill loses on average half an interval plus the write in flight.
        tau = max(w, daly_interval(c0, mtbp_s)) if c0 > 0 else w
        c, lost, window = c0 / tau if tau > 0 else 0.0, tau / 2 + w, 0.0
    parts = dict.fromkeys(("startup", "setup_restore", "steps", "loop", "lost", "tail"), 0.0)
    remaining, preempted, attempts = progress_s, 0, 0
    for gap in gaps:
        if attempts >= max_attempts:
            break
        attempts += 1
        restore = r if remaining < progress_s else 0.0  # nothing to restore before a save
        parts["startup"] += s0
        need = s1 + restore + remaining * (1 + c) + w
        if need <= gap + window:  # done, the final save committed before any kill
            parts["setup_restore"] += s1 + restore
            parts["steps"] += remaining
            parts["loop"] += remaining * c
            parts["tail"] += w
            remaining = 0.0
            break
        preempted += 1
        gain = max(0.0, (gap + window - s1 - restore - lost) / (1 + c))
        if gain <= 0:  # nothing to gain: the ideal leaves at the notice
            parts["setup_restore"] += min(gap, s1 + restore)
            parts["lost"] += max(0.0, gap - s1 - restore)
            continue
        gain = min(gain, remaining)
        parts["setup_restore"] += s1 + restore
        parts["steps"] += gain
        parts["loop"] += gain * c
        if fits:
            parts["tail"] += w
        else:
            parts["lost"] += lost
        remaining -= gain
    paid = sum(parts.values())
    # E[N]: the notices are a Poisson process on each attempt's clock since `started`;
    # an attempt is exposed for its set-up, restore, training and lost work, less the
    # window it goes on training through (Wald: E[N] = E[exposure] / M).
    denominator = mtbp_s + window - s1 - r - lost
    n = (progress_s * (1 + c) + s1 + w) / denominator if denominator > 0 else math.inf
    expected_paid = progress_s * (1 + c) + (n + 1) * costs.startup_s + n * (r + lost) + w
    return Ceiling(
        goodput=(progress_s - remaining) / paid if paid > 0 else 0.0,
        goodput_expected=progress_s / expected_paid if math.isfinite(expected_paid) else 0.0,
        preemptions=preempted,
        preemptions_expected=n,
        flush_fits=fits,
        lost_per_preemption_s=lost,
        overhead=c,
        interval_s=tau,
        parts_s=parts,
    )


def run_costs(
    attempts: Sequence[AttemptRow],
    events: Iterable[RunEvent],
    *,
    compression: float,
    killed_at: Mapping[str, float],
    now: float,
) -> dict[str, float | None]:
    """One run's per-operation costs at scale: medians over its attempts and saves."""
    by_attempt: dict[str, list[RunEvent]] = {}
    for e in sorted(events, key=lambda e: e.time):
        by_attempt.setdefault(e.attempt_id, []).append(e)
    launch, setup, restores, writes, stalls = [], [], [], [], []
    for a in attempts:
        evs = by_attempt.get(a.id, [])
        writes += [float(e.data["write_s"]) for e in evs if e.type == "checkpoint_committed"]
        stalls += periodic_stalls(evs)
        if a.launched is None or not any(e.type == "started" for e in evs):
            continue
        split = split_attempt(
            a, evs, killed_at=killed_at.get(a.id), end=a.ended if a.ended is not None else now
        )
        launch.append(split.startup)
        restored = next((e for e in evs if e.type == "restored"), None)
        read = float(restored.data["restore_s"]) if restored is not None else 0.0
        if restored is not None and int(restored.data["step"]) > 0:
            restores.append(read)
        if any(e.type == "metrics" for e in evs):  # it reached a first step
            setup.append(max(0.0, split.setup - read))
    k = compression

    def med(values: list[float], scale: float) -> float | None:
        return statistics.median(values) * scale if values else None

    return {
        "launch_s": med(launch, 1.0),
        "setup_s": med(setup, k),
        "restore_s": med(restores, k),
        "write_s": med(writes, k),
        "stall_s": med(stalls, k),
    }


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


def _up_dir(root: Path) -> Path:
    return root / "up"


def up_time(up_dir: Path, attempt_id: str) -> float | None:
    """When the attempt's training process was up (``_goodput_child --up-dir``), if yet."""
    try:
        return float((up_dir / attempt_id).read_text())
    except (FileNotFoundError, ValueError):
        return None


class Preemptor:
    """Preempts every attempt of the given runs after an exponential gap from its start.

    Each run draws from its own generator with the same seed, so the n-th attempt of every
    run waits the same time: the contenders face the same preemptions.
    """

    def __init__(
        self,
        cp: ControlPlane,
        provider: LocalProvider,
        *,
        mtbp_s: float,
        seed: int,
        up_dir: Path,
    ) -> None:
        """``provider``: the control plane's, whose instances it preempts."""
        self.cp = cp
        self.provider = provider
        self.mtbp_s = mtbp_s
        self.seed = seed
        self.up_dir = up_dir
        self._gaps: dict[str, Iterator[float]] = {}
        #: attempt id -> (run id, when the preemption is due, epoch seconds)
        self.due: dict[str, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-preemptor", daemon=True)

    def watch(self, run_id: str) -> None:
        self._gaps[run_id] = preemption_gaps(self.seed, self.mtbp_s)

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
        runs = list(self._gaps)
        if not runs:
            return
        with session_scope(self.cp.deps.engine) as session:
            rows = session.exec(
                select(EventRow.attempt_id, EventRow.run_id, EventRow.time, Attempt.instance_id)
                .join(Attempt, col(Attempt.id) == col(EventRow.attempt_id))
                .where(EventRow.type == "started", col(EventRow.run_id).in_(runs))
                .order_by(col(Attempt.number))
            ).all()
        for attempt_id, run_id, _started, instance_id in rows:
            if attempt_id in self.due or instance_id is None:
                continue
            up = up_time(self.up_dir, attempt_id)
            if up is None:  # its process is still importing: the clock has not started
                continue
            gap = next(self._gaps[run_id])
            at = up + gap
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


def _write_spec(root: Path, scenario: Scenario, regime: Regime) -> None:
    command = (
        f"python -m bench._goodput_child --steps {scenario.steps}"
        f" --step-s {scenario.wall(scenario.step_s):.6f}"
        f" --state-mb {scenario.state_mb:g} --store-mbps {scenario.store_mbps:.3f}"
        f" --notice-jitter {regime.notice_jitter:g}"
        f" --up-dir {shlex.quote(str(_up_dir(root)))}"
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
    _write_spec(root, scenario, regime)
    settings = _settings(root, regime, scenario)
    mtbp = scenario.wall(scenario.mtbp_s)
    # The interval each attempt was launched with: "auto" follows the run's measured cost.
    launched: dict[str, float | None] = {}

    def note(type_: str, run_id: str | None, data: dict[str, Any]) -> None:
        if type_ == "launched":
            launched[str(data["attempt_id"])] = data.get("checkpoint_interval_s")

    provider = local.from_settings(settings)
    with ControlPlane(
        settings,
        provider=provider,
        notifier=QuietNotifier(),
        journal=CallbackJournal(note),
        scheduler_intervals={"reconcile": 0.5, "spend": 10, "escalation": 3600, "cleanup": 2},
    ) as cp:
        try:
            with Preemptor(
                cp, provider, mtbp_s=mtbp, seed=scenario.seed, up_dir=_up_dir(root)
            ) as preemptor:
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
                    up_dir=_up_dir(root),
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


def attempt_interval(
    launched_with: float, *, start: float, end: float, commits: Sequence[tuple[float, float]]
) -> float:
    """The checkpoint interval of one attempt, weighted by time: the one it was launched
    with until a commit says another is in effect (``commits``: time, interval)."""
    if end <= start:
        return launched_with
    t, current, total = start, launched_with, 0.0
    for at, interval in sorted(commits):
        at = min(max(at, t), end)
        total += current * (at - t)
        t, current = at, interval
    return (total + current * (end - t)) / (end - start)


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
    up_dir: Path,
) -> dict[str, Any]:
    """One run's figures, from its attempt rows, its runner's events and when each
    attempt's training process was up."""
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
                select(EventRow).where(
                    EventRow.run_id == run_id,
                    col(EventRow.type).in_(["started", "restored", "checkpoint_committed", "exit"]),
                )
            ).all()
        ]
        events += [  # metrics are stored by the batch (jobs.database.metrics)
            RunEvent(p.attempt_id, "metrics", p.time, p.data)
            for p in run_metrics(session.connection(), run_id)
        ]
    events += [
        RunEvent(a.id, "up", up, {}) for a in attempts if (up := up_time(up_dir, a.id)) is not None
    ]
    summary = tasks.run_summary(deps, run_id)
    finished = state == RunState.SUCCEEDED
    killed_at = {a: at + regime.window_wall_s for a, (_, at) in due.items()}
    now = time.time()
    figures = account(
        attempts,
        events,
        kept_steps=scenario.steps if finished else last_committed,
        compression=scenario.compression,
        killed_at=killed_at,
        now=now,
        default_step_s=scenario.wall(scenario.step_s),
    )
    costs = run_costs(
        attempts, events, compression=scenario.compression, killed_at=killed_at, now=now
    )
    # Each attempt's interval, weighted by its paid time: what the run checkpointed at.
    # An "auto" interval moves within an attempt too, once the session has measured its
    # saves (their commits carry the interval in effect from then on).
    spans = [
        (
            attempt_interval(
                launched.get(a.id) or interval,
                start=a.launched,
                end=a.ended or time.time(),
                commits=[
                    (e.time, float(e.data["interval_s"]))
                    for e in events
                    if e.attempt_id == a.id
                    and e.type == "checkpoint_committed"
                    and e.data.get("interval_s")
                ],
            ),
            (a.ended or time.time()) - a.launched,
        )
        for a in sorted(attempts, key=lambda a: a.number)
        if a.launched is not None
    ]
    paid = sum(w for _, w in spans)
    weighted = sum(i * w for i, w in spans) / paid if paid > 0 else interval
    # What the design left of each window it was preempted in: not paid, but progress the
    # ideal design makes (its last step, the flush's margins).
    exits = {e.attempt_id: e.time for e in events if e.type == "exit"}
    # What each preempted attempt's flushes kept (issue 29): none may end with less
    # committed than the step it was at when the notice came.
    reports = [e.data["flush"] for e in events if e.type == "exit" and e.data.get("flush")]
    # An attempt that gave its restore up at the notice trained nothing: what it had at
    # the notice is what was committed before it, whether or not it had listed the store.
    # Nor did one the notice's signal ended before its session started (the supervisor's
    # `before_start` report): this benchmark's child trains only inside its session.
    below_notice = [
        r
        for r in reports
        if not (r.get("restore_given_up") or r.get("before_start"))
        and (r["committed_step"] is None or r["committed_step"] < r["notice_step"])
    ]
    # An attempt the preemptor killed whose exit carried no report: what it kept is unknown,
    # so it counts against the check instead of passing it by saying nothing.
    reported = {e.attempt_id for e in events if e.type == "exit" and e.data.get("flush")}
    unreported = [
        a.id
        for a in attempts
        if a.state in PREEMPTED and a.id in killed_at and a.id not in reported
    ]
    unused = [
        max(0.0, killed_at[a.id] - exits[a.id]) * scenario.compression
        for a in attempts
        if a.state in PREEMPTED and a.id in killed_at and a.id in exits
    ]
    return {
        "interval_s": rounded(weighted),
        "preflight_interval_s": rounded(interval),
        "interval_by_attempt_s": [rounded(i) for i, _ in spans],
        "state": state.value,
        "finished": finished,
        **figures,
        "goodput_system": summary.get("goodput"),
        "lost_steps_system": summary.get("lost_steps"),
        "costs_s": {name: rounded(value, 3) for name, value in costs.items()},
        "window_unused_s_at_scale": [rounded(u, 1) for u in unused],
        "notice_flushes": {
            "reports": len(reports),
            "below_notice": len(below_notice),
            "unreported": len(unreported),
            "second_landed": sum(
                1 for r in reports if len(r["flushes"]) > 1 and r["flushes"][1]["landed"]
            ),
            "given_up_steps": [r["given_up_steps"] for r in reports],
        },
    }


def judge_regime(
    scenario: Scenario, regime: Regime, runs: dict[str, dict[str, Any]], *, stall_probe_s: float
) -> dict[str, Any]:
    """The regime's ceiling, and every run's goodput against it.

    One ceiling for all the runs side by side: each cost is the lowest of the runs'
    medians (the cheapest the machine did it in this regime), so a contender's own
    waste never lowers the bar it is judged by. A cost nobody measured (no run restored)
    is the store's configured transfer time, the floor of any read or write.
    """
    k = scenario.compression
    fallback = {
        "launch_s": 0.0,
        "setup_s": 0.0,
        "restore_s": scenario.checkpoint_s,
        "write_s": scenario.checkpoint_s,
        "stall_s": stall_probe_s * k,
    }
    measured: dict[str, float] = {}
    source: dict[str, str] = {}
    for key, default in fallback.items():
        values = [fig["costs_s"][key] for fig in runs.values() if fig["costs_s"][key] is not None]
        measured[key] = min(values) if values else default
        source[key] = "measured" if values else "configured"
    costs = Costs(**measured)
    window_s = regime.window_wall_s * k
    # P as the ledger counts it: the steps at their measured time (a sleep overshoots a
    # little, more on a loaded machine), so that the ideal is credited the same progress.
    done = [fig["progress_s"] * k for fig in runs.values() if fig["finished"]]
    progress_s = statistics.median(done) if done else scenario.steps * scenario.step_s
    source["progress_s"] = "measured" if done else "configured"
    cl = ceiling(
        costs,
        progress_s=progress_s,
        mtbp_s=scenario.mtbp_s,
        window_s=window_s,
        gaps=(g * k for g in preemption_gaps(scenario.seed, scenario.wall(scenario.mtbp_s))),
    )
    for fig in runs.values():
        good = fig["goodput"]
        fig["ceiling"] = rounded(cl.goodput)
        fig["ratio"] = rounded(good / cl.goodput) if good is not None and cl.goodput else None
        fig["beyond_ceiling"] = _beyond(fig, cl, compression=k)
    block = {
        "ceiling": rounded(cl.goodput),
        "ceiling_expected": rounded(cl.goodput_expected),
        "preemptions": cl.preemptions,
        "preemptions_expected": rounded(cl.preemptions_expected, 2),
        "flush_fits_window": cl.flush_fits,
        "lost_per_preemption_s": rounded(cl.lost_per_preemption_s, 2),
        "stall_overhead": rounded(cl.overhead, 5),
        "interval_s": rounded(cl.interval_s, 2),
        "costs_s": {
            "startup": rounded(costs.startup_s, 3),
            **{key: rounded(value, 3) for key, value in measured.items()},
            "window": rounded(window_s, 3),
            "mtbp": scenario.mtbp_s,
            "progress": rounded(progress_s, 1),
        },
        "cost_source": source,
        "parts_s": {name: rounded(value, 2) for name, value in cl.parts_s.items()},
    }
    return {"ceiling": block, "runs": runs}


def _beyond(fig: dict[str, Any], cl: Ceiling, *, compression: float) -> dict[str, Any]:
    """Where a run paid beyond the ideal design, part by part, as shares of its paid time
    at scale (they add up to 1 − goodput ÷ ceiling × (the run's paid ÷ the ideal's))."""
    b, k = fig["breakdown_s"], compression
    actual = {
        "startup": b["startup"],  # launch to `started`: at 1x
        "setup_restore": b["setup_restore"] * k,
        "steps": b["steps_kept"] * k,
        "loop": b["loop_overhead"] * k + b["loop_reporting"],  # the stalls at scale
        "lost": b["steps_redone"] * k,
        "tail": b["tail"] * k,
        "shutdown_and_lag": b["shutdown"] + b["control_plane_lag"],
    }
    paid = sum(actual.values())
    ideal = dict(cl.parts_s)
    ideal["shutdown_and_lag"] = 0.0
    shares = {
        name: rounded((actual[name] - ideal.get(name, 0.0)) / paid, 4) if paid > 0 else None
        for name in actual
    }
    return {
        "extra_preemptions": fig["preemptions"] - cl.preemptions,
        "paid_s_at_scale": rounded(paid, 1),
        "ideal_paid_s": rounded(sum(ideal.values()), 1),
        "share_of_paid": shares,
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
        help="the base scenario's notice regime only, 60x compression: under a minute",
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
        help="comma-separated regimes of the base scenario: notice,no-notice,notice-jitter "
        "(default all three; quick: notice,notice-jitter)",
    )
    p.add_argument(
        "--notice-jitter",
        type=float,
        default=NOTICE_JITTER,
        help="sigma of the notice-jitter regime: from the notice on, the store's uploads "
        f"go f times slower, f lognormal(0, sigma) per attempt (default {NOTICE_JITTER})",
    )
    p.add_argument(
        "--scenarios",
        default=None,
        help="comma-separated: base (the options above; M 10 min by default) and 1h "
        "(one hour between preemptions, notice regime); default both, quick: base",
    )
    p.add_argument(
        "--hour-progress-s",
        type=float,
        default=10800.0,
        help="seconds of training of the 1h scenario, at scale (default 10800)",
    )
    p.add_argument(
        "--hour-compression",
        type=float,
        default=None,
        help="of the 1h scenario (default: --compression's)",
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
    args.regimes = args.regimes or (
        "notice,notice-jitter" if args.quick else "notice,no-notice,notice-jitter"
    )
    args.scenarios = args.scenarios or ("base" if args.quick else "base,1h")
    args.hour_compression = args.hour_compression or args.compression
    for name in (
        "compression",
        "mtbp_s",
        "checkpoint_s",
        "step_s",
        "progress_s",
        "state_mb",
        "hour_progress_s",
        "hour_compression",
    ):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            p.error(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if args.window_s < 0:
        p.error("--window-s must be 0 or more")
    unknown = set(args.regimes.split(",")) - set(REGIMES)
    if unknown:
        p.error(f"--regimes: unknown {', '.join(sorted(unknown))}; use {','.join(REGIMES)}")
    if not (math.isfinite(args.notice_jitter) and args.notice_jitter > 0):
        p.error(f"--notice-jitter must be a positive number, got {args.notice_jitter}")
    scenarios = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    if not scenarios or set(scenarios) - set(SCENARIOS):
        p.error(f"--scenarios: give any of {', '.join(SCENARIOS)}")
    args.scenarios = [n for n in SCENARIOS if n in scenarios]
    if not args.dir.is_dir():
        p.error(f"--dir {args.dir} is not a directory")
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    known = {c.name for c in CONTENDERS}
    if "auto" not in names or set(names) - known:
        p.error(f"--contenders: give auto and any of {', '.join(sorted(known - {'auto'}))}")
    args.contenders = [c for c in CONTENDERS if c.name in names]
    return args


def _scenarios(args: argparse.Namespace) -> dict[str, Scenario]:
    base = Scenario(
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
    hour = replace(
        base,
        mtbp_s=HOUR_MTBP_S,
        progress_s=args.hour_progress_s,
        compression=args.hour_compression,
    )
    return {name: s for name, s in (("base", base), ("1h", hour)) if name in args.scenarios}


def _regimes(scenario: Scenario, names: Sequence[str], *, jitter: float) -> list[Regime]:
    notice = max(NO_WINDOW_S, scenario.wall(scenario.window_s))
    return [
        Regime(n, NO_WINDOW_S)
        if n == "no-notice"
        else Regime(n, notice, notice_jitter=jitter if n == "notice-jitter" else 0.0)
        for n in names
    ]


def _describe(scenario: Scenario, stall_s: float) -> dict[str, Any]:
    return {
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
    }


def _check(name: str, value: float | None, goal: str, met: bool) -> dict[str, Any]:
    return {"check": name, "value": value, "goal": goal, "met": bool(met)}


def _checks(out: dict[str, Any], daly: dict[str, Any] | None) -> list[dict[str, Any]]:
    """What ``met`` is made of: each scenario's auto against its ceiling (and the hour's
    absolute goal) in the notice regime, and the headline interval against Daly's."""
    checks = []
    for name, block in out.items():
        jitter = block["regimes"].get("notice-jitter")
        if jitter is not None:
            ratio = jitter["runs"]["auto"]["ratio"]
            checks.append(
                _check(
                    f"{name}/notice-jitter/auto goodput / ceiling",
                    ratio,
                    f">= {JITTER_GOAL}",
                    ratio is not None and ratio >= JITTER_GOAL,
                )
            )
        for regime_name in ("notice", "notice-jitter"):
            if regime_name not in block["regimes"]:
                continue
            below = sum(
                run["notice_flushes"]["below_notice"] + run["notice_flushes"]["unreported"]
                for run in block["regimes"][regime_name]["runs"].values()
            )
            checks.append(
                _check(
                    f"{name}/{regime_name}: attempts ending with less committed than at the "
                    "notice, or preempted with no flush report",
                    below,
                    "== 0",
                    below == 0,
                )
            )
        notice = block["regimes"].get("notice")
        if notice is None:
            continue
        auto = notice["runs"]["auto"]
        ratio = auto["ratio"]
        checks.append(
            _check(
                f"{name}/notice/auto goodput / ceiling",
                ratio,
                f">= {GOAL}",
                ratio is not None and ratio >= GOAL,
            )
        )
        if name == "1h":
            good = auto["goodput"]
            checks.append(
                _check(
                    "1h/notice/auto goodput",
                    good,
                    f">= {HOUR_GOAL}",
                    good is not None and good >= HOUR_GOAL,
                )
            )
    if daly is not None:
        error = daly.get("error_vs_daly_stall")
        checks.append(
            _check(
                "headline interval / max(W, Daly(C, M of the rule)) - 1",
                error,
                f"|x| <= {INTERVAL_TOLERANCE}",
                error is not None and abs(error) <= INTERVAL_TOLERANCE,
            )
        )
    return checks


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    scenarios = _scenarios(args)
    out: dict[str, dict[str, Any]] = {}
    load_before = os.getloadavg()[0]
    cp_log = ControlPlaneLog()
    logging.getLogger().addHandler(cp_log)
    with temp_dir(args.dir, "bench-goodput") as root:
        stall_s = measure_stall(args.state_mb, root)
        log(f"goodput: stall of one save, measured here: {stall_s * 1000:.1f} ms")
        for name, scenario in scenarios.items():
            names = args.regimes.split(",") if name == "base" else ["notice"]
            regimes = _regimes(scenario, names, jitter=args.notice_jitter)
            # Each regime gets at most this long: the auto run needs about progress ÷
            # goodput plus a process start per attempt, which a busy machine makes slow.
            cap_s = 2 * scenario.wall(scenario.progress_s) + 60
            log(
                f"{name}: {scenario.steps} steps of {scenario.wall(scenario.step_s) * 1000:.0f}"
                f" ms, M {scenario.wall(scenario.mtbp_s):.1f} s, compression"
                f" {scenario.compression:g}×, checkpoint {scenario.state_mb:g} MiB at"
                f" {scenario.store_mbps:.0f} MiB/s"
            )
            out[name] = {"scenario": _describe(scenario, stall_s), "regimes": {}}
            for regime in regimes:
                runs = run_regime(
                    scenario,
                    regime,
                    args.contenders,
                    root=root / name / regime.name,
                    stall_s=stall_s,
                    cap_s=cap_s,
                )
                judged = judge_regime(scenario, regime, runs, stall_probe_s=stall_s)
                out[name]["regimes"][regime.name] = judged
                log(
                    f"  {name}/{regime.name}: ceiling {judged['ceiling']['ceiling']}"
                    f" ({judged['ceiling']['preemptions']} preemptions for the ideal design)"
                )
                for run, fig in runs.items():
                    log(
                        f"  {name}/{regime.name}/{run}: goodput {fig['goodput']} "
                        f"(wall {fig['goodput_wall']}), ratio {fig['ratio']}, "
                        f"{fig['preemptions']} preemptions, interval {fig['interval_s']}s, "
                        f"finished {fig['finished']}"
                    )
    head_name = next(iter(out))
    head_regimes = out[head_name]["regimes"]
    head_regime = "notice" if "notice" in head_regimes else next(iter(head_regimes))
    auto = head_regimes[head_regime]["runs"]["auto"]
    # The interval goal belongs to the base scenario.
    daly = _daly_check(scenarios[head_name], auto) if head_name == "base" else None
    checks = _checks(out, daly)
    doc = {
        "bench": "goodput",
        "ratio": auto["ratio"],
        "goal": GOAL,
        "goal_is": (
            f"goodput / ceiling of auto >= {GOAL} in the notice regime of every scenario run,"
            f" goodput >= {HOUR_GOAL} in 1h, and the headline's interval within"
            f" {INTERVAL_TOLERANCE:.0%} of max(write, Daly(stall, M of the rule))"
        ),
        "met": bool(checks) and all(c["met"] for c in checks),
        "goodput": auto["goodput"],
        "ceiling": auto["ceiling"],
        "checks": checks,
        "figures": {
            "headline": f"{head_name}/{head_regime}/auto",
            "by_run": {
                name: {
                    regime: {
                        run: {"goodput": fig["goodput"], "ratio": fig["ratio"]}
                        for run, fig in block["runs"].items()
                    }
                    for regime, block in scen["regimes"].items()
                }
                for name, scen in out.items()
            },
            "daly": daly,
            # Other work on the machine slows the uncompressed process starts most.
            "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "control_plane_errors": len(cp_log.errors),
            "control_plane_error_kinds": sorted(set(cp_log.errors))[:5],
            "scenarios": out,
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

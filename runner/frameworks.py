"""Metrics read from what training frameworks write, for scripts without the session API.

A Hugging Face Trainer script reports nothing to trainbot, but every ``checkpoint-N/``
it saves holds ``trainer_state.json``, whose ``log_history`` lists the logged loss,
learning rate and epoch by step; PyTorch Lightning's ``CSVLogger`` appends the same to
``metrics.csv``. :class:`FrameworkMetrics` reads them in the sync dir
(``$TRAINBOT_CHECKPOINT_DIR``) and turns each new step into the ``metrics`` event a
session would send, so the divergence rule, the run card's loss and the step time work
for such scripts too.

Neither file says when a step ran. The step time is the time between two writes of one
file (its mtime) over the steps between them: it includes the saves in between, as a
real step rate does; the first write of an attempt has nothing to measure against, so
its points carry NaN (unknown, which the control plane leaves out of its step times).
TensorBoard event files are not read: parsing their records needs TensorBoard's
protobufs, which the runner's light install does not have.

Only the standard library: ``exec`` must not pay for importing a framework.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FrameworkMetrics", "Point", "hf_points", "lightning_points"]

log = logging.getLogger(__name__)

#: Hugging Face Trainer's state file: in each checkpoint folder, and in the output dir.
HF_STATE = "trainer_state.json"
#: PyTorch Lightning's CSVLogger file (``{save_dir}/{name}/version_{n}/metrics.csv``).
LIGHTNING_CSV = "metrics.csv"
#: How deep under the sync dir a metrics.csv is looked for (lightning_logs/version_0/).
_CSV_DEPTH = 3
#: Keys of a log entry that are not metrics.
_NOT_METRICS = frozenset({"step", "global_step", "loss", "epoch_end"})
#: Which column is the loss, in order of preference (the first one present).
_LOSS_KEYS = ("loss", "train_loss", "train_loss_step", "training_loss")
_HF_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")

#: Reads one file's text into its points.
Reader = Callable[[str], list["Point"]]


@dataclass(frozen=True)
class Point:
    """One step's figures, as a framework logged them."""

    step: int
    loss: float | None
    #: The other numbers logged at this step (learning_rate, epoch, grad_norm, val_loss …).
    metrics: dict[str, float]


def _number(value: Any) -> float | None:
    """A logged value as a float: numbers, and the strings CSV and JSON give for them."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value.strip():
        try:
            return float(value)  # "nan", "inf" and "1e-3" alike
        except ValueError:
            return None
    return None


def _point(step: int, entry: dict[str, Any]) -> Point:
    loss = None
    for key in _LOSS_KEYS:
        if key in entry and (loss := _number(entry[key])) is not None:
            break
    metrics = {
        k: v
        for k, raw in entry.items()
        if k not in _NOT_METRICS and k not in _LOSS_KEYS[:1] and (v := _number(raw)) is not None
    }
    return Point(step=step, loss=loss, metrics=metrics)


def _merge(points: Iterable[Point]) -> list[Point]:
    """One point per step, in step order: a step logged twice (training, then evaluation)
    keeps the first loss and every metric."""
    by_step: dict[int, Point] = {}
    for p in points:
        seen = by_step.get(p.step)
        if seen is None:
            by_step[p.step] = p
        else:
            loss = seen.loss if seen.loss is not None else p.loss
            by_step[p.step] = Point(p.step, loss, {**p.metrics, **seen.metrics})
    return [by_step[s] for s in sorted(by_step)]


def hf_points(text: str) -> tuple[int, list[Point]]:
    """(global step, points) of a ``trainer_state.json``'s text. Raises ValueError when
    it is not one (torn, or another file of that name)."""
    state = json.loads(text)  # Python's json reads the NaN that Trainer writes for a NaN loss
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        raise ValueError("no log_history: not a Hugging Face trainer_state.json")
    points: list[Point] = []
    for entry in state["log_history"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("step"), int):
            continue
        if "train_runtime" in entry:
            continue  # the end-of-training summary: averages, not a step's figures
        points.append(_point(entry["step"], entry))
    step = state.get("global_step")
    return (step if isinstance(step, int) else max((p.step for p in points), default=0)), _merge(
        points
    )


def lightning_points(text: str) -> list[Point]:
    """The points of a Lightning ``metrics.csv``'s text (a row per log call; empty cells
    for what that call did not log). A last line without its newline is being written:
    left for the next read."""
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    points: list[Point] = []
    for row in csv.DictReader(text.splitlines()):
        step = _number(row.get("step"))
        if step is None or not math.isfinite(step) or step < 0:
            continue
        entry = {k: v for k, v in row.items() if k is not None and v not in (None, "")}
        points.append(_point(int(step), entry))
    return _merge(points)


@dataclass
class _Source:
    """A file already read: what it held then."""

    sig: tuple[int, int]
    #: Its mtime (seconds) when the newest step it holds was read.
    mtime: float
    step: int


@dataclass
class FrameworkMetrics:
    """Reads the frameworks' files under ``root`` and yields each new step once.

    ``after_step``: steps at or before it were reported already (by the attempt that
    saved the checkpoint restored into ``root``), so they are not sent again.
    """

    root: Path
    after_step: int = -1
    #: Seconds between two looks at the files (the supervisor calls :meth:`poll` often).
    every_s: float = 1.0
    #: The newest step reported.
    last_step: int = field(init=False)
    _last_look: float = field(default=-math.inf, init=False)
    _sources: dict[Path, _Source] = field(default_factory=dict, init=False)
    #: (mtime, step) of the newest step read, from any file: the step time's start.
    _mark: tuple[float, int] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.last_step = self.after_step

    def poll(self, *, now: float, force: bool = False) -> list[tuple[float, dict[str, Any]]]:
        """New steps as (unix time, ``metrics`` event data), oldest first; nothing when
        the last look was under ``every_s`` ago (``now``: time.monotonic()), unless
        ``force``."""
        if not force and now - self._last_look < self.every_s:
            return []
        self._last_look = now
        out: list[tuple[float, dict[str, Any]]] = []
        for path, reader in self._files():
            try:
                st = path.stat()
            except OSError:
                continue
            sig = (st.st_size, st.st_mtime_ns)
            seen = self._sources.get(path)
            if seen is not None and seen.sig == sig:
                continue
            try:
                text = path.read_text(encoding="utf-8")
                points = reader(text)
            except (OSError, ValueError, UnicodeDecodeError, csv.Error) as exc:
                log.debug("%s unreadable for now (%s); read again at the next change", path, exc)
                continue  # torn mid-write: its signature is not kept, so it is read again
            newest = max((p.step for p in points), default=-1)
            self._sources[path] = _Source(sig=sig, mtime=st.st_mtime, step=newest)
            fresh = [p for p in points if p.step > self.last_step]
            if fresh:
                out.extend(self._events(fresh, mtime=st.st_mtime))
        return out

    def _events(
        self, points: list[Point], *, mtime: float
    ) -> Iterator[tuple[float, dict[str, Any]]]:
        newest = points[-1].step
        step_time = math.nan
        start = self._mark
        if start is not None and newest > start[1] and mtime > start[0]:
            step_time = (mtime - start[0]) / (newest - start[1])
        self._mark = (mtime, newest)
        self.last_step = newest
        for p in points:
            # Spread over the interval they were run in, so a window of the last minutes
            # holds the steps of the last minutes.
            when = mtime if math.isnan(step_time) else mtime - (newest - p.step) * step_time
            yield (
                when,
                {
                    "step": p.step,
                    "loss": p.loss,
                    "step_time_s": step_time,
                    "data_wait_fraction": None,
                    "metrics": p.metrics,
                },
            )

    def _files(self) -> list[tuple[Path, Reader]]:
        """The files to look at: the newest Hugging Face state (the highest checkpoint
        folder's, or the output dir's own), and each Lightning metrics.csv."""
        found: list[tuple[Path, Reader]] = []
        best: tuple[int, Path] | None = None
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.root):
                m = _HF_CHECKPOINT.match(entry.name)
                if m and entry.is_dir():
                    state = Path(entry.path) / HF_STATE
                    if (best is None or int(m.group(1)) > best[0]) and state.is_file():
                        best = (int(m.group(1)), state)
        top = self.root / HF_STATE
        if best is not None:
            found.append((best[1], _hf_reader))
        if top.is_file():
            found.append((top, _hf_reader))
        found.extend((p, lightning_points) for p in _csv_files(self.root, _CSV_DEPTH))
        return found


def _hf_reader(text: str) -> list[Point]:
    return hf_points(text)[1]


def _csv_files(root: Path, depth: int) -> Iterator[Path]:
    """metrics.csv files under ``root``, ``depth`` folders down at most, skipping the
    checkpoint folders (they hold no logs and may be large)."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        if entry.name == LIGHTNING_CSV and entry.is_file():
            yield Path(entry.path)
        elif (
            depth > 0
            and entry.is_dir(follow_symlinks=False)
            and not entry.name.startswith(".")
            and not _HF_CHECKPOINT.match(entry.name)
        ):
            yield from _csv_files(Path(entry.path), depth - 1)

"""What the runner tests hand a session in place of the training script's own parts: an
event sink that keeps what it is given, tracked state of a chosen size or step, and a
supervisor of a few lines of Python."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

import torch

from runner.supervisor import Supervisor


class Recorder:
    """An event sink that keeps what it is given, with when (``time.monotonic()``)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.times: list[float] = []

    def emit(self, type: str, data: Mapping[str, Any], *, time: float | None = None) -> None:
        self.events.append((type, dict(data)))
        self.times.append(_now())

    def close(self, timeout: float = 10.0) -> None:
        return None

    def of(self, type_: str) -> list[dict[str, Any]]:
        return [d for t, d in self.events if t == type_]

    def timed(self, type_: str) -> list[tuple[dict[str, Any], float]]:
        """The events of ``type_`` with when each was emitted."""
        return [(d, at) for (t, d), at in zip(self.events, self.times, strict=True) if t == type_]


def _now() -> float:
    return time.monotonic()


class Weights:
    """State whose size is chosen (``floats`` float32s): what a save costs."""

    def __init__(self, floats: int) -> None:
        self.t = torch.zeros(floats)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"w": self.t}

    def load_state_dict(self, state: dict[str, torch.Tensor], /) -> None:
        self.t.copy_(state["w"])


class Counter:
    """A tracked object whose state says which step saved it."""

    def __init__(self) -> None:
        self.step = -1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "w": torch.full((4,), float(self.step))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def supervising(code: str, sink: Recorder, *, env: Mapping[str, str], **options: Any) -> Supervisor:
    """A Supervisor of ``python -c code`` reporting to ``sink``; this process's signal
    handlers are left alone (a test's notice comes through ``options["flag"]``)."""
    return Supervisor(
        [sys.executable, "-c", code], sink=sink, install_signals=False, env=dict(env), **options
    )

"""Telemetry from the runner to the control plane.

``sink`` is the interface; ``reporter`` ships events through the durable ``spool``;
``events_file`` carries a supervised script's events to the runner; ``system`` samples
the GPU and the scratch disk. See docs/architecture.md, "Runner: telemetry".
"""

from __future__ import annotations

from runner.telemetry.events_file import FileFollower, FileSink, SinkRecord, follow_file
from runner.telemetry.reporter import Reporter
from runner.telemetry.sink import EventSink, NullSink, SpoolError
from runner.telemetry.system import SystemSampler, sample_system

__all__ = [
    "EventSink",
    "FileFollower",
    "FileSink",
    "NullSink",
    "Reporter",
    "SinkRecord",
    "SpoolError",
    "SystemSampler",
    "follow_file",
    "sample_system",
]

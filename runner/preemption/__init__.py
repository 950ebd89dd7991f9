"""Turn preemption into a flag the training loop checks between steps.

``flag`` is the flag and its notices; ``signals`` the handlers that set it; ``aws`` and
``gcp`` the metadata pollers, ``pollers`` which ones start; ``flush`` the termination
windows and what fits in them; ``relay`` the notice a supervisor hands its child.
Standard library only. See docs/architecture.md, "Runner: preemption".
"""

from __future__ import annotations

from runner.env import TERMINATION_WINDOWS_S as WINDOWS_S
from runner.preemption.aws import AWS_TOKEN_TTL_S, AwsSpotPoller, aws_notice
from runner.preemption.flag import (
    SOURCES,
    Notice,
    PreemptionConfigError,
    PreemptionError,
    PreemptionFlag,
    SignalSetupError,
)
from runner.preemption.flush import (
    ASSUMED_BANDWIDTH_BPS,
    MEASURED_SAVES_MIN,
    UNANNOUNCED_SHARE,
    IntervalChoice,
    choose_interval,
    daly_interval,
    flush_fits,
    flush_seconds,
    write_seconds,
)
from runner.preemption.gcp import GcpPreemptedPoller
from runner.preemption.metadata import Poller
from runner.preemption.pollers import Pollers, start_pollers, termination_window_s
from runner.preemption.relay import read_notice, write_notice
from runner.preemption.signals import SignalHandlers

__all__ = [
    "ASSUMED_BANDWIDTH_BPS",
    "AWS_TOKEN_TTL_S",
    "MEASURED_SAVES_MIN",
    "SOURCES",
    "UNANNOUNCED_SHARE",
    "WINDOWS_S",
    "AwsSpotPoller",
    "GcpPreemptedPoller",
    "IntervalChoice",
    "Notice",
    "Poller",
    "Pollers",
    "PreemptionConfigError",
    "PreemptionError",
    "PreemptionFlag",
    "SignalHandlers",
    "SignalSetupError",
    "aws_notice",
    "choose_interval",
    "daly_interval",
    "flush_fits",
    "flush_seconds",
    "read_notice",
    "start_pollers",
    "termination_window_s",
    "write_notice",
    "write_seconds",
]

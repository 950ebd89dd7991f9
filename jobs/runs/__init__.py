"""The attempt machinery: what drives a run through its attempts, one instance each.

The boundaries, from the bottom up: ``jobs.domain.lifecycle`` holds only the run and attempt
state machines; this package moves runs and attempts through them; ``jobs.usecases.service``
holds the chat use-cases that call it; ``jobs.background.tasks`` the scheduled jobs that call it.

- ``rows``: reading a run and its attempts, moving the run's state.
- ``cards``: the run's card, messages in its thread, and where its alerts go.
- ``placement``: the zone and market of the next attempt.
- ``price``: holding a launch back until ``resubmit.max_price`` is met.
- ``profile``: the profile window of a run's start, and the projection made from it.
- ``interval``: the checkpoint interval, following the save cost the run measured.
- ``launch``: recording an attempt and provisioning its instance.
- ``events``: what a stored runner event does to its attempt and run.
- ``end``: ending an attempt, terminating its instance.
- ``recovery``: the same run's next attempt after a preemption or a listed exit code, and
  the work lost (a resubmit that starts a new run is ``jobs.usecases.resubmits``).
- ``reconcile``: the provider's instances against the database, repaired.
- ``fence``: refusing a deposed leader's late launch or termination.
- ``capacity``, ``relaunch``: a run waiting for capacity or a price, and its next try.
"""

from jobs.preflight import resource_request
from jobs.runs.cards import (
    alert_config,
    alert_target,
    card,
    flag_unreadable_spec,
    raise_signals,
    refresh_card,
    run_context,
    say,
)
from jobs.runs.end import end_attempt, terminate_instance
from jobs.runs.events import on_attempt_event
from jobs.runs.interval import measured_interval
from jobs.runs.launch import (
    budget_then_launch,
    launch_attempt,
    launcher_refused,
    provision,
    runner_command,
    runner_env,
)
from jobs.runs.placement import NO_CAPACITY, Placement, choose_placement
from jobs.runs.reconcile import ADOPT_AFTER_S, reconcile
from jobs.runs.recovery import next_attempt_now, record_lost_work, resubmit_if_due
from jobs.runs.relaunch import watch_prices
from jobs.runs.rows import (
    active_attempt,
    channel_of,
    checkpoint_prefix,
    get_run,
    latest_attempt,
    move_run,
    run_hours,
    spec_of,
    watched_spec,
)

__all__ = [
    "ADOPT_AFTER_S",
    "NO_CAPACITY",
    "Placement",
    "active_attempt",
    "alert_config",
    "alert_target",
    "budget_then_launch",
    "card",
    "channel_of",
    "checkpoint_prefix",
    "choose_placement",
    "end_attempt",
    "flag_unreadable_spec",
    "get_run",
    "latest_attempt",
    "launch_attempt",
    "launcher_refused",
    "measured_interval",
    "move_run",
    "next_attempt_now",
    "on_attempt_event",
    "provision",
    "raise_signals",
    "reconcile",
    "record_lost_work",
    "refresh_card",
    "resource_request",
    "resubmit_if_due",
    "run_context",
    "run_hours",
    "runner_command",
    "runner_env",
    "say",
    "spec_of",
    "terminate_instance",
    "watch_prices",
    "watched_spec",
]

"""The alert lifecycle, after PagerDuty: ``OPEN → ACKED → RESOLVED``.

Rules (:mod:`jobs.rules`) say what is wrong on every evaluation; this module turns that
stream of :class:`~jobs.rules.Signal` objects into a few alerts people can act on:

- One unresolved alert per ``(run, rule, key)``. The database enforces it
  (``Alert.dedupe_key`` is UNIQUE while the alert is unresolved and NULL after), so two
  replicas racing to open the same alert end with one row: the loser's insert fails
  inside a savepoint, it re-reads the winner's row and counts a repeat.
- A repeat never posts again: it bumps ``count``/``last_seen`` and updates the existing
  message in place. A severity increase (warning → critical) is shown the same way.
- An acknowledged alert stops notifying: repeats only update its message quietly, and
  it never escalates. A snoozed alert is not shown at all until the snooze expires,
  but its counts keep going.
- An unacknowledged critical alert escalates by levels: the on-call group after a delay,
  then the next level, then that level again up to a cap, until someone acknowledges it.
- One problem, one alert. A rule that fires again within the quiet period
  (``alerts.quiet_period``) after its alert resolved reopens that alert: same id, same
  message, updated, with a count. Signals with the same ``incident`` (a loss spike and
  a rising trend) join one alert whose message lists each; it resolves when all clear.
  An alert that reopens more than ``alerts.flap_count`` times within
  ``alerts.flap_window`` is flapping: the message says so, once.
- Some alerts act: a signal's ``stop_after_s`` sets when trainbot stops the run if the
  alert is still open and unacknowledged (0: at once, acknowledged or not, as for a NaN
  loss). :func:`stops_due` lists them; ``jobs.background.tasks`` stops the runs.

Everything works inside the caller's session and never commits; the caller's
``session_scope`` does. Messages are posted from inside the transaction, after the
row is flushed (so a racing duplicate is detected *before* anything is posted) and
before commit (so the returned :class:`~jobs.outbound.notify.MessageRef` is stored with the
alert in the same transaction). ``Notifier.post`` only queues, so nothing waits on
the network while rows are locked. The cost: if the transaction rolls back after the
post, the queued message still goes out for an alert that was not stored; the next
evaluation opens the alert again and posts a second message. A duplicate message
beats a lost one, and rollbacks here mean the database failed, which is rare.

Times are arguments (``now``); nothing here reads a clock.

The modules: :mod:`~jobs.alerts.lifecycle` (open, repeat, acknowledge, snooze, resolve),
:mod:`~jobs.alerts.incidents` (incidents, reopening, flapping),
:mod:`~jobs.alerts.escalation` (paging by levels), :mod:`~jobs.alerts.stops` (runs
stopped for their alert) and :mod:`~jobs.alerts.display` (the message and where it goes).
"""

from jobs.alerts.display import AlertTarget, alert_message
from jobs.alerts.escalation import escalate_due
from jobs.alerts.lifecycle import acknowledge, open_alerts, process_signals, resolve, snooze
from jobs.alerts.stops import mark_stopped, stops_due

__all__ = [
    "AlertTarget",
    "acknowledge",
    "alert_message",
    "escalate_due",
    "mark_stopped",
    "open_alerts",
    "process_signals",
    "resolve",
    "snooze",
    "stops_due",
]

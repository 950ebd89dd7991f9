"""What runs cost: accrual, totals, budgets, and the figures of the daily digest.

Money is recorded as :class:`~jobs.database.models.SpendRecord` rows, one per attempt per
accrual interval: the attempt's current price per instance-hour (spot price at launch,
refreshed by whoever updates ``Attempt.price_per_hour``) × hours × instances. Records
tile each attempt's paid time without gaps or overlaps: each starts where the last
ended, and ``UNIQUE(attempt_id, period_start)`` means a second, concurrent accrual of
the same interval fails instead of counting twice.

Sums over a time window (a day, a month) prorate each record by the share of it
inside the window, so a record that straddles local midnight is split between the two
days, whatever the accrual interval.

Budgets alert once per threshold: the thresholds already reported are kept in the
``budgets`` table (``alerted``), for team budgets (scope ``"team"``) and for runs
(scope ``"run"``, one row per run, created on its first check). A threshold that spend
falls back below (a raised budget) is armed again, and so is every team threshold at
the start of a new month (``updated_at`` tells which month ``alerted`` belongs to).

A run's budget goes on through its resubmits: the new run carries the old one's spend,
and one whose budget is spent (with a hard cap) is not resubmitted until the budget is
raised (:func:`resubmit_budget`). A run's cloud budget (AWS Budgets) is removed when the
run has ended, or ``cloud_budget_keep_days`` later (:func:`remove_cloud_budgets`).

Storage is its own line: the bytes each run keeps in its checkpoint store × the store's
price per GB-month (:mod:`~jobs.spend.storage`). It is reported beside compute in the
digest and the summary, and not counted in budgets, whose hard cap stops instances.
Badput (:mod:`~jobs.spend.badput`) splits the paid time that made no progress by cause.

The modules: :mod:`~jobs.spend.accrual` (records and totals), :mod:`~jobs.spend.budgets`,
:mod:`~jobs.spend.cloud_budgets`, :mod:`~jobs.spend.storage`, :mod:`~jobs.spend.badput`
and :mod:`~jobs.spend.digest` (digest and report figures).
"""

from jobs.spend.accrual import accrue, run_spent, team_spent
from jobs.spend.badput import badput_figures
from jobs.spend.budgets import BudgetStatus, check_budgets, resubmit_budget
from jobs.spend.cloud_budgets import remove_cloud_budgets
from jobs.spend.digest import PERIODS, digest_figures, spend_chart_png, spend_report
from jobs.spend.storage import StoragePrice, monthly_usd, run_storage_price, storage_figures

__all__ = [
    "PERIODS",
    "BudgetStatus",
    "StoragePrice",
    "accrue",
    "badput_figures",
    "check_budgets",
    "digest_figures",
    "monthly_usd",
    "remove_cloud_budgets",
    "resubmit_budget",
    "run_spent",
    "run_storage_price",
    "spend_chart_png",
    "spend_report",
    "storage_figures",
    "team_spent",
]

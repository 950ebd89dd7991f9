"""A run's budget as an AWS Budget, filtered on the run's cost-allocation tag.

Named after the run (:func:`budget_name`), which is what makes creating it idempotent.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from typing import Any

from botocore.exceptions import ClientError

from jobs.providers.aws.clients import Clients
from jobs.providers.aws.errors import error_code
from jobs.providers.base import TAG_RUN_ID, ProviderError

__all__ = ["budget_name", "create_budget", "delete_budget"]

log = logging.getLogger(__name__)

#: Subscribers AWS accepts per budget notification (emails and the SNS topic together).
_MAX_SUBSCRIBERS = 10


def budget_name(run_id: str) -> str:
    """The AWS Budget of a run; a name, because that is what makes creating it idempotent."""
    return re.sub(r"[:\\]", "-", f"trainbot-{run_id}")[:100]


def _notification(threshold: float) -> dict[str, Any]:
    return {
        "NotificationType": "ACTUAL",
        "ComparisonOperator": "GREATER_THAN",
        "Threshold": float(threshold),
        "ThresholdType": "PERCENTAGE",
    }


def create_budget(
    clients: Clients,
    *,
    run_id: str,
    usd: float,
    thresholds: Sequence[int],
    emails: Sequence[str] = (),
    sns_topic_arn: str | None = None,
) -> str:
    """An AWS Budget for the run's tagged cost, notifying at each threshold percent.

    Idempotent on :func:`budget_name`: a second call updates the limit and adds missing
    notifications. Costs are matched on the ``trainbot-run-id`` cost-allocation tag,
    which has to be activated once in the Billing console. The period is the calendar
    year (AWS's longest standard one). Each notification goes to every one of
    ``emails`` and to ``sns_topic_arn`` (AWS takes at most 10 subscribers per
    notification, one of them SNS); without any, the budget is created with no
    notifications, since AWS requires a subscriber for each.
    """
    if not (usd > 0 and math.isfinite(usd)):
        raise ProviderError(f"run {run_id}: a budget needs a positive amount (got {usd})")
    bad = [t for t in thresholds if not 0 < t <= 1000]
    if bad:
        raise ProviderError(f"budget thresholds must be percentages in (0, 1000]: {bad}")
    name = budget_name(run_id)
    account = clients.account_id()
    budgets = clients.client("budgets", region="us-east-1")
    budget = {
        "BudgetName": name,
        "BudgetLimit": {"Amount": f"{usd:.2f}", "Unit": "USD"},
        "TimeUnit": "ANNUALLY",
        "BudgetType": "COST",
        "CostFilters": {"TagKeyValue": [f"user:{TAG_RUN_ID}${run_id}"]},
    }
    emails = list(dict.fromkeys(e.strip() for e in emails if e.strip()))
    if len(emails) + bool(sns_topic_arn) > _MAX_SUBSCRIBERS:
        raise ProviderError(
            f"an AWS Budget notifies at most {_MAX_SUBSCRIBERS} subscribers; "
            f"TRAINBOT_AWS_BUDGET_EMAILS lists {len(emails)}"
            + (" besides the SNS topic" if sns_topic_arn else "")
        )
    subscribers = [{"SubscriptionType": "EMAIL", "Address": e} for e in emails]
    if sns_topic_arn:
        subscribers.append({"SubscriptionType": "SNS", "Address": sns_topic_arn})
    wanted = sorted(set(thresholds)) if subscribers else []

    with clients.call("budgets", f"create the budget {name}"):
        try:
            budgets.create_budget(
                AccountId=account,
                Budget=budget,
                NotificationsWithSubscribers=[
                    {"Notification": _notification(t), "Subscribers": subscribers} for t in wanted
                ],
            )
            log.info("created AWS budget %s (%.2f USD) for run %s", name, usd, run_id)
        except ClientError as exc:
            if error_code(exc) != "DuplicateRecordException":
                raise
            current = budgets.describe_budget(AccountId=account, BudgetName=name)["Budget"]
            if float(current["BudgetLimit"]["Amount"]) != round(usd, 2):
                budgets.update_budget(AccountId=account, NewBudget=budget)
            existing = budgets.describe_notifications_for_budget(
                AccountId=account, BudgetName=name
            ).get("Notifications", [])
            have = {
                float(n["Threshold"])
                for n in existing
                if n.get("NotificationType") == "ACTUAL"
                and n.get("ThresholdType", "PERCENTAGE") == "PERCENTAGE"
            }
            for t in wanted:
                if float(t) not in have:
                    budgets.create_notification(
                        AccountId=account,
                        BudgetName=name,
                        Notification=_notification(t),
                        Subscribers=subscribers,
                    )
    if not subscribers:
        log.warning(
            "AWS budget %s notifies nobody: set TRAINBOT_AWS_BUDGET_EMAILS or "
            "TRAINBOT_AWS_BUDGET_SNS_TOPIC_ARN",
            name,
        )
    return name


def delete_budget(clients: Clients, *, run_id: str) -> None:
    """Remove the run's budget; a budget that is already gone is not an error."""
    name = budget_name(run_id)
    account = clients.account_id()
    with clients.call("budgets", f"delete the budget {name}"):
        try:
            clients.client("budgets", region="us-east-1").delete_budget(
                AccountId=account, BudgetName=name
            )
        except ClientError as exc:
            if error_code(exc) != "NotFoundException":
                raise

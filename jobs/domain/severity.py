"""How loud an alert is: shared by the rules, which decide it, and the tables, which
store it. Its own module so that the rules need not import the tables."""

from __future__ import annotations

from enum import Enum

__all__ = ["Severity"]


class Severity(str, Enum):
    """How loud an alert is, from the rule's signal to the stored row (one enum for both);
    only ``CRITICAL`` escalates to the on-call group."""

    INFO = "INFO"
    WARNING = "WARNING"
    CRITICAL = "CRITICAL"

    def __str__(self) -> str:
        return self.value

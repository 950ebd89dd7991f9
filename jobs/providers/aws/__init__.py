"""AWS: spot GPUs on EC2, behind the Provider protocol.

``provider`` holds :class:`AwsProvider` and the registry's factories; ``catalog``,
``capacity``, ``launch``, ``status``, ``placement`` (a multi-node attempt's cluster
placement group), ``budgets`` and ``errors`` one concern each; ``refresh`` the
price-refresh tool; ``credentials`` the runners' storage credential broker. boto3 is
imported in this package and nowhere else in ``jobs/``. The design:
docs/architecture.md, "Providers: AWS".
"""

from jobs.providers.aws.budgets import budget_name
from jobs.providers.aws.capacity import quota_codes
from jobs.providers.aws.catalog import ACCELERATOR_TYPES, PRICES_PATH
from jobs.providers.aws.credentials import credential_broker
from jobs.providers.aws.errors import IAM_ACTIONS, AwsCredentialsError
from jobs.providers.aws.launch import DEFAULT_IMAGE, USER_DATA_TEMPLATE
from jobs.providers.aws.provider import AwsProvider, from_settings, make
from jobs.providers.aws.refresh import main, refresh_prices
from jobs.providers.aws.status import TAG_TERMINATED_BY, TERMINATION_WINDOW_S

__all__ = [
    "ACCELERATOR_TYPES",
    "DEFAULT_IMAGE",
    "IAM_ACTIONS",
    "PRICES_PATH",
    "TAG_TERMINATED_BY",
    "TERMINATION_WINDOW_S",
    "USER_DATA_TEMPLATE",
    "AwsCredentialsError",
    "AwsProvider",
    "budget_name",
    "credential_broker",
    "from_settings",
    "main",
    "make",
    "quota_codes",
    "refresh_prices",
]

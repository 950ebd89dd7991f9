"""The laptop's spot cloud: each instance is a local process group that can be preempted.

``provider`` holds :class:`LocalProvider` and the registry's factories; ``machine``,
``records``, ``processes``, ``preemption`` and ``status`` one concern each. The design
(the state directory's layout, preemption, restarts): docs/architecture.md,
"Providers: local".
"""

from jobs.providers.local.processes import DEFAULT_NICE
from jobs.providers.local.provider import LocalProvider, from_settings, make
from jobs.providers.local.records import REGION, ZONE

__all__ = [
    "DEFAULT_NICE",
    "REGION",
    "ZONE",
    "LocalProvider",
    "credential_broker",
    "from_settings",
    "make",
]


def credential_broker(settings: object) -> None:
    """None: a local instance shares this machine's file system, so there is nothing to
    hand out."""
    return None

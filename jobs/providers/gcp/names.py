"""Instance names and ids, label values, and the small parsers of API fields.

An instance id is ``ZONE/NAME`` (``us-central1-a/trainbot-…``): every instance call is
per zone, so the id carries what the API needs.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime, timezone

from jobs.providers.base import InstanceNotFound

__all__ = ["instance_name", "label_value", "last", "region_of_zone", "split_id", "utc"]


def label_value(text: str) -> str:
    """A GCP label value: lowercase letters, digits, ``_`` and ``-``, at most 63 characters."""
    return re.sub(r"[^a-z0-9_-]", "-", text.lower())[:63]


def instance_name(run_id: str, attempt_id: str) -> str:
    """The instance's name, a pure function of the run and attempt: one attempt, one name.

    The hash keeps names distinct when sanitising or truncating would make two ids equal.
    """
    digest = hashlib.sha256(f"{run_id}/{attempt_id}".encode()).hexdigest()[:10]
    slug = re.sub(r"[^a-z0-9]+", "-", attempt_id.lower()).strip("-")[:40].strip("-")
    return f"trainbot-{slug}-{digest}" if slug else f"trainbot-{digest}"


def split_id(instance_id: str) -> tuple[str, str]:
    """(zone, name) of an instance id; InstanceNotFound for anything else."""
    zone, sep, name = instance_id.partition("/")
    if not sep or not re.fullmatch(r"[a-z]+-[a-z]+\d+-[a-z]", zone) or not name:
        raise InstanceNotFound(
            f"{instance_id!r} is not a GCP instance id of trainbot's (ZONE/NAME, such as"
            " us-central1-a/trainbot-attempt-1-…); it was not launched by this provider",
            instance_id=instance_id,
        )
    return zone, name


def region_of_zone(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def utc(stamp: str) -> datetime:
    """An API timestamp (RFC 3339) in UTC; now, for an empty one."""
    if not stamp:
        return datetime.now(timezone.utc)
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).astimezone(timezone.utc)


def last(url: str) -> str:
    """The last segment of a resource URL (``…/zones/us-central1-a`` → ``us-central1-a``)."""
    return url.rstrip("/").rsplit("/", 1)[-1]

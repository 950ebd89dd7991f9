"""Instance names and ids, label values, and the small parsers of API fields.

An instance id is ``ZONE/NAME`` (``us-central1-a/trainbot-…``): every instance call is
per zone, so the id carries what the API needs.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime, timezone

from jobs.providers.base import InstanceNotFound

__all__ = [
    "instance_name",
    "label_value",
    "last",
    "policy_name",
    "region_of_zone",
    "split_id",
    "utc",
]

#: What Compute Engine accepts as a resource name (instances, resource policies).
_NAME = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")


def label_value(text: str) -> str:
    """A GCP label value: lowercase letters, digits, ``_`` and ``-``, at most 63 characters."""
    return re.sub(r"[^a-z0-9_-]", "-", text.lower())[:63]


def instance_name(run_id: str, attempt_id: str, *, node: int = 0) -> str:
    """The instance's name, a pure function of the run, attempt and node rank: one node of
    one attempt, one name. Node 0 (and a one-node attempt) has the name attempts always had,
    so an instance launched before gangs existed is still adopted by it.

    The hash keeps names distinct when sanitising or truncating would make two ids equal;
    the node's ``-nK`` shortens the slug, so the name stays within 63 characters.
    """
    seed = f"{run_id}/{attempt_id}" + (f"/n{node}" if node else "")
    digest = hashlib.sha256(seed.encode()).hexdigest()[:10]
    suffix = f"n{node}" if node else ""
    slug = re.sub(r"[^a-z0-9]+", "-", attempt_id.lower()).strip("-")
    slug = slug[: 40 - len(suffix) - 1 if suffix else 40].strip("-")
    middle = "-".join(part for part in (slug, suffix) if part)
    return f"trainbot-{middle}-{digest}" if middle else f"trainbot-{digest}"


def policy_name(placement_group: str) -> str:
    """The compact placement policy's name for a gang's ``placement_group``: the name
    itself when Compute Engine accepts it, else a sanitised one with a hash of it (so two
    groups never share a policy)."""
    if _NAME.fullmatch(placement_group):
        return placement_group
    digest = hashlib.sha256(placement_group.encode()).hexdigest()[:10]
    slug = re.sub(r"[^a-z0-9]+", "-", placement_group.lower()).strip("-")[:40].strip("-")
    if slug and not slug[0].isalpha():
        slug = f"p-{slug}"[:40].strip("-")
    return f"{slug}-{digest}" if slug else f"trainbot-{digest}"


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

"""Where a run's checkpoints may live: inside the roots an admin configured, and nowhere else.

The control plane deletes checkpoints (retention, ``/train cleanup``) with its own
credentials, so the directory it deletes in must be one that a chat message cannot
choose. Two halves make that true:

- the root (``checkpoint.uri`` in a spec) must normalise to a location inside one of
  ``TRAINBOT_CHECKPOINT_LOCATIONS`` (default: ``TRAINBOT_CHECKPOINT_URI`` alone);
- the directory under the root is the run's id, or the id of the run it resumes, which
  trainbot alone writes (``Run.checkpoint_prefix``).

Both are checked when a run is submitted and again before every store call the control
plane makes, so a row written before these rules cannot be used to escape them either.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import unquote, urlparse

from jobs.domain.errors import SpecError

__all__ = ["Location", "check_prefix", "checkpoint_root", "dry_run_prefix", "parse_location"]

#: Schemes the checkpoint stores understand (``gs`` is reserved for the GCS store).
_SCHEMES = ("file", "s3", "gs")
#: A bucket name as S3 and Cloud Storage both accept it.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]")
#: A run's directory: a run id (``r-3f9c2a1b``) or a dry run's (``r-3f9c2a1b-dry-run``).
_PREFIX = re.compile(r"r-[a-z0-9]{1,64}(-dry-run)?")


def dry_run_prefix(run_id: str) -> str:
    """A run's dry-run directory under its root, beside the run's own: the dry run
    commits there, and its instance's brokered credentials reach nothing else."""
    return f"{run_id}-dry-run"


@dataclass(frozen=True)
class Location:
    """A normalised checkpoint location."""

    #: ``file``, ``s3`` or ``gs``.
    scheme: str
    #: The bucket; empty for ``file``.
    bucket: str
    #: Path segments below the bucket (or the file system's root), none empty, ``.`` or ``..``.
    parts: tuple[str, ...]

    @property
    def uri(self) -> str:
        path = "/".join(self.parts)
        if self.scheme == "file":
            return f"file:///{path}"
        return f"{self.scheme}://{self.bucket}/{path}" if path else f"{self.scheme}://{self.bucket}"

    def contains(self, other: Location) -> bool:
        """Whether ``other`` is this location or lies below it."""
        return (
            other.scheme == self.scheme
            and other.bucket == self.bucket
            and other.parts[: len(self.parts)] == self.parts
        )


def parse_location(text: str, *, what: str = "checkpoint.uri") -> Location:
    """Normalise a path, ``file://``, ``s3://`` or ``gs://`` URI, refusing anything that
    could name a place other than the one it appears to: ``..`` and ``.`` segments, empty
    segments, a query or fragment, percent-escapes of ``/``, control characters."""
    raw = str(text).strip()
    if not raw:
        raise SpecError(f"{what} is empty: give s3://bucket/prefix or an absolute directory")
    if any(ord(c) < 0x20 or c in "\\\x7f" for c in raw):
        raise SpecError(f"{what} contains a control character or a backslash; write it plainly")
    parsed = urlparse(raw)
    if parsed.query or parsed.fragment or "?" in raw or "#" in raw:
        raise SpecError(f"{what} {_clip(raw)} has a '?' or '#': checkpoint locations take neither")
    scheme = parsed.scheme or "file"
    if scheme not in _SCHEMES:
        raise SpecError(
            f"{what} {_clip(raw)}: unsupported scheme {scheme!r}; use s3://bucket/prefix, "
            "gs://bucket/prefix or an absolute directory"
        )
    if scheme == "file":
        if parsed.scheme and parsed.netloc not in ("", "localhost"):
            raise SpecError(f"{what} {_clip(raw)} names a remote host; write file:///path")
        path = parsed.path if parsed.scheme else raw
        if not path.startswith("/"):
            raise SpecError(f"{what} {_clip(raw)} is not an absolute path")
        bucket = ""
    else:
        bucket = parsed.netloc
        if not _BUCKET.fullmatch(bucket):
            raise SpecError(f"{what} {_clip(raw)} does not name a valid bucket")
        path = parsed.path
    if "%2f" in path.lower() or "%00" in path:
        raise SpecError(f"{what} {_clip(raw)} hides a '/' or NUL in a percent-escape")
    segments = [unquote(s) for s in PurePosixPath(path or "/").parts if s != "/"]
    inner = path.strip("/")
    if inner and len(segments) != len(inner.split("/")):
        raise SpecError(f"{what} {_clip(raw)} has an empty path segment ('//')")
    if any(s in (".", "..") for s in segments):
        raise SpecError(f"{what} {_clip(raw)} has a '.' or '..' segment; write the full path")
    return Location(scheme=scheme, bucket=bucket, parts=tuple(segments))


def checkpoint_root(uri: str | None, *, default: str, allowed: Iterable[str]) -> str:
    """The normalised root a run's checkpoints go under: ``uri`` (a spec's) or ``default``,
    which must lie inside one of ``allowed`` (the default itself when none is given)."""
    roots = [parse_location(r, what="TRAINBOT_CHECKPOINT_LOCATIONS") for r in allowed] or [
        parse_location(default, what="TRAINBOT_CHECKPOINT_URI")
    ]
    location = parse_location(uri if uri is not None else default)
    if not any(root.contains(location) for root in roots):
        where = ", ".join(r.uri for r in roots)
        raise SpecError(
            f"checkpoint.uri {_clip(location.uri)} is outside the checkpoint locations this "
            f"trainbot may use ({where}); use one of them (or a directory inside one), or "
            "ask an admin to add it to TRAINBOT_CHECKPOINT_LOCATIONS"
        )
    return location.uri


def check_prefix(prefix: str) -> str:
    """A run's directory under its root, as trainbot writes it; anything else is refused
    before a store is opened with it."""
    if not _PREFIX.fullmatch(prefix):
        raise SpecError(
            f"{_clip(prefix)} is not a run's checkpoint directory; trainbot chooses it "
            "(the run's id), and it cannot be set"
        )
    return prefix


def _clip(text: str, limit: int = 80) -> str:
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}… ({len(text)} characters)"

"""Instance records on disk: ``<state_dir>/instances/<instance_id>/``, one file per fact.

Every file is written atomically, so a restarted control plane reads what the one before
it wrote; the layout is in docs/architecture.md, "Providers: local".
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from jobs.providers.base import (
    InstanceNotFound,
    LaunchRequest,
    ProviderError,
)

__all__ = [
    "EXIT",
    "INSTANCE",
    "LOG",
    "PREEMPTED",
    "PROCESS",
    "REGION",
    "SCRATCH",
    "TERMINATED",
    "ZONE",
    "Instances",
    "Record",
    "read_json",
    "utc",
    "write_json",
]

log = logging.getLogger(__name__)

#: The local provider's only region and zone.
REGION = "local"
ZONE = "local-a"

INSTANCE = "instance.json"
PROCESS = "process.json"
EXIT = "exit.json"
PREEMPTED = "preempted.json"
TERMINATED = "terminated.json"
LOG = "output.log"
SCRATCH = "scratch"
_ID = re.compile(r"local-[0-9a-f]{12}")


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Replace ``path`` atomically: readers see the old file or the new one, never half."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ProviderError(
            f"local instance file {path} is unreadable ({e}): delete its instance directory"
            " if the instance is no longer needed"
        ) from None
    if not isinstance(data, dict):
        raise ProviderError(f"local instance file {path} holds no JSON object: delete it")
    return data


def utc(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=timezone.utc)


@dataclass(frozen=True)
class Record:
    """instance.json: what was launched. Holds no environment, so no runner token."""

    instance_id: str
    run_id: str
    attempt_id: str
    owner: str
    zone: str
    idempotency_key: str
    spot: bool
    launched_at: float
    command: list[str]
    scratch_bytes: int
    cpus: int
    accelerator_count: int
    tags: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Record:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class Instances:
    """The ``instances/`` directory of one state directory, shared by every provider
    object (and every control plane process) that is given the same state directory."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.root = state_dir / "instances"
        self.root.mkdir(parents=True, exist_ok=True)

    def dir(self, instance_id: str) -> Path:
        return self.root / instance_id

    def has(self, instance_id: str, name: str) -> bool:
        return (self.dir(instance_id) / name).exists()

    def read(self, instance_id: str, name: str) -> dict[str, Any] | None:
        return read_json(self.dir(instance_id) / name)

    def write(self, instance_id: str, name: str, data: Mapping[str, Any]) -> None:
        write_json(self.dir(instance_id) / name, data)

    def load(self, instance_id: str) -> Record:
        data = None
        if _ID.fullmatch(instance_id):
            data = read_json(self.dir(instance_id) / INSTANCE)
        if data is None:
            raise InstanceNotFound(
                f"no local instance {instance_id!r} in {self.root}: it was never"
                " launched here, or its directory was deleted",
                instance_id=instance_id,
            )
        return Record.from_json(data)

    def records(self) -> list[Record]:
        """Every readable record, oldest first."""
        records = []
        for d in self.root.iterdir():
            if not _ID.fullmatch(d.name):
                continue
            try:
                data = read_json(d / INSTANCE)
            except ProviderError as e:  # one damaged record must not hide the others
                log.warning("skipping local instance %s: %s", d.name, e)
                continue
            if data is not None:
                records.append(Record.from_json(data))
        return sorted(records, key=lambda r: (r.launched_at, r.instance_id))

    @contextlib.contextmanager
    def launch_lock(self) -> Iterator[None]:
        """Serialise launches across processes sharing the state directory."""
        with open(self.state_dir / ".launch.lock", "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def create(
        self, req: LaunchRequest, key: str, *, extra_tags: Mapping[str, str] | None = None
    ) -> Record:
        """A new instance directory with its scratch volume and its instance.json."""
        extra_tags = extra_tags or {}
        instance_id = f"local-{uuid.uuid4().hex[:12]}"
        directory = self.dir(instance_id)
        (directory / SCRATCH).mkdir(parents=True)
        record = Record(
            instance_id=instance_id,
            run_id=req.run_id,
            attempt_id=req.attempt_id,
            owner=req.owner,
            zone=ZONE,
            idempotency_key=key,
            spot=req.spot,
            launched_at=time.time(),
            command=list(req.command),
            scratch_bytes=req.scratch_bytes,
            cpus=req.request.cpus or 1,
            accelerator_count=max(req.request.accelerator_count, 0),
            tags={**req.tags(key), **extra_tags},
        )
        write_json(directory / INSTANCE, asdict(record))
        return record

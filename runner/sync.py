"""Checkpoints a script writes itself, synced to the store by ``trainbot-runner exec``.

A script that does not use the session API writes its checkpoints into
``$TRAINBOT_CHECKPOINT_DIR`` (``exec --sync-dir DIR``), in one of two shapes:

- a folder whose name ends in its step (Hugging Face's ``checkpoint-500/``);
- files whose names hold their step: ``ckpt-500.pt`` (a plain ``torch.save``),
  ``epoch=0-step=500.ckpt`` (PyTorch Lightning), ``model-500.pt`` + ``optim-500.pt``
  (several files of one step form one checkpoint).

Each is committed as one checkpoint of that step (``kind="files"``; a folder under its
own name as label, top-level files under the label ``"."``) once it has *settled*: the
names, sizes and mtimes of its files were unchanged across two scans ``settle_s`` apart.
When the script has ended, a clean exit (0) has closed every file, so everything left is
committed; after a crash or a signal only what was unchanged since the last scan and not
open in the script's processes then (or settled) is, because a file the script was
writing when it died is torn. Before the script starts, the newest committed checkpoint
is put back under its own name, so a script that resumes from the newest file it finds
resumes on a new instance too.

Only the standard library: ``exec`` must not pay for importing torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from runner.errors import CheckpointError, StoreError
from runner.layout import (
    MANIFEST,
    CommitInfo,
    FileEntry,
    Manifest,
    list_committed,
    read_manifest,
    step_dir,
)
from runner.store import Store

__all__ = ["FILES_LABEL", "CheckpointSync", "Restored", "dir_step", "file_step", "open_files"]

log = logging.getLogger(__name__)

#: The label of a checkpoint made of top-level files (restored into the sync dir itself).
FILES_LABEL = "."
#: Bytes read, hashed and written at a time.
CHUNK = 8 << 20

_DIR_STEP = re.compile(r"(\d+)\D*$")
_STEP_WORD = re.compile(r"(?<![A-Za-z])step[=_-]?(\d+)", re.IGNORECASE)
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I)
#: Names of files being written by someone: never a checkpoint.
_TEMP_SUFFIXES = (".tmp", ".temp", ".part", ".partial", ".lock", ".swp", "~")
#: How a restore names a file until it is complete (hidden, so never synced back).
_RESTORING = ".trainbot-restoring"
#: Hugging Face Trainer's state file, written last into each ``checkpoint-N/`` folder.
HF_STATE = "trainer_state.json"
#: Files only a Trainer checkpoint folder holds: such a folder is complete once it has
#: HF_STATE.
_HF_FILES = frozenset(
    {
        HF_STATE,
        "training_args.bin",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "adapter_model.safetensors",
    }
)


def dir_step(name: str) -> int | None:
    """The step of a checkpoint folder: the last number in its name (``checkpoint-500``)."""
    m = _DIR_STEP.search(name)
    return int(m.group(1)) if m else None


def file_step(name: str) -> int | None:
    """The step of a checkpoint file: the number after ``step`` where the name says so
    (``epoch=2-step=500-v1.ckpt``), else the last number before the first dot
    (``ckpt-500.pt``, ``model_500.bf16.safetensors``); None when it holds none, or for a
    hidden, temporary or random (uuid) name."""
    if name.startswith(".") or name.endswith(_TEMP_SUFFIXES) or _UUID.search(name):
        return None
    m = _STEP_WORD.search(name)
    if m:
        return int(m.group(1))
    m = _DIR_STEP.search(name.split(".", 1)[0])
    return int(m.group(1)) if m else None


def open_files(pid: int) -> set[str] | None:
    """Paths open in process ``pid`` and its descendants; None where /proc cannot say."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    paths: set[str] = set()
    todo, seen = [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except FileNotFoundError:
            if p == pid:
                return None  # ended: whatever it had open when it died is unknown
            continue  # a descendant has exited: it holds nothing open
        except OSError:
            return None  # not ours to read
        for fd in fds:
            with contextlib.suppress(OSError):
                paths.add(os.readlink(f"/proc/{p}/fd/{fd}"))
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
    return paths


#: (relative name, size, mtime_ns) of every file of a candidate, sorted.
_Sig = tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class _Candidate:
    """Something in the sync dir that would be one checkpoint."""

    step: int
    #: The folder's name, or FILES_LABEL for top-level files.
    label: str
    #: Name in the store (relative to the step directory) -> path on disk.
    files: dict[str, Path]
    sig: _Sig

    @property
    def key(self) -> str:
        return self.label if self.label != FILES_LABEL else f"./{self.step}"


@dataclass
class _Seen:
    sig: _Sig
    #: time.monotonic() since when it has had this signature.
    since: float
    #: Whether none of its files was open in the script's processes (None: unknown).
    closed: bool | None


@dataclass(frozen=True)
class Restored:
    """A checkpoint put back into the sync dir before the script starts."""

    step: int
    #: What the script finds: the folder, or the top-level files, by name.
    names: tuple[str, ...]


class _Changed(Exception):
    """A file changed while it was uploaded: not settled after all."""


@dataclass
class CheckpointSync:
    """Commits the checkpoints a script writes into ``root`` and restores the newest."""

    store: Store
    root: Path
    settle_s: float = 2.0
    #: Steps committed in the store (by this attempt or earlier ones).
    done: set[int] = field(default_factory=set)
    #: Steps this attempt committed.
    committed: list[int] = field(default_factory=list)
    #: Names in ``root`` seen that hold no step, so were never synced (for the warning).
    ignored: set[str] = field(default_factory=set)
    #: Names left out of the final sync because the script died while writing them.
    torn: set[str] = field(default_factory=set)
    _seen: dict[str, _Seen] = field(default_factory=dict)

    # -- restore

    def restore(
        self, *, stop: Callable[[], bool] = lambda: False, max_step: int | None = None
    ) -> Restored | None:
        """Put the newest committed checkpoint back under its own name; an unreadable
        one falls back to the one before. ``stop`` aborts it (a notice came meanwhile).
        ``max_step``: the newest at or before that step (a run resubmitted from it)."""
        entries = list_committed(self.store)
        self.done.update(e.step for e in entries)
        for entry in reversed(entries):
            if max_step is not None and entry.step > max_step:
                continue
            try:
                manifest = read_manifest(self.store, entry.step)
                if manifest.kind != "files":
                    continue
                return self._download(manifest, stop)
            except (CheckpointError, StoreError, OSError) as exc:
                log.warning(
                    "checkpoint step %d unusable (%s); trying an older one", entry.step, exc
                )
        return None

    def _download(self, manifest: Manifest, stop: Callable[[], bool]) -> Restored | None:
        label = manifest.label or step_dir(manifest.step)
        target = self.root if label == FILES_LABEL else self.root / label
        sd = step_dir(manifest.step)
        for entry in manifest.files:
            out = target.joinpath(*entry.name.split("/"))
            if _same(out, entry):
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}{_RESTORING}")
            sha = hashlib.sha256()
            size = 0
            try:
                with self.store.open_read(f"{sd}/{entry.name}") as src, open(tmp, "wb") as dst:
                    while chunk := src.read(CHUNK):
                        if stop():
                            tmp.unlink()
                            return None
                        sha.update(chunk)
                        size += len(chunk)
                        dst.write(chunk)
                if size != entry.size or sha.hexdigest() != entry.sha256:
                    raise CheckpointError(
                        f"{sd}/{entry.name}: {size} bytes with sha256 {sha.hexdigest()[:12]}…, "
                        f"the manifest says {entry.size} bytes, {entry.sha256[:12]}…"
                    )
                os.replace(tmp, out)
            finally:
                tmp.unlink(missing_ok=True)
        names = tuple(sorted(e.name for e in manifest.files)) if label == FILES_LABEL else (label,)
        return Restored(step=manifest.step, names=names)

    # -- commit

    def poll(
        self,
        *,
        now: float,
        final: bool = False,
        clean: bool = True,
        open_paths: Callable[[], set[str] | None] = lambda: None,
        notice: bool = False,
    ) -> list[CommitInfo]:
        """Commit every settled checkpoint not committed yet.

        ``final``: the script has ended; with ``clean`` (it exited 0) everything is
        committed, otherwise only what had settled or was closed at the scan before.
        ``open_paths``: the files open in the script's processes now (asked only while
        something waits to settle).
        ``notice``: the last look before the script is stopped: what is complete now is
        committed without waiting to settle (a file none of the script's processes holds
        open). A Hugging Face folder is committed as soon as its trainer_state.json is
        written and nothing in it is open, notice or not.
        """
        out: list[CommitInfo] = []
        pending = [c for c in self._scan() if c.step not in self.done]
        if not pending:
            return out
        opened = None if final else open_paths()
        for c in pending:
            if c.step in self.done:  # a folder and files of one step: the first one wins
                continue
            previous = self._seen.get(c.key)
            same = previous is not None and previous.sig == c.sig
            if not same:
                closed = None if opened is None else not any(str(p) in opened for p in _paths(c))
                self._seen[c.key] = _Seen(sig=c.sig, since=now, closed=closed)
            elif opened is not None and previous is not None:
                previous.closed = not any(str(p) in opened for p in _paths(c))
            seen = self._seen[c.key]
            settled = same and seen.closed is not False and now - seen.since >= self.settle_s
            if _hf_unfinished(c):
                # Trainer writes trainer_state.json last: without it the folder is torn
                # (model written, optimizer not yet), however long it has been quiet.
                ready = False
                if final:
                    self.torn.add(c.label)
                    log.warning("not syncing %s/: it has no %s", c.label, HF_STATE)
            elif final and clean:
                ready = True
            elif final:
                # Died: what was open at the last scan was being written, so it is torn.
                ready = same and (seen.closed is True or settled)
                if not ready:
                    self.torn.add(c.label if c.label != FILES_LABEL else ", ".join(c.files))
                    log.warning(
                        "not syncing %s: the script ended while writing it",
                        ", ".join(c.files) if c.label == FILES_LABEL else c.label + "/",
                    )
            elif notice:
                ready = settled or (seen.closed is True and (c.label == FILES_LABEL or _hf(c)))
            else:
                # A Trainer folder with its state written and closed is whole at once: the
                # Trainer may delete it (save_total_limit) before it would have settled.
                ready = settled or (seen.closed is True and _hf(c))
            if not ready:
                continue
            try:
                out.append(self._upload(c))
            except _Changed:
                self._seen.pop(c.key, None)
                continue
            self.done.add(c.step)
            self.committed.append(c.step)
        return out

    def _scan(self) -> list[_Candidate]:
        if not self.root.is_dir():
            return []
        groups: dict[int, dict[str, Path]] = {}
        found: list[_Candidate] = []
        for entry in sorted(self.root.iterdir()):
            name = entry.name
            if name.startswith("."):
                continue
            if entry.is_dir():
                step = dir_step(name)
                if step is None:
                    self.ignored.add(name + "/")
                    continue
                if step in self.done:
                    continue  # committed: no need to walk it again
                files = {
                    p.relative_to(entry).as_posix(): p
                    for p in sorted(entry.rglob("*"))
                    if p.is_file() and not p.name.startswith(".")
                }
                if files:
                    found.append(_candidate(step, name, files))
            elif entry.is_file():
                step = file_step(name)
                if step is None:
                    if not name.endswith(_TEMP_SUFFIXES):
                        self.ignored.add(name)
                    continue
                if step in self.done:
                    continue
                groups.setdefault(step, {})[name] = entry
        found.extend(_candidate(step, FILES_LABEL, files) for step, files in groups.items())
        found.sort(key=lambda c: c.step)
        return found

    def _upload(self, c: _Candidate) -> CommitInfo:
        """Files first, the manifest last; a file that changes meanwhile calls it off."""
        t0 = time.perf_counter()
        sd = step_dir(c.step)
        entries: list[FileEntry] = []
        for name, path in c.files.items():
            entries.append(_put_file(self.store, f"{sd}/{name}", name, path))
        if _candidate(c.step, c.label, c.files).sig != c.sig:
            raise _Changed(c.label)
        total = sum(e.size for e in entries)
        manifest = Manifest(
            step=c.step,
            time=time.time(),
            files=tuple(entries),
            bytes=total,
            write_s=time.perf_counter() - t0,
            kind="files",
            label=c.label,
        )
        self.store.put_bytes(f"{sd}/{MANIFEST}", manifest.to_json())
        write_s = time.perf_counter() - t0
        return CommitInfo(
            step=c.step, bytes=total, write_s=write_s, stall_s=0.0, uri=f"{self.store.uri}/{sd}"
        )


def _hf(c: _Candidate) -> bool:
    """Whether a folder is a Hugging Face Trainer checkpoint (one of its file names)."""
    return c.label != FILES_LABEL and not _HF_FILES.isdisjoint(c.files)


def _hf_unfinished(c: _Candidate) -> bool:
    return _hf(c) and HF_STATE not in c.files


def _candidate(step: int, label: str, files: dict[str, Path]) -> _Candidate:
    sig: list[tuple[str, int, int]] = []
    for name, path in files.items():
        try:
            st = path.stat()
        except FileNotFoundError:
            continue  # deleted meanwhile: the signature changes, so it is not settled
        sig.append((name, st.st_size, st.st_mtime_ns))
    return _Candidate(step=step, label=label, files=files, sig=tuple(sorted(sig)))


def _paths(c: _Candidate) -> Iterator[Path]:
    for path in c.files.values():
        yield path.resolve()


def _put_file(store: Store, key: str, name: str, path: Path) -> FileEntry:
    sha = hashlib.sha256()
    size = 0
    try:
        src = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError as exc:
        raise _Changed(name) from exc
    stream = store.open_write(key)
    try:
        with src:
            while chunk := src.read(CHUNK):
                sha.update(chunk)
                size += len(chunk)
                stream.write(chunk)
        stream.close()
    except BaseException:
        with contextlib.suppress(Exception):
            stream.abort()
        raise
    return FileEntry(name=name, size=size, sha256=sha.hexdigest())


def _same(path: Path, entry: FileEntry) -> bool:
    """Whether ``path`` already holds this file (a restart on the same instance)."""
    try:
        if path.stat().st_size != entry.size:
            return False
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                sha.update(chunk)
        return sha.hexdigest() == entry.sha256
    except OSError:
        return False


def nothing_synced(sync: CheckpointSync, *, preempted: bool) -> str:
    """What to tell the person whose script left nothing in ``$TRAINBOT_CHECKPOINT_DIR``
    the sync could commit: what is there, and how to name a checkpoint."""
    found = sorted(sync.ignored)
    if found:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        what = f"it holds {shown}, with no step in the name"
    else:
        what = "the script wrote nothing there"
    if sync.torn:
        what += f"; {', '.join(sorted(sync.torn))} was still being written when it ended"
    then = " The next attempt starts from step 0." if preempted else ""
    msg = (
        f"no checkpoint was synced from {sync.root} ($TRAINBOT_CHECKPOINT_DIR): {what}."
        f"{then} Save checkpoints there as files or folders whose names hold the step "
        "(ckpt-500.pt, epoch=0-step=500.ckpt, checkpoint-500/), or use the session API."
    )
    return msg

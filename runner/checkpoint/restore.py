"""Restoring a session's state: the newest committed checkpoint that verifies.

A checkpoint that fails to read or verify is skipped for the one before it.
:class:`Reading` does the same on a background thread, which the caller can cancel;
:class:`Prefetch` starts one while the caller builds its model.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runner.checkpoint.read import READ_CHUNK, read_all
from runner.errors import CheckpointError, NoCheckpointError, StoreError
from runner.layout import META, CheckpointEntry, Manifest, list_committed, read_manifest, step_dir
from runner.state import TensorSpec, dtype_from_name, unflatten
from runner.store import Store

log = logging.getLogger(__name__)

_OWN_BELOW = 1 << 20


@dataclass
class Restored:
    """A checkpoint loaded from the store."""

    #: Step of the checkpoint loaded.
    step: int
    #: The nested state, as it was saved.
    state: Any
    manifest: Manifest
    #: Newer checkpoints that were skipped, with why.
    skipped: list[tuple[int, str]]
    #: Seconds spent reading and verifying.
    restore_s: float


def part_of(name: str) -> str:
    """The part a checkpoint file belongs to: "" at the step directory's top, else its
    directory with a trailing slash ("rank-00001/")."""
    head = name.rpartition("/")[0]
    return f"{head}/" if head else ""


def load_checkpoint(
    store: Store,
    manifest: Manifest,
    *,
    chunk_bytes: int = READ_CHUNK,
    cancel: threading.Event | None = None,
    part: str = "",
) -> Any:
    """Read and verify every file of a checkpoint, and rebuild its state.

    Nothing is used before every file's sha256 matches the manifest. Large tensors are
    views into the buffers the files were read into (no copy); setting ``cancel`` makes
    the reads stop at their next chunk and raises :class:`PrefetchCancelled`. ``part``
    ("rank-00001/") reads one rank's part of a multi-rank checkpoint instead of the
    files at the step directory's top.
    """
    sd = step_dir(manifest.step)
    if manifest.kind != "state":
        raise CheckpointError(
            f"{store.uri}/{sd} holds a script's files, not a session state: "
            "restore it with `trainbot-runner exec --sync-dir`"
        )
    entries = {f.name: f for f in manifest.files if part_of(f.name) == part}
    if part + META not in entries:
        raise CheckpointError(f"{store.uri}/{sd} has no {part}{META} in its manifest")
    data = read_all(store, sd, entries, chunk_bytes, cancel)
    try:
        raw_meta = data.pop(part + META).numpy().tobytes()
        meta = torch.load(io.BytesIO(raw_meta), weights_only=True)
        tensors = []
        for raw in meta["tensors"]:
            spec = TensorSpec(**{**raw, "shape": tuple(raw["shape"])})
            shard = data[part + spec.shard]
            flat = shard[spec.offset : spec.offset + spec.nbytes]
            t = flat.view(dtype_from_name(spec.dtype)).reshape(spec.shape)
            # Small tensors get their own storage: some consumers (Generator.set_state)
            # assume a tensor starts at its storage's first byte. Large ones stay views.
            tensors.append(t.clone() if spec.nbytes < _OWN_BELOW else t)
        return unflatten(meta["skeleton"], tensors)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{store.uri}/{sd}/{META} does not describe the shards: {exc}"
        ) from exc


def restore_latest(
    store: Store, *, below: int | None = None, cancel: threading.Event | None = None
) -> Restored:
    """Load the newest committed checkpoint that verifies; fall back past corrupt ones."""
    t0 = time.perf_counter()
    return _restore_from(store, list_committed(store), below=below, cancel=cancel, t0=t0)


def _restore_from(
    store: Store,
    entries: list[CheckpointEntry],
    *,
    below: int | None,
    cancel: threading.Event | None,
    t0: float,
    seen: Callable[[Manifest], None] | None = None,
) -> Restored:
    """``seen`` is told each manifest before its checkpoint is read."""
    skipped: list[tuple[int, str]] = []
    for entry in reversed(entries):
        if below is not None and entry.step >= below:
            continue
        try:
            manifest = read_manifest(store, entry.step)
            if seen is not None:
                seen(manifest)
            state = load_checkpoint(store, manifest, cancel=cancel)
        except (CheckpointError, StoreError) as exc:
            log.warning(
                "checkpoint step %d is unusable (%s); trying the previous one", entry.step, exc
            )
            skipped.append((entry.step, str(exc)))
            continue
        return Restored(
            step=entry.step,
            state=state,
            manifest=manifest,
            skipped=skipped,
            restore_s=time.perf_counter() - t0,
        )
    raise none_usable(store, skipped)


def none_usable(store: Store, skipped: list[tuple[int, str]]) -> CheckpointError:
    """The error when no checkpoint could be restored: none committed, or why each was
    skipped."""
    if skipped:
        return CheckpointError(
            f"no usable checkpoint in {store.uri}: "
            + "; ".join(f"step {s}: {why}" for s, why in skipped)
        )
    return NoCheckpointError(f"no committed checkpoint in {store.uri}")


class Reading:
    """The newest usable checkpoint (below ``below``), read and verified on a background
    thread, so that the caller can watch something else meanwhile (a preemption notice:
    a session gives a restore up when the window has no room left for it) and cancel it.
    """

    def __init__(self, store: Store, *, below: int | None = None) -> None:
        self.store = store
        self.below = below
        self._cancel = threading.Event()
        #: Newest committed step when the reading listed the store; unset if listing failed.
        self._newest: int | None = None
        self._listed = False
        #: The manifest of the checkpoint being read, once it has been read.
        self.manifest: Manifest | None = None
        self._candidate: int | None = None
        self._result: Restored | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ckpt-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            entries = list_committed(self.store)
            self._newest = entries[-1].step if entries else None
            wanted = [e.step for e in entries if self.below is None or e.step < self.below]
            self._candidate = wanted[-1] if wanted else None
            self._listed = True
            self._result = _restore_from(
                self.store, entries, below=self.below, cancel=self._cancel, t0=t0, seen=self._seen
            )
        except BaseException as exc:  # handed to the caller by result() or take()
            self._error = exc

    def _seen(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._candidate = manifest.step

    @property
    def step(self) -> int | None:
        """The step being read: the newest committed (below ``below``) once listed, the
        one actually read once its manifest is in; None before the listing."""
        return self._candidate

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the reading is over (done, failed or cancelled); False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def cancel(self) -> None:
        """Stop reading at the next chunk, without waiting for it: the reading thread ends
        on its own, and what it read is dropped."""
        self._cancel.set()

    def result(self) -> Restored:
        """Wait for the reading and hand over its checkpoint; raises what restoring raised
        (no checkpoint, none usable, :class:`PrefetchCancelled`)."""
        self._thread.join()
        result, error = self._result, self._error
        self._result = self._error = None
        if error is not None:
            raise error
        assert result is not None
        return result

    def close(self) -> None:
        """Stop reading (at the next chunk), wait for the threads and drop what was read."""
        self._cancel.set()
        self._thread.join()
        self._result = self._error = None


class Prefetch(Reading):
    """The newest usable checkpoint, read and verified on a background thread.

    A :class:`~runner.session.Session` starts one when it is created, so that reading the
    shards and hashing them (both release the GIL) overlap with the caller building its
    model and optimizer. Fallback past a corrupt checkpoint happens here too. The memory
    it holds is the state the restore needs anyway, and :meth:`take` hands it over once.
    """

    def __init__(self, store: Store) -> None:
        super().__init__(store)

    def take(self) -> Restored | None:
        """Wait for the prefetch and hand over its checkpoint.

        Returns None when the caller must restore by itself: the prefetch was cancelled,
        could not list the store, or a newer checkpoint has been committed since it
        started. Raises what restoring raised otherwise (no checkpoint, none usable).
        """
        self._thread.join()
        result, error = self._result, self._error
        self._result = self._error = None
        if not self._listed or self._cancel.is_set():
            return None
        entries = list_committed(self.store)
        newest = entries[-1].step if entries else None
        if newest != self._newest:
            log.info(
                "checkpoint step %s was committed after the prefetch started; reading it",
                newest,
            )
            return None
        if error is not None:
            raise error
        return result


def verify(store: Store, step: int) -> list[str]:
    """Problems with one committed checkpoint (every rank's part of a multi-rank one);
    an empty list means it verifies."""
    try:
        manifest = read_manifest(store, step)
        for part in sorted({part_of(f.name) for f in manifest.files}):
            load_checkpoint(store, manifest, part=part)
    except (CheckpointError, StoreError) as exc:
        return [str(exc)]
    return []

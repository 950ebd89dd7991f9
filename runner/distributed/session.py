"""The session on one rank of a DDP job: agreed stops and saves, per-rank checkpoint parts.

Everything the single-process :class:`~runner.session.Session` does stays; what changes:

- after each step, one ``all_reduce(MAX)`` of the ranks' votes (:mod:`vote`) decides
  whether every rank stops before the next step (and why) and whether every rank saves;
- :meth:`track` is for the replicated state (model, optimizer: rank 0 writes it),
  :meth:`track_local` for what is each rank's own (its data position); each rank's RNG
  state goes with its part;
- a stop flushes on every rank, and a step counts as saved only once rank 0 has
  committed it with every part in (:mod:`parts`);
- restore: rank 0 lists, every rank reads the replicated state and its own part, and the
  ranks agree (``all_reduce(MIN)``) on the newest step every rank could verify;
- :meth:`track_sharded` is for sharded state (FSDP, DTensors): ``torch.distributed.
  checkpoint`` saves each rank's shards into its part and reshards them on a restore at
  another world size (:mod:`sharded`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from runner.checkpoint import Restored, list_committed, load_checkpoint, read_manifest
from runner.checkpoint.restore import none_usable, part_of
from runner.distributed import sharded
from runner.distributed.gang import Gang
from runner.distributed.parts import RankWriter, part_dir
from runner.distributed.vote import GO, PREEMPT, STOP, Vote
from runner.errors import CheckpointError, RunnerError, StoreError
from runner.layout import MANIFEST, step_dir
from runner.session import Session, Stateful
from runner.session.config import SessionConfig
from runner.session.notice import NoticeWindow
from runner.state import capture_rng
from runner.telemetry import FileSink

log = logging.getLogger(__name__)

#: How long rank 0 waits for the other ranks' parts of a step before giving it up.
PART_TIMEOUT_S = 120.0


class WorldSizeError(RunnerError):
    """A checkpoint's per-rank state was saved by a different number of ranks."""


class DistributedSession(Session):
    """One rank's part of a multi-rank run; create it after ``init_process_group``.

    ``fresh_local_on_resize=True`` lets a run resume at a different world size with each
    rank's own state (data position, RNG) as the script built it: the replicated state
    is restored either way. Without it, such a restore raises :class:`WorldSizeError`.
    """

    def __init__(
        self,
        config: SessionConfig,
        *,
        gang: Gang | None = None,
        fresh_local_on_resize: bool = False,
        part_timeout_s: float = PART_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        self.gang = gang if gang is not None else Gang.current()
        # The first rank of each node writes the events file its node's supervisor tails
        # (so each node reports its own data wait and exit); the others their own files.
        local_rank = int(os.environ.get("LOCAL_RANK", self.gang.rank))
        if local_rank and config.events_file and "sink" not in kwargs:
            kwargs["sink"] = FileSink(f"{config.events_file}.rank-{self.gang.rank}")
        # The prefetch reads on its own thread, unagreed: the ranks restore together.
        kwargs["prefetch"] = False
        super().__init__(config, **kwargs)
        self.writer.close()  # never used: replaced by the rank's writer
        self.writer = RankWriter(  # type: ignore[assignment]
            self.store,
            rank=self.gang.rank,
            world_size=self.gang.world_size,
            nonce=self.gang.nonce(),
            part_timeout_s=part_timeout_s,
            on_commit=self._committed,
            on_error=self._save_failed,
        )
        self.fresh_local_on_resize = fresh_local_on_resize
        self._local: dict[str, Stateful] = {}
        self._sharded: dict[str, Stateful] = {}
        #: This rank's DCP files of the save being made (see _save).
        self._staged: dict[str, torch.Tensor] | None = None
        #: Where DCP writes and reads this rank's files: its own disk, never shared.
        self._scratch = Path(tempfile.mkdtemp(prefix=f"trainbot-dcp-rank{self.gang.rank}-"))
        #: The gang's decision after the last step, for the check before the next one.
        self._agreed: Vote | None = None

    @property
    def rank(self) -> int:
        return self.gang.rank

    # -- state

    def track_local(self, **objects: Stateful) -> None:
        """Objects that differ from rank to rank (a data loader's position): each rank
        saves and restores its own, in its part of every checkpoint."""
        self.track(**objects)
        self._local.update(objects)

    def track_sharded(self, **objects: Stateful) -> None:
        """Sharded state (an FSDP model and its optimizer, as :class:`sharded.Sharded`):
        every rank saves its own shards through ``torch.distributed.checkpoint``, and a
        restore reshards them to this run's world size. Call it on every rank with the
        same names, before :meth:`steps`."""
        clash = set(objects) & (set(self._tracked) | set(self._sharded))
        if clash:
            raise RunnerError(f"already tracked: {sorted(clash)}")
        self._sharded.update(objects)

    def state(self) -> dict[str, Any]:
        local: dict[str, Any] = {
            "objects": {name: obj.state_dict() for name, obj in self._local.items()},
            "rng": capture_rng(),
        }
        if self._staged is not None:
            local[sharded.DCP_KEY] = self._staged
        return {
            "step": self.step,
            "objects": {
                name: obj.state_dict()
                for name, obj in self._tracked.items()
                if name not in self._local
            },
            "local": local,
        }

    def _sharded_state(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self._sharded.items()}

    def _save(self, *, copy: bool = True) -> None:
        # Every rank saves at the same step (agreed saves, agreed flushes): DCP's save is
        # a collective. Its files then go into this rank's part like any other state.
        if self._sharded:
            self._staged = sharded.stage(self._sharded_state(), self._scratch / "save")
        try:
            super()._save(copy=copy)
        finally:
            self._staged = None

    # -- the step's vote

    def _must_stop(self) -> bool:
        if self._agreed is None:  # before the first step: nothing was voted yet
            self._agreed = self.gang.agree(Vote(stop=self._local_stop()))
        decision, self._agreed = self._agreed, None
        if decision.reason is None:
            return False
        self.stop_reason = decision.reason
        return True

    def _maybe_save(self) -> None:
        self._agreed = self.gang.agree(Vote(stop=self._local_stop(), save=self._save_due()))
        if self._agreed.save and self._agreed.stop == GO:
            self._save()

    def _local_stop(self) -> int:
        """This rank's own vote: what the single-process check says (signals, pollers,
        the stop file)."""
        if not Session._must_stop(self):
            return GO
        return STOP if self.stop_reason == "stopped" else PREEMPT

    def _train_on(self) -> bool:
        # Training on through a notice would need the ranks to agree on the budget too:
        # a multi-rank run stops at the first notice.
        return False

    def _flush_costs_more(self, stopped: float) -> bool:
        # Every rank flushes: a rank that skipped its part would leave the step torn.
        return False

    def _should_flush(self, stopped: float) -> bool:
        # Agreed: a rank whose window looks shorter than the others' would leave the step
        # torn (and, with sharded state, the others waiting in DCP's collective save).
        return self.gang.all_ok(super()._should_flush(stopped))

    def _flush_on_notice(self) -> None:
        super()._flush_on_notice()
        if self.rank and self._window is not None and self._flush_report is not None:
            self._flush_report = self._gang_report(self._window)

    def _gang_report(self, window: NoticeWindow) -> dict[str, Any]:
        """The flush report of a rank other than 0, which knows that its own part landed,
        not that the step did (rank 0 commits it once every part is in): what it says is
        committed is what the store holds (one look; a listing only when the step is not
        there), and a flush whose part alone landed did not land."""
        committed = self.committed_step
        try:
            if committed is not None and not self.store.exists(f"{step_dir(committed)}/{MANIFEST}"):
                below = [e.step for e in list_committed(self.store) if e.step < committed]
                committed = max(below, default=None)
        except StoreError as exc:
            log.warning("could not tell which step is committed: %s", exc)
        for flush in window.flushes:
            if flush.landed and (committed is None or flush.step > committed):
                flush.landed = False
        return window.report(step=self.step, committed_step=committed, now=time.monotonic())

    def close(self) -> None:
        # Rank 0 may still wait for parts: no rank exits (and so no rank's torchrun
        # agent tears the gang down) before the step is committed. A preempted rank's
        # exit leaves first: the kill at the deadline comes whatever the ranks wait for.
        self._send_preempted_exit()
        try:
            self.writer.wait()
            self.gang.barrier()
        except Exception as exc:  # a rank is gone: nothing left to wait for
            log.warning("ranks did not meet at the end of the session: %s", exc)
        super().close()
        shutil.rmtree(self._scratch, ignore_errors=True)

    # -- restore

    def _read_latest(self, below: int | None) -> Restored:
        t0 = time.perf_counter()
        steps = self.gang.broadcast(
            [e.step for e in list_committed(self.store)] if self.rank == 0 else None
        )
        skipped: list[tuple[int, str]] = []
        for step in reversed(steps):
            if below is not None and step >= below:
                continue
            try:
                state: Any = self._load(step)
                why = ""
            except (CheckpointError, StoreError) as exc:
                state, why = None, str(exc)
            if not self.gang.all_ok(state is not None):
                reason = why or "another rank could not read its part"
                log.warning("checkpoint step %d is unusable (%s); trying the previous", step, why)
                skipped.append((step, reason))
                continue
            if self._sharded:  # every rank has the step's files: DCP loads them together
                self._load_sharded(step, state.pop("sharded"))
            return Restored(
                step=step,
                state=state,
                manifest=read_manifest(self.store, step),
                skipped=skipped,
                restore_s=time.perf_counter() - t0,
            )
        raise none_usable(self.store, skipped)

    def _load(self, step: int) -> dict[str, Any]:
        """The replicated state and this rank's part of one checkpoint, verified."""
        manifest = read_manifest(self.store, step)
        shared = load_checkpoint(self.store, manifest)
        saved_parts = sorted({p for f in manifest.files if (p := part_of(f.name))})
        saved_world = len(saved_parts)
        own = part_dir(self.rank)
        #: The parts read so far, by directory: another rank's are read only for DCP.
        parts: dict[str, Any] = {}
        if saved_world != self.gang.world_size or own not in saved_parts:
            if not self.fresh_local_on_resize:
                raise WorldSizeError(
                    f"checkpoint step {step} was saved by {saved_world} ranks and this run has "
                    f"{self.gang.world_size}: each rank's own state (data position, RNG) "
                    "cannot be split or merged. Resume with the same number of ranks, or pass "
                    "fresh_local_on_resize=True to start each rank's own state afresh"
                )
            local = {
                "objects": {n: o.state_dict() for n, o in self._local.items()},
                "rng": capture_rng(),
            }
        else:
            local = parts[own] = load_checkpoint(self.store, manifest, part=own)
        missing = set(self._local) - set(local["objects"])
        if missing:
            raise RunnerError(
                f"checkpoint step {step} has no per-rank state for {sorted(missing)}: "
                "track_local the same objects as the run that saved it"
            )
        objects = {**shared["objects"], **local["objects"]}
        loaded: dict[str, Any] = {"step": shared["step"], "objects": objects, "rng": local["rng"]}
        if self._sharded:
            # DCP plans a load from every saved rank's files, whatever the world size now.
            files: dict[str, torch.Tensor] = {}
            for part in saved_parts:
                if part not in parts:
                    parts[part] = load_checkpoint(self.store, manifest, part=part)
                files.update(parts[part].get(sharded.DCP_KEY) or {})
            loaded["sharded"] = {"files": files, "saved_world": saved_world}
        return loaded

    def _load_sharded(self, step: int, found: dict[str, Any]) -> None:
        target = self._sharded_state()
        sharded.load(
            target,
            found["files"],
            self._scratch / "restore",
            step=step,
            saved_world=found["saved_world"],
            world=self.gang.world_size,
        )
        for name, obj in self._sharded.items():
            obj.load_state_dict(target[name])

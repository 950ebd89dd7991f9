"""Which checkpoints to keep: last N, every K steps, best by a metric, maximum age.

A checkpoint is kept if any keep-rule keeps it; ``max_age_s`` then drops what is older,
except that the newest committed checkpoint and the ``protect``-ed steps (the control
plane's "resubmit from" offer while an alert is open) are never deleted.
Step directories without a manifest that are older than the newest commit are torn
saves (a process killed mid-write) and are always garbage.
"""

from __future__ import annotations

from dataclasses import dataclass

from runner.errors import CheckpointError, RunnerError
from runner.layout import CheckpointEntry, delete_steps, read_manifest, scan
from runner.store import Store


@dataclass(frozen=True)
class RetentionPolicy:
    """How many checkpoints survive a prune."""

    #: Keep the newest N committed checkpoints.
    keep_last: int | None = 3
    #: Also keep every checkpoint whose step is a multiple of K.
    keep_every_steps: int | None = None
    #: Also keep the best ``keep_best_count`` by this metric from the manifests.
    keep_best_metric: str | None = None
    #: "min" or "max" for ``keep_best_metric``.
    keep_best_mode: str = "min"
    keep_best_count: int = 1
    #: Delete checkpoints older than this many seconds, whatever else keeps them.
    max_age_s: float | None = None
    #: Steps never deleted, whatever else the policy says (the checkpoint an open alert
    #: offers to resubmit from).
    protect: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise RunnerError("keep_last must be at least 1 (the newest checkpoint is always kept)")
        if self.keep_every_steps is not None and self.keep_every_steps < 1:
            raise RunnerError("keep_every_steps must be a positive number of steps")
        if self.keep_best_mode not in ("min", "max"):
            raise RunnerError(f"keep_best_mode must be 'min' or 'max', not {self.keep_best_mode!r}")
        if self.keep_best_count < 1:
            raise RunnerError("keep_best_count must be at least 1")
        if self.max_age_s is not None and self.max_age_s <= 0:
            raise RunnerError("max_age_s must be a positive number of seconds")


@dataclass(frozen=True)
class PruneResult:
    """What a prune did (or, in a dry run, would do)."""

    #: Committed steps deleted.
    deleted: tuple[int, ...]
    #: Committed steps kept.
    kept: tuple[int, ...]
    #: Torn saves (no manifest) deleted.
    torn: tuple[int, ...]
    #: Objects deleted.
    objects: int
    #: Bytes freed.
    bytes_freed: int


def select_deletions(
    entries: list[CheckpointEntry],
    policy: RetentionPolicy,
    *,
    now: float,
    metrics: dict[int, dict[str, float | None]] | None = None,
) -> set[int]:
    """Steps to delete. Pure: everything it needs is passed in."""
    if not entries:
        return set()
    steps = sorted(e.step for e in entries)
    newest = steps[-1]
    keep: set[int] = set()
    if policy.keep_last is not None:
        keep.update(steps[-policy.keep_last :])
    else:
        keep.update(steps)
    if policy.keep_every_steps:
        keep.update(s for s in steps if s % policy.keep_every_steps == 0)
    if policy.keep_best_metric and metrics is not None:
        scored = [
            (v, s)
            for s in steps
            if (v := metrics.get(s, {}).get(policy.keep_best_metric)) is not None
        ]
        scored.sort(reverse=policy.keep_best_mode == "max")
        keep.update(s for _, s in scored[: policy.keep_best_count])
    if policy.max_age_s is not None:
        by_step = {e.step: e for e in entries}
        keep = {s for s in keep if now - by_step[s].committed_at <= policy.max_age_s}
    keep.add(newest)
    keep.update(policy.protect)
    return set(steps) - keep


def prune(
    store: Store, policy: RetentionPolicy, *, now: float, dry_run: bool = False
) -> PruneResult:
    """Apply a retention policy to one run's checkpoints."""
    found = scan(store)
    entries = found.committed
    metrics: dict[int, dict[str, float | None]] | None = None
    if policy.keep_best_metric:
        metrics = {}
        for e in entries:
            try:
                metrics[e.step] = read_manifest(store, e.step).metrics
            except CheckpointError:
                metrics[e.step] = {}
    doomed = select_deletions(entries, policy, now=now, metrics=metrics)
    committed = {e.step for e in entries}
    newest = max(committed, default=None)
    torn = {s for s in found.objects if s not in committed and newest is not None and s < newest}
    freed = sum(obj.size for s in doomed | torn for obj in found.objects[s])
    objects = 0 if dry_run else delete_steps(store, found, doomed | torn)
    return PruneResult(
        deleted=tuple(sorted(doomed)),
        kept=tuple(sorted(committed - doomed)),
        torn=tuple(sorted(torn)),
        objects=objects,
        bytes_freed=freed,
    )

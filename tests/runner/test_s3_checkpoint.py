"""Checkpoints in S3 (moto's server): multipart writes, restore, fallback, prune."""

from __future__ import annotations

import time

import torch

from runner.checkpoint import (
    CheckpointWriter,
    Prefetch,
    list_committed,
    restore_latest,
    step_dir,
)
from runner.retention import RetentionPolicy, prune
from runner.state import state_digest
from runner.store.s3 import S3Store
from tests.fakes.moto_server import create_bucket


def test_checkpoints_round_trip_through_s3_multipart(moto_server: str) -> None:
    bucket = create_bucket(moto_server)
    store = S3Store(bucket, "ckpt/r-s3", endpoint_url=moto_server, part_size=5 << 20)
    writer = CheckpointWriter(store, shard_bytes=8 << 20)
    states = {}
    for step in (10, 20, 30):
        g = torch.Generator().manual_seed(step)
        states[step] = {"w": torch.randn(3 << 20, generator=g), "step": step}  # 12 MiB
        writer.save(step, states[step], metrics={"loss": 1 / step}).result()
    writer.close()
    assert [e.step for e in list_committed(store)] == [10, 20, 30]
    head = store.client.head_object(Bucket=bucket, Key=f"ckpt/r-s3/{step_dir(30)}/shard-00000.bin")
    assert "-" in head["ETag"], "a shard above the part size goes up as a multipart upload"
    restored = restore_latest(store)
    assert restored.step == 30 and state_digest(restored.state) == state_digest(states[30])
    # The session's background read works over S3 as well.
    prefetched = Prefetch(store).take()
    assert prefetched is not None and prefetched.step == 30
    assert state_digest(prefetched.state) == state_digest(states[30])

    # A corrupted newest checkpoint falls back to the previous one.
    store.put_bytes(f"{step_dir(30)}/meta.pt", b"garbage")
    fallback = restore_latest(store)
    assert fallback.step == 20 and fallback.skipped[0][0] == 30
    prefetched = Prefetch(store).take()
    assert prefetched is not None and prefetched.step == 20 and prefetched.skipped[0][0] == 30

    result = prune(store, RetentionPolicy(keep_last=1), now=time.time())
    assert result.deleted == (10, 20) and [e.step for e in list_committed(store)] == [30]

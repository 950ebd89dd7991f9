"""Checkpoint write and restore throughput through each store, side by side.

Contenders, interleaved and repeated, the same model + Adam state each time:

- local: a directory (``LocalStore``) on ``--dir``'s disk;
- s3: ``S3Store`` against moto's server on 127.0.0.1 (real boto3, real HTTP, multipart);
- gs: ``GCSStore`` against gcp-storage-emulator on 127.0.0.1, found the standard way
  (``STORAGE_EMULATOR_HOST``): resumable uploads, CRC-checked streamed reads.

Write: the background part of ``CheckpointWriter.save`` (``CommitInfo.bytes / write_s``:
shards hashed and uploaded, meta.pt, the manifest last). Restore: ``restore_latest``
(list, manifest, every shard read and sha256-verified, the state rebuilt), bytes over
its wall time. Each round's step is deleted after it is restored.

Both servers are local fakes in Python, so the cloud rows say what the client code costs
over real HTTP, not what a cloud's network would give. Goal: the GCS store keeps up with
the S3 store against fakes of the same kind: min(gs/s3 write, gs/s3 restore) >= 0.8.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    MiB,
    build_model,
    disk_of,
    emit,
    log,
    median,
    parse_args,
    rounded,
    run,
    settle,
    temp_dir,
    training_state,
)
from runner.checkpoint import CheckpointWriter, restore_latest
from runner.layout import delete_steps, scan
from runner.store import LocalStore, Store
from runner.store.gcs import GCSStore
from runner.store.s3 import S3Store
from tests.fakes.gcs_emulator import GcsEmulator
from tests.fakes.gcs_emulator import create_bucket as create_gcs_bucket
from tests.fakes.moto_server import MotoServer, create_bucket

GOAL = 0.8
STORES = ("local", "s3", "gs")


def _stores(root: Path, moto_url: str, gcs_host: str) -> dict[str, Store]:
    return {
        "local": LocalStore(root / "local"),
        "s3": S3Store(create_bucket(moto_url, prefix="bench"), "run", endpoint_url=moto_url),
        # Found as any process finds an emulator: STORAGE_EMULATOR_HOST (set in main).
        "gs": GCSStore(create_gcs_bucket(gcs_host, prefix="bench"), "run"),
    }


def main(argv: list[str] | None = None) -> None:
    opts, _ = parse_args(__doc__ or "", argv)
    # Fake credentials for boto3 (moto takes any), as the tests set them.
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    model, opt = build_model(opts.size_bytes)
    state = training_state(model, opt)
    log(f"stores: {opts.size_bytes / MiB:.0f} MiB state, {opts.repeats} rounds, {STORES}")
    write: dict[str, list[float]] = {k: [] for k in STORES}
    restore: dict[str, list[float]] = {k: [] for k in STORES}
    moto, emulator = MotoServer(), GcsEmulator()
    moto_url, gcs_host = moto.start(), emulator.start()
    os.environ["STORAGE_EMULATOR_HOST"] = gcs_host
    try:
        with temp_dir(opts.parent_dir, "bench-stores") as root:
            stores = _stores(root, moto_url, gcs_host)
            writers = {name: CheckpointWriter(store) for name, store in stores.items()}
            try:
                for r in range(opts.repeats):
                    order = list(STORES) if r % 2 == 0 else list(STORES)[::-1]
                    for name in order:
                        store = stores[name]
                        settle(opts)
                        info = writers[name].save(r + 1, state).result()
                        write[name].append(info.bytes / info.write_s)
                        began = time.perf_counter()
                        restored = restore_latest(store)
                        took = time.perf_counter() - began
                        if restored.step != r + 1:
                            raise RuntimeError(f"{name} restored step {restored.step}")
                        restore[name].append(info.bytes / took)
                        delete_steps(store, scan(store), {r + 1})
                    log(
                        f"  round {r + 1}: "
                        + ", ".join(
                            f"{k} write {write[k][-1] / MiB:.0f} / restore "
                            f"{restore[k][-1] / MiB:.0f} MiB/s"
                            for k in STORES
                        )
                    )
            finally:
                for writer in writers.values():
                    writer.close()
    finally:
        emulator.stop()
        moto.stop()
    w = {k: median(v) for k, v in write.items()}
    rd = {k: median(v) for k, v in restore.items()}
    ratio = min(w["gs"] / w["s3"], rd["gs"] / rd["s3"])
    emit(
        "stores",
        ratio=ratio,
        goal=GOAL,
        op=">=",
        figures={
            "write_mib_s": {k: rounded(v / MiB) for k, v in w.items()},
            "restore_mib_s": {k: rounded(v / MiB) for k, v in rd.items()},
            "gs_vs_s3_write": rounded(w["gs"] / w["s3"]),
            "gs_vs_s3_restore": rounded(rd["gs"] / rd["s3"]),
            "write_all_mib_s": {k: [rounded(x / MiB) for x in v] for k, v in write.items()},
            "restore_all_mib_s": {k: [rounded(x / MiB) for x in v] for k, v in restore.items()},
            "servers": "moto ThreadedMotoServer and gcp-storage-emulator, both on 127.0.0.1",
            "disk": disk_of(opts.parent_dir),
        },
        opts=opts,
    )


if __name__ == "__main__":
    sys.exit(run(main))

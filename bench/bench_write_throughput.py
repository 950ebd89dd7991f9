"""How close the background checkpoint write comes to the disk's raw write bandwidth.

Contenders, interleaved and repeated:

- ours: the background part of ``CheckpointWriter.save`` (``CommitInfo.write_s``: shards
  written while a second thread hashes them, fdatasync on close, meta.pt, the manifest)
  for the model + Adam state; throughput = ``CommitInfo.bytes / write_s``;
- dd: ``dd if=/dev/zero bs=16M conv=fdatasync`` of the same number of bytes into a new
  file on the same disk: the sequential write bandwidth with no hashing and no Python.

Goal: ours >= 0.8 of dd.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    MiB,
    build_model,
    dd_write,
    disk_of,
    emit,
    log,
    median,
    parse_args,
    rounded,
    temp_dir,
    training_state,
)
from runner.checkpoint import CheckpointWriter, CommitInfo, step_dir
from runner.store import LocalStore

GOAL = 0.8


def main(argv: list[str] | None = None) -> None:
    opts, _ = parse_args(__doc__ or "", argv)
    model, opt = build_model(opts.size_bytes)
    state = training_state(model, opt)
    log(f"write throughput: {opts.size_bytes / MiB:.0f} MiB state, {opts.repeats} rounds")
    ours_bps: list[float] = []
    dd_bps: list[float] = []
    infos: list[CommitInfo] = []
    with temp_dir(opts.parent_dir, "bench-write") as root:
        writer = CheckpointWriter(LocalStore(root / "ours"))
        try:
            writer.save(0, state).result()  # staging buffers, so every timed save is alike
            shutil.rmtree(root / "ours" / step_dir(0))
            for r in range(opts.repeats):
                for contender in ("ours", "dd") if r % 2 == 0 else ("dd", "ours"):
                    if contender == "ours":
                        info = writer.save(r + 1, state).result()
                        shutil.rmtree(root / "ours" / step_dir(r + 1))
                        infos.append(info)
                        ours_bps.append(info.bytes / info.write_s)
                    else:
                        nbytes = infos[-1].bytes if infos else opts.size_bytes
                        dd_bps.append(nbytes / dd_write(root / "dd.bin", nbytes))
                log(
                    f"  round {r + 1}: ours {ours_bps[-1] / MiB:.0f} MiB/s, "
                    f"dd {dd_bps[-1] / MiB:.0f} MiB/s"
                )
        finally:
            writer.close()
    ours = median(ours_bps)
    dd = median(dd_bps)
    emit(
        "write_throughput",
        ratio=ours / dd,
        goal=GOAL,
        op=">=",
        figures={
            "checkpoint_bytes": infos[-1].bytes,
            "files": "shards + meta.pt + manifest.json, sha256 of each",
            "ours_mib_s": rounded(ours / MiB, 1),
            "dd_mib_s": rounded(dd / MiB, 1),
            "ours_write_s": rounded(median([i.write_s for i in infos])),
            "ours_all_mib_s": [rounded(v / MiB, 1) for v in ours_bps],
            "dd_all_mib_s": [rounded(v / MiB, 1) for v in dd_bps],
            "disk": disk_of(opts.parent_dir),
        },
        opts=opts,
    )


if __name__ == "__main__":
    main()

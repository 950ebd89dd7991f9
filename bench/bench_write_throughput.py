"""How close the background checkpoint write comes to the disk's raw write bandwidth.

Contenders, interleaved and repeated:

- ours: the background part of ``CheckpointWriter.save`` (``CommitInfo.write_s``: shards
  written and sha256-hashed, fdatasync on close, meta.pt, the manifest)
  for the model + Adam state; throughput = ``CommitInfo.bytes / write_s``;
- dd: ``dd if=/dev/zero bs=16M conv=fdatasync`` of the same number of bytes into a new
  file on the same disk: the sequential write bandwidth with no hashing and no Python;
- dd_random: the same, writing random bytes from a file in memory, because some virtual
  disks store zeros faster than real data (reported, not judged).

Goal: ours >= 0.8 of dd (zeros).
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
    random_source,
    rounded,
    run,
    settle,
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
    bps: dict[str, list[float]] = {"ours": [], "dd": [], "dd_random": []}
    infos: list[CommitInfo] = []
    with temp_dir(opts.parent_dir, "bench-write") as root:
        writer = CheckpointWriter(LocalStore(root / "ours"))
        try:
            # The first save allocates the staging buffers; it also gives the size.
            nbytes = writer.save(0, state).result().bytes
            shutil.rmtree(root / "ours" / step_dir(0))
            with random_source(root, nbytes) as noise:
                for r in range(opts.repeats):
                    order = ["ours", "dd", "dd_random"]
                    for contender in order if r % 2 == 0 else order[::-1]:
                        settle(opts)
                        if contender == "ours":
                            info = writer.save(r + 1, state).result()
                            shutil.rmtree(root / "ours" / step_dir(r + 1))
                            infos.append(info)
                            bps["ours"].append(info.bytes / info.write_s)
                        else:
                            src = noise if contender == "dd_random" else None
                            took = dd_write(root / "dd.bin", nbytes, source=src)
                            bps[contender].append(nbytes / took)
                    log(
                        f"  round {r + 1}: "
                        + ", ".join(f"{k} {v[-1] / MiB:.0f} MiB/s" for k, v in bps.items())
                    )
        finally:
            writer.close()
    ours, dd, dd_random = (median(bps[k]) for k in ("ours", "dd", "dd_random"))
    emit(
        "write_throughput",
        ratio=ours / dd,
        goal=GOAL,
        op=">=",
        figures={
            "checkpoint_bytes": nbytes,
            "files": "shards + meta.pt + manifest.json, sha256 of each",
            "ours_mib_s": rounded(ours / MiB, 1),
            "dd_mib_s": rounded(dd / MiB, 1),
            "dd_random_mib_s": rounded(dd_random / MiB, 1),
            "ratio_vs_dd_random": rounded(ours / dd_random),
            "ours_write_s": rounded(median([i.write_s for i in infos])),
            "ours_all_mib_s": [rounded(v / MiB, 1) for v in bps["ours"]],
            "dd_all_mib_s": [rounded(v / MiB, 1) for v in bps["dd"]],
            "dd_random_all_mib_s": [rounded(v / MiB, 1) for v in bps["dd_random"]],
            "disk": disk_of(opts.parent_dir),
        },
        opts=opts,
    )


if __name__ == "__main__":
    sys.exit(run(main))

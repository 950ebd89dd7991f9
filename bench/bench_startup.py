"""How long a resubmitted attempt takes to have its code and environment ready.

A team's code (packed with ``trainbot-runner pack``: a requirements file and a script)
and a ``setup`` that installs a real set of wheels (``pip install -r requirements.txt``)
from a package index served on 127.0.0.1. The wheels are real ones, fetched once before
anything is timed with ``pip download`` from the index pip is configured with; while the
benchmark runs, pip sees only the loopback index, no cache and no configuration of this
machine (a fresh instance has neither). Then, interleaved and repeated:

- attempt 1: a fresh code directory, no archive in the store: the code is unpacked,
  setup runs (a virtual environment, the wheels installed into it) and what it built is
  archived to the store (``runner.setup``, as the runner does before the command);
- attempt 2: a fresh code directory (attempt 1's removed: the same path, as on every
  cloud instance; with ``--moved`` another path, as the local provider's instances have),
  the archive in the store: the code is unpacked and the environment restored (read from
  the store and unpacked by tar as it arrives, checked against its manifest's sha256,
  and with ``--moved`` its absolute paths moved to the new directory);
- raw: the same archive read from the same store and unpacked with ``tar`` into an
  empty directory: what restoring it costs at the store's and the disk's own speed.

Goals: attempt 2's start-up (code and environment ready) <= 1.3 x raw, and <= 0.25 x
attempt 1's setup (the setup commands alone, not the archiving after them). The store is
a directory on ``--dir``'s disk, or with ``--store s3`` a bucket on moto's server on
127.0.0.1 (real boto3 over real HTTP: what the client code costs, not a cloud's network).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    BenchError,
    MiB,
    emit,
    log,
    median,
    parse_args,
    rounded,
    run,
    settle,
    temp_dir,
)
from runner import env as contract
from runner.code import pack
from runner.setup import ENV_DIR, Ready, Workspace
from runner.store import Store, open_store
from tests.fakes.code_servers import serve_directory, write_simple_index

GOAL_VS_RAW = 1.3
GOAL_VS_SETUP = 0.25
#: Real wheels a team's training code might need; the full set adds numpy (a 17 MB wheel
#: of compiled code, about 60 MB installed), as most do.
QUICK_PACKAGES = ("requests", "pyyaml", "jinja2", "click", "tqdm", "packaging", "attrs")
FULL_PACKAGES = (*QUICK_PACKAGES, "numpy")
#: ``--ignore-installed``: the benchmark's image (this machine, whose packages the code's
#: virtual environment sees, as it sees an image's) has most of these already; a fresh
#: instance's image would not, and pip installs every one, as it would there.
SETUP = "pip install -q --ignore-installed -r requirements.txt"
TRAIN = "import yaml, requests, jinja2\nprint('ready')\n"
_MOTO_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
#: pip as a fresh instance has it: the loopback index only, no cache, no configuration.
_PIP_ISOLATED = {
    "PIP_CONFIG_FILE": os.devnull,
    "PIP_NO_CACHE_DIR": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "PIP_NO_INPUT": "1",
}


def _extra(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--packages",
        default=None,
        help="comma-separated requirements to install (default: "
        f"{','.join(FULL_PACKAGES)}; --quick: without numpy)",
    )
    p.add_argument(
        "--moved",
        action="store_true",
        help="attempt 2's code directory is another path than attempt 1's (the local "
        "provider's instances), so the restored environment's paths are moved too; by "
        "default it is the same path, as on every cloud instance",
    )
    p.add_argument(
        "--store",
        choices=("local", "s3"),
        default="local",
        help="the run's store: a directory under --dir, or S3 on moto's server on 127.0.0.1",
    )


def download_wheels(packages: list[str], dest: Path) -> list[Path]:
    """The packages and their dependencies as wheels, with pip's own configuration (the
    index this machine is set up for); not timed."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--only-binary=:all:",
            "-d",
            str(dest),
            *packages,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise BenchError(
            f"pip download {' '.join(packages)} failed: {done.stderr.strip()[-500:]}; "
            "this benchmark needs pip to reach a package index once, before it starts"
        )
    return wheels


def pinned_requirements(wheels: list[Path]) -> str:
    """``name==version`` for each wheel: the lock file a team would commit."""
    lines = []
    for wheel in wheels:
        name, version = wheel.name.split("-")[:2]
        lines.append(f"{name.replace('_', '-').lower()}=={version}")
    return "\n".join(sorted(lines)) + "\n"


def pip_environment(index_url: str) -> dict[str, str]:
    """This process's environment without pip's settings or any trainbot variable, then
    pip pointed at the loopback index only."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "TRAINBOT_", "VIRTUAL_"))
    }
    return {**env, **_PIP_ISOLATED, "PIP_INDEX_URL": index_url}


def attempt(base: dict[str, str], archive: str, code_dir: Path, store: Store) -> Ready:
    """The runner's preparation of one attempt: code unpacked into ``code_dir``, the
    environment restored from ``store`` or built by setup and archived there."""
    environ = base | contract.render(
        {
            contract.CODE_ARCHIVE: archive,
            contract.CODE_DIR: code_dir,
            contract.SETUP: [SETUP],
            contract.SETUP_VENV: ".venv",
            contract.SETUP_CACHE: True,
        }
    )
    workspace = Workspace.from_env(environ, store=lambda: store)
    if workspace is None:
        raise BenchError("the workspace names no code: the benchmark's variables are wrong")
    return workspace.prepare(environ, echo=False)


def raw_restore(store: Store, key: str, dest: Path) -> tuple[float, float]:
    """(seconds to read the archive from the store to a local file, seconds for ``tar``
    to unpack it into ``dest``)."""
    dest.mkdir(parents=True)
    blob = dest.parent / f"{dest.name}.tar.gz"
    start = time.perf_counter()
    with store.open_read(f"{ENV_DIR}/{key}.tar.gz") as stream, open(blob, "wb") as out:
        while chunk := stream.read(1 << 20):
            out.write(chunk)
    read_s = time.perf_counter() - start
    start = time.perf_counter()
    done = subprocess.run(["tar", "-xzf", str(blob), "-C", str(dest)], capture_output=True)
    unpack_s = time.perf_counter() - start
    if done.returncode != 0:
        raise BenchError(f"tar could not unpack the archive: {done.stderr.decode()[-300:]}")
    blob.unlink()
    return read_s, unpack_s


@contextlib.contextmanager
def store_uri(kind: str, root: Path) -> Iterator[str]:
    """The run's store: a directory, or a bucket on moto's server (found by the runner's
    S3 store as on an instance: ``AWS_ENDPOINT_URL_S3`` and static credentials)."""
    if kind == "local":
        yield f"file://{root / 'store'}"
        return
    from tests.fakes.moto_server import MotoServer, create_bucket

    moto = MotoServer()
    url = moto.start()
    saved = {k: os.environ.get(k) for k in _MOTO_ENV}
    os.environ.update({**_MOTO_ENV, "AWS_ENDPOINT_URL_S3": url})
    try:
        yield f"s3://{create_bucket(url, prefix='bench')}/run"
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        os.environ.pop("AWS_ENDPOINT_URL_S3", None)
        moto.stop()


@contextlib.contextmanager
def loopback_index(root: Path, wheels: list[Path]) -> Iterator[str]:
    write_simple_index(root, wheels)
    with serve_directory(root) as base:
        yield f"{base}/simple/"


def _forget(store: Store, key: str) -> None:
    """Remove the archive, so that the next attempt 1 builds it again."""
    store.delete([f"{ENV_DIR}/{key}.json", f"{ENV_DIR}/{key}.tar.gz"])


def main(argv: list[str] | None = None) -> None:
    opts, args = parse_args(__doc__ or "", argv, extra=_extra)
    packages = (
        [p.strip() for p in args.packages.split(",") if p.strip()]
        if args.packages
        else list(QUICK_PACKAGES if opts.quick else FULL_PACKAGES)
    )
    if not packages:
        raise BenchError("--packages names no package")
    setup_s: list[float] = []
    built_s: list[float] = []
    ready_s: list[float] = []
    restore_s: list[float] = []
    code_s: list[float] = []
    read_s: list[float] = []
    unpack_s: list[float] = []
    with temp_dir(opts.parent_dir, "bench-startup") as root:
        wheels = download_wheels(packages, root / "wheels")
        src = root / "src"
        src.mkdir()
        (src / "requirements.txt").write_text(pinned_requirements(wheels))
        (src / "train.py").write_text(TRAIN)
        archive_bytes = 0
        with (
            store_uri(args.store, root) as uri,
            loopback_index(root / "index", wheels) as index_url,
        ):
            archive = pack(src, uri)
            store = open_store(uri)
            log(
                f"startup: {len(wheels)} wheels "
                f"({sum(w.stat().st_size for w in wheels) / MiB:.1f} MiB) for "
                f"{', '.join(packages)}; store {uri}; {opts.repeats} rounds"
            )
            base = pip_environment(index_url)
            for r in range(opts.repeats):
                first = attempt(base, archive, root / f"r{r}-attempt-1" / "code", store)
                if first.prepared.how != "ran" or first.prepared.key is None:
                    raise BenchError(f"attempt 1 did not run setup: {first.lines()}")
                key = first.prepared.key
                setup_s.append(first.prepared.seconds)
                built_s.append(first.code_s + first.prepared.seconds)
                archive_bytes = store.list(f"{ENV_DIR}/{key}.tar.gz")[0].size
                if not args.moved:  # a fresh instance, the same scratch path: nothing there
                    shutil.rmtree(first.cwd)
                settle(opts)
                order = ("ours", "raw") if r % 2 == 0 else ("raw", "ours")
                for contender in order:
                    if contender == "ours":
                        code_dir = root / f"r{r}-attempt-{2 if args.moved else 1}" / "code"
                        second = attempt(base, archive, code_dir, store)
                        if second.prepared.how != "restored":
                            raise BenchError(f"attempt 2 did not restore: {second.lines()}")
                        if second.prepared.key != key:
                            raise BenchError("attempt 2 restored another environment's key")
                        ready_s.append(second.code_s + second.prepared.seconds)
                        restore_s.append(second.prepared.seconds)
                        code_s.append(second.code_s)
                    else:
                        got = raw_restore(store, key, root / f"r{r}-raw")
                        read_s.append(got[0])
                        unpack_s.append(got[1])
                    settle(opts)
                log(
                    f"  round {r + 1}: setup {setup_s[-1]:.2f}s, attempt 2 ready "
                    f"{ready_s[-1]:.2f}s (code {code_s[-1]:.2f}, environment "
                    f"{restore_s[-1]:.2f}), raw {read_s[-1] + unpack_s[-1]:.2f}s (read "
                    f"{read_s[-1]:.2f}, unpack {unpack_s[-1]:.2f})"
                )
                _forget(store, key)
                for leftover in root.glob(f"r{r}-*"):
                    shutil.rmtree(leftover, ignore_errors=True)
    ready = median(ready_s)
    raw = median([a + b for a, b in zip(read_s, unpack_s, strict=True)])
    setup = median(setup_s)
    vs_raw, vs_setup = ready / raw, ready / setup
    checks: list[dict[str, Any]] = [
        {"check": "ready_vs_raw", "value": rounded(vs_raw), "goal": GOAL_VS_RAW},
        {"check": "ready_vs_setup", "value": rounded(vs_setup), "goal": GOAL_VS_SETUP},
    ]
    for check in checks:
        check["met"] = (
            vs_raw <= GOAL_VS_RAW
            if check["check"] == "ready_vs_raw"
            else (vs_setup <= GOAL_VS_SETUP)
        )
    log(
        f"attempt 2 ready in {ready:.2f}s: {vs_raw:.2f} x raw ({raw:.2f}s), "
        f"{vs_setup:.3f} x setup ({setup:.2f}s)"
    )
    figures: dict[str, Any] = {
        "packages": packages,
        "wheels": len(wheels),
        "archive_bytes": archive_bytes,
        "setup_s": rounded(setup),
        "attempt1_ready_s": rounded(median(built_s)),
        "attempt2_ready_s": rounded(ready),
        "attempt2_code_s": rounded(median(code_s)),
        "attempt2_restore_s": rounded(median(restore_s)),
        "raw_read_s": rounded(median(read_s)),
        "raw_unpack_s": rounded(median(unpack_s)),
        "raw_s": rounded(raw),
        "store_read_mib_s": rounded(archive_bytes / MiB / median(read_s), 1),
        "ratio_vs_setup": rounded(vs_setup),
        "setup_all_s": [rounded(v) for v in setup_s],
        "attempt2_ready_all_s": [rounded(v) for v in ready_s],
        "raw_all_s": [rounded(a + b) for a, b in zip(read_s, unpack_s, strict=True)],
        "store": args.store,
        "moved": bool(args.moved),
    }
    # The headline ratio is the one against raw; both goals must hold for ``met``.
    emit(
        "startup",
        ratio=vs_raw,
        goal=GOAL_VS_RAW,
        op="<=",
        figures=figures,
        opts=opts,
        checks=checks,
    )


if __name__ == "__main__":
    sys.exit(run(main))

"""The spec's ``setup``, and the environment it built, restored instead of rebuilt.

``setup`` commands run in the code directory before the command, one after another
under ``bash`` (``sh`` where there is none), their output in the attempt's log like the
command's. A command that fails ends the attempt as a setup failure (:class:`SetupFailed`),
not a preemption: running it again on another instance would fail the same way.

With the code, setup gets a virtual environment (``setup_cache.venv``, default ``.venv``
in the code directory) that the runner makes first and puts first on ``PATH``, so that
``pip install -r requirements.txt`` installs into it; it sees the image's packages
(``--system-site-packages``: the image's torch is not installed again), and the command
runs in it too.

What setup built (that virtual environment and ``setup_cache.paths``) is archived to the
run's store once setup succeeds, under ``env/<key>.tar.gz``, where the key is a sha256
of everything that decides what setup builds: its commands, the requirement and lock
files in the code directory, the machine image, the Python version and the platform. A
later attempt, on a fresh instance, restores that archive (its digest checked, its
absolute paths moved to where the code now is) instead of running setup; a new key, or an
archive that is missing or corrupt, runs setup again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from runner import env as contract
from runner.code import CodeError, prepare_code
from runner.errors import RunnerError, StoreError
from runner.relocate import relocate
from runner.store.base import Store, WriteStream

__all__ = [
    "KEY_FILES",
    "Prepared",
    "Ready",
    "SetupFailed",
    "SetupInterrupted",
    "SetupPlan",
    "Workspace",
    "environment_key",
    "prepare_environment",
]

#: Files in the code directory whose contents decide what setup installs.
KEY_FILES = (
    "requirements*.txt",
    "requirements/*.txt",
    "constraints*.txt",
    "pyproject.toml",
    "setup.py",
    "setup.cfg",
    "*.lock",
    "Pipfile",
    "environment.yml",
    "environment.yaml",
)
#: Where the archives go in the run's store.
ENV_DIR = "env"
#: Lines of a failed setup's output shown in the run's thread.
TAIL_LINES = 20
_POLL_S = 0.2


class SetupFailed(RunnerError):
    """A setup command failed: the attempt ends as a setup failure."""

    def __init__(self, message: str, *, tail: str) -> None:
        super().__init__(message)
        self.tail = tail


class SetupInterrupted(RunnerError):
    """A preemption notice came while setup ran: the attempt ends preempted."""


@dataclass(frozen=True)
class SetupPlan:
    """What the control plane asked for (``TRAINBOT_SETUP*``)."""

    commands: tuple[str, ...]
    code_dir: Path
    #: The virtual environment setup installs into; None: none is made.
    venv: Path | None = None
    #: Archive what setup built, and restore it next time.
    cache: bool = False
    #: More paths the archive holds (relative: in the code directory).
    paths: tuple[str, ...] = ()
    key_files: tuple[str, ...] = ()
    image: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str], code_dir: Path) -> SetupPlan:
        venv = contract.SETUP_VENV.get(environ)
        return cls(
            commands=tuple(contract.SETUP.get(environ) or ()),
            code_dir=code_dir,
            venv=(code_dir / venv) if venv else None,
            cache=contract.SETUP_CACHE.get(environ),
            paths=tuple(contract.SETUP_CACHE_PATHS.get(environ) or ()),
            key_files=tuple(contract.SETUP_KEY_FILES.get(environ) or ()),
            image=contract.MACHINE_IMAGE.get(environ),
        )

    def archived(self) -> list[Path]:
        """The paths the environment archive holds."""
        found = [self.venv] if self.venv is not None else []
        found += [self.code_dir / p for p in self.paths]  # an absolute p stays absolute
        return found


@dataclass
class Prepared:
    """How the environment came to be, for the log and the dry run's report."""

    how: Literal["none", "ran", "restored"]
    seconds: float = 0.0
    key: str | None = None
    #: Why setup ran although caching is on (no archive yet, a corrupt one …).
    why: str | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        key = f" (environment {self.key[:12]})" if self.key else ""
        if self.how == "restored":
            return f"environment restored from the store in {self.seconds:.1f} s{key}"
        if self.how == "ran":
            why = f"; {self.why}" if self.why else ""
            return f"setup ran in {self.seconds:.1f} s{key}{why}"
        return "no setup"


def environment_key(plan: SetupPlan) -> str:
    """The sha256 of everything that decides what setup builds."""
    files: dict[str, str] = {}
    for pattern in (*KEY_FILES, *plan.key_files):
        for path in sorted(plan.code_dir.glob(pattern)):
            if path.is_file():
                rel = path.relative_to(plan.code_dir).as_posix()
                files[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    libc = "-".join(platform.libc_ver())
    what = {
        "version": 1,
        "setup": list(plan.commands),
        "files": files,
        "image": plan.image or "",
        "python": sys.version,
        "platform": f"{sys.platform}-{platform.machine()}-{libc}",
        "venv": str(plan.venv.relative_to(plan.code_dir)) if plan.venv else None,
        "paths": list(plan.paths),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


# --- the virtual environment -------------------------------------------------------------

_PIP_SHIM = '#!/bin/sh\nexec "$(dirname "$0")/python" -m pip "$@"\n'


def make_venv(venv: Path) -> None:
    """A virtual environment that sees the image's packages; ``pip`` in it is the
    image's pip run by its python (quick), else its own (``ensurepip``). The runner's own
    packages come last on its path, so a script using the session API imports them."""
    if (venv / "bin" / "python").exists():
        return
    base = getattr(sys, "_base_executable", sys.executable)
    done = subprocess.run(
        [base, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SetupFailed(f"cannot make the virtual environment {venv}", tail=done.stderr[-2000:])
    python = venv / "bin" / "python"
    has_pip = subprocess.run([str(python), "-c", "import pip"], capture_output=True).returncode == 0
    if has_pip:
        for name in ("pip", "pip3"):
            shim = venv / "bin" / name
            shim.write_text(_PIP_SHIM)
            shim.chmod(0o755)
    else:
        subprocess.run([str(python), "-m", "ensurepip", "--default-pip"], check=False)
    if sys.prefix != sys.base_prefix:  # the runner itself runs in a virtual environment
        purelib = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        if purelib:
            Path(purelib, "zz_trainbot_runner.pth").write_text("\n".join(_runner_sites()) + "\n")


def _runner_sites() -> list[str]:
    """The package directories the runner's own interpreter sees, in its order: its
    virtual environment's, and the image's that a ``.pth`` there adds (the installer's
    ``trainbot-image-packages.pth``: a Deep Learning AMI's torch lives in
    ``/opt/pytorch``, not in the base interpreter a virtual environment is made from)."""
    found = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    found += [
        p
        for p in sys.path
        if os.path.basename(p.rstrip(os.sep)) in ("site-packages", "dist-packages")
    ]
    return [p for p in dict.fromkeys(found) if os.path.isdir(p)]


def activated(environ: Mapping[str, str], venv: Path | None) -> dict[str, str]:
    """``environ`` with ``venv`` active: first on ``PATH``, ``VIRTUAL_ENV`` set."""
    env = dict(environ)
    if venv is None:
        return env
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join(p for p in (str(venv / "bin"), env.get("PATH", "")) if p)
    env.pop("PYTHONHOME", None)
    return env


# --- running setup -------------------------------------------------------------------------


def _shell() -> list[str]:
    bash = shutil.which("bash")
    return [bash, "-e", "-o", "pipefail", "-c"] if bash else ["/bin/sh", "-e", "-c"]


def _reader(
    source: IO[bytes], tail: deque[bytes], feed: Callable[[bytes], object] | None, echo: bool
) -> threading.Thread:
    def run() -> None:
        fd = source.fileno()
        pending = b""
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                break
            if not data:
                break
            if echo:
                with contextlib.suppress(OSError):
                    os.write(1, data)
            if feed is not None:
                feed(data)
            pending += data
            *lines, pending = pending.split(b"\n")
            tail.extend(lines)
        if pending:
            tail.append(pending)
        source.close()

    thread = threading.Thread(target=run, name="setup-output", daemon=True)
    thread.start()
    return thread


def run_setup(
    plan: SetupPlan,
    environ: Mapping[str, str],
    *,
    feed: Callable[[bytes], object] | None = None,
    stop: Callable[[], bool] = lambda: False,
    echo: bool = True,
) -> None:
    """Run each setup command in the code directory; raise :class:`SetupFailed` at the
    first that fails, :class:`SetupInterrupted` when ``stop()`` turns true meanwhile (the
    command's process group is ended)."""
    if plan.venv is not None:
        make_venv(plan.venv)
    env = activated(environ, plan.venv)
    tail: deque[bytes] = deque(maxlen=TAIL_LINES)
    for command in plan.commands:
        note = f"trainbot-runner: setup: {command}\n".encode()
        if echo:
            with contextlib.suppress(OSError):
                os.write(1, note)
        if feed is not None:
            feed(note)
        proc = subprocess.Popen(
            [*_shell(), command],
            cwd=plan.code_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert proc.stdout is not None
        reader = _reader(proc.stdout, tail, feed, echo)
        while proc.poll() is None:
            if stop():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                reader.join(timeout=2.0)
                raise SetupInterrupted(f"preempted during setup ({command[:200]})")
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_POLL_S)
        reader.join(timeout=5.0)
        if proc.returncode != 0:
            text = b"\n".join(tail).decode("utf-8", errors="replace")[-4000:]
            raise SetupFailed(
                f"setup command {command[:200]!r} exited {proc.returncode}", tail=text
            )


# --- the environment archive -------------------------------------------------------------


class _Hashing:
    """A write stream that hashes and counts what passes through it."""

    def __init__(self, out: WriteStream) -> None:
        self.out = out
        self.sha = hashlib.sha256()
        self.bytes = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.bytes += len(data)
        self.out.write(data)
        return len(data)


def _member(plan: SetupPlan, path: Path) -> str:
    try:
        return "c/" + path.relative_to(plan.code_dir).as_posix()
    except ValueError:
        return "a/" + path.as_posix().lstrip("/")


def save_environment(plan: SetupPlan, store: Store, key: str, *, setup_s: float) -> int | None:
    """Archive what setup built to ``env/<key>.tar.gz`` and its manifest (digest, size,
    where the code was) to ``env/<key>.json``, written last; returns the bytes, or None
    when setup built nothing to archive."""
    present = [p for p in plan.archived() if p.exists() or p.is_symlink()]
    if not present:
        return None
    stream = store.open_write(f"{ENV_DIR}/{key}.tar.gz")
    hashing = _Hashing(stream)
    try:
        with tarfile.open(fileobj=hashing, mode="w|gz") as tar:  # type: ignore[call-overload]
            for path in present:
                tar.add(str(path), arcname=_member(plan, path))
    except BaseException:
        stream.abort()
        raise
    stream.close()
    manifest = {
        "sha256": hashing.sha.hexdigest(),
        "bytes": hashing.bytes,
        "root": str(plan.code_dir),
        "members": [_member(plan, p) for p in present],
        "setup_s": round(setup_s, 3),
        "made_at": time.time(),
    }
    store.put_bytes(f"{ENV_DIR}/{key}.json", json.dumps(manifest).encode())
    return hashing.bytes


def restore_environment(plan: SetupPlan, store: Store, key: str) -> str | None:
    """Restore the archive for ``key``; None when restored, else why it could not be
    (then setup runs). Nothing is moved into the code directory before the archive's
    sha256 matches its manifest."""
    try:
        manifest = json.loads(store.get_bytes(f"{ENV_DIR}/{key}.json"))
    except (StoreError, ValueError, OSError):
        return "no archived environment for this key yet"
    parent = plan.code_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".trainbot-env-", dir=parent) as tmp:
        unpacked = Path(tmp) / "x"
        unpacked.mkdir()
        try:
            with store.open_read(f"{ENV_DIR}/{key}.tar.gz") as stream:
                digest, size, unpack_error = _unpack(stream, unpacked, Path(tmp))
        except (StoreError, OSError) as exc:
            return f"the archived environment could not be read ({exc})"
        if digest != manifest.get("sha256") or size != manifest.get("bytes"):
            return "the archived environment is corrupt (its sha256 does not match its manifest)"
        if unpack_error is not None:
            return f"the archived environment could not be unpacked ({unpack_error})"
        for member in manifest.get("members", []):
            source = unpacked / member
            where, _, rest = str(member).partition("/")
            target = plan.code_dir / rest if where == "c" else Path("/") / rest
            if target.is_symlink() or target.is_file():
                target.unlink()
            elif target.exists():
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, target)
            old = str(manifest.get("root") or "")
            if old and old != str(plan.code_dir):
                relocate(target, old.encode(), str(plan.code_dir).encode())
    return None


def _unpack(stream: IO[bytes], dest: Path, tmp: Path) -> tuple[str, int, str | None]:
    """Unpack the tar.gz ``stream`` into ``dest`` as it is read: (its sha256, its bytes,
    why it could not be unpacked or None). GNU tar, where there is one, unpacks while the
    archive downloads (C, and the download and the unpacking overlap); otherwise the
    archive is downloaded to ``tmp`` first and unpacked by :mod:`tarfile`."""
    digest = hashlib.sha256()
    size = 0
    tar = shutil.which("tar")
    if tar is None:
        blob = tmp / "env.tar.gz"
        with open(blob, "wb") as out:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
        try:
            with tarfile.open(blob, mode="r:gz") as archive:
                archive.extractall(dest, filter="tar")
        except (tarfile.TarError, OSError, EOFError) as exc:
            return digest.hexdigest(), size, str(exc)
        return digest.hexdigest(), size, None
    # tar's messages go to a file, not a pipe, so that tar never waits on them.
    with tempfile.TemporaryFile(dir=tmp) as said:
        proc = subprocess.Popen(
            [tar, "-x", "-z", "-f", "-", "-C", str(dest), "--no-same-owner"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=said,
        )
        assert proc.stdin is not None
        feeding = True
        try:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
                if feeding:
                    try:
                        proc.stdin.write(chunk)
                    except BrokenPipeError:
                        feeding = False  # tar gave up; the digest is still read to the end
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
            code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        said.seek(0)
        errors = said.read().decode("utf-8", errors="replace").strip()
    if code != 0 or not feeding:
        return digest.hexdigest(), size, f"tar exited {code}: {errors[-300:] or 'no message'}"
    return digest.hexdigest(), size, None


def prepare_environment(
    plan: SetupPlan,
    environ: Mapping[str, str],
    *,
    store: Callable[[], Store] | None,
    feed: Callable[[bytes], object] | None = None,
    stop: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.monotonic,
    echo: bool = True,
) -> Prepared:
    """Restore the environment from the store, or run setup (and archive what it built).
    Raises :class:`SetupFailed` or :class:`SetupInterrupted`."""
    if not plan.commands:
        return Prepared("none")
    start = clock()
    opened: Store | None = None
    why: str | None = None
    key = environment_key(plan) if plan.cache else None
    if key is not None and store is not None:
        try:
            opened = store()
            why = restore_environment(plan, opened, key)
        except (StoreError, OSError) as exc:
            why = f"the store could not be read ({exc})"
        if why is None:
            return Prepared("restored", clock() - start, key)
    run_setup(plan, environ, feed=feed, stop=stop, echo=echo)
    took = clock() - start
    prepared = Prepared("ran", took, key, why=why)
    if key is not None and opened is not None:
        try:
            size = save_environment(plan, opened, key, setup_s=took)
        except (StoreError, OSError) as exc:
            prepared.notes.append(f"the environment was not archived: {exc}")
        else:
            if size is None:
                prepared.notes.append(
                    "setup built nothing to archive (no setup_cache.venv or setup_cache.paths)"
                )
            else:
                prepared.notes.append(f"archived the environment ({size:,} bytes)")
    return prepared


@dataclass
class Ready:
    """The code and its environment, ready for the command."""

    #: The command's working directory.
    cwd: Path
    #: The command's environment (the virtual environment active).
    env: dict[str, str]
    #: What was checked out (a commit, an archive's sha256), or None.
    code: str | None
    prepared: Prepared
    #: Seconds the code took to check out or unpack.
    code_s: float = 0.0

    def lines(self) -> list[str]:
        """What happened, for the log and the run's events."""
        found = []
        if self.code is not None:
            found.append(f"code {self.code[:12]} in {self.cwd} ({self.code_s:.1f} s)")
        if self.prepared.how != "none":
            found.append(self.prepared.describe())
        return [*found, *self.prepared.notes]


@dataclass(frozen=True)
class Workspace:
    """The run's code and setup on this instance, from the control plane's variables."""

    environ: Mapping[str, str]
    code_dir: Path
    #: Opens the run's store (the environment archives); None: no caching.
    store: Callable[[], Store] | None = None

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], *, store: Callable[[], Store] | None = None
    ) -> Workspace | None:
        """None when the run names neither code nor setup."""
        has_code = bool(contract.CODE_REPO.get(environ) or contract.CODE_ARCHIVE.get(environ))
        if not has_code and not contract.SETUP.get(environ):
            return None
        code_dir = contract.CODE_DIR.get(environ)
        if code_dir is None and has_code:
            scratch = contract.SCRATCH_DIR.get(environ)
            code_dir = (scratch or Path.cwd()) / "code"
        return cls(environ, (code_dir or Path.cwd()).absolute(), store)

    def prepare(
        self,
        env: Mapping[str, str],
        *,
        feed: Callable[[bytes], object] | None = None,
        stop: Callable[[], bool] = lambda: False,
        echo: bool = True,
    ) -> Ready:
        """Check out (or unpack) the code, then restore or build its environment.
        Raises :class:`SetupFailed` (the code too could not be had) or
        :class:`SetupInterrupted`."""
        start = time.monotonic()
        try:
            code = prepare_code(self.environ, self.code_dir)
        except (CodeError, StoreError) as exc:
            raise SetupFailed(f"the code could not be fetched: {exc}", tail=str(exc)) from exc
        code_s = time.monotonic() - start
        plan = SetupPlan.from_env(self.environ, self.code_dir)
        if code is None:
            plan = dataclasses.replace(plan, venv=None)
        prepared = prepare_environment(plan, env, store=self.store, feed=feed, stop=stop, echo=echo)
        return Ready(self.code_dir, activated(env, plan.venv), code, prepared, code_s)

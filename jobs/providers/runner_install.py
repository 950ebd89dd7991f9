"""The runner on a cloud instance, pinned to the control plane's own version.

Three ways, an admin setting of each cloud provider (``TRAINBOT_AWS_RUNNER_INSTALL``,
``TRAINBOT_GCP_RUNNER_INSTALL``):

- ``wheel``: the control plane builds its own wheel (from the source it runs, once per
  process), or takes the one an admin names or its image holds (:func:`shipped_wheel`),
  and serves it itself on ``GET /v1/runner-wheel`` (:data:`WHEEL_ROUTE`, authenticated
  with the attempt's runner token, as ``/v1/events``); the boot script downloads it from
  the control plane URL the instance already reports to, checks the sha256 the control
  plane wrote into it, and installs it. No index serves trainbot, and the instance's role
  needs no access to the checkpoint bucket (it gets none: the broker's scoped credentials
  are its only way there).
- ``index``: ``trainbot==<version>`` from a configured index (pip's own when none).
- ``image``: the machine image already has the runner; nothing is installed.

In the first two, torch is installed only when the image lacks it. The instance side is
deploy/runner-install.py; each provider's boot script runs it with :func:`boot_config`.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from jobs.providers.base import ProviderError
from runner import env as contract

__all__ = [
    "INSTALLER_PATH",
    "MODES",
    "SERVED_WHEELS",
    "SHARE_DIR",
    "WHEEL_ROUTE",
    "Mode",
    "RunnerInstall",
    "ServedWheel",
    "ServedWheels",
    "TokenSource",
    "Wheel",
    "boot_config",
    "built_wheel",
    "control_plane_version",
    "deploy_file",
    "installer_source",
    "prepare_in_background",
    "shipped_wheel",
    "wheel_url",
]

log = logging.getLogger(__name__)

Mode = Literal["wheel", "index", "image"]
MODES: tuple[Mode, ...] = ("wheel", "index", "image")
#: Where the installer reads the attempt's token from (see :func:`boot_config`).
TokenSource = Literal["env-file", "gce-metadata"]
#: The control plane's route that serves its wheel to instances.
WHEEL_ROUTE = "/v1/runner-wheel"
PACKAGE = "trainbot"
_ROOT = Path(__file__).resolve().parents[2]
#: Where an installed control plane (the container image) keeps what a source checkout
#: has in deploy/ (``SHARE_DIR/deploy/…``) and its own wheel (``SHARE_DIR/wheels/``):
#: ``$TRAINBOT_SHARE_DIR``, else ``<venv>/share/trainbot``.
SHARE_DIR = Path(os.environ.get("TRAINBOT_SHARE_DIR") or Path(sys.prefix) / "share" / "trainbot")


def deploy_file(*parts: str) -> Path:
    """A file of deploy/ (a boot script, the installer): the source checkout's, else the
    one installed under :data:`SHARE_DIR` (the image's); the checkout's path when neither
    exists, so the error names it."""
    here = _ROOT.joinpath("deploy", *parts)
    if here.is_file():
        return here
    shipped = SHARE_DIR.joinpath("deploy", *parts)
    return shipped if shipped.is_file() else here


#: The installer the boot scripts run on the instance (standard library only).
INSTALLER_PATH = deploy_file("runner-install.py")
_WHEEL_NAME = re.compile(r"trainbot-(?P<version>[^-]+)-py3-none-any\.whl")
#: A fixed time for the files in a built wheel, so the same source gives the same bytes
#: (and the same sha256) at every start, and on every replica.
_SOURCE_DATE_EPOCH = "315532800"


def control_plane_version() -> str:
    """The version of trainbot this control plane runs."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ProviderError(
            "trainbot is not installed as a package here, so its version is unknown: "
            "pip install the control plane (pip install -e '.[server]' in a checkout)"
        ) from None


@dataclass(frozen=True)
class Wheel:
    """One built wheel of trainbot."""

    # The file on the control plane's disk.
    path: Path
    # Its version (from its name).
    version: str
    # sha256 of its bytes, hex.
    sha256: str

    @property
    def file_name(self) -> str:
        """The name pip needs on the instance (a build tag must start with a digit, so the
        hash stays out of it)."""
        return f"trainbot-{self.version}-py3-none-any.whl"

    @classmethod
    def of(cls, path: Path) -> Wheel:
        found = _WHEEL_NAME.fullmatch(path.name)
        if found is None:
            raise ProviderError(
                f"{path} is not a trainbot wheel (trainbot-<version>-py3-none-any.whl)"
            )
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as exc:
            raise ProviderError(f"cannot read the runner wheel {path}: {exc}") from None
        return cls(path=path, version=found["version"], sha256=digest)


_BUILD_LOCK = threading.Lock()


def built_wheel(root: Path = _ROOT) -> Wheel:
    """The wheel of the trainbot source at ``root``, built once per process (a second
    caller waits for the first one's build)."""
    with _BUILD_LOCK:
        return _built_wheel(root)


@functools.lru_cache(maxsize=4)
def _built_wheel(root: Path) -> Wheel:
    """:func:`built_wheel`, unlocked.

    It is built from a copy of the source in a temporary directory, so the checkout is
    left as it was (setuptools writes ``build/`` and ``*.egg-info`` where it builds)."""
    if not (root / "pyproject.toml").is_file():
        raise ProviderError(
            f"this control plane runs from an installed package, not a source tree ({root} "
            f"has no pyproject.toml) with no wheel of its own in {SHARE_DIR / 'wheels'}, so "
            "it cannot build its runner wheel: set "
            "TRAINBOT_<CLOUD>_RUNNER_WHEEL to the trainbot wheel of this version, or "
            "TRAINBOT_<CLOUD>_RUNNER_INSTALL=index"
        )
    out = Path(tempfile.mkdtemp(prefix="trainbot-wheel-"))
    src = out / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (root / name).is_file():
            shutil.copy2(root / name, src / name)
    for package in ("bot", "jobs", "runner"):
        shutil.copytree(root / package, src / package, ignore=ignore)
    build = (
        "import sys; from setuptools import build_meta as backend; "
        "print(backend.build_wheel(sys.argv[1]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", build, str(out)],
        cwd=src,
        env={**os.environ, "SOURCE_DATE_EPOCH": _SOURCE_DATE_EPOCH},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise ProviderError(
            f"could not build the runner wheel from {root}: "
            f"{(done.stderr or done.stdout).strip()[-600:]}; set "
            "TRAINBOT_<CLOUD>_RUNNER_WHEEL to a built wheel instead"
        )
    shutil.rmtree(src, ignore_errors=True)
    return Wheel.of(out / done.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class RunnerInstall:
    """How a provider's instances get the runner (a provider setting)."""

    # "wheel", "index" or "image" (see the module's docstring).
    mode: Mode = "wheel"
    # The index pip installs from (``--index-url``): trainbot itself in "index" mode, and
    # what the wheel needs (torch, when the image lacks it) in "wheel" mode; None: pip's own.
    index_url: str | None = None
    # "wheel" mode: the wheel to upload; None builds one from the control plane's source.
    wheel: Path | None = None
    # The version instances install; None: the control plane's own.
    version: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ProviderError(
                f"runner install mode {self.mode!r} is not one of {', '.join(MODES)}"
            )

    @property
    def pinned_version(self) -> str:
        return self.version or control_plane_version()

    def the_wheel(self) -> Wheel:
        """The wheel "wheel" mode serves, of the pinned version: the admin's; else, from
        an installed package, the one its image ships (:func:`shipped_wheel`); else the
        one built from the control plane's source."""
        if self.wheel is not None:
            wheel = Wheel.of(self.wheel)
        elif (_ROOT / "pyproject.toml").is_file():
            wheel = built_wheel()
        else:
            wheel = shipped_wheel(self.pinned_version) or built_wheel()
        if wheel.version != self.pinned_version:
            raise ProviderError(
                f"the runner wheel {wheel.path.name} is version {wheel.version}, but this "
                f"control plane is {self.pinned_version}: build the wheel of this version"
            )
        return wheel


def shipped_wheel(version: str) -> Wheel | None:
    """The wheel of ``version`` an installed control plane ships beside itself
    (``SHARE_DIR/wheels/``: deploy/Dockerfile copies its build's there), if any."""
    path = SHARE_DIR / "wheels" / f"{PACKAGE}-{version}-py3-none-any.whl"
    return Wheel.of(path) if path.is_file() else None


def prepare_in_background(
    install: RunnerInstall, *, setting: str, served: ServedWheels | None = None
) -> None:
    """At the control plane's start: build (or check) the "wheel" mode's wheel while it
    starts, and serve it, so the first launch does not wait for it, an instance another
    replica launched finds it here, and a wheel that cannot be had is logged at once,
    saying what to set (``setting``: the provider's prefix). The launch raises the same
    error to the run if it is still so."""
    if install.mode != "wheel":
        return
    shelf = SERVED_WHEELS if served is None else served
    shelf.expect()

    def prepare() -> None:
        try:
            wheel = install.the_wheel()
            shelf.offer(wheel)
        except ProviderError as exc:
            log.warning("%sRUNNER_INSTALL=wheel: %s", setting, exc)
            return
        finally:
            shelf.arrived()
        log.info("runner wheel %s (sha256 %s) served to instances", wheel.path, wheel.sha256[:12])

    threading.Thread(target=prepare, name="trainbot-runner-wheel", daemon=True).start()


class ServedWheel:
    """A wheel the control plane serves to its instances: its bytes, read once, and
    sent in chunks of :data:`CHUNK_BYTES` at every request."""

    CHUNK_BYTES = 64 * 1024

    def __init__(self, wheel: Wheel, data: bytes) -> None:
        self.wheel = wheel
        self.data = data

    @property
    def etag(self) -> str:
        return f'"{self.wheel.sha256}"'

    def chunks(self) -> Iterator[bytes]:
        view = memoryview(self.data)
        for start in range(0, len(view), self.CHUNK_BYTES):
            yield bytes(view[start : start + self.CHUNK_BYTES])


class ServedWheels:
    """The wheels this process serves on ``GET /v1/runner-wheel`` (:data:`WHEEL_ROUTE`),
    by sha256: each provider in "wheel" mode offers the one its instances are told to
    fetch (at the control plane's start, in the background, and at each launch)."""

    def __init__(self) -> None:
        self._by_digest: dict[str, ServedWheel] = {}
        self._latest: ServedWheel | None = None
        self._preparing = 0
        self._lock = threading.Lock()

    def offer(self, wheel: Wheel) -> ServedWheel:
        """Serve ``wheel`` (its file is read here, once; one already served is kept)."""
        with self._lock:
            found = self._by_digest.get(wheel.sha256)
        if found is not None:
            return found
        try:
            data = wheel.path.read_bytes()
        except OSError as exc:
            raise ProviderError(f"cannot read the runner wheel {wheel.path}: {exc}") from None
        if hashlib.sha256(data).hexdigest() != wheel.sha256:
            raise ProviderError(
                f"the runner wheel {wheel.path} changed on disk since it was read: "
                "leave the file of TRAINBOT_<CLOUD>_RUNNER_WHEEL as it is while the "
                "control plane runs"
            )
        served = ServedWheel(wheel, data)
        with self._lock:
            served = self._by_digest.setdefault(wheel.sha256, served)
            self._latest = served
        return served

    def find(self, sha256: str | None) -> ServedWheel | None:
        """The wheel of that digest (None: the latest offered), if this process has it."""
        with self._lock:
            if sha256 is None:
                return self._latest
            return self._by_digest.get(sha256.lower())

    @property
    def preparing(self) -> bool:
        """Whether a wheel is still being built or checked (a request may wait for it)."""
        with self._lock:
            return self._preparing > 0

    def expect(self) -> None:
        """A wheel is on its way (built or checked in the background): until
        :meth:`arrived`, a request for a wheel not here yet is told to retry."""
        with self._lock:
            self._preparing += 1

    def arrived(self) -> None:
        """The wheel :meth:`expect` announced is offered, or will not be."""
        with self._lock:
            self._preparing -= 1


#: The process's served wheels (what :class:`jobs.web.server.ControlPlaneApp` serves).
SERVED_WHEELS = ServedWheels()


def wheel_url(ingest_url: str, sha256: str) -> str | None:
    """Where an instance fetches the wheel, from its ``TRAINBOT_INGEST_URL``
    (``<public URL>/v1/events``); None when that is not such a URL."""
    base, sep, rest = ingest_url.rpartition("/v1/events")
    if not sep or rest or not base.startswith(("http://", "https://")):
        return None
    return f"{base}{WHEEL_ROUTE}?sha256={sha256}"


def boot_config(
    install: RunnerInstall,
    env: Mapping[str, str],
    *,
    run_id: str,
    setting: str,
    token_from: TokenSource,
    served: ServedWheels = SERVED_WHEELS,
) -> dict[str, Any]:
    """What the instance's installer is given (deploy/runner-install.py's CONFIG); in
    "wheel" mode the wheel is offered on this control plane's :data:`WHEEL_ROUTE` and
    the instance told where, with its sha256. ``setting``: the provider's settings
    prefix, for messages (``TRAINBOT_AWS_``); ``token_from``: where the installer reads
    the attempt's token (``env-file``: the AWS boot script's root-only environment file;
    ``gce-metadata``: the instance's ``trainbot-env`` metadata)."""
    version = install.pinned_version
    config: dict[str, Any] = {
        "mode": install.mode,
        "package": PACKAGE,
        "version": version,
        "index_url": install.index_url or "",
    }
    if install.mode != "wheel":
        return config
    ingest = env.get(contract.INGEST_URL.name, "")
    wheel = install.the_wheel()
    url = wheel_url(ingest, wheel.sha256)
    if url is None or not env.get(contract.TOKEN.name):
        raise ProviderError(
            f"run {run_id}: its instances fetch the runner wheel from the control plane, "
            f"but their environment has no control plane URL ({contract.INGEST_URL.name}="
            f"{ingest or 'unset'}) or no token: set TRAINBOT_PUBLIC_URL to the URL "
            f"instances reach this control plane at, or {setting}RUNNER_INSTALL=index "
            "(or image)"
        )
    size = len(served.offer(wheel).data)
    config["wheel"] = {
        "url": url,
        "sha256": wheel.sha256,
        "size": size,
        "file": wheel.file_name,
        "token_from": token_from,
    }
    return config


def installer_source(*, compact: bool = False) -> str:
    """The instance-side installer, as text; ``compact``: without its docstrings and
    comments (the same code, for EC2's 16 KiB of user data)."""
    try:
        text = INSTALLER_PATH.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProviderError(
            f"cannot read the runner installer {INSTALLER_PATH} ({exc}): reinstall trainbot "
            "from its repository"
        ) from None
    if not compact:
        return text
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                node.body = node.body[1:] or [ast.Pass()]
    return ast.unparse(tree) + "\n"

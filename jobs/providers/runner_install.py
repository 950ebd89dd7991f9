"""The runner on a cloud instance, pinned to the control plane's own version.

Three ways, an admin setting of each cloud provider (``TRAINBOT_AWS_RUNNER_INSTALL``,
``TRAINBOT_GCP_RUNNER_INSTALL``):

- ``wheel``: the control plane builds its own wheel (from the source it runs, once per
  process) or takes the one an admin names, and puts it in the run's bucket under a
  content-addressed key (:data:`WHEELS_DIR`); the boot script downloads it with the
  instance's own credentials and installs it, so no index serves trainbot itself.
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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from jobs.providers.base import ProviderError
from runner import env as contract
from runner.errors import RunnerError
from runner.store import open_store

__all__ = [
    "INSTALLER_PATH",
    "MODES",
    "WHEELS_DIR",
    "Mode",
    "RunnerInstall",
    "Wheel",
    "WheelUploads",
    "boot_config",
    "built_wheel",
    "control_plane_version",
    "installer_source",
    "prepare_in_background",
]

log = logging.getLogger(__name__)

Mode = Literal["wheel", "index", "image"]
MODES: tuple[Mode, ...] = ("wheel", "index", "image")
#: Where, under a run's checkpoint URI, the control plane's wheels are kept.
WHEELS_DIR = "_trainbot/wheels"
PACKAGE = "trainbot"
_ROOT = Path(__file__).resolve().parents[2]
#: The installer the boot scripts run on the instance (standard library only).
INSTALLER_PATH = _ROOT / "deploy" / "runner-install.py"
_WHEEL_NAME = re.compile(r"trainbot-(?P<version>[^-]+)-py3-none-any\.whl")
#: A fixed time for the files in a built wheel, so the same source gives the same bytes
#: (and the same key in the bucket) at every start.
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
    def key(self) -> str:
        """Its content-addressed name in a bucket, under :data:`WHEELS_DIR`."""
        return f"{WHEELS_DIR}/trainbot-{self.version}-{self.sha256[:12]}-py3-none-any.whl"

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
            "has no pyproject.toml), so it cannot build its runner wheel: set "
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
        """The wheel "wheel" mode uploads, of the pinned version."""
        wheel = Wheel.of(self.wheel) if self.wheel is not None else built_wheel()
        if wheel.version != self.pinned_version:
            raise ProviderError(
                f"the runner wheel {wheel.path.name} is version {wheel.version}, but this "
                f"control plane is {self.pinned_version}: build the wheel of this version"
            )
        return wheel


def prepare_in_background(install: RunnerInstall, *, setting: str) -> None:
    """At the control plane's start: build (or check) the "wheel" mode's wheel while it
    starts, so the first launch does not wait for it and a wheel that cannot be had is
    logged at once, saying what to set (``setting``: the provider's prefix). The launch
    raises the same error to the run if it is still so."""
    if install.mode != "wheel":
        return

    def prepare() -> None:
        try:
            wheel = install.the_wheel()
        except ProviderError as exc:
            log.warning("%sRUNNER_INSTALL=wheel: %s", setting, exc)
            return
        log.info("runner wheel %s (sha256 %s) ready to upload", wheel.path, wheel.sha256[:12])

    threading.Thread(target=prepare, name="trainbot-runner-wheel", daemon=True).start()


class WheelUploads:
    """The wheels a provider has put in buckets (a wheel is uploaded to a location once
    per process; the key is content-addressed, so one already there is kept)."""

    def __init__(self) -> None:
        self._done: set[str] = set()
        self._lock = threading.Lock()

    def ensure(self, wheel: Wheel, root: str, *, endpoint_url: str | None = None) -> str:
        """Put ``wheel`` under ``root`` (a checkpoint URI) unless it is there; its URI."""
        uri = f"{root.rstrip('/')}/{wheel.key}"
        with self._lock:
            if uri in self._done:
                return uri
            try:
                store = open_store(root, endpoint_url=endpoint_url, credentials="default")
                if not store.exists(wheel.key):
                    store.put_bytes(wheel.key, wheel.path.read_bytes())
            except (RunnerError, OSError) as exc:
                raise ProviderError(
                    f"could not put the runner wheel in {uri}: {exc}; the control plane "
                    "needs write access there, or set the provider's runner install to "
                    "index or image"
                ) from None
            self._done.add(uri)
        return uri


def boot_config(
    install: RunnerInstall,
    env: Mapping[str, str],
    *,
    run_id: str,
    scheme: str,
    setting: str,
    uploads: WheelUploads,
    endpoint_url: str | None = None,
    region: str = "",
) -> dict[str, Any]:
    """What the instance's installer is given (deploy/runner-install.py's CONFIG), with
    the wheel put in the run's bucket first in "wheel" mode. ``scheme``: the bucket
    scheme the instance can read ("s3", "gs"); ``setting``: the provider's settings
    prefix, for messages (``TRAINBOT_AWS_``); ``region``: the bucket's (for SigV4)."""
    version = install.pinned_version
    config: dict[str, Any] = {
        "mode": install.mode,
        "package": PACKAGE,
        "version": version,
        "index_url": install.index_url or "",
    }
    if install.mode != "wheel":
        return config
    root = env.get(contract.CHECKPOINT_URI.name, "")
    if not root.startswith(f"{scheme}://"):
        raise ProviderError(
            f"run {run_id}: the runner's wheel goes to the run's bucket, but its checkpoint "
            f"URI is {root or 'not set'}, not {scheme}://…: set checkpoint.uri to a "
            f"{scheme}:// location, or {setting}RUNNER_INSTALL=index (or image)"
        )
    wheel = install.the_wheel()
    uri = uploads.ensure(wheel, root, endpoint_url=endpoint_url)
    config["wheel"] = {
        "uri": uri,
        "sha256": wheel.sha256,
        "file": wheel.file_name,
        "region": region,
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

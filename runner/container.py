"""The spec's ``image``: the training command runs inside a container, the runner outside.

The supervisor stays on the instance and starts the runtime (docker on the cloud images,
podman on the local provider) in place of the command, so the notice pollers, the
checkpoint sync, the log shipping and the telemetry never depend on what the image
holds. The container gets:

- the paths the command works in, bind-mounted at the same paths, so every
  ``TRAINBOT_*`` path means the same inside: the code (or working) directory, the
  scratch disk, the synced checkpoint directory, a local checkpoint store, the
  supervisor's events and notice files;
- the command's environment by name (``-e NAME``: values, secrets among them, never on
  a command line), less what describes the host's own filesystem (``PATH``, ``HOME``,
  ``LD_LIBRARY_PATH`` …), which the image's own settings replace;
- the instance's GPUs when the spec asks for them (``--gpus all`` for docker, the CDI
  device ``nvidia.com/gpu=all`` for podman), its network and IPC namespace (the
  metadata server, the control plane, NCCL and DataLoader shared memory work as on
  the instance), and the runner's user id, so what it writes the runner may read;
- the runner library for the session API. An image that has trainbot installed uses
  its own; otherwise the runner's installed library and its light dependencies are
  mounted read-only at :data:`LIBRARY_DIR` and put on ``PYTHONPATH``, which works when
  the image's Python has the runner's version (their compiled parts must match);
  another Python is refused with what to install instead.

``--init`` makes a small init process the container's PID 1, so the SIGTERM the
supervisor sends the runtime (which proxies it) reaches the training process, whose exit
code (75 after a notice) is the runtime's own. A container left behind by a runtime that
was killed is removed by name when the supervisor ends.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as metadata
import importlib.util
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from runner import env as contract
from runner.errors import RunnerError

__all__ = [
    "LIBRARY_DIR",
    "RUNTIMES",
    "Container",
    "ContainerError",
    "ImageFacts",
    "check_image_ref",
    "library_paths",
    "remove_labelled",
    "run_paths",
]

log = logging.getLogger(__name__)

#: The runtimes an instance may have, and how each is given the instance's GPUs.
RUNTIMES: Mapping[str, tuple[str, ...]] = {
    "docker": ("--gpus", "all"),
    "podman": ("--device", "nvidia.com/gpu=all"),
}
#: Where the runner library is mounted in an image that has no trainbot of its own.
LIBRARY_DIR = "/opt/trainbot/lib"
#: The runner's base requirements, where its distribution's metadata cannot be read
#: (a checkout on ``PYTHONPATH``): pyproject.toml's ``dependencies``.
_BASE_REQUIREMENTS = ("boto3", "google-cloud-storage", "google-crc32c", "orjson", "msgspec")
#: Variables that describe the host's own filesystem and shell, not the run: the image's
#: settings (its PATH, its CUDA libraries) take their place inside.
_HOST_ONLY = frozenset(
    {
        "PATH", "HOME", "PWD", "OLDPWD", "SHLVL", "HOSTNAME", "USER", "LOGNAME", "SHELL",
        "TERM", "MAIL", "_", "LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "PYTHONHOME",
        "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV", "TMPDIR", "LS_COLORS", "DISPLAY",
        "CONTAINERS_CONF", "DOCKER_HOST", "DOCKER_CONFIG", "INVOCATION_ID",
        "JOURNAL_STREAM", "SYSTEMD_EXEC_PID", "MANPATH", "PS1",
    }
)  # fmt: skip
_HOST_ONLY_PREFIXES = ("XDG_", "SSH_", "CONDA_", "DBUS_", "PYTEST_", "VIRTUAL_ENV_")
#: A reference as docker and podman take it: [registry[:port]/]path[:tag][@digest].
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REGISTRY = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9-]+)*(?::[0-9]+)?/)"
_IMAGE_REF = re.compile(
    rf"{_REGISTRY}?{_COMPONENT}(?:/{_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    r"(?:@sha256:[a-f0-9]{64})?"
)
#: Seconds a missing image may take to pull (a CUDA image is gigabytes).
_PULL_TIMEOUT_S = 1800.0
_PROBE = (
    "import json, sys\n"
    "try:\n"
    "    from importlib.metadata import version\n"
    "    found = version('trainbot')\n"
    "except Exception:\n"
    "    found = None\n"
    "print(json.dumps({'python': '%d.%d' % sys.version_info[:2], 'trainbot': found}))\n"
)


class ContainerError(RunnerError):
    """The spec's image cannot run here; the message says what to do."""


def check_image_ref(text: str) -> str:
    """``text`` if docker and podman take it as an image reference, else ValueError with
    the grammar: the spec refuses a bad one before anything starts."""
    if not isinstance(text, str) or len(text) > 512 or not _IMAGE_REF.fullmatch(text):
        raise ValueError(
            f"{text!r} is not a container image reference: write [registry/]name[:tag] "
            "or name@sha256:<digest>, lower-case, e.g. nvcr.io/nvidia/pytorch:24.05-py3 or "
            "ghcr.io/team/train:1.2 (resources.image_id is the machine image, not this)"
        )
    return text


@dataclass(frozen=True)
class ImageFacts:
    """What the probe found in the image."""

    #: Its ``python``'s version, "3.11".
    python: str
    #: The trainbot version installed in it, or None: the runner library is mounted.
    trainbot: str | None


def _dist_top_levels(dist: metadata.Distribution) -> set[str]:
    text = dist.read_text("top_level.txt")
    if text:
        return {line.strip() for line in text.splitlines() if line.strip()}
    names: set[str] = set()
    for file in dist.files or ():
        first = file.parts[0] if file.parts else ""
        if not first or first.endswith((".dist-info", ".egg-info", ".data")) or first == "..":
            continue
        if first in ("__pycache__", "bin"):
            continue
        names.add(first.split(".", 1)[0] if len(file.parts) == 1 else first)
    return names


def _requirement_name(text: str) -> str | None:
    """The project in a ``Requires-Dist`` line, or None for one under an extra."""
    if "extra ==" in text:
        return None
    found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", text)
    return found[1] if found else None


def library_paths() -> dict[str, Path]:
    """What the training process imports from the runner's installation: the ``runner``
    package and everything its base install depends on (never the torch extra: the
    image brings its own torch), as name in :data:`LIBRARY_DIR` → path here."""
    try:
        todo = [n for r in metadata.requires("trainbot") or () if (n := _requirement_name(r))]
    except metadata.PackageNotFoundError:
        todo = list(_BASE_REQUIREMENTS)
    seen: set[str] = set()
    dists: list[metadata.Distribution] = []
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional platform dependency not installed here
        dists.append(dist)
        todo += [n for r in dist.requires or () if (n := _requirement_name(r))]
    paths: dict[str, Path] = {"runner": Path(__file__).resolve().parent}
    for dist in dists:
        for top in _dist_top_levels(dist):
            spec = importlib.util.find_spec(top) if top.isidentifier() else None
            if spec is None:
                continue
            if spec.submodule_search_locations:
                for location in spec.submodule_search_locations:
                    paths.setdefault(top, Path(location))  # a namespace's first part
            elif spec.origin:
                origin = Path(spec.origin)
                paths.setdefault(origin.name, origin)
            home = paths.get(top)
            if home is not None:
                libs = home.with_name(f"{top}.libs")  # auditwheel's bundled libraries
                if libs.is_dir():
                    paths.setdefault(libs.name, libs)
        info = getattr(dist, "_path", None)  # its metadata: importlib.metadata inside
        if isinstance(info, Path) and info.is_dir() and info.suffix == ".dist-info":
            paths.setdefault(info.name, info)
    return paths


@dataclass
class Container:
    """How the command runs in the spec's image on this instance."""

    image: str
    runtime: str = "docker"
    gpus: bool = False
    #: The container's name (for its pid and its removal); unique per start.
    name: str = field(default_factory=lambda: f"trainbot-{secrets.token_hex(6)}")
    #: The runtime's own environment (podman's CONTAINERS_CONF …).
    runtime_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    facts: ImageFacts | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Container | None:
        """The container ``TRAINBOT_IMAGE`` asks for, or None to run the command as is."""
        image = contract.IMAGE.get(environ)
        if not image:
            return None
        runtime = contract.CONTAINER_RUNTIME.get(environ)
        if runtime not in RUNTIMES:
            raise ContainerError(
                f"{contract.CONTAINER_RUNTIME.name}={runtime!r}: expected one of "
                f"{', '.join(RUNTIMES)}"
            )
        try:
            check_image_ref(image)
        except ValueError as exc:
            raise ContainerError(str(exc)) from None
        gpus = contract.CONTAINER_GPUS.get(environ)
        return cls(image, runtime=runtime, gpus=gpus, runtime_env=dict(environ))

    def _run(self, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [self.runtime, *args],
                env=dict(self.runtime_env),
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise ContainerError(
                f"{self.runtime} {args[0]} did not answer within {timeout:.0f} s: check "
                f"that the {self.runtime} service runs on this machine"
            ) from None
        except OSError as exc:
            raise ContainerError(f"cannot run {self.runtime}: {exc.strerror}") from None

    def check(self, *, pull: bool = True) -> ImageFacts:
        """That the runtime is here, the image is (pulled if ``pull``), its Python can run
        the runner library and the GPUs can be handed to it; else ContainerError."""
        if shutil.which(self.runtime, path=self.runtime_env.get("PATH")) is None:
            how = (
                "apt-get install podman (Debian, Ubuntu)"
                if self.runtime == "podman"
                else "use a machine image with docker (the default Deep Learning images "
                "have it) or install docker on it"
            )
            raise ContainerError(
                f"the spec's image {self.image} needs {self.runtime}, which is not "
                f"installed on this machine: {how}"
            )
        if self._run("image", "inspect", self.image, timeout=120).returncode != 0:
            self._pull(pull)
        if self.gpus and self.runtime == "podman":
            _check_cdi()
        probe = self._run(
            "run", "--rm", "--network", "none", "--entrypoint", "python", self.image,
            "-c", _PROBE, timeout=300,
        )  # fmt: skip
        try:
            found = json.loads(probe.stdout.strip().splitlines()[-1])
            facts = ImageFacts(python=str(found["python"]), trainbot=found["trainbot"])
        except (ValueError, IndexError, KeyError, TypeError):
            said = (probe.stderr or probe.stdout).strip().splitlines()[-1:] or ["nothing"]
            raise ContainerError(
                f"the image {self.image} cannot run `python` ({said[0][:300]}): training "
                "images need python on PATH; add it (or a python link) to the image"
            ) from None
        ours = f"{sys.version_info[0]}.{sys.version_info[1]}"
        if facts.trainbot is None and facts.python != ours:
            version = _own_version()
            raise ContainerError(
                f"the image {self.image} has Python {facts.python} and no trainbot; the "
                f"runner library on this machine is for Python {ours}: install trainbot "
                f"in the image (pip install 'trainbot=={version}'), or use an image with "
                f"Python {ours}"
            )
        self.facts = facts
        return facts

    def _pull(self, pull: bool) -> None:
        build = f"{self.runtime} build -t {self.image} ."
        if not pull:
            raise ContainerError(
                f"the image {self.image} is not in {self.runtime}'s storage on this "
                f"machine: {self.runtime} pull {self.image}, or build it ({build})"
            )
        got = self._run("pull", self.image, timeout=_PULL_TIMEOUT_S)
        if got.returncode != 0:
            said = (got.stderr or got.stdout).strip().splitlines()[-1:] or ["no answer"]
            raise ContainerError(
                f"the image {self.image} is not on this machine and {self.runtime} could "
                f"not pull it ({said[0][:300]}): check its name and tag, and that this "
                f"machine may read its registry ({self.runtime} login), or build it here "
                f"({build})"
            )

    def mounts(self, paths: Iterable[Path | None]) -> list[tuple[Path, str]]:
        """Host path → path inside, each mounted once: the same path for the run's own
        directories (a path under another is covered by it; one not made yet is made
        here, or what the command writes there would stay in the container), and the
        runner library when the image has no trainbot of its own."""
        chosen: list[Path] = []
        for path in sorted(
            {p.resolve() for p in paths if p is not None}, key=lambda p: (len(p.parts), str(p))
        ):
            if any(path == c or c in path.parents for c in chosen):
                continue
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ContainerError(
                    f"cannot make {path} to mount it into the container: {exc.strerror}"
                ) from None
            chosen.append(path)
        mounts = [(p, str(p)) for p in chosen]
        if self.facts is None or self.facts.trainbot is None:
            mounts += [(p, f"{LIBRARY_DIR}/{n}") for n, p in sorted(library_paths().items())]
        return mounts

    def command(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        paths: Iterable[Path | None],
    ) -> list[str]:
        """The runtime's command line that runs ``command`` in the image, in ``cwd``,
        with ``env`` passed by name (the runtime reads the values from its own
        environment, which must be ``env``)."""
        args = [
            self.runtime, "run", "--rm", "--init", "--name", self.name,
            "--network", "host", "--ipc", "host",
            "--user", f"{os.getuid()}:{os.getgid()}", "--workdir", str(cwd),
        ]  # fmt: skip
        # Whose container it is, for a person (and a test) listing them.
        args += ["--label", f"trainbot.run={contract.RUN_ID.get(env)}"]
        args += ["--label", f"trainbot.attempt={contract.ATTEMPT_ID.get(env)}"]
        instance = contract.INSTANCE_ID.get(env)
        if instance:  # the local provider's: it removes what a killed runner left
            args += ["--label", f"trainbot.instance={instance}"]
        if self.runtime == "docker":
            args += ["--sig-proxy=true"]
        else:
            args += ["--sig-proxy=true", "--pull", "never"]
        if self.gpus:
            args += list(RUNTIMES[self.runtime])
        for host, inside in self.mounts([cwd, *paths]):
            read_only = ":ro" if inside.startswith(LIBRARY_DIR) else ""
            args += ["--volume", f"{host}:{inside}{read_only}"]
        names = sorted(n for n in env if _passed(n))
        for name in names:
            args += ["--env", name]
        inside_env = {}
        if self.facts is None or self.facts.trainbot is None:
            inside_env["PYTHONPATH"] = LIBRARY_DIR
        if os.getuid() != 0:  # a user id with no home in the image: its cache goes here
            inside_env["HOME"] = str(cwd)
        for name, value in inside_env.items():
            args += ["--env", f"{name}={value}"]
        return [*args, self.image, *command]

    def host_pid(self) -> int | None:
        """The container's first process as this machine sees it (its open files tell
        the checkpoint sync what is still being written), or None."""
        got = self._run("inspect", "--format", "{{.State.Pid}}", self.name, timeout=30)
        with contextlib.suppress(ValueError):
            pid = int(got.stdout.strip() or 0)
            return pid or None
        return None

    def remove(self) -> None:
        """Remove the container if the runtime left it (the runtime itself was killed)."""
        with contextlib.suppress(ContainerError):
            self._run("rm", "--force", self.name, timeout=60)


def remove_labelled(runtime: str, label: str, *, env: Mapping[str, str] | None = None) -> int:
    """Remove every container labelled ``label`` (``trainbot.instance=…``), running or
    not: what a runner killed with SIGKILL left, whose runtime client died with it while
    the container ran on. How many there were; 0 where the runtime is missing."""
    container = Container("unused", runtime=runtime, runtime_env=dict(env or os.environ))
    if shutil.which(runtime, path=container.runtime_env.get("PATH")) is None:
        return 0
    try:
        found = container._run("ps", "--all", "--quiet", "--filter", f"label={label}", timeout=60)
        ids = found.stdout.split() if found.returncode == 0 else []
        if ids:
            container._run("rm", "--force", *ids, timeout=120)
    except ContainerError as exc:
        log.warning("could not remove the containers labelled %s: %s", label, exc)
        return 0
    return len(ids)


def run_paths(environ: Mapping[str, str], *more: Path | None) -> list[Path | None]:
    """The run's paths a command works with, to mount into its container: ``more``, the
    scratch disk, the synced checkpoint directory, the event spool, the stop file's
    folder, and a checkpoint store or data sample on this machine."""
    paths: list[Path | None] = [
        *more,
        contract.SCRATCH_DIR.get(environ),
        contract.CHECKPOINT_DIR.get(environ),
        contract.SPOOL_DIR.get(environ),
    ]
    stop = contract.STOP_FILE.get(environ)
    paths.append(stop.parent if stop is not None else None)
    for uri in (contract.CHECKPOINT_URI.get(environ), contract.DATA_URI.get(environ)):
        text = str(uri or "").removeprefix("file://")
        if text.startswith("/"):
            paths.append(Path(text))
    return paths


def _passed(name: str) -> bool:
    return name not in _HOST_ONLY and not name.startswith(_HOST_ONLY_PREFIXES)


def _own_version() -> str:
    try:
        return metadata.version("trainbot")
    except metadata.PackageNotFoundError:
        return "<the control plane's version>"


def _check_cdi() -> None:
    """podman hands GPUs over through CDI: the NVIDIA Container Toolkit's spec must exist."""
    for folder in (Path("/etc/cdi"), Path("/var/run/cdi")):
        for spec in sorted(folder.glob("*")) if folder.is_dir() else ():
            with contextlib.suppress(OSError):
                if "nvidia.com/gpu" in spec.read_text(errors="replace"):
                    return
    raise ContainerError(
        "the spec asks for GPUs in its image, and podman has no CDI spec for them: install "
        "the NVIDIA Container Toolkit and run `nvidia-ctk cdi generate --output="
        "/etc/cdi/nvidia.yaml`"
    )

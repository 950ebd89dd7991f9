"""The images in deploy/ build, serve /healthz, and the compose file runs two replicas on
one PostgreSQL.

Building takes minutes, so these run only when asked: ``make image-test`` (or
``TRAINBOT_TEST_CONTAINERS=1 pytest -m container``); ``.ci/run`` asks where it could
install podman. No registry is reachable from the CI machines, so the public bases
(python:3.12-slim, postgres:16) are replaced by a Debian base built here once with
debootstrap and kept in podman's storage (../shared/containers.md). Everything a test
starts is removed when it ends, whatever happens; the images stay, as a build cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import resource
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.paths import ROOT

# Building the images the first time takes longer than the suite's per-test limit.
pytestmark = [pytest.mark.container, pytest.mark.timeout(1800)]

ENABLE_ENV = "TRAINBOT_TEST_CONTAINERS"
BASE_IMAGE = "localhost/debian-python:bookworm"
APP_IMAGE = "localhost/trainbot:test"
POSTGRES_IMAGE = "localhost/trainbot-postgres:test"
RUNNER_IMAGE = "localhost/trainbot-runner:test-slim"
BASE_PACKAGES = "python3,python3-venv,python3-pip,python-is-python3,ca-certificates"
BUILD_TIMEOUT_S = 900


def _skip_reason() -> str | None:
    if os.environ.get(ENABLE_ENV) != "1":
        return f"container tests build images for minutes: set {ENABLE_ENV}=1 (make image-test)"
    if shutil.which("podman") is None:
        return "podman is not installed (Debian: apt-get install podman buildah runc)"
    if _compose_command() is None:
        return "podman-compose is not installed (pip install podman-compose)"
    return None


def _compose_command() -> list[str] | None:
    beside_python = Path(sys.executable).with_name("podman-compose")
    if beside_python.exists():
        return [str(beside_python)]
    found = shutil.which("podman-compose")
    return [found] if found else None


class Podman:
    """podman with this machine's settings: runc and capped limits, which crun and the
    defaults do not manage here (containers.md, step 2), in a file of our own."""

    def __init__(self, conf: Path) -> None:
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def run(
        self, *args: str, timeout: float = 120, check: bool = True, input: bytes | None = None
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["podman", *args],
            env=self.env,
            input=input.decode() if input is not None else None,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            pytest.fail(
                f"podman {' '.join(args)} exited {proc.returncode}:\n"
                f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            )
        return proc

    def image_exists(self, name: str) -> bool:
        return self.run("image", "exists", name, check=False).returncode == 0

    def build(self, tag: str, *, dockerfile: str, context: Path, **build_args: str) -> float:
        """Build, failing the test loudly (with the build's last lines) if it fails."""
        args = [f"--build-arg={k}={v}" for k, v in build_args.items()]
        started = time.monotonic()
        # --format docker keeps HEALTHCHECK, which the OCI format has no field for.
        self.run(
            "build", "--format", "docker", "--layers", "-f", dockerfile, "-t", tag,
            *args, str(context), timeout=BUILD_TIMEOUT_S,
        )  # fmt: skip
        return time.monotonic() - started


def _containers_conf() -> Path:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nofile = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trainbot"
    cache.mkdir(parents=True, exist_ok=True)
    conf = cache / "containers.conf"
    conf.write_text(
        "[containers]\n"
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc=32768:32768"]\n'
        "[engine]\n"
        'runtime = "runc"\n'
        'cgroup_manager = "cgroupfs"\n'
    )
    return conf


def _debian_mirror() -> str:
    """The mirror apt already uses here (deb822 .sources or a sources.list line)."""
    sources = Path("/etc/apt")
    for path in sorted(sources.glob("sources.list.d/*.sources")):
        for line in path.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    for path in [sources / "sources.list", *sorted(sources.glob("sources.list.d/*.list"))]:
        if path.exists():
            for line in path.read_text().splitlines():
                parts = line.split()
                if parts[:1] == ["deb"] and "security" not in line:
                    return next(p for p in parts[1:] if "://" in p)
    return "http://deb.debian.org/debian"


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[None]:
    """One build of ``name`` at a time on this machine: a test on another worker waits for
    it (then finds the image) instead of building its own copy."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trainbot"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build_base(podman: Podman) -> float:
    """debootstrap a Debian root with Python and import it (containers.md, steps 3-5)."""
    if shutil.which("debootstrap") is None:
        pytest.skip(f"{BASE_IMAGE} is missing and debootstrap is not installed to build it")
    if os.geteuid() != 0:
        pytest.skip(f"{BASE_IMAGE} is missing and debootstrap needs root to build it")
    with build_lock("base-image"):
        if podman.image_exists(BASE_IMAGE):  # another worker built it meanwhile
            return 0.0
        return _debootstrap_base(podman)


def _debootstrap_base(podman: Podman) -> float:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="trainbot-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        proc = subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}",
             "bookworm", str(rootfs), _debian_mirror()],
            capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
        )  # fmt: skip
        if proc.returncode != 0:
            pytest.fail(f"debootstrap failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        _import_rootfs(podman, rootfs)
    return time.monotonic() - started


def _import_rootfs(podman: Podman, rootfs: Path) -> None:
    # The build's HTTPS goes the host's way: trust the certificate authorities it does.
    extra_cas = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
    for ca in extra_cas:
        shutil.copy(ca, rootfs / "usr/local/share/ca-certificates" / ca.name)
    steps = ["update-ca-certificates"] if extra_cas else []
    for step in [*steps, "apt-get clean"]:
        subprocess.run(["chroot", str(rootfs), "sh", "-c", step], check=True, timeout=120)
    shutil.rmtree(rootfs / "var/lib/apt/lists", ignore_errors=True)
    (rootfs / "var/lib/apt/lists/partial").mkdir(parents=True)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    proc = subprocess.run(
        ["podman", "import", "--change", "ENV LANG=C.UTF-8",
         "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
         "-", BASE_IMAGE],
        stdin=tar.stdout, env=podman.env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert tar.stdout is not None
    tar.stdout.close()
    tar.wait()
    if proc.returncode != 0 or tar.returncode != 0:
        pytest.fail(f"podman import of the base failed:\n{proc.stderr[-3000:]}")


@pytest.fixture(scope="module")
def podman() -> Podman:
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return Podman(_containers_conf())


@pytest.fixture(scope="module")
def images(podman: Podman) -> dict[str, float]:
    """Build the base (once per machine), the control plane and PostgreSQL images; the
    seconds each took, printed for the record."""
    timings: dict[str, float] = {}
    if not podman.image_exists(BASE_IMAGE):
        timings["base (debootstrap + import)"] = _build_base(podman)
    timings["control plane image"] = podman.build(
        APP_IMAGE, dockerfile="deploy/Dockerfile", context=ROOT, BASE=BASE_IMAGE
    )
    timings["postgres image"] = podman.build(
        POSTGRES_IMAGE,
        dockerfile=str(ROOT / "deploy/postgres/Dockerfile"),
        context=ROOT / "deploy/postgres",
        BASE=BASE_IMAGE,
    )
    for what, seconds in timings.items():
        print(f"built {what} in {seconds:.0f} s")
    return timings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(
    url: str, *, timeout_s: float = 90, logs: Callable[[], str] = str
) -> dict[str, object]:
    """/healthz's JSON once it answers 200; on timeout, fails with ``logs()`` (why)."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=3) as reply:
                body = json.loads(reply.read())
                if reply.status == 200:
                    return dict(body)
                last = (reply.status, body)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            last = exc
        time.sleep(0.5)
    raise AssertionError(
        f"{url} did not answer 200 within {timeout_s:.0f} s: {last!r}\n{logs()[-4000:]}"
    )


def test_image_serves_healthz_as_non_root(podman: Podman, images: dict[str, float]) -> None:
    name = f"trainbot-test-{secrets.token_hex(4)}"
    port, admin = _free_port(), _free_port()
    started = time.monotonic()
    # The default console notifier and local provider: no Slack, no launchers needed.
    # The admin port listens on the container's network only when asked to.
    podman.run(
        "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8080",
        "-p", f"127.0.0.1:{admin}:9090", "-e", "TRAINBOT_ADMIN_HOST=0.0.0.0", APP_IMAGE,
    )  # fmt: skip
    try:
        body = _wait_healthy(
            f"http://127.0.0.1:{admin}/healthz",
            logs=lambda: podman.run("logs", name, check=False).stderr,
        )
        print(f"container answered /healthz {time.monotonic() - started:.1f} s after start")
        assert body == {"ok": True}
        ready = _wait_healthy(f"http://127.0.0.1:{admin}/readyz")
        assert ready["db"] == "ok"
        # psycopg2 built against Debian's libpq, not the -binary wheel.
        driver = podman.run(
            "exec", name, "python", "-c",
            "import importlib.metadata as m, psycopg2; print(psycopg2.__libpq_version__); "
            "print(sorted(d.metadata['Name'] for d in m.distributions() "
            "if d.metadata['Name'].startswith('psycopg')))",
        ).stdout.split("\n")  # fmt: skip
        assert int(driver[0]) >= 130000 and driver[1] == "['psycopg2']", driver
        # What cloud instances need from an installed control plane: its own wheel (which
        # it serves on /v1/runner-wheel), the boot scripts and the installer, no setting.
        shipped = podman.run(
            "exec", name, "python", "-c",
            "from jobs.providers.runner_install import INSTALLER_PATH, RunnerInstall; "
            "from jobs.providers.aws.launch import USER_DATA_TEMPLATE as a; "
            "from jobs.providers.gcp.launch import STARTUP_SCRIPT_PATH as g; "
            "print(RunnerInstall().the_wheel().path); "
            "print(all(p.is_file() for p in (INSTALLER_PATH, a, g)), INSTALLER_PATH)",
        ).stdout.split("\n")  # fmt: skip
        assert shipped[0].startswith("/opt/trainbot/share/trainbot/wheels/trainbot-"), shipped
        assert shipped[1] == "True /opt/trainbot/share/trainbot/deploy/runner-install.py"
        with pytest.raises(urllib.error.HTTPError) as public:  # not on the public port
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10)
        assert public.value.code == 404
        assert podman.run("exec", name, "id", "-u", "-n").stdout.strip() == "trainbot"
        assert podman.run("exec", name, "id", "-g", "-n").stdout.strip() == "trainbot"
        config = json.loads(podman.run("inspect", name).stdout)[0]["Config"]
        assert config["Healthcheck"]["Test"][0] in ("CMD", "CMD-SHELL")
        # The image's own HEALTHCHECK command, run once inside the container.
        health = podman.run("exec", name, *config["Healthcheck"]["Test"][1:], check=False)
        assert health.returncode == 0, health.stderr
        # SIGTERM stops it promptly and cleanly.
        stop = podman.run("stop", "-t", "20", name)
        assert stop.returncode == 0
        state = json.loads(podman.run("inspect", name).stdout)[0]["State"]
        assert state["ExitCode"] == 0, podman.run("logs", name, check=False).stderr[-2000:]
    finally:
        podman.run("rm", "-f", "-v", "-t", "0", name, check=False)


def test_runner_image_builds_without_torch(podman: Podman) -> None:
    if not podman.image_exists(BASE_IMAGE):
        pytest.skip(f"{BASE_IMAGE} is built by the image test first")
    seconds = podman.build(
        RUNNER_IMAGE,
        dockerfile="deploy/Dockerfile.runner",
        context=ROOT,
        BASE=BASE_IMAGE,
        EXTRAS="",
    )
    print(f"built runner image (no torch) in {seconds:.0f} s")
    proc = podman.run("run", "--rm", RUNNER_IMAGE, "--help")
    assert "exec" in proc.stdout
    # Its user, read from the container's log: an attached `podman run --rm` of a command
    # this short once returned 0 with no output at all (a fresh-clone run, under load).
    container = podman.run("run", "-d", "--entrypoint", "id", RUNNER_IMAGE, "-u").stdout.strip()
    try:
        assert podman.run("wait", container).stdout.strip() == "0"
        assert podman.run("logs", container).stdout.strip() == "10001"  # not root
    finally:
        podman.run("rm", "-f", container, check=False)


@pytest.fixture
def compose_project(
    podman: Podman, images: dict[str, float]
) -> Iterator[tuple[str, dict[str, str]]]:
    """``compose up`` under a project name of its own; yields (project, environment)."""
    project = f"trainbot-test-{secrets.token_hex(4)}"
    compose = _compose_command()
    assert compose is not None
    # The secrets as files (compose mounts the directory read-only in every container).
    secrets_dir = Path(tempfile.mkdtemp(prefix="trainbot-secrets-"))
    secrets_dir.chmod(0o755)
    for name, value in (
        ("database_password", secrets.token_urlsafe(16)),
        ("runner_token_secret", secrets.token_hex(32)),
    ):
        (secrets_dir / name).write_text(value + "\n")
        (secrets_dir / name).chmod(0o444)
    env = {
        **podman.env,
        "TRAINBOT_SECRETS_HOST_DIR": str(secrets_dir),
        "TRAINBOT_IMAGE": APP_IMAGE,
        "POSTGRES_IMAGE": POSTGRES_IMAGE,
        "TRAINBOT_BASE_IMAGE": BASE_IMAGE,
        "POSTGRES_BASE_IMAGE": BASE_IMAGE,
        "TRAINBOT_PORT_1": str(_free_port()),
        "TRAINBOT_PORT_2": str(_free_port()),
        "TRAINBOT_ADMIN_PORT_1": str(_free_port()),
        "TRAINBOT_ADMIN_PORT_2": str(_free_port()),
    }
    base = [*compose, "-p", project, "-f", str(ROOT / "deploy/compose.yaml")]

    def compose_run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *args], env=env, capture_output=True, text=True, timeout=300)

    try:
        up = compose_run("up", "-d")
        if up.returncode != 0:
            pytest.fail(f"compose up failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}")
        yield project, env
    finally:
        down = compose_run("down", "-v", "-t", "10")
        if down.returncode != 0:
            print(f"compose down: {down.stderr[-2000:]}")
        shutil.rmtree(secrets_dir, ignore_errors=True)
        # Whatever `down` left (a failed `up`, an interrupted test) goes too.
        label = f"label=io.podman.compose.project={project}"
        podman.run("pod", "rm", "-f", "-t", "0", f"pod_{project}", check=False)
        for kind, listing in (
            ("container", ["container", "ls", "-a", "-q", "--filter", label]),
            ("volume", ["volume", "ls", "-q", "--filter", label]),
            ("network", ["network", "ls", "-q", "--filter", label]),
        ):
            for ident in podman.run(*listing, check=False).stdout.split():
                podman.run(kind, "rm", "-f", *(["-v"] if kind == "container" else []), ident,
                           check=False)  # fmt: skip


def test_compose_runs_two_replicas_on_postgres(
    podman: Podman, compose_project: tuple[str, dict[str, str]]
) -> None:
    project, env = compose_project
    started = time.monotonic()
    label = f"label=io.podman.compose.project={project}"

    def logs() -> str:
        names = podman.run("ps", "-a", "--format", "{{.Names}}", "--filter", label).stdout
        return "\n".join(
            f"--- {n}\n{podman.run('logs', '--tail', '30', n, check=False).stderr}"
            for n in names.split()
        )

    # podman 4.3 cannot wait for PostgreSQL's healthcheck (compose's service_healthy):
    # a replica that started first exits and is restarted (restart: unless-stopped).
    for port in (env["TRAINBOT_ADMIN_PORT_1"], env["TRAINBOT_ADMIN_PORT_2"]):
        body = _wait_healthy(f"http://127.0.0.1:{port}/readyz", timeout_s=180, logs=logs)
        assert body["db"] == "ok"
    print(f"both replicas answered /healthz {time.monotonic() - started:.1f} s after up")
    names = podman.run("ps", "--format", "{{.Names}}", "--filter", label).stdout.split()
    replicas = [n for n in names if "trainbot-" in n.removeprefix(project)]
    postgres = next(n for n in names if "postgres" in n.removeprefix(project))
    assert len(replicas) == 2, names
    # Both replicas use the one PostgreSQL, and its schema is current: `trainbot migrate`
    # (the Kubernetes Job's command) has nothing left to do.
    for replica in replicas:
        url = podman.run("exec", replica, "sh", "-c", "echo $TRAINBOT_DATABASE_URL").stdout
        assert "@postgres:5432/trainbot" in url
    migrate = podman.run("exec", replicas[0], "trainbot", "migrate")
    assert "database at revision" in migrate.stdout
    revision = podman.run(
        "exec", postgres, "psql", "-U", "trainbot", "-d", "trainbot", "-tAc",
        "SELECT version_num FROM alembic_version",
    ).stdout.strip()  # fmt: skip
    assert revision and revision in migrate.stdout

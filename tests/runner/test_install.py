"""What an instance installs: ``pip install trainbot`` is the runner alone.

The slow tests build a fresh virtual environment, install this checkout with no extras
(its real dependencies, from the configured index), and use it the way an instance does:
``trainbot-runner dry-run`` trains the tiny example, checkpoints, is killed, restores and
verifies, and the control plane's libraries are not there at all.

Torch is made available without installing it: a ``.pth`` file in the new environment
points at a directory of links to torch, numpy and torch's own dependencies (read from
torch's metadata), taken from this environment. Installing it instead costs about 23 s and
940 MB even from the local CPU wheel that ``constraints.txt`` pins, and on a machine
without that wheel pip takes PyPI's default Linux wheel with gigabytes of CUDA libraries;
what is under test is trainbot's dependency set, not torch's. Nothing of trainbot's own
dependencies is linked (the fixture checks), so they come from the fresh install.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.paths import ROOT

#: The control plane's libraries (the ``server`` extra): none may be on an instance.
SERVER_MODULES = (
    "slack_bolt",
    "slack_sdk",
    "sqlmodel",
    "sqlalchemy",
    "alembic",
    "apscheduler",
    "matplotlib",
    "google.cloud.compute",
    "pydantic",
    "pydantic_settings",
    "yaml",
)


def _runner_modules() -> list[str]:
    """Every module of the runner package, from the source tree."""
    names = []
    for path in sorted((ROOT / "runner").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


_BLOCKER = """
import importlib.abc, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jobs", "bot") or any(
            name == b or name.startswith(b + ".") for b in BLOCKED
        ):
            raise ImportError(f"the runner imported {name}")
        return None

sys.meta_path.insert(0, Blocked())
"""


def _python(script: str) -> str:
    """What ``script`` printed, run by a fresh interpreter with this checkout on its path;
    it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_no_runner_module_imports_the_control_plane() -> None:
    """Each runner module, imported alone in a fresh interpreter, with ``jobs``, ``bot`` and
    the server extra's libraries made unimportable."""
    modules = _runner_modules()
    assert "runner.store.s3" in modules and "runner.cli" in modules
    script = (
        f"BLOCKED = {SERVER_MODULES!r}\n"
        + textwrap.dedent(_BLOCKER)
        + textwrap.dedent(
            f"""
            import importlib
            for name in {modules!r}:
                importlib.import_module(name)
            print("imported", len({modules!r}))
            """
        )
    )
    out = _python(script)
    assert out == f"imported {len(modules)}"


def test_a_local_store_imports_no_cloud_sdk(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        import runner.cli, runner.session
        from runner.store import open_store, run_store
        store = run_store({str(tmp_path)!r}, "r-1")
        store.put_bytes("a", b"1")
        assert open_store({str(tmp_path)!r}).exists("r-1/a")
        sdks = ("boto3", "botocore", "google")
        print(sorted(m for m in sys.modules if m.split(".")[0] in sdks))
        """
    )
    out = _python(script)
    assert out == "[]"


# -- a fresh environment with the base install ------------------------------------------


def _requirement_names(dist: importlib.metadata.Distribution) -> list[str]:
    """The distributions ``dist`` needs here (markers evaluated, extras not taken)."""
    from packaging.requirements import Requirement

    names = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(req.name)
    return names


def _link_torch(target: Path, *, skip: set[str]) -> None:
    """Links in ``target`` to torch, numpy and what torch needs, from this environment,
    except the distributions in ``skip``."""
    seen = set(skip)
    todo = ["torch", "numpy"]
    target.mkdir()
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        dist = importlib.metadata.distribution(name)
        todo.extend(_requirement_names(dist))
        site = Path(str(dist.locate_file("")))
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            if top in ("..", "bin", "__pycache__") or (target / top).exists():
                continue
            (target / top).symlink_to(site / top)


def _clean_env() -> dict[str, str]:
    """This environment without anything that would lead Python back to the checkout."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TRAINBOT_", "PYTHON", "VIRTUAL_ENV"))
    }
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(
    cmd: list[str], *, cwd: Path, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout
    )
    if check:
        assert proc.returncode == 0, f"{cmd}: {proc.stdout}\n{proc.stderr}"
    return proc


def _pip(bin_dir: Path) -> list[str]:
    """pip, acting on the environment whose ``bin`` is ``bin_dir``."""
    return [sys.executable, "-m", "pip", "--python", str(bin_dir / "python")]


def _site_packages(bin_dir: Path) -> str:
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    return _run([str(bin_dir / "python"), "-c", code], cwd=bin_dir).stdout.strip()


@pytest.fixture(scope="module")
def runner_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A new virtual environment holding ``pip install <checkout>`` and nothing else
    (torch aside); yields its ``bin`` directory."""
    tmp = tmp_path_factory.mktemp("install")
    # Build from a copy: building in the checkout would leave build/ and egg-info there.
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for package in ("runner", "jobs", "bot"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp / "dist"), str(src)],
        cwd=tmp,
    )  # fmt: skip
    (wheel,) = (tmp / "dist").glob("trainbot-*.whl")
    env_dir = tmp / "venv"
    # No pip of its own (ensurepip alone took 10 s): this environment's pip installs into
    # it through --python, from the same index, as the new environment's would.
    venv.EnvBuilder(with_pip=False).create(env_dir)
    bin_dir = env_dir / "bin"
    _run([*_pip(bin_dir), "install", "-q", str(wheel)], cwd=tmp, timeout=300)
    site = Path(_site_packages(bin_dir))
    listing = _run([*_pip(bin_dir), "list", "--format=json"], cwd=tmp)
    installed = {re.sub(r"[-_.]+", "-", p["name"]).lower() for p in json.loads(listing.stdout)}
    # What the install brought (typing-extensions, say) stays its own: never linked.
    _link_torch(tmp / "torch-only", skip=installed)
    (site / "torch-only.pth").write_text(f"{tmp / 'torch-only'}\n")
    yield bin_dir


@pytest.mark.slow
def test_the_base_install_is_the_runner_alone(runner_env: Path, tmp_path: Path) -> None:
    python = str(runner_env / "python")
    # What the install put in the environment itself (torch-only.pth's links aside).
    site = _site_packages(runner_env)
    installed = _run([*_pip(runner_env), "list", "--format=json", "--path", site], cwd=tmp_path)
    names = {p["name"].lower() for p in json.loads(installed.stdout)}
    assert {"trainbot", "boto3", "google-cloud-storage", "msgspec", "orjson"} <= names
    server = {"slack-bolt", "sqlmodel", "alembic", "apscheduler", "matplotlib",
              "google-cloud-compute", "pydantic", "pyyaml", "torch", "numpy"}  # fmt: skip
    assert names & server == set()
    probe = textwrap.dedent(
        f"""
        import importlib.util, json
        found = {{}}
        for name in {SERVER_MODULES!r}:
            try:
                found[name] = importlib.util.find_spec(name) is not None
            except ModuleNotFoundError:  # a parent package is missing
                found[name] = False
        print(json.dumps(found))
        """
    )
    out = _run([python, "-c", probe], cwd=tmp_path)
    assert json.loads(out.stdout) == dict.fromkeys(SERVER_MODULES, False)
    assert (runner_env / "trainbot-runner").exists()
    _run([str(runner_env / "trainbot-runner"), "--help"], cwd=tmp_path)


@pytest.mark.slow
def test_the_tiny_example_checkpoints_and_resumes_there(runner_env: Path, tmp_path: Path) -> None:
    """``trainbot-runner dry-run``: N steps, a checkpoint, kill -9, restart, restore, the
    state verified identical, two more steps, all from the installed package."""
    report = tmp_path / "report.json"
    proc = _run(
        [str(runner_env / "trainbot-runner"), "dry-run", "--steps", "3", "--mtbp", "10m",
         "--checkpoint-uri", str(tmp_path / "ck"), "--run-id", "r-install",
         "--report", str(report), "--",
         str(runner_env / "python"), "-m", "runner.examples.tiny", "--dim", "32", "--batch",
         "8", "--steps", "50"],
        cwd=tmp_path, timeout=180,
    )  # fmt: skip
    assert "dry run: PASSED" in proc.stdout
    figures = json.loads(report.read_text())
    assert figures["ok"] and figures["saved_sha256"] == figures["restored_sha256"]
    # The example ran from the new environment, not from the checkout.
    where = _run(
        [str(runner_env / "python"), "-c", "import runner, torch; print(runner.__file__)"],
        cwd=tmp_path,
    )  # fmt: skip
    assert str(runner_env.parent) in where.stdout


@pytest.mark.slow
def test_trainbot_without_the_server_extra_says_what_to_install(
    runner_env: Path, tmp_path: Path
) -> None:
    proc = _run([str(runner_env / "trainbot"), "shell"], cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "pip install 'trainbot[server]'" in proc.stderr
    assert "Traceback" not in proc.stderr

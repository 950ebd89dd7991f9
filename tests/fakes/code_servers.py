"""Loopback servers for a run's code and its packages: a git repository over git's dumb
HTTP protocol, and a PEP 503 simple index of wheels built in the test.

Both are a directory served by :mod:`http.server`: git's dumb protocol is plain files
once ``git update-server-info`` has written the ref lists, and a simple index is one
HTML page per project.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import subprocess
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from tests.fakes.loopback import QuietHandler, serving

__all__ = ["GitRepo", "build_wheel", "serve_directory", "write_simple_index"]


class _Quiet(QuietHandler, http.server.SimpleHTTPRequestHandler):
    pass


@contextmanager
def serve_directory(root: Path) -> Iterator[str]:
    """Serve ``root`` on a loopback port; yields its base URL."""
    with serving(functools.partial(_Quiet, directory=str(root))) as url:
        yield url


_GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
    "HOME": "/nonexistent",
    "GIT_CONFIG_NOSYSTEM": "1",
    "PATH": "/usr/local/bin:/usr/bin:/bin",
}


class GitRepo:
    """A work tree whose commits are pushed to a bare repository under a served root,
    ready for the dumb HTTP protocol (``URL/<name>.git``)."""

    def __init__(self, root: Path, name: str = "team") -> None:
        self.work = root / f"{name}-work"
        self.bare = root / "served" / f"{name}.git"
        self.served = root / "served"
        self.name = name
        self.work.mkdir(parents=True)
        self._git("init", "--quiet", "-b", "main", cwd=self.work)
        self.bare.parent.mkdir(parents=True, exist_ok=True)
        self._git("init", "--quiet", "--bare", str(self.bare), cwd=root)

    def _git(self, *args: str, cwd: Path) -> str:
        done = subprocess.run(
            ["git", *args], cwd=cwd, env=_GIT_ENV, capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    def commit(
        self, files: Mapping[str, str], *, message: str = "change", branch: str = "main"
    ) -> str:
        """Write ``files``, commit them to ``branch`` and publish it; returns the sha."""
        for rel, text in files.items():
            path = self.work / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        self._git("add", "-A", cwd=self.work)
        self._git("commit", "--quiet", "-m", message, cwd=self.work)
        self._git(
            "push", "--quiet", "--force", str(self.bare), f"HEAD:refs/heads/{branch}", cwd=self.work
        )
        self._git("update-server-info", cwd=self.bare)
        return self._git("rev-parse", "HEAD", cwd=self.work)

    def url(self, base: str) -> str:
        return f"{base}/{self.name}.git"


def build_wheel(dest: Path, name: str, version: str, module_source: str) -> Path:
    """A pure-Python wheel holding one module, ``name``."""
    dist = f"{name}-{version}"
    files = {
        f"{name}.py": module_source,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for rel, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{rel},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    path = dest / f"{dist}-py3-none-any.whl"
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as whl:
        for rel, text in files.items():
            whl.writestr(rel, text)
    return path


def write_simple_index(root: Path, wheels: list[Path]) -> None:
    """``root/simple/<project>/index.html`` for each wheel (PEP 503), served as
    ``URL/simple/``."""
    projects: dict[str, list[Path]] = {}
    for wheel in wheels:
        projects.setdefault(wheel.name.split("-")[0].lower().replace("_", "-"), []).append(wheel)
    simple = root / "simple"
    for project, found in projects.items():
        folder = simple / project
        folder.mkdir(parents=True, exist_ok=True)
        links = []
        for wheel in found:
            target = folder / wheel.name
            target.write_bytes(wheel.read_bytes())
            sha = hashlib.sha256(target.read_bytes()).hexdigest()
            links.append(f'<a href="{wheel.name}#sha256={sha}">{wheel.name}</a>')
        (folder / "index.html").write_text("<html><body>" + "".join(links) + "</body></html>")
    (simple / "index.html").write_text(
        "<html><body>" + "".join(f'<a href="{p}/">{p}</a>' for p in projects) + "</body></html>"
    )

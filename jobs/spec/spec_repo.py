"""A spec repository: a bare clone under the state directory, fetched in place at each
launch, its files read at the fetched commit (no work tree).

Every git command runs in its own process group, killed at the source's timeout, so a
host that never answers costs a bounded wait; git never prompts (no terminal, no askpass).
Within :func:`one_fetch_per_repository` (one command) a repository is fetched once.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from jobs.domain.errors import SpecError, clip
from jobs.spec.strict_yaml import MAX_SPEC_FILE_CHARS

__all__ = [
    "SPEC_NAME",
    "SPEC_SUFFIXES",
    "SpecRepo",
    "one_fetch_per_repository",
    "without_credentials",
]

#: A spec's name: its file's name without the suffix.
SPEC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SPEC_SUFFIXES = (".yaml", ".yml")
#: Bytes of a spec file read at most (UTF-8 holds a character in at most 4).
MAX_SPEC_BYTES = MAX_SPEC_FILE_CHARS * 4
#: Within :func:`one_fetch_per_repository`: each repository's commit, once fetched.
_FETCHED: ContextVar[dict[Path, str] | None] = ContextVar("spec_fetches", default=None)
_FETCH_LOCKS: dict[Path, threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def without_credentials(url: str) -> str:
    """``url`` without the user and password it may hold, for messages and records."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


@dataclass(frozen=True)
class SpecRepo:
    """One git spec source's repository, as the control plane keeps and reads it."""

    #: The source's label (named in errors).
    label: str
    url: str
    branch: str
    #: The folder holding the specs; "" for the root.
    subdir: str
    #: Where the bare clones live (under the state directory).
    cache_dir: Path
    #: Seconds any one git command may take.
    timeout_s: float

    @property
    def repo(self) -> Path:
        digest = hashlib.sha256(self.url.encode()).hexdigest()[:12]
        return self.cache_dir / f"{self.label}-{digest}.git"

    def fetch(self) -> str:
        """Fetch the branch; its commit now. Raises SpecError when the repository cannot
        be reached in time or has no such branch."""
        fetched = _FETCHED.get()
        if fetched is not None and self.repo in fetched:
            return fetched[self.repo]
        commit = self._fetch()
        if fetched is not None:
            fetched[self.repo] = commit
        return commit

    def _fetch(self) -> str:
        with _lock_for(self.repo):
            if not (self.repo / "HEAD").is_file():
                self.repo.mkdir(parents=True, exist_ok=True)
                self._run("init", "--quiet", "--bare", str(self.repo), cwd=self.repo.parent)
            ref = f"refs/trainbot/{self.branch}"
            self._run(
                "fetch",
                "--quiet",
                "--no-tags",
                "--force",
                "--",
                self.url,
                f"+refs/heads/{self.branch}:{ref}",
                what="fetch",
            )
            return self._run("rev-parse", "--verify", f"{ref}^{{commit}}").strip()

    def cached(self) -> str | None:
        """The commit the last fetch found, without asking the repository; None before one."""
        if not (self.repo / "HEAD").is_file():
            return None
        try:
            return self._run(
                "rev-parse", "--verify", f"refs/trainbot/{self.branch}^{{commit}}"
            ).strip()
        except SpecError:
            return None

    def names(self, commit: str) -> dict[str, str]:
        """Spec names at ``commit`` → the file's path in the repository."""
        tree = f"{commit}:{self.subdir}" if self.subdir else commit
        try:
            listing = self._run("ls-tree", "-z", tree)
        except SpecError:
            raise SpecError(
                f"the spec repository {self.label} has no folder "
                f"{self.subdir!r} on {self.branch}: fix path= in "
                "TRAINBOT_SPEC_SOURCES, or add the folder"
            ) from None
        found: dict[str, str] = {}
        for entry in listing.split("\0"):
            meta, _, name = entry.partition("\t")
            if not name or meta.split(" ")[1:2] != ["blob"]:
                continue
            stem, suffix = os.path.splitext(name)
            if suffix in SPEC_SUFFIXES and SPEC_NAME.fullmatch(stem):
                found.setdefault(stem, f"{self.subdir}/{name}".lstrip("/"))
        return found

    def read(self, commit: str, path: str) -> str:
        size = int(self._run("cat-file", "-s", f"{commit}:{path}").strip() or 0)
        if size > MAX_SPEC_BYTES:
            raise SpecError(
                f"{path} in {self.label} is too big ({size:,} bytes, the most is "
                f"{MAX_SPEC_FILE_CHARS:,} characters): a spec describes a run"
            )
        data = self._run_bytes("cat-file", "blob", f"{commit}:{path}")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise SpecError(f"{path} in {self.label} is not UTF-8 text: save it as UTF-8") from None

    def read_many(self, commit: str, paths: Sequence[str]) -> dict[str, str | SpecError]:
        """Several files at ``commit`` in two git commands (their sizes, then the ones
        within the bound), for a listing: each path's text, or why it cannot be read."""
        wanted = "".join(f"{commit}:{path}\n" for path in paths).encode()
        checks = self._run("cat-file", "--batch-check", stdin=wanted).splitlines()
        found: dict[str, str | SpecError] = {}
        small: list[str] = []
        for path, check in zip(paths, checks, strict=False):
            parts = check.split()
            if len(parts) != 3 or parts[1] != "blob":
                found[path] = SpecError(f"{path} in {self.label} cannot be read")
            elif int(parts[2]) > MAX_SPEC_BYTES:
                found[path] = SpecError(f"{path} in {self.label} is too big ({parts[2]} bytes)")
            else:
                small.append(path)
        batch = self._run_bytes(
            "cat-file", "--batch", stdin="".join(f"{commit}:{p}\n" for p in small).encode()
        )
        at = 0
        for path in small:
            eol = batch.index(b"\n", at)
            size = int(batch[at:eol].split()[2])
            data = batch[eol + 1 : eol + 1 + size]
            at = eol + 1 + size + 1
            try:
                found[path] = data.decode("utf-8")
            except UnicodeDecodeError:
                found[path] = SpecError(f"{path} in {self.label} is not UTF-8 text")
        return found

    def _run(
        self, *args: str, cwd: Path | None = None, what: str = "read", stdin: bytes | None = None
    ) -> str:
        return self._run_bytes(*args, cwd=cwd, what=what, stdin=stdin).decode("utf-8", "replace")

    def _run_bytes(
        self, *args: str, cwd: Path | None = None, what: str = "read", stdin: bytes | None = None
    ) -> bytes:
        command = ["git", "-c", "credential.interactive=false"]
        if cwd is None:
            command += ["--git-dir", str(self.repo)]
        env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "/bin/false"}
        where = without_credentials(self.url)
        # Its own process group, so a timeout ends git's transport helpers too.
        try:
            process = subprocess.Popen(
                [*command, *args],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except FileNotFoundError:
            raise SpecError(
                f"the spec repository {self.label} cannot be read: git is not "
                "installed on the control plane (install it, or list directories only "
                "in TRAINBOT_SPEC_SOURCES)"
            ) from None
        try:
            out, err = process.communicate(input=stdin, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise SpecError(
                f"the spec repository {self.label} ({where}) did not answer within "
                f"{self.timeout_s:g} s: check that it is reachable from the control plane, "
                "or raise TRAINBOT_SPEC_GIT_TIMEOUT_S"
            ) from None
        if process.returncode != 0:
            lines = [ln for ln in err.decode("utf-8", "replace").splitlines() if ln.strip()]
            said = (
                clip(lines[-1].replace(self.url, where), limit=300) if lines else "no reason given"
            )
            if what == "fetch":
                raise SpecError(
                    f"the spec repository {self.label} ({where}) could not be fetched "
                    f"({said}): check the URL and the branch {self.branch!r} in "
                    "TRAINBOT_SPEC_SOURCES, and that the control plane may read it"
                )
            raise SpecError(f"the spec repository {self.label} could not be read ({said})")
        return out


@contextmanager
def one_fetch_per_repository() -> Iterator[None]:
    """Within it, each repository is fetched once and its commit reused: one command reads
    the same spec when it is authorised (where the run reports) and when it is launched,
    however the branch moves in between."""
    token = _FETCHED.set({})
    try:
        yield
    finally:
        _FETCHED.reset(token)


def _lock_for(repo: Path) -> threading.Lock:
    with _LOCKS_LOCK:
        return _FETCH_LOCKS.setdefault(repo, threading.Lock())

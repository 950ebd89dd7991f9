"""The run's code on the instance: a git commit checked out, or a packed archive unpacked.

A spec names its code as a git repository and ref, which the control plane resolves to
one commit at submit (:func:`resolve_ref`), so every attempt and every node runs the
same commit; or as an archive in the object store that ``trainbot-runner pack`` made
(:func:`pack`): a tar.gz whose name holds the sha256 of its bytes, so it is verified
when fetched and two packs of the same directory are the same object.

Private repositories are reached over ssh with an admin's deploy key
(``TRAINBOT_GIT_SSH_KEY_FILE``), passed to git by ``GIT_SSH_COMMAND``; git never asks
for a password (``GIT_TERMINAL_PROMPT=0``). Standard library only, besides the store.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit, urlunsplit

from runner import env as contract
from runner.errors import RunnerError

__all__ = [
    "ARCHIVE_NAME",
    "DEFAULT_DEPLOY_KEY",
    "DEFAULT_EXCLUDES",
    "CodeError",
    "Resolved",
    "archive_digest",
    "checkout",
    "fetch_archive",
    "git_env",
    "pack",
    "pack_bytes",
    "prepare_code",
    "resolve_ref",
    "shown_repo",
]

#: A packed archive's name: its sha256, so the name says what the bytes must hash to.
ARCHIVE_NAME = re.compile(r"code-([0-9a-f]{64})\.tar\.gz")
#: Never packed: version control, environments, caches. A ``.trainbotignore`` in the
#: directory adds patterns of its own (one per line, ``#`` comments, gitignore-like).
DEFAULT_EXCLUDES = (".git", ".venv", "venv", "__pycache__", "*.pyc", ".mypy_cache", ".DS_Store")
IGNORE_FILE = ".trainbotignore"
#: The deploy key a runner uses when TRAINBOT_GIT_SSH_KEY_FILE is unset: where an admin's
#: machine image (or its boot) puts the key of the team's private repositories.
DEFAULT_DEPLOY_KEY = Path("/etc/trainbot/git-deploy-key")
_SHA = re.compile(r"[0-9a-f]{40}")
#: Seconds a git command may take to answer (ls-remote at submit, a fetch on the instance).
_GIT_TIMEOUT_S = 60.0
_FETCH_TIMEOUT_S = 900.0


class CodeError(RunnerError):
    """The code could not be resolved, fetched or packed; the message says what to fix."""


def shown_repo(repo: str) -> str:
    """A repository URL fit for a message: any user and password in it removed."""
    parts = urlsplit(repo)
    if parts.scheme and "@" in parts.netloc:
        host = parts.netloc.rsplit("@", 1)[1]
        return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    return repo


def git_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment git runs with: never a prompt; the deploy key, where an admin set
    one, for ssh."""
    env = dict(os.environ if environ is None else environ)
    env["GIT_TERMINAL_PROMPT"] = "0"
    env.setdefault("GIT_ASKPASS", "true")
    key = contract.GIT_SSH_KEY_FILE.get(env)
    if key is None and DEFAULT_DEPLOY_KEY.is_file():
        key = DEFAULT_DEPLOY_KEY  # where an admin's machine image puts it
    if key is not None:
        env["GIT_SSH_COMMAND"] = (
            f"ssh -i {shlex.quote(str(key))} -o IdentitiesOnly=yes -o BatchMode=yes "
            "-o StrictHostKeyChecking=accept-new"
        )
    return env


def _git(
    args: list[str], *, cwd: Path | None = None, env: Mapping[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    if shutil.which("git") is None:
        raise CodeError("git is not installed here: install it (apt-get install git)")
    try:
        return subprocess.run(
            ["git", *args],
            cwd=cwd,
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise CodeError(f"git {args[0]} took longer than {timeout:.0f} s") from None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no message"


@dataclass(frozen=True)
class Resolved:
    """A ref resolved to its commit."""

    commit: str
    #: What the ref turned out to be: ``refs/heads/main``, ``refs/tags/v1``, or the sha.
    ref: str


def resolve_ref(repo: str, ref: str, *, environ: Mapping[str, str] | None = None) -> Resolved:
    """The commit ``ref`` (a branch, a tag or a full sha) names in ``repo`` now, asked with
    ``git ls-remote``. Raises :class:`CodeError` saying what is wrong: the repository
    cannot be reached (or read), or it has no such ref."""
    env = git_env(environ)
    shown = shown_repo(repo)
    done = _git(["ls-remote", "--", repo], env=env, timeout=_GIT_TIMEOUT_S)
    if done.returncode != 0:
        raise CodeError(
            f"cannot read the code repository {shown}: {_last_line(done.stderr)}. Check "
            "code.repo; a private repository needs the deploy key an admin sets "
            "(TRAINBOT_GIT_SSH_KEY_FILE) and an ssh URL (git@host:org/repo.git)"
        )
    refs: dict[str, str] = {}
    for line in done.stdout.splitlines():
        sha, _, name = line.partition("\t")
        if _SHA.fullmatch(sha) and name:
            refs[name] = sha
    wanted = ref.strip()
    if _SHA.fullmatch(wanted.lower()):
        return Resolved(commit=wanted.lower(), ref=wanted.lower())
    for name in (wanted, f"refs/heads/{wanted}", f"refs/tags/{wanted}"):
        # An annotated tag's commit is its peeled entry.
        found = refs.get(f"{name}^{{}}") or refs.get(name)
        if found is not None:
            return Resolved(commit=found, ref=name)
    heads = sorted(n.removeprefix("refs/heads/") for n in refs if n.startswith("refs/heads/"))
    tags = sorted(
        n.removeprefix("refs/tags/")
        for n in refs
        if n.startswith("refs/tags/") and not n.endswith("^{}")
    )
    known = f"branches: {', '.join(heads[:10]) or 'none'}; tags: {', '.join(tags[:10]) or 'none'}"
    short = (
        " (a short sha is not enough: give all 40 characters)"
        if re.fullmatch(r"[0-9a-fA-F]{4,39}", wanted)
        else ""
    )
    raise CodeError(
        f"code.ref {wanted[:100]!r} is not a branch, tag or commit of {shown}{short} "
        f"({known}): push it, or fix code.ref"
    )


def checkout(
    repo: str, commit: str, dest: Path, *, environ: Mapping[str, str] | None = None
) -> str:
    """Check ``commit`` of ``repo`` out into ``dest`` (created, or reused when it already
    holds that commit); returns the commit. Only the commit is fetched where the server
    allows it; otherwise its branches and tags are, and the commit is found among them."""
    env = git_env(environ)
    shown = shown_repo(repo)
    if (dest / ".git").is_dir():
        head = _git(["rev-parse", "HEAD"], cwd=dest, env=env, timeout=_GIT_TIMEOUT_S)
        if head.returncode == 0 and head.stdout.strip() == commit:
            return commit
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for args in (
        ["init", "--quiet"],
        ["remote", "add", "origin", repo],
    ):
        done = _git(args, cwd=dest, env=env, timeout=_GIT_TIMEOUT_S)
        if done.returncode != 0:
            raise CodeError(f"git {args[0]} in {dest} failed: {_last_line(done.stderr)}")
    one = _git(
        ["fetch", "--quiet", "--depth", "1", "origin", commit],
        cwd=dest,
        env=env,
        timeout=_FETCH_TIMEOUT_S,
    )
    if one.returncode != 0:
        every = _git(
            [
                "fetch",
                "--quiet",
                "origin",
                "+refs/heads/*:refs/remotes/origin/*",
                "+refs/tags/*:refs/tags/*",
            ],
            cwd=dest,
            env=env,
            timeout=_FETCH_TIMEOUT_S,
        )
        if every.returncode != 0:
            raise CodeError(f"cannot fetch {shown}: {_last_line(every.stderr)}")
    done = _git(
        ["checkout", "--quiet", "--detach", commit], cwd=dest, env=env, timeout=_GIT_TIMEOUT_S
    )
    if done.returncode != 0:
        raise CodeError(
            f"commit {commit[:12]} of {shown} cannot be checked out: {_last_line(done.stderr)} "
            "(was the branch force-pushed past it? resubmit with code.ref=… to move the run)"
        )
    return commit


# --- archives ---------------------------------------------------------------------------


def _split_uri(uri: str) -> tuple[str, str]:
    """(the folder an object is in, its name)."""
    text = uri.rstrip()
    folder, _, name = text.rpartition("/")
    if not folder or not name:
        raise CodeError(
            f"{uri[:200]!r} does not name an object: write s3://BUCKET/PATH/code-….tar.gz"
        )
    return folder, name


def archive_digest(uri: str) -> str | None:
    """The sha256 an archive's name promises (a ``trainbot-runner pack`` name), or None."""
    found = ARCHIVE_NAME.fullmatch(_split_uri(uri)[1])
    return found.group(1) if found else None


def fetch_archive(uri: str, dest: Path) -> str:
    """Unpack the archive at ``uri`` into ``dest`` (emptied first); returns its sha256,
    checked against the one in its name.

    It is read with the instance's own identity, as the training script reads its data:
    the checkpoint store's brokered credentials (``TRAINBOT_STORE_CREDENTIALS=broker``)
    reach the run's own prefix only, and the archive lives outside it."""
    from runner.store import open_store

    folder, name = _split_uri(uri)
    store = open_store(folder, credentials="default")
    digest = hashlib.sha256()
    with tempfile.TemporaryFile() as tmp:
        with store.open_read(name) as stream:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
                tmp.write(chunk)
        expected = archive_digest(uri)
        if expected is not None and digest.hexdigest() != expected:
            raise CodeError(
                f"the code archive {uri} is corrupt: its sha256 is {digest.hexdigest()[:16]}…, "
                f"its name says {expected[:16]}…; pack the directory again"
            )
        tmp.seek(0)
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        with tarfile.open(fileobj=tmp, mode="r:gz") as tar:
            tar.extractall(dest, filter="data")
    return digest.hexdigest()


def _ignored(rel: PurePosixPath, patterns: list[str]) -> bool:
    for pattern in patterns:
        anchored = pattern.startswith("/")
        body = pattern.strip("/")
        if anchored:
            if fnmatch.fnmatch(str(rel), body):
                return True
        elif any(fnmatch.fnmatch(part, body) for part in rel.parts) or fnmatch.fnmatch(
            str(rel), body
        ):
            return True
    return False


def _patterns(root: Path) -> list[str]:
    found = list(DEFAULT_EXCLUDES)
    ignore = root / IGNORE_FILE
    if ignore.is_file():
        for line in ignore.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                found.append(line)
    return found


def _walk(root: Path, patterns: list[str]) -> Iterator[tuple[PurePosixPath, Path]]:
    """Every file, link and folder under ``root`` not excluded, in a fixed order."""
    stack = [root]
    while stack:
        folder = stack.pop()
        for entry in sorted(folder.iterdir(), key=lambda p: p.name, reverse=True):
            rel = PurePosixPath(entry.relative_to(root).as_posix())
            if _ignored(rel, patterns):
                continue
            yield rel, entry
            if entry.is_dir() and not entry.is_symlink():
                stack.append(entry)


def pack_bytes(root: Path) -> bytes:
    """``root`` as a deterministic tar.gz: sorted entries, no owners, fixed times and
    modes, so the same files always make the same bytes."""
    if not root.is_dir():
        raise CodeError(f"{root} is not a directory: give the folder that holds your code")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        entries = sorted(_walk(root, _patterns(root)), key=lambda e: str(e[0]))
        for rel, path in entries:
            info = tar.gettarinfo(str(path), arcname=str(rel))
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.pax_headers = {}
            if info.isdir():
                info.mode = 0o755
                tar.addfile(info)
            elif info.isfile():
                info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            elif info.issym():
                info.mode = 0o777
                tar.addfile(info)
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=6) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


def pack(root: Path, store_uri: str) -> str:
    """Pack ``root`` and upload it to ``store_uri`` as ``code-<sha256>.tar.gz``, unless
    it is there already; returns the archive's URI."""
    from runner.store import open_store

    blob = pack_bytes(root)
    name = f"code-{hashlib.sha256(blob).hexdigest()}.tar.gz"
    store = open_store(store_uri)
    if not store.exists(name):
        store.put_bytes(name, blob)
    return f"{store.uri.rstrip('/')}/{name}"


def prepare_code(environ: Mapping[str, str], dest: Path) -> str | None:
    """Put the run's code in ``dest``, as the control plane named it: the pinned commit
    of its repository, or its archive. Returns what was put there (a commit, an archive's
    sha256), or None when the run names no code."""
    repo = contract.CODE_REPO.get(environ)
    archive = contract.CODE_ARCHIVE.get(environ)
    if repo:
        commit = contract.CODE_COMMIT.get(environ)
        if commit is None:
            raise CodeError(
                "TRAINBOT_CODE_REPO is set without TRAINBOT_CODE_COMMIT: the control plane "
                "pins the commit at submit"
            )
        return checkout(repo, commit, dest, environ=environ)
    if archive:
        return fetch_archive(archive, dest)
    return None

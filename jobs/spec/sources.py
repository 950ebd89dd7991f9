"""The places specs are read from: directories and git repositories an admin sets.

``TRAINBOT_SPEC_SOURCES`` lists them, in order, separated by commas; each is
``[label=]location``:

- a directory: an absolute path (``/etc/trainbot/specs``, a ConfigMap mounted in the pod);
- a git repository: ``git+URL[#branch=B&path=P]`` (default branch ``main``, path the
  repository's root), fetched again at every launch by name, so a change pushed to the
  branch is what the next launch uses, and the commit is recorded on the run.

The label (default: the directory's or repository's last name) names the source in
``/train specs`` and in qualified names. A name is looked up in the sources in order and
the first source that has it wins; ``label/name`` picks one source's spec whatever the
others hold. Unset, the one source is ``TRAINBOT_SPECS_DIR``.

A repository is kept as a bare clone under the state directory and fetched (never cloned
again), within ``TRAINBOT_SPEC_GIT_TIMEOUT_S``; files are read from the fetched commit
with ``git cat-file``, so there is no work tree to go stale.
"""

from __future__ import annotations

import difflib
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Literal
from urllib.parse import parse_qs, urlsplit

from jobs.domain.errors import SpecError, clip
from jobs.spec.load import parse_spec, spec_mapping
from jobs.spec.model import JobSpec
from jobs.spec.origin import SpecOrigin
from jobs.spec.spec_repo import SPEC_NAME as _NAME
from jobs.spec.spec_repo import SPEC_SUFFIXES as _SUFFIXES
from jobs.spec.spec_repo import SpecRepo, one_fetch_per_repository
from jobs.spec.spec_repo import without_credentials as _without_credentials

if TYPE_CHECKING:
    from jobs.process.settings import Settings

__all__ = [
    "Catalog",
    "FoundSpec",
    "Listed",
    "SourceProblem",
    "SpecSource",
    "catalog",
    "catalog_for",
    "configured",
    "find_spec",
    "load_named_spec",
    "load_spec_for",
    "names_for",
    "one_fetch_per_repository",
    "parse_sources",
]

_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_BRANCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")
#: Specs listed from one source, at most; the rest are counted.
MAX_PER_SOURCE = 200
#: Characters of a description kept in a listing.
MAX_DESCRIPTION = 200


@dataclass(frozen=True)
class SpecSource:
    """One place specs are read from."""

    #: What people see and qualify names with (``team/gpt``).
    label: str
    kind: Literal["directory", "git"]
    #: The directory (``directory``).
    directory: Path | None = None
    #: The repository's URL (``git``), as given (never shown with its credentials).
    url: str | None = None
    #: The branch fetched (``git``).
    branch: str = "main"
    #: The folder within the repository that holds the specs; "" for its root.
    subdir: str = ""

    def where(self) -> str:
        """The source for people: the directory, or the repository without credentials."""
        if self.kind == "directory":
            return str(self.directory)
        return f"{_without_credentials(self.url or '')} ({self.branch})"


@dataclass(frozen=True)
class FoundSpec:
    """A spec file found by name: its text and where it came from."""

    name: str
    text: str
    origin: SpecOrigin


@dataclass(frozen=True)
class Listed:
    """One launchable spec, for ``/train specs``."""

    #: The name to launch it by: bare when this source is the first to have it,
    #: otherwise ``label/name``.
    name: str
    description: str
    #: ``directory /etc/specs`` or ``team@1a2b3c4``.
    where: str


@dataclass(frozen=True)
class SourceProblem:
    """A source that could not be read while listing: named, with what to do."""

    label: str
    problem: str


@dataclass
class Catalog:
    """What ``/train specs`` shows."""

    specs: list[Listed] = field(default_factory=list)
    problems: list[SourceProblem] = field(default_factory=list)
    #: Specs not listed because a source held more than :data:`MAX_PER_SOURCE`.
    more: int = 0


# ----------------------------------------------------------------------------- settings


def parse_sources(entries: Sequence[str]) -> tuple[SpecSource, ...]:
    """The sources of ``TRAINBOT_SPEC_SOURCES``; ValueError says what is wrong and how
    to write it (the settings turn it into their error)."""
    sources = tuple(_parse_one(entry.strip()) for entry in entries if entry.strip())
    labels = [s.label for s in sources]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise ValueError(
            f"the label {twice[0]!r} names two sources: give each its own label (label=location)"
        )
    return sources


_GRAMMAR = (
    "write each source as [label=]/absolute/directory or "
    "[label=]git+https://host/repo.git#branch=main&path=specs"
)


def _parse_one(entry: str) -> SpecSource:
    label = ""
    location = entry
    if not entry.startswith(("/", "git+", "~")) and "=" in entry:
        label, _, location = entry.partition("=")
        label, location = label.strip(), location.strip()
        if not _LABEL.fullmatch(label):
            raise ValueError(
                f"{clip(label)!s} is not a source label: use letters, digits, '.', '_' "
                f"and '-' ({_GRAMMAR})"
            )
    if location.startswith("git+"):
        return _git_source(label, location[len("git+") :])
    path = Path(location).expanduser()
    if not path.is_absolute():
        raise ValueError(
            f"{clip(location)} is neither an absolute directory nor git+URL: {_GRAMMAR}"
        )
    label = label or _label_from(path.name)
    return SpecSource(label=label, kind="directory", directory=path)


def _git_source(label: str, text: str) -> SpecSource:
    url, _, fragment = text.partition("#")
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http", "ssh", "file") or not (parts.netloc or parts.path):
        raise ValueError(
            f"{clip(_without_credentials(url))} is not a repository URL (https://, http://, "
            f"ssh:// or file://): {_GRAMMAR}"
        )
    options = parse_qs(fragment, keep_blank_values=True) if fragment else {}
    unknown = sorted(set(options) - {"branch", "path"})
    if unknown:
        raise ValueError(
            f"unknown option {unknown[0]!r} after '#': only branch= and path= ({_GRAMMAR})"
        )
    branch = options.get("branch", ["main"])[-1]
    if not _BRANCH.fullmatch(branch) or ".." in branch or branch.endswith((".lock", "/")):
        raise ValueError(f"{clip(branch)} is not a branch name ({_GRAMMAR})")
    subdir = options.get("path", [""])[-1].strip("/")
    if subdir and (".." in PurePosixPath(subdir).parts or not _BRANCH.fullmatch(subdir)):
        raise ValueError(f"{clip(subdir)} is not a folder inside the repository ({_GRAMMAR})")
    name = PurePosixPath(parts.path).name.removesuffix(".git")
    return SpecSource(
        label=label or _label_from(name),
        kind="git",
        url=url,
        branch=branch,
        subdir=subdir,
    )


def _label_from(name: str) -> str:
    label = re.sub(r"[^A-Za-z0-9._-]", "-", name).lstrip("._-")[:64]
    return label or "specs"


# ----------------------------------------------------------------------------- lookup


def _repo(source: SpecSource, *, cache_dir: Path, timeout_s: float) -> SpecRepo:
    assert source.url is not None
    return SpecRepo(
        label=source.label,
        url=source.url,
        branch=source.branch,
        subdir=source.subdir,
        cache_dir=cache_dir,
        timeout_s=timeout_s,
    )


@dataclass(frozen=True)
class _Snapshot:
    """One source as it stands now: its names, and how to read one."""

    source: SpecSource
    #: name → file (absolute in a directory, repository-relative in git).
    names: dict[str, str]
    commit: str | None = None


def _snapshot(
    source: SpecSource, *, cache_dir: Path, timeout_s: float, fetch: bool = True
) -> _Snapshot:
    if source.kind == "directory":
        assert source.directory is not None
        if not source.directory.is_dir():
            raise SpecError(
                f"the spec directory {source.directory} ({source.label}) does not exist: "
                "create it, mount it, or fix TRAINBOT_SPEC_SOURCES"
            )
        names: dict[str, str] = {}
        for path in sorted(source.directory.iterdir()):
            if path.suffix in _SUFFIXES and _NAME.fullmatch(path.stem) and path.is_file():
                names.setdefault(path.stem, str(path))
        return _Snapshot(source, names)
    git = _repo(source, cache_dir=cache_dir, timeout_s=timeout_s)
    commit = git.fetch() if fetch else git.cached()
    if commit is None:
        raise SpecError(f"the spec repository {source.label} has not been fetched yet")
    return _Snapshot(source, git.names(commit), commit)


def _read(snap: _Snapshot, name: str, *, cache_dir: Path, timeout_s: float) -> FoundSpec:
    source, file = snap.source, snap.names[name]
    if source.kind == "directory":
        path = Path(file)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise SpecError(f"cannot read the spec file {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise SpecError(f"{path} is not UTF-8 text: save it as UTF-8") from None
        origin = SpecOrigin(
            kind="directory", source=source.label, location=str(source.directory), path=path.name
        )
        return FoundSpec(name, text, origin)
    assert snap.commit is not None
    text = _repo(source, cache_dir=cache_dir, timeout_s=timeout_s).read(snap.commit, file)
    origin = SpecOrigin(
        kind="git",
        source=source.label,
        location=_without_credentials(source.url or ""),
        path=file,
        branch=source.branch,
        commit=snap.commit,
    )
    return FoundSpec(name, text, origin)


def find_spec(
    sources: Sequence[SpecSource], name: str, *, cache_dir: Path, timeout_s: float
) -> FoundSpec:
    """The spec ``name`` (or ``label/name``) from the first source that has it, each git
    source before it fetched now. Raises SpecError saying what is available."""
    name = name.strip()
    label, slash, bare = name.rpartition("/")
    if not _NAME.fullmatch(bare) or (slash and not _LABEL.fullmatch(label)):
        raise SpecError(
            f"{clip(name)} is not a spec name: names are letters, digits, '.', '_' and '-', "
            "optionally after the source's label (team/gpt-small)"
        )
    chosen = [s for s in sources if s.label == label] if slash else list(sources)
    if slash and not chosen:
        labels = ", ".join(s.label for s in sources) or "none"
        raise SpecError(f"no spec source is labelled {clip(label)}. Sources: {labels}")
    seen: list[str] = []
    for source in chosen:
        snap = _snapshot(source, cache_dir=cache_dir, timeout_s=timeout_s)
        if bare in snap.names:
            return _read(snap, bare, cache_dir=cache_dir, timeout_s=timeout_s)
        bare_seen = {n.rpartition("/")[2] for n in seen}
        seen += [n if n not in bare_seen else f"{source.label}/{n}" for n in sorted(snap.names)]
    close = difflib.get_close_matches(bare, sorted({n.rpartition("/")[2] for n in seen}), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    listing = ", ".join(seen[:30]) if seen else "none"
    if len(seen) > 30:
        listing += f" and {len(seen) - 30} more (/train specs lists them)"
    places = "; ".join(f"{s.label}: {s.where()}" for s in chosen)
    raise SpecError(
        f"no spec named {clip(name)} in {places}.{hint} Available: {listing}. "
        "To add one, put <name>.yaml in one of those places."
    )


def load_named_spec(
    sources: Sequence[SpecSource],
    name: str,
    *,
    cache_dir: Path,
    timeout_s: float,
    overrides: Sequence[str] = (),
) -> JobSpec:
    """Find, read, bound and validate a spec as a file spec is, its origin recorded."""
    found = find_spec(sources, name, cache_dir=cache_dir, timeout_s=timeout_s)
    where = found.origin.shown()
    data = spec_mapping(found.text, where=where)
    spec = parse_spec(data, name=found.name, overrides=overrides, source=where)
    return spec.model_copy(update={"origin": found.origin})


def catalog(sources: Sequence[SpecSource], *, cache_dir: Path, timeout_s: float) -> Catalog:
    """Every launchable spec, each with its description and where it comes from; a
    source that cannot be read is named with its problem and the others are listed."""
    result = Catalog()
    taken: set[str] = set()
    for source in sources:
        try:
            snap = _snapshot(source, cache_dir=cache_dir, timeout_s=timeout_s)
        except SpecError as exc:
            result.problems.append(SourceProblem(source.label, str(exc)))
            continue
        names = sorted(snap.names)
        if len(names) > MAX_PER_SOURCE:
            result.more += len(names) - MAX_PER_SOURCE
            names = names[:MAX_PER_SOURCE]
        try:
            texts = _texts(snap, names, cache_dir=cache_dir, timeout_s=timeout_s)
        except SpecError as exc:
            result.problems.append(SourceProblem(source.label, str(exc)))
            continue
        for name in names:
            shown = name if name not in taken else f"{source.label}/{name}"
            taken.add(name)
            text = texts[name]
            if isinstance(text, SpecError):
                description = f"(cannot be read: {_cut(str(text), 120)})"
            else:
                description = _description(text, where=snap.names[name])
            origin = (
                f"{source.label}@{(snap.commit or '')[:7]}"
                if source.kind == "git"
                else f"directory {source.label}"
            )
            result.specs.append(Listed(shown, description, origin))
    return result


def _texts(
    snap: _Snapshot, names: Sequence[str], *, cache_dir: Path, timeout_s: float
) -> dict[str, str | SpecError]:
    """The files of ``names``, each its text or why it cannot be read; a repository's in
    two git commands, however many there are."""
    if snap.source.kind == "git":
        assert snap.commit is not None
        repo = _repo(snap.source, cache_dir=cache_dir, timeout_s=timeout_s)
        by_path = repo.read_many(snap.commit, [snap.names[n] for n in names])
        return {name: by_path[snap.names[name]] for name in names}
    texts: dict[str, str | SpecError] = {}
    for name in names:
        try:
            texts[name] = _read(snap, name, cache_dir=cache_dir, timeout_s=timeout_s).text
        except SpecError as exc:
            texts[name] = exc
    return texts


def _description(text: str, *, where: str) -> str:
    try:
        data = spec_mapping(text, where=where)
    except SpecError as exc:
        return f"(invalid: {_cut(str(exc).splitlines()[0], 120)})"
    described = data.get("description")
    if not isinstance(described, str) or not described.strip():
        return ""
    # Shown in chat on one line: no format characters (a direction override), and control
    # characters (a line break) as spaces.
    visible = "".join(
        " " if unicodedata.category(ch) == "Cc" else ch
        for ch in described
        if unicodedata.category(ch) != "Cf"
    )
    return _cut(" ".join(visible.split()), MAX_DESCRIPTION)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ----------------------------------------------------------------------------- settings'


def configured(settings: Settings) -> tuple[SpecSource, ...]:
    """The sources the settings name: ``TRAINBOT_SPEC_SOURCES``, or else the one
    directory ``TRAINBOT_SPECS_DIR``."""
    if settings.spec_sources:
        return parse_sources(settings.spec_sources)
    return (SpecSource(label="specs", kind="directory", directory=settings.specs_dir),)


def _cache_dir(settings: Settings) -> Path:
    return settings.state_dir / "spec-sources"


def load_spec_for(settings: Settings, name: str, *, overrides: Sequence[str] = ()) -> JobSpec:
    """The spec a person names (``/train launch <name>``), from the configured sources."""
    return load_named_spec(
        configured(settings),
        name,
        cache_dir=_cache_dir(settings),
        timeout_s=settings.spec_git_timeout_s,
        overrides=overrides,
    )


def catalog_for(settings: Settings) -> Catalog:
    """``/train specs``: what the configured sources hold now."""
    return catalog(
        configured(settings), cache_dir=_cache_dir(settings), timeout_s=settings.spec_git_timeout_s
    )


def names_for(settings: Settings) -> list[str]:
    """Launchable names without asking any repository (the launch form, which Slack must
    be shown within 3 s): a repository's as of its last fetch. The launch fetches anew."""
    names: list[str] = []
    taken: set[str] = set()
    for source in configured(settings):
        try:
            snap = _snapshot(
                source,
                cache_dir=_cache_dir(settings),
                timeout_s=settings.spec_git_timeout_s,
                fetch=False,
            )
        except SpecError:
            continue
        for name in sorted(snap.names):
            names.append(name if name not in taken else f"{source.label}/{name}")
            taken.add(name)
    return names

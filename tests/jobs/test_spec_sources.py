"""Specs from the places an admin sets (issue 26, point 2): a directory (as a ConfigMap
is mounted) and a git repository served over loopback HTTP, fetched at every launch.

The repository is a real one (tests/fakes/code_servers.py: git's dumb HTTP protocol over
a loopback server) and the control plane is the real one on the local provider.
"""

from __future__ import annotations

import io
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bot.console import ConsoleNotifier
from jobs.database.db import session_scope
from jobs.database.models import Run
from jobs.domain.errors import SettingsError, SpecError
from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import CallbackJournal
from jobs.process.bootstrap import ControlPlane
from jobs.spec.sources import catalog_for, configured, load_spec_for
from jobs.usecases import service
from tests.fakes.code_servers import GitRepo, serve_directory
from tests.jobs.test_control_plane import ADA, settings_for, wait_until


def spec_text(command: str, description: str) -> str:
    """A spec that runs ``command`` and asks nothing of preflight (no dry run)."""
    return textwrap.dedent(
        f"""\
        description: {description}
        command: {command}
        dry_run:
          enabled: false
        """
    )


class Sources:
    """A mounted directory and a team repository served on loopback."""

    def __init__(self, root: Path, base: str, repo: GitRepo) -> None:
        self.root = root
        self.repo = repo
        self.url = repo.url(base)
        self.mounted = root / "mounted"
        self.mounted.mkdir()

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "TRAINBOT_SPEC_SOURCES": (
                f"mounted={self.mounted},team=git+{self.url}#branch=main&path=specs"
            ),
            **extra,
        }


@pytest.fixture
def sources(tmp_path: Path) -> Iterator[Sources]:
    repo = GitRepo(tmp_path, name="team-specs")
    with serve_directory(repo.served) as base:
        yield Sources(tmp_path, base, repo)


def test_a_git_spec_is_fetched_at_each_launch_and_its_commit_recorded(
    sources: Sources,
) -> None:
    first = sources.repo.commit(
        {"specs/gpt.yaml": spec_text("python -c print(1)", "GPT, first cut")}
    )
    settings = settings_for(sources.root / "state", **sources.env())
    cp = ControlPlane(
        settings,  # type: ignore[arg-type]
        notifier=ConsoleNotifier(io.StringIO()),
        journal=CallbackJournal(lambda *_: None),
        scheduler=False,
    )
    with cp:
        run1 = service.submit(cp.deps, spec_name="gpt", overrides=(), actor=ADA)
        second = sources.repo.commit(
            {"specs/gpt.yaml": spec_text("python -c print(2)", "GPT, second cut")}
        )
        run2 = service.submit(cp.deps, spec_name="gpt", overrides=(), actor=ADA)
        stored = {}
        with session_scope(cp.deps.engine) as session:
            for run in (run1, run2):
                row = session.get(Run, run.id)
                assert row is not None
                stored[run.id] = dict(row.spec)
        # Each launch read the branch as it stood then, and says at which commit.
        assert stored[run1.id]["command"] == ["python", "-c", "print(1)"]
        assert stored[run1.id]["origin"]["commit"] == first
        assert stored[run2.id]["command"] == ["python", "-c", "print(2)"]
        assert stored[run2.id]["origin"] == {
            "kind": "git",
            "source": "team",
            "location": sources.url,
            "path": "specs/gpt.yaml",
            "branch": "main",
            "commit": second,
        }
        # The run goes on from the spec stored on it: run 2 runs the pushed command.
        state = wait_until(
            lambda: (
                service.status(cp.deps, run2.id, ADA)[0].state
                not in (RunState.PREFLIGHT.value, RunState.PENDING.value)
                and service.status(cp.deps, run2.id, ADA)[0].state
            ),
            what="run 2 past preflight",
        )
        if state == RunState.AWAITING_CONFIRMATION.value:  # no dry run: "Launch anyway"
            service.resubmit(cp.deps, run2.id, ADA)
        wait_until(
            lambda: service.status(cp.deps, run2.id, ADA)[0].state == RunState.SUCCEEDED.value,
            what="run 2 to succeed",
        )
        assert service.logs(cp.deps, run2.id, ADA).text.strip().splitlines()[-1] == "2"
        for run in (run1, run2):
            if service.status(cp.deps, run.id, ADA)[0].state not in _ENDED:
                service.stop(cp.deps, run.id, ADA)
    for inst in cp.deps.provider.list_instances():
        if not inst.state.is_terminal():
            cp.deps.provider.terminate(inst.instance_id)
    cp.deps.provider.close()  # type: ignore[attr-defined]


_ENDED = {s.value for s in RunState if s.is_terminal()}


def test_the_mounted_directory_wins_a_clash_and_a_qualified_name_picks_the_repo(
    sources: Sources,
) -> None:
    commit = sources.repo.commit(
        {
            "specs/gpt.yaml": spec_text("python team.py", "the repository's GPT"),
            "specs/bert.yml": spec_text("python bert.py", "BERT <!channel> & co"),
            "README.md": "not a spec\n",
        }
    )
    (sources.mounted / "gpt.yaml").write_text(spec_text("python mounted.py", "the mounted GPT"))
    settings = settings_for(sources.root / "state", **sources.env())

    mounted = load_spec_for(settings, "gpt")  # type: ignore[arg-type]
    assert mounted.command == ["python", "mounted.py"]
    assert mounted.origin is not None
    assert (mounted.origin.kind, mounted.origin.source) == ("directory", "mounted")
    assert mounted.origin.location == str(sources.mounted)
    team = load_spec_for(settings, "team/gpt", overrides=["budget.usd=5"])  # type: ignore[arg-type]
    assert team.command == ["python", "team.py"]
    assert team.budget.usd == 5
    assert team.origin is not None and team.origin.commit == commit
    assert team.name == "gpt"

    listed = catalog_for(settings)  # type: ignore[arg-type]
    assert listed.problems == []
    assert [(s.name, s.description, s.where) for s in listed.specs] == [
        ("gpt", "the mounted GPT", "directory mounted"),
        ("bert", "BERT <!channel> & co", f"team@{commit[:7]}"),
        ("team/gpt", "the repository's GPT", f"team@{commit[:7]}"),
    ]

    with pytest.raises(SpecError) as missing:
        load_spec_for(settings, "gtp")  # type: ignore[arg-type]
    assert "Did you mean 'gpt'?" in str(missing.value)
    assert "Available: gpt, bert, team/gpt." in str(missing.value)
    with pytest.raises(SpecError, match="no spec source is labelled 'nope'"):
        load_spec_for(settings, "nope/gpt")  # type: ignore[arg-type]


def test_the_listing_reads_a_repository_in_one_go_and_says_which_files_are_broken(
    sources: Sources,
) -> None:
    files = {f"specs/s{i:02d}.yaml": spec_text("python s.py", f"spec {i}") for i in range(12)}
    files["specs/broken.yaml"] = "command: [python\n"
    files["specs/quiet.yml"] = 'command: python q.py\ndescription: "\\u202eevil\\nline"\n'
    commit = sources.repo.commit(files)
    settings = settings_for(sources.root / "state", **sources.env())
    listed = {s.name: s for s in catalog_for(settings).specs}  # type: ignore[arg-type]
    assert [listed[f"s{i:02d}"].description for i in range(12)] == [f"spec {i}" for i in range(12)]
    assert listed["broken"].description.startswith("(invalid: specs/broken.yaml is not valid YAML")
    assert listed["broken"].where == f"team@{commit[:7]}"
    # A direction override or a line break in a description is not shown in chat.
    assert listed["quiet"].description == "evil line"


def test_a_spec_in_the_repo_is_validated_like_a_file(sources: Sources) -> None:
    sources.repo.commit({"specs/bad.yaml": "command: python x.py\nbudget: {usd: -3}\nfoo: 1\n"})
    settings = settings_for(sources.root / "state", **sources.env())
    with pytest.raises(SpecError) as bad:
        load_spec_for(settings, "bad")  # type: ignore[arg-type]
    text = str(bad.value)
    assert text.startswith("spec 'bad' (team@") and "has 2 problems" in text
    assert "unknown key 'foo'" in text and "budget.usd: must be greater than 0" in text
    assert "origin" not in text
    # Only trainbot says where a spec came from.
    sources.repo.commit(
        {"specs/sly.yaml": "command: python x.py\norigin: {kind: directory, source: x}\n"}
    )
    with pytest.raises(SpecError, match="origin: is set by trainbot"):
        load_spec_for(settings, "sly")  # type: ignore[arg-type]


def test_an_unreachable_repository_is_a_clear_error_within_the_time_bound(
    sources: Sources,
) -> None:
    (sources.mounted / "local.yaml").write_text(spec_text("python local.py", "here"))
    # A port nobody answers on: the connection is refused.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused_port = closed.getsockname()[1]
    settings = settings_for(
        sources.root / "state",
        TRAINBOT_SPEC_SOURCES=(
            f"gone=git+http://user:pw@127.0.0.1:{refused_port}/x.git,{sources.mounted}"
        ),
    )
    with pytest.raises(SpecError) as gone:
        load_spec_for(settings, "local")  # type: ignore[arg-type]
    message = str(gone.value)
    assert message.startswith("the spec repository gone (http://127.0.0.1:")
    assert "could not be fetched" in message and "pw" not in message
    # The listing names the source it could not read and lists the others.
    listed = catalog_for(settings)  # type: ignore[arg-type]
    assert [p.label for p in listed.problems] == ["gone"]
    assert [s.name for s in listed.specs] == ["local"]

    # A server that takes the connection and never answers: bounded by the timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        settings = settings_for(
            sources.root / "state2",
            TRAINBOT_SPEC_SOURCES=f"slow=git+http://127.0.0.1:{silent.getsockname()[1]}/x.git",
            TRAINBOT_SPEC_GIT_TIMEOUT_S="1",
        )
        started = time.monotonic()
        with pytest.raises(SpecError, match=r"slow .* did not answer within 1 s"):
            load_spec_for(settings, "anything")  # type: ignore[arg-type]
        assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("relative/dir", "neither an absolute directory nor git+URL"),
        ("git+ftp://h/x.git", "is not a repository URL"),
        ("git+https://h/x.git#tag=v1", "unknown option 'tag'"),
        ("git+https://h/x.git#path=../etc", "is not a folder inside the repository"),
        ("a=/x,a=/y", "the label 'a' names two sources"),
    ],
)
def test_bad_sources_are_refused_at_start_saying_how_to_write_them(
    tmp_path: Path, value: str, problem: str
) -> None:
    with pytest.raises(SettingsError) as bad:
        settings_for(tmp_path, TRAINBOT_SPEC_SOURCES=value)
    assert "TRAINBOT_SPEC_SOURCES" in str(bad.value)
    assert problem in str(bad.value)


def test_without_sources_the_specs_directory_is_the_one_source(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    (only,) = configured(settings)  # type: ignore[arg-type]
    assert only.kind == "directory" and only.directory == settings.specs_dir  # type: ignore[attr-defined]
    tiny = load_spec_for(settings, "tiny")  # type: ignore[arg-type]
    assert tiny.origin is not None and tiny.origin.path == "tiny.yaml"


def test_the_shipped_kubernetes_specs_configmap_is_a_source_the_pod_mounts(
    tmp_path: Path,
) -> None:
    """deploy/kubernetes: the trainbot-specs ConfigMap is mounted where the settings'
    TRAINBOT_SPEC_SOURCES looks, and each of its files is a spec that loads (written out
    one file per key, as the kubelet mounts it)."""
    from tests.deploy.kube import KUBERNETES, render_here

    docs = {(o["kind"], o["metadata"]["name"]): o for o in render_here(KUBERNETES)}
    sources = docs[("ConfigMap", "trainbot")]["data"]["TRAINBOT_SPEC_SOURCES"]
    pod = docs[("Deployment", "trainbot")]["spec"]["template"]["spec"]
    (volume,) = [
        v for v in pod["volumes"] if v.get("configMap", {}).get("name") == "trainbot-specs"
    ]
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    assert sources.split(",")[0] == f"team={mount['mountPath']}"

    mounted = tmp_path / "mounted"
    mounted.mkdir()
    files = docs[("ConfigMap", "trainbot-specs")]["data"]
    for key, text in files.items():
        (mounted / key).write_text(text)
    settings = settings_for(
        tmp_path / "state",
        TRAINBOT_SPEC_SOURCES=sources.replace(mount["mountPath"], str(mounted)),
    )
    listed = catalog_for(settings)  # type: ignore[arg-type]
    assert sorted(s.name for s in listed.specs) == sorted(k.removesuffix(".yaml") for k in files)
    for spec in listed.specs:
        loaded = load_spec_for(settings, spec.name)  # type: ignore[arg-type]
        assert loaded.origin is not None and loaded.origin.source == "team"


def test_a_resubmit_keeps_the_origin_and_no_override_can_set_one(sources: Sources) -> None:
    from jobs.spec.changes import apply_changes

    commit = sources.repo.commit({"specs/gpt.yaml": spec_text("python gpt.py", "GPT")})
    settings = settings_for(sources.root / "state", **sources.env())
    stored = load_spec_for(settings, "gpt").model_dump(mode="json")  # type: ignore[arg-type]
    changed = apply_changes(stored, ["max_hours=9"], name="gpt")
    assert changed.max_hours == 9
    assert changed.origin is not None and changed.origin.commit == commit
    with pytest.raises(SpecError, match=r"'origin\.commit' cannot change on a resubmit"):
        apply_changes(stored, ["origin.commit=" + "0" * 40], name="gpt")
    with pytest.raises(SpecError, match="origin: is set by trainbot"):
        load_spec_for(settings, "gpt", overrides=["origin.kind=text"])  # type: ignore[arg-type]


def test_one_command_reads_each_repository_once(sources: Sources) -> None:
    """What the dispatcher does around a command: the spec it authorises (where the run
    reports) is the one it launches, though the branch moves in between."""
    from jobs.spec.sources import one_fetch_per_repository

    first = sources.repo.commit({"specs/gpt.yaml": spec_text("python one.py", "one")})
    settings = settings_for(sources.root / "state", **sources.env())
    with one_fetch_per_repository():
        checked = load_spec_for(settings, "gpt")  # type: ignore[arg-type]
        sources.repo.commit({"specs/gpt.yaml": spec_text("python two.py", "two")})
        launched = load_spec_for(settings, "gpt")  # type: ignore[arg-type]
    assert checked == launched and launched.command == ["python", "one.py"]
    assert launched.origin is not None and launched.origin.commit == first
    after = load_spec_for(settings, "gpt")  # type: ignore[arg-type]
    assert after.command == ["python", "two.py"]

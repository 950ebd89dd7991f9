"""The command-line client against ``trainbot serve``, over real HTTP.

The control plane runs as ``trainbot serve`` runs it with Slack (``attach``: the Bolt
app at /slack and the commands API at /v1/commands, on 127.0.0.1:0). Tokens are issued
by ``/train token`` in signed Slack requests; the client's functions (and, once, its
CLI in a subprocess) talk to the server with them. Who may do what is chat's rule:
Ada may launch, Bob may not (``TRAINBOT_LAUNCHERS``), Erin is in another channel.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlmodel import select

from bot import client
from jobs.database.db import session_scope
from jobs.database.models import ApiToken, Run
from jobs.domain.lifecycle import RunState
from tests.bot.test_slack_app import (
    ADA,
    BOB,
    CHANNEL,
    TOKEN,
    Slack,
    slack_plane,
    slack_settings,
    wait_until,
)
from tests.fakes.slack_api import FakeSlack

ERIN = "U0ERIN"
ELSEWHERE = "C0VISION"

#: A spec file on the person's machine: the tiny CPU model, long enough to be stopped.
SPEC = """\
description: sent by the command-line client
command: python -m runner.examples.tiny --steps 100000 --step-delay 0.05
resources:
  cloud: local
  spot: true
  disk_gb: 1
budget:
  usd: 50
dry_run:
  enabled: false
"""


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Slack]:
    fake = FakeSlack(tokens=[TOKEN], post_interval_s=0.02, burst=5).start()
    fake.add_usergroup("S0LEADS", "ml-leads", [])
    fake.add_channel(CHANNEL, "ml-training", members=[ADA, BOB])
    fake.add_channel(ELSEWHERE, "ml-vision", members=[ERIN])
    settings = slack_settings(
        tmp_path / "state", channels=f"{CHANNEL},{ELSEWHERE}", launchers=ADA, local_cores=None
    )
    with slack_plane(fake, settings) as slack:
        yield slack


def token_from_slack(s: Slack, user: str, *, channel: str = CHANNEL, name: str = "cli") -> str:
    """``/train token new <name>`` typed in Slack; the token from the private reply."""
    response, path = s.command(f"token new {name}", user=user, channel=channel)
    assert response.status_code == 200
    reply = s.hooks.wait(path)
    assert reply["response_type"] == "ephemeral", "the token is shown to its holder alone"
    found = re.search(r"\btbt_[A-Za-z0-9_-]+", reply["text"])
    assert found is not None, reply["text"]
    return found.group(0)


def call(
    s: Slack, token: str, verb: str, *args: str, sets: tuple[str, ...] = (), key: str | None = None
) -> tuple[int, str]:
    """One client command, as ``trainbot <verb> <args>`` runs it: (exit code, what it said)."""
    assert s.cp.server is not None
    out, err = io.StringIO(), io.StringIO()
    environ = {"TRAINBOT_URL": s.cp.server.url, "TRAINBOT_TOKEN": token}
    code = client.run(verb, list(args), sets=sets, key=key, environ=environ, out=out, err=err)
    return code, out.getvalue() + err.getvalue()


def test_the_client_launches_lists_reads_logs_and_stops_as_chat_allows(
    served: Slack, tmp_path: Path
) -> None:
    s = served
    ada, bob = token_from_slack(s, ADA, name="laptop"), token_from_slack(s, BOB)
    erin = token_from_slack(s, ERIN, channel=ELSEWHERE)
    with session_scope(s.cp.deps.engine) as session:  # kept as a hash, never the value
        rows = session.exec(select(ApiToken)).all()
        assert {row.token_hash for row in rows} == {
            hashlib.sha256(t.encode()).hexdigest() for t in (ada, bob, erin)
        }
        assert not any(t in str(row.model_dump()) for row in rows for t in (ada, bob, erin))

    spec = tmp_path / "my-run.yaml"
    spec.write_text(SPEC)
    # Bob is not a launcher: refused as in chat, nothing created.
    code, said = call(s, bob, "launch", str(spec), sets=("budget.usd=5",))
    assert code == 1 and "not on the list of people who may launch" in said
    assert s.counts()["Run"] == 0
    # A spec with a mistake: the spec's own error, naming the key.
    bad = tmp_path / "broken.yaml"
    bad.write_text(SPEC.replace("disk_gb: 1", "disk_gb: lots"))
    code, said = call(s, ada, "launch", str(bad))
    assert code == 1 and "resources.disk_gb" in said and "broken" in said, said
    bad.write_text("command: [unclosed\n")
    code, said = call(s, ada, "launch", str(bad))
    assert code == 1 and "not valid YAML" in said, said
    assert s.counts()["Run"] == 0

    code, said = call(s, ada, "launch", str(spec), sets=("budget.usd=5",), key="ci-42")
    assert code == 0, said
    run_id = s.only_run()
    assert run_id in said
    # The CI job's retry, with the same key: the same run, not a second one.
    code, again = call(s, ada, "launch", str(spec), sets=("budget.usd=5",), key="ci-42")
    assert code == 0 and run_id in again and s.only_run() == run_id
    with session_scope(s.cp.deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None
        assert (run.requester, run.channel, run.spec_name) == (ADA, CHANNEL, "my-run")
        assert run.budget_usd == 5 and run.spec["description"] == "sent by the command-line client"

    # list: the CLI itself, in a subprocess, with the token from the environment.
    assert s.cp.server is not None
    env = {**os.environ, "TRAINBOT_URL": s.cp.server.url, "TRAINBOT_TOKEN": bob}
    listed = subprocess.run(
        [sys.executable, "-m", "bot.cli", "list", "all"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0 and run_id in listed.stdout, listed
    # Erin's token is for another channel: Ada's run is not hers to see, as in chat.
    code, said = call(s, erin, "list", "all")
    assert code == 0 and run_id not in said
    code, said = call(s, erin, "logs", run_id)
    assert code == 1 and "no run" in said and run_id in said

    # Without a dry run the preflight warns and the run waits for "Launch anyway", which
    # in chat (and here) is a resubmit, and only a launcher who owns the run may.
    wait_until(lambda: s.state(run_id) != RunState.PREFLIGHT, 60, "the preflight")
    assert s.state(run_id) == RunState.AWAITING_CONFIRMATION
    code, said = call(s, bob, "resubmit", run_id)
    assert code == 1 and f"{run_id} belongs to @{ADA}" in said, said
    code, said = call(s, ada, "resubmit", run_id)
    assert code == 0, said
    wait_until(lambda: s.state(run_id) == RunState.RUNNING, 60, "the run to start")
    code, said = call(s, ada, "status", run_id)
    assert code == 0 and run_id in said
    code, said = call(s, ada, "logs", run_id)
    assert code == 0 and f"Attempt 1 of {run_id}" in said, said

    # Bob may read the channel's run, not stop it: the same sentence as in chat.
    code, said = call(s, bob, "stop", run_id)
    assert code == 1 and f"{run_id} belongs to @{ADA}" in said, said
    assert s.state(run_id) == RunState.RUNNING
    denied = [r for r in s.records if r["type"] == "denied" and r.get("user") == BOB]
    assert {r["action"] for r in denied} == {"launch", "resubmit", "stop"}, "audited as in chat"
    code, said = call(s, ada, "stop", run_id)
    assert code == 0 and run_id in said
    assert s.state(run_id) == RunState.STOPPED


def test_unknown_and_revoked_tokens_get_401(served: Slack) -> None:
    s = served
    assert s.cp.server is not None
    code, said = call(s, "tbt_" + "x" * 43, "list")
    assert code == 1 and "refused the token" in said
    token = token_from_slack(s, ADA)
    assert call(s, token, "list")[0] == 0
    # Revoked in Slack: refused from the next request on.
    with session_scope(s.cp.deps.engine) as session:
        (token_id,) = session.exec(select(ApiToken.id)).all()
    _, path = s.command("token list")
    assert token_id in s.hooks.wait(path)["text"]
    _, path = s.command(f"token revoke {token_id}")
    assert "Revoked" in s.hooks.wait(path)["text"]
    code, said = call(s, token, "list")
    assert code == 1 and "refused the token" in said
    # The raw answer: 401 with a JSON reason, nothing run.
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        s.cp.server.url + client.API_PATH,
        data=b'{"text": "list"}',
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 401
    assert "revoked" in caught.value.read().decode()


def test_client_errors_are_one_line_with_an_exit_code(tmp_path: Path) -> None:
    # No server there: a clear line, exit 1. Nothing set: a usage line, exit 2.
    environ = {"TRAINBOT_URL": "http://127.0.0.1:9", "TRAINBOT_TOKEN": "tbt_x"}
    err = io.StringIO()
    assert client.run("list", [], environ=environ, out=io.StringIO(), err=err) == 1
    assert "cannot reach the control plane at http://127.0.0.1:9" in err.getvalue()
    assert err.getvalue().count("\n") == 1
    err = io.StringIO()
    empty = {"TRAINBOT_CLIENT_CONFIG": str(tmp_path / "none.toml")}
    assert client.run("list", [], environ=empty, out=io.StringIO(), err=err) == 2
    assert "TRAINBOT_URL and TRAINBOT_TOKEN not set" in err.getvalue()
    # The config file stands in for the environment.
    config = tmp_path / "client.toml"
    config.write_text('url = "http://127.0.0.1:9/"\ntoken = "tbt_y"\n')
    loaded = client.load_config({"TRAINBOT_CLIENT_CONFIG": str(config)})
    assert loaded == client.ClientConfig(url="http://127.0.0.1:9", token="tbt_y")
    missing = tmp_path / "missing.yaml"
    err = io.StringIO()
    assert client.run("launch", [str(missing)], environ=environ, err=err) == 2
    assert "no spec file" in err.getvalue()

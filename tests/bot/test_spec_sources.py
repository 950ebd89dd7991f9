"""The team's own specs in Slack (issue 26, point 2): ``/train specs``, a launch by name
from a git repository served over loopback, and "New run from YAML" (the global shortcut,
its modal and its submission), all as signed HTTP into the real app, answered through the
fake Slack Web API, over the real control plane on the local provider.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import requests
import yaml
from sqlmodel import select

from bot.auth import LAUNCH_DENIED
from bot.listeners.spec_yaml import validate_pasted
from bot.slack_notifier import SlackNotifier
from bot.slack_wsgi import attach
from bot.views.spec_yaml import YAML_MODAL_CALLBACK, YAML_SHORTCUT
from jobs.database.db import session_scope
from jobs.database.models import Run
from jobs.domain.errors import SpecError
from jobs.outbound.notify import CallbackJournal
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings
from jobs.spec import MAX_SPEC_FILE_CHARS
from jobs.usecases import service
from tests.bot.test_slack_app import (
    CHANNEL,
    SECRET,
    TEAM,
    TOKEN,
    ResponseUrls,
    Slack,
    terminate_instances,
    wait_until,
)
from tests.deploy.kube import ROOT
from tests.fakes.code_servers import GitRepo, serve_directory
from tests.fakes.slack_api import FakeSlack

ADA, BOB = "U0ADA", "U0BOB"  # Ada may launch; Bob may not.

GPT = """\
description: GPT-small on the team's shards <!channel>
command: python -c print(1)
dry_run:
  enabled: false
"""


class Team:
    """The Slack app over a control plane whose specs are a mounted directory and a
    repository on loopback; Ada is the one launcher."""

    def __init__(self, slack: Slack, repo: GitRepo, mounted: Path) -> None:
        self.slack = slack
        self.repo = repo
        self.mounted = mounted

    def shortcut(self, user: str) -> requests.Response:
        payload = {
            "type": "shortcut",
            "token": "legacy-verification-token",
            "action_ts": f"{time.time():.6f}",
            "team": {"id": TEAM, "domain": "fake"},
            "user": {"id": user, "username": user.lower(), "team_id": TEAM},
            "callback_id": YAML_SHORTCUT,
            "trigger_id": f"trg-{uuid.uuid4().hex[:12]}",
        }
        return self.slack.send(urlencode({"payload": json.dumps(payload)}).encode())

    def submit(self, view: dict[str, Any], text: str, *, user: str = ADA) -> requests.Response:
        values = {
            "spec_yaml": {"spec_yaml": {"type": "plain_text_input", "value": text}},
            "channel": {
                "channel": {"type": "conversations_select", "selected_conversation": CHANNEL}
            },
        }
        return self.slack.submit_view(view, values, user=user)

    def runs(self) -> list[Run]:
        with session_scope(self.slack.cp.deps.engine) as session:
            rows = list(session.exec(select(Run).order_by(Run.created_at)).all())  # type: ignore[arg-type]
            for row in rows:
                session.expunge(row)
            return rows


@pytest.fixture
def team(tmp_path: Path) -> Iterator[Team]:
    repo = GitRepo(tmp_path, name="ml-specs")
    mounted = tmp_path / "configmap"
    mounted.mkdir()
    fake = FakeSlack(
        tokens=[TOKEN], post_interval_s=0.02, burst=5, whole_second_retry_after=False
    ).start()
    fake.add_channel(CHANNEL, "ml-training", members=[ADA, BOB])
    hooks = ResponseUrls()
    notifier = SlackNotifier(fake.client(TOKEN), min_interval_s=0.02, backoff_s=0.05)
    with serve_directory(repo.served) as base:
        settings = load_settings(
            {
                "TRAINBOT_STATE_DIR": str(tmp_path / "state"),
                "TRAINBOT_INGEST_PORT": "0",
                "TRAINBOT_LOCAL_TERMINATION_WINDOW_S": "5",
                "TRAINBOT_NOTIFIER": "slack",
                "TRAINBOT_SLACK_SIGNING_SECRET": SECRET,
                "TRAINBOT_SLACK_BOT_TOKEN": TOKEN,
                "TRAINBOT_ALLOWED_CHANNELS": CHANNEL,
                "TRAINBOT_LAUNCHERS": ADA,
                "TRAINBOT_SPEC_SOURCES": (
                    f"ops={mounted},ml=git+{repo.url(base)}#branch=main&path=specs"
                ),
            }
        )
        cp = ControlPlane(
            settings, notifier=notifier, journal=CallbackJournal(lambda *_: None), scheduler=False
        )
        front = attach(cp, client=fake.client(TOKEN), notifier=notifier)
        cp.start()
        slack = Slack(cp=cp, fake=fake, hooks=hooks, notifier=notifier, front=front)
        try:
            yield Team(slack, repo, mounted)
        finally:
            for run in Team(slack, repo, mounted).runs():
                if not run.state.is_terminal():
                    service.stop(cp.deps, run.id, service.Actor(user=ADA, channel=CHANNEL))
            front.close()
            cp.close()
            terminate_instances(cp)
            notifier.close(timeout=5)
            hooks.close()
            fake.close()


def test_specs_lists_each_source_and_a_launch_by_name_records_the_commit(team: Team) -> None:
    slack = team.slack
    commit = team.repo.commit({"specs/gpt.yaml": GPT})
    (team.mounted / "smoke.yaml").write_text("description: a quick check\ncommand: true\n")

    response, path = slack.command("specs")
    assert response.status_code == 200
    listing = slack.hooks.wait(path)
    assert listing["response_type"] == "ephemeral"
    text = listing["text"]
    assert "  smoke: a quick check · directory ops" in text
    # The description is the file's, escaped: it pings nobody.
    assert f"  gpt: GPT-small on the team's shards &lt;!channel&gt; · ml@{commit[:7]}" in text

    response, path = slack.command("launch gpt budget.usd=3")
    assert response.status_code == 200
    assert "gpt" in slack.hooks.wait(path)["text"]
    (run,) = wait_until(team.runs, what="the run launched by name")
    assert run.spec["origin"]["commit"] == commit
    assert run.spec["budget"]["usd"] == 3
    response, path = slack.command(f"status {run.id}")
    status = slack.hooks.wait(path)["text"]
    assert status.startswith(f"[{run.id}] gpt by U0ADA: ")
    assert status.endswith(f" · spec from ml@{commit[:7]} (specs/gpt.yaml)")


def test_the_manifest_offers_the_shortcut_the_app_listens_for() -> None:
    manifest = yaml.safe_load((ROOT / "deploy" / "slack-manifest.yaml").read_text())
    (shortcut,) = manifest["features"]["shortcuts"]
    assert (shortcut["type"], shortcut["callback_id"]) == ("global", YAML_SHORTCUT)
    assert len(shortcut["name"]) <= 24 and len(shortcut["description"]) <= 80


def test_new_run_from_yaml_validates_like_a_file_and_launches_as_the_command_does(
    team: Team,
) -> None:
    slack = team.slack
    assert team.shortcut(ADA).status_code == 200
    assert slack.fake.wait_for(lambda: bool(slack.fake.views), 10)
    (view,) = slack.fake.views.values()
    assert view["callback_id"] == YAML_MODAL_CALLBACK

    # Not YAML: the message under the input says where, and nothing is launched.
    bad = team.submit(view, "command: [python, train.py\n")
    assert bad.status_code == 200
    errors = bad.json()
    assert errors["response_action"] == "errors"
    assert errors["errors"]["spec_yaml"].startswith(
        "the pasted spec is not valid YAML at line 2, column 1"
    )
    assert "Traceback" not in bad.text
    # YAML, but not a spec: every problem, with its key path, as for a file.
    wrong = team.submit(view, "command: python t.py\nbudget: {usd: -1}\nresources: {gpus: 8}\n")
    problems = wrong.json()["errors"]["spec_yaml"]
    assert "spec 'pasted' (the pasted spec) has 2 problems" in problems
    assert "budget.usd: must be greater than 0" in problems
    assert "unknown key 'resources.gpus'" in problems
    # Over the file bound: Slack's input takes 3,000 characters (the view says so, and
    # the fake refuses a view that asks for more); the app refuses a bigger body whole,
    # and the check itself refuses a text over the file bound before parsing it.
    (field,) = [b for b in view["blocks"] if b.get("block_id") == "spec_yaml"]
    assert field["element"]["max_length"] == 3000
    huge = "command: x\n# " + "x" * MAX_SPEC_FILE_CHARS
    assert team.submit(view, huge).status_code == 413
    with pytest.raises(SpecError, match=r"the pasted spec is too big \(1,048,589 characters"):
        validate_pasted(huge)
    assert team.runs() == []

    good = team.submit(view, "name: pasted-gpt\n" + GPT)
    assert good.status_code == 200 and good.json() == {"response_action": "clear"}
    (run,) = wait_until(team.runs, what="the run from the modal")
    assert (run.requester, run.channel, run.spec_name) == (ADA, CHANNEL, "pasted-gpt")
    assert run.spec["command"] == ["python", "-c", "print(1)"]
    assert run.spec["origin"]["kind"] == "text"
    # Slack delivers the submission again: still one run.
    assert team.submit(view, "name: pasted-gpt\n" + GPT).status_code == 200
    time.sleep(0.5)
    assert len(team.runs()) == 1


def test_a_non_launcher_gets_no_form_and_a_forged_submission_launches_nothing(
    team: Team,
) -> None:
    slack = team.slack
    assert team.shortcut(BOB).status_code == 200
    told = wait_until(
        lambda: [c for c in slack.fake.calls_to("chat.postMessage") if c.args["channel"] == BOB],
        what="the refusal sent to Bob",
    )
    assert told[0].args["text"] == LAUNCH_DENIED
    assert slack.fake.calls_to("views.open") == []

    # A submission of the form Ada was given, sent as Bob: refused by the same rule as
    # /train launch, privately, and nothing runs.
    assert team.shortcut(ADA).status_code == 200
    assert slack.fake.wait_for(lambda: bool(slack.fake.views), 10)
    (view,) = slack.fake.views.values()
    assert team.submit(view, GPT, user=BOB).status_code == 200
    refused = wait_until(
        lambda: slack.fake.calls_to("chat.postEphemeral"), what="the refusal to Bob"
    )
    assert (refused[0].args["user"], refused[0].args["text"]) == (BOB, LAUNCH_DENIED)
    assert team.runs() == []


def test_the_launch_form_offers_the_yaml_form_over_it(team: Team) -> None:
    slack = team.slack
    response, _ = slack.command("launch")
    assert response.status_code == 200
    assert slack.fake.wait_for(lambda: bool(slack.fake.views), 10)
    (form,) = slack.fake.views.values()
    assert form["blocks"][-1]["elements"][0]["action_id"] == "paste_yaml"
    payload = {
        "type": "block_actions",
        "team": {"id": TEAM, "domain": "fake"},
        "user": {"id": ADA, "username": "ada", "team_id": TEAM},
        "api_app_id": "A0TRAIN",
        "container": {"type": "view", "view_id": form["id"]},
        "trigger_id": f"trg-{uuid.uuid4().hex[:12]}",
        "view": form,
        "actions": [
            {"action_id": "paste_yaml", "block_id": "paste_yaml", "type": "button",
             "value": "yaml", "action_ts": f"{time.time():.6f}"}
        ],
    }  # fmt: skip
    assert slack.send(urlencode({"payload": json.dumps(payload)}).encode()).status_code == 200
    (pushed,) = wait_until(lambda: slack.fake.calls_to("views.push"), what="the YAML form")
    view = pushed.args["view"]
    view = json.loads(view) if isinstance(view, str) else view
    assert view["callback_id"] == YAML_MODAL_CALLBACK
    (channel,) = [b for b in view["blocks"] if b.get("block_id") == "channel"]
    assert channel["element"]["initial_conversation"] == CHANNEL

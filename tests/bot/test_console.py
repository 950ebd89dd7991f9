"""`trainbot shell`: the terminal chat over the real control plane."""

from __future__ import annotations

import io
from pathlib import Path

from bot.console import ConsoleNotifier, Shell
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings


def test_shell_runs_commands_and_prints_replies(tmp_path: Path) -> None:
    settings = load_settings(
        {"TRAINBOT_STATE_DIR": str(tmp_path / "state"), "TRAINBOT_INGEST_PORT": "0"}
    )
    out = io.StringIO()
    script = io.StringIO(
        "# comments and blank lines are skipped\n\n"
        "help\n"
        "/train lanch tiny\n"
        "/train list all\n"
        "/train oncall @grace\n"
        "oncall\n"
        "/train budget\n"
        "quit\n"
        "/train list\n"  # never reached
    )
    with ControlPlane(settings, notifier=ConsoleNotifier(out), scheduler=False) as cp:
        code = Shell(cp.deps, user="ada", stdin=script, out=out).loop()
    text = out.getvalue()
    assert code == 0
    assert "`/train launch" in text  # help
    assert "did you mean" in text.lower() and "launch" in text  # typo suggestion
    assert "No runs" in text
    assert "@grace is now on call here" in text
    assert "@grace is on call for this channel" in text
    assert "No runs with budgets" in text
    assert text.count("No runs.") == 1, "nothing after quit runs"
    assert "Traceback" not in text

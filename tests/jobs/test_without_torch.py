"""The control plane's image installs `trainbot[server]` without torch: it must start,
answer /healthz and stop without importing it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.paths import ROOT

SCRIPT = """
import importlib.abc, os, sys, urllib.request

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is not installed in the control plane's image")
        return None

sys.meta_path.insert(0, NoTorch())
from bot.console import ConsoleNotifier
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings

with ControlPlane(load_settings(), notifier=ConsoleNotifier()) as cp:
    assert urllib.request.urlopen(f"{cp.server.admin_url}/healthz").status == 200
print("ok", "torch" in sys.modules)
"""


def test_the_control_plane_starts_and_serves_without_torch(tmp_path: Path) -> None:
    # A preflight left behind by a crash is resumed at start: that path too.
    (tmp_path / "preflight" / "r-gone").mkdir(parents=True)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(ROOT),
            "TRAINBOT_STATE_DIR": str(tmp_path),
            "TRAINBOT_INGEST_PORT": "0",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "False"]

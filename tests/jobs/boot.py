"""Playing an instance's boot on this machine: the AWS user data and the GCP startup
script run under bash with stand-in commands, writing where the test says instead of the
instance's fixed paths (``TRAINBOT_BOOT_*``, ``TRAINBOT_STATE_DIR``, ``TRAINBOT_VENV``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def stand_in(path: Path, body: str) -> Path:
    """An executable at ``path`` (its folders made) whose text is ``body``; the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    path.chmod(0o755)
    return path


def root_commands(root: Path, *, apt_get: bool = True) -> Path:
    """``root/bin`` holding stand-ins for the commands the AWS user data runs as root on a
    fresh instance; the folder, to put first on PATH.

    ``shutdown`` appends its arguments to ``root/shutdown``; ``runuser`` runs its command as
    this user; ``id``, ``useradd``, ``chgrp`` and ``chown`` succeed; ``apt-get`` fails (no
    package comes from the network), unless ``apt_get=False`` leaves it out.
    """
    bin_dir = root / "bin"
    bodies = {
        "shutdown": f'echo "shutdown $*" >> {root / "shutdown"}',
        "runuser": 'while [ "$1" != "--" ]; do shift; done; shift; exec "$@"',
        "id": "exit 0",
        "useradd": "exit 0",
        "chgrp": "exit 0",
        "chown": "exit 0",
    }
    if apt_get:
        bodies["apt-get"] = "exit 1"
    for name, body in bodies.items():
        stand_in(bin_dir / name, f"#!/bin/sh\n{body}\n")
    return bin_dir


def aws_boot_env(root: Path, home: Path, *, path: str) -> dict[str, str]:
    """The environment the AWS user data runs under: its home, env file, scratch
    directory and console under ``root``/``home``, commands looked up on ``path``."""
    return {
        "PATH": path,
        "TRAINBOT_BOOT_HOME": str(home),
        "TRAINBOT_BOOT_ENV_FILE": str(root / "etc" / "runner.env"),
        "TRAINBOT_BOOT_SCRATCH_DIR": str(root / "scratch"),
        "TRAINBOT_BOOT_CONSOLE": str(root / "console"),
    }


def gcp_boot_env(
    root: Path, md_url: str, *, halt: str = "true", path: str | None = None
) -> dict[str, str]:
    """The environment the GCP startup script runs under: the metadata server at
    ``md_url``, its state and the runner's venv under ``root``, ``halt`` for the
    shutdown it ends with, and ``path`` (or this process's PATH) for commands."""
    return {
        "PATH": path or os.environ["PATH"],
        "TRAINBOT_GCE_METADATA_URL": md_url,
        "TRAINBOT_STATE_DIR": str(root / "state"),
        "TRAINBOT_VENV": str(root / "venv"),
        "TRAINBOT_RUN_AS": "",
        "TRAINBOT_HALT": halt,
    }


def runner_venv(root: Path) -> Path:
    """``root/venv`` as an image with the runner installed has it: this interpreter as its
    python and a runner that does nothing (the test's command is what runs)."""
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    stand_in(venv / "bin" / "trainbot-runner", "#!/bin/sh\n")
    return venv


def secret_checker(variable: str) -> str:
    """A training script that exits 0 when ``variable`` holds the value whose sha256 is
    its argument, 3 otherwise, printing which and never the value."""
    return (
        "import hashlib, os, sys\n"
        f"got = os.environ.get({variable!r})\n"
        "ok = got is not None and hashlib.sha256(got.encode()).hexdigest() == sys.argv[1]\n"
        'print("secret ok" if ok else "secret wrong", flush=True)\n'
        "sys.exit(0 if ok else 3)\n"
    )

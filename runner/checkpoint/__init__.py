"""Asynchronous, atomic checkpoints in a store (needs torch).

``write`` snapshots and writes in the background, one save in flight; ``read`` reads
files verified against the manifest; ``restore`` loads the newest checkpoint that
verifies; ``files`` commits and restores a script's directory. Where checkpoints live and
what commits one (torch-free) is :mod:`runner.layout`. See docs/architecture.md,
"Runner: checkpoints".
"""

from __future__ import annotations

from runner.checkpoint.files import commit_files, download_files
from runner.checkpoint.read import PrefetchCancelled
from runner.checkpoint.restore import Prefetch, Restored, load_checkpoint, restore_latest, verify
from runner.checkpoint.write import CheckpointWriter
from runner.errors import CheckpointError, NoCheckpointError, RunnerError
from runner.layout import (
    MANIFEST,
    CheckpointEntry,
    CommitInfo,
    Manifest,
    delete_steps,
    list_committed,
    read_manifest,
    scan,
    step_dir,
)

__all__ = [
    "MANIFEST",
    "CheckpointEntry",
    "CheckpointError",
    "CheckpointWriter",
    "CommitInfo",
    "Manifest",
    "NoCheckpointError",
    "Prefetch",
    "PrefetchCancelled",
    "Restored",
    "RunnerError",
    "commit_files",
    "delete_steps",
    "download_files",
    "list_committed",
    "load_checkpoint",
    "read_manifest",
    "restore_latest",
    "scan",
    "step_dir",
    "verify",
]

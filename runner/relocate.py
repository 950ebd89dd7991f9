"""Moving an environment restored from the store to this instance's code directory.

A virtual environment holds absolute paths to where it was built (shebangs, activate
scripts, links); restored under another directory, they are rewritten to the new one
(:func:`runner.setup.restore_environment`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["relocate"]

#: The biggest file whose absolute paths are moved when an archive is restored elsewhere.
MAX_BYTES = 8 << 20


def relocate(root: Path, old: bytes, new: bytes) -> None:
    """Move absolute paths into the old code directory (shebangs, activate scripts,
    links) to the new one. Binary files (a NUL in their first 8 KiB: compiled modules,
    ``.pyc``) are left alone, their rest unread."""
    if root.is_symlink() or not root.is_dir():
        _relocate_one(str(root), old, new)
        return
    folders = [str(root)]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(entry.path)
                else:
                    _relocate_one(entry.path, old, new)


def _relocate_one(path: str, old: bytes, new: bytes) -> None:
    if os.path.islink(path):
        target = os.readlink(path).encode()
        if old in target:
            os.unlink(path)
            os.symlink(target.replace(old, new), path)
        return
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_BYTES:
        return
    with open(path, "rb") as f:
        head = f.read(8192)
        if b"\0" in head:
            return
        data = head + f.read()
    if old not in data:
        return
    with open(path, "wb") as f:
        f.write(data.replace(old, new))
    os.chmod(path, stat.S_IMODE(info.st_mode))

"""Price tables shipped with the providers: dated, each refreshed by its provider.

:func:`read_table` reads one, again only when its file changes; each caller says what
to do when it cannot (reinstall, refresh).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

__all__ = ["read_table"]


@functools.lru_cache(maxsize=8)
def _table(path: str, mtime: float, key: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"is unreadable ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get(key), dict):
        raise ValueError(f"has no {key!r}")
    return data


def read_table(path: Path, *, key: str) -> dict[str, Any]:
    """The JSON table at ``path``, which must map ``key`` to an object. Raises ValueError
    saying what is wrong ("is unreadable (…)", "has no 'regions'"), for the caller's
    message."""
    try:
        mtime = path.stat().st_mtime
    except OSError:
        mtime = 0.0
    return _table(str(path), mtime, key)

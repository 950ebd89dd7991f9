"""Where the repository is, for tests that read its files or run its scripts.

One definition instead of a ``Path(__file__).resolve().parents[N]`` in every module, whose
``N`` changes with how deep the module sits.
"""

from __future__ import annotations

from pathlib import Path

#: The repository's root: the folder that holds pyproject.toml.
ROOT = Path(__file__).resolve().parents[1]

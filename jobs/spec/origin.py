"""Where a run's spec was read: stored with it, so a run says which file, and which
commit of a repository, it was launched from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from jobs.spec.sections import Section

__all__ = ["SpecOrigin"]


class SpecOrigin(Section):
    """Set by trainbot when it reads a spec; a spec file that sets it is refused."""

    #: ``directory``: a file in a directory source; ``git``: a file at a commit of a git
    #: source; ``text``: text sent with the command (the Slack modal, the command-line client).
    kind: Literal["directory", "git", "text"]
    #: The source's label (``TRAINBOT_SPEC_SOURCES``); empty for ``text``.
    source: str = ""
    #: The directory, or the repository's URL; for ``text``, who sent it (``slack modal``).
    location: str = ""
    #: The file within the directory or repository.
    path: str = ""
    #: The branch fetched (``git``).
    branch: str | None = None
    #: The commit the file was read at (``git``): every launch fetches the branch anew.
    commit: str | None = Field(default=None, pattern=r"^[0-9a-f]{40}$")

    def shown(self) -> str:
        """One line for people: ``ml@1a2b3c4 (specs/gpt.yaml)``, ``team/gpt.yaml``."""
        if self.kind == "git":
            return f"{self.source}@{(self.commit or '')[:7]} ({self.path})"
        if self.kind == "directory":
            return f"{self.source}/{self.path}"
        return f"pasted ({self.location})" if self.location else "pasted"

"""A run's code pinned to one commit when it is submitted (and when a resubmit moves it).

The spec names a repository and a ref; the control plane asks the repository (``git
ls-remote``, :func:`runner.code.resolve_ref`) which commit the ref names now and stores
it in the run's spec as ``code.commit``, so every attempt and every node, however late,
checks out the same commit. A ref that does not exist, or a repository that cannot be
read, refuses the submit with what to fix.
"""

from __future__ import annotations

from collections.abc import Mapping

from jobs.domain.errors import SpecError
from jobs.spec import JobSpec
from runner.code import CodeError, resolve_ref

__all__ = ["pin_code", "short_commit"]


def short_commit(commit: object) -> str:
    """A commit as people read it (seven characters)."""
    return str(commit)[:7] if commit else "(none)"


def pin_code(
    spec: JobSpec, *, environ: Mapping[str, str] | None = None, again: bool = True
) -> JobSpec:
    """``spec`` with ``code.commit`` set to what ``code.ref`` names now (the default
    branch without a ref; a commit given alone is kept, once the repository answers).
    ``again=False`` keeps a commit already pinned (a resubmit that did not change the
    ref). Raises :class:`SpecError` saying what to fix."""
    code = spec.code
    if code is None or code.repo is None:
        return spec
    if code.commit is not None and not again:
        return spec
    ref = code.ref or (code.commit if code.commit is not None else "HEAD")
    try:
        resolved = resolve_ref(code.repo, ref, environ=environ)
    except CodeError as exc:
        raise SpecError(str(exc), problems=[("code.ref", str(exc))]) from None
    pinned = code.model_copy(update={"commit": resolved.commit})
    return spec.model_copy(update={"code": pinned})

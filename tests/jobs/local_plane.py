"""The control plane's dependencies for the use-case tests: the local provider, a console
notifier, a journal kept in memory and a clock the test moves; what the instances and the
provider leave behind is cleaned up at the end."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from bot.console import ConsoleNotifier
from jobs.outbound.notify import CallbackJournal
from jobs.process.deps import Deps
from jobs.process.settings import Settings
from jobs.providers.local import LocalProvider


class Clock:
    """The control plane's clock (``Deps.clock``), moved by the test."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def _at_once(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
    fn(*args, **kwargs)


@contextmanager
def local_deps(
    settings: Settings,
    engine: Engine,
    root: Path,
    *,
    gpu_names: Sequence[str] | None = None,
    at_once: bool = False,
    **deps: Any,
) -> Iterator[Deps]:
    """Deps on a local provider under ``root / "local"``; ``deps.records`` keeps every
    journal record as ``{"type", "run", **data}``; ``at_once``: background work runs in
    the caller, so a use-case has done all it will when it returns."""
    records: list[dict[str, Any]] = []
    provider = LocalProvider(root / "local", gpu_names=gpu_names)
    made = Deps(
        settings=settings,
        engine=engine,
        provider=provider,
        notifier=ConsoleNotifier(io.StringIO()),
        journal=CallbackJournal(
            lambda t, run, data: records.append({"type": t, "run": run, **data})
        ),
        **deps,
    )
    made.records = records  # type: ignore[attr-defined]
    if at_once:
        made.background = _at_once  # type: ignore[method-assign]
    try:
        yield made
    finally:
        made.close()
        for instance in provider.list_instances():
            if not instance.state.is_terminal():
                provider.terminate(instance.instance_id)
        provider.close()


@contextmanager
def closing_each(build: Callable[..., Deps]) -> Iterator[Callable[..., Deps]]:
    """``build`` (Deps from a test's arguments), each Deps it makes closed with its provider
    at the end of the block: for a test that makes several, as replicas."""
    made: list[Deps] = []

    def make(*args: Any, **kwargs: Any) -> Deps:
        made.append(build(*args, **kwargs))
        return made[-1]

    try:
        yield make
    finally:
        for deps in made:
            deps.close()
            deps.provider.close()

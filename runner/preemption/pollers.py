"""Which metadata pollers a runner starts, from ``TRAINBOT_PREEMPTION_SOURCES`` and the
related variables (:mod:`runner.env`), validated before any thread starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from runner import env as contract
from runner.preemption.aws import AwsSpotPoller
from runner.preemption.flag import PreemptionConfigError, PreemptionFlag
from runner.preemption.gcp import GcpPreemptedPoller
from runner.preemption.metadata import Poller, PollerThread

T = TypeVar("T")
D = TypeVar("D")


class Pollers:
    """The pollers one runner started; stop them all on the way out."""

    def __init__(self, pollers: Sequence[Poller]) -> None:
        self.pollers = tuple(pollers)

    def stop(self) -> None:
        for poller in self.pollers:
            poller.stop()

    def __enter__(self) -> Pollers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def termination_window_s(env: Mapping[str, str] | None = None, *, default: float) -> float:
    """The termination window from ``TRAINBOT_TERMINATION_WINDOW_S``, else ``default``."""
    given = _setting(contract.TERMINATION_WINDOW_S, env)
    return default if given is None else given


def _setting(var: contract.Var[T, D], env: Mapping[str, str] | None) -> T | D:
    """``var`` from ``env``; a bad value is a :class:`PreemptionConfigError`, raised
    before any poller starts."""
    try:
        return var.get(env)
    except contract.EnvError as exc:
        hint = (
            "; set it to e.g. 120 (AWS) or 30 (GCP), or unset it for the provider's default"
            if var is contract.TERMINATION_WINDOW_S
            else ""
        )
        raise PreemptionConfigError(f"{exc}{hint}") from None


def _aws(flag: PreemptionFlag, env: Mapping[str, str]) -> PollerThread:
    return AwsSpotPoller(
        flag,
        base_url=_setting(contract.AWS_METADATA_URL, env),
        window_s=termination_window_s(env, default=contract.TERMINATION_WINDOWS_S["aws"]),
    )


def _gcp(flag: PreemptionFlag, env: Mapping[str, str]) -> PollerThread:
    return GcpPreemptedPoller(
        flag,
        base_url=_setting(contract.GCP_METADATA_URL, env),
        window_s=termination_window_s(env, default=contract.TERMINATION_WINDOWS_S["gcp"]),
    )


#: Preemption source (a provider's ``Capabilities.preemption_source``, as the control
#: plane sends it in ``TRAINBOT_PREEMPTION_SOURCES``) → the poller that hears its notice.
#: "none" (or "signal", the local provider's): SIGTERM alone, no poller.
POLLERS: Mapping[str, Callable[[PreemptionFlag, Mapping[str, str]], PollerThread]] = {
    "aws": _aws,
    "gcp": _gcp,
}
_NO_POLLER = ("none", "signal")


def _parse_sources(sources: str) -> list[str]:
    names = [part.strip().lower() for part in sources.split(",") if part.strip()]
    known = " and ".join(repr(name) for name in POLLERS)
    unknown = [name for name in names if name not in POLLERS and name not in _NO_POLLER]
    if unknown:
        raise PreemptionConfigError(
            f"unknown preemption source {unknown[0]!r} in {sources!r}; use a comma list of "
            f"{known}, or 'none' for a local run"
        )
    if any(name in _NO_POLLER for name in names) and len(names) > 1:
        raise PreemptionConfigError(
            f"preemption sources {sources!r} combine 'none' with others; give either "
            f"'none' or a list of {known}"
        )
    return list(dict.fromkeys(name for name in names if name not in _NO_POLLER))


def start_pollers(
    flag: PreemptionFlag, *, sources: str, env: Mapping[str, str] | None = None
) -> Pollers:
    """Start the metadata pollers named in ``sources`` ("aws", "gcp", "aws,gcp", "none"
    or "" for local runs). Everything is validated before any thread starts."""
    env = os.environ if env is None else env
    pollers = [POLLERS[name](flag, env) for name in _parse_sources(sources)]
    for poller in pollers:
        poller.start()
    return Pollers(pollers)

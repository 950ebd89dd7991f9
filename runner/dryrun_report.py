"""The dry run's report, and a cloud dry run's posts of it: ``POST /v1/dry-run``.

:class:`DryRunReport` is what ``trainbot-runner dry-run`` measured; it lives here, apart
from :mod:`runner.dryrun`, so the control plane reads one without importing torch.

The control plane starts ``trainbot-runner dry-run`` on a cheap instance with
``TRAINBOT_DRY_RUN_ID``, ``TRAINBOT_INGEST_URL`` and the dry run's own
``TRAINBOT_TOKEN``; the runner then says when it started, when the first phase saved,
and sends its report (:mod:`runner.wire.dry_run`). Progress is best effort; the report
is retried, because the control plane waits for it, and then terminates the instance.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import KW_ONLY, asdict, dataclass, field

from runner import env as contract
from runner.errors import RunnerError
from runner.store.broker import post_request, route_url
from runner.wire.dry_run import DRY_RUN_ROUTE, encode_dry_run_post

__all__ = ["DRY_RUN_ID_ENV", "DryRunReport", "DryRunReports"]

log = logging.getLogger(__name__)

#: Set by the control plane on a dry run's instance: the id its reports name.
DRY_RUN_ID_ENV = contract.DRY_RUN_ID.name


@dataclass
class DryRunReport:
    """What the dry run measured and whether the round trip held."""

    ok: bool = False
    steps_before_kill: int = 0
    steps_after_restore: int = 0
    step_time_s: float | None = None
    checkpoint_bytes: int | None = None
    write_s: float | None = None
    #: Seconds a periodic save blocked the loop (median over the saves after the first,
    #: which also allocates the staging buffers); None from a runner that does not say.
    stall_s: float | None = None
    restore_s: float | None = None
    saved_sha256: str | None = None
    restored_sha256: str | None = None
    mtbp_s: float = 3600.0
    #: Daly's interval for C = the stall, floored at the write time, if every preemption
    #: lost the work since the last checkpoint (no emergency checkpoint).
    daly_interval_s: float | None = None
    #: Whether an emergency checkpoint fits each provider's termination window.
    emergency_fits: dict[str, bool] = field(default_factory=dict)
    #: The data sample (``TRAINBOT_DATA_URI``) as this machine's own credentials read it,
    #: where the dry run was asked to read it (a cloud dry run's instance).
    sample_uri: str | None = None
    sample_objects: int | None = None
    sample_bytes: int | None = None
    #: Seconds the run's code and setup took before the first phase (checkout, then setup
    #: or its environment restored); None: the run names neither.
    setup_s: float | None = None
    #: What was made ready, in words (the commit, setup's time, the environment's key).
    setup: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def lines(self) -> list[str]:
        def fmt(v: float | None, unit: str) -> str:
            return "n/a" if v is None else f"{v:.3f}{unit}"

        out = [
            f"dry run: {'PASSED' if self.ok else 'FAILED'}",
            f"  step time        {fmt(self.step_time_s, ' s')}",
            f"  checkpoint       {self.checkpoint_bytes or 0:,} bytes, "
            f"write {fmt(self.write_s, ' s')}, restore {fmt(self.restore_s, ' s')}, "
            f"stall {fmt(self.stall_s, ' s')}",
            f"  state after restore bit-identical: {self.saved_sha256 == self.restored_sha256}",
            f"  Daly interval    {fmt(self.daly_interval_s, ' s')} for MTBP {self.mtbp_s:.0f} s",
        ]
        if self.setup_s is not None:
            out.append(f"  code and setup   {fmt(self.setup_s, ' s')}: {'; '.join(self.setup)}")
        for name, fits in sorted(self.emergency_fits.items()):
            window = contract.TERMINATION_WINDOWS_S[name]
            out.append(f"  emergency checkpoint within {name}'s {window:.0f} s window: {fits}")
        out.extend(f"  problem: {p}" for p in self.problems)
        return out


@dataclass(frozen=True)
class DryRunReports:
    """Posts one dry run's phases and report to the control plane."""

    #: The control plane's dry-run route (:data:`DRY_RUN_ROUTE` beside the ingest URL).
    url: str
    token: str = field(repr=False)
    dry_run_id: str
    _: KW_ONLY
    tries: int = 6
    backoff_s: float = 1.0
    timeout_s: float = 10.0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DryRunReports | None:
        """The reporter the control plane configured, or None for a dry run a person runs."""
        dry_run_id = contract.DRY_RUN_ID.get(env)
        if not dry_run_id:
            return None
        url, token = contract.INGEST_URL.get(env), contract.TOKEN.get(env)
        if not url or not token:
            raise RunnerError(
                f"{DRY_RUN_ID_ENV} is set, but TRAINBOT_INGEST_URL or TRAINBOT_TOKEN is not: "
                "the control plane sets all three on a dry run's instance"
            )
        return cls(route_url(url, DRY_RUN_ROUTE), token, dry_run_id)

    def progress(self, phase: str) -> None:
        """Say where the dry run stands; a failure is logged, not raised."""
        try:
            self._post(phase, None, tries=2)
        except RunnerError as exc:
            log.warning("could not tell the control plane the dry run %s: %s", phase, exc)

    def finish(self, report: DryRunReport) -> None:
        """Send the report; raises RunnerError when the control plane never took it."""
        self._post("finished", asdict(report), tries=self.tries)

    def _post(self, phase: str, report: dict[str, object] | None, *, tries: int) -> None:
        body = encode_dry_run_post(self.dry_run_id, phase, report)
        request = post_request(self.url, self.token, body)
        for attempt in range(1, tries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    reply.read()
                return
            except urllib.error.HTTPError as exc:
                problem = f"HTTP {exc.code}"
                if exc.code < 500:  # refused: the token was revoked, or the body is wrong
                    raise RunnerError(
                        f"the control plane at {self.url} refused it ({problem})"
                    ) from None
            except OSError as exc:  # unreachable, reset, timed out
                problem = str(getattr(exc, "reason", exc))
            if attempt == tries:
                raise RunnerError(
                    f"could not reach the control plane at {self.url} ({problem}): check that "
                    "it is reachable from this instance"
                )
            time.sleep(self.backoff_s * 2 ** (attempt - 1))

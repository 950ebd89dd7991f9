"""What a run is planned with before any check answers: its resources in the provider's
terms, the preemption rate to assume, its step count, and the checkpoint interval.

The interval is Daly's optimum from the dry run's measured costs
(:func:`runner.preemption.choose_interval`), unless the spec fixes one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from jobs.domain.format import duration
from jobs.providers.base import Provider, ProviderError, ResourceRequest
from jobs.spec import JobSpec, Resources
from runner.preemption import IntervalChoice, choose_interval

__all__ = [
    "DEFAULT_SPOT_MTBP_S",
    "assumed_mtbp_s",
    "checkpoint_interval",
    "interval_choice",
    "interval_text",
    "resource_request",
    "resources_request",
    "target_steps",
]

#: Mean time between preemptions assumed for spot capacity when nothing better is known.
#: Published spot interruption rates are mostly under 5 % a month per instance, but the
#: GPU types people want are reclaimed far more often; 6 hours keeps Daly's interval short.
DEFAULT_SPOT_MTBP_S = 6 * 3600.0

#: Command-line flags whose value is the run's total number of steps (argparse style).
_STEP_FLAGS = ("--steps", "--max-steps", "--max_steps")


def resource_request(
    spec: JobSpec, provider: Provider, *, spot: bool | None = None
) -> ResourceRequest:
    """The spec's resources in ``provider``'s terms (the provider the spec runs on), in
    the first of ``resources.regions``, or the provider's own default region (its
    ``TRAINBOT_AWS_REGION``…) when the spec names none; each region's own request is
    :func:`request_in`, which the checks ask with several regions.
    ``spot`` overrides the spec's market (an on-demand fallback attempt)."""
    return resources_request(spec.resources, provider, spot=spot)


def request_in(spec: JobSpec, region: str, *, spot: bool, provider: Provider) -> ResourceRequest:
    """The spec's request on ``provider`` for one region: its listed zones there, or any
    zone of it."""
    base = resources_request(spec.resources, provider, spot=spot, region=region)
    return replace(base, zones=tuple(spec.resources.zones_in(region)))


def resources_request(
    res: Resources, provider: Provider, *, spot: bool | None = None, region: str | None = None
) -> ResourceRequest:
    """:func:`resource_request` of the resources section alone (one instance's share);
    ``region`` overrides the spec's."""
    acc = res.accelerator
    region = region or res.region or provider.capabilities.default_region
    if region is None:
        raise ProviderError(
            f"the {provider.name} provider has no default region: set resources.region "
            "in the spec, or configure the provider's region"
        )
    return ResourceRequest(
        cloud=provider.name,
        region=region,
        zones=tuple(res.zones),
        accelerator_type=acc.type if acc is not None else None,
        accelerator_count=acc.count if acc is not None else 0,
        instance_type=res.instance_type,
        spot=res.spot if spot is None else spot,
        instances=res.instances,
        image_id=res.image_id,
    )


def assumed_mtbp_s(provider: Provider) -> float:
    """Mean seconds between preemptions to plan for: the provider's declared mean (the
    local provider's configured one), else :data:`DEFAULT_SPOT_MTBP_S`."""
    return provider.capabilities.mean_time_between_preemptions_s or DEFAULT_SPOT_MTBP_S


def target_steps(command: Sequence[str]) -> int | None:
    """The run's total steps from ``--steps N`` / ``--steps=N`` (last one wins), if given."""
    found: int | None = None
    for i, arg in enumerate(command):
        flag, eq, value = arg.partition("=")
        if flag not in _STEP_FLAGS:
            continue
        if not eq:
            value = command[i + 1] if i + 1 < len(command) else ""
        try:
            steps = int(value)
        except ValueError:
            continue
        if steps > 0:
            found = steps
    return found


def interval_choice(
    *,
    write_s: float | None,
    stall_s: float | None,
    mtbp_s: float,
    flush_fits_window: bool,
) -> IntervalChoice | None:
    """The ``"auto"`` interval and its figures (:func:`runner.preemption.choose_interval`):
    Daly's √(2CM) − C with C the stall of a save (the writer is asynchronous), floored at
    the write time, and M the mean time between preemptions that lose work. None without
    a measured write time."""
    if write_s is None or not write_s > 0:
        return None
    return choose_interval(
        write_s=write_s, stall_s=stall_s, mtbp_s=mtbp_s, flush_fits_window=flush_fits_window
    )


def checkpoint_interval(
    spec: JobSpec,
    *,
    write_s: float | None,
    mtbp_s: float,
    stall_s: float | None = None,
    flush_fits_window: bool = False,
) -> float | None:
    """Seconds between checkpoints: the spec's, or for ``"auto"`` :func:`interval_choice`'s.

    ``None`` when the spec says ``"auto"`` and there is no measured write time. Without a
    measured stall, C is the write time (a synchronous save).
    """
    fixed = spec.checkpoint.interval_s
    if fixed is not None:
        return fixed
    choice = interval_choice(
        write_s=write_s, stall_s=stall_s, mtbp_s=mtbp_s, flush_fits_window=flush_fits_window
    )
    return None if choice is None else choice.interval_s


def interval_text(spec: JobSpec, interval: float | None, choice: IntervalChoice | None) -> str:
    """The chosen interval in words, with where it came from."""
    if interval is None:
        return "unknown (no checkpoint time measured)"
    if spec.checkpoint.interval_s is not None or choice is None:
        return f"{duration(interval)} (from the spec)"
    floor = " (the write time: one save at a time)" if interval <= choice.floor_s else ""
    return (
        f"{duration(interval)}{floor}: Daly's optimum for {duration(choice.cost_s)} lost per "
        f"save and a preemption losing work every {duration(choice.mtbp_s)}"
    )

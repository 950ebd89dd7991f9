"""The contract every Provider passes: local, AWS (moto) and GCP (a fake Compute API).

Use it by subclassing ``ProviderContract`` in a test module that defines these fixtures
(at module level or on the subclass):

- ``provider``: the Provider under test, torn down by the fixture.
- ``resource_request``: a ResourceRequest the provider can launch right now.
- ``workload``: a command that runs for at least a minute and exits 75 on SIGTERM, as
  ``trainbot-runner exec`` does (a cloud fake may ignore it).

``unknown_instance_id`` may be overridden with an id in the provider's own format.
The module is not named ``test_*`` so pytest collects it only through a subclass.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import suppress

import pytest

from jobs.providers.base import (
    TAG_ATTEMPT_ID,
    TAG_MANAGED,
    TAG_RUN_ID,
    InstanceInfo,
    InstanceNotFound,
    InstanceState,
    InstanceStatus,
    LaunchRequest,
    PriceQuote,
    Provider,
    ProviderError,
    QuotaInfo,
    ResourceRequest,
    Unsupported,
    ZoneCapacity,
)
from runner.preemption.pollers import POLLERS

Launch = Callable[..., InstanceInfo]


def wait_for_state(
    provider: Provider,
    instance_id: str,
    states: Collection[InstanceState],
    *,
    timeout_s: float = 10.0,
) -> InstanceStatus:
    """Poll ``status`` until it is one of ``states``; fail with the last status seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = provider.status(instance_id)
        if status.state in states:
            return status
        if time.monotonic() >= deadline:
            wanted = ", ".join(s.value for s in states)
            raise AssertionError(
                f"{instance_id} still {status.state.value} ({status.reason}) after"
                f" {timeout_s} s; wanted {wanted}"
            )
        time.sleep(0.02)


def launch_request(
    request: ResourceRequest,
    command: Sequence[str],
    *,
    zone: str,
    run_id: str | None = None,
    attempt_id: str = "attempt-1",
    key: str | None = None,
    env: dict[str, str] | None = None,
    scratch_bytes: int = 1 << 30,
) -> LaunchRequest:
    """A launch request as the service layer builds one, with a fresh run id by default."""
    run_id = run_id or f"run-{uuid.uuid4().hex[:8]}"
    return LaunchRequest(
        run_id=run_id,
        attempt_id=attempt_id,
        owner="U0TEST",
        request=request,
        zone=zone,
        command=list(command),
        env=env if env is not None else {"TRAINBOT_RUNNER_TOKEN": "contract-token"},
        scratch_bytes=scratch_bytes,
        idempotency_key=key or f"{run_id}/{attempt_id}",
        spot=request.spot,
    )


class ProviderContract:
    """Behaviour the service layer and the reconcile job rely on, for any provider."""

    @pytest.fixture
    def unknown_instance_id(self) -> str:
        return "i-0123456789abcdef0"

    @pytest.fixture
    def launch_zone(self, provider: Provider, resource_request: ResourceRequest) -> str:
        zones = [z for z in provider.capacity(resource_request) if z.available]
        assert zones, "the contract's resource_request must be launchable"
        return zones[0].zone

    @pytest.fixture
    def launch(
        self,
        provider: Provider,
        resource_request: ResourceRequest,
        workload: Sequence[str],
        launch_zone: str,
    ) -> Iterator[Launch]:
        """Launch the workload; everything launched is terminated at teardown."""
        launched: list[str] = []

        def _launch(
            *, run_id: str | None = None, attempt_id: str = "attempt-1", key: str | None = None
        ) -> InstanceInfo:
            req = launch_request(
                resource_request,
                workload,
                zone=launch_zone,
                run_id=run_id,
                attempt_id=attempt_id,
                key=key,
            )
            info = provider.launch(req)
            launched.append(info.instance_id)
            return info

        yield _launch
        for instance_id in dict.fromkeys(launched):
            with suppress(ProviderError):
                provider.terminate(instance_id)

    # -- questions ------------------------------------------------------------------------

    def test_quota_reports_consistent_figures(
        self, provider: Provider, resource_request: ResourceRequest
    ) -> None:
        quota = provider.quota(resource_request)
        assert isinstance(quota, QuotaInfo)
        assert quota.unit and quota.detail
        assert quota.needed > 0
        assert quota.ok == (quota.used + quota.needed <= quota.limit)
        assert quota.ok, "the contract's resource_request must fit the quota"
        assert quota.remedy == ""

    def test_quota_refuses_an_oversized_request_and_says_what_to_do(
        self, provider: Provider, resource_request: ResourceRequest
    ) -> None:
        huge = dataclasses.replace(
            resource_request,
            accelerator_count=10_000,
            cpus=(resource_request.cpus or 1) * 100_000,
        )
        quota = provider.quota(huge)
        assert not quota.ok
        assert quota.used + quota.needed > quota.limit
        assert quota.remedy

    def test_capacity_ranks_available_zones_first(
        self, provider: Provider, resource_request: ResourceRequest
    ) -> None:
        zones = provider.capacity(resource_request)
        assert zones and all(isinstance(z, ZoneCapacity) for z in zones)
        assert zones[0].available
        available = [z.available for z in zones]
        assert available == sorted(available, reverse=True)
        scores = [z.score for z in zones if z.available and z.score is not None]
        assert scores == sorted(scores, reverse=True)
        assert len({z.zone for z in zones}) == len(zones)

    def test_price_is_per_hour_with_spot_no_dearer_than_on_demand(
        self, provider: Provider, resource_request: ResourceRequest, launch_zone: str
    ) -> None:
        quote = provider.price(resource_request, zone=launch_zone)
        assert isinstance(quote, PriceQuote)
        assert 0 < quote.spot_usd_per_hour <= quote.on_demand_usd_per_hour
        assert quote.source
        assert quote.as_of.tzinfo is not None

    def test_instance_type_for_holds_exactly_what_it_is_asked(
        self, provider: Provider, resource_request: ResourceRequest
    ) -> None:
        """A CPU-only request has no accelerator type to hold; one no type holds (10,000
        accelerators) has none; an answer is a type name the provider prices."""
        cpu = dataclasses.replace(resource_request, accelerator_type=None, accelerator_count=0)
        assert provider.instance_type_for(cpu) is None
        for count in (1, 8):
            asked = dataclasses.replace(
                resource_request,
                accelerator_type=resource_request.accelerator_type or "A100",
                accelerator_count=count,
                instance_type=None,
            )
            found = provider.instance_type_for(asked)
            assert found is None or (isinstance(found, str) and found)
            if found is not None:
                quote = provider.price(dataclasses.replace(asked, instance_type=found))
                assert quote.on_demand_usd_per_hour > 0
        huge = dataclasses.replace(resource_request, accelerator_count=10_000)
        assert provider.instance_type_for(huge) is None

    def test_the_dry_run_request_is_one_instance_no_dearer_than_the_run_s(
        self, provider: Provider, resource_request: ResourceRequest, launch_zone: str
    ) -> None:
        """The dry run's instance comes from the catalog: of the run's accelerator, with
        no more of them, in the run's region and market, priced no higher."""
        cheap = provider.dry_run_request(resource_request)
        assert isinstance(cheap, ResourceRequest)
        assert cheap.region in (resource_request.region, provider.capabilities.default_region)
        assert cheap.spot == resource_request.spot
        assert cheap.accelerator_count <= max(resource_request.accelerator_count, 1)
        if resource_request.accelerator_count:
            assert cheap.accelerator_count >= 1
        run_price = provider.price(resource_request, zone=launch_zone).on_demand_usd_per_hour
        assert provider.price(cheap, zone=launch_zone).on_demand_usd_per_hour <= run_price

    def test_capabilities_say_what_callers_may_rely_on(
        self, provider: Provider, resource_request: ResourceRequest, unknown_instance_id: str
    ) -> None:
        """Callers decide by the declared capabilities alone, so each optional method
        works exactly where they say it does, and refuses (``Unsupported``) elsewhere."""
        caps = provider.capabilities
        assert caps.termination_window_s > 0
        # A source the runner hears: one of its pollers', or SIGTERM alone.
        assert caps.preemption_source in ("signal", *POLLERS)
        assert isinstance(provider, Provider)
        if not caps.cloud_budgets:
            with pytest.raises(Unsupported):
                provider.create_budget(run_id="r-contract", usd=10.0, thresholds=[50, 100])
            with pytest.raises(Unsupported):
                provider.delete_budget(run_id="r-contract")
        else:
            provider.delete_budget(run_id="r-contract-never")  # one never made: not an error
        if not caps.instance_logs:
            with pytest.raises(Unsupported):
                provider.instance_log("anything", lines=5)
        else:
            with pytest.raises(InstanceNotFound):
                provider.instance_log(unknown_instance_id, lines=5)
        if not caps.permission_probe:
            with suppress(Unsupported):  # a provider without a probe may also just allow
                provider.check_launch_permissions(resource_request)

    def test_bucket_location_is_none_when_unknowable(self, provider: Provider) -> None:
        assert provider.bucket_location("ftp://example.invalid/data") is None

    # -- instances ------------------------------------------------------------------------

    def test_launched_instance_runs(self, provider: Provider, launch: Launch) -> None:
        info = launch(run_id="run-runs", attempt_id="attempt-7")
        assert info.instance_id
        assert (info.run_id, info.attempt_id) == ("run-runs", "attempt-7")
        assert info.launched_at.tzinfo is not None
        status = wait_for_state(provider, info.instance_id, {InstanceState.RUNNING})
        assert status.instance_id == info.instance_id
        assert not status.state.is_terminal()

    def test_launch_is_idempotent_on_its_key(self, provider: Provider, launch: Launch) -> None:
        run_id = f"run-{uuid.uuid4().hex[:8]}"
        first = launch(run_id=run_id, key=f"{run_id}-key")
        again = launch(run_id=run_id, key=f"{run_id}-key")
        assert again.instance_id == first.instance_id
        mine = [i for i in provider.list_instances() if i.run_id == run_id]
        assert [i.instance_id for i in mine] == [first.instance_id]

    def test_distinct_keys_launch_distinct_instances(
        self, provider: Provider, launch: Launch
    ) -> None:
        run_id = f"run-{uuid.uuid4().hex[:8]}"
        a = launch(run_id=run_id, attempt_id="attempt-1")
        b = launch(run_id=run_id, attempt_id="attempt-2")
        assert a.instance_id != b.instance_id

    def test_list_instances_carries_run_and_attempt_tags(
        self, provider: Provider, launch: Launch
    ) -> None:
        info = launch(attempt_id="attempt-3")
        listed = {i.instance_id: i for i in provider.list_instances()}
        assert info.instance_id in listed
        found = listed[info.instance_id]
        assert (found.run_id, found.attempt_id) == (info.run_id, "attempt-3")
        assert found.tags[TAG_RUN_ID] == info.run_id
        assert found.tags[TAG_ATTEMPT_ID] == "attempt-3"
        assert TAG_MANAGED in found.tags

    def test_terminate_is_idempotent_and_ends_terminated(
        self, provider: Provider, launch: Launch
    ) -> None:
        info = launch()
        wait_for_state(provider, info.instance_id, {InstanceState.RUNNING})
        provider.terminate(info.instance_id)
        provider.terminate(info.instance_id)
        status = wait_for_state(provider, info.instance_id, {InstanceState.TERMINATED})
        assert status.state.is_terminal()
        provider.terminate(info.instance_id)
        assert provider.status(info.instance_id).state is InstanceState.TERMINATED

    def test_unknown_instance_is_not_found(
        self, provider: Provider, unknown_instance_id: str
    ) -> None:
        with pytest.raises(InstanceNotFound) as status_error:
            provider.status(unknown_instance_id)
        assert status_error.value.instance_id == unknown_instance_id
        assert unknown_instance_id in str(status_error.value)
        with pytest.raises(InstanceNotFound):
            provider.terminate(unknown_instance_id)

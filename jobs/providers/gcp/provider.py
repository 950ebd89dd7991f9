"""``GcpProvider``: the Provider Protocol over Compute Engine, and the registry's factories.

The class holds the options and answers the Protocol; the work is in the modules beside
it: catalog (machine types, prices), quota (quota, capacity), launch, status, buckets.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.providers import base, gang
from jobs.providers.gcp import secrets
from jobs.providers.gcp.api import ComputeApi
from jobs.providers.gcp.buckets import bucket_location
from jobs.providers.gcp.catalog import PRICES_PATH, Catalog
from jobs.providers.gcp.images import Images
from jobs.providers.gcp.launch import (
    DEFAULT_IMAGE,
    STARTUP_SCRIPT_PATH,
    InstanceTemplate,
    insert,
    instance_body,
)
from jobs.providers.gcp.names import instance_name, last, policy_name, region_of_zone
from jobs.providers.gcp.policies import CompactPolicies
from jobs.providers.gcp.quota import Placement
from jobs.providers.gcp.settings import GcpSettings
from jobs.providers.gcp.status import Instances
from jobs.providers.options import by_name
from jobs.providers.runner_install import (
    RunnerInstall,
    boot_config,
    prepare_in_background,
)
from runner.preemption import WINDOWS_S
from runner.secrets import SecretRef

if TYPE_CHECKING:
    from jobs.process.settings import Settings

__all__ = ["GcpProvider", "from_settings", "make"]

log = logging.getLogger(__name__)

#: Why ``create_budget`` and ``delete_budget`` are refused (``Capabilities.cloud_budgets``).
_NO_BUDGETS = "the gcp provider does not create Cloud Billing budgets yet"


class GcpProvider:
    """Spot (or on-demand) GPU instances in one Compute Engine project, in any of its
    regions: ``region`` is where a spec naming none runs, and each request names its own.

    Clients are built on first use, so a missing credential shows up as a preflight
    failure that says how to fix it, not as a control plane that will not start.
    """

    name = "gcp"

    def __init__(
        self,
        *,
        project: str,
        region: str,
        zones: Sequence[str] | None = None,
        regions: Sequence[str] = (),
        machine_type_for: Mapping[str, str] | None = None,
        image: str = DEFAULT_IMAGE,
        service_account: str | None = None,
        api_endpoint: str | None = None,
        credentials: Any = None,
        network: str = "global/networks/default",
        subnetwork: str | None = None,
        external_ip: bool = True,
        runner: RunnerInstall | None = None,
        boot_disk_gb: int = 50,
        startup_script: Path | str | None = None,
        prices: Path | str | None = None,
        storage_endpoint: str | None = None,
        launch_timeout_s: float = 300.0,
        call_timeout_s: float = 60.0,
        stockout_cooldown_s: float = 900.0,
        policy_retry_s: float = 30.0,
        policy_sweep_s: float = 300.0,
        secrets_prefix: str = secrets.DEFAULT_SECRETS_PREFIX,
        secrets_endpoint: str | None = None,
    ) -> None:
        """``machine_type_for`` maps ``TYPE:COUNT`` or ``TYPE`` (``A100:8``,
        ``nvidia-l4``; ``cpu`` for CPU-only runs) to a machine type, over the built-in
        choice. ``boot_disk_gb`` is added to the attempt's scratch size. A zone that ran out
        of a type is ranked unavailable for ``stockout_cooldown_s``. ``zones`` may name
        zones of several regions; a request in a region none of them is in may use any zone
        of it. ``regions``: the other regions runs may fail over to (the specs'
        ``resources.regions``); a multi- or dual-region bucket that covers one of them, and
        not ``region``, is placed there. The deletion of a gang's placement policy, refused
        while its nodes are still going, is tried again at most every ``policy_retry_s``;
        the policies of these regions that gangs left behind (the control plane restarted
        between their nodes' going and the policy's deletion) are looked for at most every
        ``policy_sweep_s``. The launch options (``image`` to ``startup_script``, the fields
        of :class:`InstanceTemplate`) are kept as ``template``, read at each launch;
        ``image`` defaults to a Deep Learning VM family, and a spec's
        ``resources.image_id`` wins over it. ``runner``: how instances get the runner,
        pinned to this control plane's version (default here: ``trainbot==<version>``
        from pip's index; ``from_settings`` defaults to the control plane's own wheel, which
        it serves)."""
        if not project or not region:
            raise base.ProviderError("the GCP provider needs a project and a region (us-central1)")
        startup_script = Path(startup_script) if startup_script else STARTUP_SCRIPT_PATH
        #: The launch options; a caller may replace it (``dataclasses.replace``) between
        #: launches.
        self.template = by_name(InstanceTemplate, locals())
        self.runner = runner or RunnerInstall(mode="index")
        self.project = project
        self.region = region
        self.zones = tuple(zones or ())
        self.regions = tuple(r for r in dict.fromkeys(regions) if r and r != region)
        self.machine_type_for = {k.lower(): v for k, v in (machine_type_for or {}).items()}
        self.api_endpoint = api_endpoint
        self.prices_path = Path(prices) if prices else PRICES_PATH
        self.storage_endpoint = storage_endpoint or api_endpoint or "https://storage.googleapis.com"
        self.launch_timeout_s = launch_timeout_s
        #: ``gcp-sm://`` secrets: the ids the runner may read, and Secret Manager's API.
        self.secrets_prefix = secrets_prefix
        self.secrets_endpoint = secrets_endpoint or secrets.DEFAULT_SECRETS_ENDPOINT
        self.call_timeout_s = call_timeout_s
        self.stockout_cooldown_s = stockout_cooldown_s
        # The project, endpoint, timeouts, prices and machine types are fixed from here on.
        self._api = ComputeApi(
            project=project,
            api_endpoint=api_endpoint,
            credentials=credentials,
            call_timeout_s=call_timeout_s,
        )
        self._catalog = Catalog(
            prices_path=self.prices_path, machine_type_for=self.machine_type_for
        )
        self._placement = Placement(self._api, self._catalog)
        self._instances = Instances(self._api)
        self._policies = CompactPolicies(self._api, retry_s=policy_retry_s, sweep_s=policy_sweep_s)
        self._images = Images(self._api)

    @property
    def startup_script(self) -> Path:
        """The startup script every instance runs (the template's)."""
        return self.template.startup_script

    # -- Provider: questions --------------------------------------------------------------

    @property
    def capabilities(self) -> base.Capabilities:
        """A cloud: commands never run on the control plane. Thirty seconds' notice
        through the metadata server; gangs under a compact placement policy; no cloud
        budgets or permission probe yet."""
        return base.Capabilities(
            runs_on_this_machine=False,
            termination_window_s=WINDOWS_S["gcp"],
            preemption_source="gcp",
            default_region=self.region,
            gang_placement="compact placement policy",
        )

    def create_budget(self, *, run_id: str, usd: float, thresholds: Sequence[int]) -> str:
        raise base.Unsupported(_NO_BUDGETS)

    def delete_budget(self, *, run_id: str) -> None:
        raise base.Unsupported(_NO_BUDGETS)

    def check_launch_permissions(
        self, req: base.ResourceRequest, *, zone: str | None = None
    ) -> None:
        raise base.Unsupported("the gcp provider has no permission probe")

    def instance_log(self, instance_id: str, *, lines: int) -> str:
        raise base.Unsupported("the gcp provider keeps logs on the instance")

    def close(self) -> None:
        """Nothing to release: the Compute clients close with the process."""

    def quota(self, req: base.ResourceRequest) -> base.QuotaInfo:
        """The regional metric for the type (preemptible for spot, when the project has
        any), and GPUS_ALL_REGIONS; the tighter of the two binds."""
        return self._placement.quota(req, region=self._region(req))

    def capacity(self, req: base.ResourceRequest) -> list[base.ZoneCapacity]:
        """Zones of the request's region that offer the type (acceleratorTypes), available
        first; a zone that ran out of the type lately is ranked unavailable. First, that
        the boot image exists (a ProviderError saying what to set when not: preflight
        shows it)."""
        self._images.check(req.image_id or self.template.image)
        region = self._region(req)
        return self._placement.capacity(
            req,
            region=region,
            zones=self._zones_in(region),
            cooldown_s=self.stockout_cooldown_s,
        )

    def instance_type_for(self, req: base.ResourceRequest) -> str | None:
        """The machine type that carries exactly the request's GPUs, if one does."""
        return self._catalog.exact_machine_type(req)

    def dry_run_request(
        self, req: base.ResourceRequest, *, instance_type: str | None = None
    ) -> base.ResourceRequest:
        """One instance of the cheapest machine for the dry run (see the catalog's)."""
        return self._catalog.dry_run_request(
            replace(req, region=self._region(req)), instance_type=instance_type
        )

    def price(self, req: base.ResourceRequest, *, zone: str | None = None) -> base.PriceQuote:
        """From the shipped table: machine vCPUs and memory plus GPUs, per region."""
        region = region_of_zone(zone) if zone else self._region(req)
        return self._catalog.price(req, region=region)

    def secret_problem(self, ref: SecretRef) -> tuple[str, str] | None:
        """Whether a ``gcp-sm://`` secret exists and the runner's service account may
        read it (its metadata and IAM policy; never its value)."""
        return secrets.secret_problem(
            session=self._api.storage_session(),
            endpoint=self.secrets_endpoint,
            ref=ref,
            prefix=self.secrets_prefix,
            service_account=self.template.service_account,
            timeout_s=self.call_timeout_s,
        )

    def bucket_location(self, uri: str) -> base.BucketLocation | None:
        """Where a ``gs://`` bucket is, a multi- or dual-region with every region it
        covers; other URIs are None."""
        return bucket_location(self._api, uri, endpoint=self.storage_endpoint)

    # -- Provider: instances --------------------------------------------------------------

    def launch(self, req: base.LaunchRequest) -> base.InstanceInfo:
        """Insert the attempt's instance and wait for the insert to finish; for a gang
        (``req.nodes`` above 1), its nodes, all in one zone under one compact placement
        policy, all or none (:mod:`jobs.providers.gang`).

        A stockout raises CapacityError naming the zone (and ranks it unavailable for
        a while); a quota refusal raises QuotaExceeded; a name already taken adopts it.
        """
        if not req.command:
            raise base.ProviderError(
                f"run {req.run_id} attempt {req.attempt_id}: the launch command is empty;"
                " the spec needs a command to run"
            )
        res = req.request
        wanted = self._region(res)
        zone = req.zone or self._placement.first_zone(
            res, region=wanted, zones=self._zones_in(wanted), cooldown_s=self.stockout_cooldown_s
        )
        region = region_of_zone(zone)
        if res.region not in ("", "local") and res.region != region:
            raise base.ProviderError(
                f"zone {zone} is not in region {res.region}: fix resources.zones or the region"
            )
        # Chosen once: every node of a gang goes to this zone, whatever capacity says later.
        req = replace(req, zone=zone)
        runner = self._runner_config(req)
        if req.nodes < 2:
            return self._launch_one(req, runner=runner)
        policy = (region, policy_name(req.placement_group))
        path = self._policies.ensure(*policy, nodes=req.nodes, timeout_s=self.launch_timeout_s)
        try:
            info = gang.launch(
                functools.partial(self._launch_one, runner=runner, resource_policies=(path,)),
                req,
                terminate_one=self._instances.terminate,
            )
        except base.ProviderError:
            # gang.launch has deleted the nodes it started; the policy goes after them.
            self._policies.release((), [policy])
            raise
        self._policies.remember(gang.node_ids(info.instance_id), policy)
        return info

    def _runner_config(self, req: base.LaunchRequest) -> dict[str, Any]:
        """The installer's configuration for ``req``'s instances; in "wheel" mode the
        control plane's wheel is served to them (``GET /v1/runner-wheel``)."""
        return boot_config(
            self.runner,
            req.env,
            run_id=req.run_id,
            setting=GcpSettings.PREFIX,
            token_from="gce-metadata",
        )

    def _launch_one(
        self,
        req: base.LaunchRequest,
        *,
        runner: Mapping[str, Any],
        resource_policies: Sequence[str] = (),
    ) -> base.InstanceInfo:
        """Insert one instance (one node of a gang) in ``req.zone`` and read it back."""
        zone = req.zone
        name = instance_name(req.run_id, req.attempt_id, node=req.node_rank)
        body = instance_body(
            req,
            catalog=self._catalog,
            template=self.template,
            runner=runner,
            resource_policies=resource_policies,
        )
        kind = self._catalog.kind(req.request)
        try:
            created = insert(self._api, req, body=body, kind=kind, timeout_s=self.launch_timeout_s)
        except base.CapacityError:
            self._placement.ran_out(zone, kind)
            raise
        if not created:
            return self._instances.adopt(zone, name, req)
        return self._instances.info(
            self._instances.get(zone, name, what=f"read instance {name} in {zone}")
        )

    def status(self, instance_id: str) -> base.InstanceStatus:
        """Instance status, plus the zone's preemption operations and the runner's exit
        code; a gang's (``+``-joined node ids) is its nodes' combined."""
        try:
            return gang.status(
                self._instances.status,
                instance_id,
                window_s=self.capabilities.termination_window_s,
            )
        finally:
            self._policies.sweep()  # policies of gangs whose nodes were still going

    def terminate(self, instance_id: str) -> None:
        """Delete the instance, or every node of a gang and then its placement policy; an
        instance already deleted or preempted away is done."""
        nodes = gang.node_ids(instance_id)
        policies = self._policies.known(nodes)
        if len(nodes) > 1 and not policies:
            # Not launched or listed by this process: the nodes that remain name it.
            try:
                policies = self._policies.listed_by(self._instances.existing(nodes))
            except base.ProviderError as e:  # the nodes go all the same; only the policy stays
                log.warning("could not read the nodes of %s for their policy: %s", instance_id, e)
        try:
            gang.terminate(self._instances.terminate, instance_id)
        finally:
            self._policies.release(nodes, policies)

    def list_instances(self) -> list[base.InstanceInfo]:
        """Every instance labelled trainbot-managed=true, in every zone of the project, a
        gang's nodes as one: one aggregated list covers every region, so a restarted
        control plane finds the instances of a run that failed over (``regions`` or any
        other). Placement policies that gangs left behind in the provider's regions go
        here too (at most every ``policy_sweep_s``), since reconcile calls this often."""
        found = self._instances.managed()
        for inst in found:
            for policy in self._policies.listed_by([inst]):
                self._policies.remember([f"{last(inst.zone)}/{inst.name}"], policy)
        self._policies.sweep()
        regions = (self.region, *self.regions, *(region_of_zone(z) for z in self.zones))
        self._policies.sweep_left_behind(
            regions, self._policies.listed_by(found), now=datetime.now(timezone.utc)
        )
        return gang.group(self._instances.info(i) for i in found)

    # -- helpers --------------------------------------------------------------------------

    def _region(self, req: base.ResourceRequest) -> str:
        return req.region if req.region not in ("", "local") else self.region

    def _zones_in(self, region: str) -> tuple[str, ...]:
        """The configured zones of ``region``; none means any zone of it."""
        return tuple(z for z in self.zones if region_of_zone(z) == region)


def make(**options: Any) -> GcpProvider:
    """The registry's factory: ``options`` are :class:`GcpProvider`'s keyword arguments.

    The region defaults to preflight's default (us-central1); the project has no default.
    """
    if not options.get("project"):
        raise base.ProviderError(
            "the gcp provider needs a project: set TRAINBOT_GCP_PROJECT to the project id"
        )
    options.setdefault("region", "us-central1")
    return GcpProvider(**options)


def from_settings(settings: Settings) -> GcpProvider:
    """The provider as ``TRAINBOT_GCP_*`` configure it: the process settings, and the
    provider's own (:class:`GcpSettings`, read from the environment)."""
    own = GcpSettings.from_env()
    prepare_in_background(own.runner(), setting=GcpSettings.PREFIX)
    options: dict[str, Any] = {
        "image": own.image,
        "runner": own.runner(),
        "project": settings.gcp_project,
        "region": settings.gcp_region,
        "zones": settings.gcp_zones or None,
        "regions": settings.gcp_regions or None,
        "service_account": settings.gcp_service_account,
        "api_endpoint": settings.gcp_api_endpoint,
        "secrets_prefix": own.secrets_prefix,
        "secrets_endpoint": own.secrets_endpoint,
    }
    return make(**{k: v for k, v in options.items() if v is not None})

"""``AwsProvider``, the Provider Protocol on EC2, and the registry's factories.

The class holds the provider's settings and its clients; each answer comes from the
module of its concern (catalog, capacity, launch, status, placement, budgets). A
multi-node attempt is a gang (:mod:`jobs.providers.gang`) in one cluster placement group.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3

from jobs.providers import base, gang
from jobs.providers.aws import budgets, capacity, catalog, launch, placement, secrets, status
from jobs.providers.aws.clients import Clients, utcnow
from jobs.providers.aws.launch import LaunchConfig
from jobs.providers.aws.settings import AwsSettings
from jobs.providers.options import by_name
from jobs.providers.runner_install import (
    RunnerInstall,
    boot_config,
    prepare_in_background,
)
from runner.secrets import SecretRef

if TYPE_CHECKING:
    from jobs.process.settings import Settings

__all__ = ["AwsProvider", "from_settings", "make"]

#: Between the region and the EC2 id of an instance outside the home region.
_REGION_SEP = "/"


class AwsProvider:
    """Spot (and on-demand) EC2 instances for trainbot's attempts: in its home region, and
    in any other a request names (``ResourceRequest.region``, for region failover).

    Instances outside the home region are known by ``REGION/INSTANCE-ID``, so that
    status and terminate find them after a restart with nothing else remembered.
    """

    name = "aws"

    def __init__(
        self,
        *,
        region: str,
        instance_profile: str | None = None,
        subnet_ids: Mapping[str, str] | None = None,
        security_group_ids: Sequence[str] = (),
        image_id: str | None = None,
        endpoint_url: str | None = None,
        session: boto3.session.Session | None = None,
        runner: RunnerInstall | None = None,
        user_data_template: str | os.PathLike[str] | None = None,
        prices_path: str | os.PathLike[str] | None = None,
        budget_emails: Sequence[str] = (),
        budget_sns_topic_arn: str | None = None,
        regions: Sequence[str] = (),
        secrets_prefix: str = secrets.DEFAULT_SECRETS_PREFIX,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        """``instance_profile``: name or ARN of the runner's instance profile (its policy is
        deploy/aws/runner-instance-policy.json). ``subnet_ids``: zone → subnet; when given,
        only those zones are used (zone names are unique across regions, so one map serves
        every region). ``image_id``: an AMI id or ``resolve:ssm:<parameter>``
        (default: the Deep Learning Base AMI, through its public SSM parameter); a spec's
        ``resources.image_id`` wins over it. ``endpoint_url``: one endpoint for every
        service (moto in tests). ``runner``: how instances get the runner, pinned to this
        control plane's version (default here: ``trainbot==<version>`` from pip's index;
        ``from_settings`` defaults to the control plane's own wheel, which it serves).
        ``budget_emails`` and ``budget_sns_topic_arn``: who a run's AWS Budget notifies at
        its thresholds (AWS sends nothing without a subscriber). ``regions``: other
        regions whose trainbot instances ``list_instances`` reports from the start (the
        specs' failover regions), so reconcile finds orphans there after a restart.
        ``secrets_prefix``: the names of the only secrets the instance role may read."""
        if not region:
            raise base.ProviderError("the AWS provider needs a region: set TRAINBOT_AWS_REGION")
        self.region = region
        self.instance_profile = instance_profile or None
        self.subnet_ids = dict(subnet_ids or {})
        self.security_group_ids = tuple(security_group_ids)
        self.image_id = image_id or launch.DEFAULT_IMAGE
        self.runner = runner or RunnerInstall(mode="index")
        self.endpoint_url = endpoint_url or None
        self.budget_emails = tuple(e.strip() for e in budget_emails if e.strip())
        self.budget_sns_topic_arn = budget_sns_topic_arn or None
        self.regions = tuple(r for r in regions if r and r != region)
        self.secrets_prefix = secrets_prefix
        self._clients = Clients(
            region=region,
            session=session or boto3.session.Session(),
            endpoint_url=endpoint_url or None,
        )
        self.template_path = Path(user_data_template or launch.USER_DATA_TEMPLATE)
        self._prices_path = Path(prices_path or catalog.PRICES_PATH)
        self._clock = clock
        #: Regions where listing placement groups was denied, so the warning is logged once.
        self._sweep_denied: set[str] = set()

    @property
    def capabilities(self) -> base.Capabilities:
        """A cloud: commands never run on the control plane. Two minutes' notice from
        IMDSv2; AWS Budgets, EC2's DryRun permission probe and cluster placement groups
        for multi-node attempts are there."""
        return base.Capabilities(
            runs_on_this_machine=False,
            termination_window_s=status.TERMINATION_WINDOW_S,
            preemption_source="aws",
            default_region=self.region,
            cloud_budgets=True,
            permission_probe=True,
            gang_placement="cluster placement group",
        )

    def client(self, service: str, *, region: str | None = None, advisory: bool = False) -> Any:
        """The botocore client this provider uses for ``service`` (cached, thread-safe);
        tests attach botocore's Stubber to these same objects."""
        return self._clients.client(service, region=region, advisory=advisory)

    def close(self) -> None:
        """Nothing to release: boto3 clients need no closing."""

    # -- questions -------------------------------------------------------------------------

    def instance_type(self, req: base.ResourceRequest) -> str:
        """The EC2 type for a request: its own, or the smallest that holds its accelerators."""
        return catalog.accelerator_type(req)[0]

    def instance_type_for(self, req: base.ResourceRequest) -> str | None:
        return catalog.exact_type(req)

    def dry_run_request(
        self, req: base.ResourceRequest, *, instance_type: str | None = None
    ) -> base.ResourceRequest:
        """One instance of the cheapest type for the dry run (:func:`catalog.dry_run_type`),
        or of ``instance_type``; ``"cpu"`` asks for the cheapest CPU type."""
        region = req.region or self.region
        if instance_type and instance_type != base.CPU_INSTANCE:
            itype = instance_type
        else:
            source = req
            if instance_type == base.CPU_INSTANCE:
                source = replace(
                    req, accelerator_type=None, accelerator_count=0, instance_type=None
                )
            itype = catalog.dry_run_type(source, prices_path=self._prices_path, region=region)
        gpus = itype in catalog.ACCELERATOR_TYPES.values()
        held = next((k for k, t in catalog.ACCELERATOR_TYPES.items() if t == itype), None)
        return replace(
            req,
            region=region,
            instance_type=itype,
            accelerator_type=held[0] if gpus and held else None,
            accelerator_count=held[1] if gpus and held else 0,
            cpus=None,
        )

    def quota(self, req: base.ResourceRequest) -> base.QuotaInfo:
        return capacity.quota(self._in(req.region), req, self.instance_type(req))

    def capacity(self, req: base.ResourceRequest) -> list[base.ZoneCapacity]:
        """The zones that offer the type; first, that the machine image is there (a
        ProviderError saying what to set when it is not: preflight shows it)."""
        clients = self._in(req.region)
        launch.image_of(clients, req.image_id or self.image_id, clients.region)
        return capacity.capacity(
            self._in(req.region), req, self.instance_type(req), subnet_ids=self.subnet_ids
        )

    def price(self, req: base.ResourceRequest, *, zone: str | None = None) -> base.PriceQuote:
        return catalog.price(
            self._in(req.region),
            req,
            self.instance_type(req),
            zone=zone,
            prices_path=self._prices_path,
            clock=self._clock,
        )

    def bucket_location(self, uri: str) -> base.BucketLocation | None:
        """An S3 bucket is in one region (see :func:`capacity.bucket_region`)."""
        region = capacity.bucket_region(self._clients, uri)
        return None if region is None else base.BucketLocation.region(region)

    # -- budgets ---------------------------------------------------------------------------

    def secret_problem(self, ref: SecretRef) -> tuple[str, str] | None:
        """Whether an ``aws-sm://`` secret exists in the home region and the instance role
        may read it (``DescribeSecret`` and a policy simulation; never its value)."""
        return secrets.secret_problem(
            clients=self._clients,
            region=self.region,
            ref=ref,
            prefix=self.secrets_prefix,
            instance_profile=self.instance_profile,
        )

    def create_budget(
        self,
        *,
        run_id: str,
        usd: float,
        thresholds: Sequence[int],
        email: str | None = None,
    ) -> str:
        """An AWS Budget for the run's tagged cost, notifying the provider's subscribers
        (and ``email``, when given) (see :func:`budgets.create_budget`)."""
        emails = [*self.budget_emails, *([email] if email else [])]
        return budgets.create_budget(
            self._clients,
            run_id=run_id,
            usd=usd,
            thresholds=thresholds,
            emails=list(dict.fromkeys(emails)),
            sns_topic_arn=self.budget_sns_topic_arn,
        )

    def delete_budget(self, *, run_id: str) -> None:
        """Remove the run's AWS Budget; one already gone is not an error."""
        budgets.delete_budget(self._clients, run_id=run_id)

    # -- instances -------------------------------------------------------------------------

    def check_launch_permissions(
        self, req: base.ResourceRequest, *, zone: str | None = None
    ) -> None:
        """Ask EC2 whether a launch would be allowed (``DryRun``), creating nothing.

        Raises AwsCredentialsError without credentials, ProviderPermissionError naming
        the missing permission (``ec2:RunInstances``, ``iam:PassRole`` …) otherwise; for
        a multi-node request, also ``ec2:CreatePlacementGroup``.
        """
        clients = self._in(req.region)
        launch.check_launch_permissions(clients, req, self._launch_config(), zone=zone)
        if req.instances > 1:
            placement.check_permission(clients, now=self._clock())

    def launch(self, req: base.LaunchRequest) -> base.InstanceInfo:
        """Start the attempt's instance, or return the one this key already started.

        A multi-node attempt's nodes go into its cluster placement group, all or none
        (:func:`gang.launch`); its id is theirs joined by ``+``. A failed gang's group is
        deleted again (or later, by the sweep) and its error raised as it was."""
        clients = self._in(req.request.region)
        config = self._launch_config()
        runner = self._runner_config(req)

        def one(node: base.LaunchRequest) -> base.InstanceInfo:
            return launch.launch(clients, node, config, runner=runner, clock=self._clock)

        if req.nodes > 1:
            placement.ensure(clients, req, now=self._clock())
        try:
            found = gang.launch(one, req, terminate_one=self._terminator(clients))
        except base.ProviderError:
            if req.nodes > 1:
                placement.delete(clients, req.placement_group)
            raise
        return self._qualified(clients.region, found)

    def render_user_data(self, req: base.LaunchRequest) -> str:
        """The instance's boot script (see :func:`launch.render_user_data`)."""
        return launch.render_user_data(
            req, runner=self._runner_config(req), template_path=self.template_path
        )

    def _runner_config(self, req: base.LaunchRequest) -> dict[str, Any]:
        """The installer's configuration for ``req``'s instances; in "wheel" mode the
        control plane's wheel is served to them (``GET /v1/runner-wheel``)."""
        return boot_config(
            self.runner,
            req.env,
            run_id=req.run_id,
            setting=AwsSettings.PREFIX,
            token_from="env-file",
        )

    def _launch_config(self) -> LaunchConfig:
        """The launch settings as they are now (a caller may have changed one)."""
        return by_name(LaunchConfig, vars(self))

    def status(self, instance_id: str) -> base.InstanceStatus:
        """One instance's state, or a gang's: its nodes' combined (:func:`gang.combine`)."""
        region, raw = self._split_id(instance_id)
        clients = self._in(region)
        found = gang.status(
            lambda node: status.status(clients, node, clock=self._clock),
            raw,
            window_s=self.capabilities.termination_window_s,
        )
        return replace(found, instance_id=instance_id)

    def terminate(self, instance_id: str) -> None:
        """End the instance, or every node of a gang and then its placement group."""
        region, raw = self._split_id(instance_id)
        clients = self._in(region)
        gang.terminate(self._terminator(clients), raw)
        nodes = gang.node_ids(raw)
        if len(nodes) > 1:
            placement.release(clients, nodes)

    def list_instances(self) -> list[base.InstanceInfo]:
        """Every trainbot instance in the home region, the ``regions`` given, and any
        region this provider has launched in or been asked about; a gang once, by its
        joined id. Deletes the placement groups of gangs that have ended, as it goes."""
        for region in self.regions:
            self._in(region)
        found: list[base.InstanceInfo] = []
        for region in self._clients.regions():
            clients = self._in(region)
            listed = status.list_instances(clients, clock=self._clock)
            placement.sweep(clients, listed, now=self._clock(), warned=self._sweep_denied)
            found.extend(self._qualified(region, i) for i in gang.group(listed))
        return found

    @staticmethod
    def _terminator(clients: Clients) -> Callable[[str], None]:
        return lambda node: status.terminate(clients, node)

    # -- regions ---------------------------------------------------------------------------

    def _in(self, region: str | None) -> Clients:
        return self._clients.in_region(region or self.region)

    def _qualified(self, region: str, found: base.InstanceInfo) -> base.InstanceInfo:
        if region == self.region:
            return found
        return replace(found, instance_id=f"{region}{_REGION_SEP}{found.instance_id}")

    def _split_id(self, instance_id: str) -> tuple[str, str]:
        region, sep, raw = instance_id.rpartition(_REGION_SEP)
        return (region, raw) if sep else (self.region, instance_id)

    def instance_log(self, instance_id: str, *, lines: int) -> str:
        raise base.Unsupported("the aws provider keeps logs on the instance")


# -- factories ---------------------------------------------------------------------------


def _split(value: str | Sequence[str] | None) -> list[str]:
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [item.strip() for item in items if item.strip()]


def make(**options: Any) -> AwsProvider:
    """The registry's factory. Takes the constructor's options; from settings, also
    ``subnet_ids`` as ``"us-east-1a=subnet-1,us-east-1b=subnet-2"`` and
    ``security_group_ids`` as ``"sg-1,sg-2"``. Without ``region``, the session's region."""
    subnets = options.pop("subnet_ids", None)
    if isinstance(subnets, str):
        pairs = [item.partition("=") for item in _split(subnets)]
        bad = [z for z, eq, s in pairs if not eq or not z.strip() or not s.strip()]
        if bad:
            raise base.ProviderError(
                f"subnet_ids: write zone=subnet pairs separated by commas ({bad})"
            )
        subnets = {z.strip(): s.strip() for z, _, s in pairs}
    groups = _split(options.pop("security_group_ids", None))
    region = options.pop("region", None)
    if not region:
        session = options.get("session") or boto3.session.Session()
        options["session"] = session
        region = session.region_name
    return AwsProvider(region=region, subnet_ids=subnets, security_group_ids=groups, **options)


def from_settings(settings: Settings) -> AwsProvider:
    """The provider as ``TRAINBOT_AWS_*`` configure it: the process settings, and the
    provider's own (:class:`AwsSettings`, read from the environment)."""
    own = AwsSettings.from_env()
    prepare_in_background(own.runner(), setting=AwsSettings.PREFIX)
    options: dict[str, Any] = {
        "runner": own.runner(),
        "region": settings.aws_region,
        "instance_profile": settings.aws_instance_profile,
        "subnet_ids": settings.aws_subnet_ids,
        "security_group_ids": settings.aws_security_group_ids,
        "image_id": settings.aws_image_id,
        "endpoint_url": settings.aws_endpoint_url,
        "budget_emails": settings.aws_budget_emails or None,
        "budget_sns_topic_arn": settings.aws_budget_sns_topic_arn,
        "regions": settings.aws_regions or None,
        "secrets_prefix": own.secrets_prefix,
    }
    return make(**{k: v for k, v in options.items() if v is not None})

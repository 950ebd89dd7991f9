"""The one interface between the control plane and a place that runs instances.

Everything that crosses it is a frozen dataclass, so a provider cannot hand the service
layer a live SDK object, and the service layer cannot reach into a provider's state.
Cloud SDKs are imported only in their provider package (``aws/``, ``gcp/``);
``local.py`` needs nothing but the standard library. What a caller may rely on beyond
the methods every provider has is declared in :class:`Capabilities`.

Quota and capacity are separate questions on purpose: a quota of 8 A100s in a region says
nothing about whether any zone has one free right now, and the preflight report has to
say which of the two stops a run.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol, runtime_checkable

from jobs.domain.errors import TrainbotError

__all__ = [
    "CPU_INSTANCE",
    "TAG_ATTEMPT_ID",
    "TAG_DRY_RUN",
    "TAG_IDEMPOTENCY_KEY",
    "TAG_MANAGED",
    "TAG_NODE",
    "TAG_NODES",
    "TAG_OWNER",
    "TAG_RUN_ID",
    "BucketLocation",
    "Capabilities",
    "CapacityError",
    "InstanceInfo",
    "InstanceNotFound",
    "InstanceState",
    "InstanceStatus",
    "LaunchRequest",
    "PriceQuote",
    "Provider",
    "ProviderError",
    "ProviderPermissionError",
    "QuotaExceeded",
    "QuotaInfo",
    "ResourceRequest",
    "Unsupported",
    "ZoneCapacity",
]

# Tags every provider puts on the instances it launches. ``list_instances`` finds
# instances by TAG_MANAGED; reconciliation matches the others against the database.
# Lowercase with hyphens, so they are valid as AWS tags and as GCP labels alike.
TAG_MANAGED = "trainbot-managed"
TAG_RUN_ID = "trainbot-run-id"
TAG_ATTEMPT_ID = "trainbot-attempt-id"
TAG_OWNER = "trainbot-owner"
TAG_IDEMPOTENCY_KEY = "trainbot-idempotency-key"
#: On a preflight dry run's instance only ("true"): its TAG_ATTEMPT_ID is the dry run's
#: id, which no attempt has, so reconcile asks the dry runs before calling it an orphan.
TAG_DRY_RUN = "trainbot-dry-run"
#: On each node of a multi-node attempt (:mod:`jobs.providers.gang`): its node rank
#: ("0", "1", …) and the gang's node count.
TAG_NODE = "trainbot-node"
TAG_NODES = "trainbot-nodes"
#: ``dry_run.instance_type`` for "the cheapest CPU type": the script runs without a GPU.
CPU_INSTANCE = "cpu"


# -- errors ------------------------------------------------------------------------------


#: The only variables of the control plane's own environment that reach a process it
#: starts on this machine (a local instance, a dry run), as on a fresh machine: the
#: control plane's secrets (Slack token, cloud keys) stay behind.
PASSTHROUGH_ENV = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "VIRTUAL_ENV",
    "PYTHONPATH",
    "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES",
)


class ProviderError(TrainbotError):
    """A provider refused or failed a request; the message says which and what to do."""


class QuotaExceeded(ProviderError):
    """The quota for the accelerator type in the region does not cover the request.

    Not worth retrying in another zone: quotas are per region (and per account).
    """

    def __init__(self, message: str, *, quota: QuotaInfo | None = None) -> None:
        super().__init__(message)
        self.quota = quota


class CapacityError(ProviderError):
    """The zone has no capacity for the type right now: try the next zone."""

    def __init__(self, message: str, *, zone: str | None = None) -> None:
        super().__init__(message)
        self.zone = zone


class InstanceNotFound(ProviderError):
    """The provider has no instance with this id (never launched, or long gone)."""

    def __init__(self, message: str, *, instance_id: str) -> None:
        super().__init__(message)
        self.instance_id = instance_id


class ProviderPermissionError(ProviderError):
    """The credentials lack a permission; ``permission`` names it (``ec2:RunInstances``)."""

    def __init__(self, message: str, *, permission: str) -> None:
        super().__init__(message)
        self.permission = permission


# -- data crossing the boundary ----------------------------------------------------------


class InstanceState(str, enum.Enum):
    """What a provider can say about one instance, seen from outside it."""

    PENDING = "pending"
    RUNNING = "running"
    PREEMPTED = "preempted"
    TERMINATED = "terminated"
    FAILED = "failed"
    SUCCEEDED = "succeeded"
    #: A node of a gang ended without notice (killed, gone): the gang cannot go on, and
    #: the attempt resumes from its last committed step like a preempted one.
    LOST = "lost"
    UNKNOWN = "unknown"

    def is_terminal(self) -> bool:
        """The instance will not run again; its attempt is over."""
        return self in _TERMINAL


_TERMINAL = frozenset(
    {
        InstanceState.PREEMPTED,
        InstanceState.TERMINATED,
        InstanceState.FAILED,
        InstanceState.SUCCEEDED,
        InstanceState.LOST,
    }
)


@dataclass(frozen=True)
class ResourceRequest:
    """What a run needs from one instance, in the provider's own vocabulary."""

    # Provider name, as in the registry: "local", "aws", "gcp".
    cloud: str
    # Region the quota is counted in and the instance runs in ("us-east-1", "local").
    region: str
    # Zones the run may use, in order of preference; empty means any zone of the region.
    zones: Sequence[str] = ()
    # Accelerator type as the provider names it ("A100", "nvidia-tesla-a100"); None: CPU only.
    accelerator_type: str | None = None
    # Accelerators per instance; 0 for a CPU-only run.
    accelerator_count: int = 0
    # Provider instance type ("p4d.24xlarge", "a2-highgpu-1g"); None: the provider picks.
    instance_type: str | None = None
    # Spot (preemptible) capacity rather than on-demand.
    spot: bool = True
    # Virtual CPUs per instance; None when the instance type decides.
    cpus: int | None = None
    # Instances of it the run needs at once (the nodes of a multi-node run): quota counts
    # them all; capacity and prices stay per instance.
    instances: int = 1
    # The machine image the spec names (``resources.image_id``: an AMI id or
    # ``resolve:ssm:<parameter>`` on AWS, an image or family URL on GCP); None: the
    # provider's own (its admin's setting, else a GPU-ready default).
    image_id: str | None = None


@dataclass(frozen=True)
class QuotaInfo:
    """The quota that binds a request, and whether it covers it."""

    # The quota's limit, in ``unit``.
    limit: float
    # How much of it is in use now.
    used: float
    # How much the request needs on top of ``used``.
    needed: float
    # What is counted: "GPUs", "vCPUs", "cores".
    unit: str
    # used + needed <= limit.
    ok: bool
    # One line naming the quota, region and figures, for the preflight report.
    detail: str
    # What to do when not ok (the console page or command to raise it); "" when ok.
    remedy: str = ""

    @classmethod
    def check(
        cls, limit: float, used: float, needed: float, unit: str, *, detail: str, remedy: str
    ) -> QuotaInfo:
        """The quota of these figures: ok when ``used + needed`` is within ``limit``, and
        then without the ``remedy``."""
        ok = used + needed <= limit
        return cls(limit, used, needed, unit, ok, detail, "" if ok else remedy)


@dataclass(frozen=True)
class ZoneCapacity:
    """Whether one zone can take the request now."""

    # Zone name ("us-east-1a", "local-a").
    zone: str
    # The zone offers the type now (as far as the provider can tell).
    available: bool
    # Higher is better (AWS spot placement score 1-10); None when the provider has none.
    score: float | None = None
    # Why it is or is not available, for the preflight report.
    detail: str = ""

    @classmethod
    def unavailable(cls, zone: str, detail: str) -> ZoneCapacity:
        """A zone that cannot take the request, and why."""
        return cls(zone, False, None, detail)


@dataclass(frozen=True)
class PriceQuote:
    """Price of one instance of the request, per hour."""

    # USD per instance-hour on spot capacity.
    spot_usd_per_hour: float
    # USD per instance-hour on demand.
    on_demand_usd_per_hour: float
    # Where the figures come from ("aws pricing api", "local: configured").
    source: str
    # When the figures were true (timezone-aware UTC).
    as_of: datetime


@dataclass(frozen=True)
class BucketLocation:
    """Where a data or checkpoint bucket is: the regions that read and write it without
    crossing regions. One region for most buckets; several for a Cloud Storage dual-
    region, a whole continent's for a multi-region (``US``, ``EU``, ``ASIA``)."""

    # The location as the cloud names it: "us-east-1", "us-central1", "US", "NAM4".
    name: str
    # The regions it is in (a dual-region's two; a single region's one).
    regions: frozenset[str] = frozenset()
    # Region-name prefixes it covers entirely (a multi-region: "us-" for US).
    region_prefixes: tuple[str, ...] = ()

    @classmethod
    def region(cls, region: str) -> BucketLocation:
        """A bucket in one region."""
        return cls(name=region, regions=frozenset({region}))

    def covers(self, region: str) -> bool:
        """An instance in ``region`` reads and writes it without crossing regions."""
        return region in self.regions or region.startswith(self.region_prefixes or ("\0",))

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class LaunchRequest:
    """Everything a provider needs to start the instance for one attempt."""

    # The run this attempt belongs to.
    run_id: str
    # The attempt this instance is for; one attempt, one instance.
    attempt_id: str
    # Who launched the run (chat user id); becomes a tag for cost reports.
    owner: str
    # What the instance needs.
    request: ResourceRequest
    # Zone to launch in, chosen from ``capacity()``.
    zone: str
    # Command the instance runs, normally ``trainbot-runner exec -- <spec command>``.
    command: Sequence[str]
    # Environment for the command. Holds the per-attempt runner token: never log or
    # persist it, hence repr=False.
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    # Declared size of the scratch volume in bytes; the runner reports disk use against it.
    scratch_bytes: int = 0
    # Same key, same instance: a retried launch adopts the instance it already started.
    idempotency_key: str = ""
    # Spot capacity rather than on-demand (after N preemptions the policy switches).
    spot: bool = True
    # A preflight dry run's instance (``attempt_id`` is the dry run's id): launched the
    # same way, and tagged TAG_DRY_RUN so that nothing takes it for an attempt's.
    dry_run: bool = False
    # Nodes of the attempt's gang (``resources.instances``), launched all or none
    # (:mod:`jobs.providers.gang`), and which of them this request is for.
    nodes: int = 1
    node_rank: int = 0

    @property
    def placement_group(self) -> str:
        """The name of the gang's placement (an AWS cluster placement group, a GCP compact
        placement policy): one per attempt, so a resubmitted gang gets a new one."""
        return f"trainbot-{self.attempt_id}".lower()

    @property
    def key(self) -> str:
        """The key the provider launches with: ``idempotency_key``, else the run's and the
        attempt's ids."""
        return self.idempotency_key or f"{self.run_id}/{self.attempt_id}"

    def tags(self, idempotency_key: str) -> dict[str, str]:
        """The tags (AWS) or labels (GCP) of its instance, before each cloud's limits on
        their values; ``idempotency_key`` is the one the provider launches with."""
        return {
            TAG_MANAGED: "true",
            TAG_RUN_ID: self.run_id,
            TAG_ATTEMPT_ID: self.attempt_id,
            TAG_OWNER: self.owner,
            TAG_IDEMPOTENCY_KEY: idempotency_key,
            **({TAG_DRY_RUN: "true"} if self.dry_run else {}),
            **(
                {TAG_NODE: str(self.node_rank), TAG_NODES: str(self.nodes)}
                if self.nodes > 1
                else {}
            ),
        }


@dataclass(frozen=True)
class InstanceInfo:
    """One instance a provider knows about, as found by launch or list_instances."""

    # Provider instance id ("i-0abc…", "local-3f2a…").
    instance_id: str
    # From the TAG_RUN_ID tag; "" when the instance carries none.
    run_id: str
    # From the TAG_ATTEMPT_ID tag; "" when the instance carries none.
    attempt_id: str
    # Zone it runs in.
    zone: str
    # State when it was looked at.
    state: InstanceState
    # When it was launched (timezone-aware UTC).
    launched_at: datetime
    # Every tag on the instance, the trainbot ones included.
    tags: Mapping[str, str] = field(default_factory=dict)
    # Its private address, where the other nodes of its gang reach it; "" when the
    # provider does not know it (yet).
    address: str = ""


@dataclass(frozen=True)
class InstanceStatus:
    """The state of one instance, and why."""

    # Provider instance id.
    instance_id: str
    # What the provider says.
    state: InstanceState
    # Why, in words, for the run's thread ("preempted: spot capacity reclaimed").
    reason: str
    # Exit code of the command when the provider knows it (local does; clouds mostly not).
    exit_code: int | None = None
    # When the preemption happened, if it was one (timezone-aware UTC).
    preempted_at: datetime | None = None


@dataclass(frozen=True)
class Capabilities:
    """What a provider declares about itself, so that callers never decide by its type
    or look for a method by name.

    The control plane's machine holds the Slack secrets, the cloud credentials and the
    database, so whether a spec's command may run on it is a property of the provider,
    stated once here, and never inferred from a spec (which arrives from chat).
    """

    # Its instances are processes on the control plane's own machine (the local provider:
    # one person's laptop), so the control plane may run a spec's command itself, as the
    # preflight dry run does. False for a cloud: there the control plane never executes a
    # spec's command or any other user-controlled string, and never imports user code.
    runs_on_this_machine: bool
    # Seconds between the preemption notice and the kill, which an emergency checkpoint
    # has to fit in (the runner is told it as TRAINBOT_TERMINATION_WINDOW_S).
    termination_window_s: float
    # Where the runner on an instance hears the notice (``runner.preemption.SOURCES``):
    # "aws" (IMDSv2 spot/instance-action), "gcp" (the metadata server's preempted flag),
    # or "signal" (SIGTERM only, the local provider's).
    preemption_source: str
    # The region a spec without ``resources.region`` runs in; None: the spec must say.
    default_region: str | None = None
    # Mean seconds between the preemptions the provider itself causes (the local
    # provider's configured mean); None: unknown, and preflight assumes its default.
    mean_time_between_preemptions_s: float | None = None
    # ``create_budget`` creates a budget in the cloud's own billing (AWS Budgets), and
    # ``delete_budget`` removes it.
    cloud_budgets: bool = False
    # ``check_launch_permissions`` can ask the cloud whether a launch would be allowed
    # without launching (EC2 DryRun).
    permission_probe: bool = False
    # ``instance_log`` can read an instance's output (the local provider's log files).
    instance_logs: bool = False
    # How ``launch`` places the nodes of a multi-node attempt (``LaunchRequest.nodes``),
    # all or none (:mod:`jobs.providers.gang`): "cluster placement group", "compact
    # placement policy", "this machine". "": the provider launches one node only, and a
    # spec with ``resources.instances`` above 1 is refused.
    gang_placement: str = ""


class Unsupported(ProviderError):
    """The provider does not have this optional capability (its :class:`Capabilities`
    say so); callers check the capability first, so this is a bug when it surfaces."""


# -- the interface -----------------------------------------------------------------------


@runtime_checkable
class Provider(Protocol):
    """A place that runs instances: a cloud, or the laptop."""

    # Registry name: "local", "aws", "gcp".
    name: str

    @property
    def capabilities(self) -> Capabilities:
        """What this provider declares about itself (see :class:`Capabilities`)."""
        ...

    def quota(self, req: ResourceRequest) -> QuotaInfo:
        """Quota for the exact accelerator type in the exact region, against the request."""
        ...

    def capacity(self, req: ResourceRequest) -> list[ZoneCapacity]:
        """Which zones offer the type now, best first."""
        ...

    def price(self, req: ResourceRequest, *, zone: str | None = None) -> PriceQuote:
        """Spot and on-demand USD per hour for one instance of the request."""
        ...

    def bucket_location(self, uri: str) -> BucketLocation | None:
        """Where a data or checkpoint bucket is; None when this provider cannot tell."""
        ...

    def instance_type_for(self, req: ResourceRequest) -> str | None:
        """The instance type of the provider's catalogue that holds exactly the request's
        accelerators (its type and count) in one instance; None when no type does, and
        for a CPU-only request. Preflight asks whether N instances of k accelerators
        could be one instance of N·k."""

    def dry_run_request(
        self, req: ResourceRequest, *, instance_type: str | None = None
    ) -> ResourceRequest:
        """The cheapest request that can run ``req``'s preflight dry run, from the catalog:
        ``instance_type`` when given (``"cpu"``: the cheapest CPU type), else one instance
        of the smallest type of the same accelerator, or the cheapest CPU type for a
        request without one. One instance, in ``req``'s region, zones and market."""
        ...

    def launch(self, req: LaunchRequest) -> InstanceInfo:
        """Start the attempt's instance; a second call with the same key returns it again."""
        ...

    def status(self, instance_id: str) -> InstanceStatus:
        """What the instance is doing; raises InstanceNotFound for an unknown id."""
        ...

    def terminate(self, instance_id: str) -> None:
        """Stop the instance for good; terminating a finished one is not an error."""
        ...

    def list_instances(self) -> list[InstanceInfo]:
        """Every instance tagged by trainbot, so reconciliation can find orphans."""
        ...

    # -- optional capabilities: call only where ``capabilities`` says the provider has
    # -- them; the others raise :class:`Unsupported`.

    def create_budget(self, *, run_id: str, usd: float, thresholds: Sequence[int]) -> str:
        """A budget in the cloud's billing for the run's spend, alerting at ``thresholds``
        percent; returns its name (``capabilities.cloud_budgets``)."""
        ...

    def delete_budget(self, *, run_id: str) -> None:
        """Remove the run's cloud budget once the run has ended; one that is already gone
        is not an error (``capabilities.cloud_budgets``)."""
        ...

    def check_launch_permissions(self, req: ResourceRequest, *, zone: str | None = None) -> None:
        """Raise :class:`ProviderPermissionError` when the credentials could not launch
        this request (``capabilities.permission_probe``)."""
        ...

    def instance_log(self, instance_id: str, *, lines: int) -> str:
        """The last ``lines`` lines of the instance's output; raises
        :class:`InstanceNotFound` when there is none yet (``capabilities.instance_logs``)."""
        ...

    def close(self) -> None:
        """Release what the provider holds (threads, connections); instances keep running."""
        ...

"""AWS: spot GPUs on EC2, behind the Provider protocol.

Each question asks the API that answers it, in the run's region: Service Quotas for the
instance family's vCPU quota (spot and on-demand are separate quotas, and new accounts
start at 0), instance-type offerings and spot placement scores for capacity, spot price
history plus a shipped, dated on-demand table for price, ``GetBucketLocation`` for data
locality. Budgets become AWS Budgets filtered on the run's cost-allocation tag.

Launches are idempotent twice over: the attempt's key is EC2's ``ClientToken`` (a
retried ``RunInstances`` returns the instance it already started, which is what saves a
control plane killed between the call and its database write), and it is also a tag,
which ``launch`` looks up first so the answer does not depend on how long EC2 remembers
tokens. EC2 reads are eventually consistent, so the token is the guarantee; the lookup
is what makes a restart cheap.

The runner's token travels only in the user data (``deploy/aws/user-data.sh``). On the
instance, IMDSv2 with a hop limit of 1 keeps it from containers; in the account, anyone
allowed ``ec2:DescribeInstanceAttribute`` can read user data, which is why the token is
per attempt, hashed in the database and revoked when the attempt ends. It is never
logged, never put in an error message, and the script never echoes it.

Preemption is read from the instance's state reason (``Server.SpotInstanceTermination``)
and, when the instance came from a spot request, the request's status
(``instance-terminated-no-capacity`` …, or ``marked-for-termination`` during the two-minute
notice). An instance that shut itself down (the user data runs ``shutdown -h now`` when
the runner exits) is classified from the runner's exit code, which the script writes to
the serial console.

The on-demand table is refreshed with ``python -m jobs.providers.aws refresh-prices``
(Price List API, ``pricing:GetProducts``); tests never call it against AWS.

boto3 is imported here and nowhere else in ``jobs/``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import re
import shlex
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
    ReadTimeoutError,
)
from botocore.parsers import ResponseParserError

from jobs.providers.base import (
    TAG_ATTEMPT_ID,
    TAG_IDEMPOTENCY_KEY,
    TAG_MANAGED,
    TAG_OWNER,
    TAG_RUN_ID,
    Capabilities,
    CapacityError,
    InstanceInfo,
    InstanceNotFound,
    InstanceState,
    InstanceStatus,
    LaunchRequest,
    PriceQuote,
    ProviderError,
    ProviderPermissionError,
    QuotaExceeded,
    QuotaInfo,
    ResourceRequest,
    ZoneCapacity,
)
from runner import EXIT_PREEMPTED, EXIT_SUCCEEDED

__all__ = [
    "ACCELERATOR_TYPES",
    "DEFAULT_IMAGE",
    "IAM_ACTIONS",
    "PRICES_PATH",
    "TAG_TERMINATED_BY",
    "USER_DATA_TEMPLATE",
    "AwsCredentialsError",
    "AwsProvider",
    "budget_name",
    "main",
    "make",
    "quota_codes",
    "refresh_prices",
]

log = logging.getLogger(__name__)

_ROOT = Path(__file__).resolve().parents[2]
#: The user-data template; outside the package, so an installed control plane passes
#: ``user_data_template`` (see ``make``).
USER_DATA_TEMPLATE = _ROOT / "deploy" / "aws" / "user-data.sh"
#: The shipped on-demand price table.
PRICES_PATH = Path(__file__).resolve().parent / "data" / "aws_prices.json"
#: AWS's public SSM parameter for the latest Deep Learning Base AMI (NVIDIA driver, CUDA).
DEFAULT_IMAGE = (
    "resolve:ssm:/aws/service/deeplearning/ami/x86_64/"
    "base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"
)
#: Put on an instance just before the control plane terminates it, so ``status`` can tell
#: our terminations from everyone else's.
TAG_TERMINATED_BY = "trainbot-terminated-by"
_BY_CONTROL_PLANE = "control-plane"

#: Seconds between EC2's spot interruption notice and the instance being reclaimed.
TERMINATION_WINDOW_S = 120.0
#: Largest user data EC2 accepts, before base64.
_USER_DATA_MAX = 16 * 1024
_GIB = 1 << 30
_SCRATCH_DIR = "/var/lib/trainbot/scratch"

#: (accelerator, count) → instance type, for specs that name an accelerator and no type.
ACCELERATOR_TYPES: Mapping[tuple[str, int], str] = {
    ("T4", 1): "g4dn.xlarge",
    ("T4", 4): "g4dn.12xlarge",
    ("T4", 8): "g4dn.metal",
    ("A10G", 1): "g5.xlarge",
    ("A10G", 4): "g5.12xlarge",
    ("A10G", 8): "g5.48xlarge",
    ("L4", 1): "g6.xlarge",
    ("L4", 4): "g6.12xlarge",
    ("L4", 8): "g6.48xlarge",
    ("L40S", 1): "g6e.xlarge",
    ("L40S", 4): "g6e.12xlarge",
    ("L40S", 8): "g6e.48xlarge",
    ("V100", 1): "p3.2xlarge",
    ("V100", 4): "p3.8xlarge",
    ("V100", 8): "p3.16xlarge",
    ("A100", 8): "p4d.24xlarge",
    ("A100-80GB", 8): "p4de.24xlarge",
    ("H100", 8): "p5.48xlarge",
    ("H200", 8): "p5e.48xlarge",
}

# Instance-family groups → (spot quota, on-demand quota), each (code, name). Codes from
# the Amazon EC2 quotas page of the Service Quotas user guide; all count vCPUs.
_QUOTAS: Mapping[str, tuple[tuple[str, str], tuple[str, str]]] = {
    "G": (
        ("L-3819A6DF", "All G and VT Spot Instance Requests"),
        ("L-DB2E81BA", "Running On-Demand G and VT instances"),
    ),
    "P": (
        ("L-7212CCBC", "All P4, P3 and P2 Spot Instance Requests"),
        ("L-417A185B", "Running On-Demand P instances"),
    ),
    "P5": (
        ("L-C4BD4855", "All P5 Spot Instance Requests"),
        ("L-417A185B", "Running On-Demand P instances"),
    ),
    "standard": (
        ("L-34B43A08", "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests"),
        ("L-1216C47A", "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances"),
    ),
    "X": (
        ("L-E3A00192", "All X Spot Instance Requests"),
        ("L-7295265B", "Running On-Demand X instances"),
    ),
    "Inf": (
        ("L-B5D1601B", "All Inf Spot Instance Requests"),
        ("L-1945791B", "Running On-Demand Inf instances"),
    ),
    "Trn": (
        ("L-6B0D517C", "All Trn Spot Instance Requests"),
        ("L-2C3B7624", "Running On-Demand Trn instances"),
    ),
    "DL": (
        ("L-85EED4F7", "All DL Spot Instance Requests"),
        ("L-6E869C2A", "Running On-Demand DL instances"),
    ),
    "F": (
        ("L-88CF9481", "All F Spot Instance Requests"),
        ("L-74FC7D96", "Running On-Demand F instances"),
    ),
}
_STANDARD_LETTERS = frozenset("acdhimrtz")
_FAMILY = re.compile(r"^([a-z]+?)(\d+)")

#: "service.Operation" → the IAM action it needs, for "access denied" messages; the
#: tests check that deploy/aws/iam-policy.json grants every one the provider calls.
IAM_ACTIONS: Mapping[str, str] = {
    "ec2.RunInstances": "ec2:RunInstances",
    "ec2.CreateTags": "ec2:CreateTags",
    "ec2.TerminateInstances": "ec2:TerminateInstances",
    "ec2.DescribeInstances": "ec2:DescribeInstances",
    "ec2.DescribeInstanceTypes": "ec2:DescribeInstanceTypes",
    "ec2.DescribeInstanceTypeOfferings": "ec2:DescribeInstanceTypeOfferings",
    "ec2.DescribeAvailabilityZones": "ec2:DescribeAvailabilityZones",
    "ec2.DescribeSpotPriceHistory": "ec2:DescribeSpotPriceHistory",
    "ec2.DescribeSpotInstanceRequests": "ec2:DescribeSpotInstanceRequests",
    "ec2.DescribeImages": "ec2:DescribeImages",
    "ec2.GetSpotPlacementScores": "ec2:GetSpotPlacementScores",
    "ec2.GetConsoleOutput": "ec2:GetConsoleOutput",
    "service-quotas.GetServiceQuota": "servicequotas:GetServiceQuota",
    "service-quotas.GetAWSDefaultServiceQuota": "servicequotas:GetAWSDefaultServiceQuota",
    "s3.GetBucketLocation": "s3:GetBucketLocation",
    "s3.HeadBucket": "s3:ListBucket",
    "budgets.CreateBudget": "budgets:ModifyBudget",
    "budgets.UpdateBudget": "budgets:ModifyBudget",
    "budgets.DeleteBudget": "budgets:ModifyBudget",
    "budgets.CreateNotification": "budgets:ModifyBudget",
    "budgets.DescribeBudget": "budgets:ViewBudget",
    "budgets.DescribeNotificationsForBudget": "budgets:ViewBudget",
    "ssm.GetParameter": "ssm:GetParameter",
    "sts.GetCallerIdentity": "",  # needs no permission
    "sts.DecodeAuthorizationMessage": "sts:DecodeAuthorizationMessage",
    "pricing.GetProducts": "pricing:GetProducts",  # refresh-prices only, run by a person
}

_DENIED = frozenset(
    {
        "AccessDenied",
        "AccessDeniedException",
        "UnauthorizedOperation",
        "UnauthorizedException",
        "Forbidden",
    }
)
_BAD_CREDENTIALS = frozenset(
    {
        "AuthFailure",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "ExpiredTokenException",
        "RequestExpired",
        "UnrecognizedClientException",
        "InvalidAccessKeyId",
    }
)
_NO_CAPACITY = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientCapacity",
        "InsufficientHostCapacity",
        "InsufficientReservedInstanceCapacity",
        "SpotMaxPriceTooLow",
        "Unsupported",
    }
)
_OVER_QUOTA = frozenset(
    {"VcpuLimitExceeded", "MaxSpotInstanceCountExceeded", "InstanceLimitExceeded"}
)
_NOT_FOUND = frozenset({"InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"})
# The instance's state reason when EC2 reclaimed it.
_RECLAIMED = frozenset(
    {
        "Server.SpotInstanceTermination",
        "Server.SpotInstanceShutdown",
        "Server.InsufficientInstanceCapacity",
    }
)
# Spot request status codes of an interruption (the request's side of the story).
_SPOT_INTERRUPTED = frozenset(
    {
        "instance-terminated-by-price",
        "instance-terminated-no-capacity",
        "instance-terminated-capacity-oversubscribed",
        "instance-terminated-launch-group-constraint",
        "instance-terminated-by-experiment",
        "instance-stopped-by-price",
        "instance-stopped-no-capacity",
        "instance-stopped-capacity-oversubscribed",
        "instance-stopped-by-experiment",
    }
)
_SPOT_NOTICE = frozenset({"marked-for-termination", "marked-for-stop"})
_EXIT_MARKER = re.compile(r"trainbot-runner exited with code (\d+)")
_SERVICE_TIME = re.compile(r"\((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) (?:GMT|UTC)\)")
_TOKEN_SAFE = re.compile(r"^[A-Za-z0-9 +\-=._:/@]{1,64}$")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # fullmatch: "$" would let "X\n" through
_PLACEHOLDER = re.compile(r"@@([A-Z_]+)@@")
_ENCODED = re.compile(r"Encoded authorization failure message:\s*(\S+)")


class AwsCredentialsError(ProviderError):
    """No AWS credentials were found, or AWS rejected them; nothing was created."""


# -- small pure helpers ------------------------------------------------------------------


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _utc(value: datetime) -> datetime:
    return value.astimezone(timezone.utc) if value.tzinfo else value.replace(tzinfo=timezone.utc)


def _tags(item: Mapping[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in item.get("Tags") or ()}


def _client_token(key: str) -> str:
    """The idempotency key as an EC2 ClientToken (64 ASCII characters at most).

    Keys outside EC2's tag alphabet or longer than 64 are hashed, so the same key always
    gives the same token.
    """
    if _TOKEN_SAFE.match(key):
        return key
    return "sha256-" + hashlib.sha256(key.encode()).hexdigest()[:57]


def budget_name(run_id: str) -> str:
    """The AWS Budget of a run; a name, because that is what makes creating it idempotent."""
    return re.sub(r"[:\\]", "-", f"trainbot-{run_id}")[:100]


def _accelerator_key(name: str) -> str:
    text = name.strip().upper()
    for prefix in ("NVIDIA-", "TESLA-", "NVIDIA ", "TESLA "):
        text = text.removeprefix(prefix)
    return text.removeprefix("TESLA-").replace(" ", "-")


def _family_group(instance_type: str) -> str | None:
    """The quota group of an instance type ("g5.xlarge" → "G"), None when unknown."""
    match = _FAMILY.match(instance_type.lower())
    if match is None:
        return None
    letters, generation = match.group(1), int(match.group(2))
    if letters in ("g", "vt"):
        return "G"
    if letters == "p":
        return "P5" if generation == 5 else "P" if generation <= 4 else None
    if letters == "x":
        return "X"
    if letters in ("inf", "trn", "dl", "f"):
        return {"inf": "Inf", "trn": "Trn", "dl": "DL", "f": "F"}[letters]
    if len(letters) == 1 and letters in _STANDARD_LETTERS:
        return "standard"
    return None


def quota_codes(instance_type: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """((spot code, name), (on-demand code, name)) of the quotas that count this type."""
    group = _family_group(instance_type)
    if group is None:
        raise ProviderError(
            f"trainbot knows no EC2 Service Quotas code for {instance_type}'s family; check "
            "its vCPU quota in the Service Quotas console, or choose a G, P, or standard type"
        )
    return _QUOTAS[group]


def _decode_console(output: str | None) -> str:
    if not output:
        return ""
    try:
        return base64.b64decode(output, validate=False).decode("utf-8", "replace")
    except ValueError:
        return output


@functools.lru_cache(maxsize=4)
def _price_table(path: str, mtime: float) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ProviderError(
            f"the AWS price table {path} is unreadable ({exc}): reinstall trainbot or run "
            "python -m jobs.providers.aws refresh-prices"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("regions"), dict):
        raise ProviderError(f"the AWS price table {path} has no 'regions': regenerate it")
    return data


def _load_prices(path: Path) -> dict[str, Any]:
    try:
        mtime = path.stat().st_mtime
    except OSError:
        mtime = 0.0
    return _price_table(str(path), mtime)


@dataclass(frozen=True)
class _TypeInfo:
    vcpus: int
    gpus: int


# -- the provider ------------------------------------------------------------------------


class AwsProvider:
    """Spot (and on-demand) EC2 instances in one region, for trainbot's attempts."""

    name = "aws"
    #: Seconds between the interruption notice and the reclaim; preflight's emergency
    #: checkpoint has to fit in it.
    termination_window_s = TERMINATION_WINDOW_S
    capabilities = Capabilities(runs_on_this_machine=False)

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
        runner_package: str = "trainbot[runner]",
        user_data_template: str | os.PathLike[str] | None = None,
        prices_path: str | os.PathLike[str] | None = None,
        budget_sns_topic_arn: str | None = None,
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        """``instance_profile``: name or ARN of the runner's instance profile (its policy is
        deploy/aws/runner-instance-policy.json). ``subnet_ids``: zone → subnet; when given,
        only those zones are used. ``image_id``: an AMI id or ``resolve:ssm:<parameter>``
        (default: the Deep Learning Base AMI). ``endpoint_url``: one endpoint for every
        service (moto in tests). ``runner_package``: what the instance pip-installs.
        ``budget_sns_topic_arn``: also notify this topic at budget thresholds."""
        if not region:
            raise ProviderError("the AWS provider needs a region: set TRAINBOT_AWS_REGION")
        self.region = region
        self.instance_profile = instance_profile or None
        self.subnet_ids = dict(subnet_ids or {})
        self.security_group_ids = tuple(security_group_ids)
        self.image_id = image_id or DEFAULT_IMAGE
        self.runner_package = runner_package
        self.budget_sns_topic_arn = budget_sns_topic_arn
        self._endpoint_url = endpoint_url or None
        self._session = session or boto3.session.Session()
        self._template_path = Path(user_data_template or USER_DATA_TEMPLATE)
        self._prices_path = Path(prices_path or PRICES_PATH)
        self._clock = clock
        self._lock = threading.Lock()
        self._clients: dict[tuple[str, str, bool], Any] = {}
        self._types: dict[tuple[str, str], _TypeInfo] = {}
        self._roots: dict[tuple[str, str], tuple[str, int] | None] = {}
        self._account: str | None = None

    # -- clients ---------------------------------------------------------------------------

    def client(self, service: str, *, region: str | None = None, advisory: bool = False) -> Any:
        """The botocore client this provider uses for ``service`` (cached, thread-safe).

        ``advisory`` clients answer questions whose failure only degrades a report (spot
        placement scores, console output): one try and short timeouts, so a slow or
        refusing endpoint never holds up preflight or reconcile. Tests attach botocore's
        Stubber to these same objects.
        """
        key = (service, region or self.region, advisory)
        with self._lock:
            found = self._clients.get(key)
            if found is None:
                config = Config(
                    retries={"mode": "standard", "max_attempts": 1 if advisory else 4},
                    connect_timeout=5 if advisory else 10,
                    read_timeout=15 if advisory else 60,
                    user_agent_extra="trainbot",
                )
                try:
                    found = self._session.client(
                        service,
                        region_name=key[1],
                        endpoint_url=self._endpoint_url,
                        config=config,
                    )
                except NoRegionError:  # pragma: no cover - region is always passed
                    raise ProviderError("no AWS region: set TRAINBOT_AWS_REGION") from None
                self._clients[key] = found
            return found

    @contextlib.contextmanager
    def _aws(self, service: str, doing: str) -> Iterator[None]:
        """Turn SDK failures into ProviderErrors that say what to do."""
        try:
            yield
        except ClientError as exc:
            raise self._client_error(exc, service=service, doing=doing) from None
        except (NoCredentialsError, PartialCredentialsError):
            raise AwsCredentialsError(
                f"no AWS credentials to {doing}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY or AWS_PROFILE for the control plane, or run it with "
                "an IAM role (deploy/aws/iam-policy.json); nothing was created"
            ) from None
        except (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError) as exc:
            raise ProviderError(
                f"cannot reach AWS {service} to {doing} ({exc}): check the control plane's "
                "network and the region, then try again"
            ) from None
        except (BotoCoreError, ResponseParserError) as exc:
            raise ProviderError(f"AWS {service} failed to {doing}: {exc}") from None

    def _client_error(self, exc: ClientError, *, service: str, doing: str) -> ProviderError:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        message = _ENCODED.sub("(encoded details omitted)", str(error.get("Message", "")))
        operation = exc.operation_name
        action = IAM_ACTIONS.get(f"{service}.{operation}") or f"{service}:{operation}"
        if code in _DENIED:
            decoded = self._decode_denial(str(error.get("Message", "")))
            if decoded is not None:
                action, resource = decoded
                where = f" on {resource}" if resource else ""
            else:
                where = ""
            return ProviderPermissionError(
                f"AWS denied the control plane permission to {doing}: it needs {action}{where} "
                f"({code}). Grant it (deploy/aws/iam-policy.json lists what trainbot needs) "
                "and try again; nothing was created",
                permission=action,
            )
        if code in _BAD_CREDENTIALS:
            return AwsCredentialsError(
                f"AWS rejected the control plane's credentials when trying to {doing} "
                f"({code}: {message}): refresh or replace them; nothing was created"
            )
        return ProviderError(f"AWS {service} refused to {doing}: {code}: {message}")

    def _decode_denial(self, message: str) -> tuple[str, str] | None:
        """The action and resource EC2 denied, from its encoded message (best effort)."""
        match = _ENCODED.search(message)
        if match is None:
            return None
        try:
            decoded = self.client("sts", advisory=True).decode_authorization_message(
                EncodedMessage=match.group(1)
            )
            context = json.loads(decoded["DecodedMessage"]).get("context", {})
        except (ClientError, BotoCoreError, ResponseParserError, ValueError, KeyError) as exc:
            log.info("could not decode an AWS authorization failure: %s", exc)
            return None
        action = context.get("action")
        return (str(action), str(context.get("resource") or "")) if action else None

    # -- catalogue -------------------------------------------------------------------------

    def instance_type(self, req: ResourceRequest) -> str:
        """The EC2 type for a request: its own, or the smallest that holds its accelerators.

        A count no single type holds gives the largest type of that accelerator, so the
        quota question is still answered (for as many instances as it takes); ``launch``
        refuses it, since an attempt is one instance.
        """
        return self._accelerator_type(req)[0]

    def _accelerator_type(self, req: ResourceRequest) -> tuple[str, int | None]:
        """(instance type, accelerators it holds; None when the request named the type)."""
        if req.instance_type:
            return req.instance_type, None
        if not req.accelerator_type:
            raise ProviderError(
                "a CPU-only run on AWS needs resources.instance_type (for example m6i.xlarge)"
            )
        wanted = _accelerator_key(req.accelerator_type)
        sizes = sorted((n, t) for (a, n), t in ACCELERATOR_TYPES.items() if a == wanted)
        if not sizes:
            known = ", ".join(sorted({a for a, _ in ACCELERATOR_TYPES}))
            raise ProviderError(
                f"no EC2 instance type is known for the accelerator {req.accelerator_type}; "
                f"set resources.instance_type, or use one of {known}"
            )
        count = max(req.accelerator_count, 1)
        n, itype = next(((n, t) for n, t in sizes if n >= count), sizes[-1])
        return itype, n

    def _type_info(self, instance_types: Sequence[str], region: str) -> dict[str, _TypeInfo]:
        missing = sorted({t for t in instance_types if (t, region) not in self._types})
        if missing:
            ec2 = self.client("ec2", region=region)
            with self._aws("ec2", f"describe instance types {', '.join(missing)}"):
                try:
                    found = ec2.describe_instance_types(InstanceTypes=missing)["InstanceTypes"]
                except ClientError as exc:
                    if exc.response.get("Error", {}).get("Code") == "InvalidInstanceType":
                        raise ProviderError(
                            f"EC2 has no instance type {', '.join(missing)} in {region}: "
                            "fix resources.instance_type"
                        ) from None
                    raise
            for item in found:
                gpus = sum(g.get("Count", 0) for g in (item.get("GpuInfo") or {}).get("Gpus", []))
                info = _TypeInfo(vcpus=int(item["VCpuInfo"]["DefaultVCpus"]), gpus=gpus)
                self._types[(item["InstanceType"], region)] = info
        return {t: self._types[(t, region)] for t in instance_types if (t, region) in self._types}

    def _zones(self, region: str) -> dict[str, str]:
        """Zone name → zone id of the region's available availability zones."""
        ec2 = self.client("ec2", region=region)
        with self._aws("ec2", f"list the availability zones of {region}"):
            zones = ec2.describe_availability_zones(
                Filters=[{"Name": "zone-type", "Values": ["availability-zone"]}]
            )["AvailabilityZones"]
        return {z["ZoneName"]: z["ZoneId"] for z in zones if z.get("State") == "available"}

    # -- Provider: questions ---------------------------------------------------------------

    def quota(self, req: ResourceRequest) -> QuotaInfo:
        """The family's vCPU quota (spot or on-demand, as asked) against what the run needs.

        Used vCPUs are counted from running and pending instances of the family in the
        same market, as EC2 counts them; the other market's quota is named in the detail.
        """
        region = req.region or self.region
        itype = self.instance_type(req)
        (spot_code, spot_name), (od_code, od_name) = quota_codes(itype)
        info = self._type_info([itype], region)[itype]
        instances = 1
        if req.accelerator_count and info.gpus:
            instances = math.ceil(req.accelerator_count / info.gpus)
        needed = float(max(info.vcpus * instances, req.cpus or 0))
        code, name = (spot_code, spot_name) if req.spot else (od_code, od_name)
        limit = self._quota_value(code, region)
        other_code = od_code if req.spot else spot_code
        try:
            other: float | None = self._quota_value(other_code, region)
        except ProviderError as exc:
            log.info("could not read quota %s in %s: %s", other_code, region, exc)
            other = None
        used = float(self._vcpus_in_use(region, itype, spot=req.spot))
        ok = used + needed <= limit
        market = "spot" if req.spot else "on-demand"
        other_text = (
            f"; the {'on-demand' if req.spot else 'spot'} quota {other_code} is {other:g} vCPUs"
            if other is not None
            else ""
        )
        detail = (
            f"AWS {market} quota {code} ({name}) in {region}: limit {limit:g} vCPUs, "
            f"{used:g} in use; {itype} needs {needed:g}{other_text}"
        )
        remedy = ""
        if not ok:
            desired = math.ceil(used + needed)
            remedy = (
                f"request an increase of {code} ({name}) in {region} to at least {desired} "
                f"vCPUs: aws service-quotas request-service-quota-increase --service-code ec2 "
                f"--quota-code {code} --desired-value {desired} --region {region} (or "
                f"https://{region}.console.aws.amazon.com/servicequotas/home/services/ec2/"
                f"quotas/{code}); new accounts start at 0 and GPU increases can take days"
            )
            if req.spot and other is not None and other >= needed:
                remedy += f", or set resources.spot=false to use the on-demand quota {od_code}"
        return QuotaInfo(
            limit=float(limit),
            used=used,
            needed=needed,
            unit="vCPUs",
            ok=ok,
            detail=detail,
            remedy=remedy,
        )

    def _quota_value(self, code: str, region: str) -> float:
        sq = self.client("service-quotas", region=region)
        with self._aws("service-quotas", f"read EC2 quota {code} in {region}"):
            try:
                quota = sq.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]
            except ClientError as exc:
                # No applied value yet: the account still has the default.
                if exc.response.get("Error", {}).get("Code") != "NoSuchResourceException":
                    raise
                quota = sq.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]
        return float(quota["Value"])

    def _vcpus_in_use(self, region: str, itype: str, *, spot: bool) -> int:
        group = _family_group(itype)
        ec2 = self.client("ec2", region=region)
        found: list[str] = []
        with self._aws("ec2", f"count running instances in {region}"):
            pages = ec2.get_paginator("describe_instances").paginate(
                Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}]
            )
            for page in pages:
                for reservation in page["Reservations"]:
                    for inst in reservation["Instances"]:
                        is_spot = inst.get("InstanceLifecycle") == "spot"
                        if is_spot == spot and _family_group(inst["InstanceType"]) == group:
                            found.append(inst["InstanceType"])
        sizes = self._type_info(sorted(set(found)), region)
        return sum(sizes[t].vcpus for t in found if t in sizes)

    def capacity(self, req: ResourceRequest) -> list[ZoneCapacity]:
        """Zones that offer the type, ranked by spot placement score where AWS gives one."""
        region = req.region or self.region
        itype = self.instance_type(req)
        zone_ids = self._zones(region)
        candidates = list(req.zones) or sorted(zone_ids)
        ec2 = self.client("ec2", region=region)
        offered: set[str] = set()
        with self._aws("ec2", f"list the zones of {region} that offer {itype}"):
            pages = ec2.get_paginator("describe_instance_type_offerings").paginate(
                LocationType="availability-zone",
                Filters=[{"Name": "instance-type", "Values": [itype]}],
            )
            for page in pages:
                offered.update(o["Location"] for o in page["InstanceTypeOfferings"])
        scores: dict[str, float] = {}
        scores_note = ""
        if req.spot and offered:
            scores, scores_note = self._placement_scores(itype, region)
        by_id = {zid: name for name, zid in zone_ids.items()}
        zone_scores = {by_id[zid]: s for zid, s in scores.items() if zid in by_id}
        out: list[ZoneCapacity] = []
        for zone in dict.fromkeys(candidates):
            if zone not in zone_ids:
                out.append(ZoneCapacity(zone, False, None, f"{zone} is not a zone of {region}"))
            elif zone not in offered:
                out.append(ZoneCapacity(zone, False, None, f"{itype} is not offered in {zone}"))
            elif self.subnet_ids and zone not in self.subnet_ids:
                out.append(
                    ZoneCapacity(
                        zone, False, None, f"no subnet is configured for {zone} (subnet_ids)"
                    )
                )
            else:
                score = zone_scores.get(zone)
                if score is not None:
                    detail = f"{itype} offered; spot placement score {score:g}/10"
                elif req.spot:
                    detail = f"{itype} offered; {scores_note or 'no spot placement score'}"
                else:
                    detail = f"{itype} offered (on demand)"
                out.append(ZoneCapacity(zone, True, score, detail))
        order = {z: i for i, z in enumerate(candidates)}
        out.sort(
            key=lambda z: (
                not z.available,
                z.score is None,
                -(z.score or 0.0),
                order.get(z.zone, 0),
            )
        )
        return out

    def _placement_scores(self, itype: str, region: str) -> tuple[dict[str, float], str]:
        """Zone id → score, or an empty map and why: scores only rank, never block."""
        scores_client = self.client("ec2", region=region, advisory=True)
        try:
            answer = scores_client.get_spot_placement_scores(
                InstanceTypes=[itype],
                TargetCapacity=1,
                TargetCapacityUnitType="units",
                SingleAvailabilityZone=True,
                RegionNames=[region],
            )
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "error")
            if code in _DENIED:
                note = (
                    f"spot placement scores not permitted ({code}): grant "
                    "ec2:GetSpotPlacementScores to rank zones by likelihood of spot capacity"
                )
            else:
                note = f"spot placement scores unavailable ({code})"
            log.info("%s for %s in %s", note, itype, region)
            return {}, note
        except (BotoCoreError, ResponseParserError) as exc:
            log.info("spot placement scores for %s in %s failed: %s", itype, region, exc)
            return {}, f"spot placement scores unavailable ({type(exc).__name__})"
        scores = {
            s["AvailabilityZoneId"]: float(s["Score"])
            for s in answer.get("SpotPlacementScores", [])
            if s.get("AvailabilityZoneId") and s.get("Region", region) == region
        }
        return scores, "" if scores else "no spot placement score returned"

    def price(self, req: ResourceRequest, *, zone: str | None = None) -> PriceQuote:
        """Latest spot price (the zone's, or the lowest of the candidate zones) and on-demand."""
        region = req.region or self.region
        itype = self.instance_type(req)
        on_demand, od_as_of, od_source = self._on_demand(itype, region)
        ec2 = self.client("ec2", region=region)
        zones = [zone] if zone else list(req.zones)
        params: dict[str, Any] = {
            "InstanceTypes": [itype],
            "ProductDescriptions": ["Linux/UNIX"],
            "StartTime": self._clock(),
        }
        if zones:
            params["Filters"] = [{"Name": "availability-zone", "Values": zones}]
        latest: dict[str, tuple[datetime, float]] = {}
        with self._aws("ec2", f"read the spot price of {itype} in {region}"):
            for page in ec2.get_paginator("describe_spot_price_history").paginate(**params):
                for item in page["SpotPriceHistory"]:
                    az, when = item["AvailabilityZone"], _utc(item["Timestamp"])
                    if az not in latest or when > latest[az][0]:
                        latest[az] = (when, float(item["SpotPrice"]))
        if latest:
            best_zone, (spot_at, spot) = min(latest.items(), key=lambda kv: kv[1][1])
            source = (
                f"aws spot price history ({best_zone}, {spot_at:%Y-%m-%d %H:%M} UTC); "
                f"on-demand: {od_source}"
            )
            as_of = min(spot_at, od_as_of)
        else:
            spot, as_of = on_demand, od_as_of
            where = ", ".join(zones) if zones else region
            source = f"no spot price for {itype} in {where}; on-demand used: {od_source}"
        return PriceQuote(
            spot_usd_per_hour=spot,
            on_demand_usd_per_hour=on_demand,
            source=source,
            as_of=as_of,
        )

    def _on_demand(self, itype: str, region: str) -> tuple[float, datetime, str]:
        table = _load_prices(self._prices_path)
        regions: dict[str, Any] = table["regions"]
        order = [region, "us-east-1", *sorted(regions)]
        for name in dict.fromkeys(order):
            entry = regions.get(name) or {}
            price = (entry.get("prices") or {}).get(itype)
            if price is None:
                continue
            as_of = datetime.combine(
                date.fromisoformat(str(entry["as_of"])), datetime.min.time(), timezone.utc
            )
            source = f"shipped table ({entry.get('source', 'AWS price list')}, {entry['as_of']})"
            if name != region:
                source += f", {name} price used for {region}"
            return float(price), as_of, source
        raise ProviderError(
            f"the shipped AWS price table has no on-demand price for {itype}: run "
            f"python -m jobs.providers.aws refresh-prices --region {region} --type {itype}"
        )

    def bucket_region(self, uri: str) -> str | None:
        """Region of an ``s3://`` bucket; None for other schemes, or when AWS will not say.

        Access denied is not an error here: the control plane may not be allowed to read a
        team's data bucket that the instance role can. It tries ``HeadBucket``, whose
        refusal still carries the region header, then logs why and returns None, and the
        data-locality check warns. A bucket that does not exist is an error.
        """
        parsed = urlparse(uri)
        if parsed.scheme != "s3":
            return None
        bucket = parsed.netloc
        if not bucket:
            raise ProviderError(f"{uri!r} names no bucket: write s3://BUCKET/PREFIX")
        s3 = self.client("s3")
        try:
            with self._aws("s3", f"find the region of s3://{bucket}"):
                try:
                    answer = s3.get_bucket_location(Bucket=bucket)
                except ClientError as exc:
                    if exc.response.get("Error", {}).get("Code") == "NoSuchBucket":
                        raise ProviderError(
                            f"the bucket s3://{bucket} does not exist: fix data_uri or "
                            "checkpoint_uri"
                        ) from None
                    raise
        except ProviderPermissionError as exc:
            region = self._region_from_head(bucket)
            if region is None:
                log.warning("cannot tell the region of s3://%s: %s", bucket, exc)
            return region
        location = answer.get("LocationConstraint") or "us-east-1"
        return "eu-west-1" if location == "EU" else str(location)

    def _region_from_head(self, bucket: str) -> str | None:
        try:
            answer = self.client("s3", advisory=True).head_bucket(Bucket=bucket)
            headers = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        except ClientError as exc:
            headers = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        except (BotoCoreError, ResponseParserError):
            return None
        region = headers.get("x-amz-bucket-region")
        return str(region) if region else None

    # -- budgets ---------------------------------------------------------------------------

    def _account_id(self) -> str:
        if self._account is None:
            with self._aws("sts", "identify the AWS account"):
                self._account = str(self.client("sts").get_caller_identity()["Account"])
        return self._account

    def create_budget(
        self,
        *,
        run_id: str,
        usd: float,
        thresholds: Sequence[int],
        email: str | None = None,
    ) -> str:
        """An AWS Budget for the run's tagged cost, notifying at each threshold percent.

        Idempotent on :func:`budget_name`: a second call updates the limit and adds missing
        notifications. Costs are matched on the ``trainbot-run-id`` cost-allocation tag,
        which has to be activated once in the Billing console. The period is the calendar
        year (AWS's longest standard one). Without an email or SNS topic the budget is
        created with no notifications, since AWS requires a subscriber for each.
        """
        if not (usd > 0 and math.isfinite(usd)):
            raise ProviderError(f"run {run_id}: a budget needs a positive amount (got {usd})")
        bad = [t for t in thresholds if not 0 < t <= 1000]
        if bad:
            raise ProviderError(f"budget thresholds must be percentages in (0, 1000]: {bad}")
        name = budget_name(run_id)
        account = self._account_id()
        budgets = self.client("budgets", region="us-east-1")
        budget = {
            "BudgetName": name,
            "BudgetLimit": {"Amount": f"{usd:.2f}", "Unit": "USD"},
            "TimeUnit": "ANNUALLY",
            "BudgetType": "COST",
            "CostFilters": {"TagKeyValue": [f"user:{TAG_RUN_ID}${run_id}"]},
        }
        subscribers = []
        if email:
            subscribers.append({"SubscriptionType": "EMAIL", "Address": email})
        if self.budget_sns_topic_arn:
            subscribers.append({"SubscriptionType": "SNS", "Address": self.budget_sns_topic_arn})
        wanted = sorted(set(thresholds)) if subscribers else []

        def notification(threshold: float) -> dict[str, Any]:
            return {
                "NotificationType": "ACTUAL",
                "ComparisonOperator": "GREATER_THAN",
                "Threshold": float(threshold),
                "ThresholdType": "PERCENTAGE",
            }

        with self._aws("budgets", f"create the budget {name}"):
            try:
                budgets.create_budget(
                    AccountId=account,
                    Budget=budget,
                    NotificationsWithSubscribers=[
                        {"Notification": notification(t), "Subscribers": subscribers}
                        for t in wanted
                    ],
                )
                log.info("created AWS budget %s (%.2f USD) for run %s", name, usd, run_id)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "DuplicateRecordException":
                    raise
                current = budgets.describe_budget(AccountId=account, BudgetName=name)["Budget"]
                if float(current["BudgetLimit"]["Amount"]) != round(usd, 2):
                    budgets.update_budget(AccountId=account, NewBudget=budget)
                existing = budgets.describe_notifications_for_budget(
                    AccountId=account, BudgetName=name
                ).get("Notifications", [])
                have = {
                    float(n["Threshold"])
                    for n in existing
                    if n.get("NotificationType") == "ACTUAL"
                    and n.get("ThresholdType", "PERCENTAGE") == "PERCENTAGE"
                }
                for t in wanted:
                    if float(t) not in have:
                        budgets.create_notification(
                            AccountId=account,
                            BudgetName=name,
                            Notification=notification(t),
                            Subscribers=subscribers,
                        )
        if not subscribers:
            log.warning(
                "AWS budget %s has no notifications: give an email or budget_sns_topic_arn", name
            )
        return name

    def delete_budget(self, *, run_id: str) -> None:
        """Remove the run's budget; a budget that is already gone is not an error."""
        name = budget_name(run_id)
        account = self._account_id()
        with self._aws("budgets", f"delete the budget {name}"):
            try:
                self.client("budgets", region="us-east-1").delete_budget(
                    AccountId=account, BudgetName=name
                )
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "NotFoundException":
                    raise

    # -- Provider: instances ---------------------------------------------------------------

    def check_launch_permissions(self, req: ResourceRequest, *, zone: str | None = None) -> None:
        """Ask EC2 whether a launch would be allowed (``DryRun``), creating nothing.

        Raises AwsCredentialsError without credentials, ProviderPermissionError naming
        the missing permission (``ec2:RunInstances``, ``iam:PassRole`` …) otherwise.
        """
        with self._aws("sts", "check the control plane's AWS credentials"):
            self.client("sts").get_caller_identity()
        if zone is None and self.subnet_ids:
            zone = sorted(self.subnet_ids)[0]
        probe = LaunchRequest(
            run_id="preflight",
            attempt_id="permission-check",
            owner="trainbot",
            request=req,
            zone=zone or "",
            command=["true"],
            spot=req.spot,
        )
        params = self._launch_params(probe, self.instance_type(req), token="", user_data="")
        del params["ClientToken"], params["UserData"]
        ec2 = self.client("ec2", region=req.region or self.region)
        with self._aws("ec2", "launch instances (dry run)"):
            try:
                ec2.run_instances(DryRun=True, **params)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "DryRunOperation":
                    raise

    def launch(self, req: LaunchRequest) -> InstanceInfo:
        """Start the attempt's instance, or return the one this key already started."""
        region = req.request.region or self.region
        if region != self.region:
            raise ProviderError(
                f"run {req.run_id} asks for {region}, but this control plane launches in "
                f"{self.region} (TRAINBOT_AWS_REGION): set resources.region={self.region} or "
                "run a control plane for that region"
            )
        if not req.command:
            raise ProviderError(
                f"run {req.run_id} attempt {req.attempt_id}: the launch command is empty;"
                " the spec needs a command to run"
            )
        itype, holds = self._accelerator_type(req.request)
        if holds is not None and req.request.accelerator_count > holds:
            raise ProviderError(
                f"run {req.run_id}: {req.request.accelerator_count} {req.request.accelerator_type}"
                f" do not fit one instance ({itype} holds {holds}); ask for at most {holds} per "
                "instance and more instances"
            )
        token = _client_token(req.idempotency_key or f"{req.run_id}/{req.attempt_id}")
        user_data = self.render_user_data(req)
        existing = self._find_by_token(token)
        if existing is not None:
            log.info("launch of %s/%s adopts %s", req.run_id, req.attempt_id, existing.instance_id)
            return existing
        params = self._launch_params(req, itype, token=token, user_data=user_data)
        ec2 = self.client("ec2")
        with self._aws("ec2", f"launch {itype} in {req.zone or self.region}"):
            try:
                answer = ec2.run_instances(**params)
            except ClientError as exc:
                raise self._launch_error(exc, req=req, itype=itype) from None
        inst = answer["Instances"][0]
        log.info(
            "launched %s (%s %s in %s) for run %s attempt %s",
            inst["InstanceId"],
            "spot" if req.spot else "on-demand",
            itype,
            inst.get("Placement", {}).get("AvailabilityZone", req.zone),
            req.run_id,
            req.attempt_id,
        )
        return self._info(inst)

    def _launch_error(self, exc: ClientError, *, req: LaunchRequest, itype: str) -> Exception:
        error = exc.response.get("Error", {})
        code, message = str(error.get("Code", "")), str(error.get("Message", ""))
        where = req.zone or self.region
        market = "spot" if req.spot else "on-demand"
        if code in _NO_CAPACITY:
            return CapacityError(
                f"EC2 has no {market} capacity for {itype} in {where} now ({code}): "
                "try the next zone",
                zone=req.zone or None,
            )
        if code in _OVER_QUOTA:
            return QuotaExceeded(
                f"the {market} vCPU quota for {itype} in {self.region} is used up ({code}): "
                f"{message}; request an increase in Service Quotas"
            )
        if code == "IdempotentParameterMismatch":
            return ProviderError(
                f"attempt {req.attempt_id} of run {req.run_id} was launched before with other "
                "parameters under the same idempotency key; start a new attempt"
            )
        if code in _DENIED:
            fallback = "ec2:RunInstances (with ec2:CreateTags and iam:PassRole)"
            decoded = self._decode_denial(message)
            action = decoded[0] if decoded else fallback
            return ProviderPermissionError(
                f"AWS denied launching {itype} for run {req.run_id}: the control plane needs "
                f"{action}{' on ' + decoded[1] if decoded and decoded[1] else ''} ({code}). "
                "Grant it (deploy/aws/iam-policy.json); nothing was created",
                permission=decoded[0] if decoded else "ec2:RunInstances",
            )
        return self._client_error(exc, service="ec2", doing=f"launch {itype} in {where}")

    def _launch_params(
        self, req: LaunchRequest, itype: str, *, token: str, user_data: str
    ) -> dict[str, Any]:
        tags = [
            {"Key": k, "Value": v[:256]}
            for k, v in {
                TAG_MANAGED: "true",
                TAG_RUN_ID: req.run_id,
                TAG_ATTEMPT_ID: req.attempt_id,
                TAG_OWNER: req.owner,
                TAG_IDEMPOTENCY_KEY: token,
                "Name": f"trainbot {req.run_id} {req.attempt_id}",
            }.items()
        ]
        image, root = self._image(self.region)
        params: dict[str, Any] = {
            "ImageId": image,
            "InstanceType": itype,
            "MinCount": 1,
            "MaxCount": 1,
            "ClientToken": token,
            "UserData": user_data,
            "InstanceInitiatedShutdownBehavior": "terminate",
            "MetadataOptions": {
                "HttpTokens": "required",
                "HttpPutResponseHopLimit": 1,
                "HttpEndpoint": "enabled",
                "InstanceMetadataTags": "disabled",
            },
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": tags},
                {"ResourceType": "volume", "Tags": tags},
            ],
        }
        if root is not None:
            device, base_gib = root
            params["BlockDeviceMappings"] = [
                {
                    "DeviceName": device,
                    "Ebs": {
                        "VolumeSize": base_gib + math.ceil(max(req.scratch_bytes, 0) / _GIB),
                        "VolumeType": "gp3",
                        "DeleteOnTermination": True,
                        "Encrypted": True,
                    },
                }
            ]
        if req.spot:
            params["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate",
                },
            }
        if self.instance_profile:
            key = "Arn" if self.instance_profile.startswith("arn:") else "Name"
            params["IamInstanceProfile"] = {key: self.instance_profile}
        if self.subnet_ids:
            subnet = self.subnet_ids.get(req.zone)
            if subnet is None:
                raise CapacityError(
                    f"no subnet is configured for {req.zone or 'an unnamed zone'} "
                    f"(subnet_ids has {', '.join(sorted(self.subnet_ids))}): use one of those "
                    "zones or add a subnet for it",
                    zone=req.zone or None,
                )
            params["SubnetId"] = subnet
        elif req.zone:
            params["Placement"] = {"AvailabilityZone": req.zone}
        if self.security_group_ids:
            params["SecurityGroupIds"] = list(self.security_group_ids)
        return params

    def _image(self, region: str) -> tuple[str, tuple[str, int] | None]:
        """The AMI id to launch and its (root device, size in GiB), when AWS says."""
        image = self.image_id
        if image.startswith("resolve:ssm:"):
            parameter = image.removeprefix("resolve:ssm:")
            with self._aws("ssm", f"resolve the image parameter {parameter}"):
                try:
                    image = self.client("ssm", region=region).get_parameter(Name=parameter)[
                        "Parameter"
                    ]["Value"]
                except ClientError as exc:
                    if exc.response.get("Error", {}).get("Code") == "ParameterNotFound":
                        raise ProviderError(
                            f"the SSM parameter {parameter} does not exist in {region}: set "
                            "TRAINBOT_AWS_IMAGE_ID to an AMI with NVIDIA drivers"
                        ) from None
                    raise
        if (region, image) in self._roots:  # an AMI never changes
            return image, self._roots[(region, image)]
        with self._aws("ec2", f"describe the image {image}"):
            images = self.client("ec2", region=region).describe_images(ImageIds=[image])["Images"]
        if not images:
            raise ProviderError(f"the AMI {image} does not exist in {region}: fix image_id")
        found = images[0]
        device = found.get("RootDeviceName")
        root = None
        for mapping in found.get("BlockDeviceMappings") or ():
            if mapping.get("DeviceName") == device and "Ebs" in mapping:
                root = (str(device), int(mapping["Ebs"].get("VolumeSize") or 8))
        self._roots[(region, image)] = root
        return image, root

    def render_user_data(self, req: LaunchRequest) -> str:
        """The instance's boot script: install the runner, run the command, shut down.

        It runs as root, so every value in it is data: each is shell-quoted once and the
        template is substituted in one pass, so no value is ever read again as template
        (a command word holding "@@ENV@@" stays that text) or as shell. The environment
        is quoted into a root-only file on the instance; names must be identifiers and
        values may not hold newlines, so nothing can end the here-document early.
        """
        try:
            template = self._template_path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ProviderError(
                f"cannot read the AWS user-data template {self._template_path} ({exc}): "
                "pass user_data_template (TRAINBOT_AWS_USER_DATA) pointing at "
                "deploy/aws/user-data.sh"
            ) from None
        env = {
            "TRAINBOT_RUN_ID": req.run_id,
            "TRAINBOT_ATTEMPT_ID": req.attempt_id,
            "TRAINBOT_PREEMPTION_SOURCES": "aws",
            **req.env,
            "TRAINBOT_SCRATCH_DIR": _SCRATCH_DIR,
            "TRAINBOT_SCRATCH_BYTES": str(max(req.scratch_bytes, 0)),
            "TRAINBOT_TERMINATION_WINDOW_S": f"{TERMINATION_WINDOW_S:g}",
        }
        lines = []
        for key, value in env.items():
            if not _ENV_NAME.fullmatch(key):
                raise ProviderError(
                    f"run {req.run_id}: {key!r} is not a valid variable name: environment "
                    "names are letters, digits and underscores, not starting with a digit; "
                    "rename it in the spec's env"
                )
            if "\n" in value or "\r" in value or "\0" in value:
                raise ProviderError(
                    f"run {req.run_id}: the value of {key} holds a line break or a NUL, which "
                    "the instance's environment file cannot carry; put it on one line"
                )
            lines.append(f"{key}={shlex.quote(value)}")
        for word in (*req.command, self.runner_package):
            if "\0" in word:
                raise ProviderError(
                    f"run {req.run_id}: the command or the runner package holds a NUL "
                    "character, which no program can be given; remove it"
                )
        values = {
            "RUNNER_PACKAGE": shlex.quote(self.runner_package),
            "SCRATCH_DIR": shlex.quote(_SCRATCH_DIR),
            "COMMAND": shlex.join(req.command),
            "ENV": "\n".join(lines),
        }
        for name in values:
            if f"@@{name}@@" not in template:
                raise ProviderError(
                    f"the user-data template {self._template_path} lacks @@{name}@@: restore "
                    "it from deploy/aws/user-data.sh"
                )
        # One pass, with a function (no backslash escapes): what it inserts is never rescanned.
        rendered = _PLACEHOLDER.sub(lambda m: values.get(m[1], m[0]), template)
        if len(rendered.encode()) > _USER_DATA_MAX:
            raise ProviderError(
                f"run {req.run_id}: the boot script is {len(rendered.encode())} bytes, over "
                f"EC2's {_USER_DATA_MAX}; shorten the command or the spec's env"
            )
        return rendered

    def _find_by_token(self, token: str) -> InstanceInfo | None:
        ec2 = self.client("ec2")
        found: list[dict[str, Any]] = []
        with self._aws("ec2", "look for an instance launched with this key"):
            pages = ec2.get_paginator("describe_instances").paginate(
                Filters=[
                    {"Name": f"tag:{TAG_IDEMPOTENCY_KEY}", "Values": [token]},
                    {"Name": f"tag:{TAG_MANAGED}", "Values": ["true"]},
                ]
            )
            for page in pages:
                for reservation in page["Reservations"]:
                    found.extend(reservation["Instances"])
        if not found:
            return None
        found.sort(key=lambda i: (i["State"]["Name"] in ("terminated", "shutting-down"),))
        return self._info(found[0])

    def status(self, instance_id: str) -> InstanceStatus:
        """What EC2 says about the instance, with the spot request's side where there is one."""
        inst = self._describe(instance_id)
        state = inst["State"]["Name"]
        reason = (inst.get("StateReason") or {}).get("Code", "")
        spot: tuple[str, datetime | None] | None = None
        if inst.get("SpotInstanceRequestId") and reason not in _RECLAIMED:
            spot = self._spot_request(inst["SpotInstanceRequestId"])
        exit_code = None
        if (
            state in ("shutting-down", "terminated", "stopping", "stopped")
            and reason == "Client.InstanceInitiatedShutdown"
            and _tags(inst).get(TAG_TERMINATED_BY) != _BY_CONTROL_PLANE
        ):
            exit_code = self._exit_code(instance_id)
        return self._classify(inst, spot=spot, exit_code=exit_code)

    def _describe(self, instance_id: str) -> dict[str, Any]:
        ec2 = self.client("ec2")
        with self._aws("ec2", f"describe {instance_id}"):
            try:
                reservations = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in _NOT_FOUND:
                    reservations = []
                else:
                    raise
        for reservation in reservations:
            for inst in reservation["Instances"]:
                if inst["InstanceId"] == instance_id:
                    return dict(inst)
        raise InstanceNotFound(
            f"EC2 has no instance {instance_id} in {self.region} (never launched there, or "
            "terminated long enough ago that EC2 forgot it)",
            instance_id=instance_id,
        )

    def _spot_request(self, request_id: str) -> tuple[str, datetime | None] | None:
        """(status code, when) of a spot request; None when EC2 will not say."""
        try:
            answer = self.client("ec2").describe_spot_instance_requests(
                SpotInstanceRequestIds=[request_id]
            )
        except (ClientError, BotoCoreError, ResponseParserError) as exc:
            log.info("spot request %s unreadable: %s", request_id, exc)
            return None
        for item in answer.get("SpotInstanceRequests", []):
            status = item.get("Status") or {}
            when = status.get("UpdateTime")
            return str(status.get("Code", "")), _utc(when) if when else None
        return None

    def _exit_code(self, instance_id: str) -> int | None:
        """The runner's exit code, from the line the user data writes to the console."""
        try:
            answer = self.client("ec2", advisory=True).get_console_output(InstanceId=instance_id)
        except (ClientError, BotoCoreError, ResponseParserError) as exc:
            log.info("console output of %s unreadable: %s", instance_id, exc)
            return None
        codes = _EXIT_MARKER.findall(_decode_console(answer.get("Output")))
        return int(codes[-1]) if codes else None

    def _classify(
        self,
        inst: Mapping[str, Any],
        *,
        spot: tuple[str, datetime | None] | None = None,
        exit_code: int | None = None,
    ) -> InstanceStatus:
        iid = inst["InstanceId"]
        state = inst["State"]["Name"]
        state_reason = inst.get("StateReason") or {}
        code = str(state_reason.get("Code", ""))
        said = str(state_reason.get("Message", "")) or code
        spot_code, spot_at = spot if spot is not None else ("", None)

        def make(s: InstanceState, why: str, **kw: Any) -> InstanceStatus:
            return InstanceStatus(instance_id=iid, state=s, reason=why, **kw)

        if state == "pending":
            return make(InstanceState.PENDING, "starting")
        if state == "running":
            if spot_code in _SPOT_NOTICE:
                return make(
                    InstanceState.RUNNING,
                    f"preemption notice: EC2 reclaims this spot instance within "
                    f"{TERMINATION_WINDOW_S:g} s ({spot_code})",
                )
            return make(InstanceState.RUNNING, "running")
        if code in _RECLAIMED or spot_code in _SPOT_INTERRUPTED:
            match = _SERVICE_TIME.search(str(inst.get("StateTransitionReason") or ""))
            if match:
                when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S").replace(
                    tzinfo=timezone.utc
                )
            else:
                when = spot_at or self._clock()
            why = spot_code if spot_code in _SPOT_INTERRUPTED else said
            return make(
                InstanceState.PREEMPTED,
                f"preempted: EC2 reclaimed the spot capacity ({why})",
                preempted_at=when,
            )
        if _tags(inst).get(TAG_TERMINATED_BY) == _BY_CONTROL_PLANE:
            return make(InstanceState.TERMINATED, "terminated by the control plane")
        if code == "Client.InstanceInitiatedShutdown":
            if exit_code == EXIT_SUCCEEDED:
                return make(
                    InstanceState.SUCCEEDED,
                    "the runner finished and the instance shut down",
                    exit_code=exit_code,
                )
            if exit_code == EXIT_PREEMPTED:
                return make(
                    InstanceState.PREEMPTED,
                    "the runner stopped on a preemption notice and the instance shut down",
                    exit_code=exit_code,
                    preempted_at=self._clock(),
                )
            if exit_code is not None:
                return make(
                    InstanceState.FAILED,
                    f"the runner exited {exit_code} and the instance shut down",
                    exit_code=exit_code,
                )
            return make(
                InstanceState.FAILED,
                "the instance shut itself down and its console shows no runner exit code (the "
                f"runner may not have started): aws ec2 get-console-output --instance-id {iid}",
            )
        if state in ("stopping", "stopped"):
            return make(
                InstanceState.FAILED,
                f"stopped ({said or 'no reason given'}); trainbot's instances terminate rather "
                "than stop, so terminate it to stop paying for its volume",
            )
        if code == "Client.UserInitiatedShutdown" or spot_code == "instance-terminated-by-user":
            return make(
                InstanceState.TERMINATED, "terminated outside trainbot (console, CLI or API)"
            )
        return make(InstanceState.FAILED, f"{state}: {said or 'EC2 gave no reason'}")

    def _info(self, inst: Mapping[str, Any]) -> InstanceInfo:
        tags = _tags(inst)
        return InstanceInfo(
            instance_id=inst["InstanceId"],
            run_id=tags.get(TAG_RUN_ID, ""),
            attempt_id=tags.get(TAG_ATTEMPT_ID, ""),
            zone=str((inst.get("Placement") or {}).get("AvailabilityZone", "")),
            state=self._classify(inst).state,
            launched_at=_utc(inst["LaunchTime"]),
            tags=tags,
        )

    def terminate(self, instance_id: str) -> None:
        """Tag the instance as ours to end, then terminate it; ended instances are left be."""
        inst = self._describe(instance_id)
        if inst["State"]["Name"] in ("shutting-down", "terminated"):
            return
        ec2 = self.client("ec2")
        with self._aws("ec2", f"terminate {instance_id}"):
            try:
                ec2.create_tags(
                    Resources=[instance_id],
                    Tags=[{"Key": TAG_TERMINATED_BY, "Value": _BY_CONTROL_PLANE}],
                )
                ec2.terminate_instances(InstanceIds=[instance_id])
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in _NOT_FOUND:
                    raise InstanceNotFound(
                        f"EC2 has no instance {instance_id} in {self.region}",
                        instance_id=instance_id,
                    ) from None
                raise
        log.info("terminated %s", instance_id)

    def list_instances(self) -> list[InstanceInfo]:
        """Every instance tagged ``trainbot-managed=true`` in the region, in any state."""
        ec2 = self.client("ec2")
        out: list[InstanceInfo] = []
        with self._aws("ec2", "list trainbot's instances"):
            pages = ec2.get_paginator("describe_instances").paginate(
                Filters=[{"Name": f"tag:{TAG_MANAGED}", "Values": ["true"]}]
            )
            for page in pages:
                for reservation in page["Reservations"]:
                    out.extend(self._info(inst) for inst in reservation["Instances"])
        return out


# -- factory -----------------------------------------------------------------------------


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
            raise ProviderError(f"subnet_ids: write zone=subnet pairs separated by commas ({bad})")
        subnets = {z.strip(): s.strip() for z, _, s in pairs}
    groups = _split(options.pop("security_group_ids", None))
    region = options.pop("region", None)
    if not region:
        session = options.get("session") or boto3.session.Session()
        options["session"] = session
        region = session.region_name
    return AwsProvider(region=region, subnet_ids=subnets, security_group_ids=groups, **options)


# -- on-demand price table ---------------------------------------------------------------


def _hourly_usd(product: Mapping[str, Any]) -> float | None:
    """The on-demand hourly USD price in one Price List product document."""
    for term in (product.get("terms") or {}).get("OnDemand", {}).values():
        for dimension in (term.get("priceDimensions") or {}).values():
            usd = (dimension.get("pricePerUnit") or {}).get("USD")
            if dimension.get("unit") == "Hrs" and usd is not None and float(usd) > 0:
                return float(usd)
    return None


def refresh_prices(
    *,
    regions: Sequence[str],
    instance_types: Sequence[str] | None = None,
    path: str | os.PathLike[str] = PRICES_PATH,
    session: boto3.session.Session | None = None,
    client: Any = None,
    today: date | None = None,
) -> dict[str, Any]:
    """Fetch on-demand Linux prices from the Price List API into the table, dated today.

    Needs ``pricing:GetProducts`` (any account). Regions not asked for keep their old,
    dated entries. Types default to those already in the table and the accelerator map.
    """
    target = Path(path)
    try:
        table: dict[str, Any] = json.loads(target.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        table = {}
    table.setdefault("regions", {})
    pricing = client or (session or boto3.session.Session()).client(
        "pricing", region_name="us-east-1"
    )
    stamp = (today or _utcnow().date()).isoformat()
    for region in regions:
        old = (table["regions"].get(region) or {}).get("prices", {})
        types = sorted(set(instance_types or [*old, *ACCELERATOR_TYPES.values()]))
        prices: dict[str, float] = {}
        for itype in types:
            filters = [
                {"Type": "TERM_MATCH", "Field": field, "Value": value}
                for field, value in (
                    ("instanceType", itype),
                    ("regionCode", region),
                    ("operatingSystem", "Linux"),
                    ("tenancy", "Shared"),
                    ("preInstalledSw", "NA"),
                    ("capacitystatus", "Used"),
                )
            ]
            pages = pricing.get_paginator("get_products").paginate(
                ServiceCode="AmazonEC2", Filters=filters
            )
            for page in pages:
                for raw in page.get("PriceList", []):
                    usd = _hourly_usd(json.loads(raw) if isinstance(raw, str) else raw)
                    if usd is not None:
                        prices[itype] = usd
                        break
                if itype in prices:
                    break
            if itype not in prices:
                log.warning("no on-demand price for %s in %s", itype, region)
        table["regions"][region] = {
            "as_of": stamp,
            "source": "AWS Price List API, Linux, shared tenancy",
            "prices": dict(sorted(prices.items())),
        }
    table["refresh"] = "python -m jobs.providers.aws refresh-prices --region REGION"
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, target)
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jobs.providers.aws refresh-prices [--region R …] [--type T …]``."""
    parser = argparse.ArgumentParser(prog="python -m jobs.providers.aws")
    sub = parser.add_subparsers(dest="cmd", required=True)
    refresh = sub.add_parser("refresh-prices", help="refresh the shipped on-demand price table")
    refresh.add_argument("--region", action="append", dest="regions")
    refresh.add_argument("--type", action="append", dest="types")
    refresh.add_argument("--output", default=str(PRICES_PATH))
    args = parser.parse_args(argv)
    regions = args.regions or sorted(_load_prices(Path(args.output))["regions"])
    try:
        table = refresh_prices(regions=regions, instance_types=args.types, path=args.output)
    except (BotoCoreError, ClientError) as exc:
        print(f"refresh-prices failed: {exc}", file=sys.stderr)
        return 1
    for region in regions:
        count = len(table["regions"][region]["prices"])
        print(f"{region}: {count} prices as of {table['regions'][region]['as_of']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

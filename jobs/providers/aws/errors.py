"""AWS SDK failures as trainbot's ProviderErrors, each saying what to do.

Access denied names the IAM action (decoded from EC2's encoded message when STS will say);
launches also tell capacity (try the next zone) from quota (ask for an increase).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)
from botocore.parsers import ResponseParserError

from jobs.providers.base import (
    CapacityError,
    LaunchRequest,
    ProviderError,
    ProviderPermissionError,
    QuotaExceeded,
)

__all__ = [
    "IAM_ACTIONS",
    "AwsCredentialsError",
    "Decoder",
    "client_error",
    "decode_denial",
    "error_code",
    "launch_error",
    "translate",
]

log = logging.getLogger(__name__)

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
    "ec2.CreatePlacementGroup": "ec2:CreatePlacementGroup",
    "ec2.DeletePlacementGroup": "ec2:DeletePlacementGroup",
    "ec2.DescribePlacementGroups": "ec2:DescribePlacementGroups",
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

DENIED = frozenset(
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
_ENCODED = re.compile(r"Encoded authorization failure message:\s*(\S+)")

#: Turns EC2's encoded denial message into (action, resource); None when it cannot.
Decoder = Callable[[str], tuple[str, str] | None]


class AwsCredentialsError(ProviderError):
    """No AWS credentials were found, or AWS rejected them; nothing was created."""


def error_code(exc: ClientError) -> str:
    """The AWS error code of a refused call ("" when the answer has none)."""
    return str(exc.response.get("Error", {}).get("Code", ""))


@contextlib.contextmanager
def translate(service: str, doing: str, *, decode: Decoder) -> Iterator[None]:
    """Turn SDK failures into ProviderErrors that say what to do."""
    try:
        yield
    except ClientError as exc:
        raise client_error(exc, service=service, doing=doing, decode=decode) from None
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


def client_error(exc: ClientError, *, service: str, doing: str, decode: Decoder) -> ProviderError:
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    message = _ENCODED.sub("(encoded details omitted)", str(error.get("Message", "")))
    operation = exc.operation_name
    action = IAM_ACTIONS.get(f"{service}.{operation}") or f"{service}:{operation}"
    if code in DENIED:
        decoded = decode(str(error.get("Message", "")))
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


def launch_error(
    exc: ClientError, *, req: LaunchRequest, itype: str, region: str, decode: Decoder
) -> Exception:
    """A refused ``RunInstances``: capacity (next zone), quota, or the general case."""
    error = exc.response.get("Error", {})
    code, message = str(error.get("Code", "")), str(error.get("Message", ""))
    where = req.zone or region
    market = "spot" if req.spot else "on-demand"
    if code in _NO_CAPACITY:
        return CapacityError(
            f"EC2 has no {market} capacity for {itype} in {where} now ({code}): try the next zone",
            zone=req.zone or None,
        )
    if code in _OVER_QUOTA:
        return QuotaExceeded(
            f"the {market} vCPU quota for {itype} in {region} is used up ({code}): "
            f"{message}; request an increase in Service Quotas"
        )
    if code == "IdempotentParameterMismatch":
        return ProviderError(
            f"attempt {req.attempt_id} of run {req.run_id} was launched before with other "
            "parameters under the same idempotency key; start a new attempt"
        )
    if code in DENIED:
        fallback = "ec2:RunInstances (with ec2:CreateTags and iam:PassRole)"
        decoded = decode(message)
        action = decoded[0] if decoded else fallback
        return ProviderPermissionError(
            f"AWS denied launching {itype} for run {req.run_id}: the control plane needs "
            f"{action}{' on ' + decoded[1] if decoded and decoded[1] else ''} ({code}). "
            "Grant it (deploy/aws/iam-policy.json); nothing was created",
            permission=decoded[0] if decoded else "ec2:RunInstances",
        )
    return client_error(exc, service="ec2", doing=f"launch {itype} in {where}", decode=decode)


def decode_denial(message: str, *, sts: Callable[[], Any]) -> tuple[str, str] | None:
    """The action and resource EC2 denied, from its encoded message (best effort)."""
    match = _ENCODED.search(message)
    if match is None:
        return None
    try:
        decoded = sts().decode_authorization_message(EncodedMessage=match.group(1))
        context = json.loads(decoded["DecodedMessage"]).get("context", {})
    except (ClientError, BotoCoreError, ResponseParserError, ValueError, KeyError) as exc:
        log.info("could not decode an AWS authorization failure: %s", exc)
        return None
    action = context.get("action")
    return (str(action), str(context.get("resource") or "")) if action else None

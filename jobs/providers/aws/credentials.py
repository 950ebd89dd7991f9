"""Short-lived S3 credentials for one run's checkpoint prefix, brokered by STS.

The control plane assumes the runner-storage role with a session policy naming only the
run's prefix, and answers in the shape of ``credential_process`` output; never logged.
Why the instance profile gets no checkpoint access: docs/architecture.md, "Providers: AWS".
"""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from jobs.domain.errors import NotFound, PermissionDenied
from jobs.providers.base import ProviderError

if TYPE_CHECKING:
    from jobs.process.settings import Settings

__all__ = [
    "OBJECT_ACTIONS",
    "StorageCredentialBroker",
    "role_session_name",
    "s3_scope",
    "session_policy",
]

log = logging.getLogger(__name__)

#: What a runner does to its own checkpoints (the store's writes are multipart).
OBJECT_ACTIONS = (
    "s3:GetObject",
    "s3:PutObject",
    "s3:DeleteObject",
    "s3:AbortMultipartUpload",
    "s3:ListMultipartUploadParts",
)
#: STS's default and the longest a role allows unless its MaxSessionDuration is raised.
DEFAULT_DURATION_S = 3600
_SESSION_NAME_BAD = re.compile(r"[^\w+=,.@-]")
#: Characters IAM reads as wildcards or policy variables, with no way to escape them.
_UNSCOPABLE = re.compile(r"[*?$]")


def s3_scope(checkpoint_uri: str, run_prefix: str) -> tuple[str, str]:
    """``(bucket, key prefix)`` of one run's checkpoints: ``root/run`` with no slashes at
    either end. Raises NotFound for a store that is not S3 (nothing to broker) and
    PermissionDenied for a prefix IAM cannot scope."""
    parsed = urlparse(checkpoint_uri.strip())
    if parsed.scheme != "s3" or not parsed.netloc:
        raise NotFound(
            f"the credential broker serves S3 checkpoint stores only, and this run's is "
            f"{checkpoint_uri!r}: its runner uses its own credentials"
        )
    parts = [p for p in f"{parsed.path}/{run_prefix}".split("/") if p]
    if not run_prefix.strip("/") or _UNSCOPABLE.search(parsed.netloc + "/".join(parts)):
        raise PermissionDenied(
            f"cannot scope credentials to s3://{parsed.netloc}/{'/'.join(parts)}: a "
            "checkpoint prefix must be non-empty and free of '*', '?' and '$'"
        )
    return parsed.netloc, "/".join(parts)


def session_policy(bucket: str, prefix: str) -> dict[str, Any]:
    """The session policy that narrows the storage role to ``s3://bucket/prefix/``.

    Objects under ``prefix/`` only; listing only with an ``s3:prefix`` inside it (or the
    prefix itself), so run ``r-1`` can neither read nor list ``r-10``.
    """
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "OwnCheckpointObjects",
                "Effect": "Allow",
                "Action": list(OBJECT_ACTIONS),
                "Resource": f"arn:aws:s3:::{bucket}/{prefix}/*",
            },
            {
                "Sid": "ListOwnCheckpointPrefix",
                "Effect": "Allow",
                "Action": "s3:ListBucket",
                "Resource": f"arn:aws:s3:::{bucket}",
                "Condition": {"StringLike": {"s3:prefix": [f"{prefix}/*", prefix]}},
            },
        ],
    }


def role_session_name(run_id: str, attempt_id: str) -> str:
    """``trainbot-<run>-<attempt>``, as STS allows it (2-64 of ``[\\w+=,.@-]``); it shows
    in CloudTrail, so every S3 call of a runner can be traced to its attempt."""
    name = _SESSION_NAME_BAD.sub("_", f"trainbot-{run_id}-{attempt_id}")
    return name[:64]


class StorageCredentialBroker:
    """Assumes the runner-storage role, narrowed to one run's prefix; thread-safe.

    Built like :class:`jobs.providers.aws.AwsProvider`'s clients: the same region,
    endpoint (moto in tests) and boto3 session, so the control plane's own credentials
    (its role) call STS.
    """

    def __init__(
        self,
        role_arn: str,
        *,
        region: str | None = None,
        endpoint_url: str | None = None,
        session: boto3.session.Session | None = None,
        duration_s: int = DEFAULT_DURATION_S,
    ) -> None:
        if not role_arn.startswith("arn:"):
            raise ProviderError(
                f"{role_arn!r} is not a role ARN: set TRAINBOT_AWS_RUNNER_STORAGE_ROLE_ARN to "
                "arn:aws:iam::ACCOUNT_ID:role/trainbot-runner-storage"
            )
        self.role_arn = role_arn
        self.duration_s = duration_s
        session = session or boto3.session.Session()
        self._sts: Any = session.client(
            "sts",
            region_name=region or session.region_name or "us-east-1",
            endpoint_url=endpoint_url or None,
            config=Config(
                retries={"mode": "standard", "max_attempts": 3},
                connect_timeout=5,
                read_timeout=15,
                user_agent_extra="trainbot",
            ),
        )

    def issue(
        self, *, checkpoint_uri: str, run_prefix: str, run_id: str, attempt_id: str
    ) -> dict[str, Any]:
        """Credentials for ``{checkpoint_uri}/{run_prefix}/*``, as ``credential_process``
        output. Raises NotFound (not S3), PermissionDenied (unscopable prefix) or
        ProviderError (STS refused or failed)."""
        bucket, prefix = s3_scope(checkpoint_uri, run_prefix)
        try:
            answer = self._sts.assume_role(
                RoleArn=self.role_arn,
                RoleSessionName=role_session_name(run_id, attempt_id),
                Policy=json.dumps(session_policy(bucket, prefix), separators=(",", ":")),
                DurationSeconds=self.duration_s,
            )
        except ClientError as exc:
            error = exc.response.get("Error", {})
            raise ProviderError(
                f"STS refused to assume {self.role_arn} for run {run_id} "
                f"({error.get('Code')}: {error.get('Message')}): check that the control "
                "plane's role may sts:AssumeRole on it (deploy/aws/iam-policy.json) and that "
                "the role trusts it (deploy/aws/runner-storage-role.json)"
            ) from None
        except BotoCoreError as exc:
            raise ProviderError(
                f"could not reach STS to assume {self.role_arn} for run {run_id}: {exc}"
            ) from None
        credentials = answer["Credentials"]
        log.info(
            "issued checkpoint credentials for s3://%s/%s to attempt %s of run %s, until %s",
            bucket,
            prefix,
            attempt_id,
            run_id,
            credentials["Expiration"].isoformat(),
        )
        return {
            "Version": 1,
            "AccessKeyId": credentials["AccessKeyId"],
            "SecretAccessKey": credentials["SecretAccessKey"],
            "SessionToken": credentials["SessionToken"],
            "Expiration": credentials["Expiration"].isoformat(),
        }


def credential_broker(settings: Settings) -> StorageCredentialBroker | None:
    """The broker ``TRAINBOT_AWS_RUNNER_STORAGE_ROLE_ARN`` enables; None without it."""
    if not settings.aws_runner_storage_role_arn:
        return None
    return StorageCredentialBroker(
        settings.aws_runner_storage_role_arn,
        region=settings.aws_region,
        endpoint_url=settings.aws_endpoint_url,
    )

"""Secrets for the training process, read on the instance with the instance's own identity.

A spec names each secret by reference (``secrets: {WANDB_API_KEY: aws-sm://trainbot/wandb}``);
the control plane hands the runner the references only (``TRAINBOT_SECRETS``), never a
value. The supervisor resolves them before setup and the command, and puts the values into
the command's environment only: not into the runner's own environment, not into setup's,
not into any event, log line or exit report. A secret that cannot be read ends the attempt
as ``secret_unavailable``, naming the variable and the reference, never a value.

References, one scheme per store:

- ``aws-sm://NAME`` — AWS Secrets Manager, ``GetSecretValue`` with the instance profile's
  credentials (boto3's default chain), in the region the control plane names
  (``TRAINBOT_AWS_SECRETS_REGION``); NAME is the secret's name or ARN.
- ``gcp-sm://projects/P/secrets/S[/versions/V]`` — GCP Secret Manager over REST
  (``…:access``), with the service account's token from the metadata server; V defaults
  to ``latest``. No Google SDK: plain HTTPS, as the rest of the runner's metadata code.
- ``local://NAME`` — the file NAME in the admin's directory ``TRAINBOT_LOCAL_SECRETS_DIR``
  (the local provider's instances are this machine).

The reference grammar lives here, so the control plane's spec validation and the runner
agree on it; boto3 is imported only when an ``aws-sm://`` secret is read.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from runner import env as contract
from runner.errors import RunnerError

__all__ = [
    "SCHEMES",
    "SecretRef",
    "SecretUnavailable",
    "parse_ref",
    "resolve",
]

#: Scheme → the provider whose instances can read it.
SCHEMES: Mapping[str, str] = {"aws-sm": "aws", "gcp-sm": "gcp", "local": "local"}

# Secrets Manager names: letters, digits and /_+=.@- (up to 512); an ARN is allowed too.
_AWS_NAME = re.compile(r"^(arn:aws[\w-]*:secretsmanager:[\w-]+:\d{12}:secret:)?[\w/+=.@-]{1,512}$")
_GCP_NAME = re.compile(
    r"^projects/(?P<project>[a-z0-9][a-z0-9.:-]{0,62})/secrets/(?P<secret>[\w-]{1,255})"
    r"(?:/versions/(?P<version>latest|\d+))?$"
)
_LOCAL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
_GCP_API = "https://secretmanager.googleapis.com"
#: Seconds one store request may take before the attempt gives up on it.
_TIMEOUT_S = 20.0


class SecretUnavailable(RunnerError):
    """A secret could not be read on the instance; the message names it, never its value."""

    def __init__(self, name: str, ref: str, why: str) -> None:
        super().__init__(f"secret {name} ({ref}) could not be read: {why}")
        self.name = name
        self.ref = ref


@dataclass(frozen=True)
class SecretRef:
    """One parsed reference."""

    #: "aws-sm", "gcp-sm" or "local".
    scheme: str
    #: The secret's name in its store: an AWS name or ARN, a GCP version's resource name
    #: (``projects/P/secrets/S/versions/V``), or a file name in the local directory.
    path: str

    @property
    def provider(self) -> str:
        """The provider whose instances can read it: "aws", "gcp" or "local"."""
        return SCHEMES[self.scheme]

    def __str__(self) -> str:
        return f"{self.scheme}://{self.path}"


def parse_ref(text: str) -> SecretRef:
    """The reference ``text``; raises ValueError whose message says what a good one is."""
    scheme, sep, path = text.strip().partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(
            f"{text!r} is not a secret reference: write aws-sm://NAME (AWS Secrets Manager), "
            "gcp-sm://projects/P/secrets/S (GCP Secret Manager) or local://NAME (the local "
            "provider's secrets directory)"
        )
    if scheme == "aws-sm" and not _AWS_NAME.fullmatch(path):
        raise ValueError(
            f"{text!r}: an AWS secret's name is 1 to 512 letters, digits and /_+=.@- (or its ARN)"
        )
    if scheme == "gcp-sm":
        found = _GCP_NAME.fullmatch(path)
        if found is None:
            raise ValueError(
                f"{text!r}: write gcp-sm://projects/PROJECT/secrets/SECRET, optionally "
                "followed by /versions/N or /versions/latest"
            )
        path = f"projects/{found['project']}/secrets/{found['secret']}/versions/" + (
            found["version"] or "latest"
        )
    if scheme == "local" and not _LOCAL_NAME.fullmatch(path):
        raise ValueError(
            f"{text!r}: a local secret is a file name in the secrets directory "
            "(letters, digits, '.', '_' and '-'; no '/')"
        )
    return SecretRef(scheme, path)


def resolve(refs: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """Each variable's value, read from its store with this machine's identity. Raises
    :class:`SecretUnavailable` for the first that cannot be read."""
    values: dict[str, str] = {}
    for name, text in refs.items():
        try:
            ref = parse_ref(text)
        except ValueError as exc:
            raise SecretUnavailable(name, text, str(exc)) from None
        reader = {"aws-sm": _read_aws, "gcp-sm": _read_gcp, "local": _read_local}[ref.scheme]
        try:
            value = reader(ref, environ)
        except SecretUnavailable:
            raise
        except Exception as exc:  # what the store said, never what it held
            raise SecretUnavailable(name, text, _why(exc)) from None
        if "\x00" in value:
            raise SecretUnavailable(
                name, text, "its value holds a NUL byte, which no environment can"
            )
        values[name] = value
    return values


def _why(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text[:300]


def _read_local(ref: SecretRef, environ: Mapping[str, str]) -> str:
    folder = contract.LOCAL_SECRETS_DIR.get(environ)
    if folder is None:
        raise RunnerError(f"{contract.LOCAL_SECRETS_DIR.name} is not set on this machine")
    path = Path(folder) / ref.path
    try:
        return path.read_text(encoding="utf-8").rstrip("\r\n")
    except FileNotFoundError:
        raise RunnerError(f"no file {ref.path} in {folder}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunnerError(f"{path}: {exc}") from None


def _read_aws(ref: SecretRef, environ: Mapping[str, str]) -> str:
    import boto3  # only where an AWS secret is read
    from botocore.exceptions import BotoCoreError, ClientError

    region = contract.AWS_SECRETS_REGION.get(environ)
    try:
        client = boto3.session.Session().client("secretsmanager", region_name=region)
        answer = client.get_secret_value(SecretId=ref.path)
    except ClientError as exc:
        error = exc.response.get("Error", {})
        raise RunnerError(f"{error.get('Code', 'error')}: {error.get('Message', '')}") from None
    except BotoCoreError as exc:
        raise RunnerError(str(exc)) from None
    if "SecretString" in answer:
        return str(answer["SecretString"])
    return bytes(answer["SecretBinary"]).decode("utf-8")


def _metadata_token(base_url: str) -> str:
    """The instance's service-account token, from the metadata server (plain http.client:
    no proxy variable may route a metadata request elsewhere)."""
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=_TIMEOUT_S)
    try:
        conn.request(
            "GET",
            "/computeMetadata/v1/instance/service-accounts/default/token",
            headers={"Metadata-Flavor": "Google"},
        )
        reply = conn.getresponse()
        body = reply.read()
    finally:
        conn.close()
    if reply.status != 200:
        raise RunnerError(f"the metadata server gave no token (HTTP {reply.status})")
    return str(json.loads(body)["access_token"])


def _read_gcp(ref: SecretRef, environ: Mapping[str, str]) -> str:
    token = _metadata_token(contract.GCP_METADATA_URL.get(environ))
    api = (contract.GCP_SECRETS_URL.get(environ) or _GCP_API).rstrip("/")
    request = urllib.request.Request(
        f"{api}/v1/{ref.path}:access", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as reply:
            answer: dict[str, Any] = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except Exception:
            message = exc.reason
        raise RunnerError(f"HTTP {exc.code}: {message}") from None
    except urllib.error.URLError as exc:
        raise RunnerError(f"Secret Manager not reachable: {exc.reason}") from None
    return base64.b64decode(answer["payload"]["data"]).decode("utf-8")

"""Starting an attempt's instance: ``RunInstances``, idempotent, and its boot script.

The attempt's key is both EC2's ``ClientToken`` and a tag looked up first, so a retried
or restarted launch adopts the instance it already started. The user data carries the
runner's token; docs/architecture.md ("Providers: AWS") says how it is kept.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import logging
import math
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from jobs.providers.aws.catalog import accelerator_type
from jobs.providers.aws.clients import Clients
from jobs.providers.aws.errors import error_code, launch_error
from jobs.providers.aws.status import TERMINATION_WINDOW_S, info
from jobs.providers.base import (
    TAG_IDEMPOTENCY_KEY,
    TAG_MANAGED,
    CapacityError,
    InstanceInfo,
    LaunchRequest,
    ProviderError,
    ResourceRequest,
)
from jobs.providers.runner_install import deploy_file, installer_source
from runner import env as contract

__all__ = [
    "DEFAULT_IMAGE",
    "USER_DATA_TEMPLATE",
    "LaunchConfig",
    "check_launch_permissions",
    "launch",
    "render_user_data",
]

log = logging.getLogger(__name__)

#: The user-data template: the checkout's deploy/aws/user-data.sh, or the copy an
#: installed control plane ships (the image's; :func:`runner_install.deploy_file`); a
#: provider's ``user_data_template`` names another.
USER_DATA_TEMPLATE = deploy_file("aws", "user-data.sh")
#: AWS's public SSM parameter for the latest Deep Learning Base AMI (NVIDIA driver, CUDA).
DEFAULT_IMAGE = (
    "resolve:ssm:/aws/service/deeplearning/ami/x86_64/"
    "base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"
)
#: Largest user data EC2 accepts, before base64.
_USER_DATA_MAX = 16 * 1024
_GIB = 1 << 30
_SCRATCH_DIR = "/var/lib/trainbot/scratch"
_TOKEN_SAFE = re.compile(r"^[A-Za-z0-9 +\-=._:/@]{1,64}$")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # fullmatch: "$" would let "X\n" through
_PLACEHOLDER = re.compile(r"@@([A-Z_]+)@@")


@dataclass(frozen=True)
class LaunchConfig:
    """What every launch of one provider shares (the provider's settings)."""

    #: An AMI id or ``resolve:ssm:<parameter>``.
    image_id: str
    #: Name or ARN of the runner's instance profile; None launches without one.
    instance_profile: str | None
    #: Zone → subnet; empty places the instance by zone in the default VPC.
    subnet_ids: Mapping[str, str]
    #: Security groups of the instance; empty leaves EC2's default.
    security_group_ids: tuple[str, ...]
    #: The user-data template (deploy/aws/user-data.sh).
    template_path: Path


def _client_token(key: str) -> str:
    """The idempotency key as an EC2 ClientToken (64 ASCII characters at most).

    Keys outside EC2's tag alphabet or longer than 64 are hashed, so the same key always
    gives the same token.
    """
    if _TOKEN_SAFE.match(key):
        return key
    return "sha256-" + hashlib.sha256(key.encode()).hexdigest()[:57]


def check_launch_permissions(
    clients: Clients, req: ResourceRequest, config: LaunchConfig, *, zone: str | None
) -> None:
    """Ask EC2 whether a launch would be allowed (``DryRun``), creating nothing."""
    with clients.call("sts", "check the control plane's AWS credentials"):
        clients.client("sts").get_caller_identity()
    if zone is None and config.subnet_ids:
        zone = sorted(config.subnet_ids)[0]
    probe = LaunchRequest(
        run_id="preflight",
        attempt_id="permission-check",
        owner="trainbot",
        request=req,
        zone=zone or "",
        command=["true"],
        spot=req.spot,
    )
    itype = accelerator_type(req)[0]
    params = _launch_params(clients, probe, config, itype, token="", user_data="")
    del params["ClientToken"], params["UserData"]
    ec2 = clients.client("ec2", region=req.region or clients.region)
    with clients.call("ec2", "launch instances (dry run)"):
        try:
            ec2.run_instances(DryRun=True, **params)
        except ClientError as exc:
            if error_code(exc) != "DryRunOperation":
                raise


def launch(
    clients: Clients,
    req: LaunchRequest,
    config: LaunchConfig,
    *,
    runner: Mapping[str, Any],
    clock: Callable[[], datetime],
) -> InstanceInfo:
    """Start the attempt's instance, or return the one this key already started;
    ``runner``: how its boot script installs the runner (:func:`runner_install.boot_config`)."""
    region = clients.region
    asked = req.request.region or region
    if asked != region:
        raise ProviderError(
            f"run {req.run_id} asks for {asked}, but this control plane launches in "
            f"{region} (TRAINBOT_AWS_REGION): set resources.region={region} or "
            "run a control plane for that region"
        )
    if not req.command:
        raise ProviderError(
            f"run {req.run_id} attempt {req.attempt_id}: the launch command is empty;"
            " the spec needs a command to run"
        )
    itype, holds = accelerator_type(req.request)
    if holds is not None and req.request.accelerator_count > holds:
        raise ProviderError(
            f"run {req.run_id}: {req.request.accelerator_count} {req.request.accelerator_type}"
            f" do not fit one instance ({itype} holds {holds}); ask for at most {holds} per "
            "instance and more instances"
        )
    token = _client_token(req.key)
    user_data = render_user_data(req, runner=runner, template_path=config.template_path)
    existing = _find_by_token(clients, token, clock=clock)
    if existing is not None:
        log.info("launch of %s/%s adopts %s", req.run_id, req.attempt_id, existing.instance_id)
        return existing
    params = _launch_params(clients, req, config, itype, token=token, user_data=user_data)
    ec2 = clients.client("ec2")
    with clients.call("ec2", f"launch {itype} in {req.zone or region}"):
        try:
            answer = ec2.run_instances(**params)
        except ClientError as exc:
            raise launch_error(
                exc, req=req, itype=itype, region=region, decode=clients.decode_denial
            ) from None
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
    return info(inst, clock=clock)


def _launch_params(
    clients: Clients,
    req: LaunchRequest,
    config: LaunchConfig,
    itype: str,
    *,
    token: str,
    user_data: str,
) -> dict[str, Any]:
    tags = [
        {"Key": k, "Value": v[:256]}
        for k, v in {
            **req.tags(token),
            "Name": f"trainbot {req.run_id} {'dry run ' if req.dry_run else ''}{req.attempt_id}",
        }.items()
    ]
    image, root = image_of(clients, req.request.image_id or config.image_id, clients.region)
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
    if config.instance_profile:
        key = "Arn" if config.instance_profile.startswith("arn:") else "Name"
        params["IamInstanceProfile"] = {key: config.instance_profile}
    if config.subnet_ids:
        subnet = config.subnet_ids.get(req.zone)
        if subnet is None:
            raise CapacityError(
                f"no subnet is configured for {req.zone or 'an unnamed zone'} "
                f"(subnet_ids has {', '.join(sorted(config.subnet_ids))}): use one of those "
                "zones or add a subnet for it",
                zone=req.zone or None,
            )
        params["SubnetId"] = subnet
    elif req.zone:
        params["Placement"] = {"AvailabilityZone": req.zone}
    if req.nodes > 1:
        # The attempt's cluster placement group (the provider creates it before node 0):
        # every node in one zone, on the network the collectives need.
        params.setdefault("Placement", {})["GroupName"] = req.placement_group
    if config.security_group_ids:
        params["SecurityGroupIds"] = list(config.security_group_ids)
    return params


def image_of(clients: Clients, image: str, region: str) -> tuple[str, tuple[str, int] | None]:
    """The AMI id to launch and its (root device, size in GiB), when AWS says; a
    ProviderError saying what to set when the parameter or the AMI is not in ``region``.
    Preflight asks it through ``capacity`` and the launch probe."""
    if image.startswith("resolve:ssm:"):
        parameter = image.removeprefix("resolve:ssm:")
        with clients.call("ssm", f"resolve the image parameter {parameter}"):
            try:
                image = clients.client("ssm", region=region).get_parameter(Name=parameter)[
                    "Parameter"
                ]["Value"]
            except ClientError as exc:
                if error_code(exc) in ("ParameterNotFound", "ValidationException"):
                    raise ProviderError(
                        f"the image parameter {parameter} does not exist in {region}: set "
                        "resources.image_id in the spec, or TRAINBOT_AWS_IMAGE_ID, to an AMI "
                        f"of {region} with NVIDIA drivers (or resolve:ssm:<parameter>)"
                    ) from None
                raise
    if (region, image) in clients.roots:  # an AMI never changes
        return image, clients.roots[(region, image)]
    with clients.call("ec2", f"describe the image {image}"):
        try:
            images = clients.client("ec2", region=region).describe_images(ImageIds=[image])[
                "Images"
            ]
        except ClientError as exc:
            if error_code(exc) not in ("InvalidAMIID.NotFound", "InvalidAMIID.Malformed"):
                raise
            images = []
    if not images:
        raise ProviderError(
            f"the AMI {image} does not exist in {region}: set resources.image_id in the spec, "
            f"or TRAINBOT_AWS_IMAGE_ID, to an AMI of {region} (AMIs are regional)"
        )
    found = images[0]
    device = found.get("RootDeviceName")
    root = None
    for mapping in found.get("BlockDeviceMappings") or ():
        if mapping.get("DeviceName") == device and "Ebs" in mapping:
            root = (str(device), int(mapping["Ebs"].get("VolumeSize") or 8))
    clients.roots[(region, image)] = root
    return image, root


def render_user_data(req: LaunchRequest, *, runner: Mapping[str, Any], template_path: Path) -> str:
    """The instance's boot script: install the runner, run the command, shut down.

    ``runner`` is the installer's configuration (:func:`runner_install.boot_config`),
    carried as JSON with the installer itself (deploy/runner-install.py, without its
    docstrings, compressed).

    It runs as root, so every value in it is data: each is shell-quoted once and the
    template is substituted in one pass, so no value is ever read again as template
    (a command word holding "@@ENV@@" stays that text) or as shell. The environment
    is quoted into a root-only file on the instance; names must be identifiers and
    values may not hold newlines, so nothing can end the here-document early.
    """
    try:
        template = template_path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProviderError(
            f"cannot read the AWS user-data template {template_path} ({exc}): "
            "pass user_data_template (TRAINBOT_AWS_USER_DATA) pointing at "
            "deploy/aws/user-data.sh"
        ) from None
    env = {
        **contract.render(
            {
                contract.RUN_ID: req.run_id,
                contract.ATTEMPT_ID: req.attempt_id,
                contract.PREEMPTION_SOURCES: "aws",
            }
        ),
        **req.env,
        **contract.render(
            {
                contract.SCRATCH_DIR: _SCRATCH_DIR,
                contract.SCRATCH_BYTES: max(req.scratch_bytes, 0),
                contract.TERMINATION_WINDOW_S: TERMINATION_WINDOW_S,
            }
        ),
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
    for word in req.command:
        if "\0" in word:
            raise ProviderError(
                f"run {req.run_id}: the command holds a NUL character, which no program "
                "can be given; remove it"
            )
    source = installer_source(compact=True).encode()
    installer = base64.encodebytes(gzip.compress(source, mtime=0))
    values = {
        "RUNNER_MODE": shlex.quote(str(runner["mode"])),
        # One line of JSON, whose escapes keep any line break or NUL out of it.
        "RUNNER_CONFIG": json.dumps(dict(runner), sort_keys=True),
        "RUNNER_INSTALLER": installer.decode().strip(),
        "SCRATCH_DIR": shlex.quote(_SCRATCH_DIR),
        "COMMAND": shlex.join(req.command),
        "ENV": "\n".join(lines),
    }
    for name in values:
        if f"@@{name}@@" not in template:
            raise ProviderError(
                f"the user-data template {template_path} lacks @@{name}@@: restore "
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


def _find_by_token(
    clients: Clients, token: str, *, clock: Callable[[], datetime]
) -> InstanceInfo | None:
    ec2 = clients.client("ec2")
    found: list[dict[str, Any]] = []
    with clients.call("ec2", "look for an instance launched with this key"):
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
    return info(found[0], clock=clock)

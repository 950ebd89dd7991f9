"""Launching one attempt: the ``instances.insert`` body, its metadata and the insert.

The runner's command and environment travel as JSON in instance metadata, read by the
static startup script from the metadata server; nothing is templated into a shell
script. Names and request ids derive from the attempt, so a retried insert adopts the
instance the first one made.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.cloud import compute_v1

from jobs.providers.base import (
    TAG_ATTEMPT_ID,
    TAG_RUN_ID,
    CapacityError,
    LaunchRequest,
    ProviderError,
    QuotaExceeded,
)
from jobs.providers.gcp.api import CLOUD_PLATFORM, ComputeApi
from jobs.providers.gcp.catalog import Catalog, accelerator
from jobs.providers.gcp.errors import QUOTAS_CONSOLE
from jobs.providers.gcp.images import DEFAULT_IMAGE
from jobs.providers.gcp.names import instance_name, label_value
from jobs.providers.runner_install import deploy_file, installer_source

__all__ = [
    "DEFAULT_IMAGE",
    "STARTUP_SCRIPT_PATH",
    "InstanceTemplate",
    "insert",
    "instance_body",
]

log = logging.getLogger(__name__)

#: The startup script every instance runs (read at launch, sent as metadata): the
#: checkout's, or the copy an installed control plane ships (the image's).
STARTUP_SCRIPT_PATH = deploy_file("gcp", "startup-script.sh")
#: Request ids derive from this namespace, so a retried call repeats its id.
NAMESPACE = uuid.UUID("6f1d1f3e-1c55-4f8e-9a0b-7a2b5e0c9d41")
_STOCKOUT_CODES = ("ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS")

# Metadata keys the startup script reads. Exact ids live here too: labels are lowercased.
MD_ENV = "trainbot-env"
MD_COMMAND = "trainbot-command"
MD_RUNNER = "trainbot-runner"
MD_INSTALLER = "trainbot-runner-installer"
MD_SCRATCH = "trainbot-scratch-bytes"
MD_IDS = {TAG_RUN_ID: "trainbot-run-id", TAG_ATTEMPT_ID: "trainbot-attempt-id"}
#: Guest attributes namespace of the runner's exit code (``trainbot/exit-code``).
EXIT_NAMESPACE = "trainbot"


@dataclass(frozen=True)
class InstanceTemplate:
    """What every instance of a provider shares: the provider's launch options."""

    # Boot image (a family or an image URL); a spec's resources.image_id wins over it.
    image: str
    # The runner's service account; None leaves the instance without one.
    service_account: str | None
    # VPC network, used when no subnetwork is set.
    network: str
    # Subnetwork URL, over the network.
    subnetwork: str | None
    # Give the instance an ephemeral external IP (ONE_TO_ONE_NAT).
    external_ip: bool
    # Boot disk size before the attempt's scratch bytes are added.
    boot_disk_gb: int
    # The startup script, read at every launch.
    startup_script: Path


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # fullmatch: "$" would let "X\n" through


def _check_runner_inputs(req: LaunchRequest) -> None:
    """Refuse what the startup script's exec cannot carry as plain data.

    The command and environment travel as JSON metadata and are exec'd without a shell,
    so quoting is not the risk; a name that is not an identifier, or a NUL, is refused
    here with the run named rather than failing on the instance after it has booted.
    """
    for key, value in req.env.items():
        if not _ENV_NAME.fullmatch(key):
            raise ProviderError(
                f"run {req.run_id}: {key!r} is not a valid variable name: environment "
                "names are letters, digits and underscores, not starting with a digit; "
                "rename it in the spec's env"
            )
        if "\0" in value:
            raise ProviderError(
                f"run {req.run_id}: the value of {key} holds a NUL character, which no "
                "environment can carry; remove it"
            )
    if any("\0" in word for word in req.command):
        raise ProviderError(
            f"run {req.run_id}: the command holds a NUL character, which no program can be "
            "given; remove it from the spec's command"
        )


def instance_body(
    req: LaunchRequest,
    *,
    catalog: Catalog,
    template: InstanceTemplate,
    runner: Mapping[str, Any],
    resource_policies: Sequence[str] = (),
) -> Any:
    """The ``instances.insert`` body of the attempt's instance (node ``req.node_rank``
    of its gang) in ``req.zone``; ``runner``: how its startup script installs the runner
    (:func:`runner_install.boot_config`); ``resource_policies``: the gang's compact
    placement policy."""
    _check_runner_inputs(req)
    zone = req.zone
    res = req.request
    accel = accelerator(res)
    machine = catalog.machine_type(res)
    name = instance_name(req.run_id, req.attempt_id, node=req.node_rank)
    try:
        script = template.startup_script.read_text(encoding="utf-8")
    except OSError as e:
        raise ProviderError(
            f"the GCP startup script {template.startup_script} is unreadable ({e}): reinstall"
            " trainbot from its repository, or pass startup_script= to the gcp provider"
        ) from None
    labels = {k: label_value(v) for k, v in req.tags(req.key).items()}
    metadata = {
        "startup-script": script,
        "enable-guest-attributes": "TRUE",
        MD_ENV: json.dumps(dict(req.env), sort_keys=True),
        MD_COMMAND: json.dumps(list(req.command)),
        MD_RUNNER: json.dumps(dict(runner), sort_keys=True),
        MD_INSTALLER: installer_source(),
        MD_SCRATCH: str(req.scratch_bytes),
        MD_IDS[TAG_RUN_ID]: req.run_id,
        MD_IDS[TAG_ATTEMPT_ID]: req.attempt_id,
    }
    if accel is not None:
        metadata["install-nvidia-driver"] = "True"  # honoured by Deep Learning VM images
    scheduling = compute_v1.Scheduling(
        provisioning_model="SPOT" if req.spot else "STANDARD",
        on_host_maintenance="TERMINATE",
        automatic_restart=False,
    )
    if req.spot:
        scheduling.instance_termination_action = "DELETE"
    disk_gb = template.boot_disk_gb + -(-max(req.scratch_bytes, 0) // 1_000_000_000)
    nic = compute_v1.NetworkInterface()
    if template.subnetwork:
        nic.subnetwork = template.subnetwork
    else:
        nic.network = template.network
    if template.external_ip:
        nic.access_configs = [compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")]
    body = compute_v1.Instance(
        name=name,
        machine_type=f"zones/{zone}/machineTypes/{machine}",
        labels=labels,
        metadata=compute_v1.Metadata(
            items=[compute_v1.Items(key=k, value=v) for k, v in metadata.items()]
        ),
        scheduling=scheduling,
        disks=[
            compute_v1.AttachedDisk(
                boot=True,
                auto_delete=True,
                type_="PERSISTENT",
                initialize_params=compute_v1.AttachedDiskInitializeParams(
                    source_image=res.image_id or template.image,
                    disk_size_gb=disk_gb,
                    disk_type=f"zones/{zone}/diskTypes/pd-balanced",
                ),
            )
        ],
        network_interfaces=[nic],
    )
    if resource_policies:
        body.resource_policies = list(resource_policies)
    if accel is not None:
        body.guest_accelerators = [
            compute_v1.AcceleratorConfig(
                accelerator_type=f"zones/{zone}/acceleratorTypes/{accel.name}",
                accelerator_count=res.accelerator_count,
            )
        ]
    if template.service_account:
        body.service_accounts = [
            compute_v1.ServiceAccount(email=template.service_account, scopes=[CLOUD_PLATFORM])
        ]
    return body


def insert(api: ComputeApi, req: LaunchRequest, *, body: Any, kind: str, timeout_s: float) -> bool:
    """Insert ``body`` in ``req.zone`` and wait up to ``timeout_s`` for the insert to finish.

    True when it made the instance; False when the name was already taken (the caller
    adopts it). A stockout of ``kind`` raises CapacityError naming the zone; a quota
    refusal raises QuotaExceeded.
    """
    name = body.name
    zone = req.zone
    request_id = str(uuid.uuid5(NAMESPACE, f"insert {api.project}/{zone}/{req.key}"))
    what = f"start instance {name} in {zone} for run {req.run_id}"
    request = compute_v1.InsertInstanceRequest(
        project=api.project, zone=zone, instance_resource=body, request_id=request_id
    )
    op = api.insert(what, "instances.insert", request, client="instances")
    if op is None:
        log.info("instance %s/%s already exists: adopting it", zone, name)
        return False
    op = api.wait(zone, op, what=what, timeout_s=timeout_s)
    errors = list(op.error.errors) if op.error and op.error.errors else []
    if errors:
        codes = [e.code for e in errors]
        text = "; ".join(f"{e.code}: {e.message}" for e in errors)
        if any(c in _STOCKOUT_CODES for c in codes):
            raise CapacityError(
                f"zone {zone} has no spot capacity for {kind} now ({text});"
                " the next attempt tries another zone",
                zone=zone,
            )
        if "QUOTA_EXCEEDED" in codes:
            raise QuotaExceeded(
                f"Compute Engine refused {name} in {zone}: {text}. Request more quota:"
                f" {QUOTAS_CONSOLE.format(project=api.project)}"
            )
        if any(c in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS") for c in codes):
            return False
        raise ProviderError(f"Compute Engine could not {what}: {text}")
    log.info("launched %s/%s for run %s attempt %s", zone, name, req.run_id, req.attempt_id)
    return True

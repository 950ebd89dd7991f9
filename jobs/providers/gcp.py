"""Spot GPUs on Google Compute Engine, through the real ``google-cloud-compute`` client.

Quota, capacity and launch are separate calls because they are separate questions:
``regions.get`` says how many GPUs of a type the project may hold in a region
(``PREEMPTIBLE_NVIDIA_A100_GPUS`` for spot, ``NVIDIA_A100_GPUS`` on demand, and
``GPUS_ALL_REGIONS`` across the project); ``acceleratorTypes.aggregatedList`` says which
zones offer the type at all; only ``instances.insert`` finds out whether a zone has one
free now (``ZONE_RESOURCE_POOL_EXHAUSTED`` when not).

Choices, and why:

- **One instance per attempt, named after it.** The name is derived from the run and
  attempt ids, and Compute Engine names are unique per zone, so a retried insert (after
  a crash between the API call and the database write) gets ``409 alreadyExists`` and
  adopts the instance instead of starting a second one. ``requestId`` is a UUID derived
  from the idempotency key and the zone, so a retry within Compute Engine's
  deduplication window gets the very same operation back.
- **Instance ids are ``ZONE/NAME``** (``us-central1-a/trainbot-…``): every instance
  call is per zone, so the id carries what the API needs.
- **``instanceTerminationAction=DELETE``.** A preempted spot VM is deleted, boot disk
  included, so nothing bills after a preemption; the checkpoints live in the object
  store, not on the disk. The preemption stays visible afterwards as the zone's
  ``compute.instances.preempted`` operation, which is what :meth:`status` reads.
- **``onHostMaintenance=TERMINATE`` and ``automaticRestart=false``** (GPUs cannot live
  migrate, spot VMs cannot restart): one attempt is one boot; the resubmit policy, not
  Compute Engine, decides what runs next.
- **The runner's environment travels in instance metadata** (``trainbot-env``), read by
  the static startup script from the metadata server; nothing is templated into a shell
  script. The runner token in it is readable from inside the instance and by principals
  with ``compute.instances.get`` in the project; it is per attempt, stored hashed by the
  control plane and revoked when the attempt ends. It is never logged: nothing here
  formats metadata values into a message.
- **Exit codes come back as guest attributes** (``trainbot/exit-code``), written by the
  startup script before it halts the guest, so :meth:`status` tells success (0) from
  failure from preemption (75) after the runner has gone.

Tests point ``api_endpoint`` at a local fake Compute API. The REST transport keeps an
explicit scheme in the endpoint (``_Base…RestTransport.__init__`` only prefixes
``url_scheme``, default ``https``, to a bare host), so ``api_endpoint="http://127.0.0.1:PORT"``
with :class:`google.auth.credentials.AnonymousCredentials` needs no transport argument.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import logging
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlparse

from google.api_core import exceptions as api_exceptions
from google.api_core.client_options import ClientOptions
from google.auth import exceptions as auth_exceptions
from google.cloud import compute_v1

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

__all__ = [
    "DEFAULT_IMAGE",
    "PERMISSIONS",
    "PRICES_PATH",
    "REQUIRED_PERMISSIONS",
    "STARTUP_SCRIPT_PATH",
    "GcpProvider",
    "instance_name",
    "label_value",
    "make",
    "prices_from_catalog",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_IMAGE = "projects/debian-cloud/global/images/family/debian-12"
_ROOT = Path(__file__).resolve().parents[2]
#: The startup script every instance runs (read at launch, sent as metadata).
STARTUP_SCRIPT_PATH = _ROOT / "deploy" / "gcp" / "startup-script.sh"
#: The shipped price table (dated; see its ``refresh`` field).
PRICES_PATH = Path(__file__).resolve().parent / "data" / "gcp_prices.json"
_CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
_NAMESPACE = uuid.UUID("6f1d1f3e-1c55-4f8e-9a0b-7a2b5e0c9d41")
_QUOTAS_CONSOLE = "https://console.cloud.google.com/iam-admin/quotas?project={project}"
_STOCKOUT_CODES = ("ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS")
_ROLE_HINT = (
    "grant the trainbotControlPlane role from deploy/gcp/roles.yaml to the control plane's "
    "service account (deploy/gcp/README.md)"
)

# Metadata keys the startup script reads. Exact ids live here too: labels are lowercased.
MD_ENV = "trainbot-env"
MD_COMMAND = "trainbot-command"
MD_INSTALL = "trainbot-install"
MD_SCRATCH = "trainbot-scratch-bytes"
_MD_IDS = {TAG_RUN_ID: "trainbot-run-id", TAG_ATTEMPT_ID: "trainbot-attempt-id"}
_EXIT_NAMESPACE = "trainbot"

#: What each API call needs: the control plane's role must hold exactly their union.
PERMISSIONS: Mapping[str, tuple[str, ...]] = {
    "projects.get": ("compute.projects.get",),
    "regions.get": ("compute.regions.get",),
    "acceleratorTypes.aggregatedList": ("compute.acceleratorTypes.list",),
    "instances.insert": (
        "compute.instances.create",
        "compute.disks.create",
        "compute.instances.setMetadata",
        "compute.instances.setLabels",
        "compute.subnetworks.use",
        "compute.subnetworks.useExternalIp",
        "compute.instances.setServiceAccount",
        "iam.serviceAccounts.actAs",
    ),
    "instances.get": ("compute.instances.get",),
    "instances.getGuestAttributes": ("compute.instances.getGuestAttributes",),
    "instances.delete": ("compute.instances.delete",),
    "instances.aggregatedList": ("compute.instances.list",),
    "zoneOperations.wait": ("compute.zoneOperations.get",),
    "zoneOperations.list": ("compute.zoneOperations.list",),
    "storage.buckets.get": ("storage.buckets.get",),
}
REQUIRED_PERMISSIONS = frozenset(p for perms in PERMISSIONS.values() for p in perms)


# -- accelerators and names --------------------------------------------------------------


@dataclass(frozen=True)
class _Accelerator:
    """One GPU type in Compute Engine's vocabulary."""

    # Compute Engine accelerator type ("nvidia-tesla-a100").
    name: str
    # Regional quota metric for on-demand use; spot uses PREEMPTIBLE_ + this.
    metric: str
    # GPUs per instance → the machine type that carries them.
    machines: Mapping[int, str]
    # Other spellings a spec may use ("A100").
    aliases: tuple[str, ...]


_N1 = {1: "n1-standard-8", 2: "n1-standard-16", 4: "n1-standard-32", 8: "n1-standard-64"}
_ACCELERATORS = (
    _Accelerator(
        "nvidia-tesla-a100",
        "NVIDIA_A100_GPUS",
        {1: "a2-highgpu-1g", 2: "a2-highgpu-2g", 4: "a2-highgpu-4g", 8: "a2-highgpu-8g"}
        | {16: "a2-megagpu-16g"},
        ("a100", "a100-40gb"),
    ),
    _Accelerator(
        "nvidia-a100-80gb",
        "NVIDIA_A100_80GB_GPUS",
        {1: "a2-ultragpu-1g", 2: "a2-ultragpu-2g", 4: "a2-ultragpu-4g", 8: "a2-ultragpu-8g"},
        ("a100-80gb", "a100_80gb"),
    ),
    _Accelerator(
        "nvidia-h100-80gb",
        "NVIDIA_H100_GPUS",
        {1: "a3-highgpu-1g", 2: "a3-highgpu-2g", 4: "a3-highgpu-4g", 8: "a3-highgpu-8g"},
        ("h100", "h100-80gb"),
    ),
    _Accelerator(
        "nvidia-l4",
        "NVIDIA_L4_GPUS",
        {1: "g2-standard-4", 2: "g2-standard-24", 4: "g2-standard-48", 8: "g2-standard-96"},
        ("l4",),
    ),
    _Accelerator("nvidia-tesla-t4", "NVIDIA_T4_GPUS", _N1, ("t4",)),
    _Accelerator("nvidia-tesla-v100", "NVIDIA_V100_GPUS", _N1, ("v100",)),
    _Accelerator("nvidia-tesla-p100", "NVIDIA_P100_GPUS", _N1, ("p100",)),
    _Accelerator("nvidia-tesla-p4", "NVIDIA_P4_GPUS", _N1, ("p4",)),
)
_BY_NAME = {k: a for a in _ACCELERATORS for k in (a.name, *a.aliases)}


def _accelerator(req: ResourceRequest) -> _Accelerator | None:
    if req.accelerator_count <= 0 or req.accelerator_type is None:
        return None
    found = _BY_NAME.get(req.accelerator_type.strip().lower())
    if found is None:
        known = ", ".join(a.aliases[0].upper() for a in _ACCELERATORS)
        raise ProviderError(
            f"unknown GCP accelerator type {req.accelerator_type!r}: use one of {known}, or a"
            " Compute Engine name such as nvidia-tesla-a100"
        )
    return found


def label_value(text: str) -> str:
    """A GCP label value: lowercase letters, digits, ``_`` and ``-``, at most 63 characters."""
    return re.sub(r"[^a-z0-9_-]", "-", text.lower())[:63]


def instance_name(run_id: str, attempt_id: str) -> str:
    """The instance's name, a pure function of the run and attempt: one attempt, one name.

    The hash keeps names distinct when sanitising or truncating would make two ids equal.
    """
    digest = hashlib.sha256(f"{run_id}/{attempt_id}".encode()).hexdigest()[:10]
    slug = re.sub(r"[^a-z0-9]+", "-", attempt_id.lower()).strip("-")[:40].strip("-")
    return f"trainbot-{slug}-{digest}" if slug else f"trainbot-{digest}"


def _split_id(instance_id: str) -> tuple[str, str]:
    zone, sep, name = instance_id.partition("/")
    if not sep or not re.fullmatch(r"[a-z]+-[a-z]+\d+-[a-z]", zone) or not name:
        raise InstanceNotFound(
            f"{instance_id!r} is not a GCP instance id of trainbot's (ZONE/NAME, such as"
            " us-central1-a/trainbot-attempt-1-…); it was not launched by this provider",
            instance_id=instance_id,
        )
    return zone, name


def _region_of_zone(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def _utc(stamp: str) -> datetime:
    if not stamp:
        return datetime.now(timezone.utc)
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).astimezone(timezone.utc)


def _last(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


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


# -- errors ------------------------------------------------------------------------------


_PERMISSION = re.compile(r"\b((?:compute|iam|storage)\.[A-Za-z]+\.[A-Za-z]+)\b")


def _reasons(exc: api_exceptions.GoogleAPICallError) -> set[str]:
    return {str(e.get("reason", "")) for e in exc.errors or [] if isinstance(e, Mapping)}


def _translate(exc: Exception, *, what: str, call: str) -> ProviderError:
    """A Google error as the ProviderError the service layer understands."""
    if isinstance(exc, (auth_exceptions.DefaultCredentialsError, auth_exceptions.RefreshError)):
        return ProviderError(
            f"no usable Google Cloud credentials to {what} ({exc}): run the control plane with"
            " the trainbot service account attached, set GOOGLE_APPLICATION_CREDENTIALS to its"
            " key file, or run `gcloud auth application-default login`"
        )
    if not isinstance(exc, api_exceptions.GoogleAPICallError):
        return ProviderError(f"could not reach Google Cloud to {what} ({exc}); try again")
    message = exc.message.split(": ", 1)[-1] if exc.message else str(exc)
    reasons = _reasons(exc)
    if isinstance(exc, api_exceptions.Forbidden):
        if reasons & {"rateLimitExceeded", "userRateLimitExceeded", "quotaExceeded"}:
            return ProviderError(f"Google Cloud is rate-limiting requests to {what}; try again")
        if "accessNotConfigured" in reasons or "SERVICE_DISABLED" in message:
            return ProviderError(
                f"the Compute Engine API is not enabled, so trainbot cannot {what}: run"
                " `gcloud services enable compute.googleapis.com` in the project"
            )
        found = _PERMISSION.search(message)
        permission = found.group(1) if found else PERMISSIONS[call][0]
        return ProviderPermissionError(
            f"Google Cloud refused to {what}: the control plane's credentials lack"
            f" {permission} ({message}); {_ROLE_HINT}",
            permission=permission,
        )
    if isinstance(exc, api_exceptions.Unauthorized):
        return ProviderError(
            f"Google Cloud rejected the credentials while trying to {what} ({message}): renew"
            " them, or check GOOGLE_APPLICATION_CREDENTIALS"
        )
    if isinstance(exc, (api_exceptions.TooManyRequests, api_exceptions.ServerError)):
        return ProviderError(f"Google Cloud could not {what} just now ({message}); try again")
    return ProviderError(f"Google Cloud could not {what}: {message}")


# -- prices ------------------------------------------------------------------------------


def _load_prices(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ProviderError(
            f"the GCP price table {path} is unreadable ({e}): reinstall trainbot, or rebuild"
            " it with `python -m jobs.providers.gcp refresh-prices`"
        ) from None
    if not isinstance(data, dict) or "regions" not in data or "machine_types" not in data:
        raise ProviderError(f"the GCP price table {path} has no regions or machine_types")
    return data


_SKU_MACHINE = re.compile(
    r"^(?:Spot Preemptible )?(?P<family>[A-Z][A-Z0-9]+) (?:Predefined )?Instance "
    r"(?P<kind>Core|Ram) running in"
)
# Accelerator type → the start of its GPU SKUs' descriptions.
_SKU_GPU = {
    "nvidia-tesla-a100": "Nvidia Tesla A100 GPU",
    "nvidia-a100-80gb": "Nvidia A100 80GB GPU",
    "nvidia-h100-80gb": "Nvidia H100 80GB GPU",
    "nvidia-l4": "Nvidia L4 GPU",
    "nvidia-tesla-t4": "Nvidia Tesla T4 GPU",
    "nvidia-tesla-v100": "Nvidia Tesla V100 GPU",
    "nvidia-tesla-p100": "Nvidia Tesla P100 GPU",
    "nvidia-tesla-p4": "Nvidia Tesla P4 GPU",
}
_SKU_SKIP = ("Commitment", "Custom", "Sole Tenancy", "Workstation", "Reserved", "DWS", "Calendar")


def _unit_price(sku: Mapping[str, Any]) -> float | None:
    try:
        rates = sku["pricingInfo"][0]["pricingExpression"]["tieredRates"]
        money = rates[-1]["unitPrice"]
        return round(int(money.get("units") or 0) + int(money.get("nanos") or 0) / 1e9, 9)
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def prices_from_catalog(
    skus: Iterable[Mapping[str, Any]], *, regions: Sequence[str]
) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """Unit prices per region from Cloud Billing Catalog SKUs of Compute Engine.

    Returns ``{region: {"vcpu"|"ram_gb": {FAMILY: {...}}, "gpu": {type: {...}}}}`` with
    ``on_demand`` and ``spot`` per entry: the shape of the shipped table's ``regions``.
    """
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {
        r: {"vcpu": {}, "ram_gb": {}, "gpu": {}} for r in regions
    }
    for sku in skus:
        category = sku.get("category") or {}
        usage = {"OnDemand": "on_demand", "Preemptible": "spot"}.get(str(category.get("usageType")))
        description = str(sku.get("description", ""))
        price = _unit_price(sku)
        if usage is None or price is None or any(s in description for s in _SKU_SKIP):
            continue
        where = [r for r in sku.get("serviceRegions") or [] if r in out]
        entry: tuple[str, str] | None = None
        if category.get("resourceGroup") == "GPU":
            for name, prefix in _SKU_GPU.items():
                bare = description.removeprefix("Spot Preemptible ")
                if bare.startswith(prefix + " ") or bare.startswith(prefix + "s "):
                    entry = ("gpu", name)
        elif m := _SKU_MACHINE.match(description):
            entry = ("vcpu" if m.group("kind") == "Core" else "ram_gb", m.group("family"))
        if entry is None:
            continue
        for region in where:
            out[region][entry[0]].setdefault(entry[1], {})[usage] = price
    for tables in out.values():
        for table in tables.values():
            for key in [k for k, v in table.items() if set(v) != {"on_demand", "spot"}]:
                del table[key]
    return out


def _dump_prices(doc: Mapping[str, Any]) -> str:
    """The table as JSON with one line per leaf entry, so refreshes diff readably."""
    leaf = re.compile(r"\{\n\s+([^{}\[\]]*?)\n\s+\}", re.S)
    text = json.dumps(doc, indent=1)
    return leaf.sub(lambda m: "{" + re.sub(r",\n\s+", ", ", m.group(1)) + "}", text) + "\n"


# -- the provider ------------------------------------------------------------------------


class GcpProvider:
    """Spot (or on-demand) GPU instances in one Compute Engine project.

    Clients are built on first use, so a missing credential shows up as a preflight
    failure that says how to fix it, not as a control plane that will not start.
    """

    name = "gcp"
    capabilities = Capabilities(runs_on_this_machine=False)

    def __init__(
        self,
        *,
        project: str,
        region: str,
        zones: Sequence[str] | None = None,
        machine_type_for: Mapping[str, str] | None = None,
        image: str = DEFAULT_IMAGE,
        service_account: str | None = None,
        api_endpoint: str | None = None,
        credentials: Any = None,
        network: str = "global/networks/default",
        subnetwork: str | None = None,
        external_ip: bool = True,
        runner_package: str = "trainbot[runner]",
        boot_disk_gb: int = 50,
        startup_script: Path | str | None = None,
        prices: Path | str | None = None,
        storage_endpoint: str | None = None,
        launch_timeout_s: float = 300.0,
        call_timeout_s: float = 60.0,
        stockout_cooldown_s: float = 900.0,
    ) -> None:
        """``machine_type_for`` maps ``TYPE:COUNT`` or ``TYPE`` (``A100:8``,
        ``nvidia-l4``; ``cpu`` for CPU-only runs) to a machine type, over the built-in
        choice. ``boot_disk_gb`` is added to the attempt's scratch size. A zone that ran out
        of a type is ranked unavailable for ``stockout_cooldown_s``."""
        if not project or not region:
            raise ProviderError("the GCP provider needs a project and a region (us-central1)")
        self.project = project
        self.region = region
        self.zones = tuple(zones or ())
        self.machine_type_for = {k.lower(): v for k, v in (machine_type_for or {}).items()}
        self.image = image
        self.service_account = service_account
        self.api_endpoint = api_endpoint
        self.network = network
        self.subnetwork = subnetwork
        self.external_ip = external_ip
        self.runner_package = runner_package
        self.boot_disk_gb = boot_disk_gb
        self.startup_script = Path(startup_script) if startup_script else STARTUP_SCRIPT_PATH
        self.prices_path = Path(prices) if prices else PRICES_PATH
        self.storage_endpoint = storage_endpoint or api_endpoint or "https://storage.googleapis.com"
        self.launch_timeout_s = launch_timeout_s
        self.call_timeout_s = call_timeout_s
        self.stockout_cooldown_s = stockout_cooldown_s
        self._credentials = credentials
        _quiet_payload_logging()
        self._lock = threading.Lock()
        self._clients: dict[str, Any] = {}
        self._prices: dict[str, Any] | None = None
        self._region_zones: dict[str, list[str]] = {}
        self._stockouts: dict[tuple[str, str], float] = {}
        self._deleted: set[str] = set()

    # -- Provider: questions --------------------------------------------------------------

    def quota(self, req: ResourceRequest) -> QuotaInfo:
        """The regional metric for the type (preemptible for spot, when the project has
        any), and GPUS_ALL_REGIONS; the tighter of the two binds."""
        region = self._region(req)
        accel = _accelerator(req)
        regional = self._regional_quota(req, region=region, accel=accel)
        if accel is None:
            return regional
        world = self._project_gpu_quota(needed=regional.needed)
        return regional if world is None else _binding(regional, world)

    def _regional_quota(
        self, req: ResourceRequest, *, region: str, accel: _Accelerator | None
    ) -> QuotaInfo:
        found = self._call(
            f"read the quotas of region {region}",
            "regions.get",
            lambda: self._client("regions").get(
                project=self.project, region=region, timeout=self.call_timeout_s
            ),
            not_found=f"region {region} does not exist for project {self.project}: fix"
            " resources.region (GCP regions look like us-central1)",
        )
        with self._lock:
            self._region_zones[region] = sorted(_last(z) for z in found.zones)
        metrics = {q.metric: q for q in found.quotas}
        standard = accel.metric if accel else "CPUS"
        preemptible = f"PREEMPTIBLE_{standard}"
        metric, note = standard, ""
        if req.spot:
            pre = metrics.get(preemptible)
            if pre is not None and pre.limit > 0:
                metric = preemptible
            else:
                # Without preemptible quota, spot VMs consume the standard quota.
                note = f" (no {preemptible} quota, so spot VMs count against {standard})"
        quota = metrics.get(metric)
        limit, used = (quota.limit, quota.usage) if quota is not None else (0.0, 0.0)
        if quota is None:
            note += f"; region {region} lists no {metric} quota"
        needed = float(req.accelerator_count if accel else self._vcpus(req))
        unit = "GPUs" if accel else "vCPUs"
        ok = used + needed <= limit
        remedy = ""
        if not ok:
            remedy = self._quota_remedy(
                preemptible if req.spot else standard, used + needed, region=region
            )
            if req.spot and metric == standard:
                remedy += f" (or raise {standard}: spot VMs use it while {preemptible} is 0)"
        what = f"{accel.name} {unit}" if accel else unit
        return QuotaInfo(
            limit=limit,
            used=used,
            needed=needed,
            unit=unit,
            ok=ok,
            detail=f"{metric} in {region}: {used:g} of {limit:g} {what} in use{note}",
            remedy=remedy,
        )

    def _project_gpu_quota(self, *, needed: float) -> QuotaInfo | None:
        found = self._call(
            f"read the quotas of project {self.project}",
            "projects.get",
            lambda: self._client("projects").get(project=self.project, timeout=self.call_timeout_s),
            not_found=f"project {self.project} does not exist or is not visible: fix the"
            " configured GCP project id",
        )
        total = next((q for q in found.quotas if q.metric == "GPUS_ALL_REGIONS"), None)
        if total is None:
            return None
        ok = total.usage + needed <= total.limit
        return QuotaInfo(
            limit=total.limit,
            used=total.usage,
            needed=needed,
            unit="GPUs",
            ok=ok,
            detail=f"GPUS_ALL_REGIONS in project {self.project}: {total.usage:g} of"
            f" {total.limit:g} GPUs in use",
            remedy=""
            if ok
            else self._quota_remedy("GPUS_ALL_REGIONS", total.usage + needed, region=None),
        )

    def capacity(self, req: ResourceRequest) -> list[ZoneCapacity]:
        """Zones of the region that offer the type (acceleratorTypes), available first.

        Compute Engine publishes no spot placement score, so there are no scores; a zone
        that answered an insert with a stockout lately is ranked unavailable for a while,
        so the next attempt goes to the next zone.
        """
        region = self._region(req)
        accel = _accelerator(req)
        in_region = self._zones_of(region)
        candidates = list(dict.fromkeys(req.zones or self.zones or in_region))
        offered: dict[str, int] = {}
        if accel is not None:
            offered = self._offered(accel)
        kind = self._stockout_kind(req)
        now = time.monotonic()
        zones: list[ZoneCapacity] = []
        for zone in candidates:
            since = self._stockouts.get((zone, kind))
            if zone not in in_region:
                zones.append(ZoneCapacity(zone, False, detail=f"not a zone of {region}"))
            elif since is not None and now - since < self.stockout_cooldown_s:
                ago = int(now - since)
                zones.append(
                    ZoneCapacity(
                        zone,
                        False,
                        detail=f"ran out of {kind} {ago} s ago (ZONE_RESOURCE_POOL_EXHAUSTED)",
                    )
                )
            elif accel is None:
                zones.append(ZoneCapacity(zone, True, detail="CPU machine types"))
            elif zone not in offered:
                zones.append(ZoneCapacity(zone, False, detail=f"does not offer {accel.name}"))
            elif req.accelerator_count > offered[zone]:
                zones.append(
                    ZoneCapacity(
                        zone,
                        False,
                        detail=f"offers at most {offered[zone]} {accel.name} per instance",
                    )
                )
            else:
                zones.append(
                    ZoneCapacity(
                        zone, True, detail=f"offers {accel.name} (up to {offered[zone]} per VM)"
                    )
                )
        return sorted(zones, key=lambda z: not z.available)

    def price(self, req: ResourceRequest, *, zone: str | None = None) -> PriceQuote:
        """From the shipped table: machine vCPUs and memory plus GPUs, per region."""
        table = self._price_table()
        region = _region_of_zone(zone) if zone else self._region(req)
        machine = self._machine_type(req)
        shape = table["machine_types"].get(machine)
        if shape is None:
            raise ProviderError(
                f"the GCP price table has no machine type {machine}: add it to"
                f" {self.prices_path} (family, vcpus, memory_gb) and refresh the prices with"
                " `python -m jobs.providers.gcp refresh-prices`"
            )
        units = table["regions"].get(region)
        priced = region
        if units is None:
            priced = str(table.get("fallback_region", "us-central1"))
            units = table["regions"][priced]
        accel = _accelerator(req)
        totals: dict[str, float] = {}
        for model in ("on_demand", "spot"):
            try:
                total = shape["vcpus"] * units["vcpu"][shape["family"]][model]
                total += shape["memory_gb"] * units["ram_gb"][shape["family"]][model]
                if accel is not None:
                    total += req.accelerator_count * units["gpu"][accel.name][model]
            except KeyError as e:
                raise ProviderError(
                    f"the GCP price table has no {model} price for {e.args[0]} in {priced}:"
                    " refresh it with `python -m jobs.providers.gcp refresh-prices`"
                ) from None
            totals[model] = round(total, 6)
        where = priced if priced == region else f"{priced} figures; {region} is not in the table"
        return PriceQuote(
            spot_usd_per_hour=totals["spot"],
            on_demand_usd_per_hour=totals["on_demand"],
            source=f"gcp price table {self.prices_path.name} ({machine}, {where})",
            as_of=datetime.combine(
                date.fromisoformat(str(table["as_of"])), datetime.min.time(), timezone.utc
            ),
        )

    def bucket_region(self, uri: str) -> str | None:
        """The region of a ``gs://`` bucket, from the Cloud Storage JSON API.

        Read with google-auth's authorized session, so no storage client library is
        needed. A multi- or dual-region bucket that covers this provider's region counts
        as being in it (reads from it do not cross regions); other URIs are None.
        """
        parsed = urlparse(uri)
        if parsed.scheme != "gs" or not parsed.netloc:
            return None
        bucket = parsed.netloc
        url = f"{self.storage_endpoint.rstrip('/')}/storage/v1/b/{quote(bucket, safe='')}"
        session = self._storage_session()
        try:
            response = session.get(url, timeout=self.call_timeout_s)
        except Exception as e:  # requests' and google-auth's errors alike
            raise _translate(
                e, what=f"find the region of gs://{bucket}", call="storage.buckets.get"
            ) from None
        if response.status_code == 404:
            raise ProviderError(
                f"the bucket gs://{bucket} does not exist (or is not visible to the control"
                " plane): fix data_uri"
            )
        if response.status_code == 403:
            raise ProviderPermissionError(
                f"the control plane cannot read the metadata of gs://{bucket}: it lacks"
                f" storage.buckets.get on that bucket; {_ROLE_HINT}",
                permission="storage.buckets.get",
            )
        if response.status_code != 200:
            raise ProviderError(
                f"Cloud Storage answered {response.status_code} for gs://{bucket}; try again"
            )
        data = response.json()
        location = str(data.get("location", "")).lower()
        covered = [
            str(r).lower()
            for r in (data.get("customPlacementConfig") or {}).get("dataLocations", [])
        ]
        if data.get("locationType") in ("multi-region", "dual-region"):
            covered += _MULTI_REGIONS.get(location, [])
            prefix = {"us": "us-", "eu": "europe-", "asia": "asia-"}.get(location)
            if self.region in covered or (prefix and self.region.startswith(prefix)):
                return self.region
        return location or None

    # -- Provider: instances --------------------------------------------------------------

    def launch(self, req: LaunchRequest) -> InstanceInfo:
        """Insert the attempt's instance and wait for the insert to finish.

        A stockout raises CapacityError naming the zone (and ranks it unavailable for
        a while); a quota refusal raises QuotaExceeded; a name already taken adopts it.
        """
        if not req.command:
            raise ProviderError(
                f"run {req.run_id} attempt {req.attempt_id}: the launch command is empty;"
                " the spec needs a command to run"
            )
        res = req.request
        zone = req.zone or self._first_zone(res)
        region = _region_of_zone(zone)
        if res.region not in ("", "local") and res.region != region:
            raise ProviderError(
                f"zone {zone} is not in region {res.region}: fix resources.zones or the region"
            )
        name = instance_name(req.run_id, req.attempt_id)
        key = req.idempotency_key or f"{req.run_id}/{req.attempt_id}"
        request_id = str(uuid.uuid5(_NAMESPACE, f"insert {self.project}/{zone}/{key}"))
        body = self._instance_body(req, zone=zone, name=name, key=key)
        what = f"start instance {name} in {zone} for run {req.run_id}"
        try:
            op = self._call(
                what,
                "instances.insert",
                lambda: self._client("instances").insert_unary(
                    request=compute_v1.InsertInstanceRequest(
                        project=self.project,
                        zone=zone,
                        instance_resource=body,
                        request_id=request_id,
                    ),
                    timeout=self.call_timeout_s,
                ),
                conflict=True,
            )
        except api_exceptions.Conflict:
            log.info("instance %s/%s already exists: adopting it", zone, name)
            return self._adopt(zone, name, req)
        op = self._wait(zone, op, what=what)
        errors = list(op.error.errors) if op.error and op.error.errors else []
        if errors:
            codes = [e.code for e in errors]
            text = "; ".join(f"{e.code}: {e.message}" for e in errors)
            if any(c in _STOCKOUT_CODES for c in codes):
                with self._lock:
                    self._stockouts[(zone, self._stockout_kind(res))] = time.monotonic()
                raise CapacityError(
                    f"zone {zone} has no spot capacity for {self._stockout_kind(res)} now ({text});"
                    " the next attempt tries another zone",
                    zone=zone,
                )
            if "QUOTA_EXCEEDED" in codes:
                raise QuotaExceeded(
                    f"Compute Engine refused {name} in {zone}: {text}. Request more quota:"
                    f" {_QUOTAS_CONSOLE.format(project=self.project)}"
                )
            if any(c in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS") for c in codes):
                return self._adopt(zone, name, req)
            raise ProviderError(f"Compute Engine could not {what}: {text}")
        log.info("launched %s/%s for run %s attempt %s", zone, name, req.run_id, req.attempt_id)
        return self._info(self._get(zone, name, what=f"read instance {name} in {zone}"))

    def status(self, instance_id: str) -> InstanceStatus:
        """Instance status, plus the zone's preemption operations and the runner's exit code."""
        zone, name = _split_id(instance_id)
        try:
            inst = self._get(zone, name, what=f"read instance {instance_id}")
        except InstanceNotFound:
            inst = None
        if inst is None:
            return self._status_of_gone(instance_id, zone, name)
        status = inst.status

        def make(state: InstanceState, reason: str, **kw: Any) -> InstanceStatus:
            return InstanceStatus(instance_id=instance_id, state=state, reason=reason, **kw)

        deleted = instance_id in self._deleted
        if status in ("PROVISIONING", "STAGING") and not deleted:
            return make(InstanceState.PENDING, f"{status.lower()} in {zone}")
        if status == "RUNNING" and not deleted:
            return make(InstanceState.RUNNING, "running")
        if status == "REPAIRING" and not deleted:
            return make(InstanceState.UNKNOWN, "Compute Engine is repairing the instance")
        event = self._history(zone, name, target_id=str(inst.id))
        if event is not None and event[0] == "compute.instances.preempted":
            return _preempted(instance_id, event[1], f"its status is {status}")
        if deleted or event is not None:
            who = "by trainbot" if deleted else "outside trainbot"
            return make(InstanceState.TERMINATED, f"deleted {who} (now {status})")
        code = self._exit_code(zone, name)
        if code is not None:
            if code == 0:
                return make(InstanceState.SUCCEEDED, "the runner exited 0", exit_code=code)
            if code == 75:
                return make(
                    InstanceState.PREEMPTED,
                    "the runner exited 75: preempted, with a checkpoint committed",
                    exit_code=code,
                    preempted_at=_utc(inst.last_stop_timestamp),
                )
            return make(
                InstanceState.FAILED,
                f"the runner exited {code}; see the serial console log of {instance_id}",
                exit_code=code,
            )
        if status == "STOPPING":
            return make(InstanceState.UNKNOWN, "stopping; the cause is not known yet")
        return make(
            InstanceState.TERMINATED,
            f"{status.lower()} outside trainbot, without a runner exit code"
            + (f" ({inst.status_message})" if inst.status_message else ""),
        )

    def terminate(self, instance_id: str) -> None:
        """Delete the instance; an instance already deleted or preempted away is done."""
        zone, name = _split_id(instance_id)
        request_id = str(uuid.uuid5(_NAMESPACE, f"delete {self.project}/{instance_id}"))
        try:
            self._call(
                f"delete instance {instance_id}",
                "instances.delete",
                lambda: self._client("instances").delete_unary(
                    request=compute_v1.DeleteInstanceRequest(
                        project=self.project, zone=zone, instance=name, request_id=request_id
                    ),
                    timeout=self.call_timeout_s,
                ),
                not_found=None,
            )
        except api_exceptions.NotFound:
            if instance_id in self._deleted or self._history(zone, name) is not None:
                return
            raise InstanceNotFound(
                f"GCP instance {instance_id} does not exist and has no deletion or preemption"
                f" on record in project {self.project}; nothing to terminate",
                instance_id=instance_id,
            ) from None
        with self._lock:
            self._deleted.add(instance_id)
        log.info("deleting GCP instance %s", instance_id)

    def list_instances(self) -> list[InstanceInfo]:
        """Every instance labelled trainbot-managed=true, in every zone of the project."""
        request = compute_v1.AggregatedListInstancesRequest(
            project=self.project,
            filter=f'labels.{TAG_MANAGED} = "true"',
        )

        def collect() -> list[Any]:
            pager = self._client("instances").aggregated_list(
                request=request, timeout=self.call_timeout_s
            )
            return [i for _, scoped in pager for i in scoped.instances]

        found = self._call("list trainbot's instances", "instances.aggregatedList", collect)
        return [self._info(i) for i in found if i.labels.get(TAG_MANAGED) == "true"]

    # -- clients and calls ----------------------------------------------------------------

    def _client(self, kind: str) -> Any:
        with self._lock:
            client = self._clients.get(kind)
            if client is not None:
                return client
            credentials = self._credentials_or_default()
            options = ClientOptions(api_endpoint=self.api_endpoint) if self.api_endpoint else None
            factory = {
                "regions": compute_v1.RegionsClient,
                "projects": compute_v1.ProjectsClient,
                "accelerator_types": compute_v1.AcceleratorTypesClient,
                "instances": compute_v1.InstancesClient,
                "zone_operations": compute_v1.ZoneOperationsClient,
            }[kind]
            client = factory(credentials=credentials, client_options=options)
            self._clients[kind] = client
            return client

    def _credentials_or_default(self) -> Any:
        """Caller holds the lock. Application-default credentials, once."""
        if self._credentials is None:
            import google.auth

            try:
                self._credentials, _ = google.auth.default(scopes=[_CLOUD_PLATFORM])
            except auth_exceptions.DefaultCredentialsError as e:
                raise _translate(
                    e, what="call the Compute Engine API", call="regions.get"
                ) from None
        return self._credentials

    def _storage_session(self) -> Any:
        from google.auth.transport.requests import AuthorizedSession

        with self._lock:
            session = self._clients.get("storage")
            if session is None:
                session = AuthorizedSession(self._credentials_or_default())
                self._clients["storage"] = session
            return session

    def _call(
        self,
        what: str,
        call: str,
        fn: Callable[[], T],
        *,
        not_found: str | None = "",
        conflict: bool = False,
    ) -> T:
        """Run one API call; Google's errors become ProviderErrors that say what to do.

        ``not_found``: the message for a 404 ("" keeps the generic one; None lets the
        NotFound through to the caller). ``conflict``: let a 409 through.
        """
        try:
            return fn()
        except api_exceptions.NotFound as e:
            if not_found is None:
                raise
            if not_found:
                raise ProviderError(not_found) from None
            raise _translate(e, what=what, call=call) from None
        except api_exceptions.Conflict as e:
            if conflict:
                raise
            raise _translate(e, what=what, call=call) from None
        except ProviderError:
            raise
        except Exception as e:  # every other Google, auth or network error
            if isinstance(e, (api_exceptions.GoogleAPIError, auth_exceptions.GoogleAuthError)):
                raise _translate(e, what=what, call=call) from None
            if type(e).__module__.startswith(("requests", "urllib3")):
                raise _translate(e, what=what, call=call) from None
            raise

    def _get(self, zone: str, name: str, *, what: str) -> Any:
        try:
            return self._call(
                what,
                "instances.get",
                lambda: self._client("instances").get(
                    project=self.project, zone=zone, instance=name, timeout=self.call_timeout_s
                ),
                not_found=None,
            )
        except api_exceptions.NotFound:
            raise InstanceNotFound(
                f"GCP instance {zone}/{name} does not exist in project {self.project}",
                instance_id=f"{zone}/{name}",
            ) from None

    def _wait(self, zone: str, op: Any, *, what: str) -> Any:
        """Wait for a zone operation (zoneOperations.wait returns at DONE or after ~2 min)."""
        deadline = time.monotonic() + self.launch_timeout_s
        while op.status != compute_v1.Operation.Status.DONE:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("%s: still %s after %.0f s", what, op.status, self.launch_timeout_s)
                return op
            op = self._call(
                what,
                "zoneOperations.wait",
                functools.partial(
                    self._client("zone_operations").wait,
                    project=self.project,
                    zone=zone,
                    operation=op.name,
                    timeout=min(left, 130.0),
                ),
            )
        return op

    def _history(
        self, zone: str, name: str, *, target_id: str | None = None
    ) -> tuple[str, datetime] | None:
        """The first preemption or deletion on record for the instance: (type, when)."""
        request = compute_v1.ListZoneOperationsRequest(
            project=self.project,
            zone=zone,
            filter='(operationType = "compute.instances.preempted") OR (operationType = "delete")',
        )
        suffix = f"/zones/{zone}/instances/{name}"

        def collect() -> list[Any]:
            pager = self._client("zone_operations").list(
                request=request, timeout=self.call_timeout_s
            )
            return [
                op
                for op in pager
                if op.target_link.endswith(suffix)
                and (target_id is None or not op.target_id or str(op.target_id) == target_id)
            ]

        ops = self._call(f"read the operations of {zone}/{name}", "zoneOperations.list", collect)
        events = sorted((_utc(op.insert_time or op.start_time), op.operation_type) for op in ops)
        return (events[0][1], events[0][0]) if events else None

    def _exit_code(self, zone: str, name: str) -> int | None:
        """The runner's exit code, as the startup script reported it; None if it did not."""
        try:
            attrs = self._call(
                f"read the guest attributes of {zone}/{name}",
                "instances.getGuestAttributes",
                lambda: self._client("instances").get_guest_attributes(
                    request=compute_v1.GetGuestAttributesInstanceRequest(
                        project=self.project,
                        zone=zone,
                        instance=name,
                        query_path=f"{_EXIT_NAMESPACE}/",
                    ),
                    timeout=self.call_timeout_s,
                ),
                not_found=None,
            )
        except api_exceptions.NotFound:
            return None
        for item in attrs.query_value.items:
            if item.key == "exit-code":
                try:
                    return int(item.value)
                except ValueError:
                    return None
        return None

    def _status_of_gone(self, instance_id: str, zone: str, name: str) -> InstanceStatus:
        event = self._history(zone, name)
        if event is not None and event[0] == "compute.instances.preempted":
            return _preempted(instance_id, event[1], "deleted (instanceTerminationAction=DELETE)")
        if event is not None or instance_id in self._deleted:
            return InstanceStatus(
                instance_id=instance_id,
                state=InstanceState.TERMINATED,
                reason="deleted"
                + (f" at {event[1].isoformat(timespec='seconds')}" if event else ""),
            )
        raise InstanceNotFound(
            f"GCP instance {instance_id} does not exist in project {self.project} and has no"
            " deletion or preemption on record",
            instance_id=instance_id,
        )

    def _adopt(self, zone: str, name: str, req: LaunchRequest) -> InstanceInfo:
        info = self._info(self._get(zone, name, what=f"read instance {name} in {zone}"))
        if (info.run_id, info.attempt_id) != (req.run_id, req.attempt_id):
            raise ProviderError(
                f"instance {zone}/{name} exists but belongs to run {info.run_id or '?'} attempt"
                f" {info.attempt_id or '?'}, not {req.run_id} {req.attempt_id}: delete it or"
                " check for a clash of attempt ids"
            )
        return info

    # -- building blocks ------------------------------------------------------------------

    def _region(self, req: ResourceRequest) -> str:
        return req.region if req.region not in ("", "local") else self.region

    def _zones_of(self, region: str) -> list[str]:
        with self._lock:
            cached = self._region_zones.get(region)
        if cached is not None:
            return cached
        found = self._call(
            f"list the zones of region {region}",
            "regions.get",
            lambda: self._client("regions").get(
                project=self.project, region=region, timeout=self.call_timeout_s
            ),
            not_found=f"region {region} does not exist for project {self.project}: fix"
            " resources.region (GCP regions look like us-central1)",
        )
        zones = sorted(_last(z) for z in found.zones)
        with self._lock:
            self._region_zones[region] = zones
        return zones

    def _offered(self, accel: _Accelerator) -> dict[str, int]:
        """Zone → most GPUs of the type per instance, for every zone that offers it."""
        request = compute_v1.AggregatedListAcceleratorTypesRequest(
            project=self.project, filter=f'name = "{accel.name}"'
        )

        def collect() -> dict[str, int]:
            pager = self._client("accelerator_types").aggregated_list(
                request=request, timeout=self.call_timeout_s
            )
            out: dict[str, int] = {}
            for scope, scoped in pager:
                for t in scoped.accelerator_types:
                    if t.name == accel.name and not (t.deprecated and t.deprecated.state):
                        out[_last(scope)] = int(t.maximum_cards_per_instance or 0)
            return out

        return self._call(
            f"list the zones that offer {accel.name}", "acceleratorTypes.aggregatedList", collect
        )

    def _first_zone(self, req: ResourceRequest) -> str:
        for zone in self.capacity(req):
            if zone.available:
                return zone.zone
        raise CapacityError(
            f"no zone of {self._region(req)} offers the request now; try later or another region"
        )

    def _machine_type(self, req: ResourceRequest) -> str:
        if req.instance_type:
            return req.instance_type
        accel = _accelerator(req)
        if accel is None:
            chosen = self.machine_type_for.get("cpu")
            if chosen:
                return chosen
            cpus = req.cpus or 4
            size = next((n for n in (2, 4, 8, 16, 32) if n >= cpus), None)
            if size is None:
                raise ProviderError(
                    f"{cpus} vCPUs is more than e2-standard-32 offers: set"
                    " resources.instance_type to a larger machine type"
                )
            return f"e2-standard-{size}"
        count = req.accelerator_count
        for key in (f"{accel.name}:{count}", f"{(req.accelerator_type or '').lower()}:{count}"):
            if key in self.machine_type_for:
                return self.machine_type_for[key]
        for key in (accel.name, (req.accelerator_type or "").lower()):
            if key in self.machine_type_for:
                return self.machine_type_for[key]
        machine = accel.machines.get(count)
        if machine is None:
            counts = ", ".join(str(c) for c in sorted(accel.machines))
            raise ProviderError(
                f"Compute Engine has no machine type with {count} {accel.name}: ask for"
                f" {counts} per instance, or set resources.instance_type"
            )
        return machine

    def _vcpus(self, req: ResourceRequest) -> int:
        shape = self._price_table()["machine_types"].get(self._machine_type(req))
        return int(shape["vcpus"]) if shape else int(req.cpus or 1)

    def _stockout_kind(self, req: ResourceRequest) -> str:
        accel = _accelerator(req)
        return accel.name if accel else self._machine_type(req)

    def _price_table(self) -> dict[str, Any]:
        with self._lock:
            if self._prices is None:
                self._prices = _load_prices(self.prices_path)
            return self._prices

    def _quota_remedy(self, metric: str, wanted: float, *, region: str | None) -> str:
        scope = "region" if region else "project"
        quota_id = f"{metric.replace('_', '-')}-per-project" + ("-region" if region else "")
        where = f" in region {region}" if region else " for the project"
        dims = f" --dimensions=region={region}" if region else ""
        return (
            f"request an increase of {metric}{where} to at least {wanted:g}: in the console"
            f" at {_QUOTAS_CONSOLE.format(project=self.project)} (filter on {metric},"
            f" {scope} {region or 'global'}), or run `gcloud quotas preferences create"
            f" --service=compute.googleapis.com --project={self.project}"
            f" --quota-id={quota_id} --preferred-value={wanted:g}{dims} --email=YOU@EXAMPLE.COM`"
        )

    def _instance_body(self, req: LaunchRequest, *, zone: str, name: str, key: str) -> Any:
        _check_runner_inputs(req)
        res = req.request
        accel = _accelerator(res)
        machine = self._machine_type(res)
        try:
            script = self.startup_script.read_text(encoding="utf-8")
        except OSError as e:
            raise ProviderError(
                f"the GCP startup script {self.startup_script} is unreadable ({e}): reinstall"
                " trainbot from its repository, or pass startup_script= to the gcp provider"
            ) from None
        labels = {
            TAG_MANAGED: "true",
            TAG_RUN_ID: label_value(req.run_id),
            TAG_ATTEMPT_ID: label_value(req.attempt_id),
            TAG_OWNER: label_value(req.owner),
            TAG_IDEMPOTENCY_KEY: label_value(key),
        }
        metadata = {
            "startup-script": script,
            "enable-guest-attributes": "TRUE",
            MD_ENV: json.dumps(dict(req.env), sort_keys=True),
            MD_COMMAND: json.dumps(list(req.command)),
            MD_INSTALL: self.runner_package,
            MD_SCRATCH: str(req.scratch_bytes),
            _MD_IDS[TAG_RUN_ID]: req.run_id,
            _MD_IDS[TAG_ATTEMPT_ID]: req.attempt_id,
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
        disk_gb = self.boot_disk_gb + -(-max(req.scratch_bytes, 0) // 1_000_000_000)
        nic = compute_v1.NetworkInterface()
        if self.subnetwork:
            nic.subnetwork = self.subnetwork
        else:
            nic.network = self.network
        if self.external_ip:
            nic.access_configs = [
                compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")
            ]
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
                        source_image=self.image,
                        disk_size_gb=disk_gb,
                        disk_type=f"zones/{zone}/diskTypes/pd-balanced",
                    ),
                )
            ],
            network_interfaces=[nic],
        )
        if accel is not None:
            body.guest_accelerators = [
                compute_v1.AcceleratorConfig(
                    accelerator_type=f"zones/{zone}/acceleratorTypes/{accel.name}",
                    accelerator_count=res.accelerator_count,
                )
            ]
        if self.service_account:
            body.service_accounts = [
                compute_v1.ServiceAccount(email=self.service_account, scopes=[_CLOUD_PLATFORM])
            ]
        return body

    def _info(self, inst: Any) -> InstanceInfo:
        """An InstanceInfo from an Instance; reads only the id items of its metadata."""
        zone = _last(inst.zone)
        labels = dict(inst.labels)
        exact = {
            item.key: item.value for item in inst.metadata.items if item.key in _MD_IDS.values()
        }
        run_id = exact.get(_MD_IDS[TAG_RUN_ID]) or labels.get(TAG_RUN_ID, "")
        attempt_id = exact.get(_MD_IDS[TAG_ATTEMPT_ID]) or labels.get(TAG_ATTEMPT_ID, "")
        tags = {**labels, TAG_RUN_ID: run_id, TAG_ATTEMPT_ID: attempt_id}
        instance_id = f"{zone}/{inst.name}"
        if instance_id in self._deleted:
            state = InstanceState.TERMINATED
        else:
            state = _STATES.get(inst.status, InstanceState.UNKNOWN)
        return InstanceInfo(
            instance_id=instance_id,
            run_id=run_id,
            attempt_id=attempt_id,
            zone=zone,
            state=state,
            launched_at=_utc(inst.creation_timestamp),
            tags=tags,
        )


# Instance status → state, as far as the status alone can tell (list_instances).
_STATES = {
    "PROVISIONING": InstanceState.PENDING,
    "STAGING": InstanceState.PENDING,
    "RUNNING": InstanceState.RUNNING,
    "STOPPING": InstanceState.UNKNOWN,
    "REPAIRING": InstanceState.UNKNOWN,
    "SUSPENDING": InstanceState.UNKNOWN,
    "SUSPENDED": InstanceState.TERMINATED,
    "STOPPED": InstanceState.TERMINATED,
    "TERMINATED": InstanceState.TERMINATED,
}

# Predefined multi- and dual-regions → the regions they hold.
_MULTI_REGIONS: Mapping[str, list[str]] = {
    "nam4": ["us-central1", "us-east1"],
    "eur4": ["europe-north1", "europe-west4"],
    "eur5": ["europe-west1", "europe-west2"],
    "eur7": ["europe-west2", "europe-west3"],
    "eur8": ["europe-west3", "europe-west6"],
    "asia1": ["asia-northeast1", "asia-northeast2"],
}


def _quiet_payload_logging() -> None:
    """Keep the instances client from logging request and response payloads.

    At DEBUG, google-cloud-compute logs each payload in the record's extra fields, and an
    instance's metadata holds the runner token; a structured log handler would write it.
    """
    logging.getLogger("google.cloud.compute_v1.services.instances").setLevel(logging.INFO)


def _preempted(instance_id: str, when: datetime, how: str) -> InstanceStatus:
    return InstanceStatus(
        instance_id=instance_id,
        state=InstanceState.PREEMPTED,
        reason=f"preempted (spot capacity reclaimed) at {when.isoformat(timespec='seconds')};"
        f" {how}",
        preempted_at=when,
    )


def _binding(regional: QuotaInfo, world: QuotaInfo) -> QuotaInfo:
    """Of a regional and the project-wide quota, the one that stops the request (or,
    when both allow it, the one with less headroom), naming both."""
    if not regional.ok and not world.ok:
        return dataclasses.replace(
            regional,
            detail=f"{regional.detail}; {world.detail}",
            remedy=f"{regional.remedy}; and {world.remedy}",
        )
    if regional.ok and world.ok:
        tighter = regional.limit - regional.used <= world.limit - world.used
        first, second = (regional, world) if tighter else (world, regional)
    else:
        first, second = (world, regional) if regional.ok else (regional, world)
    return dataclasses.replace(first, detail=f"{first.detail}; {second.detail}")


def make(**options: Any) -> GcpProvider:
    """The registry's factory: ``options`` are :class:`GcpProvider`'s keyword arguments.

    The region defaults to preflight's default (us-central1); the project has no default.
    """
    if not options.get("project"):
        raise ProviderError(
            "the gcp provider needs a project: set TRAINBOT_GCP_PROJECT to the project id"
        )
    options.setdefault("region", "us-central1")
    return GcpProvider(**options)


# -- refreshing the price table (never run by tests: it calls the real Billing API) ------

_COMPUTE_SERVICE = "services/6F81-5844-456A"  # Compute Engine in the Cloud Billing Catalog


def _fetch_skus(session: Any) -> Iterable[Mapping[str, Any]]:
    url = f"https://cloudbilling.googleapis.com/v1/{_COMPUTE_SERVICE}/skus"
    token = ""
    while True:
        params = {"currencyCode": "USD", "pageSize": "5000"}
        if token:
            params["pageToken"] = token
        response = session.get(url, params=params, timeout=120)
        response.raise_for_status()
        page = response.json()
        yield from page.get("skus", [])
        token = page.get("nextPageToken", "")
        if not token:
            return


def refresh_prices(
    *, regions: Sequence[str], path: Path = PRICES_PATH, session: Any = None
) -> None:
    """Rewrite the price table from the Cloud Billing Catalog, keeping its machine shapes."""
    if session is None:
        import google.auth
        from google.auth.transport.requests import AuthorizedSession

        credentials, _ = google.auth.default(scopes=[_CLOUD_PLATFORM])
        session = AuthorizedSession(credentials)
    doc = _load_prices(path)
    fresh = prices_from_catalog(_fetch_skus(session), regions=regions)
    for region, tables in fresh.items():
        if not any(tables.values()):
            raise ProviderError(f"the Billing Catalog listed no Compute Engine prices for {region}")
        doc["regions"][region] = tables
    doc["as_of"] = date.today().isoformat()
    doc["source"] = "Cloud Billing Catalog API (Compute Engine SKUs, list prices)"
    path.write_text(_dump_prices(doc), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.providers.gcp")
    sub = parser.add_subparsers(dest="command", required=True)
    refresh = sub.add_parser("refresh-prices", help="refresh the shipped GCP price table")
    refresh.add_argument("--regions", default="us-central1,us-east1,us-west1")
    refresh.add_argument("--output", type=Path, default=PRICES_PATH)
    args = parser.parse_args(argv)
    regions = [r.strip() for r in args.regions.split(",") if r.strip()]
    import requests

    try:
        refresh_prices(regions=regions, path=args.output)
    except (
        ProviderError,
        OSError,
        auth_exceptions.GoogleAuthError,
        requests.RequestException,
    ) as e:
        print(f"could not refresh the GCP prices: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} for {', '.join(regions)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

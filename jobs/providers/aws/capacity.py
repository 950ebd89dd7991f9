"""Whether a run fits, and where: vCPU quotas, zone offerings, spot scores, data region.

Service Quotas answers for the instance family (spot and on-demand are separate quotas,
and new accounts start at 0); offerings and spot placement scores rank the zones;
``GetBucketLocation`` tells where the data is.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from urllib.parse import urlparse

from botocore.exceptions import BotoCoreError, ClientError
from botocore.parsers import ResponseParserError

from jobs.providers import base
from jobs.providers.aws.catalog import type_info, zones
from jobs.providers.aws.clients import Clients
from jobs.providers.aws.errors import DENIED, error_code

__all__ = ["bucket_region", "capacity", "quota", "quota_codes"]

log = logging.getLogger(__name__)

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
        raise base.ProviderError(
            f"trainbot knows no EC2 Service Quotas code for {instance_type}'s family; check "
            "its vCPU quota in the Service Quotas console, or choose a G, P, or standard type"
        )
    return _QUOTAS[group]


# -- quota -------------------------------------------------------------------------------


def quota(clients: Clients, req: base.ResourceRequest, itype: str) -> base.QuotaInfo:
    """The family's vCPU quota (spot or on-demand, as asked) against what the run needs:
    every one of its ``req.instances`` instances (a multi-node run's nodes) at once.

    Used vCPUs are counted from running and pending instances of the family in the
    same market, as EC2 counts them; the other market's quota is named in the detail.
    """
    region = req.region or clients.region
    (spot_code, spot_name), (od_code, od_name) = quota_codes(itype)
    info = type_info(clients, [itype], region)[itype]
    per_node = 1
    if req.accelerator_count and info.gpus:
        per_node = math.ceil(req.accelerator_count / info.gpus)
    nodes = max(req.instances, 1)
    needed = float(max(info.vcpus * per_node, req.cpus or 0) * nodes)
    asking = f"{nodes} × {itype} need" if nodes > 1 else f"{itype} needs"
    code, name = (spot_code, spot_name) if req.spot else (od_code, od_name)
    limit = _quota_value(clients, code, region)
    other_code = od_code if req.spot else spot_code
    try:
        other: float | None = _quota_value(clients, other_code, region)
    except base.ProviderError as exc:
        log.info("could not read quota %s in %s: %s", other_code, region, exc)
        other = None
    used = float(_vcpus_in_use(clients, region, itype, spot=req.spot))
    market = "spot" if req.spot else "on-demand"
    other_text = (
        f"; the {'on-demand' if req.spot else 'spot'} quota {other_code} is {other:g} vCPUs"
        if other is not None
        else ""
    )
    detail = (
        f"AWS {market} quota {code} ({name}) in {region}: limit {limit:g} vCPUs, "
        f"{used:g} in use; {asking} {needed:g}{other_text}"
    )
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
    return base.QuotaInfo.check(float(limit), used, needed, "vCPUs", detail=detail, remedy=remedy)


def _quota_value(clients: Clients, code: str, region: str) -> float:
    sq = clients.client("service-quotas", region=region)
    with clients.call("service-quotas", f"read EC2 quota {code} in {region}"):
        try:
            found = sq.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]
        except ClientError as exc:
            # No applied value yet: the account still has the default.
            if error_code(exc) != "NoSuchResourceException":
                raise
            found = sq.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]
    return float(found["Value"])


def _vcpus_in_use(clients: Clients, region: str, itype: str, *, spot: bool) -> int:
    group = _family_group(itype)
    ec2 = clients.client("ec2", region=region)
    found: list[str] = []
    with clients.call("ec2", f"count running instances in {region}"):
        pages = ec2.get_paginator("describe_instances").paginate(
            Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}]
        )
        for page in pages:
            for reservation in page["Reservations"]:
                for inst in reservation["Instances"]:
                    is_spot = inst.get("InstanceLifecycle") == "spot"
                    if is_spot == spot and _family_group(inst["InstanceType"]) == group:
                        found.append(inst["InstanceType"])
    sizes = type_info(clients, sorted(set(found)), region)
    return sum(sizes[t].vcpus for t in found if t in sizes)


# -- capacity ----------------------------------------------------------------------------


def capacity(
    clients: Clients, req: base.ResourceRequest, itype: str, *, subnet_ids: Mapping[str, str]
) -> list[base.ZoneCapacity]:
    """Zones that offer the type, ranked by spot placement score where AWS gives one."""
    region = req.region or clients.region
    zone_ids = zones(clients, region)
    candidates = list(req.zones) or sorted(zone_ids)
    ec2 = clients.client("ec2", region=region)
    offered: set[str] = set()
    with clients.call("ec2", f"list the zones of {region} that offer {itype}"):
        pages = ec2.get_paginator("describe_instance_type_offerings").paginate(
            LocationType="availability-zone",
            Filters=[{"Name": "instance-type", "Values": [itype]}],
        )
        for page in pages:
            offered.update(o["Location"] for o in page["InstanceTypeOfferings"])
    scores: dict[str, float] = {}
    scores_note = ""
    if req.spot and offered:
        scores, scores_note = _placement_scores(clients, itype, region, req.instances)
    by_id = {zid: name for name, zid in zone_ids.items()}
    zone_scores = {by_id[zid]: s for zid, s in scores.items() if zid in by_id}
    out: list[base.ZoneCapacity] = []
    for zone in dict.fromkeys(candidates):
        if zone not in zone_ids:
            out.append(base.ZoneCapacity.unavailable(zone, f"{zone} is not a zone of {region}"))
        elif zone not in offered:
            out.append(base.ZoneCapacity.unavailable(zone, f"{itype} is not offered in {zone}"))
        elif subnet_ids and zone not in subnet_ids:
            out.append(
                base.ZoneCapacity.unavailable(
                    zone, f"no subnet is configured for {zone} (subnet_ids)"
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
            out.append(base.ZoneCapacity(zone, True, score, detail))
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


def _placement_scores(
    clients: Clients, itype: str, region: str, instances: int = 1
) -> tuple[dict[str, float], str]:
    """Zone id → score for ``instances`` of the type in one zone (a gang's nodes share
    theirs), or an empty map and why: scores only rank, never block."""
    scores_client = clients.client("ec2", region=region, advisory=True)
    try:
        answer = scores_client.get_spot_placement_scores(
            InstanceTypes=[itype],
            TargetCapacity=max(instances, 1),
            TargetCapacityUnitType="units",
            SingleAvailabilityZone=True,
            RegionNames=[region],
        )
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "error")
        if code in DENIED:
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


# -- data locality -----------------------------------------------------------------------


def bucket_region(clients: Clients, uri: str) -> str | None:
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
        raise base.ProviderError(f"{uri!r} names no bucket: write s3://BUCKET/PREFIX")
    if bucket.endswith(".mrap"):
        # A Multi-Region Access Point's alias: its buckets are in several regions, each
        # request routed to the nearest; no one region to compare.
        log.info("s3://%s is a Multi-Region Access Point: no one region", bucket)
        return None
    s3 = clients.client("s3")
    try:
        with clients.call("s3", f"find the region of s3://{bucket}"):
            try:
                answer = s3.get_bucket_location(Bucket=bucket)
            except ClientError as exc:
                if error_code(exc) == "NoSuchBucket":
                    raise base.ProviderError(
                        f"the bucket s3://{bucket} does not exist: fix data_uri or checkpoint_uri"
                    ) from None
                raise
    except base.ProviderPermissionError as exc:
        region = _region_from_head(clients, bucket)
        if region is None:
            log.warning("cannot tell the region of s3://%s: %s", bucket, exc)
        return region
    location = answer.get("LocationConstraint") or "us-east-1"
    return "eu-west-1" if location == "EU" else str(location)


def _region_from_head(clients: Clients, bucket: str) -> str | None:
    try:
        answer = clients.client("s3", advisory=True).head_bucket(Bucket=bucket)
        headers = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    except ClientError as exc:
        headers = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    except (BotoCoreError, ResponseParserError):
        return None
    region = headers.get("x-amz-bucket-region")
    return str(region) if region else None

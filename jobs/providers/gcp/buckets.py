"""Where a ``gs://`` bucket lives, for preflight's data-locality check.

Read from the Cloud Storage JSON API with google-auth's authorized session, so no
storage client library is needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import quote, urlparse

from jobs.providers.base import BucketLocation, ProviderError, ProviderPermissionError
from jobs.providers.gcp.api import ComputeApi
from jobs.providers.gcp.errors import ROLE_HINT, translate

__all__ = ["bucket_location"]

# Predefined dual-regions → the regions they hold.
_DUAL_REGIONS: Mapping[str, list[str]] = {
    "nam4": ["us-central1", "us-east1"],
    "eur4": ["europe-north1", "europe-west4"],
    "eur5": ["europe-west1", "europe-west2"],
    "eur7": ["europe-west2", "europe-west3"],
    "eur8": ["europe-west3", "europe-west6"],
    "asia1": ["asia-northeast1", "asia-northeast2"],
}
# Multi-regions → the prefix of the regions on their continent: reads from any of them
# stay inside the multi-region.
_MULTI_REGIONS: Mapping[str, str] = {"us": "us-", "eu": "europe-", "asia": "asia-"}


def bucket_location(api: ComputeApi, uri: str, *, endpoint: str) -> BucketLocation | None:
    """Where a ``gs://`` bucket is; other URIs are None.

    A dual-region holds its two regions (predefined, or a configurable one's
    ``customPlacementConfig.dataLocations``); a multi-region covers every region of its
    continent. Failover checks each region it moves to against that, not one answer.
    """
    parsed = urlparse(uri)
    if parsed.scheme != "gs" or not parsed.netloc:
        return None
    bucket = parsed.netloc
    url = f"{endpoint.rstrip('/')}/storage/v1/b/{quote(bucket, safe='')}"
    session = api.storage_session()
    try:
        response = session.get(url, timeout=api.call_timeout_s)
    except Exception as e:  # requests' and google-auth's errors alike
        raise translate(
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
            f" storage.buckets.get on that bucket; {ROLE_HINT}",
            permission="storage.buckets.get",
        )
    if response.status_code != 200:
        raise ProviderError(
            f"Cloud Storage answered {response.status_code} for gs://{bucket}; try again"
        )
    data = response.json()
    location = str(data.get("location", "")).lower()
    if not location:
        return None
    kind = data.get("locationType")
    if kind not in ("multi-region", "dual-region"):
        return BucketLocation.region(location)
    covered = {
        str(r).lower() for r in (data.get("customPlacementConfig") or {}).get("dataLocations", [])
    }
    covered.update(_DUAL_REGIONS.get(location, []))
    prefix = _MULTI_REGIONS.get(location) if kind == "multi-region" else None
    return BucketLocation(
        name=location.upper(),
        regions=frozenset(covered),
        region_prefixes=(prefix,) if prefix else (),
    )

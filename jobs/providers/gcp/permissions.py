"""The IAM permissions each Compute Engine call needs.

``deploy/gcp/roles.yaml`` grants the control plane exactly their union; a test compares
the two, so a new call here without its permission there fails.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["PERMISSIONS", "REQUIRED_PERMISSIONS"]

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
        # a gang's nodes list their compact placement policy
        "compute.resourcePolicies.use",
    ),
    "instances.get": ("compute.instances.get",),
    "instances.getGuestAttributes": ("compute.instances.getGuestAttributes",),
    "instances.delete": ("compute.instances.delete",),
    "instances.aggregatedList": ("compute.instances.list",),
    "zoneOperations.wait": ("compute.zoneOperations.get",),
    "zoneOperations.list": ("compute.zoneOperations.list",),
    "resourcePolicies.insert": ("compute.resourcePolicies.create",),
    "resourcePolicies.delete": ("compute.resourcePolicies.delete",),
    "resourcePolicies.list": ("compute.resourcePolicies.list",),
    "regionOperations.wait": ("compute.regionOperations.get",),
    "storage.buckets.get": ("storage.buckets.get",),
    # preflight: the boot image exists (a family's newest image)
    "images.get": ("compute.images.get",),
    "images.getFromFamily": ("compute.images.getFromFamily",),
}
REQUIRED_PERMISSIONS = frozenset(p for perms in PERMISSIONS.values() for p in perms)

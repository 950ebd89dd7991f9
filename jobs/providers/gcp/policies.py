"""Compact placement policies: the nodes of a multi-node attempt on nearby hosts.

Each gang gets one regional resource policy (``groupPlacementPolicy.collocation
COLLOCATED``, ``vmCount`` its nodes), created before node 0 and listed by every node's
insert. Compute Engine refuses to delete a policy an instance still lists, and deleted
instances take a while to go, so the deletion is best effort: a policy still in use is
kept and tried again on later calls, and a failure is logged, never raised, because the
nodes (what costs money) are already gone by then.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterable
from typing import Any

from google.api_core import exceptions as api_exceptions
from google.cloud import compute_v1

from jobs.providers.base import ProviderError, ProviderPermissionError, QuotaExceeded
from jobs.providers.gcp.api import ComputeApi
from jobs.providers.gcp.errors import QUOTAS_CONSOLE

__all__ = ["CompactPolicies", "parse_policy"]

log = logging.getLogger(__name__)

_POLICY = re.compile(r"(?:^|/)regions/([^/]+)/resourcePolicies/([^/]+)$")
_IN_USE = "resourceInUseByAnotherResource"
#: Only policies of these names are trainbot's to delete (``LaunchRequest.placement_group``).
_OURS = "trainbot-"


def parse_policy(url: str) -> tuple[str, str] | None:
    """(region, name) of a resource policy URL (full or partial), None for anything else."""
    found = _POLICY.search(url)
    return (found.group(1), found.group(2)) if found else None


class CompactPolicies:
    """Creates gangs' policies, and deletes them once their nodes are gone; remembers each
    gang's policy and the policies waiting for their instances to go."""

    def __init__(self, api: ComputeApi, *, retry_s: float) -> None:
        """``retry_s``: the least time between two tries of a policy still in use, so
        that the control plane's status polls do not each cost a refused delete."""
        self._api = api
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._swept = -float("inf")
        # (region, name) of policies to delete once no instance lists them.
        self._doomed: set[tuple[str, str]] = set()
        # Node instance id → its gang's policy, from launch and list_instances, so that
        # terminate knows it without reading nodes that may be gone.
        self._of_node: dict[str, tuple[str, str]] = {}

    def path(self, region: str, name: str) -> str:
        """The policy's URL as an instance's ``resourcePolicies`` lists it."""
        return f"projects/{self._api.project}/regions/{region}/resourcePolicies/{name}"

    def ensure(self, region: str, name: str, *, nodes: int, timeout_s: float) -> str:
        """Create the policy for a gang of ``nodes``; one that exists already is the gang's
        own (a retried launch, or one adopted after a crash). Returns its path."""
        api = self._api
        with self._lock:
            # A launch of the attempt again (the next zone) needs the policy after all.
            self._doomed.discard((region, name))
        what = f"create compact placement policy {name} in {region}"
        body = compute_v1.ResourcePolicy(
            name=name,
            description=f"trainbot: places the {nodes} nodes of one multi-node attempt",
            group_placement_policy=compute_v1.ResourcePolicyGroupPlacementPolicy(
                collocation="COLLOCATED", vm_count=nodes
            ),
        )
        # No request id: a policy deleted after a failed launch and wanted again (the
        # attempt launched anew) would get the old insert's answer back and not exist. The
        # name is the idempotency: a second insert is refused as a conflict (409).
        try:
            op = api.call(
                what,
                "resourcePolicies.insert",
                lambda: api.client("resource_policies").insert_unary(
                    request=compute_v1.InsertResourcePolicyRequest(
                        project=api.project,
                        region=region,
                        resource_policy_resource=body,
                    ),
                    timeout=api.call_timeout_s,
                ),
                conflict=True,
            )
        except api_exceptions.Conflict:
            log.info("compact placement policy %s/%s exists already: using it", region, name)
            return self.path(region, name)
        op = api.wait_region(region, op, what=what, timeout_s=timeout_s)
        if op.status != compute_v1.Operation.Status.DONE:
            raise ProviderError(
                f"Compute Engine did not {what} within {timeout_s:.0f} s; the launch is retried"
            )
        errors = list(op.error.errors) if op.error and op.error.errors else []
        codes = {e.code for e in errors}
        if codes & {"RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"}:
            return self.path(region, name)
        text = "; ".join(f"{e.code}: {e.message}" for e in errors)
        if "QUOTA_EXCEEDED" in codes:
            raise QuotaExceeded(
                f"Compute Engine refused to {what}: {text}. Delete unused resource policies"
                f" in {region} or request more quota:"
                f" {QUOTAS_CONSOLE.format(project=api.project)}"
            )
        if errors:
            raise ProviderError(f"Compute Engine could not {what}: {text}")
        log.info("created compact placement policy %s/%s for %d nodes", region, name, nodes)
        return self.path(region, name)

    def remember(self, node_ids: Iterable[str], policy: tuple[str, str]) -> None:
        """Note that these nodes (one gang's) list ``policy``: (region, name)."""
        with self._lock:
            for node in node_ids:
                self._of_node[node] = policy

    def known(self, node_ids: Iterable[str]) -> set[tuple[str, str]]:
        """The policies remembered for these nodes."""
        with self._lock:
            return {self._of_node[n] for n in node_ids if n in self._of_node}

    @staticmethod
    def listed_by(instances: Iterable[Any]) -> set[tuple[str, str]]:
        """The trainbot policies these instances (as the API describes them) list."""
        found = set()
        for inst in instances:
            for url in inst.resource_policies:
                parsed = parse_policy(url)
                if parsed is not None and parsed[1].startswith(_OURS):
                    found.add(parsed)
        return found

    def release(self, node_ids: Iterable[str], policies: Iterable[tuple[str, str]]) -> None:
        """Delete the policies once nothing lists them: now, or on a later :meth:`sweep`;
        the nodes are forgotten."""
        with self._lock:
            for node in node_ids:
                self._of_node.pop(node, None)
            self._doomed.update(policies)
        self.sweep(due_only=False)

    def sweep(self, *, due_only: bool = True) -> None:
        """Try to delete every policy waiting for its instances to go, when ``retry_s``
        has passed since the last try (``due_only``) or now; best effort."""
        now = time.monotonic()
        with self._lock:
            if not self._doomed or (due_only and now - self._swept < self._retry_s):
                return
            self._swept = now
            doomed = sorted(self._doomed)
        for region, name in doomed:
            if self._delete(region, name):
                with self._lock:
                    self._doomed.discard((region, name))

    def _delete(self, region: str, name: str) -> bool:
        """True when the policy is gone, or will never be deleted by us (no permission)."""
        api = self._api

        def delete() -> Any:
            try:
                return api.client("resource_policies").delete_unary(
                    project=api.project,
                    region=region,
                    resource_policy=name,
                    timeout=api.call_timeout_s,
                )
            except api_exceptions.BadRequest as e:
                if _in_use(e):
                    return None
                raise

        what = f"delete compact placement policy {name} in {region}"
        try:
            op = api.call(what, "resourcePolicies.delete", delete, not_found=None)
        except api_exceptions.NotFound:
            return True
        except ProviderPermissionError as e:
            log.warning(
                "%s; delete it by hand: gcloud compute resource-policies delete %s --region=%s",
                e,
                name,
                region,
            )
            return True
        except ProviderError as e:
            log.warning("%s (tried again later)", e)
            return False
        if op is None:
            log.debug("policy %s/%s is still in use by an instance being deleted", region, name)
            return False
        log.info("deleting compact placement policy %s/%s", region, name)
        return True


def _in_use(exc: api_exceptions.GoogleAPICallError) -> bool:
    reasons = {str(e.get("reason", "")) for e in exc.errors or [] if isinstance(e, dict)}
    return _IN_USE in reasons or "already being used by" in (exc.message or "")

"""Compact placement policies: the nodes of a multi-node attempt on nearby hosts.

Each gang gets one regional resource policy (``groupPlacementPolicy.collocation
COLLOCATED``, ``vmCount`` its nodes), created before node 0 and listed by every node's
insert. Compute Engine refuses to delete a policy an instance still lists, and deleted
instances take a while to go, so the deletion is best effort: a policy still in use is
kept and tried again on later calls, and a failure is logged, never raised, because the
nodes (what costs money) are already gone by then.

A control plane that restarts after a gang's nodes went and before it deleted their
policy no longer knows the policy; :meth:`CompactPolicies.sweep_left_behind`, run with
each listing of the instances, finds such policies by name and deletes them.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from google.api_core import exceptions as api_exceptions
from google.cloud import compute_v1

from jobs.providers.base import ProviderError, ProviderPermissionError, QuotaExceeded
from jobs.providers.gcp.api import ComputeApi
from jobs.providers.gcp.errors import QUOTAS_CONSOLE
from jobs.providers.gcp.names import utc

__all__ = ["LEFT_BEHIND_AFTER", "CompactPolicies", "parse_policy"]

log = logging.getLogger(__name__)

_POLICY = re.compile(r"(?:^|/)regions/([^/]+)/resourcePolicies/([^/]+)$")
_IN_USE = "resourceInUseByAnotherResource"
#: Only policies of these names are trainbot's to delete (``LaunchRequest.placement_group``).
_OURS = "trainbot-"
#: A trainbot policy no instance lists is left behind once it is this old; a younger one
#: may be a launch's whose first node is not inserted yet.
LEFT_BEHIND_AFTER = timedelta(hours=1)


def parse_policy(url: str) -> tuple[str, str] | None:
    """(region, name) of a resource policy URL (full or partial), None for anything else."""
    found = _POLICY.search(url)
    return (found.group(1), found.group(2)) if found else None


class CompactPolicies:
    """Creates gangs' policies, and deletes them once their nodes are gone; remembers each
    gang's policy and the policies waiting for their instances to go."""

    def __init__(self, api: ComputeApi, *, retry_s: float, sweep_s: float) -> None:
        """``retry_s``: the least time between two tries of a policy still in use, so
        that the control plane's status polls do not each cost a refused delete.
        ``sweep_s``: the least time between two listings of a region's policies by
        :meth:`sweep_left_behind`."""
        self._api = api
        self._retry_s = retry_s
        self._sweep_s = sweep_s
        self._lock = threading.Lock()
        self._swept = -float("inf")
        # Region → when sweep_left_behind last listed it (time.monotonic()).
        self._region_swept: dict[str, float] = {}
        # Regions whose policies the credentials may not list: warned about once.
        self._list_denied: set[str] = set()
        # Policies this process ensured, and when (time.monotonic()): an old policy that a
        # launch adopts is not left behind while its nodes are being inserted.
        self._ensured: dict[tuple[str, str], float] = {}
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
            self._ensured[(region, name)] = time.monotonic()
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
        request = compute_v1.InsertResourcePolicyRequest(
            project=api.project, region=region, resource_policy_resource=body
        )
        op = api.insert(what, "resourcePolicies.insert", request, client="resource_policies")
        if op is None:
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
            for policy in policies:
                self._doomed.add(policy)
                self._ensured.pop(policy, None)
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

    def sweep_left_behind(
        self, regions: Iterable[str], used: set[tuple[str, str]], *, now: datetime
    ) -> list[tuple[str, str]]:
        """Delete the trainbot compact placement policies of ``regions`` that no instance
        lists (``used``: those the instances just listed name) and that are older than
        :data:`LEFT_BEHIND_AFTER`: a gang's whose nodes all went while no control plane
        knew its policy. Each region is listed at most every ``sweep_s``. Best effort:
        logs, never raises, since this runs with every listing of the instances. Returns
        the (region, name) of the policies deleted."""
        clock = time.monotonic()
        due = []
        with self._lock:
            for region in dict.fromkeys(regions):
                if clock - self._region_swept.get(region, -float("inf")) >= self._sweep_s:
                    self._region_swept[region] = clock
                    due.append(region)
            grace = LEFT_BEHIND_AFTER.total_seconds()
            self._ensured = {p: at for p, at in self._ensured.items() if clock - at < grace}
            launching = set(self._ensured)
        deleted = []
        for region in due:
            try:
                for name, created in self._ours(region):
                    policy = (region, name)
                    if policy in used or policy in launching or now - created < LEFT_BEHIND_AFTER:
                        continue
                    log.info(
                        "compact placement policy %s/%s is left behind (no instance lists it)",
                        region,
                        name,
                    )
                    if self._delete(region, name):
                        deleted.append(policy)
            except Exception:  # housekeeping: never what stops a listing of the instances
                log.warning("sweeping the placement policies of %s failed", region, exc_info=True)
        return deleted

    def _ours(self, region: str) -> list[tuple[str, datetime]]:
        """(name, creation time) of the region's trainbot compact placement policies; none
        when they cannot be listed (a missing permission is warned about once)."""
        api = self._api
        request = compute_v1.ListResourcePoliciesRequest(
            project=api.project, region=region, filter=f'name eq "{_OURS}.*"'
        )

        def collect() -> list[Any]:
            pager = api.client("resource_policies").list(
                request=request, timeout=api.call_timeout_s
            )
            return list(pager)

        what = f"list the resource policies of {region}"
        try:
            found = api.call(what, "resourcePolicies.list", collect)
        except ProviderPermissionError as e:
            with self._lock:
                first = region not in self._list_denied
                self._list_denied.add(region)
            if first:
                log.warning(
                    "compact placement policies left behind in %s are not deleted: %s", region, e
                )
            return []
        except ProviderError as e:
            log.info("resource policies of %s not listed this time: %s", region, e)
            return []
        return [
            (p.name, utc(p.creation_timestamp))
            for p in found
            if p.name.startswith(_OURS) and _compact(p)
        ]

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


def _compact(policy: Any) -> bool:
    """Whether a resource policy (as the API describes it) is a compact placement policy."""
    return "group_placement_policy" in policy and (
        policy.group_placement_policy.collocation == "COLLOCATED"
    )


def _in_use(exc: api_exceptions.GoogleAPICallError) -> bool:
    reasons = {str(e.get("reason", "")) for e in exc.errors or [] if isinstance(e, dict)}
    return _IN_USE in reasons or "already being used by" in (exc.message or "")

"""What became of an instance: its status, the zone's operations and the runner's exit code.

A preempted spot VM is deleted (``instanceTerminationAction=DELETE``), so the preemption
is read from the zone's ``compute.instances.preempted`` operation; the exit code comes
back as a guest attribute the startup script writes before it halts the guest.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from google.api_core import exceptions as api_exceptions
from google.cloud import compute_v1

from jobs.providers import base
from jobs.providers.gcp.api import ComputeApi
from jobs.providers.gcp.launch import EXIT_NAMESPACE, MD_IDS, NAMESPACE
from jobs.providers.gcp.names import last, split_id, utc

__all__ = ["Instances"]

log = logging.getLogger(__name__)

# Instance status → state, as far as the status alone can tell (list_instances).
_STATES = {
    "PROVISIONING": base.InstanceState.PENDING,
    "STAGING": base.InstanceState.PENDING,
    "RUNNING": base.InstanceState.RUNNING,
    "STOPPING": base.InstanceState.UNKNOWN,
    "REPAIRING": base.InstanceState.UNKNOWN,
    "SUSPENDING": base.InstanceState.UNKNOWN,
    "SUSPENDED": base.InstanceState.TERMINATED,
    "STOPPED": base.InstanceState.TERMINATED,
    "TERMINATED": base.InstanceState.TERMINATED,
}


class Instances:
    """Reads, lists and deletes trainbot's instances; remembers which ones it deleted,
    so a deletion is never mistaken for a failure or a preemption."""

    def __init__(self, api: ComputeApi) -> None:
        self._api = api
        self._lock = threading.Lock()
        self._deleted: set[str] = set()

    def status(self, instance_id: str) -> base.InstanceStatus:
        """Instance status, plus the zone's preemption operations and the runner's exit code."""
        zone, name = split_id(instance_id)
        try:
            inst = self.get(zone, name, what=f"read instance {instance_id}")
        except base.InstanceNotFound:
            inst = None
        if inst is None:
            return self._status_of_gone(instance_id, zone, name)
        status = inst.status

        def make(state: base.InstanceState, reason: str, **kw: Any) -> base.InstanceStatus:
            return base.InstanceStatus(instance_id=instance_id, state=state, reason=reason, **kw)

        deleted = instance_id in self._deleted
        if status in ("PROVISIONING", "STAGING") and not deleted:
            return make(base.InstanceState.PENDING, f"{status.lower()} in {zone}")
        if status == "RUNNING" and not deleted:
            return make(base.InstanceState.RUNNING, "running")
        if status == "REPAIRING" and not deleted:
            return make(base.InstanceState.UNKNOWN, "Compute Engine is repairing the instance")
        event = self._history(zone, name, target_id=str(inst.id))
        if event is not None and event[0] == "compute.instances.preempted":
            return _preempted(instance_id, event[1], f"its status is {status}")
        if deleted or event is not None:
            who = "by trainbot" if deleted else "outside trainbot"
            return make(base.InstanceState.TERMINATED, f"deleted {who} (now {status})")
        code = self._exit_code(zone, name)
        if code is not None:
            if code == 0:
                return make(base.InstanceState.SUCCEEDED, "the runner exited 0", exit_code=code)
            if code == 75:
                return make(
                    base.InstanceState.PREEMPTED,
                    "the runner exited 75: preempted; the next attempt resumes from its "
                    "newest checkpoint",
                    exit_code=code,
                    preempted_at=utc(inst.last_stop_timestamp),
                )
            return make(
                base.InstanceState.FAILED,
                f"the runner exited {code}; see the serial console log of {instance_id}",
                exit_code=code,
            )
        if status == "STOPPING":
            return make(base.InstanceState.UNKNOWN, "stopping; the cause is not known yet")
        return make(
            base.InstanceState.TERMINATED,
            f"{status.lower()} outside trainbot, without a runner exit code"
            + (f" ({inst.status_message})" if inst.status_message else ""),
        )

    def terminate(self, instance_id: str) -> None:
        """Delete the instance; an instance already deleted or preempted away is done."""
        api = self._api
        zone, name = split_id(instance_id)
        request_id = str(uuid.uuid5(NAMESPACE, f"delete {api.project}/{instance_id}"))
        request = compute_v1.DeleteInstanceRequest(
            project=api.project, zone=zone, instance=name, request_id=request_id
        )
        try:
            api.send(
                f"delete instance {instance_id}",
                "instances.delete",
                request,
                client="instances",
                method="delete_unary",
                not_found=None,
            )
        except api_exceptions.NotFound:
            if instance_id in self._deleted or self._history(zone, name) is not None:
                return
            raise base.InstanceNotFound(
                f"GCP instance {instance_id} does not exist and has no deletion or preemption"
                f" on record in project {api.project}; nothing to terminate",
                instance_id=instance_id,
            ) from None
        with self._lock:
            self._deleted.add(instance_id)
        log.info("deleting GCP instance %s", instance_id)

    def managed(self) -> list[Any]:
        """Every instance labelled trainbot-managed=true, in every zone of the project, as
        the API describes it (:meth:`info` makes InstanceInfos of them)."""
        api = self._api
        request = compute_v1.AggregatedListInstancesRequest(
            project=api.project,
            filter=f'labels.{base.TAG_MANAGED} = "true"',
        )

        def collect() -> list[Any]:
            pager = api.client("instances").aggregated_list(
                request=request, timeout=api.call_timeout_s
            )
            return [i for _, scoped in pager for i in scoped.instances]

        found = api.call("list trainbot's instances", "instances.aggregatedList", collect)
        return [i for i in found if i.labels.get(base.TAG_MANAGED) == "true"]

    def existing(self, instance_ids: Sequence[str]) -> list[Any]:
        """The instances of these ids that exist now (those gone are left out)."""
        found = []
        for instance_id in instance_ids:
            try:
                zone, name = split_id(instance_id)
                found.append(self.get(zone, name, what=f"read instance {instance_id}"))
            except base.InstanceNotFound:
                continue
        return found

    def get(self, zone: str, name: str, *, what: str) -> Any:
        """instances.get; InstanceNotFound when there is no such instance."""
        api = self._api
        try:
            return api.call(
                what,
                "instances.get",
                lambda: api.client("instances").get(
                    project=api.project, zone=zone, instance=name, timeout=api.call_timeout_s
                ),
                not_found=None,
            )
        except api_exceptions.NotFound:
            raise base.InstanceNotFound(
                f"GCP instance {zone}/{name} does not exist in project {api.project}",
                instance_id=f"{zone}/{name}",
            ) from None

    def adopt(self, zone: str, name: str, req: base.LaunchRequest) -> base.InstanceInfo:
        """The existing instance of the attempt's name, if it is the attempt's."""
        info = self.info(self.get(zone, name, what=f"read instance {name} in {zone}"))
        if (info.run_id, info.attempt_id) != (req.run_id, req.attempt_id):
            raise base.ProviderError(
                f"instance {zone}/{name} exists but belongs to run {info.run_id or '?'} attempt"
                f" {info.attempt_id or '?'}, not {req.run_id} {req.attempt_id}: delete it or"
                " check for a clash of attempt ids"
            )
        return info

    def info(self, inst: Any) -> base.InstanceInfo:
        """An InstanceInfo from an Instance; reads only the id items of its metadata."""
        zone = last(inst.zone)
        labels = dict(inst.labels)
        exact = {
            item.key: item.value for item in inst.metadata.items if item.key in MD_IDS.values()
        }
        run_id = exact.get(MD_IDS[base.TAG_RUN_ID]) or labels.get(base.TAG_RUN_ID, "")
        attempt_id = exact.get(MD_IDS[base.TAG_ATTEMPT_ID]) or labels.get(base.TAG_ATTEMPT_ID, "")
        tags = {**labels, base.TAG_RUN_ID: run_id, base.TAG_ATTEMPT_ID: attempt_id}
        instance_id = f"{zone}/{inst.name}"
        if instance_id in self._deleted:
            state = base.InstanceState.TERMINATED
        else:
            state = _STATES.get(inst.status, base.InstanceState.UNKNOWN)
        return base.InstanceInfo(
            instance_id=instance_id,
            run_id=run_id,
            attempt_id=attempt_id,
            zone=zone,
            state=state,
            launched_at=utc(inst.creation_timestamp),
            tags=tags,
            # Where the other nodes of a gang reach it (gang.launch hands node 0's on).
            address=inst.network_interfaces[0].network_i_p if inst.network_interfaces else "",
        )

    def _history(
        self, zone: str, name: str, *, target_id: str | None = None
    ) -> tuple[str, datetime] | None:
        """The first preemption or deletion on record for the instance: (type, when)."""
        api = self._api
        request = compute_v1.ListZoneOperationsRequest(
            project=api.project,
            zone=zone,
            filter='(operationType = "compute.instances.preempted") OR (operationType = "delete")',
        )
        suffix = f"/zones/{zone}/instances/{name}"

        def collect() -> list[Any]:
            pager = api.client("zone_operations").list(request=request, timeout=api.call_timeout_s)
            return [
                op
                for op in pager
                if op.target_link.endswith(suffix)
                and (target_id is None or not op.target_id or str(op.target_id) == target_id)
            ]

        ops = api.call(f"read the operations of {zone}/{name}", "zoneOperations.list", collect)
        events = sorted((utc(op.insert_time or op.start_time), op.operation_type) for op in ops)
        return (events[0][1], events[0][0]) if events else None

    def _exit_code(self, zone: str, name: str) -> int | None:
        """The runner's exit code, as the startup script reported it; None if it did not."""
        api = self._api
        request = compute_v1.GetGuestAttributesInstanceRequest(
            project=api.project, zone=zone, instance=name, query_path=f"{EXIT_NAMESPACE}/"
        )
        try:
            attrs = api.send(
                f"read the guest attributes of {zone}/{name}",
                "instances.getGuestAttributes",
                request,
                client="instances",
                method="get_guest_attributes",
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

    def _status_of_gone(self, instance_id: str, zone: str, name: str) -> base.InstanceStatus:
        event = self._history(zone, name)
        if event is not None and event[0] == "compute.instances.preempted":
            return _preempted(instance_id, event[1], "deleted (instanceTerminationAction=DELETE)")
        if event is not None or instance_id in self._deleted:
            return base.InstanceStatus(
                instance_id=instance_id,
                state=base.InstanceState.TERMINATED,
                reason="deleted"
                + (f" at {event[1].isoformat(timespec='seconds')}" if event else ""),
            )
        raise base.InstanceNotFound(
            f"GCP instance {instance_id} does not exist in project {self._api.project} and has"
            " no deletion or preemption on record",
            instance_id=instance_id,
        )


def _preempted(instance_id: str, when: datetime, how: str) -> base.InstanceStatus:
    return base.InstanceStatus(
        instance_id=instance_id,
        state=base.InstanceState.PREEMPTED,
        reason=f"preempted (spot capacity reclaimed) at {when.isoformat(timespec='seconds')};"
        f" {how}",
        preempted_at=when,
    )

"""The executor's part for the pair's own record: `status` (a write-through copy of it, adopted from the watch when
the live object is newer; each write only the fields that changed, with the conditions' transition times kept), the
fields the executor fills in (ports, pods, service, the roles' counts, the rollout's ports and pods), what it reads
of the health watch's `status.health`, and the restart annotations (the pair's and the per-instance record), read
back with this process's own newer write covering the watch's lag. Separate from the pass so that the one place
that writes the pair object is in one module. `PairStatus` is a part of `reconciler.PairReconciler` (its state
lives there) and decides nothing."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Iterable, Mapping

from pdpair.contract import (
    ANNOTATION_INSTANCE_RESTART_TIMES,
    ANNOTATION_RESTART_TIMES,
    GROUP,
    PHASE_FAILED,
    PLURAL,
    ROLE_DECODE,
    ROLE_PREFILL,
    ROLE_ROUTER,
    VERSION,
)
from pdpair.operator.act.pod_steps import CREATED_UNSEEN_WAIT
from pdpair.operator.build.pods import pod_name
from pdpair.operator.decide import health_status
from pdpair.operator.decide import recreate as d
from pdpair.operator.decide import scale_targets
from pdpair.operator.decide import surge
from pdpair.operator.model.conditions import Condition, apply_conditions, status_diff
from pdpair.operator.model.observed import Finding, PodView


class PairStatus:
    """Mixed into PairReconciler: the status copy and its writes, the fields the executor fills in, the restart
    annotations read back."""

    def _refresh_status(self) -> None:
        """Take the live status (kopf's body follows the watch) when its object is newer than our last status
        write: another writer (the health watch, a user, the replica that led before us) is seen on the next pass,
        and nothing is remembered that the API does not have. resourceVersions are etcd revisions; one that is not
        a number keeps the copy."""
        live = self.body.get("metadata", {}).get("resourceVersion")
        if self.status_version is not None:
            try:
                if live is None or int(live) <= int(self.status_version):
                    return
            except (TypeError, ValueError):
                return
        self.status = json.loads(json.dumps(dict(self.body.get("status") or {})))
        self.status_version = live

    def _restart_times(self) -> list[float]:
        """The pair's restart record (its annotation), or this reconciler's own newer write while the watch has not
        delivered it yet (for at most CREATED_UNSEEN_WAIT)."""
        raw = ((self.body.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_RESTART_TIMES, "[]")
        try:
            recorded = [float(t) for t in json.loads(raw)]
        except (ValueError, TypeError):
            recorded = []
        if self.restart_times_written is not None:
            written, at = self.restart_times_written
            if list(written) == recorded or time.monotonic() - at > CREATED_UNSEEN_WAIT:
                self.restart_times_written = None
            else:
                return list(written)
        return recorded

    def _instance_restart_times(self) -> tuple[int, dict[str, tuple[float, ...]]]:
        """The pair's per-instance replacement record (annotation pdpair.io/instance-restart-times: the generation
        it is about and the times by "<role>-<index>"), or this reconciler's own newer write (as _restart_times)."""
        raw = ((self.body.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_INSTANCE_RESTART_TIMES)
        try:
            doc = json.loads(raw) if raw else {}
            recorded = (int(doc.get("generation") or 0),
                        {str(k): tuple(float(t) for t in v) for k, v in (doc.get("times") or {}).items()})
        except (ValueError, TypeError, AttributeError):
            recorded = (0, {})
        if self.instance_restarts_written is not None:
            written, at = self.instance_restarts_written
            if written == recorded or time.monotonic() - at > CREATED_UNSEEN_WAIT:
                self.instance_restarts_written = None
            else:
                return written
        return recorded

    def _rollout_fields(self, plan: d.Plan, pods: tuple[PodView, ...]) -> dict[str, Any]:
        """plan.status_fields, with status.rollout's ports and pods filled in (what the executor holds)."""
        fields = dict(plan.status_fields)
        current = fields.get("rollout", self.status.get("rollout"))
        if isinstance(current, Mapping) and current.get("phase") in surge.ACTIVE_PHASES:
            generation, _ = surge.other_generation({**self.status, "rollout": current})  # type: ignore[misc]
            fields["rollout"] = {**current, "ports": self.rollout_ports or [],
                                 "pods": sorted(p.name for p in pods if p.generation == generation)}
        return fields

    def _scale_condition(self) -> list[Condition]:
        """ReplicasFromScaleTarget, while the role objects are watched: True while one's count overrides the inline."""
        if self.scale_views is None:
            return []
        found = scale_targets.inline_overridden(self.body["spec"], self.scale_views)
        return [Condition(*scale_targets.overridden_condition(found))]

    def _health_finding(self) -> Finding | None:
        """The health watch's restart finding, as it wrote it to status.health (for the planner)."""
        return health_status.restart_finding(self._health())

    def _health(self) -> Any:
        """`status.health` as the health watch last wrote it (kopf's live body: this reconciler never writes it)."""
        return (self.body.get("status") or {}).get("health")

    def _signals_condition(self, generation: int) -> list[Condition]:
        """SignalsHealthy for the current generation, from `status.health` (health_status.signals_condition)."""
        return [health_status.signals_condition(self._health(), generation)]

    def _status_fields(self, plan: d.Plan, pods: tuple[PodView, ...]) -> dict[str, Any]:
        names = {
            role: pod_name(self.ref.name, role, plan.pair_generation) for role in (ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER)
        }
        present = {p.role for p in pods if p.generation == plan.pair_generation}
        fields: dict[str, Any] = {
            "phase": plan.phase,
            "pairGeneration": plan.pair_generation,
            "message": plan.message[:32768],
            "pods": {role: name for role, name in names.items() if role in present},
            "restarts": int(self.status.get("restarts") or 0),
            "service": self.service,  # None removes the field (merge patch)
            "ports": self.ports or [],  # the leases exactly: none held is an empty list, not the last list seen
        }
        for role, entry in plan.role_status.items():
            view = (self.scale_views or {}).get(role)
            fields[role] = {**entry, "scaleTarget": view.name if view is not None else None}
        return fields

    async def _write_status(
        self, fields: Mapping[str, Any], conditions: Iterable[Condition], meta_generation: int
    ) -> bool:
        new = dict(self.status)
        new.update(fields)
        new["observedGeneration"] = meta_generation
        new["conditions"], cond_changed = apply_conditions(self.status.get("conditions"), conditions)
        patch = status_diff(self.status, new)
        if not patch:
            return False
        await self._patch_status(patch)
        self.status = new
        return True

    async def _patch_status(self, patch: Mapping[str, Any]) -> None:
        result = await asyncio.to_thread(
            self.rt.custom.patch_namespaced_custom_object_status,
            GROUP, VERSION, self.ref.namespace, PLURAL, self.ref.name, {"status": dict(patch)},
        )
        self.status.update(patch)
        version = ((result or {}).get("metadata") or {}).get("resourceVersion") if isinstance(result, dict) else None
        if version:
            self.status_version = version

    async def _patch_meta(self, annotations: Mapping[str, str]) -> None:
        await asyncio.to_thread(
            self.rt.custom.patch_namespaced_custom_object,
            GROUP, VERSION, self.ref.namespace, PLURAL, self.ref.name, {"metadata": {"annotations": dict(annotations)}},
        )

    async def _fail(self, message: str, conditions: Iterable[Condition], meta_generation: int) -> None:
        changed = await self._write_status(
            {"phase": PHASE_FAILED, "message": message[:32768]},
            list(conditions) + self._signals_condition(int(self.status.get("pairGeneration") or 0)),
            meta_generation,
        )
        if changed:
            self.emit("Warning", "RestartBudgetExhausted", message)
            self.log.warning("pair %s/%s failed: %s", self.ref.namespace, self.ref.name, message)

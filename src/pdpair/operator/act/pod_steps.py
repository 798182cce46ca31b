"""The executor's part for the pair's pods: it deletes the pods a plan names (each once, though the pod index lags),
marks draining instances, and creates the plan's pod from its manifest (build/pods.py) after the pair's Secrets it
references. A pod the API server refuses for this spec (validation, admission, quota) is a `Rejection`: backed off,
told once (a PodRejected Event, the Ready or Progressing condition) and tried again at once after a spec change.
Separate from the reconciler's pass because it is the only code that writes pods. `PodSteps` is a part of
`reconciler.PairReconciler` (its state lives there) and decides nothing."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Mapping

from pdpair.contract import (
    ANNOTATION_DRAINING_SINCE,
    ANNOTATION_PEERS_DIGEST,
    COND_PROGRESSING,
    COND_READY,
    ROLE_DECODE,
    ROLE_PREFILL,
    ROLE_ROUTER,
)
from pdpair.operator.act.kube_api import api_status, call_dropped
from pdpair.operator.build.pods import POD_SECRETS, SECRET_PEERS, SECRET_SIDE_CHANNEL
from pdpair.operator.build.pods import ManifestError, engine_pod, pod_name, router_pod
from pdpair.operator.decide import recreate as d
from pdpair.operator.decide import surge
from pdpair.operator.decide import pushes
from pdpair.operator.model.conditions import FALSE, Condition
from pdpair.operator.model.observed import PodView
from pdpair.operator.model.pair_spec import spec_fingerprint


# The API server refused the object itself (validation, admission, quota): retrying the same manifest at once
# cannot succeed, so it is retried with backoff and reported, not hammered.
REJECTED_STATUSES = (400, 403, 422)
REJECTION_BACKOFF_FIRST = 2.0
REJECTION_BACKOFF_MAX = 300.0
# How long a pod this process created may stay missing from the pod index before a pass creates it again (the
# apiserver's 409 still guards that create). Normally the watch delivers it within milliseconds; 500 pairs on a
# loaded 2-core box saw 40 s, and a 30 s bound cost 585 refused creates there.
CREATED_UNSEEN_WAIT = 120.0


def api_reason(exc: BaseException) -> tuple[str, str]:
    """(reason, message) of an API error, as the API server's Status says them (the message names the field)."""
    body = getattr(exc, "body", None)
    try:
        status = json.loads(body) if body else {}
    except (TypeError, ValueError):
        status = {}
    if not isinstance(status, dict):
        status = {}
    reason = str(status.get("reason") or getattr(exc, "reason", "") or type(exc).__name__)
    message = str(status.get("message") or str(exc))
    return reason, message


@dataclass(frozen=True)
class Rejection:
    """The API server refused to create a role's pod for this spec; retried no sooner than `not_before`."""

    spec_hash: str
    attempts: int
    not_before: float  # time.monotonic()
    message: str


def _create_generation(plan: d.Plan) -> int:
    return plan.create_generation if plan.create_generation is not None else plan.pair_generation


def created_name(pair_name: str, plan: d.Plan) -> str:
    assert plan.create
    return pod_name(pair_name, plan.create, _create_generation(plan), plan.create_instance)


class PodSteps:
    """Mixed into PairReconciler: _act (deletes, drain marks, the create), the API server's refusals, the manifests."""

    async def _act(self, plan: d.Plan, pods: tuple[PodView, ...], meta_generation: int = 0) -> None:
        live = {p.uid for p in pods if not p.deleting}
        for uid in [u for u, at in self.deleted_unseen.items() if u not in live or time.monotonic() - at > CREATED_UNSEEN_WAIT]:
            del self.deleted_unseen[uid]
        for name in plan.force_delete:
            pod = next((p for p in pods if p.name == name), None)
            if pod is None or pod.uid in self.deleted_unseen:
                continue
            await self._delete_pod(name, pod.uid, grace_seconds=0)
            self.deleted_unseen[pod.uid] = time.monotonic()
            self.emit("Warning", "PodForceDeleted", f"force-deleted {pod.role} pod {name} on lost node {pod.node}: "
                      "its kubelet cannot confirm an end while the node is cut off; its ports stay fenced to it")
        for name in plan.delete:
            pod = next((p for p in pods if p.name == name), None)
            if pod is not None and pod.uid in self.deleted_unseen:
                continue  # deleted by an earlier pass; the index has not shown its deletionTimestamp yet
            await self._delete_pod(name, pod.uid if pod else None)
            if pod is not None and pod.uid:
                self.deleted_unseen[pod.uid] = time.monotonic()
            self.emit("Normal", "PodDeleted", f"deleted {pod.role if pod else 'pod'} {name} ({plan.step})")
        for name in plan.mark_draining:
            await self._patch_pod_annotations(name, {ANNOTATION_DRAINING_SINCE: f"{time.time():.3f}"})
            self.emit("Normal", "InstanceDraining", f"{name}: {plan.message}")
        seen = {p.name for p in pods}
        for name in [n for n, at in self.created_unseen.items() if n in seen or time.monotonic() - at > CREATED_UNSEEN_WAIT]:
            del self.created_unseen[name]
        if plan.create:
            await self._create(plan, pods, meta_generation)

    async def _create(self, plan: d.Plan, pods: tuple[PodView, ...], meta_generation: int) -> None:
        """Creates plan.create's pod, unless it was refused before for this spec (backoff) or an earlier pass
        created it and the watch has not shown it yet."""
        assert plan.create
        # The pod takes its keys from the pair's Secrets (pods.POD_SECRETS says which): they must exist first
        needs = POD_SECRETS.get(plan.create, ())
        if SECRET_PEERS in needs:
            await self._peers_token()
        if SECRET_SIDE_CHANNEL in needs:
            await self._side_channel_secret()
        rejection = self._rejection(plan)
        if rejection is not None and time.monotonic() < rejection.not_before:
            return  # refused before for this very spec: wait out the backoff
        if created_name(self.ref.name, plan) in self.created_unseen:
            return  # created by an earlier pass; its watch event (which wakes this pair) has not arrived yet
        manifest = self._manifest(plan, pods)
        name = manifest["metadata"]["name"]
        try:
            created = await self._create_pod(manifest)
        except Exception as exc:
            if api_status(exc) not in REJECTED_STATUSES:
                raise
            await self._rejected(plan, name, exc, meta_generation)
            return
        self.rejections.pop(plan.create, None)
        self.created_unseen[name] = time.monotonic()
        if created:
            what = plan.create if not plan.create_instance else f"{plan.create} instance {plan.create_instance}"
            self.emit("Normal", "PodCreated", f"created {what} {name} (generation {_create_generation(plan)})")

    def _rejection(self, plan: d.Plan) -> Rejection | None:
        """The standing refusal of the pod this plan creates, if the spec is still the one refused."""
        if not plan.create:
            return None
        rejection = self.rejections.get(plan.create)
        if rejection is None or rejection.spec_hash != spec_fingerprint(self.body["spec"]):
            return None
        return rejection

    def _rollout_rejection(self, spec: Mapping[str, Any]) -> str:
        """The API server's refusal of a pod of a Surge rollout's new generation (only those are created while
        one is Progressing), for the planner to roll the rollout back."""
        active = surge.active_rollout(self.status)
        if not active or active.get("phase") != surge.PHASE_PROGRESSING:
            return ""
        want = spec_fingerprint(spec)
        return next((r.message for r in self.rejections.values() if r.spec_hash == want), "")

    @staticmethod
    def _rejected_condition(rejection: Rejection, plan: d.Plan | None = None) -> Condition:
        if plan is not None and plan.create_slot:  # a Surge rollout's new pod: the serving generation stays Ready
            return Condition(COND_PROGRESSING, FALSE, "PodRejected", rejection.message[:32768])
        return Condition(COND_READY, FALSE, "PodRejected", rejection.message[:32768])

    async def _rejected(self, plan: d.Plan, name: str, exc: BaseException, meta_generation: int) -> None:
        reason, api_message = api_reason(exc)
        spec_hash = spec_fingerprint(self.body["spec"])
        previous = self._rejection(plan)
        attempts = previous.attempts + 1 if previous else 1
        delay = min(REJECTION_BACKOFF_MAX, REJECTION_BACKOFF_FIRST * 2 ** (attempts - 1))
        message = (f"the API server refused {plan.create} pod {name} ({api_status(exc)} {reason}): {api_message}; "
                   f"retrying in {delay:.0f}s, at once after a spec change")
        self.rejections[plan.create] = Rejection(spec_hash, attempts, time.monotonic() + delay, message)
        if previous is None or previous.message.split("; retrying")[0] != message.split("; retrying")[0]:
            self.emit("Warning", "PodRejected", message)
            self.log.warning("pair %s/%s: %s", self.ref.namespace, self.ref.name, message)
        await self._write_status({"message": message[:32768]},
                                 [self._rejected_condition(self.rejections[plan.create], plan)],
                                 meta_generation)

    def _manifest(self, plan: d.Plan, pods: tuple[PodView, ...]) -> dict[str, Any]:
        body = {"metadata": dict(self.body["metadata"]), "spec": self.body["spec"]}
        spec_hash = spec_fingerprint(self.body["spec"])
        generation = _create_generation(plan)
        ports = self.rollout_ports if plan.create_slot else self.ports  # a rollout's new generation: its port set
        assert ports is not None
        if plan.create == ROLE_DECODE:
            return engine_pod(body, ROLE_DECODE, generation, ports, spec_hash, instance=plan.create_instance)
        if plan.create == ROLE_PREFILL:
            decodes, digest = pushes.prefill_set(pods, generation, ports, tp=1)  # the env names host:base only
            manifest = engine_pod(body, ROLE_PREFILL, generation, ports, spec_hash, instance=plan.create_instance,
                                  peers=[(d.host, d.port_base) for d in decodes])
            # What it was told at creation: a push is due only once the set differs (pushes.py)
            manifest["metadata"]["annotations"][ANNOTATION_PEERS_DIGEST] = digest
            return manifest
        if plan.create == ROLE_ROUTER:
            # Started with one instance of each role (pushes.first_router_members: the lowest serving one, else
            # instance 0); the push adds the others once they are Ready, and none is due while the Ready set is
            # still these two (a 1P1D pair is never pushed).
            first = pushes.first_router_members(pods, generation)
            prefill, decode = first.get(ROLE_PREFILL), first.get(ROLE_DECODE)
            manifest = router_pod(body, generation, ports, spec_hash,
                                  [(prefill.instance, prefill.ip or "")] if prefill else "",
                                  [(decode.instance, decode.ip or "")] if decode else "",
                                  instance=plan.create_instance)
            _, digest = pushes.router_set([p for p in (prefill, decode) if p is not None], ports)
            manifest["metadata"]["annotations"][ANNOTATION_PEERS_DIGEST] = digest
            return manifest
        raise ManifestError(f"unknown role {plan.create!r}")

    async def _patch_pod_annotations(self, name: str, annotations: Mapping[str, str]) -> None:
        try:
            await asyncio.to_thread(call_dropped, self.rt.core.patch_namespaced_pod, name, self.ref.namespace,
                                    {"metadata": {"annotations": dict(annotations)}})
        except Exception as exc:
            if api_status(exc) != 404:  # gone: nothing to mark
                raise

    async def _create_pod(self, manifest: dict[str, Any]) -> bool:
        from kubernetes.client import V1Pod

        try:
            await asyncio.to_thread(
                call_dropped, self.rt.core.create_namespaced_pod, manifest["metadata"]["namespace"],
                V1Pod.from_dict(manifest),
            )
            return True
        except Exception as exc:
            if api_status(exc) == 409:  # made by an earlier pass; the index had not caught up
                return False
            raise

    async def _delete_pod(self, name: str, uid: str | None, grace_seconds: int | None = None) -> None:
        from kubernetes.client import V1DeleteOptions, V1Preconditions

        opts = V1DeleteOptions(preconditions=V1Preconditions(uid=uid) if uid else None,
                               grace_period_seconds=grace_seconds)
        try:
            await asyncio.to_thread(call_dropped, self.rt.core.delete_namespaced_pod, name, self.ref.namespace,
                                    body=opts)
        except Exception as exc:
            if api_status(exc) not in (404, 409):
                raise

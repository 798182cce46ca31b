"""The executor's part for the objects a pair owns beside its pods: the router Service, the PodDisruptionBudget, the
optional NetworkPolicy, and the pair's two Secrets (the push token, the side-channel key). Each is made or put back
to the operator's spec; a failure is told once (an Event) and retried next pass, never stopping the pods' steps.
What each object is comes from build/ (service.py, disruption.py, network_policy.py, pair_secrets.py, push.py's
token Secret); `PairObjects` is a part of `reconciler.PairReconciler` (its state lives there) and decides nothing."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Iterable, Mapping

from pdpair.operator.act import push
from pdpair.operator.act.kube_api import api_status, call_dropped, call_json
from pdpair.operator.build import disruption, network_policy, pair_secrets
from pdpair.operator.build.pods import peers_secret_name
from pdpair.operator.build.service import (
    ACTION_CREATE,
    ACTION_DELETE,
    ACTION_PATCH,
    ServiceView,
    kept_service_port,
    plan_service,
    router_service,
    service_name,
)
from pdpair.operator.decide import planner
from pdpair.operator.model.pair_spec import router_enabled

# A pair's NetworkPolicy, once made or found right, is read again after this many resync intervals (5 min by
# default): it is not watched, so this is how a deleted or edited one comes back.
NETWORK_POLICY_RECHECK_RESYNCS = 10


def _service_port(manifest: Mapping[str, Any]) -> int:
    return int(manifest["spec"]["ports"][0]["port"])


class PairObjects:
    """Mixed into PairReconciler: ensure_service, ensure_budget, ensure_network_policy and the two Secrets."""

    async def ensure_service(self, services: Iterable[ServiceView]) -> None:
        """The router Service (service.py): created, corrected or deleted to match spec.router.enabled and the
        router's leased port. A failure here is reported and retried next pass; it never stops the pods' steps."""
        body = {"metadata": self.body["metadata"], "spec": self.body["spec"]}
        # During a Surge rollout two routers exist: the Service selects the serving generation's. Its port stays
        # the one clients know (status.servicePort, kept from before the first Surge switch).
        name = service_name(self.ref.name)
        observed = next((s for s in services if s.name == name), None)
        desired = router_service(body, self.ports, planner.service_generation(self.status),
                                 kept_service_port(self.body["spec"], self.status, observed, self.ref.uid))
        if desired is None and router_enabled(self.body["spec"]):
            return  # the router port is not leased yet: leave whatever exists alone
        action = plan_service(desired, observed, self.ref.uid)
        try:
            if action == ACTION_CREATE:
                await self._create_service(desired)
            elif action == ACTION_PATCH:
                await asyncio.to_thread(
                    self.rt.core.patch_namespaced_service, name, self.ref.namespace,
                    [{"op": "test", "path": "/metadata/uid", "value": observed.uid},
                     {"op": "replace", "path": "/spec/selector", "value": desired["spec"]["selector"]},
                     {"op": "replace", "path": "/spec/ports", "value": desired["spec"]["ports"]}],
                    _content_type="application/json-patch+json",
                )
                self.emit("Normal", "ServiceUpdated", f"service {name}: port {_service_port(desired)}")
            elif action == ACTION_DELETE:
                await self._delete_service(name, observed.uid)
                self.emit("Normal", "ServiceDeleted", f"deleted service {name} (router disabled)")
        except Exception as exc:  # RBAC, a foreign Service of that name, apiserver down: reported, retried
            self._service_problem(f"service {name}: {type(exc).__name__}: {str(exc)[:500]}")
            return
        if desired is None:
            self.service = None
        elif action == ACTION_CREATE or (observed is not None and self.ref.uid in observed.owner_uids):
            self.service = name
            self.service_problem = ""

    async def _create_service(self, manifest: dict[str, Any]) -> None:
        from kubernetes.client import V1Service

        name = manifest["metadata"]["name"]
        try:
            await asyncio.to_thread(self.rt.core.create_namespaced_service, self.ref.namespace,
                                    V1Service.from_dict(manifest))
        except Exception as exc:
            if api_status(exc) != 409:
                raise
            # Made by an earlier pass (the watch had not caught up), or someone else's Service of that name.
            existing = await asyncio.to_thread(self.rt.core.read_namespaced_service, name, self.ref.namespace)
            owners = [o.uid for o in existing.metadata.owner_references or ()]
            if self.ref.uid not in owners:
                raise RuntimeError(
                    f"a Service named {name} exists and is not owned by this pair; the router Service cannot be "
                    f"created (delete or rename that Service)"
                ) from None
            return
        self.emit("Normal", "ServiceCreated", f"created service {name} (port {_service_port(manifest)})")

    async def _delete_service(self, name: str, uid: str) -> None:
        from kubernetes.client import V1DeleteOptions, V1Preconditions

        try:
            await asyncio.to_thread(self.rt.core.delete_namespaced_service, name, self.ref.namespace,
                                    body=V1DeleteOptions(preconditions=V1Preconditions(uid=uid)))
        except Exception as exc:
            if api_status(exc) not in (404, 409):
                raise

    def _service_problem(self, message: str) -> None:
        self.service = None
        if message != self.service_problem:
            self.emit("Warning", "ServiceError", message)
            self.log.warning("pair %s/%s: %s", self.ref.namespace, self.ref.name, message)
        self.service_problem = message

    async def ensure_budget(self, budgets: Iterable[tuple[str, tuple]]) -> None:
        """The pair's PodDisruptionBudget (disruption.py), made when the watch shows none and patched back to its spec
        when the watch shows another (one made by an older operator). A failure (RBAC of an older chart, a foreign
        object of that name) is reported once and retried next pass; it never stops the pods' steps."""
        if self.rt.policy is None:
            return
        existing = list(budgets)
        manifest = disruption.pair_budget(self.body)
        name = manifest["metadata"]["name"]
        try:
            if existing:
                patch = disruption.budget_outdated(existing[0][1], self.body)
                if patch is None:
                    return
                await asyncio.to_thread(self.rt.policy.patch_namespaced_pod_disruption_budget, existing[0][0],
                                        self.ref.namespace, patch)
                done = ("DisruptionBudgetUpdated", f"PodDisruptionBudget {existing[0][0]}: now {patch['spec']}")
            else:
                from kubernetes.client import V1PodDisruptionBudget

                await asyncio.to_thread(call_dropped, self.rt.policy.create_namespaced_pod_disruption_budget,
                                        self.ref.namespace, V1PodDisruptionBudget.from_dict(manifest))
                done = ("DisruptionBudgetCreated", f"created PodDisruptionBudget {name} (minAvailable "
                        f"{disruption.NO_READY_POD_EVICTED}: no Ready pod is evicted; a drain waits until the pair "
                        "has moved)")
        except Exception as exc:
            if api_status(exc) == 409:
                return  # made by an earlier pass the watch has not shown yet (or someone else's: it stays theirs)
            message = f"PodDisruptionBudget {name}: {type(exc).__name__}: {str(exc)[:500]}"
            if message != self.budget_problem:
                self.emit("Warning", "DisruptionBudgetError", message)
                self.log.warning("pair %s/%s: %s", self.ref.namespace, self.ref.name, message)
            self.budget_problem = message
            return
        self.budget_problem = ""
        self.emit("Normal", *done)

    async def ensure_network_policy(self) -> None:
        """The pair's NetworkPolicy (network_policy.py), with PDPAIR_NETWORK_POLICY and pods off the host network:
        read, made when missing, patched back to the operator's spec; one of another owner of that name is left
        alone. Like the budget, a failure is told once (Event NetworkPolicyError) and retried next pass; it never
        stops the pods' steps. Not watched (no index, no list/watch rights): at most one read per pair every
        NETWORK_POLICY_RECHECK_RESYNCS resyncs once it is right."""
        cfg = self.rt.config
        if not network_policy.wanted(self.body.get("spec") or {}, cfg.network_policy):
            return
        manifest = network_policy.pair_network_policy(self.body, cfg.namespace)
        digest = network_policy.spec_digest(manifest)
        now = time.monotonic()
        seen = self.network_policy_seen
        if seen and seen[0] == digest and now - seen[1] < cfg.resync_interval * NETWORK_POLICY_RECHECK_RESYNCS:
            return
        name = manifest["metadata"]["name"]
        where = (network_policy.GROUP, network_policy.VERSION, self.ref.namespace, network_policy.PLURAL)
        done: tuple[str, str] | None = None
        try:
            try:
                found = await asyncio.to_thread(call_json, self.rt.custom.get_namespaced_custom_object, *where, name)
            except Exception as exc:
                if api_status(exc) != 404:
                    raise
                found = None
            if found is None:
                await asyncio.to_thread(call_dropped, self.rt.custom.create_namespaced_custom_object, *where, manifest)
                done = ("NetworkPolicyCreated", f"created NetworkPolicy {name}: only the pair's own pods reach its "
                        f"engines; namespace {cfg.namespace} their metrics and side-channel ports")
            elif not network_policy.owned_by(found, self.ref.uid):
                raise LookupError(f"a NetworkPolicy {name} exists that this pair does not own: left as it is")
            elif network_policy.spec_digest(found) != digest:
                await asyncio.to_thread(call_dropped, self.rt.custom.patch_namespaced_custom_object, *where, name,
                                        {"spec": manifest["spec"]})
                done = ("NetworkPolicyUpdated", f"NetworkPolicy {name}: back to the operator's spec")
        except Exception as exc:
            if api_status(exc) == 409:
                return  # made since the read (an earlier pass's create): the next pass reads it
            message = f"NetworkPolicy {name}: {type(exc).__name__}: {str(exc)[:500]}"
            if message != self.network_policy_problem:
                self.emit("Warning", "NetworkPolicyError", message)
                self.log.warning("pair %s/%s: %s", self.ref.namespace, self.ref.name, message)
            self.network_policy_problem = message
            return
        self.network_policy_problem = ""
        self.network_policy_seen = (digest, now)
        if done:
            self.emit("Normal", *done)

    async def _peers_token(self) -> str:
        """The pair's push token (push.pair_token: derived from the operator's key and the pair's uid), with the
        pair's Secret made once so that its prefill and router pods can take it (409: it exists already)."""
        if self.peers_token is not None:
            return self.peers_token
        token = push.pair_token(self.rt.config.peers_key, self.ref.uid)
        manifest = push.token_secret({"metadata": dict(self.body["metadata"])}, peers_secret_name(self.ref.name),
                                     token)
        try:
            await asyncio.to_thread(self.rt.core.create_namespaced_secret, self.ref.namespace, manifest)
        except Exception as exc:
            if api_status(exc) != 409:
                raise
        self.peers_token = token
        return token

    async def _side_channel_secret(self) -> None:
        """The pair's side-channel Secret (pair_secrets: its key derived from the operator's key and the pair's uid),
        made once so that its prefill and decode pods can take the key (409: it exists already, e.g. made by this
        operator before a restart; never read back, the operator has no get on Secrets)."""
        if self.side_channel_made:
            return
        key = pair_secrets.side_channel_key(self.rt.config.peers_key, self.ref.uid)
        manifest = pair_secrets.side_channel_secret({"metadata": dict(self.body["metadata"])}, key)
        try:
            await asyncio.to_thread(self.rt.core.create_namespaced_secret, self.ref.namespace, manifest)
        except Exception as exc:
            if api_status(exc) != 409:
                raise
        self.side_channel_made = True

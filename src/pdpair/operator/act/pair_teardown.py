"""A deleted pair's cleanup (handlers.release_ports runs it on kopf's delete): delete the pair's pods in the order the
planner decides (planner.deletion_step: prefill and router before decode) and wait until none is left, at most
PDPAIR_POD_GONE_TIMEOUT after the deletion began; then stop listing the ports in status and release the leases. A
port is never leased again while a process may still hold it: the ports of a pod still there at the deadline (on a
lost node, say) are fenced to it, not released (the sweep frees each once its pod is gone: lease_sweep.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Callable, Mapping

from pdpair.contract import GROUP, LABEL_PAIR_UID, PLURAL, VERSION

from pdpair.operator.act.port_leaser import PairRef
from pdpair.operator.decide import planner
from pdpair.operator.model.observed import PodView
from pdpair.operator.model.timestamps import epoch

Emit = Callable[[str, str, str], None]
POD_GONE_POLL = 1.0


async def release(runtime: Any, body: Mapping[str, Any], uid: str, emit: Emit, logger: logging.Logger) -> None:
    """Tear the deleted pair down: its pods gone (or fenced to), its status no longer listing ports, its leases
    released, its metrics forgotten."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    left = await pods_gone(runtime, body, uid, emit, logger)
    if left:
        # A pod still there may still run, bound to its ports (a lost node's kubelet cannot stop it): those ports
        # are fenced to it, never released; the sweep frees each once its pod is gone.
        ref = PairRef(namespace, name, uid)
        fenced: list[int] = []
        for pod in left:
            fenced += [port for port in pod.ports
                       if await runtime.leaser.fence(ref, port, pod.node or "?", f"{namespace}/{pod.name}/{pod.uid}",
                                                     f"pod {pod.name} of deleted pair {namespace}/{name} still exists")]
        emit("Warning", "PortsFencedWithPodsLeft",
             (f"pods {', '.join(p.name for p in left)} were not gone {runtime.config.pod_gone_timeout:.0f}s after the "
              f"pair's deletion; their ports {sorted(fenced)} stay fenced to them until they are gone, the rest are "
              "released"))
    status = body.get("status") or {}
    if status.get("ports") or status.get("rollout"):
        # Stop listing the ports (a Surge rollout's second set too) before the leases go: no moment where two pairs
        # list one port.
        with contextlib.suppress(Exception):
            await asyncio.to_thread(runtime.custom.patch_namespaced_custom_object_status, GROUP, VERSION, namespace,
                                    PLURAL, name, {"status": {"ports": [], "rollout": None}})
    released = await runtime.leaser.release_pair(uid)
    if runtime.metrics is not None:
        runtime.metrics.forget_pair(namespace, name)
    emit("Normal", "PortsReleased", f"released {released} port leases")
    logger.info("released %d port leases", released)


async def pods_gone(runtime: Any, body: Mapping[str, Any], uid: str, emit: Emit,
                    logger: logging.Logger) -> list[PodView]:
    """Delete the pair's pods as planner.deletion_step says, each pass after listing them, until none is left or its
    deadline passed. Returns the pods still there at the deadline (name, uid, node and declared ports filled in)."""
    from kubernetes.client import V1DeleteOptions, V1Preconditions

    namespace = body["metadata"]["namespace"]
    began = epoch(body["metadata"].get("deletionTimestamp")) or time.time()
    told_slow = False
    while True:
        listed = await asyncio.to_thread(runtime.core.list_namespaced_pod, namespace,
                                         label_selector=f"{LABEL_PAIR_UID}={uid}")
        # The one reading of a pod (observed.PodView.from_pod) on the API's own JSON form of the listed V1Pods.
        serialize = runtime.core.api_client.sanitize_for_serialization
        pods = [PodView.from_pod(serialize(p)) for p in listed.items]
        step = planner.deletion_step(pods, began, time.time(), runtime.config.pod_gone_timeout, told_slow)
        uids = {p.name: p.uid for p in pods}
        for name in step.delete:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(
                    runtime.core.delete_namespaced_pod, name, namespace,
                    body=V1DeleteOptions(preconditions=V1Preconditions(uid=uids[name])),
                )
        if step.done:
            return list(step.left)
        if step.tell_slow:
            told_slow = True
            emit("Normal", "WaitingForPods", f"holding the port leases until pods {', '.join(p.name for p in pods)} "
                                             f"are gone (at most {step.seconds_left:.0f}s more)")
            logger.info("waiting for pods %s to be gone before releasing the ports", [p.name for p in pods])
        await asyncio.sleep(POD_GONE_POLL)

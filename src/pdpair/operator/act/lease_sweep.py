"""The port leases' background sweep (started with the operator, handlers.configure): every PDPAIR_SWEEP_INTERVAL it
releases the leases of pairs that no longer exist (`pair_alive` asks), ends quarantines whose TTL passed, frees the
fences of pods that are gone (`pod_exists` asks) and re-reads which ports are taken. What is an orphan, an expired
quarantine or a freed fence is port_leaser.PortLeaser's to decide from these answers; a failed round is logged and
the next one runs (the sweep never stops while the operator runs).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pdpair.contract import GROUP, PLURAL, VERSION

from pdpair.operator.act.kube_api import api_status
from pdpair.operator.model.observed import NodeView

log = logging.getLogger(__name__)


async def sweep_forever(runtime: Any) -> None:
    while True:
        try:
            released = await runtime.leaser.sweep_orphans(lambda ns, name, uid: pair_alive(runtime, ns, name, uid))
            if released:
                log.info("orphan sweep released %d leases", released)
            await runtime.leaser.sweep_quarantines()  # ports found busy on a node come back after their TTL
            await runtime.leaser.sweep_fences(lambda ns, name, uid: pod_exists(runtime, ns, name, uid),
                                              lambda node: node_still_lost(runtime, node))
            await runtime.leaser.refresh_taken()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("orphan sweep failed: %s", exc)
        await asyncio.sleep(runtime.config.sweep_interval)


async def pair_alive(runtime: Any, namespace: str, name: str, uid: str) -> bool:
    """A pair of that name and uid exists: its leases are not orphans."""
    if not (namespace and name and uid):
        return False
    if uid in runtime.wakeups:  # this operator runs the pair's reconcile daemon: it exists, with this uid
        return True  # (a GET for each of 1000 pairs every sweep interval was 17 GETs a second at rest)
    try:
        pair = await asyncio.to_thread(
            runtime.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name
        )
    except Exception as exc:
        if api_status(exc) == 404:
            return False
        raise
    return (pair.get("metadata") or {}).get("uid") == uid


async def pod_exists(runtime: Any, namespace: str, name: str, uid: str) -> bool:
    """A pod of that name and uid exists (deleting or not): its fenced ports stay fenced."""
    try:
        pod = await asyncio.to_thread(runtime.core.read_namespaced_pod, name, namespace)
    except Exception as exc:
        if api_status(exc) == 404:
            return False
        raise
    return pod.metadata.uid == uid


async def node_still_lost(runtime: Any, node: str) -> bool:
    """The node exists and is not back: not Ready, or still tainted unreachable (nodes.py's test without its wait:
    a fence stays until the kubelet that could still run the fenced pod's containers is back to end them). A
    deleted node runs nothing: False."""
    try:
        body = await asyncio.to_thread(runtime.core.read_node, node)
    except Exception as exc:
        if api_status(exc) == 404:
            return False
        raise
    view = NodeView.from_node(runtime.core.api_client.sanitize_for_serialization(body))
    return view.unreachable or view.ready != "True"

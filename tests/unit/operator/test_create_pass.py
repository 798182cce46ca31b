"""The executor's side of the parallel start (reconciler.reconcile_once against fake API objects): the pass that
creates decode creates prefill right after it, in the same pass (desired.Plan.then_create), and a decode the API
server refuses is not followed by its prefill.

Cost: well under a second; no cluster, no engine.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kubernetes.client.exceptions import ApiException

from pdpair.contract import (ENV_PEER_HOST, ENV_PEERS, ENV_PEERS_TOKEN, LABEL_ROLE, PHASE_DECODE_STARTING,
                             PHASE_PREFILL_STARTING, ROLE_DECODE, ROLE_PREFILL)
from pdpair.operator.config import OperatorConfig, PortPool
from pdpair.operator.desired import spec_fingerprint
from pdpair.operator.observed import PodView
from pdpair.operator.ports import PortLeaser
from pdpair.operator.reconciler import PairReconciler, Runtime
from tests.crd_defaults import with_crd_defaults
from tests.unit.operator.fake_leases import Leases
from tests.unit.operator.test_rollout_executor import Pair

NS, OPS, UID = "ns", "ops", "uid-p"
SPEC = with_crd_defaults({"metadata": {"name": "p"}, "spec": {"model": "m", "image": "img:1"}})["spec"]


class Core:
    """Pods are recorded in the order they were created (`refuse`: roles answered 422, as an admission webhook
    would); Secrets, Services and Events are accepted and forgotten."""

    def __init__(self, refuse: tuple[str, ...] = ()) -> None:
        self.created: list[Any] = []
        self.refuse = refuse

    def create_namespaced_pod(self, namespace, body):
        if body.metadata.labels.get(LABEL_ROLE) in self.refuse:
            raise ApiException(status=422, reason="Invalid")
        self.created.append(body)
        return body

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def one_pass(core: Core) -> tuple[Pair, PairReconciler]:
    pair = Pair({"metadata": {"name": "p", "namespace": NS, "uid": UID, "generation": 1, "resourceVersion": "1"},
                 "spec": SPEC, "status": {}})
    config = OperatorConfig(namespace=OPS, port_pool=PortPool(20000, 20099))
    rt = Runtime(config=config, core=core, custom=pair, leaser=PortLeaser(Leases(), OPS, config.port_pool))
    reconciler = PairReconciler(rt, pair.body, emit=lambda *event: None)
    asyncio.run(reconciler.reconcile_once(()))
    return pair, reconciler


def test_one_pass_leases_then_creates_decode_and_prefill_in_that_order():
    core = Core()
    pair, _ = one_pass(core)
    assert [pod.metadata.labels[LABEL_ROLE] for pod in core.created] == [ROLE_DECODE, ROLE_PREFILL]
    assert pair.body["status"]["phase"] == PHASE_DECODE_STARTING and pair.body["status"]["ports"]
    # prefill was made before decode had an address: it carries none, the push brings it (instances.prefill_peers)
    env = {e.name for c in core.created[1].spec.containers for e in c.env or []}
    assert ENV_PEERS_TOKEN in env and not env & {ENV_PEER_HOST, ENV_PEERS}


def test_a_refused_decode_is_not_followed_by_its_prefill():
    core = Core(refuse=(ROLE_DECODE,))
    pair, reconciler = one_pass(core)
    assert core.created == []
    assert "refused decode pod" in pair.body["status"]["message"]


def test_a_refused_prefill_leaves_decode_and_is_tried_in_a_pass_of_its_own():
    core = Core(refuse=(ROLE_PREFILL,))
    pair, reconciler = one_pass(core)
    assert [pod.metadata.labels[LABEL_ROLE] for pod in core.created] == [ROLE_DECODE]
    assert "refused prefill pod" in pair.body["status"]["message"]
    decode = core.created[0]
    seen = PodView(decode.metadata.name, ROLE_DECODE, 1, spec_fingerprint(SPEC), phase="Pending", ready=False,
                   scheduled=False, uid="uid-decode")
    asyncio.run(reconciler.reconcile_once((seen,)))  # within the refusal's backoff: nothing new is created
    assert len(core.created) == 1 and pair.body["status"]["phase"] == PHASE_PREFILL_STARTING
    assert "refused prefill pod" in pair.body["status"]["message"]

"""The executor plans from the pods it created before their watch events arrive (reconciler.created_views): the pass
after decode's create creates prefill, without waiting for the pod watch (which lagged ~15 s at 1000 pairs on the
2-core box), and nothing is created twice. Replayed against fake API objects; the index (the `pods` argument) shows
nothing until the test says so. Cost: no cluster; well under a second."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pdpair.contract import ROLE_DECODE, ROLE_PREFILL
from pdpair.operator.observed import PodView
from tests.unit.operator.test_rollout_executor import NS, SPEC, UID, Leases, Pair, reconciler


class Core:
    """Records each pod create and answers with its uid; the rest is accepted."""

    def __init__(self) -> None:
        self.created: list[dict] = []

    def create_namespaced_pod(self, namespace, pod):
        self.created.append(pod.to_dict())
        return SimpleNamespace(metadata=SimpleNamespace(uid=f"uid-{len(self.created)}"))

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_prefill_follows_decode_in_the_next_pass_without_the_watch_and_nothing_twice():
    leases = Leases()
    pair = Pair({"metadata": {"name": "p", "namespace": NS, "uid": UID, "generation": 1, "resourceVersion": "1"},
                 "spec": {**SPEC, "rolloutStrategy": "Recreate"}})
    r = reconciler(pair, leases)
    core = Core()
    r.rt.core = core

    delays = []
    for _ in range(6):  # the index shows no pod in any of these passes
        delays.append(asyncio.run(r.reconcile_once(())))
        if len(core.created) == 2 and delays[-1] > 0:
            break
    roles = [p["metadata"]["labels"]["pdpair.io/role"] for p in core.created]
    assert roles == [ROLE_DECODE, ROLE_PREFILL], roles
    assert delays[-1] > 0 and delays[-2] == 0.0, delays  # right after each create the pass comes back at once
    assert pair.body["status"]["pods"] == {ROLE_DECODE: "p-decode-g1", ROLE_PREFILL: "p-prefill-g1"}

    # the watch catches up: the index's views replace ours, and still nothing is created again
    shown = tuple(PodView.from_pod({**p, "metadata": {**p["metadata"], "uid": f"uid-{i + 1}"}})
                  for i, p in enumerate(core.created))
    asyncio.run(r.reconcile_once(shown))
    assert len(core.created) == 2 and r.created_views == {} and r.created_unseen == {}

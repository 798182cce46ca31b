"""A spec rollout under load on real nodes: Surge drops no request, Recreate is an outage.

Four clients inside node n1's network namespace send greedy completions through the pair's Service, one after the
other each, while the spec changes (a harmless engine argument is added to decode and prefill: same greedy
outputs). Every request is counted: a refused connection, an HTTP error or a timeout is a failure, and every
successful output must equal the single engine's (the session's baseline). Surge must fail none; Recreate's failures
are counted and reported for contrast (the Service has no router while the old generation is gone and the new one
starts).

Both run on the package's shared serving pair (serving_pair.py), Ready at whatever generation N the scenarios
before left it: the strategy and its knobs are patched first (they are not part of the pods' spec, so that alone
rolls nothing), then the engine argument, which rolls the pair to N + 1. Cost: one generation each (2 vLLM cold
starts; Surge runs the old and the new generation's engines side by side for a while). The last test deletes the
shared pair and checks that its pods go and its port leases are released.
"""
from __future__ import annotations

import json
import time

import pytest

from pdpair.contract import GROUP, LABEL_PAIR_UID, LABEL_PORT_LEASE, PLURAL
from devcluster.product import (
    ENGINE_ARGS, ENGINE_START_TIMEOUT, OPERATOR_NS, PROMPTS, completion,
)
from devcluster.waiting import wait_for
from tests.e2e_realnode.load import Load

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(2400)]

CLIENTS = 4  # each sends one greedy completion after the other (load.py)
DRAIN_SECONDS = 10  # the old generation serves this long after the switch: a request here (16 tokens) takes seconds

def _rollout_under_load(real_cluster, serving_pair, baseline_outputs, strategy, harmless_args):
    name, namespace = serving_pair.name, serving_pair.namespace
    g1 = int(serving_pair.ready()["pairGeneration"])
    g2 = g1 + 1
    patch = {"spec": {"rolloutStrategy": strategy,
                      "rollout": {"drainSeconds": DRAIN_SECONDS, "progressDeadlineSeconds": 1800}}}
    real_cluster.kubectl("patch", f"{PLURAL}.{GROUP}", name, "-n", namespace, "--type=merge", "-p", json.dumps(patch))
    spec = serving_pair.get()["spec"]

    def pair():
        return serving_pair.get() or {}

    def diagnose() -> str:
        return serving_pair.diagnose()

    svc = json.loads(real_cluster.kubectl("get", "service", name, "-n", namespace, "-o", "json").stdout)
    ip, port = svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["port"]
    assert completion(real_cluster, "n1", ip, port, PROMPTS[0]) == baseline_outputs[PROMPTS[0]]  # Service programmed

    load = Load(real_cluster, ip, port, CLIENTS)
    try:
        t_load = time.time()
        wait_for(lambda: load.ok_since(t_load) >= 2 * CLIENTS, 300, "requests served before the rollout",
                 diagnose=lambda: json.dumps(load.records[-5:]), interval=1.0)
        t_change = time.time()
        # The base args plus a scheduler bound: every strategy sets its own value, so each patch changes the spec.
        patch = {"spec": {role: {"args": ENGINE_ARGS + harmless_args} for role in ("prefill", "decode")}}
        assert spec["prefill"]["args"] != patch["spec"]["prefill"]["args"], "the patch would roll nothing"
        real_cluster.kubectl("patch", f"{PLURAL}.{GROUP}", name, "-n", namespace, "--type=merge", "-p",
                             json.dumps(patch))
        switched: list[float] = []

        def rolled_out() -> bool:
            status = pair().get("status", {})
            if not switched and status.get("pairGeneration") == g2 and status.get("phase") == "Ready":
                switched.append(time.time())  # Recreate: the new generation is Ready; Surge: the Service switched
            pods = list(serving_pair.pods().values())
            return bool(switched) and "rollout" not in status and bool(pods) and all(
                p["metadata"]["labels"]["pdpair.io/generation"] == str(g2) for p in pods)

        wait_for(rolled_out, 2 * ENGINE_START_TIMEOUT + 300, f"generation {g2} serving and generation {g1} gone",
                 diagnose=diagnose, interval=1.0)
        t_done = time.time()
        wait_for(lambda: load.ok_since(t_done) >= 2 * CLIENTS, 300, "requests served after the rollout",
                 diagnose=lambda: json.dumps(load.records[-5:]), interval=1.0)
    finally:
        records = load.stop()
    failed = [r for r in records if not r["ok"]]
    during = [r for r in records if t_change <= r["t"] <= t_done]
    wrong = [r for r in records if r["ok"] and r["text"] != baseline_outputs[r["prompt"]]]
    ok_times = sorted(r["t"] + r["dur"] for r in records if r["ok"])
    longest_gap = max((b - a for a, b in zip(ok_times, ok_times[1:])), default=0.0)
    status = pair()["status"]
    print(f"\n[realnode-rollout] {strategy}: {len(failed)} failed of {len(records)} requests "
          f"({len(during)} sent during the rollout), {len(wrong)} outputs differ from the baseline; "
          f"spec change -> generation {g2} serving {switched[0] - t_change:.1f}s, -> generation {g1} gone "
          f"{t_done - t_change:.1f}s; longest time without a completed request {longest_gap:.1f}s; "
          f"first failures (seconds after the spec change; the switch at {switched[0] - t_change:.1f}): "
          f"{[(round(r['t'] - t_change, 1), r['error']) for r in failed[:3]]}")
    return records, failed, wrong, status, g2


def test_surge_rollout_under_load_fails_no_request(real_cluster, baseline_outputs, serving_pair):
    records, failed, wrong, status, g2 = _rollout_under_load(real_cluster, serving_pair, baseline_outputs, "Surge",
                                                             ["--max-num-seqs", "32"])
    assert failed == [], failed[:5]
    assert wrong == [], wrong[:5]
    assert status["pairGeneration"] == g2 and status.get("servicePort")


def test_recreate_rollout_under_load_is_an_outage(real_cluster, baseline_outputs, serving_pair):
    records, failed, wrong, _, _ = _rollout_under_load(real_cluster, serving_pair, baseline_outputs, "Recreate",
                                                       ["--max-num-seqs", "24"])
    assert wrong == [], wrong[:5]
    assert failed, "Recreate deletes every old pod before the new generation starts: some request must fail"


def test_deleting_the_shared_pair_removes_its_pods_and_releases_its_leases(real_cluster, serving_pair):
    """The last scenario on the shared pair: deleted, its pods go and every port lease it held is released (the
    leases were checked against its spec and status.ports at its first start, test_realnode_faults e). Cost: none."""
    pair = serving_pair.get()
    assert pair is not None, "the shared pair is gone before its deletion scenario"
    uid = pair["metadata"]["uid"]

    def leases() -> list[dict]:
        return json.loads(real_cluster.kubectl("get", "leases.coordination.k8s.io", "-n", OPERATOR_NS, "-l",
                                               f"{LABEL_PORT_LEASE}=true,{LABEL_PAIR_UID}={uid}", "-o",
                                               "json").stdout)["items"]

    assert leases(), "the serving pair holds no port lease"
    serving_pair.delete()
    wait_for(lambda: not leases(), 120, "the pair's leases to be released",
             diagnose=lambda: json.dumps(leases())[-2000:], interval=1.0)

#!/usr/bin/env python3
"""The demo on real nodes (`bash hack/demo.sh`): two Kubernetes nodes (kubelet, containerd, runc, CNI, kube-proxy)
in network namespaces of their own, the operator installed with `helm install` from the image built here, an
InferencePair whose prefill (node n1) and decode (node n2) run vLLM from the engine image, a completion sent to
the pair's Service from inside the cluster network, then a single engine pod (no connector) of the same image and
model beside it, the same prompt to both, a timeline, and a full teardown.

No stand-in anywhere: decode's KV listener is the real connector's. The operator creates prefill right after decode
(it pushes decode's address to prefill once decode has one), so both engines load at once; prefill pairs once
decode's listener accepts, and the pair is Ready once the operator saw that listener (the timeline shows each step).
The single engine's apply-to-first-token is the yardstick of the pair's. Everything is built or reused from caches
first (devcluster/).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import threading
import time

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdpair.contract import GROUP, LABEL_PAIR, LABEL_ROLE, PLURAL, VERSION  # noqa: E402
from devcluster.images import engine_image, operator_image  # noqa: E402
from devcluster.build import build_node  # noqa: E402
from devcluster.realnode import RealNodeCluster  # noqa: E402
from devcluster.product import (  # noqa: E402
    ENGINE_START_TIMEOUT, OPERATOR_NS, RELEASE, baseline_pod, build_model, completion, install_operator, operator_logs,
    pair_manifest,
)

PAIR, NAMESPACE = "tiny-tcp", "default"
SINGLE = "single-engine"  # one plain engine pod (no connector), the yardstick
PROMPT = "Kubernetes runs pods;"


class Timeline:
    def __init__(self):
        self.started = time.monotonic()
        self.lock = threading.Lock()

    def say(self, text: str) -> None:
        with self.lock:
            print(f"[{time.monotonic() - self.started:6.1f}s] {text}", flush=True)


def watch_pair(custom, namespace: str, say, stop: threading.Event) -> None:
    from kubernetes import watch

    seen = None
    while not stop.is_set():
        try:
            for ev in watch.Watch().stream(custom.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
                                           field_selector=f"metadata.name={PAIR}", timeout_seconds=5):
                status = ev["object"].get("status") or {}
                now = (status.get("phase"), status.get("message"))
                if status.get("phase") and now != seen:
                    seen = now
                    say(f"pair phase {now[0]}: {now[1]}")
                if stop.is_set():
                    return
        except Exception:  # noqa: BLE001 - the stream ends when the pair or the cluster goes away
            time.sleep(0.2)


def watch_pods(core, namespace: str, say, stop: threading.Event) -> None:
    from kubernetes import watch

    state: dict[str, tuple] = {}
    while not stop.is_set():
        try:
            for ev in watch.Watch().stream(core.list_namespaced_pod, namespace, timeout_seconds=5):
                pod = ev["object"]
                labels = pod.metadata.labels or {}
                if labels.get(LABEL_PAIR) != PAIR and pod.metadata.name != SINGLE:
                    continue
                name, role = pod.metadata.name, labels.get(LABEL_ROLE, "single engine, no connector")
                ready = any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))
                now = (ev["type"], pod.status.phase, ready, pod.spec.node_name)
                if ev["type"] == "DELETED":
                    say(f"pod {name} ({role}) deleted")
                    state.pop(name, None)
                elif state.get(name) != now:
                    if name not in state:
                        say(f"pod {name} ({role}) created")
                    elif ready and not state[name][2]:
                        say(f"pod {name} ({role}) Ready on node {pod.spec.node_name} "
                                     f"({pod.status.pod_ip})")
                    state[name] = now
                if stop.is_set():
                    return
        except Exception:  # noqa: BLE001
            time.sleep(0.2)


def show_pair_and_single(cluster, engine_ref: str, model: pathlib.Path, say, timeout: float,
                         namespace: str = NAMESPACE) -> int:
    """The demo's part on a cluster where the operator runs: the pair applied and timed to its first answer through
    its Service, then one engine pod without a connector (same image, model and node) timed the same way, both
    answers printed and compared, both deleted. 0 when the answers are equal. Cost: 3 vLLM cold starts (the pair's
    two, then the single engine's). `tests/e2e_realnode/test_realnode_demo.py` runs it on the test session's
    cluster, so this code path is in CI."""
    from kubernetes import client

    api = cluster.api_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    stop = threading.Event()
    watchers = [threading.Thread(target=fn, args=(api_, namespace, say, stop), daemon=True)
                for fn, api_ in ((watch_pair, custom), (watch_pods, core))]
    for w in watchers:
        w.start()
    try:
        manifest = pair_manifest(PAIR, namespace, engine_ref, model, router_replicas=None)  # the product default
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
        applied = time.monotonic()
        say(f"kubectl apply: InferencePair {namespace}/{PAIR} (transport tcp; prefill on n1, decode on n2)")
        deadline = applied + timeout
        while True:
            pair = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, PAIR)
            if (pair.get("status") or {}).get("phase") == "Ready":
                break
            if time.monotonic() > deadline:
                say(f"not Ready after {timeout:.0f}s:\n" + cluster.kubectl("get", "pods", "-A", "-o", "wide").stdout
                    + operator_logs(cluster, tail=40))
                return 1
            time.sleep(0.5)
        svc = json.loads(cluster.kubectl("get", "service", PAIR, "-n", namespace, "-o", "json").stdout)
        ip, port = svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["port"]
        say(f"sending a completion to Service {PAIR} ({ip}:{port}) from inside node n1's network")
        answer = completion(cluster, "n1", ip, port, PROMPT)
        pair_seconds = time.monotonic() - applied
        say(f"pair: first answer {pair_seconds:.1f}s after kubectl apply: {answer!r}")
        say("(the tiny test model's weights are random, so its words are nonsense by design: what shows the KV "
            "moved right is that the pair answers exactly as one engine does, greedy, same model)")
        single = baseline_pod(SINGLE, namespace, engine_ref, model, "n1")
        cluster.kubectl("apply", "-f", "-", input=json.dumps(single))
        single_applied = time.monotonic()
        say(f"kubectl apply: Pod {namespace}/{SINGLE}, one engine without a connector, same image and model, n1")
        cluster.kubectl("wait", "-n", namespace, "--for=condition=Ready", f"pod/{SINGLE}",
                        f"--timeout={int(ENGINE_START_TIMEOUT)}s", timeout=ENGINE_START_TIMEOUT + 30)
        single_ip = json.loads(cluster.kubectl("get", "pod", SINGLE, "-n", namespace, "-o", "json").stdout
                               )["status"]["podIP"]
        single_answer = completion(cluster, "n1", single_ip, 8000, PROMPT)
        single_seconds = time.monotonic() - single_applied
        say(f"single engine: first answer {single_seconds:.1f}s after kubectl apply: {single_answer!r}")
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        say(f"the pair's answer {'EQUALS' if answer == single_answer else 'DIFFERS FROM'} the single engine's; "
            f"apply to first answer: pair {pair_seconds:.1f}s, single engine {single_seconds:.1f}s "
            f"(ratio {pair_seconds / single_seconds:.2f}; load average {load})")
        time.sleep(0.5)  # let the watchers print the last changes
        cluster.kubectl("delete", "pod", SINGLE, "-n", namespace, "--wait=true", "--timeout=60s", timeout=90)
        if answer != single_answer:
            return 1
        say("cleaning up: delete the pair")
        cluster.kubectl("delete", f"{PLURAL}.{GROUP}", PAIR, "-n", namespace, "--wait=true",
                        "--timeout=120s", timeout=150)
        return 0
    finally:
        stop.set()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for the pair's Ready phase")
    args = parser.parse_args()
    timeline = Timeline()
    say = timeline.say

    say("build or reuse: control plane, kubelet, kube-proxy, containerd, pause image (Go modules, cached)")
    build_node(log=lambda m: None)
    say("build or reuse: operator image (Dockerfile) and engine image (images/engine-base + images/engine), via buildah")
    operator, engine = operator_image(log=say), engine_image(log=say)
    say(f"images: {operator.ref}, {engine.ref}")
    with tempfile.TemporaryDirectory(prefix="pdpair-demo-model-") as tmp:
        model = build_model(pathlib.Path(tmp) / "tiny")
        say(f"tiny test model in {model} (reaches the pods through a hostPath volume in the pair's templates)")
        with RealNodeCluster(nodes=2, log=lambda m: None) as cluster:
            say(f"cluster up: 2 real nodes (n1 198.18.0.2, n2 198.18.0.3), phases {cluster.timings}")
            for image in (operator, engine):
                cluster.import_image(image.archive)
            say("images imported into both nodes' containerd")
            helm = install_operator(cluster, operator.ref)
            say(f"helm install {RELEASE} charts/pdpair: the operator runs as 2 pods in {OPERATOR_NS} (one leads, one stands by)")
            try:
                shown = show_pair_and_single(cluster, engine.ref, model, say, args.timeout)
            finally:
                say("helm uninstall, then stop the nodes and the control plane")
                helm("uninstall", RELEASE, "--namespace", OPERATOR_NS, "--wait", "--timeout", "120s")
                helm.close()
            if shown != 0:
                return shown
        left = cluster.leftovers()
        say(f"torn down; left on the host: {left or 'nothing'}")
        return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())

"""Faults on the real nodes: what a user's cluster does to a serving pair, with real vLLM pods.

- e. the leading operator pod is deleted while a pair starts (decode exists and no pod is Ready yet: prefill is made
  in the pass after decode, and the router as soon as both run (~1 s on a real node with the image there), so which
  of them exist at that moment is a race; no pod is Ready before the engines' cold starts): the standby replica
  takes the leader Lease over and converges with exactly one pod per role, no second set of port leases, and a
  serving pair.
- f. `helm upgrade` rolls the operator replicas while a client sends requests: no failed request, the pair's pods
  keep their UIDs with no container restart, the pair stays Ready, and the leader runs the new revision.
- c. decode's side-channel listener stops while its engine keeps running (the connector's stop-listener test knob:
  the loop leaves as a bug would; nothing a peer sends can stop it): within the hang timeout the operator names the
  cause (`listener_lost`, the decode pod, in an Unhealthy Event and the restart's reason, never Healthy) and
  restarts the pair IN ORDER (recorded by a pod watch: prefill deleted, then decode, new decode, the new prefill
  beside it, the router once both run, and the new decode's listener seen before Ready), and the pair serves again
  with the single engine's greedy outputs. A dead engine process on real pods is the TP = 2 worker kill
  (test_realnode_tp2.py) and xPyD's decode engine-core kill (test_realnode_xpyd.py).

All three run on the package's shared serving pair (serving_pair.py), in this order: e creates it (a first start is
its meaning, so it deletes any pair of that name first), f leaves it as it found it, c leaves it Ready one
generation later. The operator release is the session's (conftest `operator_release`); scenario f leaves it
upgraded, installed and serving.

Cost: e is the shared pair's first start (2 vLLM cold starts), f none, c one ordered restart (2 cold starts).
"""
from __future__ import annotations

import datetime
import json
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import pytest

from pdpair.contract import (
    LABEL_PAIR, LABEL_PAIR_UID, LABEL_PORT_LEASE, LABEL_PURPOSE, LABEL_ROLE, ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER,
)
from tests.port_blocks_support import spec_blocks
from devcluster.product import (
    CHART, OPERATOR_NS, PROMPTS, RELEASE, SERVED_NAME, completion, describe, leader_pod_name, list_pods,
    operator_logs, operator_pods, pod_logs, read_pair,
)
from devcluster.waiting import wait_for
from tests.e2e_realnode.serving_pair import READY_TIMEOUT, STOP_LISTENER_KNOB

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(2400)]

ROLES = (ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER)


# --- a pod watch ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PodEvent:
    t: float  # time.monotonic() when the watch saw it
    type: str  # ADDED | MODIFIED | DELETED
    name: str
    uid: str
    role: str
    generation: str
    phase: str
    ready: bool
    ip: str
    restarts: int
    deleting: bool

    def line(self, t0: float) -> str:
        return (f"{self.t - t0:7.1f}s {self.type:8} {self.name:28} phase={self.phase:9} ready={self.ready!s:5} "
                f"ip={self.ip or '-':12} restarts={self.restarts} deleting={self.deleting}")


class PodWatch:
    """Every watch event on one pair's pods, in a thread (kubernetes client, resumed by resourceVersion after each
    server-side timeout, so no event between two streams is lost). Only that pair's: another pair in the namespace
    (e.g. left by a failed test) must not show up in this one's record."""

    def __init__(self, cluster, namespace: str, pair: str):
        from kubernetes import client, config

        self.core = client.CoreV1Api(config.new_client_from_config(config_file=str(cluster.kubeconfig)))
        self.namespace = namespace
        self.selector = f"{LABEL_PAIR}={pair}"
        self.events: list[PodEvent] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        listing = self.core.list_namespaced_pod(namespace, label_selector=self.selector)
        self.initial = [p.metadata.name for p in listing.items]
        self._rv = listing.metadata.resource_version
        self._thread = threading.Thread(target=self._run, name=f"podwatch-{namespace}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kubernetes import watch

        try:
            while not self._stop.is_set():
                w = watch.Watch()
                for ev in w.stream(self.core.list_namespaced_pod, self.namespace, label_selector=self.selector,
                                   resource_version=self._rv, timeout_seconds=5, _request_timeout=30):
                    pod = ev["object"]
                    self._rv = pod.metadata.resource_version
                    self.events.append(_event(ev["type"], pod))
                    if self._stop.is_set():
                        w.stop()
        except BaseException as exc:  # reported by stop(): a watch that died would make the record incomplete
            self.error = exc

    def stop(self) -> list[PodEvent]:
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "pod watch thread did not stop"
        assert self.error is None, f"pod watch failed: {self.error!r}"
        return list(self.events)

    def since(self, t: float) -> list[PodEvent]:
        return [e for e in list(self.events) if e.t >= t]

    def first(self, t: float, pred) -> PodEvent | None:
        return next((e for e in self.since(t) if pred(e)), None)


def _event(kind: str, pod) -> PodEvent:
    labels = pod.metadata.labels or {}
    status = pod.status
    ready = any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))
    restarts = sum(cs.restart_count or 0 for cs in (status.container_statuses or []))
    return PodEvent(time.monotonic(), kind, pod.metadata.name, pod.metadata.uid, labels.get(LABEL_ROLE, ""),
                    labels.get("pdpair.io/generation", ""), status.phase or "", ready, status.pod_ip or "", restarts,
                    pod.metadata.deletion_timestamp is not None)


# --- helpers ------------------------------------------------------------------------------------------------
def _pair(cluster, ns: str, name: str) -> dict:
    pair = read_pair(cluster, ns, name)
    assert pair is not None, f"pair {ns}/{name} could not be read"  # kubectl get (check=True) raised here
    return pair


def _pods(cluster, ns: str, name: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in list_pods(cluster, ns, f"{LABEL_PAIR}={name}")}


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def _diagnose(cluster, ns: str, name: str, watch: PodWatch | None = None, t0: float = 0.0):
    def run() -> str:
        out = [describe(cluster, ns)]
        try:
            out.append(json.dumps(_pair(cluster, ns, name).get("status"), indent=1)[-3000:])
        except Exception as exc:  # the pair may be gone: the rest is still worth printing
            out.append(f"pair: {exc}")
        for pod in _pods(cluster, ns, name):
            out.append(f"--- {pod}:\n{pod_logs(cluster, ns, pod)}")
        out.append("--- operator:\n" + operator_logs(cluster, tail=80))
        if watch is not None:
            out.append("--- pod watch:\n" + "\n".join(e.line(t0) for e in list(watch.events)))
        return "\n".join(out)
    return run


def _wait_ready(cluster, ns: str, name: str, diagnose, *, generation: int | None = None,
                timeout: float = READY_TIMEOUT) -> dict:
    def ready():
        status = _pair(cluster, ns, name).get("status") or {}
        if status.get("phase") != "Ready":
            return None
        if generation is not None and int(status.get("pairGeneration") or 0) != generation:
            return None
        return status
    return wait_for(ready, timeout, f"pair {name} phase Ready" + (f" at generation {generation}" if generation else ""),
                    diagnose=diagnose, interval=1.0)


def _service(cluster, ns: str, name: str) -> tuple[str, int]:
    svc = json.loads(cluster.kubectl("get", "service", name, "-n", ns, "-o", "json").stdout)
    return svc["spec"]["clusterIP"], int(svc["spec"]["ports"][0]["port"])


def _assert_serves_like_baseline(cluster, ns: str, name: str, baseline_outputs, prompts=PROMPTS) -> None:
    ip, port = _service(cluster, ns, name)
    outputs = {p: completion(cluster, "n1", ip, port, p) for p in prompts}
    expected = {p: baseline_outputs[p] for p in prompts}
    assert outputs == expected, f"pair outputs differ from the single engine:\npair: {outputs}\nbaseline: {expected}"


def _leases(cluster, pair_uid: str) -> list[dict]:
    return json.loads(cluster.kubectl("get", "leases.coordination.k8s.io", "-n", OPERATOR_NS, "-l",
                                      f"{LABEL_PORT_LEASE}=true,{LABEL_PAIR_UID}={pair_uid}", "-o",
                                      "json").stdout)["items"]


# --- e. the operator pod deleted during a pair's startup --------------------------------------------------------
def test_operator_pod_deleted_during_pair_startup_converges_without_duplicates(
        real_cluster, baseline_outputs, serving_pair):
    """Cost: the shared pair's first start (2 vLLM cold starts); the pair stays for the scenarios after this one."""
    name, namespace = serving_pair.name, serving_pair.namespace
    serving_pair.delete()  # a first start is this scenario's meaning
    # The chart runs 2 replicas; the one that acts is the leader Lease's holder: delete that one.
    leader = wait_for(lambda: leader_pod_name(real_cluster), 120, "an operator leader", interval=1.0)
    [old_operator] = [p for p in operator_pods(real_cluster) if p["metadata"]["name"] == leader]
    watch = PodWatch(real_cluster, namespace, name)
    diagnose = _diagnose(real_cluster, namespace, name, watch, time.monotonic())
    t_apply = serving_pair.apply()
    decode_added = wait_for(lambda: watch.first(t_apply, lambda e: e.type == "ADDED" and e.role == ROLE_DECODE), 180,
                            "the decode pod", diagnose=diagnose, interval=1.0)
    real_cluster.kubectl("delete", "pod", "-n", OPERATOR_NS, old_operator["metadata"]["name"], "--wait=false")
    t_delete = time.monotonic()
    seen = [e for e in watch.since(t_apply) if e.t <= t_delete]
    before = sorted({e.role for e in seen})
    assert not [e for e in seen if e.ready], f"a pod was Ready before the operator was deleted: the test missed " \
                                             f"its window (pods seen by then: {before})"
    print(f"[faults] {name}: decode ADDED {decode_added.t - t_apply:.1f}s after apply; operator pod "
          f"{old_operator['metadata']['name']} deleted {t_delete - t_apply:.1f}s after apply, when these roles "
          f"had pods: {before}")

    def new_leader_ready():
        pods = operator_pods(real_cluster)
        gone = all(p["metadata"]["uid"] != old_operator["metadata"]["uid"] for p in pods)
        holder = leader_pod_name(real_cluster)
        fresh = [p for p in pods if p["metadata"]["name"] == holder and holder != leader and _ready(p)]
        return fresh[0] if fresh and gone else None
    new_operator = wait_for(new_leader_ready, 300, "another operator replica leading and the old one gone",
                            diagnose=diagnose, interval=1.0)
    print(f"[faults] {name}: operator {new_operator['metadata']['name']} leads and the old leader is gone "
          f"{time.monotonic() - t_delete:.1f}s after the delete")

    status = _wait_ready(real_cluster, namespace, name, diagnose)
    t_ready = time.monotonic()
    _assert_serves_like_baseline(real_cluster, namespace, name, baseline_outputs)
    events = watch.stop()
    timeline = "\n".join(e.line(t_apply) for e in events)
    print(f"[faults] {name}: apply -> Ready {t_ready - t_apply:.1f}s\n[faults] pod watch (seconds after apply):\n"
          f"{timeline}")

    # Exactly one pod per role was ever created, none deleted, no container restarted: no restart, no twin.
    added = sorted((e.role, e.name) for e in events if e.type == "ADDED")
    assert [r for r, _ in added] == sorted(ROLES), timeline
    assert not [e for e in events if e.type == "DELETED" or e.deleting or e.restarts], timeline
    assert int(status["pairGeneration"]) == 1 and int(status.get("restarts") or 0) == 0, status
    # One lease per required port, each listed once in status.ports.
    pair = _pair(real_cluster, namespace, name)
    leases = _leases(real_cluster, pair["metadata"]["uid"])
    lease_keys = sorted((l["metadata"]["labels"][LABEL_ROLE], l["metadata"]["labels"][LABEL_PURPOSE]) for l in leases)
    want = sorted(k for b in spec_blocks(pair["spec"]) for k in [(b.role, b.purpose)] * b.count)
    assert lease_keys == want, (lease_keys, want)
    assert sorted(int(l["metadata"]["name"].rsplit("-", 1)[1]) for l in leases) == \
        sorted(int(p["port"]) for p in status["ports"]), (leases, status["ports"])
    # The pair serves on for the next scenarios; test_realnode_rollout deletes it and checks that these leases go.


# --- f. helm upgrade of the operator while a pair serves ----------------------------------------------------
# Runs in node n1's network namespace: greedy completions through the Service, one after another, until stdin
# closes or `limit` seconds pass. One JSON line per request. A refused connection is a failure here (no retry).
_CLIENT_SNIPPET = r"""
import json, select, sys, time, urllib.request
url, model, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
prompts = json.loads(sys.argv[4])
end = time.monotonic() + limit
i = 0
while time.monotonic() < end:
    if select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.readline():
        break
    prompt = prompts[i % len(prompts)]
    i += 1
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}).encode()
    t = time.monotonic()
    try:
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = json.load(resp)["choices"][0]["text"]
        print(json.dumps({"prompt": prompt, "ok": True, "text": text, "seconds": time.monotonic() - t}), flush=True)
    except Exception as exc:
        print(json.dumps({"prompt": prompt, "ok": False, "error": repr(exc)[:300], "seconds": time.monotonic() - t}),
              flush=True)
        time.sleep(0.2)
"""


def test_helm_upgrade_of_the_operator_keeps_a_serving_pair_untouched(
        real_cluster, operator_release, baseline_outputs, serving_pair):
    """Cost: no vLLM cold start (the shared pair serves through the upgrade, unchanged)."""
    import subprocess

    name, namespace = serving_pair.name, serving_pair.namespace
    diagnose = _diagnose(real_cluster, namespace, name)
    before = serving_pair.ready()
    _assert_serves_like_baseline(real_cluster, namespace, name, baseline_outputs, PROMPTS[:1])
    pods_before = {n: (p["metadata"]["uid"], p["status"]["containerStatuses"][0]["restartCount"])
                   for n, p in _pods(real_cluster, namespace, name).items()}
    assert len(pods_before) == 3 and all(r == 0 for _, r in pods_before.values()), pods_before
    old_operators = {p["metadata"]["uid"] for p in operator_pods(real_cluster)}
    revision_before = _helm_revision(operator_release)

    ip, port = _service(real_cluster, namespace, name)
    kubelet = real_cluster.node("n1").pid("kubelet")
    client = subprocess.Popen(
        ["nsenter", "-t", str(kubelet), "-m", "-n", sys.executable, "-c", _CLIENT_SNIPPET,
         f"http://{ip}:{port}/v1/completions", SERVED_NAME, "420", json.dumps(PROMPTS)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results: list[dict] = []
    reader = threading.Thread(target=lambda: results.extend(json.loads(l) for l in client.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: len(results) >= 2, 120, "the client's first requests", diagnose=lambda: str(results),
                 interval=1.0)
        stamp = uuid.uuid4().hex[:12]
        t0 = time.monotonic()
        operator_release("upgrade", RELEASE, str(CHART), "--namespace", OPERATOR_NS, "--reuse-values",
                         "--set-string", f"operator.podAnnotations.pdpair\\.io/faults-upgrade={stamp}",
                         "--wait", "--timeout", "300s", timeout=360)
        t_upgraded = time.monotonic() - t0

        def new_operator():
            """Every replica is from the new revision and Ready, and one of them leads."""
            pods = operator_pods(real_cluster)
            fresh = [p for p in pods if (p["metadata"].get("annotations") or {}).get("pdpair.io/faults-upgrade") == stamp
                     and _ready(p) and not p["metadata"].get("deletionTimestamp")]
            holder = leader_pod_name(real_cluster)
            leading = [p for p in fresh if p["metadata"]["name"] == holder]
            return leading[0] if len(fresh) == len(pods) and leading else None
        operator = wait_for(new_operator, 300, "every operator replica Ready from the new revision, one leading",
                            diagnose=diagnose, interval=1.0)
        # The new operator has taken the pair over: its first reconcile pass logs the pair's step.
        wait_for(lambda: f"pair {namespace}/{name}: Ready" in real_cluster.kubectl(
            "logs", "-n", OPERATOR_NS, operator["metadata"]["name"], check=False).stdout, 120,
            "the new operator's first pass over the pair", diagnose=diagnose, interval=1.0)
        # Then two more health ticks' worth of traffic (the operator's default health interval is 10 s).
        n = len(results)
        t_taken = time.monotonic()
        wait_for(lambda: time.monotonic() - t_taken >= 25 and len(results) >= n + 3, 180,
                 "traffic after the takeover", diagnose=lambda: str(results[-5:]), interval=1.0)
    finally:
        client.stdin.close()
        try:
            client.wait(timeout=120)
        finally:
            if client.poll() is None:
                client.kill()
        reader.join(timeout=30)
    failed = [r for r in results if not r["ok"]]
    wrong = [r for r in results if r["ok"] and r["text"] != baseline_outputs[r["prompt"]]]
    print(f"[faults] {name}: helm upgrade --wait took {t_upgraded:.1f}s; {len(results)} requests during and after, "
          f"{len(failed)} failed, slowest {max(r['seconds'] for r in results):.2f}s")
    assert client.returncode == 0, client.stderr.read()
    assert not failed, failed
    assert not wrong, wrong
    assert len(results) >= 5, results

    assert _helm_revision(operator_release) == revision_before + 1
    assert operator["metadata"]["uid"] not in old_operators
    after = _pair(real_cluster, namespace, name)["status"]
    assert after["phase"] == "Ready" and after["pairGeneration"] == before["pairGeneration"], after
    assert int(after.get("restarts") or 0) == int(before.get("restarts") or 0), after
    pods_after = {n: (p["metadata"]["uid"], p["status"]["containerStatuses"][0]["restartCount"])
                  for n, p in _pods(real_cluster, namespace, name).items()}
    assert pods_after == pods_before, (pods_before, pods_after)


def _helm_revision(helm) -> int:
    return int(json.loads(helm("status", RELEASE, "--namespace", OPERATOR_NS, "-o", "json").stdout)["version"])


# --- c. decode's side-channel listener stopped -----------------------------------------------------------------
def test_a_stopped_decode_listener_is_named_and_the_pair_restarted_in_order_within_the_hang_timeout(
        real_cluster, baseline_outputs, serving_pair):
    """A served pair that lost its pairing is never reported Healthy, and is replaced within the hang timeout (the
    pair's connector.hangTimeoutSeconds, 30 s), not the startup timeout. Cost: one ordered restart of the shared pair
    (2 vLLM cold starts, about 3 min quiet)."""
    name, namespace = serving_pair.name, serving_pair.namespace
    status = serving_pair.ready()
    g1 = int(status["pairGeneration"])
    restarts_before = int(status.get("restarts") or 0)
    _assert_serves_like_baseline(real_cluster, namespace, name, baseline_outputs, PROMPTS[:1])

    pods = _pods(real_cluster, namespace, name)
    old = {p["metadata"]["labels"][LABEL_ROLE]: p for p in pods.values()}
    decode = old[ROLE_DECODE]["metadata"]["name"]

    watch = PodWatch(real_cluster, namespace, name)
    diagnose = _diagnose(real_cluster, namespace, name, watch, time.monotonic())
    t_kill = time.monotonic()
    real_cluster.kubectl("exec", "-n", namespace, decode, "-c", "engine", "--", "python", "-c",
                         f"open({STOP_LISTENER_KNOB!r}, 'w').close()")
    print(f"[faults] {name}: decode {decode}'s side-channel listener stopped (test knob {STOP_LISTENER_KNOB})")

    # Detection: the operator's first deletion of an old pod, within the hang timeout of the knob's file (the loop
    # sees it within 0.5 s; the health watch judges the pod's report on its next check).
    first_delete = wait_for(
        lambda: watch.first(t_kill, lambda e: e.deleting and e.generation == str(g1)), 240,
        "the operator to start deleting the old generation's pods", diagnose=diagnose, interval=1.0)
    hang_timeout = serving_pair.manifest()["spec"]["connector"]["hangTimeoutSeconds"]
    assert first_delete.t - t_kill <= hang_timeout, (first_delete.t - t_kill, hang_timeout)
    status = _wait_ready(real_cluster, namespace, name, diagnose, generation=g1 + 1)
    t_ready = time.monotonic()
    ip, port = _service(real_cluster, namespace, name)
    first = completion(real_cluster, "n1", ip, port, PROMPTS[0])
    t_token = time.monotonic()
    events = watch.stop()
    timeline = "\n".join(e.line(t_kill) for e in events)
    print(f"[faults] {name}: kill -> restart detected (first pod deletion) {first_delete.t - t_kill:.1f}s, "
          f"-> Ready again {t_ready - t_kill:.1f}s, -> first token again {t_token - t_kill:.1f}s\n"
          f"[faults] pod watch (seconds after the kill):\n{timeline}")

    assert first == baseline_outputs[PROMPTS[0]], (first, baseline_outputs[PROMPTS[0]])
    assert int(status.get("restarts") or 0) == restarts_before + 1, status
    assert "listener lost" in status.get("lastRestart", {}).get("reason", ""), status
    # The cause, named with the pod, in the pair's Events (status.health moved on to the new generation by now).
    unhealthy = _pair_events(real_cluster, namespace, name, "Unhealthy")
    assert any(ev["message"].startswith("listener_lost: ") and decode in ev["message"] for ev in unhealthy), unhealthy

    # The order, from the watch. Old generation: prefill (and the router) go before decode is touched.
    def t_of(pred) -> float:
        event = next((e for e in events if pred(e)), None)
        assert event is not None, f"no such event in the watch:\n{timeline}"
        return event.t

    old_gen, new_gen = str(g1), str(g1 + 1)
    prefill_gone = t_of(lambda e: e.type == "DELETED" and e.role == ROLE_PREFILL and e.generation == old_gen)
    router_gone = t_of(lambda e: e.type == "DELETED" and e.role == ROLE_ROUTER and e.generation == old_gen)
    # The old decode's engine still runs (only its listener stopped): the operator deletes it only after the front
    # pods are gone.
    decode_delete = t_of(lambda e: e.role == ROLE_DECODE and e.generation == old_gen and e.deleting)
    decode_gone = t_of(lambda e: e.type == "DELETED" and e.role == ROLE_DECODE and e.generation == old_gen)
    decode_added = t_of(lambda e: e.type == "ADDED" and e.role == ROLE_DECODE and e.generation == new_gen)
    decode_running = t_of(lambda e: e.role == ROLE_DECODE and e.generation == new_gen and e.phase == "Running"
                          and e.ip)
    prefill_added = t_of(lambda e: e.type == "ADDED" and e.role == ROLE_PREFILL and e.generation == new_gen)
    router_added = t_of(lambda e: e.type == "ADDED" and e.role == ROLE_ROUTER and e.generation == new_gen)
    # New generation: decode, then prefill beside it (before decode runs, as a rule: the push gives it decode's
    # address), the router once both run.
    assert max(prefill_gone, router_gone) <= decode_delete <= decode_gone <= decode_added <= prefill_added \
        <= router_added and decode_running <= router_added, timeline
    # No in-place restart of any container anywhere: every replacement went through the ordered path.
    assert not [e for e in events if e.restarts], timeline
    ended = [e.phase for e in events if e.role == ROLE_DECODE and e.generation == old_gen]
    print(f"[faults] {name}: old decode's phases after the kill: {sorted(set(ended))}")
    # One pod per role in the new generation.
    added = [e.role for e in events if e.type == "ADDED" and e.generation == new_gen]
    assert sorted(added) == sorted(ROLES), timeline
    # The listener: the operator saw the new decode accept (its DecodeListening Event) before the pair was Ready
    # again (prefill starts beside decode and pairs when the listener accepts; the router starts beside them, and
    # the pair is Ready only after the operator's own probe).
    new_decode = next(e.name for e in events if e.type == "ADDED" and e.role == ROLE_DECODE and e.generation == new_gen)
    listening = _pair_events(real_cluster, namespace, name, "DecodeListening")
    assert any(new_decode in ev["message"] for ev in listening), listening
    ready_condition = next(c for c in status["conditions"] if c["type"] == "Ready")
    # Event times may carry microseconds, condition times have whole seconds: compare whole seconds.
    listened_at = max(_seconds(ev["time"]) for ev in listening if new_decode in ev["message"])
    assert ready_condition["status"] == "True" and listened_at <= _seconds(ready_condition["lastTransitionTime"]), (
        listening, ready_condition)

    _assert_serves_like_baseline(real_cluster, namespace, name, baseline_outputs)


def _seconds(rfc3339: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).replace(microsecond=0)


def _pair_events(cluster, ns: str, name: str, reason: str) -> list[dict]:
    items = json.loads(cluster.kubectl("get", "events", "-n", ns, "--field-selector",
                                       f"involvedObject.name={name},reason={reason}", "-o", "json").stdout)["items"]
    return [{"message": e.get("message", ""),
             "time": e.get("eventTime") or e.get("firstTimestamp") or e["metadata"]["creationTimestamp"]}
            for e in items]

"""xPyD on real nodes: one InferencePair with 2 prefill and 2 decode instances (docs/xpyd.md), vLLM in every pod.

A pair of its own (the shared serving pair is deleted by test_realnode_rollout, before this module runs): prefill
instances 0 and 1 on node n1, decode instances 0 and 1 and the router on node n2 (pair_manifest pins each role to one
node), `spec.router.debugRouting` on, so the router honours `X-Pdpair-Route: <prefill index>,<decode index>` and logs
each choice, and `spec.rollout.drainSeconds` 5. The tests share it, in file order:

  1. apply -> Ready with P 2/2 and D 2/2 (the parallel start: all four engines load at once); every (prefill,
     decode) combination, forced by the header, answers every prompt like the single engine (the session's
     baseline), and the router's log shows the forced pair was the one used;
  2. decode instance 1 slowed by the connector's test knob (a file in its pod): under a steady unforced load it
     receives at most half the requests decode 0 does (the router's least-outstanding choice);
  3. decode instance 0's engine core SIGKILLed (its pod fails) under the steady load and a client forced to
     (0, 1): the pair stays Ready at its generation, decode 0 alone is replaced (instances.heal: a new uid, an
     InstanceReplacing Event, no pair restart), D comes back to 2/2 and the router takes (0, 0) again; requests fail
     only while routed to the killed instance (counted and printed); the forced (0, 1) client fails none;
  4. `kubectl scale inferencepairrole/<pair>-decode` 2 -> 1 under a steady load that never retries (load.py), the
     removed decode holding requests when it is marked draining: no request fails, every output is the baseline's,
     its pod goes, D 1/1 (the scale-up under load is test 5's burst);
  5. a HorizontalPodAutoscaler on the decode role object, fed by vllm:num_requests_waiting through the in-cluster
     Prometheus and prometheus-adapter (the custom metrics API), with the ratio band [1, 1], from P 2/2 D 1/1:
     idle -> P 1/1 D 1/1, a burst of never-retrying clients on slowed decodes -> P 2/2 D 2/2 (both new engines
     start under load), the burst stops -> P 1/1 D 1/1, no request failed (the decodes run at most
     DECODE_MAX_NUM_SEQS requests at once, so a burst queues);
  6. the pair deleted: its pods, role objects and port leases go.

Cost: 7 vLLM cold starts (4 at the start, loading at once; 1 for the replaced decode; 2 for the HPA's scale-up, at
once), about 6.5 minutes of the real-node stage on a 2-core machine (measured: apply -> P 2/2 D 2/2 49-78 s, the 16
forced completions 8-18 s, delete -> re-created decode Ready 81 s, scale-down 7 s under load; the HPA test about 3
minutes with the HPA controller's upstream 15 s sync period (5 s in this cluster: realnode.HPA_SYNC_SECONDS):
Prometheus and the adapter 5 s once their images are in n1, burst -> HPA desired 2 16 s -> P 2/2 D 2/2 72 s, stop ->
1/1 within the window; the pair's deletion 3 s).
"""
from __future__ import annotations

import datetime
import json
import re
import time

import pytest
import yaml

from pdpair.contract import (
    ANNOTATION_DRAINING_SINCE, API_VERSION, ENV_TEST_SLOW_DECODE_FILE, GROUP, LABEL_INSTANCE, LABEL_PAIR,
    LABEL_PAIR_UID, LABEL_PORT_LEASE, LABEL_ROLE, PLURAL, ROLE_OBJECT_KIND, ROLE_OBJECT_PLURAL, VERSION,
)
from devcluster.incluster_prometheus import PROMETHEUS_PORT, InClusterPrometheus, prometheus_image
from devcluster.prometheus_adapter import PrometheusAdapter, adapter_config_from_chart, prometheus_adapter_image
from devcluster.product import (
    ENGINE_ARGS, ENGINE_START_TIMEOUT, OPERATOR_NS, PROMPTS, completion, container_processes, describe,
    engine_core_pid, list_pods, operator_logs, pair_manifest, read_pair,
)
from devcluster.realnode import HPA_SYNC_SECONDS, ClusterError
from devcluster.waiting import wait_for
from tests.e2e_realnode.load import Load

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(2400)]

NAME = "xp"
DRAIN_SECONDS = 5
CLIENTS = 3  # the steady unforced load (load.py): decode 1 holds some of it at any time
ROUTE = "X-Pdpair-Route"
# The decodes' slow-step knob (connector, test-only): while this file exists in a decode pod, each of its engine steps
# sleeps the milliseconds it holds. Set on every decode, written in one only.
SLOW_DECODE_KNOB = "/tmp/pdpair-slow-decode"
SLOW_DECODE_MS = 150
# The router's --log-choices line (router/app.py _log_choice).
CHOICE = re.compile(r"request (\S+): prefill (\d+) \S+, decode (\d+) \S+( \(forced by X-Pdpair-Route\))?;")
# Apply -> Ready with every instance: the four engines load at once (prefills beside the decodes).
START_TIMEOUT = ENGINE_START_TIMEOUT + 120
# The HPA test. Each decode runs at most DECODE_MAX_NUM_SEQS requests at once (vLLM's
# --max-num-seqs), so requests beyond that wait in its queue: with the slow-step knob on, HPA_CLIENTS clients keep
# vllm:num_requests_waiting well above HPA_TARGET_WAITING per decode on one decode and above it on two.
DECODE_MAX_NUM_SEQS = 2
HPA_CLIENTS = 8
HPA_TARGET_WAITING = "1"  # the HPA's Pods metric target: average vllm:num_requests_waiting per decode instance
HPA_SCALE_DOWN_WINDOW = 15  # behavior.scaleDown.stabilizationWindowSeconds: 300 by default, shortened for the test
HPA_SYNC = HPA_SYNC_SECONDS  # kube-controller-manager's --horizontal-pod-autoscaler-sync-period in this cluster
WAITING = "vllm:num_requests_waiting"
PROMETHEUS_SETS = ("monitoring.podMonitor.interval=1s", "monitoring.podMonitor.scrapeTimeout=1s",
                   "monitoring.podMonitor.engineMetrics=true")


class XPair:
    """The module's 2P2D pair: reading its status, pods, router log; forced completions through its Service."""

    def __init__(self, cluster, namespace: str):
        self.cluster, self.namespace, self.name = cluster, namespace, NAME

    def get(self) -> dict:
        return read_pair(self.cluster, self.namespace, self.name) or {}

    def status(self) -> dict:
        return self.get().get("status") or {}

    def pods(self) -> dict[str, dict]:
        return {p["metadata"]["name"]: p for p in list_pods(self.cluster, self.namespace, f"{LABEL_PAIR}={self.name}")}

    def engine(self, role: str, instance: int) -> dict | None:
        """The live (not deleting) pod of that role's instance, of any generation."""
        for pod in self.pods().values():
            labels = pod["metadata"]["labels"]
            if (labels.get(LABEL_ROLE) == role and int(labels.get(LABEL_INSTANCE, "0")) == instance
                    and not pod["metadata"].get("deletionTimestamp")):
                return pod
        return None

    def router_pod(self) -> str:
        return next(n for n, p in self.pods().items() if p["metadata"]["labels"].get(LABEL_ROLE) == "router"
                    and not p["metadata"].get("deletionTimestamp"))

    def service(self) -> tuple[str, int]:
        svc = json.loads(self.cluster.kubectl("get", "service", self.name, "-n", self.namespace, "-o", "json").stdout)
        return svc["spec"]["clusterIP"], int(svc["spec"]["ports"][0]["port"])

    def counts(self) -> tuple[str, str, str]:
        status = self.status()
        return (status.get("phase", ""), (status.get("prefill") or {}).get("readyOfDesired", ""),
                (status.get("decode") or {}).get("readyOfDesired", ""))

    def choices(self) -> dict[str, tuple[int, int, bool]]:
        """Request id -> (prefill index, decode index, forced) from the router's log (--log-choices)."""
        log = self.cluster.kubectl("logs", "-n", self.namespace, self.router_pod(), "--tail=-1", check=False).stdout
        return {m.group(1): (int(m.group(2)), int(m.group(3)), bool(m.group(4))) for m in CHOICE.finditer(log)}

    def routed(self, p: int, d: int, prompt: str, rid: str = "") -> str:
        headers = {ROUTE: f"{p},{d}", **({"X-Request-Id": rid} if rid else {})}
        ip, port = self.service()
        return completion(self.cluster, "n1", ip, port, prompt, headers=headers)

    def wait_routable(self, p: int, d: int, timeout: float = 120) -> float:
        """Until the router accepts the forced route (p, d): it answers 400 for an index it was not pushed yet."""
        t0 = time.monotonic()
        errors: list[str] = []

        def accepted() -> bool:
            try:
                self.routed(p, d, PROMPTS[0])
                return True
            except ClusterError as exc:
                errors.append(str(exc)[-300:])
                return False

        wait_for(accepted, timeout, f"the router to accept the forced route ({p}, {d})",
                 diagnose=lambda: f"{errors[-1:]}\n{self.diagnose()}", interval=1.0)
        return time.monotonic() - t0

    def watch(self, t0: float, pod: str) -> tuple[str, str, str]:
        """The pair's phase and counts, recording every change of them and of `pod`'s state (phase, deleting, the
        engine container's exit) with its time after `t0` in self.trace: a restart shows its cause here."""
        status = self.status()
        counts = (status.get("phase", ""), (status.get("prefill") or {}).get("readyOfDesired", ""),
                  (status.get("decode") or {}).get("readyOfDesired", ""))
        raw = self.pods().get(pod)
        state = "gone"
        if raw is not None:
            term = [c["state"]["terminated"] for c in raw["status"].get("containerStatuses", [])
                    if "terminated" in (c.get("state") or {})]
            state = (f"{raw['metadata']['uid'][:8]} {raw['status'].get('phase')}"
                     f"{' deleting' if raw['metadata'].get('deletionTimestamp') else ''}"
                     f"{' exit ' + ','.join(str(t.get('exitCode')) for t in term) if term else ''}")
        entry = f"{' '.join(counts)} (restarts {status.get('restarts', 0)}); {pod}: {state}"
        trace = self.__dict__.setdefault("trace", [])
        if not trace or trace[-1][1] != entry:
            trace.append((time.time() - t0, entry))
        return counts

    def evidence(self, t0: float) -> str:
        """What a restart leaves: the trace, status message and conditions, the namespace's events, the operator."""
        status = self.status()
        conds = [(c.get("type"), c.get("status"), c.get("reason"), (c.get("message") or "")[:200])
                 for c in status.get("conditions", [])]
        events = self.cluster.kubectl("get", "events", "-n", self.namespace, "--sort-by=.lastTimestamp",
                                      check=False).stdout[-4000:]
        ops = [line for line in operator_logs(self.cluster, tail=400).splitlines() if f"/{self.name}" in line
               or f" {self.name}" in line or "restart" in line.lower()]
        trace = "\n".join(f"  +{t:.1f}s {e}" for t, e in self.__dict__.get("trace", []) if t >= -1)
        return (f"trace (seconds after the action):\n{trace}\nstatus.message: {status.get('message')}\n"
                f"conditions: {conds}\nevents:\n{events}\noperator (pair lines):\n" + "\n".join(ops[-60:]))

    def diagnose(self) -> str:
        status = {k: v for k, v in self.status().items() if k != "ports"}
        return "\n".join([describe(self.cluster, self.namespace), json.dumps(status, indent=1)[-4000:],
                          "--- operator:\n" + operator_logs(self.cluster, tail=80)])


def _epoch(rfc3339: str) -> float:
    return datetime.datetime.strptime(rfc3339, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc).timestamp()


def _ready_after(pod: dict, t0: float) -> str:
    """Seconds from `t0` (epoch) to the pod's creation and to its Ready transition (the API's 1 s resolution)."""
    ready = next((c["lastTransitionTime"] for c in pod["status"].get("conditions", [])
                  if c["type"] == "Ready" and c["status"] == "True"), None)
    created = _epoch(pod["metadata"]["creationTimestamp"]) - t0
    return f"created +{created:.0f}s, Ready +{_epoch(ready) - t0:.0f}s" if ready else f"created +{created:.0f}s"


def _summary(records: list[dict], baseline_outputs) -> tuple[list[dict], list[dict]]:
    failed = [r for r in records if not r["ok"]]
    wrong = [r for r in records if r["ok"] and r["text"] != baseline_outputs[r["prompt"]]]
    return failed, wrong


@pytest.fixture(scope="module")
def xpair(real_cluster, operator_release, images, model_dir, namespace):
    manifest = pair_manifest(NAME, namespace, images["engine"].ref, model_dir, prefill_node="n1", decode_node="n2",
                             decode_env=[{"name": ENV_TEST_SLOW_DECODE_FILE, "value": SLOW_DECODE_KNOB}])
    manifest["spec"]["prefill"]["replicas"] = 2
    manifest["spec"]["decode"]["replicas"] = 2
    manifest["spec"]["decode"]["args"] = ENGINE_ARGS + ["--max-num-seqs", str(DECODE_MAX_NUM_SEQS)]
    manifest["spec"]["router"]["debugRouting"] = True
    manifest["spec"]["rollout"] = {"drainSeconds": DRAIN_SECONDS}
    pair = XPair(real_cluster, namespace)
    pair.t_apply = time.monotonic()
    real_cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(manifest))
    yield pair
    real_cluster.kubectl("delete", f"{PLURAL}.{GROUP}", NAME, "-n", namespace, "--ignore-not-found", "--wait=true",
                         "--timeout=120s", check=False, timeout=150)


def test_2p2d_pair_starts_and_every_prefill_decode_combination_serves_like_a_single_engine(
        real_cluster, baseline_outputs, xpair):
    t_apply = xpair.t_apply
    marks: dict[str, float] = {}

    def ready() -> bool:
        phase, p, d = xpair.counts()
        if phase == "Ready" and "ready" not in marks:
            marks["ready"] = time.monotonic() - t_apply
        return phase == "Ready" and p == "2/2" and d == "2/2"

    wait_for(ready, START_TIMEOUT, "the 2P2D pair Ready with P 2/2 and D 2/2", diagnose=xpair.diagnose, interval=1.0)
    t_all = time.monotonic() - t_apply
    pods = xpair.pods()
    created = _epoch(xpair.get()["metadata"]["creationTimestamp"])
    print(f"\n[realnode-xpyd] apply -> phase Ready {marks['ready']:.1f}s, -> P 2/2 D 2/2 {t_all:.1f}s; pods: "
          + "; ".join(f"{n} on {p['spec'].get('nodeName')}: {_ready_after(p, created)}"
                      for n, p in sorted(pods.items())) + " (after the pair's creation)")
    engines = {n for n, p in pods.items() if p["metadata"]["labels"].get(LABEL_ROLE) in ("prefill", "decode")}
    gen = xpair.status()["pairGeneration"]
    assert engines == {f"{NAME}-{r}-g{gen}{s}" for r in ("prefill", "decode") for s in ("", "-1")}, sorted(engines)
    assert {pods[n]["spec"]["nodeName"] for n in engines} == {"n1", "n2"}

    # The router starts with instance 0 of each role and is pushed the others: wait until it takes (1, 1).
    t_route = xpair.wait_routable(1, 1)
    print(f"[realnode-xpyd] P 2/2 D 2/2 -> the router accepts the forced route (1, 1) {t_route:.1f}s")
    t0 = time.monotonic()
    rids = {}
    for p in (0, 1):
        for d in (0, 1):
            for k, prompt in enumerate(PROMPTS):
                rid = f"xpyd-p{p}-d{d}-{k}-{time.monotonic_ns()}"
                rids[rid] = (p, d)
                out = xpair.routed(p, d, prompt, rid)
                assert out == baseline_outputs[prompt], (p, d, prompt, out, baseline_outputs[prompt])
    print(f"[realnode-xpyd] {len(rids)} forced completions (4 combinations x {len(PROMPTS)} prompts) equal the "
          f"baseline in {time.monotonic() - t0:.1f}s")
    choices = xpair.choices()
    for rid, (p, d) in rids.items():
        assert choices.get(rid) == (p, d, True), (rid, choices.get(rid))


def test_a_slowed_decode_receives_fewer_requests(real_cluster, baseline_outputs, xpair):
    """the router picks the decode with the fewest requests in flight, so a decode slowed by the
    test knob (SLOW_DECODE_MS per engine step, written in decode 1's pod only) holds each request longer and is
    chosen measurably less under a steady unforced load. Cost: no cold start, about 40 s."""
    ns = xpair.namespace
    wait_for(lambda: xpair.counts() == ("Ready", "2/2", "2/2"), START_TIMEOUT, "the pair Ready 2/2 2/2",
             diagnose=xpair.diagnose, interval=1.0)
    slow = xpair.engine("decode", 1)["metadata"]["name"]

    def knob(*argv: str) -> None:
        real_cluster.kubectl("exec", "-n", ns, slow, "-c", "engine", "--", "python", "-c", *argv)

    knob(f"open({SLOW_DECODE_KNOB!r}, 'w').write('{SLOW_DECODE_MS}')")
    ip, port = xpair.service()
    load = Load(real_cluster, ip, port, CLIENTS + 1)
    try:
        t0 = time.time()
        wait_for(lambda: load.ok_since(t0) >= 40, 300, "40 requests served with decode 1 slowed",
                 diagnose=lambda: json.dumps(load.records[-5:]), interval=0.5)
    finally:
        records = load.stop()
        knob(f"import os; os.remove({SLOW_DECODE_KNOB!r})")
    failed, wrong = _summary(records, baseline_outputs)
    choices = xpair.choices()
    per_decode = [sum(1 for r in records if r["ok"] and choices.get(r["rid"], (None, None))[1] == d) for d in (0, 1)]
    slow_s = [r["dur"] for r in records if r["ok"] and choices.get(r["rid"], (None, None))[1] == 1]
    fast_s = [r["dur"] for r in records if r["ok"] and choices.get(r["rid"], (None, None))[1] == 0]
    print(f"[realnode-xpyd] decode 1 slowed by {SLOW_DECODE_MS} ms per step: requests per decode {per_decode} of "
          f"{len(records)} ({len(failed)} failed); median latency decode 0 "
          f"{sorted(fast_s)[len(fast_s) // 2] if fast_s else 0:.2f}s, decode 1 "
          f"{sorted(slow_s)[len(slow_s) // 2] if slow_s else 0:.2f}s")
    assert failed == [] and wrong == [], (failed[:3], wrong[:3])
    # Measured margin: the slowed decode's requests take several times longer, so least-outstanding sends it a
    # small share; half of the fast one's count leaves room for a loaded box.
    assert per_decode[1] * 2 <= per_decode[0], per_decode


def test_killed_decode_instance_0_is_replaced_alone_while_the_pair_serves(real_cluster, baseline_outputs, xpair):
    """("one decode killed: only its edges fail, the rest keep serving, it is replaced in order"):
    decode instance 0's engine core SIGKILLed in its container (its pod fails: restartPolicy Never) under the steady
    load and a client forced to (prefill 0, decode 1), an edge of the prefill that also pushed to the dead decode.
    Cost: 1 vLLM cold start (the replacement), about 1.5 min."""
    ns = xpair.namespace
    wait_for(lambda: xpair.counts() == ("Ready", "2/2", "2/2"), START_TIMEOUT, "the pair Ready 2/2 2/2",
             diagnose=xpair.diagnose, interval=1.0)
    before = xpair.status()
    victim = xpair.engine("decode", 0)
    pod1, uid1 = victim["metadata"]["name"], victim["metadata"]["uid"]
    ip, port = xpair.service()
    load = Load(real_cluster, ip, port, CLIENTS)
    forced = Load(real_cluster, ip, port, 1, headers={ROUTE: "0,1"})
    phases: set[str] = set()
    try:
        t_load = time.time()
        wait_for(lambda: load.ok_since(t_load) >= 2 * CLIENTS and forced.ok_since(t_load) >= 2, 300,
                 "requests served before the kill", diagnose=lambda: json.dumps(load.records[-5:]), interval=0.5)
        t_kill = time.time()
        pid = engine_core_pid(container_processes(real_cluster, ns, pod1))
        # The image has no kill(1) (python:slim): os.kill from inside the container, as the engine's own user.
        real_cluster.kubectl("exec", "-n", ns, pod1, "-c", "engine", "--", "python", "-c",
                             f"import os, signal; os.kill({pid}, signal.SIGKILL)")
        marks: dict[str, float] = {}

        xpair.trace = []

        def back() -> bool:
            phase, _, d = xpair.watch(t_kill, pod1)
            phases.add(phase)
            pod = xpair.engine("decode", 0)
            if pod is not None and pod["metadata"]["uid"] != uid1 and "created" not in marks:
                marks["created"] = time.time()
            if d != "2/2" and "dropped" not in marks:
                marks["dropped"] = time.time()
            return bool(pod is not None and pod["metadata"]["uid"] != uid1 and d == "2/2")

        wait_for(back, START_TIMEOUT, f"{pod1} re-created and D 2/2", diagnose=lambda: xpair.evidence(t_kill),
                 interval=0.5)
        t_back = time.time()
        t_route = xpair.wait_routable(0, 0)
        wait_for(lambda: load.ok_since(t_back) >= 2 * CLIENTS and forced.ok_since(t_back) >= 2, 300,
                 "requests served after the re-creation", diagnose=lambda: json.dumps(load.records[-5:]),
                 interval=0.5)
    finally:
        records = load.stop()
        forced_records = forced.stop()
    after = xpair.status()
    failed, wrong = _summary(records, baseline_outputs)
    forced_failed, forced_wrong = _summary(forced_records, baseline_outputs)
    choices = xpair.choices()
    not_on_d0 = [r for r in failed if choices.get(r["rid"], (None, None))[1] != 0]
    print(f"[realnode-xpyd] decode 0 killed under load: {len(failed)} failed of {len(records)} unforced requests "
          f"({len(not_on_d0)} not routed to decode 0), forced (0, 1): {len(forced_failed)} failed of "
          f"{len(forced_records)}; {len(wrong) + len(forced_wrong)} outputs differ; phases seen {sorted(phases)}; "
          f"kill -> D below 2/2 {marks.get('dropped', t_kill) - t_kill:.1f}s, -> new {pod1} created "
          f"{marks.get('created', t_back) - t_kill:.1f}s, -> D 2/2 {t_back - t_kill:.1f}s "
          f"(+{t_route:.1f}s until the router takes (0, 0)); failures (seconds after the kill, decode chosen, "
          f"error): {[(round(r['t'] - t_kill, 1), choices.get(r['rid']), r['error'][:200]) for r in failed[:8]]}")
    if phases != {"Ready"}:
        print(f"[realnode-xpyd] the pair left Ready after the kill: {sorted(phases)}\n{xpair.evidence(t_kill)}")
    assert phases == {"Ready"}, phases
    assert after.get("pairGeneration") == before.get("pairGeneration"), (before.get("pairGeneration"),
                                                                        after.get("pairGeneration"))
    assert int(after.get("restarts") or 0) == int(before.get("restarts") or 0)
    assert forced_failed == [], forced_failed[:5]
    assert not_on_d0 == [], not_on_d0[:5]
    events = real_cluster.kubectl("get", "events", "-n", ns, "--field-selector", "reason=InstanceReplacing",
                                  "-o", "json").stdout
    assert pod1 in events, "no InstanceReplacing Event names the killed decode"
    assert wrong == [] and forced_wrong == [], (wrong[:3], forced_wrong[:3])


def test_decode_scale_down_under_load_fails_no_request(real_cluster, baseline_outputs, xpair):
    """`kubectl scale` of the decode role object 2 -> 1 under the steady load (load.py: a failed request is counted,
    never retried): decode 1 is marked draining (as a rule while it holds requests: the count is printed), no request
    fails, every output is the baseline's, its pod goes, D 1/1. The pair stays at D 1/1 for the HPA test; the
    scale-up under never-retrying clients is that test's burst (2 cold starts, no request failed). Cost: no cold
    start, under a minute."""
    ns, name = xpair.namespace, xpair.name
    wait_for(lambda: xpair.counts() == ("Ready", "2/2", "2/2"), START_TIMEOUT, "the pair Ready 2/2 2/2",
             diagnose=xpair.diagnose, interval=1.0)
    decode1 = xpair.engine("decode", 1)
    assert decode1 is not None
    pod1 = decode1["metadata"]["name"]
    ip, port = xpair.service()
    load = Load(real_cluster, ip, port, CLIENTS)
    phases: set[str] = set()
    seen: dict = {}
    try:
        t_load = time.time()
        wait_for(lambda: load.ok_since(t_load) >= 2 * CLIENTS, 300, "requests served before the scale-down",
                 diagnose=lambda: json.dumps(load.records[-5:]), interval=0.5)
        # Scale down while decode 1 holds requests: the router's outstanding counts balance the clients across both
        # decodes, so one of the three is almost always on decode 1; wait for a moment when it is.
        t_down = time.time()
        real_cluster.kubectl("scale", f"{ROLE_OBJECT_PLURAL}.{GROUP}/{name}-decode", "--replicas=1", "-n", ns)

        def marked() -> float | None:
            pod = xpair.pods().get(pod1)
            value = ((pod or {}).get("metadata", {}).get("annotations") or {}).get(ANNOTATION_DRAINING_SINCE)
            return float(value) if value else None

        t_marked = wait_for(marked, 60, f"{pod1} marked draining", diagnose=xpair.diagnose, interval=0.2)

        def watched(counts):
            phases.add(counts[0])
            return counts

        wait_for(lambda: watched(xpair.watch(t_down, pod1))[2] == "1/1" and pod1 not in xpair.pods(),
                 120 + DRAIN_SECONDS, f"D 1/1 and {pod1} gone", diagnose=lambda: xpair.evidence(t_down),
                 interval=0.5)
        t_gone = time.time()
        seen = xpair.choices()  # the router's choices so far (a restart would replace the router and its log)
        for _ in range(10):  # a restart the deletion caused shows within a few passes
            watched(xpair.watch(t_down, pod1))
            time.sleep(0.5)
        wait_for(lambda: load.ok_since(t_gone) >= 2 * CLIENTS, 300, "requests served after the scale-down",
                 diagnose=lambda: json.dumps(load.records[-5:]), interval=0.5)
    finally:
        records = load.stop()
    failed, wrong = _summary(records, baseline_outputs)
    choices = {**seen, **xpair.choices()}
    on_d1 = [r for r in records if choices.get(r["rid"], (None, None))[1] == 1]
    in_flight = [r for r in on_d1 if r["t"] < t_marked < r["t"] + r["dur"]]
    # Chosen after the mark: the router is pushed the set without decode 1 in the pass that marks it or the next
    # one; a choice after the pod is gone would have failed.
    after_mark = [r["t"] - t_marked for r in on_d1 if t_marked < r["t"]]
    after_gone = [r for r in on_d1 if t_gone < r["t"]]
    print(f"[realnode-xpyd] scale-down under load: {len(failed)} failed of {len(records)} requests, {len(wrong)} "
          f"outputs differ; {len(in_flight)} request(s) in flight on {pod1} when it was marked draining, "
          f"{len(after_mark)} sent to decode 1 after the mark (the last {max(after_mark, default=0):.2f}s after it), "
          f"{len(after_gone)} after it was gone; kubectl scale "
          f"-> marked draining {t_marked - t_down:.1f}s, -> D 1/1 and {pod1} gone {t_gone - t_down:.1f}s")
    if phases != {"Ready"}:
        print(f"[realnode-xpyd] the pair left Ready during the scale-down: {sorted(phases)}\n"
              f"{xpair.evidence(t_down)}")
    print(f"[realnode-xpyd] failures (seconds after kubectl scale, error): "
          f"{[(round(r['t'] - t_down, 1), r['error'][:200]) for r in failed[:8]]}")
    assert phases == {"Ready"}, sorted(phases)
    assert failed == [], failed[:5]
    assert wrong == [], wrong[:5]
    assert after_gone == [], after_gone[:5]
    if not in_flight:
        print("[realnode-xpyd] note: no request was in flight on decode 1 at the mark (timing), the drain held none")


def _quantity(value: str) -> float:
    """A resource.Quantity as the custom metrics API writes it ("3", "1500m")."""
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


@pytest.fixture(scope="module")
def custom_metrics(real_cluster, namespace, images):
    """The in-cluster Prometheus (the chart's PodMonitor with engineMetrics, 1 s scrapes) and prometheus-adapter
    with the chart's rules, both in the module's namespace on n1: the custom metrics API the HPA controller reads."""
    prom_image, adapter_image = prometheus_image(), prometheus_adapter_image()
    for archive in (prom_image.archive, adapter_image.archive):
        real_cluster.import_image(archive, nodes=["n1"])
    prom = InClusterPrometheus(real_cluster, namespace, prom_image.ref, images["operator"].ref, PROMETHEUS_SETS,
                               node="n1")
    prom.deploy()
    adapter = PrometheusAdapter(real_cluster, namespace, adapter_image.ref, f"http://{prom.pod_ip}:{PROMETHEUS_PORT}/",
                                adapter_config_from_chart(), node="n1")
    try:
        adapter.deploy()
        yield adapter
    finally:
        adapter.delete()
        prom.delete()


class ScaleTimeline:
    """What the test reads while the HPA works, one line per change: the decodes' vllm:num_requests_waiting as the
    HPA reads it (the custom metrics API, selected by the decode role object's /scale selector), the HPA's current
    and desired replicas, both role objects' counts, the pair's phase and P/D counts."""

    def __init__(self, cluster, pair: "XPair", adapter: PrometheusAdapter, hpa: str):
        self.cluster, self.pair, self.adapter, self.hpa = cluster, pair, adapter, hpa
        self.t0 = time.time()
        self.lines: list[tuple[float, str]] = []
        self.phases: set[str] = set()
        self.peak = 0.0  # the highest per-decode value read

    def waiting(self) -> dict[str, float]:
        """{decode pod: vllm:num_requests_waiting}, or {} while the adapter has no series for them."""
        selector = f"{LABEL_PAIR}={self.pair.name},{LABEL_ROLE}=decode"
        try:
            items = self.adapter.pods_metric(self.pair.namespace, WAITING, label_selector=selector)["items"]
        except ClusterError:
            return {}
        return {i["describedObject"]["name"]: _quantity(i["value"]) for i in items}

    def sample(self) -> dict:
        # Once a second for minutes, beside the engines the HPA starts: through the pooled ApiClient, not kubectl
        # processes (devcluster/product.py, read_pair).
        from kubernetes import client

        api = self.cluster.api_client()
        try:
            hpa = json.loads(client.AutoscalingV2Api(api).read_namespaced_horizontal_pod_autoscaler(
                self.hpa, self.pair.namespace, _preload_content=False, _request_timeout=60).data).get("status") or {}
        except client.ApiException:  # not created yet, or gone: as `kubectl get hpa` with check=False
            hpa = {}
        roles = json.loads(client.CustomObjectsApi(api).list_namespaced_custom_object(
            GROUP, VERSION, self.pair.namespace, ROLE_OBJECT_PLURAL, _preload_content=False,
            _request_timeout=60).data)["items"]
        counts = self.pair.counts()
        self.phases.add(counts[0])
        state = {"waiting": self.waiting(), "hpa": (hpa.get("currentReplicas"), hpa.get("desiredReplicas")),
                 "roles": {o["spec"]["role"]: o["spec"]["replicas"] for o in roles}, "pair": counts}
        self.peak = max([self.peak, *state["waiting"].values()])
        line = (f"waiting {json.dumps(state['waiting'], sort_keys=True)}; HPA current/desired {state['hpa'][0]}/{state['hpa'][1]}; role objects {state['roles']}; pair "
                f"{' '.join(counts)}")
        if not self.lines or self.lines[-1][1] != line:
            self.lines.append((time.time() - self.t0, line))
        return state

    def text(self) -> str:
        return "\n".join(f"  +{t:6.1f}s {line}" for t, line in self.lines)


def test_an_hpa_on_decode_follows_queue_depth_and_the_ratio_band_moves_prefill(
        real_cluster, baseline_outputs, xpair, custom_metrics):
    """a HorizontalPodAutoscaler (kube-controller-manager's) on the decode role object, min 1,
    max 2, Pods metric vllm:num_requests_waiting (average HPA_TARGET_WAITING per decode) read from the engines by the
    in-cluster Prometheus through prometheus-adapter and the aggregation layer; `spec.scaling.ratio {min: 1, max: 1}`
    (prefill follows decode). It starts from what the scale-down test leaves: P 2/2, D 1/1, the decode role object's
    replicas 1 written by `kubectl scale`. A trickle client runs throughout, so every scale-down drains instances that
    serve:
      1. idle: the band moves prefill 2 -> 1, the HPA takes over the decode role object and keeps it at its minimum 1;
      2. HPA_CLIENTS more clients with the decodes slowed (the knob): waiting rises above the target, the HPA scales
         decode to 2, the band moves prefill to 2, both new engines start: the module's scale-up under load, its
         clients never retrying (load.py: a failed request is counted);
      3. those clients stop: after the stabilization window the HPA scales decode back to 1 and prefill follows.
    No request fails, every output equals the single engine's, the pair stays Ready at its generation, a RatioBand
    Event for each move. Cost: 2 vLLM cold starts (the new decode and prefill, at once), about 3.5 minutes."""
    ns, name = xpair.namespace, xpair.name

    def left_by_the_scale_down() -> bool:  # D 1/1 and the drained decode's pod gone
        engines = [p for p in xpair.pods().values() if p["metadata"]["labels"].get(LABEL_ROLE) in ("prefill", "decode")]
        return xpair.counts() == ("Ready", "2/2", "1/1") and len(engines) == 3

    wait_for(left_by_the_scale_down, START_TIMEOUT, "the pair Ready P 2/2 D 1/1, 3 engine pods",
             diagnose=xpair.diagnose, interval=1.0)
    before = xpair.status()
    ip, port = xpair.service()
    trickle = Load(real_cluster, ip, port, 1)
    burst = None
    slowed: list[str] = []
    marks: dict[str, float] = {}
    hpa_name = f"{name}-decode"
    timeline = ScaleTimeline(real_cluster, xpair, custom_metrics, hpa_name)
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": hpa_name, "namespace": ns},
           "spec": {"scaleTargetRef": {"apiVersion": API_VERSION, "kind": ROLE_OBJECT_KIND, "name": f"{name}-decode"},
                    "minReplicas": 1, "maxReplicas": 2,
                    "metrics": [{"type": "Pods", "pods": {"metric": {"name": WAITING}, "target": {
                        "type": "AverageValue", "averageValue": HPA_TARGET_WAITING}}}],
                    "behavior": {"scaleDown": {"stabilizationWindowSeconds": HPA_SCALE_DOWN_WINDOW},
                                 "scaleUp": {"stabilizationWindowSeconds": 0}}}}

    def knob(pod: str, write: bool) -> None:
        code = (f"open({SLOW_DECODE_KNOB!r}, 'w').write('{SLOW_DECODE_MS}')" if write else
                f"import os; os.path.exists({SLOW_DECODE_KNOB!r}) and os.remove({SLOW_DECODE_KNOB!r})")
        # Writing must work; removing is best effort (the pod may be gone by then).
        real_cluster.kubectl("exec", "-n", ns, pod, "-c", "engine", "--", "python", "-c", code, check=write)

    def at(counts: tuple[str, str, str], hpa_desired: int):
        def check() -> bool:
            state = timeline.sample()
            return state["pair"] == counts and state["hpa"][1] == hpa_desired
        return check

    try:
        # The band [1, 1] with decode at 1: prefill 2 -> 1, drained under the trickle client (sampled, so the
        # timeline and the phases seen include it).
        real_cluster.kubectl("patch", f"{PLURAL}.{GROUP}", name, "-n", ns, "--type=merge",
                             "-p", json.dumps({"spec": {"scaling": {"ratio": {"min": 1, "max": 1}}}}))
        wait_for(lambda: len(timeline.sample()["waiting"]) == 1, 120,
                 f"the custom metrics API to serve {WAITING} of the decode", diagnose=custom_metrics.diagnose,
                 interval=2.0)
        real_cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(hpa))
        timeline.t0 = t_hpa = time.time()
        # 1. Idle (one trickle client): the HPA keeps decode at its minimum (desired 1: it read the metric), the band
        # has taken prefill to 1.
        wait_for(at(("Ready", "1/1", "1/1"), 1), 3 * HPA_SYNC + 120, "decode and prefill scaled to 1 by the HPA and "
                 "the band", diagnose=lambda: f"{timeline.text()}\n{xpair.diagnose()}", interval=1.0)
        marks["down1"] = time.time() - t_hpa
        # 2. The load: decode 0 slowed, HPA_CLIENTS more clients.
        decode0 = xpair.engine("decode", 0)["metadata"]["name"]
        knob(decode0, True)
        slowed.append(decode0)
        t_burst = time.time()
        burst = Load(real_cluster, ip, port, HPA_CLIENTS)

        def scaled_up() -> bool:
            state = timeline.sample()
            decode1 = xpair.engine("decode", 1)
            if decode1 is not None and decode1["metadata"]["name"] not in slowed and any(
                    (c.get("state") or {}).get("running") for c in decode1["status"].get("containerStatuses", [])):
                knob(decode1["metadata"]["name"], True)  # so that two decodes still queue: the HPA keeps 2
                slowed.append(decode1["metadata"]["name"])
            if state["hpa"][1] == 2 and "hpa_up" not in marks:
                marks["hpa_up"] = time.time() - t_burst
            return state["pair"] == ("Ready", "2/2", "2/2")

        wait_for(scaled_up, 3 * HPA_SYNC + START_TIMEOUT, "decode and prefill scaled to 2 under the load",
                 diagnose=lambda: f"{timeline.text()}\n{xpair.diagnose()}", interval=1.0)
        marks["up"] = time.time() - t_burst
        t_up = time.time()
        wait_for(lambda: burst.ok_since(t_up) >= HPA_CLIENTS, 300, "requests served with 2 decodes",
                 diagnose=lambda: json.dumps(burst.records[-5:]), interval=1.0)
        timeline.sample()
        # 3. The load stops: after the stabilization window the HPA scales decode back to 1, prefill follows.
        t_stop = time.time()  # the clients are told to stop; their requests in flight still finish
        burst_records = burst.stop()
        burst = None
        for pod in slowed:
            knob(pod, False)
        wait_for(at(("Ready", "1/1", "1/1"), 1), HPA_SCALE_DOWN_WINDOW + 3 * HPA_SYNC + 120,
                 "decode and prefill back to 1 after the load", diagnose=lambda: f"{timeline.text()}\n"
                 f"{xpair.diagnose()}", interval=1.0)
        marks["down2"] = time.time() - t_stop
        wait_for(lambda: len([p for p in xpair.pods().values()
                              if p["metadata"]["labels"].get(LABEL_ROLE) in ("prefill", "decode")]) == 2, 120,
                 "the scaled-down instances' pods gone", diagnose=xpair.diagnose, interval=1.0)
        wait_for(lambda: trickle.ok_since(t_stop) >= 2, 120,
                 "the trickle client served after the scale-down", interval=1.0)
    finally:
        if burst is not None:
            burst_records = burst.stop()
        trickle_records = trickle.stop()
        real_cluster.kubectl("delete", "hpa", hpa_name, "-n", ns, "--ignore-not-found", check=False)
        for pod in slowed:
            knob(pod, False)
    after = xpair.status()
    records = burst_records + trickle_records
    failed, wrong = _summary(records, baseline_outputs)
    events = json.loads(real_cluster.kubectl("get", "events", "-n", ns, "--field-selector", "reason=RatioBand",
                                             "-o", "json").stdout)["items"]
    band = sorted((e.get("lastTimestamp") or e.get("eventTime") or "", e["message"]) for e in events)
    print(f"\n[realnode-xpyd] HPA on decode ({WAITING} target {HPA_TARGET_WAITING} per decode, scaleDown "
          f"stabilizationWindowSeconds {HPA_SCALE_DOWN_WINDOW}, sync period {HPA_SYNC}s), ratio band [1, 1]: HPA "
          f"created -> P 1/1 D 1/1 {marks['down1']:.1f}s; {HPA_CLIENTS} clients -> HPA desired 2 "
          f"{marks.get('hpa_up', 0):.1f}s, -> P 2/2 D 2/2 {marks['up']:.1f}s; load stopped -> P 1/1 D 1/1 "
          f"{marks['down2']:.1f}s; {len(failed)} failed of {len(records)} requests ({len(trickle_records)} from the "
          f"trickle client), {len(wrong)} outputs differ; highest {WAITING} read {timeline.peak}; phases seen "
          f"{sorted(timeline.phases)}\ntimeline (seconds after the HPA was created):\n{timeline.text()}\n"
          f"RatioBand events: {band}")
    assert failed == [], [(round(r["t"] - t_hpa, 1), r["error"][:200]) for r in failed[:5]]
    assert wrong == [], wrong[:5]
    assert timeline.phases == {"Ready"}, sorted(timeline.phases)
    assert after.get("pairGeneration") == before.get("pairGeneration")
    assert int(after.get("restarts") or 0) == int(before.get("restarts") or 0)
    messages = [m for _, m in band]
    assert any(re.match(r"decode 1 → prefill 2 .*: prefill set to 1", m) for m in messages), messages
    assert any(re.match(r"decode 2 → prefill 1 .*: prefill set to 2", m) for m in messages), messages
    assert timeline.peak > float(HPA_TARGET_WAITING), timeline.peak  # what the HPA scaled up on


def test_deleting_the_2p2d_pair_removes_its_pods_role_objects_and_leases(real_cluster, xpair):
    ns, name = xpair.namespace, xpair.name
    uid = xpair.get()["metadata"]["uid"]
    engines = [p for p in xpair.pods().values() if p["metadata"]["labels"].get(LABEL_ROLE) in ("prefill", "decode")]

    def leases() -> list[dict]:
        return json.loads(real_cluster.kubectl("get", "leases.coordination.k8s.io", "-n", OPERATOR_NS, "-l",
                                               f"{LABEL_PORT_LEASE}=true,{LABEL_PAIR_UID}={uid}", "-o",
                                               "json").stdout)["items"]

    def role_objects() -> list[str]:
        items = json.loads(real_cluster.kubectl("get", f"{ROLE_OBJECT_PLURAL}.{GROUP}", "-n", ns, "-o",
                                                "json").stdout)["items"]
        return [o["metadata"]["name"] for o in items]

    held = leases()
    # TP 1: side channel, metrics, http per instance (the HPA test leaves 1P1D); the router's port
    assert len(held) == 3 * len(engines) + 1, (len(held), len(engines))
    t0 = time.monotonic()
    real_cluster.kubectl("delete", f"{PLURAL}.{GROUP}", name, "-n", ns, "--wait=true", "--timeout=120s", timeout=150)
    wait_for(lambda: not xpair.pods(), 180, "the pair's pods to go", diagnose=xpair.diagnose, interval=1.0)
    wait_for(lambda: not leases(), 120, "the pair's leases to be released",
             diagnose=lambda: json.dumps(leases())[-2000:], interval=1.0)
    wait_for(lambda: not role_objects(), 120, "the role objects to go (garbage collector)",
             diagnose=lambda: str(role_objects()), interval=1.0)
    print(f"[realnode-xpyd] delete -> pods, leases and role objects gone {time.monotonic() - t0:.1f}s")

"""One pair placed by preferred node affinity on the real nodes, two failures of decode's node in turn: ports a
process outside Kubernetes holds there before the pair starts, then a network partition of that node (docs/design.md,
"A leased port in use on a node" and "Lost nodes"). Test 1 needs the pair's fresh start (the ports are taken before
the lease); test 2 needs a serving pair with decode and the router on n2, which test 1 leaves behind. So they share
one pair: the module fixture applies it while the foreign process listens, test 1 sees it recover to generation 2,
test 2 cuts its node off.

Nothing pins a pod to a node here (the demo's pair pins them): preferred node affinity places decode and the router
on n2 and prefill on n1 at first, and lets the partition's replacements go to n1.

1. A foreign process on decode's node. The operator leases the lowest free ports of its pool, decode's blocks first
   (port_blocks.required_blocks: side channel, metrics, http), so the fixture reads the port Leases and occupies the
   three lowest free ports on node n2 with a plain Python listener in n2's network namespace (not a pod). Decode's
   port preflight (the first step of its engine container) finds them busy and fails the pod with `pdpair: ports in
   use on this node: ...`; the operator quarantines them, leases others, posts PortInUse and restarts the pair
   decode-first to generation 2, outside its restart budget; decode lands on n2 again (the preference), the pair
   serves through its Service like a single engine, and the foreign process still holds its ports (nothing killed
   it). The test then kills the foreign process: the partition has no use for it, and its ports stay quarantined for
   the quarantine's TTL whether it runs or not. The control-plane version of the same flow, with the quarantine's
   end: tests/e2e/test_port_in_use.py.
2. A network partition: node n2's link to the hub goes down under the serving pair (decode and router there, prefill
   on n1); n2's kubelet and engines keep running. The controller manager runs at upstream defaults: after its
   node-monitor grace period it marks n2 Unknown and taints it unreachable; the operator then counts n2 lost at
   once, fences the ports of the pods there, and restarts the pair on n1 without waiting for deletions n2 cannot
   confirm. Measured from link-down: the restart decision, and the pair serving again through its Service with
   outputs equal to the single engine's. A steady client in n1 counts its failed requests (never retried): they fail
   while the partition is detected; none sent after the next generation serves. During the partition the cut-off
   decode still answers inside n2's network (a partition, not a stopped kubelet). Link up: n2's kubelet ends the old
   pods, the fences go with them, no force delete. Whichever comes first restarts the pair: the health watch (n2's
   pods unreachable three times, a budgeted restart) or the lost node (outside the budget); the old pods go only once
   n2 counts as lost and their ports are fenced. Its generation and restart assertions are relative to what it finds:
   exactly one more restart, to the next generation. It waits for the pair Ready at whatever generation, so it also
   runs (and fails clearly, not by hanging) when test 1 failed or was not selected.

Cost: 2 + 2 vLLM cold starts (a pair of its own for each scenario cost 2 + (2 + 2)): generation 1 starts no engine
(decode's preflight fails within seconds, and prefill waits for decode), generation 2 starts both, then the
partition's replacement on n1; plus the grace period (50 s on Kubernetes 1.36: measured 53.7 s from link-down to
NodeLost) and the heal (the fences go at the operator's next sweep: every 10 s in the real-node tier's release,
conftest.operator_release). Runs last: it takes node n2 away for a while.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

from pdpair.contract import (
    ANNOTATION_RESTART_TIMES, COND_NODE_LOST, GROUP, LABEL_PORT_LEASE, LABEL_PORT_QUARANTINE, LEASE_NAME_PREFIX,
    PLURAL, QUARANTINE_HOLDER_PREFIX,
)
from pdpair.operator.build.pods import ENGINE_CONTAINER
from pdpair.operator.model.config import DEFAULT_PORT_POOL, PortPool
from devcluster.product import (
    ENGINE_START_TIMEOUT, OPERATOR_NS, PROMPTS, completion, describe, fenced_ports, leader_pod_name, list_pods,
    operator_logs, pair_manifest, pod_logs, read_pair,
)
from devcluster.waiting import wait_for
from tests.e2e_realnode.load import Load

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(2400)]

NAME = "partition"
LOAD_CLIENTS = 2
LOAD_TIMEOUT = 10.0  # seconds per request: one sent to the cut-off router fails after it
CUT_NODE = "n2"  # decode's and the router's node: the foreign process's, then the partitioned one
BANNER = b"foreign process\n"
# Listens on every port given, answers each connection with BANNER, until killed. Prints one line once all listen.
FOREIGN_LISTENER = f"""
import socket, sys, threading
socks = []
for port in map(int, sys.argv[1:]):
    s = socket.socket()
    # Like any server (and the preflight): an earlier pair's connections on the port may sit in TIME_WAIT.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(16)
    socks.append(s)
def serve(s):
    while True:
        conn, _ = s.accept()
        conn.sendall({BANNER!r})
        conn.close()
for s in socks[1:]:
    threading.Thread(target=serve, args=(s,), daemon=True).start()
print("listening", flush=True)
serve(socks[0])
"""
BANNER_CHECK = ("import socket, sys\n"
                "with socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=10) as c:\n"
                "    sys.stdout.write(c.recv(64).decode())\n")


def prefer(node: str) -> dict:
    return {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": {
        "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}}]}}


def unpinned_manifest(namespace: str, engine_ref: str, model_dir) -> dict:
    body = pair_manifest(NAME, namespace, engine_ref, model_dir, prefill_node="n1", decode_node=CUT_NODE)
    for role, node in (("prefill", "n1"), ("decode", CUT_NODE), ("router", CUT_NODE)):
        template = body["spec"][role]["template"]["spec"]
        del template["nodeSelector"]
        template["affinity"] = prefer(node)
    return body


def leased_ports(cluster) -> set[int]:
    leases = json.loads(cluster.kubectl("get", "leases", "-n", OPERATOR_NS, "-l", f"{LABEL_PORT_LEASE}=true",
                                        "-o", "json").stdout)["items"]
    return {int(l["metadata"]["name"].removeprefix(LEASE_NAME_PREFIX)) for l in leases}


def next_free(pool: PortPool, taken: set[int], count: int) -> list[int]:
    return [p for p in pool if p not in taken][:count]


def start_foreign_listener(cluster, node: str, ports: list[int]) -> subprocess.Popen:
    """A plain process in the node's network namespace (what hostNetwork pods share), holding `ports`."""
    pid = cluster.node(node).pid("kubelet")
    proc = subprocess.Popen(["nsenter", "-t", str(pid), "-n", sys.executable, "-c", FOREIGN_LISTENER,
                             *map(str, ports)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # returns at "listening", or at EOF when it failed to bind
    if line.strip() != "listening":
        proc.kill()
        raise AssertionError(f"the foreign listener did not start on {ports}: {proc.stderr.read()}")
    return proc


class PartitionPair:
    """The module's pair and the foreign process that held its first decode's ports: what both tests read."""

    def __init__(self, cluster, namespace: str, busy: list[int], foreign: subprocess.Popen):
        self.cluster, self.namespace, self.busy, self.foreign = cluster, namespace, busy, foreign
        self.t_apply = time.monotonic()

    def pair(self) -> dict:
        pair = read_pair(self.cluster, self.namespace, NAME)
        assert pair is not None, f"pair {self.namespace}/{NAME} could not be read"  # kubectl get raised here
        return pair

    def status(self) -> dict:
        return self.pair().get("status") or {}

    def restart_times(self) -> list:
        """The restarts counted against the budget (the operator's annotation)."""
        return json.loads((self.pair()["metadata"].get("annotations") or {}).get(ANNOTATION_RESTART_TIMES, "[]"))

    def pods(self) -> list[dict]:
        return list_pods(self.cluster, self.namespace)

    def events(self, reason: str) -> list[dict]:
        return json.loads(self.cluster.kubectl("get", "events", "-n", self.namespace, "--field-selector",
                                               f"reason={reason}", "-o", "json").stdout)["items"]

    def service(self) -> dict:
        return json.loads(self.cluster.kubectl("get", "service", NAME, "-n", self.namespace, "-o", "json").stdout)

    def answers(self) -> dict[str, str]:
        svc = self.service()
        ip, port = svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["port"]
        return {p: completion(self.cluster, "n1", ip, port, p) for p in PROMPTS}

    def diagnose(self) -> str:
        return "\n".join([describe(self.cluster, self.namespace), json.dumps(self.status(), indent=1)[-3000:],
                          "--- operator:\n" + operator_logs(self.cluster)])

    def diagnose_with_logs(self) -> str:
        """diagnose() and every pod's log: not during the partition, when a log from n2 cannot be fetched."""
        out = [self.diagnose()]
        for p in self.pods():
            out.append(f"--- {p['metadata']['name']}:\n{pod_logs(self.cluster, self.namespace, p['metadata']['name'])}")
        return "\n".join(out)

    def stop_foreign(self) -> None:
        if self.foreign.poll() is None:
            self.foreign.kill()
        self.foreign.wait(timeout=30)


@pytest.fixture(scope="module")
def partition_pair(real_cluster, operator_release, images, model_dir, namespace):
    """The pair applied while a foreign process holds, on CUT_NODE, the three ports its decode will be leased."""
    # The release uses the chart's default pool (devcluster/product.install_operator sets none).
    busy = next_free(PortPool.parse(DEFAULT_PORT_POOL), leased_ports(real_cluster), 3)
    run = PartitionPair(real_cluster, namespace, busy, start_foreign_listener(real_cluster, CUT_NODE, busy))
    try:
        run.t_apply = time.monotonic()
        real_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(unpinned_manifest(
            namespace, images["engine"].ref, model_dir)))
        yield run
    finally:
        real_cluster.kubectl("delete", f"{PLURAL}.{GROUP}", NAME, "-n", namespace, "--ignore-not-found",
                             "--wait=true", "--timeout=180s", timeout=210, check=False)
        run.stop_foreign()


def test_ports_held_by_a_foreign_process_on_decodes_node_are_replaced_and_the_pair_serves(
        real_cluster, baseline_outputs, partition_pair):
    run, busy = partition_pair, partition_pair.busy
    try:
        # The first decode fails in its preflight, seconds after it is scheduled: a PortInUse Event names the ports.
        [event] = wait_for(lambda: run.events("PortInUse"), 300, "a PortInUse Event",
                           diagnose=run.diagnose_with_logs, interval=1.0)
        print(f"[realnode-e2e] PortInUse {time.monotonic() - run.t_apply:.1f}s after apply: {event['message']}")
        message = event["message"]
        # Decode's first pod went to CUT_NODE by preference: only there are its ports busy.
        assert f"ports {' '.join(map(str, busy))} in use on node {CUT_NODE}" in message, (busy, message)
        assert f"container {ENGINE_CONTAINER}" in message and "decode pod" in message, message
        for port in busy:
            lease = json.loads(real_cluster.kubectl("get", "lease", f"{LEASE_NAME_PREFIX}{port}", "-n", OPERATOR_NS,
                                                    "-o", "json").stdout)
            assert lease["metadata"]["labels"].get(LABEL_PORT_QUARANTINE) == "true", lease
            assert lease["spec"]["holderIdentity"] == f"{QUARANTINE_HOLDER_PREFIX}{CUT_NODE}", lease

        # Two engine starts, together now (prefill beside decode), but on a loaded box each may take up to
        # ENGINE_START_TIMEOUT (a first run here, one after the other, saw decode listen after 8.5 min at load 25).
        wait_for(lambda: run.status().get("phase") == "Ready", 2 * ENGINE_START_TIMEOUT,
                 "pair phase Ready on the replacement ports", diagnose=run.diagnose_with_logs, interval=1.0)
        print(f"[realnode-e2e] apply -> Ready on replacement ports {time.monotonic() - run.t_apply:.1f}s")
        status = run.status()
        decode_ports = {p["port"] for p in status["ports"] if p["role"] == "decode"}
        assert len(decode_ports) == 3 and not decode_ports & set(busy), (busy, status["ports"])
        assert all(str(p) in message for p in decode_ports), ("the Event names the replacement", message)
        assert status["pairGeneration"] == 2 and str(busy[0]) in status["lastRestart"]["reason"], status
        assert run.restart_times() == [], "counted against the budget"

        pods = json.loads(real_cluster.kubectl("get", "pods", "-n", run.namespace, "-l", f"pdpair.io/pair={NAME}",
                                               "-o", "json").stdout)["items"]
        by_role = {p["metadata"]["labels"]["pdpair.io/role"]: p for p in pods}
        # The replacement decode keeps the preference (its new ports are free there); the partition needs it there.
        assert by_role["decode"]["spec"]["nodeName"] == CUT_NODE, by_role["decode"]["spec"]["nodeName"]
        assert by_role["decode"]["metadata"]["labels"]["pdpair.io/generation"] == "2"
        # The replacement's preflight passed and became the engine: no init container of ours, the engine runs.
        assert not by_role["decode"]["status"].get("initContainerStatuses"), by_role["decode"]["status"]
        [engine] = [s for s in by_role["decode"]["status"]["containerStatuses"] if s["name"] == ENGINE_CONTAINER]
        assert engine["state"].get("running") and engine["restartCount"] == 0, engine

        outputs = run.answers()
        expected = {p: baseline_outputs[p] for p in PROMPTS}
        assert outputs == expected, \
            f"pair outputs differ from the single engine:\npair: {outputs}\nbaseline: {expected}"

        # Nothing killed or took over the foreign process: it still runs and answers on every one of its ports.
        assert run.foreign.poll() is None, run.foreign.stderr.read()
        for busy_port in busy:
            answer = real_cluster.node_exec(CUT_NODE, [sys.executable, "-c", BANNER_CHECK, str(busy_port)]).stdout
            assert answer == BANNER.decode(), (busy_port, answer)
    finally:
        # Its part ends here, passed or not: the partition then runs as it would on a pair of its own (the busy
        # ports stay quarantined for the TTL whether the process runs or not). The fixture kills it when this test
        # did not run.
        run.stop_foreign()


def test_a_partitioned_node_is_left_behind_and_the_pair_serves_from_the_other_node(
        real_cluster, baseline_outputs, partition_pair):
    cluster, run, namespace = real_cluster, partition_pair, partition_pair.namespace

    def fences() -> dict[int, str]:
        return fenced_ports(json.loads(cluster.kubectl("get", "leases", "-n", OPERATOR_NS, "-l",
                                                       f"{LABEL_PORT_QUARANTINE}=true", "-o", "json").stdout)["items"],
                            f"{namespace}/")

    def declared(pod) -> set[int]:
        return {int(p["containerPort"]) for c in pod["spec"]["containers"] for p in c.get("ports") or []}

    def serving(generation: int):
        status = run.status()
        return status if status.get("phase") == "Ready" and status.get("pairGeneration") == generation else None

    hub_link = f"v{CUT_NODE}"  # n2's veth end on the hub's bridge (devcluster/realnode.py)
    # The pair as test 1 left it (generation 2, one restart outside the budget), or still starting when test 1
    # failed early or did not run: the assertions below are relative to what is found here.
    start = wait_for(lambda: (lambda s: s if s.get("phase") == "Ready" else None)(run.status()),
                     2 * ENGINE_START_TIMEOUT, "the pair Ready (any generation)", diagnose=run.diagnose_with_logs,
                     interval=1.0)
    generation, restarts_before = int(start["pairGeneration"]), int(start.get("restarts") or 0)
    budgeted_before = len(run.restart_times())
    old = {p["metadata"]["labels"]["pdpair.io/role"]: p for p in run.pods()
           if p["metadata"]["labels"].get("pdpair.io/generation") == str(generation)
           and not p["metadata"].get("deletionTimestamp")}
    assert (old["decode"]["spec"]["nodeName"], old["router"]["spec"]["nodeName"],
            old["prefill"]["spec"]["nodeName"]) == (CUT_NODE, CUT_NODE, "n1"), {r: p["spec"]["nodeName"]
                                                                                for r, p in old.items()}
    old_uids = {o["metadata"]["uid"] for o in old.values()}
    old_ports = set().union(*(declared(p) for r, p in old.items() if r != "prefill"))
    leader_on_cut = (leader_pod_name(cluster) or "") in {
        p["metadata"]["name"] for p in json.loads(cluster.kubectl(
            "get", "pods", "-n", OPERATOR_NS, "--field-selector", f"spec.nodeName={CUT_NODE}", "-o", "json"
        ).stdout)["items"]}

    # A steady client in n1 (two threads, 10 s per request, a failed request counted and never retried): its
    # requests fail while the partition is being detected, none sent once the new generation serves.
    svc = run.service()
    load = Load(cluster, svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["port"], LOAD_CLIENTS, LOAD_TIMEOUT)
    loading = time.time()
    link = ["ip", "-n", cluster.hub, "link", "set", hub_link]
    try:
        wait_for(lambda: load.ok_since(loading) >= LOAD_CLIENTS, 120, "the client's answers before the cut",
                 diagnose=lambda: json.dumps(load.records[-3:]), interval=1.0)
        subprocess.run(link + ["down"], check=True)
        cut, cut_wall = time.monotonic(), time.time()
        # Whichever comes first restarts the pair once: the health watch (n2's pods unreachable 3 times, a
        # budgeted restart) or the lost node (the unreachable taint after the grace period, outside the budget).
        # Either way the old pods can only go once n2 counts as lost and their ports are fenced.
        restarted = wait_for(lambda: (lambda s: s if int(s.get("restarts") or 0) > restarts_before else None)(
            run.status()), 300, "the restart", diagnose=run.diagnose, interval=1.0)
        decided = time.monotonic() - cut
        reason = restarted["lastRestart"]["reason"]

        def node_lost():
            found = [c for c in run.status().get("conditions") or []
                     if c["type"] == COND_NODE_LOST and c["status"] == "True"]
            return found[0] if found else None

        lost_condition = wait_for(node_lost, 300, "condition NodeLost", diagnose=run.diagnose, interval=1.0)
        lost_after = time.monotonic() - cut
        assert CUT_NODE in lost_condition["message"], lost_condition
        nodes = json.loads(cluster.kubectl("get", "node", CUT_NODE, "-o", "json").stdout)
        ready = next(c for c in nodes["status"]["conditions"] if c["type"] == "Ready")

        # The cut-off decode still runs and answers inside n2's network: a partition, not a stopped node.
        http = next(int(p["containerPort"]) for c in old["decode"]["spec"]["containers"]
                    for p in c.get("ports") or [] if p.get("name") == "http")
        alive = completion(cluster, CUT_NODE, old["decode"]["status"]["podIP"], http, PROMPTS[0], refused_for=0)
        assert alive == baseline_outputs[PROMPTS[0]]

        wait_for(lambda: serving(generation + 1), 2 * ENGINE_START_TIMEOUT, f"generation {generation + 1} Ready",
                 diagnose=run.diagnose, interval=1.0)
        assert run.answers() == {p: baseline_outputs[p] for p in PROMPTS}
        # The Service kept the port clients know (service.kept_service_port), though the router's was fenced.
        assert run.service()["spec"]["ports"][0]["port"] == svc["spec"]["ports"][0]["port"]
        serving_again, serving_wall = time.monotonic() - cut, time.time()
        wait_for(lambda: load.ok_since(serving_wall) >= 2 * LOAD_CLIENTS, 120, "the client's answers after",
                 diagnose=lambda: json.dumps(load.records[-3:]), interval=1.0)
        now = run.pods()
        new = [p for p in now if p["metadata"]["labels"]["pdpair.io/generation"] == str(generation + 1)]
        assert {p["spec"]["nodeName"] for p in new} == {"n1"}, [(p["metadata"]["name"], p["spec"]["nodeName"])
                                                              for p in new]
        stranded = [p for p in now if p["metadata"]["uid"] in old_uids and p["spec"]["nodeName"] == CUT_NODE]
        assert stranded and all(p["metadata"].get("deletionTimestamp") for p in stranded), stranded
        new_ports = set().union(*(declared(p) for p in new))
        assert not new_ports & old_ports, \
            f"generation {generation + 1} shares {new_ports & old_ports} with the cut-off pods"
        assert old_ports <= set(fences()), (sorted(old_ports), fences())
        counted = run.restart_times()
        by_node_rule = "re-homing generation" in reason  # planner.failure's node_lost message
        added = len(counted) - budgeted_before
        assert added in (0, 1) and by_node_rule == (added == 0), (reason, counted, budgeted_before)
    finally:
        subprocess.run(link + ["up"], check=True)
        records = load.stop()
    healed = time.monotonic()
    failed = [r for r in records if not r["ok"]]
    late = [r for r in failed if r["t"] >= serving_wall]
    assert not late, f"requests sent after generation {generation + 1} served failed: {late[:3]}"
    wrong = [r for r in records if r["ok"] and r["text"] != baseline_outputs[r["prompt"]]]
    assert not wrong, wrong[:3]
    first_ok = min((r["t"] + r["dur"] for r in records if r["ok"] and r["t"] >= cut_wall), default=None)
    wait_for(lambda: not [p for p in run.pods() if p["metadata"]["uid"] in old_uids], 300,
             "n2's kubelet ends the old pods", diagnose=run.diagnose, interval=1.0)
    old_gone = time.monotonic() - healed
    wait_for(lambda: not old_ports & set(fences()), 120, "the fences released (one operator sweep)",
             diagnose=run.diagnose, interval=2.0)
    released = time.monotonic() - healed
    assert run.status()["restarts"] == restarts_before + 1, (restarts_before, run.status())
    print(f"\n[realnode-e2e] partition of {CUT_NODE} (operator leader there: {leader_on_cut}): restart decided "
          f"{decided:.1f}s after link-down ({reason[:120]}); NodeLost {lost_after:.1f}s after link-down (node "
          f"Ready={ready['status']} since {ready['lastTransitionTime']}); serving again from n1 "
          f"{serving_again:.1f}s after link-down; link up: old pods gone in {old_gone:.1f}s, fences released "
          f"in {released:.1f}s; the client: {len(failed)} of {len(records)} requests failed, all sent before "
          f"generation {generation + 1} served, its first answer after the cut "
          f"{(first_ok - cut_wall) if first_ok else float('nan'):.1f}s after link-down")

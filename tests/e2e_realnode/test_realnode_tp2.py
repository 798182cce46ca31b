"""One tensor-parallel-2 pair on the real nodes: the seed's startup-hang case, with real listeners.

`spec.<role>.tensorParallelSize: 2` on both roles: each engine runs vLLM's API server, engine core and two gloo
worker processes in one container; each worker (TP rank r) runs its own side channel and transport, and decode's
rank r listens on the leased side-channel base + r. tcp transport, prefill on n1, decode and the router on n2,
hostNetwork (the chart's default), the session's tiny model, engine image and operator release.

What is asserted (each could fail):
1. ordered startup on real listeners: pod and pair watches (one etcd: resourceVersions order them) see decode
   created, then the pair's DecodeListening condition True with the operator's probe result naming BOTH decode
   side-channel ports of status.ports (the operator's own port math: base, base + 1), then prefill created. The
   engines agree independently: prefill's handshake counter has no `retry` on either rank (a retry is counted only
   when the TCP connect to decode's base + r is refused), so both of decode's listeners accepted at prefill's
   first attempt. And `ss -ltnp` in n2's network namespace shows the two ports held by two different processes of
   the decode pod (its two workers, by their cgroup), with the decode container never restarted;
2. phase Ready, and greedy outputs of devcluster.product.PROMPTS through the router Service equal the single TP = 1
   engine's (`baseline_outputs`; tests/engine/test_tp2_engine.py found TP = 2 and TP = 1 equal token for token);
3. per-rank visibility: decode's and prefill's /metrics (rank 0's port; rank 0 merges the other rank's series)
   carry rank="0" and rank="1" series; decode counted every request's KV transfer on BOTH ranks with equal bytes
   (each rank moves its own KV head), no error or timeout; prefill's rank r paired once with decode's base + r;
4. status.health Healthy for generation 1, both roles healthy;
5. one decode TP worker killed ("Faults at TP = 2"): SIGKILL of decode's rank 1 worker alone, found in the
   container by vLLM's process title (`VLLM::Worker_TP1`, a child of `VLLM::EngineCore`; the engine core and rank 0
   are not touched). It fails visibly: a request through the router right after the kill gets an answer within its
   120 s deadline (measured: a 502 naming decode's 500 "EngineCore encountered an issue", in 0.2 s), and decode's
   pod ends (vLLM's executor sees the dead worker, the engine core stops, the API server exits; restartPolicy
   Never). The operator records exactly one restart, with the reason it derives from the ended pod
   (health.pod_fact of the ended pod; measured: "decode pod tiny-tp2-decode-g1 exited (Succeeded): a server must
   not end", vLLM's API server exits 0) in status.lastRestart and one Restarting Event,
   and restarts IN ORDER, by the resourceVersions of pod and pair watches: decode ended, restart recorded in status,
   old prefill deleted and gone (the old router gone too), old decode deleted and gone, new decode created,
   DecodeListening True for generation 2 with the probe naming both rank ports, new prefill created; no container
   restarted in place. Generation 2 is Ready at TP = 2 and its greedy outputs equal `baseline_outputs`;
then the pair (whatever generation it is at) is deleted: its pods go and its port leases are released.

The first run found a product bug: the engine image had no C++ compiler, and at TP > 1 vLLM's inductor-compiled
vocab-embedding helper killed both engines on the first request (images/README.md; fixed in the image).

Measured on the quiet box (load average 1-2), 2026-12-01, two runs (docs/benchmarks.md has the commands):
apply -> phase Ready 78.9 s / 77.3 s (decode created -> its listener accepting on both rank ports 35.5 s / 33.5 s,
prefill created in the same second), apply -> first completion 115.3 s / 113.9 s (the first request of a TP = 2
pair is slow: each of the four workers compiles inductor's kernel with g++ and warms up gloo; the next three take
~7 s together), the module after the session fixtures 128.9 s / 125.0 s. Memory of each engine pod (its memory
cgroup: API server, engine core, two workers): usage ~2.11 GiB, RSS ~1.88 GiB, /dev/shm 16 MiB.
Test 5 (the worker kill), 2026-12-01, two runs of the 6-test module beside a full CI run on the same box (load average
2-5): kill -> request answered 502 in 0.15 s / 0.37 s, -> restart recorded 3.2 s / 3.3 s, -> Ready at generation 2
99.3 s / 137.7 s, -> first completion of generation 2 136.4 s / 189.7 s; the test itself 142.8 s / 200.8 s (what it adds
to the module), the module after the session fixtures 293.9 s / 414.5 s.
"""
from __future__ import annotations

import json
import pathlib
import re
import sys
import time

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdpair.contract import (
    ANNOTATION_PEERS_DIGEST, COND_DECODE_LISTENING, ENV_LISTEN_PORT_BASE, ENV_PEER_HOST, ENV_PEER_PORT_BASE, GROUP,
    LABEL_GENERATION, LABEL_PAIR_UID, LABEL_PORT_LEASE, LABEL_ROLE, PLURAL, PURPOSE_SIDECHANNEL, ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER,
    VERSION,
)
from pdpair.operator.decide.health import pod_fact
from pdpair.operator.decide.instances import peers_digest
from pdpair.operator.act.listener_probe import ProbeResult
from pdpair.operator.decide.port_blocks import ports_of
from tests.port_blocks_support import spec_blocks
from devcluster.product import (
    ENGINE_ARGS, ENGINE_START_TIMEOUT, OPERATOR_NS, PROMPTS, SERVED_NAME, completion, container_processes, describe,
    list_pods, operator_logs, pair_manifest, read_pair,
)
from devcluster.waiting import wait_for
from devcluster.realnode_watch import Recorder, listening_since, pod_steps

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(2400)]

NAME = "tiny-tp2"
TP = 2
FIRST_ANSWER_AFTER_READY = 15.0  # seconds from phase Ready to the first completion through the Service (measured: see below)
PREFILL_NODE, DECODE_NODE = "n1", "n2"
_FETCH = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


class Tp2Pair:
    """What the module's tests read: the pair as served, the watches' events, the measured times."""

    def __init__(self, cluster, namespace: str, model_dir: pathlib.Path):
        self.cluster, self.namespace, self.model_dir = cluster, namespace, model_dir
        self.t_module = time.monotonic()
        self.pod_events: list = []
        self.pair_events: list = []
        self.outputs: dict[str, str] = {}
        self.seconds: dict[str, float] = {}
        self.memory: dict[str, dict[str, int] | None] = {}

    def pair(self) -> dict:
        pair = read_pair(self.cluster, self.namespace, NAME)
        assert pair is not None, f"pair {self.namespace}/{NAME} could not be read"  # kubectl get raised here
        return pair

    def pods(self) -> dict[str, dict]:
        items = list_pods(self.cluster, self.namespace, f"pdpair.io/pair={NAME}")
        return {p["metadata"]["labels"][LABEL_ROLE]: p for p in items}

    def metrics(self, role: str) -> list[tuple[str, dict, float]]:
        """(sample name, labels, value) of the role's pod /metrics, scraped from inside decode's node."""
        pod = self.pods()[role]
        port = next(p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "metrics")
        text = self.cluster.node_exec(DECODE_NODE, [sys.executable, "-c", _FETCH,
                                                    f"http://{pod['status']['podIP']}:{port}/metrics"]).stdout
        return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]

    def diagnose(self) -> str:
        out = [describe(self.cluster, self.namespace)]
        try:
            out.append(json.dumps(self.pair().get("status"), indent=1)[-3000:])
        except Exception as exc:  # the pair may be gone already
            out.append(f"pair: {exc}")
        for role, p in self.pods().items():
            logs = self.cluster.kubectl("logs", "-n", self.namespace, p["metadata"]["name"], "--tail=150",
                                        check=False).stdout
            out.append(f"--- {role} {p['metadata']['name']}:\n{logs}")
        out.append("--- operator:\n" + operator_logs(self.cluster))
        return "\n".join(out)


def value(samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def ranks_of(samples, name: str) -> set[str]:
    return {lab["rank"] for n, lab, _ in samples if n == name and "rank" in lab}


def bytes_per_block_per_rank(model_dir: pathlib.Path) -> int:
    """KV bytes one TP rank holds per block: layers x (K, V) x block tokens x its KV heads x head_dim x float32."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    block_tokens = int(ENGINE_ARGS[ENGINE_ARGS.index("--block-size") + 1])
    assert ENGINE_ARGS[ENGINE_ARGS.index("--dtype") + 1] == "float32"
    return config["num_hidden_layers"] * 2 * block_tokens * (config["num_key_value_heads"] // TP) * head_dim * 4


def pod_memory(cluster, node: str, pod: dict) -> dict[str, int] | None:
    """The pod's memory cgroup (v1, the kubelet's cgroupfs driver under the node's cgroup root): usage (RSS, page
    cache and the /dev/shm emptyDir) and RSS alone. None when the cgroup cannot be found (the numbers are reported,
    not asserted)."""
    root = pathlib.Path("/sys/fs/cgroup/memory") / cluster.node(node).cgroup_root.strip("/")
    found = next(iter(root.glob(f"kubepods/**/pod{pod['metadata']['uid']}")), None)
    if found is None:
        return None
    stat = dict(line.split() for line in (found / "memory.stat").read_text().splitlines())
    return {"usage": int((found / "memory.usage_in_bytes").read_text()), "rss": int(stat["total_rss"]),
            "shmem": int(stat.get("total_shmem", 0))}


@pytest.fixture(scope="module")
def tp2(real_cluster, operator_release, baseline_outputs, images, model_dir, namespace):
    """The TP = 2 pair applied with pod and pair watches running, Ready, and the PROMPTS sent through its Service."""
    from kubernetes import client

    run = Tp2Pair(real_cluster, namespace, model_dir)
    api = real_cluster.api_client()
    pods = Recorder(api, client.CoreV1Api(api).list_namespaced_pod, namespace)
    pairs = Recorder(api, client.CustomObjectsApi(api).list_namespaced_custom_object, GROUP, VERSION, namespace,
                     PLURAL)
    body = pair_manifest(NAME, namespace, images["engine"].ref, model_dir, prefill_node=PREFILL_NODE,
                         decode_node=DECODE_NODE, tensor_parallel_size=TP)
    try:
        t_apply = time.monotonic()
        real_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))
        # Two TP = 2 engine starts one after the other (decode, then prefill once decode listens).
        wait_for(lambda: run.pair().get("status", {}).get("phase") == "Ready", 2 * ENGINE_START_TIMEOUT,
                 "the TP = 2 pair's phase Ready", diagnose=run.diagnose, interval=1.0)
        run.seconds["apply_to_ready"] = time.monotonic() - t_apply
        svc = json.loads(real_cluster.kubectl("get", "service", NAME, "-n", namespace, "-o", "json").stdout)
        ip, port = svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["port"]
        try:
            run.outputs[PROMPTS[0]] = completion(real_cluster, PREFILL_NODE, ip, port, PROMPTS[0])
            run.seconds["apply_to_first_token"] = time.monotonic() - t_apply
            for prompt in PROMPTS[1:]:
                run.outputs[prompt] = completion(real_cluster, DECODE_NODE, ip, port, prompt)
        except Exception as exc:
            raise AssertionError(f"a completion through the TP = 2 pair failed: {exc}\n{run.diagnose()}") from exc
        run.seconds["apply_to_all_outputs"] = time.monotonic() - t_apply
        by_role = run.pods()
        run.memory = {role: pod_memory(real_cluster, by_role[role]["spec"]["nodeName"], by_role[role])
                      for role in (ROLE_DECODE, ROLE_PREFILL)}
    finally:
        pods.stop()
        pairs.stop()
    assert pods.error is None and pairs.error is None, (pods.error, pairs.error)
    run.pod_events, run.pair_events = pods.events, pairs.events
    mib = {r: (f"usage {m['usage'] / 2**20:.0f} MiB, rss {m['rss'] / 2**20:.0f} MiB, shmem {m['shmem'] / 2**20:.0f} "
               "MiB" if m else "n/a") for r, m in run.memory.items()}
    print(f"\n[realnode-e2e] tp2: apply -> Ready {run.seconds['apply_to_ready']:.1f}s, -> first completion "
          f"{run.seconds['apply_to_first_token']:.1f}s, -> all {len(PROMPTS)} completions "
          f"{run.seconds['apply_to_all_outputs']:.1f}s; pod memory cgroups: decode {mib[ROLE_DECODE]}; "
          f"prefill {mib[ROLE_PREFILL]}")
    yield run
    # Whatever a test left: the pair goes (the last test asserts this itself; here only best effort).
    real_cluster.kubectl("delete", f"{PLURAL}.{GROUP}", NAME, "-n", namespace, "--ignore-not-found", "--wait=true",
                         "--timeout=120s", timeout=150, check=False)


def test_prefill_starts_beside_decode_and_pairs_on_both_ranks_once_decode_listens(tp2):
    """Parallel start, ordered pairing, at TP = 2 (where the seed's wrong order hung both sides): prefill is created
    beside decode (told decode's address by the operator's push once decode has one), not after its listener; each prefill rank hands its unique id only to a decode rank that
    accepted (a refused connect is a retry, never a handshake), pairs exactly once, and prefill's readiness (/readyz)
    says both ranks are paired; the router is created beside them once prefill runs, and the pair is Ready only after
    the operator saw both listeners."""
    pair = tp2.pair()
    status, by_role = pair["status"], tp2.pods()
    decode = by_role[ROLE_DECODE]
    # The operator's port math: one contiguous side-channel block of TP ports for decode; rank r uses base + r.
    [block] = [b for b in spec_blocks(pair["spec"]) if b.key == (ROLE_DECODE, 0, PURPOSE_SIDECHANNEL)]
    side = ports_of(status["ports"], ROLE_DECODE, PURPOSE_SIDECHANNEL)
    assert block.count == TP and len(side) == TP and side == list(range(side[0], side[0] + TP)), status["ports"]
    env = {role: {e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]} for role, p in by_role.items()}
    assert env[ROLE_DECODE][ENV_LISTEN_PORT_BASE] == str(side[0]), env[ROLE_DECODE]
    decode_ip = decode["status"]["podIP"]
    # Prefill is created beside decode, before decode has an address: its environment names a decode only if one had
    # an address by then; the operator's push told it decode's (PUT /pdpair/v1/peers on its metrics port, forwarded
    # to rank 1), and the pod's annotation records the set it was last told.
    if ENV_PEER_HOST in env[ROLE_PREFILL]:
        assert (env[ROLE_PREFILL][ENV_PEER_HOST], env[ROLE_PREFILL][ENV_PEER_PORT_BASE]) == (decode_ip, str(side[0]))
    told = by_role[ROLE_PREFILL]["metadata"]["annotations"].get(ANNOTATION_PEERS_DIGEST)
    assert told == peers_digest([f"{decode_ip}:{side[0]}"]), (told, env[ROLE_PREFILL], decode_ip)

    # The order, as the API server saw it: decode created, then prefill (beside it, while decode loads), then the
    # router (once prefill runs); the pair Ready only after DecodeListening True with every port probed.
    steps = {s: (t, rv) for t, rv, s in pod_steps(tp2.pod_events)}
    names = {role: p["metadata"]["name"] for role, p in by_role.items()}
    created = {role: steps.get(f"create {names[role]}") for role in (ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER)}
    assert all(created.values()), (created, [s for _, _, s in pod_steps(tp2.pod_events)])
    listening = listening_since(tp2.pair_events, 1)
    assert listening is not None, "no pair status with DecodeListening True for generation 1"
    assert created[ROLE_DECODE][1] < created[ROLE_PREFILL][1] < created[ROLE_ROUTER][1], (created, listening)
    ready = next(((t, rv) for t, rv, _, p in tp2.pair_events if (p.get("status") or {}).get("phase") == "Ready"
                  and int(p["status"].get("pairGeneration") or 0) == 1), None)
    assert ready is not None and listening[1] < ready[1], (created, listening, ready)
    first_listening = next(p for _, rv, _, p in tp2.pair_events if rv == listening[1])
    condition = next(c for c in first_listening["status"]["conditions"] if c["type"] == COND_DECODE_LISTENING)
    assert condition["message"] == ProbeResult(decode_ip, tuple(side), ()).message, (condition, side)
    print(f"[realnode-e2e] tp2 startup: prefill created {created[ROLE_PREFILL][0] - created[ROLE_DECODE][0]:.1f}s "
          f"after decode, decode listening {listening[0] - created[ROLE_DECODE][0]:.1f}s after decode "
          f"({condition['message']}); router created {created[ROLE_ROUTER][0] - created[ROLE_PREFILL][0]:.1f}s "
          f"after prefill; pair Ready {ready[0] - listening[0]:.1f}s after decode listening")

    # The engines' side of it: each prefill rank paired with decode's base + r exactly once (its attempts before
    # decode listened were refused connects, counted as retries, never a uid sent), and is paired now.
    prefill_metrics = tp2.metrics(ROLE_PREFILL)
    handshakes = [s for s in prefill_metrics if s[0] == "pdpair_handshakes_total"]
    for rank in map(str, range(TP)):
        assert value(prefill_metrics, "pdpair_handshakes_total", rank=rank, outcome="ok") == 1, handshakes
        for outcome in ("refused", "timeout", "error"):
            assert value(prefill_metrics, "pdpair_handshakes_total", rank=rank, outcome=outcome) == 0, handshakes
        assert value(prefill_metrics, "pdpair_peer_paired", rank=rank) == 1, prefill_metrics
    print(f"[realnode-e2e] tp2 prefill retries before decode listened: "
          f"{[value(prefill_metrics, 'pdpair_handshakes_total', rank=str(r), outcome='retry') for r in range(TP)]}")

    # Both listeners are decode's, one per worker process, from inside n2's network namespace (hostNetwork).
    listeners = tp2.cluster.node_exec(DECODE_NODE, ["ss", "-ltnpH"]).stdout
    owners = {}
    for port in side:
        line = next((ln for ln in listeners.splitlines() if re.search(rf"[:\]]{port}\s", ln)), None)
        assert line is not None, f"nothing listens on {port} in {DECODE_NODE}:\n{listeners}"
        owners[port] = int(re.search(r"pid=(\d+)", line).group(1))
        cgroup = pathlib.Path(f"/proc/{owners[port]}/cgroup").read_text()
        assert f"pod{decode['metadata']['uid']}" in cgroup, (port, line, cgroup)
    assert len(set(owners.values())) == TP, f"one listener process per rank expected: {owners}"
    assert decode["status"]["containerStatuses"][0]["restartCount"] == 0, decode["status"]["containerStatuses"]


def test_tp2_pair_serves_like_the_single_tp1_engine(tp2, baseline_outputs):
    by_role = tp2.pods()
    assert by_role[ROLE_PREFILL]["spec"]["nodeName"] == PREFILL_NODE
    assert by_role[ROLE_DECODE]["spec"]["nodeName"] == DECODE_NODE
    for role in (ROLE_DECODE, ROLE_PREFILL):
        command = by_role[role]["spec"]["containers"][0]["command"]
        assert command[command.index("--tensor-parallel-size") + 1] == str(TP), command
    expected = {p: baseline_outputs[p] for p in PROMPTS}
    assert tp2.outputs == expected, f"TP = 2 pair outputs differ from the TP = 1 engine:\npair: {tp2.outputs}\n" \
                                    f"baseline: {expected}"
    # Warm before Ready (connector/warmup.py): the first completion after Ready pays no first-call compile (it took
    # 36-40 s after Ready before the warm-up existed, each worker compiling inductor's helper with g++).
    first = tp2.seconds["apply_to_first_token"] - tp2.seconds["apply_to_ready"]
    assert first < FIRST_ANSWER_AFTER_READY, f"the first completion came {first:.1f}s after Ready"


def test_each_rank_has_its_series_and_moved_its_share_of_the_kv(tp2):
    ranks = {str(r) for r in range(TP)}

    def decode_transfers():
        samples = tp2.metrics(ROLE_DECODE)
        done = all(value(samples, "pdpair_kv_transfers_total", rank=r, outcome="ok") >= len(PROMPTS) for r in ranks)
        return samples if done else None

    decode = wait_for(decode_transfers, 30, f"{len(PROMPTS)} ok KV transfers on each of decode's {TP} ranks",
                      diagnose=lambda: str([s for s in tp2.metrics(ROLE_DECODE) if s[0] == "pdpair_kv_transfers_total"]),
                      interval=1.0)
    prefill = tp2.metrics(ROLE_PREFILL)
    for name in ("pdpair_kv_transfers_total", "pdpair_kv_transfer_bytes_total", "pdpair_handshakes_total",
                 "pdpair_listener_ready", "pdpair_signals_expected_total"):
        assert ranks_of(decode, name) == ranks, (name, ranks_of(decode, name))
    for name in ("pdpair_handshakes_total", "pdpair_kv_transfers_total"):
        assert ranks_of(prefill, name) == ranks, (name, ranks_of(prefill, name))

    decode_ip = tp2.pods()[ROLE_DECODE]["status"]["podIP"]
    side = ports_of(tp2.pair()["status"]["ports"], ROLE_DECODE, PURPOSE_SIDECHANNEL)
    moved = {}
    for rank in sorted(ranks):
        assert value(decode, "pdpair_kv_transfers_total", rank=rank, outcome="ok") == len(PROMPTS), rank
        assert value(decode, "pdpair_kv_transfers_total", rank=rank, outcome="error") == 0, rank
        assert value(decode, "pdpair_kv_transfers_total", rank=rank, outcome="timeout") == 0, rank
        assert value(decode, "pdpair_listener_ready", rank=rank) == 1, rank
        moved[rank] = value(decode, "pdpair_kv_transfer_bytes_total", rank=rank)
        # Decode's rank r takes signals only from prefill's rank r (one prefill: one `peer`, its instance); all of
        # them arrived.
        assert len({lab["peer"] for n, lab, _ in decode if n == "pdpair_signals_expected_total"}) == 1
        expected = value(decode, "pdpair_signals_expected_total", rank=rank)
        assert expected > 0 and value(decode, "pdpair_signals_received_total", rank=rank) == expected
        # Prefill's rank r reached its decode (peer = decode's host:portBase) and paired once.
        assert value(prefill, "pdpair_transport_slots", rank=rank, peer=f"{decode_ip}:{side[0]}") > 0, \
            [s for s in prefill if s[0] == "pdpair_transport_slots"]
    # Each rank holds one of the tiny model's two KV heads: the same bytes on both, in whole blocks of its shard,
    # at least one block per request.
    assert moved["0"] == moved["1"] > 0, moved
    block = bytes_per_block_per_rank(tp2.model_dir)
    assert moved["0"] % block == 0 and moved["0"] >= len(PROMPTS) * block, (moved, block)
    print(f"[realnode-e2e] tp2 KV bytes moved per rank: {moved}")


def test_health_is_healthy_for_generation_1(tp2):
    def judged() -> dict:
        health = tp2.pair().get("status", {}).get("health") or {}
        return health if health.get("verdict") == "Healthy" and health.get("pairGeneration") == 1 else {}

    health = wait_for(judged, 90, "status.health Healthy for generation 1", diagnose=tp2.diagnose, interval=1.0)
    assert {role: health["roles"][role]["state"] for role in (ROLE_DECODE, ROLE_PREFILL)} == {
        ROLE_DECODE: "healthy", ROLE_PREFILL: "healthy"}, health
    assert health["roles"][ROLE_DECODE]["pod"] == tp2.pods()[ROLE_DECODE]["metadata"]["name"], health
    conditions = {c["type"]: c for c in tp2.pair()["status"]["conditions"]}
    assert conditions["SignalsHealthy"]["status"] == "True", conditions["SignalsHealthy"]


# One request through the router from inside a node, never retried: its HTTP status, text and finish reason, or
# its error, whether it ran into its own timeout (a hang), and how long it took.
_ONE_REQUEST_SNIPPET = r"""
import json, sys, time, urllib.error, urllib.request
url, model, prompt, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}).encode()
out = {"status": None, "text": None, "finish_reason": None, "error": None, "timed_out": False}
t = time.monotonic()
try:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        choice = json.load(resp)["choices"][0]
        out.update(status=resp.status, text=choice["text"], finish_reason=choice.get("finish_reason"))
except urllib.error.HTTPError as exc:
    out.update(status=exc.code, error=exc.read().decode(errors="replace")[:300])
except TimeoutError as exc:
    out.update(timed_out=True, error=repr(exc))
except urllib.error.URLError as exc:
    out.update(timed_out=isinstance(exc.reason, TimeoutError), error=repr(exc)[:300])
except Exception as exc:  # e.g. the connection reset mid-response: an error, not a hang
    out.update(error=repr(exc)[:300])
out["seconds"] = time.monotonic() - t
print(json.dumps(out))
"""
REQUEST_TIMEOUT = 120  # the request after the kill: an answer of any kind within this, or it hung


def test_killing_one_decode_tp_worker_restarts_the_pair_in_order(tp2, baseline_outputs):
    """SIGKILL of decode's TP rank 1 worker only (its engine core and rank 0 are not touched): the pair fails visibly
    and the operator restarts it in order to a new generation that serves like the TP = 1 engine again."""
    from kubernetes import client

    cluster, ns = tp2.cluster, tp2.namespace
    status = tp2.pair()["status"]
    assert status["phase"] == "Ready", status
    g1, restarts_before = int(status["pairGeneration"]), int(status.get("restarts") or 0)
    old = {role: p["metadata"]["name"] for role, p in tp2.pods().items()}

    # The victim by vLLM's process title: the engine core (a child of the API server, PID 1) runs one worker per TP
    # rank as its children, titled VLLM::Worker_TP<rank>.
    processes = container_processes(cluster, ns, old[ROLE_DECODE])
    table = json.dumps(processes, indent=1)
    title = {p["pid"]: (p["cmdline"].split() or [""])[0] for p in processes}
    cores = [p for p in processes if p["ppid"] == 1 and title[p["pid"]] == "VLLM::EngineCore"]
    assert len(cores) == 1, f"one VLLM::EngineCore under PID 1 expected in {old[ROLE_DECODE]}:\n{table}"
    core = cores[0]
    workers = {title[p["pid"]]: p for p in processes if p["ppid"] == core["pid"]
               and title[p["pid"]].startswith("VLLM::Worker")}
    assert sorted(workers) == [f"VLLM::Worker_TP{r}" for r in range(TP)], f"one worker per TP rank expected:\n{table}"
    victim = workers[f"VLLM::Worker_TP{TP - 1}"]["pid"]

    api = cluster.api_client()
    pods = Recorder(api, client.CoreV1Api(api).list_namespaced_pod, ns)
    pairs = Recorder(api, client.CustomObjectsApi(api).list_namespaced_custom_object, GROUP, VERSION, ns, PLURAL)
    try:
        t_kill = time.monotonic()
        # The image has no kill(1): os.kill from inside the container, as the engine's own user.
        cluster.kubectl("exec", "-n", ns, old[ROLE_DECODE], "-c", "engine", "--", "python", "-c",
                        f"import os, signal; os.kill({victim}, signal.SIGKILL)")
        print(f"\n[realnode-e2e] tp2: SIGKILL to {old[ROLE_DECODE]}'s VLLM::Worker_TP{TP - 1} (pid {victim} in the "
              f"container; engine core pid {core['pid']})")

        # A client right after the kill gets an answer (an error, or the right text) within bounded time.
        svc = json.loads(cluster.kubectl("get", "service", NAME, "-n", ns, "-o", "json").stdout)
        url = f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}/v1/completions"
        proc = cluster.node_exec(PREFILL_NODE, [sys.executable, "-c", _ONE_REQUEST_SNIPPET, url, SERVED_NAME,
                                                PROMPTS[0], str(REQUEST_TIMEOUT)], timeout=REQUEST_TIMEOUT + 60)
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"[realnode-e2e] tp2: a request {time.monotonic() - t_kill:.1f}s after the kill: {answer}")
        assert not answer["timed_out"], f"the request hung for {REQUEST_TIMEOUT}s: {answer}\n{tp2.diagnose()}"
        served = answer["status"] == 200 and answer["finish_reason"] != "error"
        assert not served or answer["text"] == baseline_outputs[PROMPTS[0]], (answer, baseline_outputs[PROMPTS[0]])

        # The pair reports it: the operator records the restart (status first, before it touches a pod).
        def restarted() -> dict:
            st = tp2.pair().get("status") or {}
            return st if int(st.get("restarts") or 0) > restarts_before else {}

        recorded = wait_for(restarted, 300, "status.restarts to count the restart", diagnose=tp2.diagnose, interval=1.0)
        t_recorded = time.monotonic()
        # Two TP = 2 engine starts one after the other, as at apply.
        ready = wait_for(lambda: (lambda st: st if st.get("phase") == "Ready" and int(st.get("pairGeneration") or 0)
                                  == g1 + 1 else None)(tp2.pair().get("status") or {}),
                         2 * ENGINE_START_TIMEOUT, f"the pair Ready at generation {g1 + 1}", diagnose=tp2.diagnose,
                         interval=1.0)
        t_ready = time.monotonic()
        new = tp2.pods()
        first = completion(cluster, PREFILL_NODE, svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["port"],
                           PROMPTS[0])
        t_first = time.monotonic()
        outputs = {PROMPTS[0]: first, **{p: completion(cluster, DECODE_NODE, svc["spec"]["clusterIP"],
                                                       svc["spec"]["ports"][0]["port"], p) for p in PROMPTS[1:]}}
    finally:
        pods.stop()
        pairs.stop()
    assert pods.error is None and pairs.error is None, (pods.error, pairs.error)
    print(f"[realnode-e2e] tp2 worker kill: -> restart recorded {t_recorded - t_kill:.1f}s, -> Ready at generation "
          f"{g1 + 1} {t_ready - t_kill:.1f}s, -> first completion {t_first - t_kill:.1f}s")

    # Exactly one restart, to the next generation, for the reason the operator derives from the ended decode pod.
    assert int(ready["restarts"] or 0) == restarts_before + 1 == int(recorded["restarts"]), (recorded, ready)
    assert int(recorded["pairGeneration"]) == g1 + 1, recorded
    pod_log = [(rv, kind, p) for _, rv, kind, p in pods.events]
    timeline = "\n".join(f"{rv} {kind:8} {p['metadata']['name']:24} {p['status'].get('phase')} "
                         f"deleting={bool(p['metadata'].get('deletionTimestamp'))}" for rv, kind, p in pod_log)
    # Fails visibly: vLLM exits when a worker dies, so decode's container ends (restartPolicy Never: the pod ends).
    ended = next(((rv, p) for rv, _, p in pod_log if p["metadata"]["name"] == old[ROLE_DECODE]
                  and p["status"].get("phase") in ("Failed", "Succeeded")
                  and not p["metadata"].get("deletionTimestamp")), None)
    assert ended is not None, f"the old decode pod never ended before its deletion:\n{timeline}"
    reason = pod_fact(ROLE_DECODE, ended[1]).message
    print(f"[realnode-e2e] tp2 worker kill: status.lastRestart.reason {ready['lastRestart']['reason']!r}")
    assert ready["lastRestart"]["reason"] == reason, (ready["lastRestart"], reason)
    events = json.loads(cluster.kubectl("get", "events", "-n", ns, "--field-selector",
                                        f"involvedObject.name={NAME},reason=Restarting", "-o", "json").stdout)["items"]
    assert [e["message"] for e in events] == [f"ordered restart to generation {g1 + 1}: {reason}"], events
    assert all(cs.get("restartCount", 0) == 0 for _, _, p in pod_log
               for cs in p["status"].get("containerStatuses") or []), timeline

    # Restarted in order, by resourceVersion: the decode pod ended, the restart was recorded, the old front pods were
    # gone before the old decode was deleted, the new decode was created before the new prefill (which starts beside
    # it), and the new decode listened on both rank ports (the operator's probe) before the pair was Ready again.
    def rv_of(name: str, pred, what: str) -> int:
        found = next((rv for rv, kind, p in pod_log if p["metadata"]["name"] == name and pred(kind, p)), None)
        assert found is not None, f"{what} ({name}) not in the pod watch:\n{timeline}"
        return found

    def deleting(kind, p):
        return kind == "DELETED" or bool(p["metadata"].get("deletionTimestamp"))

    recorded_rv = next(rv for _, rv, _, p in pairs.events if int((p.get("status") or {}).get("restarts") or 0)
                       > restarts_before)
    assert {p["metadata"]["labels"][LABEL_GENERATION] for p in new.values()} == {str(g1 + 1)}, new
    names = {role: p["metadata"]["name"] for role, p in new.items()}
    listening = listening_since(pairs.events, g1 + 1)
    assert listening is not None, f"no pair status with DecodeListening True for generation {g1 + 1}"
    order = [
        ("old decode ended", ended[0]),
        ("restart recorded", recorded_rv),
        ("old prefill deleting", rv_of(old[ROLE_PREFILL], deleting, "old prefill deleting")),
        ("old prefill gone", rv_of(old[ROLE_PREFILL], lambda k, _: k == "DELETED", "old prefill gone")),
        ("old decode deleting", rv_of(old[ROLE_DECODE], deleting, "old decode deleting")),
        ("old decode gone", rv_of(old[ROLE_DECODE], lambda k, _: k == "DELETED", "old decode gone")),
        ("new decode created", rv_of(names[ROLE_DECODE], lambda k, _: k == "ADDED", "new decode created")),
        ("new prefill created", rv_of(names[ROLE_PREFILL], lambda k, _: k == "ADDED", "new prefill created")),
    ]
    ready_rv = next(rv for _, rv, _, p in pairs.events if (p.get("status") or {}).get("phase") == "Ready"
                    and int(p["status"].get("pairGeneration") or 0) == g1 + 1)
    assert dict(order)["new decode created"] < listening[1] <= ready_rv, (order, listening, ready_rv)
    router_gone = rv_of(old[ROLE_ROUTER], lambda k, _: k == "DELETED", "old router gone")
    assert [what for what, _ in sorted(order, key=lambda x: x[1])] == [what for what, _ in order], \
        f"{order}\n{timeline}"
    assert router_gone < dict(order)["old decode deleting"], (router_gone, order, timeline)
    # The probe that opened the gate named both of the new decode's rank ports.
    pair_then = next(p for _, rv, _, p in pairs.events if rv == listening[1])
    side = ports_of(pair_then["status"]["ports"], ROLE_DECODE, PURPOSE_SIDECHANNEL)
    assert len(side) == TP and side == list(range(side[0], side[0] + TP)), pair_then["status"]["ports"]
    condition = next(c for c in pair_then["status"]["conditions"] if c["type"] == COND_DECODE_LISTENING)
    assert condition["message"] == ProbeResult(new[ROLE_DECODE]["status"]["podIP"], tuple(side), ()).message, \
        (condition, side)

    # Serving again at TP = 2.
    for role in (ROLE_DECODE, ROLE_PREFILL):
        command = new[role]["spec"]["containers"][0]["command"]
        assert command[command.index("--tensor-parallel-size") + 1] == str(TP), command
    expected = {p: baseline_outputs[p] for p in PROMPTS}
    assert outputs == expected, f"generation {g1 + 1} outputs differ from the TP = 1 engine:\n{outputs}\n{expected}"


def test_deleting_the_tp2_pair_removes_its_pods_and_releases_its_leases(tp2):
    uid = tp2.pair()["metadata"]["uid"]
    selector = f"{LABEL_PORT_LEASE}=true,{LABEL_PAIR_UID}={uid}"

    def leases() -> list[str]:
        items = json.loads(tp2.cluster.kubectl("get", "leases", "-n", OPERATOR_NS, "-l", selector,
                                               "-o", "json").stdout)["items"]
        return [lease["metadata"]["name"] for lease in items]

    held = leases()
    # decode and prefill: side channel (TP each), metrics, http; the router's http.
    assert len(held) == 2 * (TP + 2) + 1, held
    tp2.cluster.kubectl("delete", f"{PLURAL}.{GROUP}", NAME, "-n", tp2.namespace, "--wait=true", "--timeout=120s",
                        timeout=150)
    wait_for(lambda: not json.loads(tp2.cluster.kubectl("get", "pods", "-n", tp2.namespace, "-o", "json").stdout)
             ["items"], 120, "the pair's pods to go", diagnose=lambda: describe(tp2.cluster, tp2.namespace),
             interval=1.0)
    wait_for(lambda: not leases(), 60, f"the pair's port leases released (held: {held})",
             diagnose=lambda: str(leases()), interval=1.0)
    print(f"[realnode-e2e] tp2 module wall time (after the session fixtures): {time.monotonic() - tp2.t_module:.1f}s")

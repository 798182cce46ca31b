"""xPyD on the real control plane (kwok nodes, IP 127.0.0.1; the operator under the chart's ServiceAccount and RBAC):
one InferencePair with several prefill and decode instances. What is checked against the real apiserver:
  - every instance has its own ports (cluster-unique: the Leases are exactly status.ports, no port twice);
  - every prefill is created while a decode of its generation runs, and told every running decode (PDPAIR_PEERS);
  - the operator pushes the changed sets, with the pair's Secret's token: each prefill its decodes and the router
    its Ready instances (the test serves the push endpoints on the pods' leased ports, as the connector and the
    router would);
  - the pair's side-channel key is a Secret of its own (not the push token), owned by the pair, referenced by every
    engine pod and never by the router (read back from the API; no extra wait);
  - scale up through the role's scale object (`/scale`, as kubectl scale and an HPA do: decode 3 -> 4) leaves every existing pod alone and keeps the pair Ready; scale down (4 -> 2) drains
    the highest instances first (out of every push), deletes them as soon as the router (the test's stand-in,
    answering `involved` 0 for every instance, to PUT and GET) no longer lists them, well before
    spec.rollout.drainSeconds (30), and releases their ports only once they are gone; P and D in status;
  - an operator SIGKILLed mid-scale converges after its restart without a duplicate pod or port.
Cost: about 60-90 s on the shared kwok cluster (one operator subprocess, no engine, 0 vLLM cold starts).
"""

from __future__ import annotations

import base64
import collections
import socket
import time

import pytest

from pdpair.contract import (
    ANNOTATION_DRAINING_SINCE,
    ENV_PEER_HOST,
    ENV_PEERS,
    LABEL_INSTANCE,
    LABEL_ROLE,
    LEASE_NAME_PREFIX,
    SIDE_CHANNEL_SECRET_KEY,
    ENV_SIDE_CHANNEL_KEY,
)
from pdpair.operator.build.pods import peers_secret_name, side_channel_secret_name
from tests.e2e.operator_helpers import (
    Api, PodRecorder, PushReceiver, cleanup_pairs, operator, pair_diagnosis, pool_of_free_ports,
)
from devcluster.waiting import wait_for

pytestmark = pytest.mark.cluster

PEERS_PATH = "/pdpair/v1/peers"


def port_named(pair, name):
    return next(p["port"] for p in pair["status"]["ports"] if p["name"] == name)


def pods_by_role(api, ns):
    out = collections.defaultdict(dict)
    for pod in api.pods(ns):
        labels = pod["metadata"]["labels"]
        if pod["metadata"].get("deletion_timestamp"):
            continue
        out[labels[LABEL_ROLE]][int(labels.get(LABEL_INSTANCE, "0"))] = pod
    return out


def env_of(pod):
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def scale(api, ns, role_object, replicas):
    """What `kubectl scale ipr/<name> --replicas=N` does: the role object's /scale subresource (its count wins over
    the pair's inline spec.<role>.replicas once it exists)."""
    api.custom.patch_namespaced_custom_object_scale("pdpair.io", "v1alpha1", ns, "inferencepairroles", role_object,
                                                    {"spec": {"replicas": replicas}})


def check_ports(api, ns, pair):
    """status.ports is exactly the pair's Leases and lists no port twice."""
    ports = [p["port"] for p in pair["status"]["ports"]]
    assert len(ports) == len(set(ports)), f"a port listed twice: {sorted(ports)}"
    leased = {int(lease.metadata.name.removeprefix(LEASE_NAME_PREFIX)) for lease in api.leases(ns)}
    assert set(ports) == leased
    return set(ports)


def test_a_2p3d_pair_scales_and_tells_every_pod_its_set(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    receivers: dict[int, PushReceiver] = {}
    listeners: list[socket.socket] = []

    def serve(port, router=False):
        if port not in receivers:
            receivers[port] = PushReceiver(port, router)
        return receivers[port]

    def listen(port):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(16)
        listeners.append(sock)

    recorder = PodRecorder(api, ns)
    try:
        with operator(platform, ns, pool_of_free_ports(80), tmp_path) as proc:
            api.create_pair(ns, "xp", router={"enabled": True}, prefill={"replicas": 2}, decode={"replicas": 3},
                            rollout={"drainSeconds": 30})
            pair = wait_for(lambda: (lambda p: p if (p.get("status") or {}).get("ports") else None)(api.pair(ns, "xp")),
                            60, "ports leased")
            # The decode listener of instance 0 (the operator's Ready gate) and the push endpoints of every prefill
            # (metrics port) and of the router (http port), on the leased ports, before the pods exist.
            listen(port_named(pair, "decode-sidechannel-0"))
            for name in ("prefill-metrics-0", "prefill-metrics-0-i1", "router-http-0", "router-http-0-i1"):
                serve(port_named(pair, name), router=name.startswith("router"))
            ready = wait_for(lambda: (lambda p: p if (p.get("status") or {}).get("phase") == "Ready" and
                                      p["status"].get("decode", {}).get("readyOfDesired") == "3/3" and
                                      p["status"].get("prefill", {}).get("readyOfDesired") == "2/2" else None)(
                api.pair(ns, "xp")), 90, "Ready with 2/2 prefill and 3/3 decode", interval=0.2,
                diagnose=lambda: pair_diagnosis(api, ns, 'xp', proc))
            ports = check_ports(api, ns, ready)
            assert len(ports) == 3 * (2 + 3) + 2  # TP 1: side channel, metrics, http per instance; two routers' ports
            pods = pods_by_role(api, ns)
            assert sorted(pods["decode"]) == [0, 1, 2] and sorted(pods["prefill"]) == [0, 1]
            assert [p["metadata"]["name"] for _, p in sorted(pods["decode"].items())] == [
                "xp-decode-g1", "xp-decode-g1-1", "xp-decode-g1-2"]
            # Each prefill was created beside the decodes (parallel start) and told at creation the decodes that
            # had an address then, if any; the push tells it the rest (below)
            decodes = {f"127.0.0.1:{port_named(ready, name)}" for name in
                       ("decode-sidechannel-0", "decode-sidechannel-0-i1", "decode-sidechannel-0-i2")}
            for prefill in pods["prefill"].values():
                env = env_of(prefill)
                told = set((env.get(ENV_PEERS) or "").split(",")) if env.get(ENV_PEERS) else {
                    f"{env[ENV_PEER_HOST]}:{env['PDPAIR_PEER_PORT_BASE']}"} if env.get(ENV_PEER_HOST) else set()
                assert told <= decodes
            order = recorder.created()
            assert order.index("xp-decode-g1") < order.index("xp-prefill-g1")
            # Pushes: every prefill ends up told all three decodes; the router its five Ready instances; all with
            # the pair's own token
            secret = api.core.read_namespaced_secret(peers_secret_name("xp"), ns)
            token = base64.b64decode(secret.data["token"]).decode()
            # The side-channel key: a Secret of its own, owned by the pair, not the push token; every engine pod
            # takes it by secretKeyRef, the router never (it must not be able to pair as a prefill)
            side_secret = api.core.read_namespaced_secret(side_channel_secret_name("xp"), ns)
            side_key = base64.b64decode(side_secret.data[SIDE_CHANNEL_SECRET_KEY]).decode()
            assert len(side_key) == 43 and side_key != token
            assert [o.uid for o in side_secret.metadata.owner_references] == [ready["metadata"]["uid"]]
            for role, by_instance in pods_by_role(api, ns).items():
                for instance_pod in by_instance.values():
                    refs = {e["name"]: (e.get("value_from") or {}).get("secret_key_ref")
                            for e in instance_pod["spec"]["containers"][0]["env"]}
                    if role == "router":
                        assert ENV_SIDE_CHANNEL_KEY not in refs
                    else:
                        assert (refs[ENV_SIDE_CHANNEL_KEY]["name"], refs[ENV_SIDE_CHANNEL_KEY]["key"]) == (
                            side_channel_secret_name("xp"), SIDE_CHANNEL_SECRET_KEY), role

            def prefill_sets():
                out = []
                for name in ("prefill-metrics-0", "prefill-metrics-0-i1"):
                    last = receivers[port_named(ready, name)].last()
                    out.append({f"{d['host']}:{d['portBase']}" for d in last[2]["decodes"]} if last else None)
                return out

            def router_set():
                last = receivers[port_named(ready, "router-http-0")].last()
                return None if last is None else (len(last[2]["prefills"]), len(last[2]["decodes"]))

            def told_all():
                sets = prefill_sets()
                return all(s == decodes for s in sets if s is not None) and router_set() == (2, 3)

            # A prefill is pushed every decode it was not told at creation; the router needs one (it starts with
            # instance 0 of each role)
            wait_for(told_all, 30, "the router told its five Ready instances")
            for receiver in receivers.values():
                for path, auth, _ in receiver.received:
                    assert path == PEERS_PATH and auth == f"Bearer {token}"

            # Scale up: decode 3 -> 4. No existing pod is touched, the pair stays Ready, both prefills are told.
            uids = {p["metadata"]["uid"] for role in pods.values() for p in role.values()}
            scale(api, ns, "xp-decode", 4)
            scaled = wait_for(lambda: (lambda p: p if p["status"].get("decode", {}).get("readyOfDesired") == "4/4"
                                       else None)(api.pair(ns, "xp")), 60, "4/4 decode", interval=0.2)
            assert scaled["status"]["phase"] == "Ready"
            decodes.add(f"127.0.0.1:{port_named(scaled, 'decode-sidechannel-0-i3')}")
            wait_for(lambda: prefill_sets() == [decodes, decodes] and router_set() == (2, 4), 30,
                     "both prefills told four decodes, the router four")
            now_uids = {p["metadata"]["uid"] for role in pods_by_role(api, ns).values() for p in role.values()}
            assert uids < now_uids
            check_ports(api, ns, scaled)

            # Scale down: decode 4 -> 2. Instances 3 and 2 drain (out of every push) and go as soon as the router
            # answers that it no longer lists them and nothing involves them (its PUT answer, then GETs), well
            # before drainSeconds (30); their ports are released once they are gone.
            # An idle drain ends within a pass or two of its mark: a marked pod may be gone before a poll sees its
            # annotation, so the marks are checked in the pods seen, the operator's InstanceDraining Events and the
            # router's pushes (each drained decode left the router's set before it was deleted).
            scale_down_at = time.monotonic()
            scale(api, ns, "xp-decode", 2)
            marked: set[int] = set()

            def decode_down():
                decodes_now = pods_by_role(api, ns)["decode"]
                marked.update(i for i, p in decodes_now.items()
                              if ANNOTATION_DRAINING_SINCE in (p["metadata"].get("annotations") or {}))
                p = api.pair(ns, "xp")
                return p if (p["status"].get("decode", {}).get("desired") == 2 and sorted(decodes_now) == [0, 1] and
                             len(p["status"]["ports"]) == 3 * (2 + 2) + 2) else None

            down = wait_for(decode_down, 60, "decode 2/2 with the drained instances' ports released", interval=0.2,
                            diagnose=lambda: pair_diagnosis(api, ns, 'xp', proc))
            drained_in = time.monotonic() - scale_down_at
            assert marked <= {2, 3}, marked
            assert drained_in < 20, f"the drain took {drained_in:.1f} s: the router's counts were not used (the " \
                                    f"deadline is 30 s)\n{pair_diagnosis(api, ns, 'xp', proc)}"
            two = {f"127.0.0.1:{port_named(scaled, name)}" for name in ("decode-sidechannel-0",
                                                                        "decode-sidechannel-0-i1")}
            wait_for(lambda: prefill_sets() == [two, two] and router_set() == (2, 2), 30,
                     "the drained decodes out of every push")
            wait_for(lambda: {e.message.split(":")[0] for e in api.events(ns) if e.reason == "InstanceDraining"} >=
                     {"xp-decode-g1-2", "xp-decode-g1-3"}, 30, "an InstanceDraining Event for each drained decode")
            router_receiver = receivers[port_named(ready, "router-http-0")]
            assert all(auth == f"Bearer {token}" for _, auth in router_receiver.reads)
            for instance in (2, 3):
                url = f"http://127.0.0.1:{port_named(scaled, f'decode-http-0-i{instance}')}"
                left = next(at for at, (_, _, body) in zip(router_receiver.put_times, router_receiver.received)
                            if at > scale_down_at and url not in {d["url"] for d in body["decodes"]})
                gone = next(at for at, kind, name in recorder.events
                            if kind == "delete" and name == f"xp-decode-g1-{instance}")
                assert left < gone, f"decode {instance} deleted before the router was told it left"
            check_ports(api, ns, down)
            assert down["status"]["phase"] == "Ready"
            deleted = [e for e in recorder.order() if e.startswith("delete")]
            assert deleted and all("decode-g1-2" in e or "decode-g1-3" in e for e in deleted), deleted

            # SIGKILL mid-scale: prefill 2 -> 4, the operator killed once the first new prefill exists
            scale(api, ns, "xp-prefill", 4)
            wait_for(lambda: 2 in pods_by_role(api, ns)["prefill"], 30, "prefill instance 2")
            proc.kill()
            proc.start()
            final = wait_for(lambda: (lambda p: p if p["status"].get("prefill", {}).get("readyOfDesired") == "4/4"
                                      else None)(api.pair(ns, "xp")), 90, "4/4 prefill after the restart", interval=0.3)
            wait_for(lambda: len(api.pods(ns)) >= 4 + 2 + 2, 30, "both router replicas")
            names = [p["metadata"]["name"] for p in api.pods(ns)]
            assert len(names) == len(set(names)) == 4 + 2 + 2  # prefills, decodes, two router replicas
            check_ports(api, ns, final)
            cleanup_pairs(api, ns)
            assert api.leases(ns) == []
    finally:
        recorder.stop()
        for receiver in receivers.values():
            receiver.close()
        for sock in listeners:
            sock.close()


def test_an_8p8d_pair_starts_with_every_port_its_own(platform, cluster_namespace, tmp_path):
    """8 prefill and 8 decode instances on kwok (TP 2: two side channels per instance): 16 engine pods and a router,
    8 * 2 * 4 + 1 = 65 ports, none twice, Leases equal to status; every prefill created while a decode of its
    generation ran; the time from apply to 8/8 and 8/8 printed (the kwok figure of the xPyD issue's closing note).
    Cost: about 15 s."""
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    recorder = PodRecorder(api, ns)
    listener = None
    try:
        with operator(platform, ns, pool_of_free_ports(100), tmp_path) as proc:
            started = time.monotonic()
            api.create_pair(ns, "big", router={"enabled": True}, prefill={"replicas": 8, "tensorParallelSize": 2},
                            decode={"replicas": 8, "tensorParallelSize": 2})
            pair = wait_for(lambda: (lambda p: p if (p.get("status") or {}).get("ports") else None)(api.pair(ns, "big")),
                            60, "ports leased")
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port_named(pair, "decode-sidechannel-0")))
            listener.listen(16)
            second = socket.socket()  # rank 1 of decode instance 0: the probe asks every rank
            second.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            second.bind(("127.0.0.1", port_named(pair, "decode-sidechannel-1")))
            second.listen(16)
            try:
                ready = wait_for(lambda: (lambda p: p if p["status"].get("decode", {}).get("readyOfDesired") == "8/8"
                                          and p["status"].get("prefill", {}).get("readyOfDesired") == "8/8"
                                          and p["status"].get("phase") == "Ready" else None)(api.pair(ns, "big")),
                                 120, "8/8 and 8/8, Ready", interval=0.2,
                                 diagnose=lambda: pair_diagnosis(api, ns, 'xp', proc))
            finally:
                second.close()
            print(f"\n8P8D (TP 2) on kwok: apply -> 8/8 prefill, 8/8 decode, Ready in {time.monotonic() - started:.1f}s")
            ports = check_ports(api, ns, ready)
            assert len(ports) == 8 * 2 * (2 + 2) + 2
            created = recorder.created()
            first_decode = created.index("big-decode-g1")
            assert all(created.index(f"big-prefill-g1{'' if i == 0 else f'-{i}'}") > first_decode for i in range(8))
            cleanup_pairs(api, ns)
            assert api.leases(ns) == []
    finally:
        recorder.stop()
        if listener is not None:
            listener.close()

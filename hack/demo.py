#!/usr/bin/env python3
"""The demo (`bash hack/demo.sh`): a local control plane, the chart's CRD and RBAC, the operator under its
ServiceAccount, and examples/inferencepair.yaml walking through its phases to Ready. Then everything is cleaned up.

No engine runs on kwok's fake nodes, so nothing would ever listen on decode's side-channel port. The demo opens that
listener itself (a plain TCP socket on 127.0.0.1) to show the pair held back until it listens (prefill is created
beside the running decode and the router beside them, but no Ready), and says so when it does.
"""

from __future__ import annotations

import argparse
import pathlib
import socket
import sys
import threading
import time

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdpair.contract import GROUP, LABEL_PAIR_UID, LABEL_PORT_LEASE, PLURAL, VERSION  # noqa: E402
from devcluster import operator_process  # noqa: E402
from devcluster.build import helm_path  # noqa: E402
from devcluster.localcluster import LocalCluster  # noqa: E402

OPERATOR_NS = "pdpair-system"
EXAMPLE = ROOT / "examples" / "inferencepair.yaml"
GATE_HOLD_SECONDS = 4.0


def say(text: str, started: float) -> None:
    print(f"[{time.monotonic() - started:6.1f}s] {text}", flush=True)


def print_phases(custom, ns: str, name: str, started: float, stop: threading.Event) -> None:
    """Print every phase/message change as the apiserver's watch delivers it (no poll can miss one)."""
    from kubernetes import watch

    seen = None
    while not stop.is_set():
        w = watch.Watch()
        try:
            for ev in w.stream(custom.list_namespaced_custom_object, GROUP, VERSION, ns, PLURAL,
                               field_selector=f"metadata.name={name}", timeout_seconds=5):
                status = ev["object"].get("status") or {}
                now = (status.get("phase"), status.get("message"))
                if status.get("phase") and now != seen:
                    seen = now
                    say(f"phase {now[0]}: {now[1]} (pairGeneration {status.get('pairGeneration')})", started)
                if stop.is_set():
                    w.stop()
        except Exception:  # the stream ends when the pair or the cluster goes away
            time.sleep(0.2)


def free_range(size: int) -> str:
    """A free range below the ephemeral ports (the chart refuses a pool inside them: see charts/pdpair/README.md)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_first = int(f.read().split()[0])
    for start in range(22000, ephemeral_first - size, size):
        ok = True
        for port in range(start, start + size):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return f"{start}-{start + size - 1}"
    raise SystemExit("no free port range on 127.0.0.1 for the operator's pool")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for Ready")
    args = parser.parse_args()
    started = time.monotonic()
    pair_doc = yaml.safe_load(EXAMPLE.read_text())
    name, ns = pair_doc["metadata"]["name"], pair_doc["metadata"].get("namespace", "default")

    with LocalCluster(log=lambda line: say(line, started)) as cluster:
        from kubernetes import client

        api = cluster.api_client()
        custom, core, coord = client.CustomObjectsApi(api), client.CoreV1Api(api), client.CoordinationV1Api(api)
        cluster.add_node("demo-node", ip="127.0.0.1")
        say("fake node demo-node is Ready (kwok; InternalIP 127.0.0.1)", started)
        operator_process.install_crd(cluster)
        kubeconfig = operator_process.install_operator_rbac(cluster, helm_path(), OPERATOR_NS)
        say(f"installed the chart's CRD and RBAC; the operator runs as its ServiceAccount in {OPERATOR_NS}", started)
        # No engine means no pod /metrics either: keep the health watch from judging that as a failure.
        operator = operator_process.OperatorProcess(kubeconfig, OPERATOR_NS, free_range(50), pathlib.Path("/tmp/pdpair-demo-operator.log"),
                                          extra_env={"PDPAIR_HEALTH_INTERVAL_SECONDS": "3600"})
        operator.start()
        say(f"operator running (pid {operator.proc.pid}, log {operator.log_path})", started)
        listener = None
        try:
            stop_printing = threading.Event()
            printer = threading.Thread(target=print_phases, args=(custom, ns, name, started, stop_printing), daemon=True)
            printer.start()
            cluster.kubectl("apply", "-f", str(EXAMPLE))
            say(f"applied {EXAMPLE.relative_to(ROOT)}: InferencePair {ns}/{name}", started)
            phase, message, gate_seen = None, None, None
            deadline = time.monotonic() + args.timeout
            while time.monotonic() < deadline:
                pair = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
                status = pair.get("status") or {}
                phase, message = status.get("phase"), status.get("message")
                if phase == "Ready":
                    time.sleep(0.5)  # let the watch print the last change
                    stop_printing.set()
                    break
                side = [p["port"] for p in status.get("ports") or [] if p.get("name") == "decode-sidechannel-0"]
                waiting = phase in ("DecodeStarting", "PrefillStarting") and "does not accept" in (message or "")
                if listener is None and side and waiting:
                    gate_seen = gate_seen or time.monotonic()
                    if time.monotonic() - gate_seen >= GATE_HOLD_SECONDS:
                        pods = [p.metadata.name for p in core.list_namespaced_pod(
                            ns, label_selector=f"{LABEL_PAIR_UID}={pair['metadata']['uid']}").items]
                        say(f"held for {GATE_HOLD_SECONDS:.0f}s: pods are {pods} (prefill and the router start beside "
                            f"decode), no Ready while nothing listens on decode's side-channel port {side[0]}",
                            started)
                        say("NOTE: no engine runs on kwok nodes, so the DEMO ITSELF now opens a TCP listener on "
                            f"127.0.0.1:{side[0]} standing in for decode's KV side channel", started)
                        listener = socket.socket()
                        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                        listener.bind(("127.0.0.1", side[0]))
                        listener.listen(16)
                time.sleep(0.2)
            else:
                stop_printing.set()
                say(f"the pair did not reach Ready within {args.timeout:.0f}s; operator log:\n{operator.log_tail()}",
                    started)
                return 1
            for p in core.list_namespaced_pod(ns, label_selector=f"{LABEL_PAIR_UID}={pair['metadata']['uid']}").items:
                say(f"  pod {p.metadata.name}: {p.status.phase} on {p.spec.node_name} ({p.status.pod_ip})", started)
            for p in status.get("ports") or []:
                say(f"  leased port {p['port']}: {p['role']} {p['purpose']} #{p['rank']}", started)
            events = [e for e in core.list_namespaced_event(ns).items if e.involved_object.name == name]
            for e in sorted(events, key=lambda e: e.metadata.creation_timestamp):
                say(f"  event {e.reason}: {e.message}", started)
            print(cluster.kubectl("get", "ipair", "-n", ns, "-o", "wide").stdout, flush=True)

            say("cleaning up: deleting the pair (pods go by ownerReference GC, leases by the finalizer)", started)
            cluster.kubectl("delete", "-f", str(EXAMPLE), "--wait=true", "--timeout=60s")
            leases = coord.list_namespaced_lease(OPERATOR_NS, label_selector=f"{LABEL_PORT_LEASE}=true").items
            say(f"pair deleted; {len(leases)} port leases left", started)
            return 0 if not leases else 1
        finally:
            if listener is not None:
                listener.close()
            operator.stop()
            say("operator stopped; stopping the control plane", started)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Real-node cluster setup (devcluster/realnode.py) against the kwok cluster (the baseline, same run).

Measures, with every binary and image already cached (the cold numbers are in docs/benchmarks.md):
- build check (all cached), control plane start, nodes Ready, pod Ready after `kubectl apply` (an imported
  image), image import into every node, teardown; the same start/stop for the kwok LocalCluster;
- the RSS of every node process (containerd, kubelet, kube-proxy, shims) and of the control plane.

    python tests/bench/bench_realnode.py [--nodes 2]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from devcluster.images import debian_base  # noqa: E402
from devcluster.localcluster import LocalCluster  # noqa: E402
from devcluster.realnode import RealNodeCluster  # noqa: E402
import quiet  # noqa: E402  (tests/bench/quiet.py: the load guard)


def rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def process_tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def comm(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=2)
    args = parser.parse_args()
    quiet.require_quiet("bench_realnode")  # exits when the box is too busy to measure

    t0 = time.monotonic()
    kwok = LocalCluster()
    kwok.start()
    kwok_start = time.monotonic() - t0
    t0 = time.monotonic()
    kwok.stop()
    kwok_stop = time.monotonic() - t0

    base = debian_base(log=lambda m: None)
    t0 = time.monotonic()
    cluster = RealNodeCluster(nodes=args.nodes)
    cluster.start()
    real_start = time.monotonic() - t0
    try:
        t0 = time.monotonic()
        cluster.import_image(base.archive)
        import_s = time.monotonic() - t0
        pods = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"p{i}"},
                 "spec": {"nodeName": node.name, "containers": [{
                     "name": "c", "image": base.ref, "imagePullPolicy": "Never", "command": ["sleep", "3600"]}]}}
                for i, node in enumerate(cluster.nodes)]
        t0 = time.monotonic()
        cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": pods}))
        cluster.kubectl("wait", "--for=condition=Ready", *[f"pod/p{i}" for i in range(len(pods))],
                        "--timeout=120s", timeout=130)
        pod_ready = time.monotonic() - t0
        rss: dict[str, float] = {}
        for node in cluster.nodes:
            for pid in process_tree(node.process.pid):
                name = comm(pid)
                if name in ("containerd", "kubelet", "kube-proxy", "containerd-shim"):
                    rss[name] = rss.get(name, 0.0) + rss_mib(pid)
        control_plane = {c.name: rss_mib(pid) for c in cluster._components
                         for pid in [c.process.pid] + process_tree(c.process.pid) if comm(pid) == c.name[:15]}
    finally:
        t0 = time.monotonic()
        cluster.stop()
        real_stop = time.monotonic() - t0
    left = cluster.leftovers()

    print(f"| step | real node ({args.nodes} nodes) | kwok baseline | ratio |")
    print("|---|---|---|---|")
    print(f"| start (build check, control plane, nodes Ready) | {real_start:.1f} s | {kwok_start:.1f} s | "
          f"{real_start / kwok_start:.2f} |")
    print(f"| stop | {real_stop:.1f} s | {kwok_stop:.1f} s | {real_stop / kwok_stop:.2f} |")
    print(f"\nreal-node start phases: {', '.join(f'{k} {v:.1f} s' for k, v in cluster.timings.items())}")
    print(f"image import ({base.archive.stat().st_size >> 20} MiB archive, {args.nodes} nodes): {import_s:.1f} s")
    print(f"{len(pods)} pods Ready after apply: {pod_ready:.1f} s")
    print("\n| process | RSS MiB (all nodes) |\n|---|---|")
    for name, value in sorted(rss.items()):
        print(f"| {name} | {value:.0f} |")
    for name, value in control_plane.items():
        print(f"| {name} (control plane) | {value:.0f} |")
    print(f"| total | {sum(rss.values()) + sum(control_plane.values()):.0f} |")
    print(f"\nleftovers after stop: {left or 'none'}")
    quiet.report_after("bench_realnode")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())

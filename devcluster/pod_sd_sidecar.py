"""Kubernetes pod discovery for a Prometheus built without it, as file_sd target files.

Debian's prometheus package is built without Kubernetes service discovery (its NEWS.Debian, 1.5.0+ds-1:
"Kubernetes support has been completely removed, due to the insane amount of dependencies in their client
library"; `kubernetes_sd_configs` fails to parse). This sidecar stands in for `kubernetes_sd_configs: [{role: pod}]`
only: it lists the pods (in-cluster config, the Prometheus pod's ServiceAccount, every `--interval` seconds) and
writes one target per container port with the meta labels Prometheus' own pod role produces
(`__meta_kubernetes_namespace`, `__meta_kubernetes_pod_*`, `__meta_kubernetes_pod_container_*`). The scrape job's
relabel rules, translated from the chart's PodMonitor, then select and label targets exactly as they would with
Prometheus' pod role.

Runs in the operator image (Python + the kubernetes client):
    python pod_sd_sidecar.py --out DIR --job FILE=NS1,NS2 --job FILE2=*     (* : every namespace)
Stdlib + kubernetes only; `pod_targets` is pure and unit-tested.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any, Iterable, Mapping

_INVALID_LABEL_CHARS = re.compile(r"[^a-zA-Z0-9_]")


def _name(text: str) -> str:
    return _INVALID_LABEL_CHARS.sub("_", text)


def _ready(status: Mapping[str, Any]) -> str:
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Ready":
            return "true" if cond.get("status") == "True" else "false"
    return "unknown"


def _address(ip: str, port: int | None) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return host if port is None else f"{host}:{port}"


def pod_targets(pod: Mapping[str, Any]) -> list[dict]:
    """file_sd groups for one pod (API JSON, camelCase), as Prometheus' kubernetes SD pod role builds them: one target
    per declared container port, one port-less target per container without ports; none before the pod has an IP."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    ip = status.get("podIP") or ""
    if not ip:
        return []
    common = {
        "__meta_kubernetes_namespace": meta.get("namespace", ""),
        "__meta_kubernetes_pod_name": meta.get("name", ""),
        "__meta_kubernetes_pod_ip": ip,
        "__meta_kubernetes_pod_ready": _ready(status),
        "__meta_kubernetes_pod_phase": status.get("phase", ""),
        "__meta_kubernetes_pod_node_name": spec.get("nodeName", ""),
        "__meta_kubernetes_pod_host_ip": status.get("hostIP", ""),
        "__meta_kubernetes_pod_uid": meta.get("uid", ""),
    }
    for key, value in (meta.get("labels") or {}).items():
        common[f"__meta_kubernetes_pod_label_{_name(key)}"] = value
        common[f"__meta_kubernetes_pod_labelpresent_{_name(key)}"] = "true"
    for key, value in (meta.get("annotations") or {}).items():
        common[f"__meta_kubernetes_pod_annotation_{_name(key)}"] = value
        common[f"__meta_kubernetes_pod_annotationpresent_{_name(key)}"] = "true"
    for owner in meta.get("ownerReferences") or []:
        if owner.get("controller"):
            common["__meta_kubernetes_pod_controller_kind"] = owner.get("kind", "")
            common["__meta_kubernetes_pod_controller_name"] = owner.get("name", "")
    groups = []
    for init, containers in ((False, spec.get("containers") or []), (True, spec.get("initContainers") or [])):
        for container in containers:
            labels = {**common, "__meta_kubernetes_pod_container_name": container.get("name", ""),
                      "__meta_kubernetes_pod_container_image": container.get("image", ""),
                      "__meta_kubernetes_pod_container_init": "true" if init else "false"}
            ports = container.get("ports") or []
            if not ports:
                if not init:
                    groups.append({"targets": [_address(ip, None)], "labels": labels})
                continue
            for port in ports:
                groups.append({"targets": [_address(ip, int(port["containerPort"]))], "labels": {
                    **labels, "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                    "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "TCP")}})
    return groups


def targets_for(pods: Iterable[Mapping[str, Any]], namespaces: set[str] | None) -> list[dict]:
    """Every target of `pods` in `namespaces` (None: all), in a stable order."""
    selected = [p for p in pods if namespaces is None or (p.get("metadata") or {}).get("namespace") in namespaces]
    selected.sort(key=lambda p: ((p.get("metadata") or {}).get("namespace", ""), (p.get("metadata") or {}).get("name", "")))
    return [group for pod in selected for group in pod_targets(pod)]


def write_atomically(path: str, groups: list[dict]) -> bool:
    """Writes `path` (rename, so Prometheus never reads half a file) if its content changes; True if it did."""
    text = json.dumps(groups, indent=1, sort_keys=True)
    try:
        with open(path) as fh:
            if fh.read() == text:
                return False
    except FileNotFoundError:
        pass
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return True


def parse_jobs(specs: list[str]) -> dict[str, set[str] | None]:
    jobs: dict[str, set[str] | None] = {}
    for spec in specs:
        file, sep, namespaces = spec.partition("=")
        if not sep or not file or not namespaces:
            raise SystemExit(f"--job {spec!r}: use FILE=NS1,NS2 or FILE=*")
        jobs[file] = None if namespaces == "*" else set(namespaces.split(","))
    return jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory of the target files (shared with Prometheus)")
    parser.add_argument("--job", action="append", default=[], help="FILE=NS1,NS2 or FILE=* (every namespace)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between pod lists")
    args = parser.parse_args(argv)
    jobs = parse_jobs(args.job)

    from kubernetes import client, config

    config.load_incluster_config()
    core = client.CoreV1Api()
    while True:
        try:
            resp = core.list_pod_for_all_namespaces(_preload_content=False, _request_timeout=10)
            pods = json.loads(resp.data)["items"]
            for file, namespaces in jobs.items():
                groups = targets_for(pods, namespaces)
                if write_atomically(os.path.join(args.out, file), groups):
                    print(f"{time.strftime('%H:%M:%S')} {file}: {sum(len(g['targets']) for g in groups)} targets",
                          flush=True)
        except Exception as exc:  # an apiserver hiccup: keep the last files, try again next interval
            print(f"{time.strftime('%H:%M:%S')} list pods failed: {type(exc).__name__}: {exc}", file=sys.stderr,
                  flush=True)
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())

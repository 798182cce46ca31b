#!/usr/bin/env python3
"""A Prometheus running as a pod in the real-node cluster, configured from the chart's monitoring objects.

prometheus-operator itself is NOT run. This harness does its job for the two objects the chart renders:
- the PodMonitor becomes a `kubernetes_sd_configs` (role: pod) scrape job with the relabel rules
  prometheus-operator v0.85.0 generates for a PodMonitor (`podmonitor_scrape_configs`: selector -> keep/drop rules on
  `__meta_kubernetes_pod_label*`, namespaceSelector -> `namespaces.names`, the endpoint's port name -> a keep rule on
  `__meta_kubernetes_pod_container_port_name`, path/interval/timeout, the namespace/container/pod/job/endpoint
  target labels, then the endpoint's own relabelings). Sharding (one shard) and the operator's other knobs are left
  out; a field this translation does not know raises `UnsupportedMonitorField` instead of being dropped silently.
- the PrometheusRule's `spec.groups` become a rules file, as prometheus-operator writes them into its rules ConfigMap.

The Prometheus binary is Debian's (`/usr/bin/prometheus` of the host's `prometheus` package, 2.42, the one hack/lib.sh
installs), put into an image on the project's Debian base (`prometheus_image()`: two layers, the base's and one with
the binary; cached by content hash like images.py). Debian builds it WITHOUT Kubernetes service discovery
(`kubernetes_sd_configs` does not parse), so `with_file_sd` swaps each job's `kubernetes_sd_configs` for a
`file_sd_configs` file that a sidecar (`pod_sd_sidecar.py`, in the operator image, with the pod's ServiceAccount and
a ClusterRole to get/list/watch pods) fills with the same per-container-port targets and `__meta_kubernetes_pod_*`
labels Prometheus' pod role would discover. The relabel rules, i.e. the PodMonitor's selection and labels, are
untouched. The tests reach Prometheus' HTTP API through `cluster.node_exec` (`InClusterPrometheus.api`).

    python devcluster/incluster_prometheus.py config [--set k=v ...]   # print the translated prometheus.yml
    python devcluster/incluster_prometheus.py image                    # build (or reuse) the image archive
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import sys
import tarfile
import tempfile
import time
from typing import Any, Callable, Mapping

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from devcluster.images import Image, _Lock, debian_base, images_dir  # noqa: E402
from devcluster.errors import BuildError  # noqa: E402
from devcluster.oci import write_oci_archive_from_files  # noqa: E402

PROMETHEUS_BINARY = pathlib.Path("/usr/bin/prometheus")
PROMETHEUS_PORT = 9090
PROMETHEUS_UID = 65534  # nobody
CONFIG_FILE = "prometheus.yml"
RULES_FILE = "pdpair-rules.yaml"
APP_LABEL = "pdpair-incluster-prometheus"

# prometheus-operator's sanitizeLabelName: every character outside [a-zA-Z0-9_] becomes "_".
_INVALID_LABEL_CHARS = re.compile(r"[^a-zA-Z0-9_]")

# What the translation understands; anything else in a PodMonitor raises (never silently ignored).
_SPEC_FIELDS = {"selector", "namespaceSelector", "podMetricsEndpoints", "podTargetLabels", "jobLabel"}
_ENDPOINT_FIELDS = {"port", "path", "interval", "scrapeTimeout", "scheme", "params", "honorLabels", "relabelings",
                    "metricRelabelings"}
_RELABEL_KEYS = {"sourceLabels": "source_labels", "separator": "separator", "targetLabel": "target_label",
                 "regex": "regex", "modulus": "modulus", "replacement": "replacement", "action": "action"}


class UnsupportedMonitorField(ValueError):
    """The PodMonitor uses something this translation does not implement (named in the message)."""


def sanitize_label_name(name: str) -> str:
    return _INVALID_LABEL_CHARS.sub("_", name)


def _relabel(config: Mapping[str, Any], where: str) -> dict:
    unknown = set(config) - set(_RELABEL_KEYS)
    if unknown:
        raise UnsupportedMonitorField(f"{where}: unknown relabel fields {sorted(unknown)}")
    out = {_RELABEL_KEYS[k]: v for k, v in config.items()}
    if "action" in out:
        out["action"] = str(out["action"]).lower()  # the CRD takes Replace or replace; Prometheus wants lower case
    return out


def _selector_rules(selector: Mapping[str, Any]) -> list[dict]:
    """A label selector as keep/drop rules on the pod's label (value) and labelpresent (true) meta labels."""
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise UnsupportedMonitorField(f"spec.selector: unknown fields {sorted(unknown)}")
    rules = []
    for key in sorted(selector.get("matchLabels") or {}):
        name = sanitize_label_name(key)
        rules.append({"action": "keep",
                      "source_labels": [f"__meta_kubernetes_pod_label_{name}", f"__meta_kubernetes_pod_labelpresent_{name}"],
                      "regex": f"({selector['matchLabels'][key]});true"})
    for expr in selector.get("matchExpressions") or []:
        name, op = sanitize_label_name(expr["key"]), expr["operator"]
        value_and_present = [f"__meta_kubernetes_pod_label_{name}", f"__meta_kubernetes_pod_labelpresent_{name}"]
        if op in ("In", "NotIn"):
            rules.append({"action": "keep" if op == "In" else "drop", "source_labels": value_and_present,
                          "regex": f"({'|'.join(expr.get('values') or [])});true"})
        elif op in ("Exists", "DoesNotExist"):
            rules.append({"action": "keep" if op == "Exists" else "drop",
                          "source_labels": [f"__meta_kubernetes_pod_labelpresent_{name}"], "regex": "true"})
        else:
            raise UnsupportedMonitorField(f"spec.selector.matchExpressions: unknown operator {op!r}")
    return rules


def _namespaces(namespace_selector: Mapping[str, Any] | None, own_namespace: str) -> list[str] | None:
    """None: every namespace (`any: true`); else the names to watch (an empty selector means the monitor's own)."""
    selector = dict(namespace_selector or {})
    if selector.get("any"):
        return None
    return list(selector.get("matchNames") or []) or [own_namespace]


def podmonitor_scrape_configs(podmonitor: Mapping[str, Any]) -> list[dict]:
    """The scrape jobs prometheus-operator would generate for this PodMonitor (one per podMetricsEndpoint)."""
    meta, spec = podmonitor["metadata"], podmonitor["spec"]
    unknown = set(spec) - _SPEC_FIELDS
    if unknown:
        raise UnsupportedMonitorField(f"PodMonitor spec fields not translated: {sorted(unknown)}")
    ns, name = meta["namespace"], meta["name"]
    sd: dict[str, Any] = {"role": "pod"}
    namespaces = _namespaces(spec.get("namespaceSelector"), ns)
    if namespaces is not None:
        sd["namespaces"] = {"names": namespaces}
    jobs = []
    for index, endpoint in enumerate(spec.get("podMetricsEndpoints") or []):
        where = f"spec.podMetricsEndpoints[{index}]"
        unknown = set(endpoint) - _ENDPOINT_FIELDS
        if unknown:
            raise UnsupportedMonitorField(f"{where}: fields not translated: {sorted(unknown)}")
        job: dict[str, Any] = {"job_name": f"podMonitor/{ns}/{name}/{index}",
                               "honor_labels": bool(endpoint.get("honorLabels", False)),
                               "kubernetes_sd_configs": [dict(sd)]}
        for src, dst in (("interval", "scrape_interval"), ("scrapeTimeout", "scrape_timeout"),
                         ("path", "metrics_path"), ("params", "params"), ("scheme", "scheme")):
            if endpoint.get(src):
                job[dst] = endpoint[src]
        rules: list[dict] = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
        # filterRunning (default true): finished pods are not scraped
        rules.append({"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"],
                      "regex": "(Failed|Succeeded)"})
        rules += _selector_rules(spec.get("selector") or {})
        if endpoint.get("port"):
            rules.append({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                          "regex": endpoint["port"]})
        rules += [
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        ]
        for label in spec.get("podTargetLabels") or []:
            rules.append({"source_labels": [f"__meta_kubernetes_pod_label_{sanitize_label_name(label)}"],
                          "target_label": sanitize_label_name(label), "regex": "(.+)", "replacement": "${1}"})
        rules.append({"target_label": "job", "replacement": f"{ns}/{name}"})
        if spec.get("jobLabel"):
            rules.append({"source_labels": [f"__meta_kubernetes_pod_label_{sanitize_label_name(spec['jobLabel'])}"],
                          "target_label": "job", "regex": "(.+)", "replacement": "${1}"})
        if endpoint.get("port"):
            rules.append({"target_label": "endpoint", "replacement": endpoint["port"]})
        rules += [_relabel(r, f"{where}.relabelings[{i}]") for i, r in enumerate(endpoint.get("relabelings") or [])]
        job["relabel_configs"] = rules
        if endpoint.get("metricRelabelings"):
            job["metric_relabel_configs"] = [_relabel(r, f"{where}.metricRelabelings[{i}]")
                                             for i, r in enumerate(endpoint["metricRelabelings"])]
        jobs.append(job)
    if not jobs:
        raise UnsupportedMonitorField(f"PodMonitor {ns}/{name} has no podMetricsEndpoints")
    return jobs


def rules_file(prometheus_rule: Mapping[str, Any]) -> dict:
    """A PrometheusRule's groups as a Prometheus rules file (what prometheus-operator mounts for it)."""
    return {"groups": list(prometheus_rule["spec"]["groups"])}


SD_DIR = "/sd"  # the sidecar's target files (an emptyDir shared by the two containers)
SD_REFRESH = "1s"


def with_file_sd(scrape_configs: list[dict]) -> tuple[list[dict], list[str]]:
    """The jobs with `kubernetes_sd_configs` (role pod) replaced by a file_sd file each, and the sidecar's `--job`
    arguments (FILE=namespaces) that fill those files."""
    jobs, sidecar_jobs = [], []
    for index, job in enumerate(scrape_configs):
        job = dict(job)
        sds = job.pop("kubernetes_sd_configs", None)
        if sds is None:
            jobs.append(job)
            continue
        if len(sds) != 1 or set(sds[0]) - {"role", "namespaces"} or sds[0]["role"] != "pod":
            raise UnsupportedMonitorField(f"job {job['job_name']}: only one role-pod kubernetes_sd_config is "
                                          f"supported by the discovery sidecar, got {sds}")
        names = (sds[0].get("namespaces") or {}).get("names")
        file = f"job{index}.json"
        sidecar_jobs.append(f"{file}={','.join(names) if names else '*'}")
        job["file_sd_configs"] = [{"files": [f"{SD_DIR}/{file}"], "refresh_interval": SD_REFRESH}]
        jobs.append(job)
    return jobs, sidecar_jobs


def prometheus_config(scrape_configs: list[dict], *, evaluation_interval: str = "1s",
                      rule_files: tuple[str, ...] = (RULES_FILE,)) -> dict:
    return {"global": {"evaluation_interval": evaluation_interval},
            "rule_files": [f"/etc/prometheus/{f}" for f in rule_files],
            "scrape_configs": scrape_configs}


def render_chart_monitoring(*sets: str, release: str | None = None) -> tuple[dict, dict]:
    """(PodMonitor, PrometheusRule) of `helm template` of the chart with monitoring on, plus `--set` overrides."""
    from tests.monitoring_support import one, render

    docs = render(*sets) if release is None else render(*sets, release=release)
    return one(docs, "PodMonitor"), one(docs, "PrometheusRule")


def render_operator_monitor(release: str, *sets: str) -> tuple[dict, dict]:
    """(ServiceMonitor, the operator's metrics Service) of `helm template` of the chart as release `release` (the
    Service's selector names the release, so it must be the installed one's)."""
    from tests.monitoring_support import one, render

    docs = render(*sets, release=release)
    monitor = one(docs, "ServiceMonitor")
    wanted = monitor["spec"]["selector"].get("matchLabels") or {}
    services = [d for d in docs if d.get("kind") == "Service" and all(
        (d["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())]
    if len(services) != 1:
        raise UnsupportedMonitorField(f"the ServiceMonitor selects {len(services)} rendered Services, not one")
    return monitor, services[0]


def servicemonitor_scrape_configs(servicemonitor: Mapping[str, Any], service: Mapping[str, Any]) -> list[dict]:
    """The scrape jobs for a ServiceMonitor, as pod-role jobs the discovery sidecar can fill. prometheus-operator
    discovers the Service's endpoints; these are exactly the Ready pods its selector matches, on the container port its
    `targetPort` names, which is what these jobs keep (the sidecar's `__meta_kubernetes_pod_ready` stands for the
    endpoint's readiness)."""
    meta, spec = servicemonitor["metadata"], servicemonitor["spec"]
    unknown = set(spec) - {"selector", "namespaceSelector", "endpoints"}
    if unknown:
        raise UnsupportedMonitorField(f"ServiceMonitor spec fields not translated: {sorted(unknown)}")
    ns, name = meta["namespace"], meta["name"]
    namespaces = _namespaces(spec.get("namespaceSelector"), ns)
    sd: dict[str, Any] = {"role": "pod", **({"namespaces": {"names": namespaces}} if namespaces is not None else {})}
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    jobs = []
    for index, endpoint in enumerate(spec.get("endpoints") or []):
        unknown = set(endpoint) - {"port", "path", "interval", "scrapeTimeout", "honorLabels"}
        if unknown:
            raise UnsupportedMonitorField(f"spec.endpoints[{index}]: fields not translated: {sorted(unknown)}")
        target = ports[endpoint["port"]].get("targetPort")
        if not isinstance(target, str):
            raise UnsupportedMonitorField(f"spec.endpoints[{index}]: the Service's targetPort must be a port name")
        job: dict[str, Any] = {"job_name": f"serviceMonitor/{ns}/{name}/{index}",
                               "honor_labels": bool(endpoint.get("honorLabels", False)),
                               "kubernetes_sd_configs": [dict(sd)]}
        for src, dst in (("interval", "scrape_interval"), ("scrapeTimeout", "scrape_timeout"), ("path", "metrics_path")):
            if endpoint.get(src):
                job[dst] = endpoint[src]
        rules = [{"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
                 {"action": "keep", "source_labels": ["__meta_kubernetes_pod_ready"], "regex": "true"}]
        rules += _selector_rules({"matchLabels": service["spec"]["selector"]})
        rules += [
            {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": target},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"target_label": "service", "replacement": service["metadata"]["name"]},
            {"target_label": "job", "replacement": service["metadata"]["name"]},
            {"target_label": "endpoint", "replacement": endpoint["port"]},
        ]
        job["relabel_configs"] = rules
        jobs.append(job)
    return jobs


# --- the image -------------------------------------------------------------------------------------------------

def _file_sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def prometheus_image(log: Callable[[str], None] = print) -> Image:
    """Debian's prometheus binary on the Debian base (whose libc it links against), as an OCI archive."""
    if not PROMETHEUS_BINARY.is_file():
        raise BuildError(f"{PROMETHEUS_BINARY} is missing: apt-get install -y prometheus (hack/lib.sh ensure_prometheus)")
    base = debian_base(log)
    key = hashlib.sha256(json.dumps({"base": base.key, "prometheus": _file_sha256(PROMETHEUS_BINARY),
                                     "uid": PROMETHEUS_UID, "layout": 1}).encode()).hexdigest()[:16]
    ref = f"localhost/pdpair/prometheus:{key[:12]}"
    archive = images_dir() / f"prometheus-{key}.oci.tar"
    with _Lock("prometheus"):
        if archive.is_file():
            return Image(ref, archive, key)
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="pdpair-prometheus-", dir=images_dir()) as tmp:
            base_layer = pathlib.Path(tmp) / "base.tar"
            with tarfile.open(base.archive) as oci:
                index = json.load(oci.extractfile("index.json"))
                manifest = json.load(oci.extractfile(
                    "blobs/sha256/" + index["manifests"][0]["digest"].split(":", 1)[1]))
                [layer] = manifest["layers"]
                with oci.extractfile("blobs/sha256/" + layer["digest"].split(":", 1)[1]) as src, \
                        open(base_layer, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            top = pathlib.Path(tmp) / "prometheus.tar"
            with tarfile.open(top, "w") as tar:
                for name, mode in (("usr", 0o755), ("usr/bin", 0o755), ("prometheus", 0o775)):
                    info = tarfile.TarInfo(name)
                    info.type, info.mode = tarfile.DIRTYPE, mode
                    if name == "prometheus":
                        info.uid = info.gid = PROMETHEUS_UID
                    tar.addfile(info)
                tar.add(PROMETHEUS_BINARY, "usr/bin/prometheus", filter=lambda i: _owned_by_root(i, 0o755))
            tmp_archive = archive.with_name(archive.name + ".tmp")
            write_oci_archive_from_files(tmp_archive, ref, [base_layer, top], {
                "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                "Entrypoint": ["/usr/bin/prometheus"], "User": str(PROMETHEUS_UID), "WorkingDir": "/prometheus"})
            os.replace(tmp_archive, archive)
        log(f"[images] {ref} built in {time.monotonic() - t0:.0f}s ({archive.stat().st_size >> 20} MiB)")
    return Image(ref, archive, key)


def _owned_by_root(info: tarfile.TarInfo, mode: int) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mode = mode
    return info


# --- the objects in the cluster ---------------------------------------------------------------------------------

SIDECAR_SCRIPT = pathlib.Path(__file__).with_name("pod_sd_sidecar.py")


def manifests(namespace: str, image_ref: str, sidecar_image_ref: str, config: dict, sidecar_jobs: list[str],
              rules: dict, *, retention: str = "2h", node: str | None = None) -> list[dict]:
    """ServiceAccount, ClusterRole (+ binding) to get/list/watch pods, the config/rules/sidecar ConfigMap, the pod
    (Prometheus and the discovery sidecar)."""
    name = APP_LABEL
    labels = {"app.kubernetes.io/name": name}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": f"{name}-{namespace}"},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": f"{name}-{namespace}"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"{name}-{namespace}"},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace},
         "data": {CONFIG_FILE: yaml.safe_dump(config, sort_keys=False),
                  RULES_FILE: yaml.safe_dump(rules, sort_keys=False),
                  SIDECAR_SCRIPT.name: SIDECAR_SCRIPT.read_text()}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace, "labels": labels},
         "spec": {
             "serviceAccountName": name,
             # The discovery sidecar does not act on SIGTERM and a test's Prometheus keeps nothing: without this each
             # deletion waited out the default 30 s grace (31 s of teardown per module in CI).
             "terminationGracePeriodSeconds": 2,
             **({"nodeSelector": {"kubernetes.io/hostname": node}} if node else {}),
             "securityContext": {"runAsUser": PROMETHEUS_UID, "runAsGroup": PROMETHEUS_UID, "fsGroup": PROMETHEUS_UID},
             "containers": [{
                 "name": "prometheus", "image": image_ref, "imagePullPolicy": "Never",
                 "args": [f"--config.file=/etc/prometheus/{CONFIG_FILE}", "--storage.tsdb.path=/prometheus",
                          f"--storage.tsdb.retention.time={retention}", f"--web.listen-address=:{PROMETHEUS_PORT}"],
                 "ports": [{"name": "web", "containerPort": PROMETHEUS_PORT}],
                 "readinessProbe": {"httpGet": {"path": "/-/ready", "port": PROMETHEUS_PORT}, "periodSeconds": 2},
                 "volumeMounts": [{"name": "config", "mountPath": "/etc/prometheus"},
                                  {"name": "data", "mountPath": "/prometheus"},
                                  {"name": "sd", "mountPath": SD_DIR, "readOnly": True}],
             }, {
                 "name": "pod-sd", "image": sidecar_image_ref, "imagePullPolicy": "Never",
                 "command": ["python", f"/etc/prometheus/{SIDECAR_SCRIPT.name}", "--out", SD_DIR,
                             *[a for job in sidecar_jobs for a in ("--job", job)]],
                 "volumeMounts": [{"name": "config", "mountPath": "/etc/prometheus"},
                                  {"name": "sd", "mountPath": SD_DIR}],
             }],
             "volumes": [{"name": "config", "configMap": {"name": name}}, {"name": "data", "emptyDir": {}},
                         {"name": "sd", "emptyDir": {}}],
         }},
    ]


# GET a URL from inside a node's namespaces; prints the body. Retries a refused connection for `refused_for` s.
_GET_SNIPPET = """
import sys, time, urllib.error, urllib.request
url, refused_for = sys.argv[1], float(sys.argv[2])
deadline = time.monotonic() + refused_for
while True:
    try:
        print(urllib.request.urlopen(url, timeout=20).read().decode())
        break
    except urllib.error.URLError as exc:
        if not isinstance(exc.reason, ConnectionRefusedError) or time.monotonic() > deadline:
            raise
        time.sleep(0.5)
"""


class InClusterPrometheus:
    """The Prometheus pod in `namespace`, configured from the rendered chart (`helm_sets` tune the monitoring
    values, e.g. a 1 s scrape interval for a test)."""

    def __init__(self, cluster, namespace: str, image_ref: str, sidecar_image_ref: str,
                 helm_sets: tuple[str, ...] = (), node: str | None = None, operator_release: str | None = None):
        """`operator_release`: the installed operator's helm release, whose metrics the chart's ServiceMonitor
        scrapes (servicemonitor_scrape_configs); None: the engines' PodMonitor only."""
        self.cluster, self.namespace, self.image_ref = cluster, namespace, image_ref
        self.podmonitor, self.prometheus_rule = render_chart_monitoring(*helm_sets)
        self.scrape_configs = podmonitor_scrape_configs(self.podmonitor)  # what prometheus-operator would generate
        if operator_release is not None:
            self.scrape_configs += servicemonitor_scrape_configs(*render_operator_monitor(operator_release,
                                                                                         *helm_sets))
        jobs, sidecar_jobs = with_file_sd(self.scrape_configs)
        self.config = prometheus_config(jobs)
        self.rules = rules_file(self.prometheus_rule)
        self.objects = manifests(namespace, image_ref, sidecar_image_ref, self.config, sidecar_jobs, self.rules,
                                 node=node)
        self.pod_ip: str | None = None
        self.node: str | None = None

    def deploy(self, timeout: float = 180.0) -> None:
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(self.objects))
        self.cluster.kubectl("wait", "-n", self.namespace, "--for=condition=Ready", f"pod/{APP_LABEL}",
                             f"--timeout={int(timeout)}s", timeout=timeout + 30, check=False)
        pod = json.loads(self.cluster.kubectl("get", "pod", "-n", self.namespace, APP_LABEL, "-o", "json").stdout)
        ready = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}.get("Ready") == "True"
        if not ready:
            logs = self.logs()
            raise AssertionError(f"in-cluster Prometheus not Ready after {timeout:.0f}s:\n"
                                 f"{json.dumps(pod['status'], indent=1)[-2500:]}\n{logs}")
        self.pod_ip, self.node = pod["status"]["podIP"], pod["spec"]["nodeName"]

    def logs(self) -> str:
        return "\n".join(f"--- {c}:\n" + self.cluster.kubectl("logs", "-n", self.namespace, APP_LABEL, "-c", c,
                                                             "--tail=40", check=False).stdout
                         for c in ("prometheus", "pod-sd"))

    def delete(self) -> None:
        cluster_scoped = [o for o in self.objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
        self.cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", check=False,
                             input=yaml.safe_dump_all(cluster_scoped))
        self.cluster.kubectl("delete", "pod", "-n", self.namespace, APP_LABEL, "--ignore-not-found",
                             "--wait=true", "--timeout=60s", check=False, timeout=90)

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path> from inside the cluster network; the `data` of a successful answer."""
        from urllib.parse import urlencode

        assert self.pod_ip, "deploy() first"
        url = f"http://{self.pod_ip}:{PROMETHEUS_PORT}/api/v1/{path}" + (f"?{urlencode(params)}" if params else "")
        proc = self.cluster.node_exec(self.node, [sys.executable, "-c", _GET_SNIPPET, url, "30"], timeout=90)
        body = json.loads(proc.stdout)
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]

    def targets(self) -> list[dict]:
        return self.api("targets", state="active")["activeTargets"]

    def rule_groups(self) -> list[dict]:
        return self.api("rules")["groups"]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    config = sub.add_parser("config", help="print the prometheus.yml translated from the rendered chart")
    config.add_argument("--set", action="append", default=[], help="helm --set for the chart's monitoring values")
    sub.add_parser("image", help="build (or reuse) the Prometheus image archive")
    args = parser.parse_args(argv)
    if args.what == "config":
        podmonitor, _ = render_chart_monitoring(*args.set)
        jobs, sidecar_jobs = with_file_sd(podmonitor_scrape_configs(podmonitor))
        print(f"# discovery sidecar: {' '.join('--job ' + j for j in sidecar_jobs)}")
        print(yaml.safe_dump(prometheus_config(jobs), sort_keys=False))
        return 0
    try:
        image = prometheus_image()
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{image.ref} {image.archive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

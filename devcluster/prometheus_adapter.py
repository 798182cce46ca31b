#!/usr/bin/env python3
"""prometheus-adapter (kubernetes-sigs/prometheus-adapter) in the real-node cluster: the custom metrics API
(custom.metrics.k8s.io) served from the in-cluster Prometheus (incluster_prometheus.py), through the aggregation
layer, with the chart's rules (`autoscaling.prometheusAdapterRules`).

How it runs, and why as a pod: the adapter is deployed the way users deploy it (a Deployment, its Service, the
APIServices `v1beta1`/`v1beta2.custom.metrics.k8s.io`, and its RBAC: system:auth-delegator, the
extension-apiserver-authentication-reader Role in kube-system, a resource reader), in-cluster config through the
`kubernetes` Service, so every hop a user's cluster has is exercised: kube-apiserver -> aggregator -> the backend pod
(front-proxy client cert, X-Remote-* headers) -> the adapter's delegated authn/authz back to the apiserver ->
Prometheus. A host process next to the control plane would need a selector-less Service with hand-written
Endpoints and would skip the in-cluster auth path. The image is one layer holding the static binary (no base, like
the pause image), so it costs under a second to write.

Needs a RealNodeCluster started with `aggregation_layer=True` (front-proxy CA + proxy client cert +
--enable-aggregator-routing: the hub namespace routes to pod IPs but has no kube-proxy for Service IPs).

The adapter's serving cert is our own, for `<service>.<namespace>.svc` (the name the aggregator verifies), signed
by a CA that goes into each APIService's caBundle: no insecureSkipTLSVerify.

    from devcluster.prometheus_adapter import PrometheusAdapter, adapter_config_from_chart, prometheus_adapter_image
    image = prometheus_adapter_image(); cluster.import_image(image.archive)
    adapter = PrometheusAdapter(cluster, "rn-adapter", image.ref, prometheus_url, adapter_config_from_chart())
    adapter.deploy()              # Deployment Available, then every APIService Available
    adapter.get_raw("/apis/custom.metrics.k8s.io/v1beta1/namespaces/ns/pods/*/vllm:num_requests_waiting")

    python devcluster/prometheus_adapter.py image      # build (or reuse) the binary and the image archive
    python devcluster/prometheus_adapter.py config     # the chart's adapter config (config.yaml)
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import pathlib
import sys
import tarfile
import tempfile
import time
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from devcluster.build import PROMETHEUS_ADAPTER_VERSION, build_prometheus_adapter  # noqa: E402
from devcluster.images import Image, _Lock, images_dir  # noqa: E402
from devcluster.oci import write_oci_archive_from_files  # noqa: E402

NAME = "prometheus-adapter"
ADAPTER_PORT = 6443
ADAPTER_UID = 65534  # nobody
API_GROUP = "custom.metrics.k8s.io"
# v1beta2 is what the HPA controller prefers; v1beta1 is what most tools (and `kubectl get --raw` examples) use.
API_VERSIONS = ("v1beta1", "v1beta2")
CONFIG_KEY = "config.yaml"
CHART_CONFIGMAP_SUFFIX = "-prometheus-adapter"


# --- the image -------------------------------------------------------------------------------------------------

def prometheus_adapter_image(log: Callable[[str], None] = print) -> Image:
    """The static adapter binary (devcluster/build.py, built on first use) as a one-layer OCI archive, cached under
    ~/.cache/pdpair/images/prometheus-adapter-<key>.oci.tar by the binary's hash."""
    binary = build_prometheus_adapter(log=log)
    digest = hashlib.sha256(binary.read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps({"binary": digest, "uid": ADAPTER_UID, "layout": 1}).encode()).hexdigest()[:16]
    ref = f"localhost/pdpair/{NAME}:{PROMETHEUS_ADAPTER_VERSION}-{key[:12]}"
    archive = images_dir() / f"{NAME}-{key}.oci.tar"
    with _Lock(NAME):
        if archive.is_file():
            return Image(ref, archive, key)
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="pdpair-adapter-image-", dir=images_dir()) as tmp:
            layer = pathlib.Path(tmp) / "layer.tar"
            with tarfile.open(layer, "w") as tar:
                tmp_dir = tarfile.TarInfo("tmp")
                tmp_dir.type, tmp_dir.mode = tarfile.DIRTYPE, 0o1777
                tar.addfile(tmp_dir)
                info = tar.gettarinfo(str(binary), arcname=NAME)
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                info.mode, info.mtime = 0o755, 0
                with open(binary, "rb") as fh:
                    tar.addfile(info, fh)
            tmp_archive = archive.with_name(archive.name + ".tmp")
            write_oci_archive_from_files(tmp_archive, ref, [layer], {
                "Entrypoint": [f"/{NAME}"], "User": f"{ADAPTER_UID}:{ADAPTER_UID}", "WorkingDir": "/tmp"})
            os.replace(tmp_archive, archive)
        log(f"[images] {ref} written in {time.monotonic() - t0:.1f}s ({archive.stat().st_size >> 20} MiB)")
    return Image(ref, archive, key)


# --- configuration and certificates ------------------------------------------------------------------------------

def adapter_config_from_chart(*sets: str) -> str:
    """The adapter's config.yaml from `helm template` of the chart with autoscaling.prometheusAdapterRules on
    (plus `--set` overrides): the ConfigMap users mount is the one the tests run."""
    from tests.monitoring_support import render

    docs = render("autoscaling.prometheusAdapterRules.enabled=true", *sets, monitoring_on=False)
    [configmap] = [d for d in docs
                   if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith(CHART_CONFIGMAP_SUFFIX)]
    return configmap["data"][CONFIG_KEY]


def serving_certs(namespace: str, service: str = NAME) -> dict[str, bytes]:
    """{ca.crt, tls.crt, tls.key}: a CA of its own and a serving cert for the names the aggregator dials
    (`<service>.<namespace>.svc`; with aggregator routing it still verifies that name, not the pod IP)."""
    from cryptography.hazmat.primitives import serialization

    from devcluster.realnode import _issue_cert, _new_ca

    ca_key, ca = _new_ca(f"pdpair-{service}-ca")
    names = (f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local", f"{service}.{namespace}")
    key, cert = _issue_cert(ca_key, ca, names[0], client=False, dns_names=names)
    pem = serialization.Encoding.PEM
    return {"ca.crt": ca.public_bytes(pem), "tls.crt": cert.public_bytes(pem),
            "tls.key": key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())}


def adapter_args(prometheus_url: str, *, relist_interval: str = "5s", verbosity: int = 2) -> list[str]:
    return [
        f"--secure-port={ADAPTER_PORT}",
        "--tls-cert-file=/var/run/serving-cert/tls.crt",
        "--tls-private-key-file=/var/run/serving-cert/tls.key",
        f"--config=/etc/adapter/{CONFIG_KEY}",
        f"--prometheus-url={prometheus_url}",
        # How often the adapter lists the series Prometheus has (default 10m: a new pod's metric would appear
        # minutes late); it must exceed the scrape interval.
        f"--metrics-relist-interval={relist_interval}",
        f"--v={verbosity}",
    ]


def manifests(namespace: str, image_ref: str, prometheus_url: str, config_yaml: str, certs: dict[str, bytes], *,
              relist_interval: str = "5s", node: str | None = None) -> list[dict]:
    """Everything the adapter needs, as upstream's deploy/manifests lay it out (v0.12.0), with our serving cert."""
    labels = {"app.kubernetes.io/name": NAME}
    sa = {"kind": "ServiceAccount", "name": NAME, "namespace": namespace}
    reader = f"{NAME}-resource-reader-{namespace}"
    objects: list[dict] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": NAME, "namespace": namespace}},
        # Delegated authentication and authorization: TokenReviews and SubjectAccessReviews.
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": f"{NAME}-auth-delegator-{namespace}"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:auth-delegator"},
         "subjects": [sa]},
        # The requestheader CA and allowed names that the apiserver publishes in
        # kube-system/extension-apiserver-authentication.
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": f"{NAME}-auth-reader-{namespace}", "namespace": "kube-system"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                     "name": "extension-apiserver-authentication-reader"},
         "subjects": [sa]},
        # The objects the rules map series labels to (namespace, pod; nodes and services as upstream grants).
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": reader},
         "rules": [{"apiGroups": [""], "resources": ["nodes", "namespaces", "pods", "services"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": reader},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": reader},
         "subjects": [sa]},
        {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
         "metadata": {"name": f"{NAME}-serving-cert", "namespace": namespace},
         "data": {k: base64.b64encode(certs[k]).decode() for k in ("tls.crt", "tls.key")}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": NAME, "namespace": namespace},
         "data": {CONFIG_KEY: config_yaml}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": NAME, "namespace": namespace,
                                                                     "labels": labels},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
             "metadata": {"labels": labels},
             "spec": {
                 "serviceAccountName": NAME,
                 "terminationGracePeriodSeconds": 5,  # a test's adapter: nothing to finish
                 **({"nodeSelector": {"kubernetes.io/hostname": node}} if node else {}),
                 "securityContext": {"runAsNonRoot": True, "runAsUser": ADAPTER_UID, "runAsGroup": ADAPTER_UID},
                 "containers": [{
                     "name": NAME, "image": image_ref, "imagePullPolicy": "Never",
                     "args": adapter_args(prometheus_url, relist_interval=relist_interval),
                     "ports": [{"name": "https", "containerPort": ADAPTER_PORT}],
                     "readinessProbe": {"httpGet": {"path": "/readyz", "port": "https", "scheme": "HTTPS"},
                                        "periodSeconds": 2},
                     "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                         "capabilities": {"drop": ["ALL"]}},
                     "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                                      {"name": "serving-cert", "mountPath": "/var/run/serving-cert", "readOnly": True},
                                      {"name": "config", "mountPath": "/etc/adapter", "readOnly": True}],
                 }],
                 "volumes": [{"name": "tmp", "emptyDir": {}},
                             {"name": "serving-cert", "secret": {"secretName": f"{NAME}-serving-cert"}},
                             {"name": "config", "configMap": {"name": NAME}}],
             }}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": NAME, "namespace": namespace, "labels": labels},
         "spec": {"selector": labels, "ports": [{"name": "https", "port": 443, "targetPort": "https"}]}},
    ]
    ca_bundle = base64.b64encode(certs["ca.crt"]).decode()
    for priority, version in enumerate(API_VERSIONS, start=1):
        objects.append({
            "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
            "metadata": {"name": f"{version}.{API_GROUP}", "labels": labels},
            "spec": {"group": API_GROUP, "version": version, "caBundle": ca_bundle,
                     "service": {"name": NAME, "namespace": namespace, "port": 443},
                     "groupPriorityMinimum": 100, "versionPriority": 100 * priority}})
    return objects


# --- in the cluster ----------------------------------------------------------------------------------------------

class PrometheusAdapter:
    """The adapter in `namespace` of a RealNodeCluster started with aggregation_layer=True."""

    def __init__(self, cluster, namespace: str, image_ref: str, prometheus_url: str, config_yaml: str, *,
                 relist_interval: str = "5s", node: str | None = None):
        if not getattr(cluster, "aggregation_layer", False):
            raise ValueError("the cluster has no aggregation layer: start RealNodeCluster(aggregation_layer=True)")
        self.cluster, self.namespace = cluster, namespace
        self.certs = serving_certs(namespace)
        self.objects = manifests(namespace, image_ref, prometheus_url, config_yaml, self.certs,
                                 relist_interval=relist_interval, node=node)
        self.timings: dict[str, float] = {}

    @property
    def apiservices(self) -> list[str]:
        return [f"{v}.{API_GROUP}" for v in API_VERSIONS]

    def deploy(self, timeout: float = 180.0) -> None:
        """Applies everything, waits for the Deployment to be Available, then for every APIService's Available
        condition (the aggregator reached the pod through its endpoint and the adapter answered discovery)."""
        t0 = time.monotonic()
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(self.objects))
        proc = self.cluster.kubectl("wait", "-n", self.namespace, "--for=condition=Available", f"deployment/{NAME}",
                                    f"--timeout={int(timeout)}s", timeout=timeout + 30, check=False)
        if proc.returncode != 0:
            raise AssertionError(f"{NAME} Deployment not Available after {timeout:.0f}s:\n{self.diagnose()}")
        self.timings["deployment_available"] = time.monotonic() - t0
        for name in self.apiservices:
            proc = self.cluster.kubectl("wait", "--for=condition=Available", f"apiservice/{name}",
                                        f"--timeout={int(timeout)}s", timeout=timeout + 30, check=False)
            if proc.returncode != 0:
                raise AssertionError(f"APIService {name} not Available after {timeout:.0f}s:\n{self.diagnose()}")
        self.timings["apiservices_available"] = time.monotonic() - t0

    def get_raw(self, path: str) -> Any:
        """`kubectl get --raw PATH` as the admin, through the apiserver and its aggregator; the parsed JSON."""
        return json.loads(self.cluster.kubectl("get", "--raw", path).stdout)

    def pods_metric(self, namespace: str, metric: str, *, version: str = "v1beta1", pods: str = "*",
                    metric_label_selector: str | None = None, label_selector: str | None = None) -> Any:
        """A Pods metric as the HPA controller asks for it: `label_selector` picks the pods (an HPA sends its
        target's /scale selector), `metric_label_selector` the series (an HPA's metric.selector)."""
        from urllib.parse import urlencode

        path = f"/apis/{API_GROUP}/{version}/namespaces/{namespace}/pods/{pods}/{metric}"
        query = {k: v for k, v in (("labelSelector", label_selector), ("metricLabelSelector", metric_label_selector))
                 if v}
        return self.get_raw(path + (f"?{urlencode(query)}" if query else ""))

    def logs(self, tail: int = 60) -> str:
        return self.cluster.kubectl("logs", "-n", self.namespace, f"deployment/{NAME}", f"--tail={tail}",
                                    check=False).stdout

    def diagnose(self) -> str:
        parts = [self.cluster.kubectl("get", "apiservice", *self.apiservices, "-o", "json", check=False).stdout[-3000:],
                 self.cluster.kubectl("get", "pods,endpointslices", "-n", self.namespace, "-o", "wide",
                                      check=False).stdout,
                 "--- adapter log:\n" + self.logs(),
                 "--- kube-apiserver log:\n" + self.cluster.log_tail("kube-apiserver")]
        return "\n".join(parts)

    def delete(self) -> None:
        cluster_scoped = [o for o in self.objects
                          if o["kind"] in ("APIService", "ClusterRole", "ClusterRoleBinding", "RoleBinding")]
        self.cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", check=False,
                             input=yaml.safe_dump_all(cluster_scoped))
        self.cluster.kubectl("delete", "deployment", "-n", self.namespace, NAME, "--ignore-not-found",
                             "--wait=true", "--timeout=60s", check=False, timeout=90)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("image", help="build (or reuse) the adapter binary and its image archive")
    config = sub.add_parser("config", help="print the chart's adapter config (config.yaml)")
    config.add_argument("--set", action="append", default=[], help="chart value, as helm's --set")
    args = parser.parse_args(argv)
    if args.command == "image":
        image = prometheus_adapter_image()
        print(f"{image.ref} {image.archive}")
    else:
        sys.stdout.write(adapter_config_from_chart(*args.set))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

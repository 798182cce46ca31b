#!/usr/bin/env python3
"""Real-node mode of the local cluster: the control plane of localcluster.py plus real nodes (containerd, runc,
CNI, kubelet, kube-proxy), every process inside network namespaces this harness creates, with no default route.

Layout (all addresses are RFC 2544 space, never eth0's and never a private range: traffic stays on loopback or
inside the namespaces this harness creates, devcluster/README.md "Layout and the network rule"):

    netns <prefix>-hub     bridge br0 198.18.0.1/24: etcd, kube-apiserver (:6443), controller-manager, scheduler
    netns <prefix>-n<i>    eth0 198.18.0.(1+i)/24 (a veth whose peer is on br0 in the hub), node-local bridge
                           cni0 with pods 198.18.(63+i).0/24; containerd, kubelet, kube-proxy under one supervisor
    services               198.19.0.0/16; `kubernetes` = 198.19.0.1 -> 198.18.0.1:6443

The root namespace reaches the apiserver through a loopback listener (127.0.0.1:<port>) that this process forwards
into the hub, so `cluster.kubeconfig`, `cluster.kubectl()` and `cluster.api_client()` work as with LocalCluster.
Tests reach pods and Services from inside a node namespace with `cluster.node_exec()`.

    from devcluster.realnode import RealNodeCluster
    with RealNodeCluster(nodes=2) as cluster:
        cluster.import_image(archive)            # an OCI archive, into every node's containerd
        cluster.kubectl("apply", "-f", ...)
        cluster.node_exec("n1", ["python3", "-c", ...])

CLI (the one of localcluster.py):
    python devcluster/localcluster.py build --real-node
    python devcluster/localcluster.py up --dir D --real-nodes 2 [--background]
    python devcluster/localcluster.py down --dir D
"""
from __future__ import annotations

import datetime
import fcntl
import ipaddress
import json
import os
import pathlib
import secrets
import subprocess
import sys
import time
from typing import Callable

import yaml

if __package__ in (None, ""):  # run as a script: make `devcluster` importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from devcluster.build import PAUSE_IMAGE, build, build_node, cache_root, node_binary_path, pause_archive_path  # noqa: E402
from devcluster.errors import ClusterError, _tail  # noqa: E402
from devcluster.hoststate import (  # noqa: E402
    KUBELET_HOST_SYSCTLS, _host_cgroup_hierarchies, _read_sysctl, _registry_dir, _write_sysctl, sweep_stale_clusters,
)
from devcluster.localcluster import LocalCluster  # noqa: E402
from devcluster.network import LoopbackForwarder, _ip, in_netns  # noqa: E402
from devcluster.processes import _Component, _write_kubeconfig  # noqa: E402

HUB_IP = "198.18.0.1"
NODE_NET = ipaddress.ip_network("198.18.0.0/24")
CLUSTER_POD_CIDR = "198.18.64.0/18"   # kube-proxy's clusterCIDR; node i gets 198.18.(63+i).0/24
SERVICE_CIDR = "198.19.0.0/16"
KUBERNETES_SERVICE_IP = "198.19.0.1"
APISERVER_PORT = 6443
HPA_SYNC_SECONDS = 5  # kube-controller-manager --horizontal-pod-autoscaler-sync-period (upstream: 15 s)


# ---------------------------------------------------------------------------------------------------------------
# Certificates: one CA; the apiserver's serving cert valid for every name clients use
# ---------------------------------------------------------------------------------------------------------------

def _write_serving_certs(directory: pathlib.Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, ca = _new_ca("pdpair-realnode-ca")
    ca_name = ca.subject
    key = ec.generate_private_key(ec.SECP256R1())
    names = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
             "kubernetes.default.svc.cluster.local"]
    ips = ["127.0.0.1", HUB_IP, KUBERNETES_SERVICE_IP]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]
                                                       + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    (directory / "ca.crt").write_bytes(ca.public_bytes(pem))
    (directory / "apiserver.crt").write_bytes(cert.public_bytes(pem))
    (directory / "apiserver.key").write_bytes(key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))



# ---------------------------------------------------------------------------------------------------------------
# Aggregation layer (kube-aggregator): a front-proxy CA and the apiserver's client cert to extension apiservers
# ---------------------------------------------------------------------------------------------------------------

FRONT_PROXY_CLIENT_CN = "front-proxy-client"


def _new_ca(common_name: str):
    """(key, certificate) of a self-signed CA, valid 7 days, as the cluster's other CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _issue_cert(ca_key, ca_cert, common_name: str, *, client: bool, dns_names: tuple[str, ...] = ()):
    """(key, certificate) signed by the CA: a client cert (clientAuth) or a serving cert (serverAuth, dns_names)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=7))
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH if client
                                                     else ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    if dns_names:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]),
                                        critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _pem_pair(directory: pathlib.Path, stem: str, key, cert) -> None:
    from cryptography.hazmat.primitives import serialization

    pem = serialization.Encoding.PEM
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{stem}.crt").write_bytes(cert.public_bytes(pem))
    key_path = directory / f"{stem}.key"
    key_path.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    key_path.chmod(0o600)


def write_front_proxy_certs(directory: pathlib.Path) -> None:
    """front-proxy-ca.{crt,key} (a CA of its own, as kubeadm makes it: extension apiservers trust it for the
    X-Remote-* headers only, never for client auth to the apiserver itself) and front-proxy-client.{crt,key}, the
    client cert the apiserver presents when it proxies a request to an APIService's backend."""
    ca_key, ca = _new_ca("pdpair-realnode-front-proxy-ca")
    key, cert = _issue_cert(ca_key, ca, FRONT_PROXY_CLIENT_CN, client=True)
    _pem_pair(directory, "front-proxy-ca", ca_key, ca)
    _pem_pair(directory, "front-proxy-client", key, cert)


def aggregation_layer_flags(pki: pathlib.Path) -> list[str]:
    """kube-apiserver flags for the aggregation layer (APIService backends such as prometheus-adapter).

    --enable-aggregator-routing: the apiserver runs in the hub namespace, which has a route to every node's pod CIDR
    but none to the Service CIDR and no kube-proxy (Service IPs are DNATed only inside the node namespaces). So it
    must dial an APIService's endpoint (the backend pod's IP), not its ClusterIP."""
    return [
        f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
        f"--requestheader-allowed-names={FRONT_PROXY_CLIENT_CN}",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-username-headers=X-Remote-User",
        f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
        f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
        "--enable-aggregator-routing=true",
    ]


# ---------------------------------------------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------------------------------------------

class RealNode:
    def __init__(self, cluster: "RealNodeCluster", index: int):
        self.index = index
        self.name = f"n{index}"
        self.netns = f"{cluster.prefix}-{self.name}"
        self.ip = str(NODE_NET.network_address + 1 + index)
        self.pod_cidr = f"198.18.{63 + index}.0/24"
        self.workdir = cluster.workdir / "nodes" / self.name
        self.cgroup_root = f"/{cluster.prefix}-{self.name}"
        self.process: subprocess.Popen | None = None

    @property
    def state_file(self) -> pathlib.Path:
        return self.workdir / "supervisor.json"

    def state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def pid(self, component: str) -> int:
        return self.state()["pids"][component]


class RealNodeCluster(LocalCluster):
    """LocalCluster's control plane in its own network namespace plus `nodes` real nodes. See the module doc."""

    def __init__(self, workdir: str | os.PathLike | None = None, *, nodes: int = 2, start_timeout: float = 180.0,
                 keep_workdir: bool = False, log: Callable[[str], None] = lambda msg: None,
                 aggregation_layer: bool = False):
        """`aggregation_layer`: give the apiserver the front-proxy CA, its proxy client cert and aggregator
        routing (`aggregation_layer_flags`), so APIServices served by pods (prometheus-adapter,
        devcluster/prometheus_adapter.py) are reachable through it. Off by default; the real-node tests' package
        cluster (devcluster/fixtures.py `real_cluster`) turns it on for the autoscaling tests."""
        super().__init__(workdir, start_timeout=start_timeout, keep_workdir=keep_workdir, log=log)
        self.aggregation_layer = aggregation_layer
        if not 1 <= nodes <= 8:
            raise ValueError("nodes must be 1..8")
        self.prefix = f"pdp{secrets.token_hex(3)}"
        self.hub = f"{self.prefix}-hub"
        self.nodes = [RealNode(self, i) for i in range(1, nodes + 1)]
        self._node_tokens = {n.name: secrets.token_urlsafe(24) for n in self.nodes}
        self._node_tokens["kube-proxy"] = secrets.token_urlsafe(24)
        self._forwarder: LoopbackForwarder | None = None
        self._netns_created: list[str] = []
        self._saved_sysctls: dict[str, str] = {}
        self.timings: dict[str, float] = {}

    # -- paths -----------------------------------------------------------------------------------------------
    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self._forwarder.port if self._forwarder else 0}"

    @property
    def ca_file(self) -> pathlib.Path:
        return self.workdir / "pki" / "ca.crt"

    def node(self, name: str) -> RealNode:
        return next(n for n in self.nodes if n.name == name)

    # -- lifecycle -------------------------------------------------------------------------------------------
    def _register(self) -> None:
        entry = {"harness_pid": os.getpid(), "workdir": str(self.workdir), "keep_workdir": self.keep_workdir,
                 "netns": [self.hub] + [n.netns for n in self.nodes],
                 "cgroup_roots": [n.cgroup_root for n in self.nodes], "saved_sysctls": self._saved_sysctls}
        tmp = _registry_dir() / f".{self.prefix}.tmp"
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, _registry_dir() / f"{self.prefix}.json")

    def start(self) -> "RealNodeCluster":
        t0 = time.monotonic()
        sweep_stale_clusters(self._log)
        self._register()
        binaries = {**build(log=self._log), **build_node(log=self._log)}
        self.timings["build"] = time.monotonic() - t0
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(exist_ok=True)
        deadline = time.monotonic() + self.start_timeout
        try:
            self._start_real(binaries, deadline)
        except BaseException:
            self._teardown()
            raise
        self.timings["start"] = time.monotonic() - t0 - self.timings["build"]
        return self

    def stop(self) -> None:
        self._teardown()
        if not self.keep_workdir:
            # `rm -rf`, not shutil.rmtree: the nodes' containerd stores hold unpacked engine images (hundreds of
            # thousands of files); rmtree took over 10 minutes for two of them on a busy machine, rm -rf 14 s.
            subprocess.run(["rm", "-rf", "--one-file-system", str(self.workdir)], capture_output=True)

    def _start_real(self, binaries: dict[str, pathlib.Path], deadline: float) -> None:
        w = self.workdir
        self._setup_network()
        self._forwarder = LoopbackForwarder(self.hub, (HUB_IP, APISERVER_PORT)).start()
        self._write_credentials()
        _write_serving_certs(w / "pki")
        if self.aggregation_layer:
            write_front_proxy_certs(w / "pki")
        rows = (self.workdir / "tokens.csv").read_text().splitlines()
        rows += [f'{self._node_tokens[n.name]},system:node:{n.name},uid-node-{n.name},"system:nodes"'
                 for n in self.nodes]
        rows.append(f"{self._node_tokens['kube-proxy']},system:kube-proxy,uid-kube-proxy")
        (w / "tokens.csv").write_text("\n".join(rows) + "\n")
        local = f"https://127.0.0.1:{APISERVER_PORT}"  # inside the hub
        for component, user in (("kube-controller-manager", "system:kube-controller-manager"),
                                ("kube-scheduler", "system:kube-scheduler")):
            _write_kubeconfig(w / f"{component}.kubeconfig", local, self.ca_file, user, self._tokens[component])
        netns_exec = ["ip", "netns", "exec", self.hub]
        etcd = _Component("etcd", [
            *netns_exec, str(binaries["etcd"]), "--name=local", f"--data-dir={w / 'etcd-data'}",
            "--listen-client-urls=http://127.0.0.1:2379", "--advertise-client-urls=http://127.0.0.1:2379",
            "--listen-peer-urls=http://127.0.0.1:2380", "--initial-advertise-peer-urls=http://127.0.0.1:2380",
            "--initial-cluster=local=http://127.0.0.1:2380", "--unsafe-no-fsync", "--log-level=warn",
        ], "http://127.0.0.1:2379/health")
        apiserver = _Component("kube-apiserver", [
            *netns_exec, str(binaries["kube-apiserver"]),
            "--etcd-servers=http://127.0.0.1:2379",
            f"--secure-port={APISERVER_PORT}", "--bind-address=0.0.0.0", f"--advertise-address={HUB_IP}",
            f"--tls-cert-file={w / 'pki' / 'apiserver.crt'}", f"--tls-private-key-file={w / 'pki' / 'apiserver.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={w / 'sa.pub'}",
            f"--service-account-signing-key-file={w / 'sa.key'}",
            "--authorization-mode=Node,RBAC",
            f"--token-auth-file={w / 'tokens.csv'}",
            "--allow-privileged=true",
            # Node names do not resolve (no DNS leaves the namespaces): reach kubelets by their InternalIP.
            "--kubelet-preferred-address-types=InternalIP",
            "--profiling=false",
            *self.apiserver_aggregation_flags(w / "pki"),
        ], f"https://127.0.0.1:{APISERVER_PORT}/readyz")
        kcm_kubeconfig = str(w / "kube-controller-manager.kubeconfig")
        kcm = _Component("kube-controller-manager", [
            *netns_exec, str(binaries["kube-controller-manager"]),
            f"--kubeconfig={kcm_kubeconfig}",
            f"--authentication-kubeconfig={kcm_kubeconfig}", f"--authorization-kubeconfig={kcm_kubeconfig}",
            "--secure-port=10257", "--bind-address=127.0.0.1", f"--cert-dir={w / 'kcm-certs'}",
            "--leader-elect=false", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={w / 'sa.key'}", f"--root-ca-file={self.ca_file}",
            "--profiling=false",
            # The HPA controller reads metrics every 5 s instead of every 15: the HPA test waits for a few of its
            # passes. Everything else runs at upstream defaults (the node-monitor grace period included: the
            # partition test measures what a cluster at defaults does).
            f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_SECONDS}s",
        ], "https://127.0.0.1:10257/healthz")
        scheduler_kubeconfig = str(w / "kube-scheduler.kubeconfig")
        scheduler = _Component("kube-scheduler", [
            *netns_exec, str(binaries["kube-scheduler"]),
            f"--kubeconfig={scheduler_kubeconfig}", f"--authentication-kubeconfig={scheduler_kubeconfig}",
            f"--authorization-kubeconfig={scheduler_kubeconfig}",
            "--secure-port=10259", "--bind-address=127.0.0.1", f"--cert-dir={w / 'scheduler-certs'}",
            "--leader-elect=false", "--profiling=false",
        ], "https://127.0.0.1:10259/healthz")

        self._launch(etcd)
        self._wait_healthy(etcd, deadline)
        self._launch(apiserver)
        self._wait_healthy(apiserver, deadline)
        _write_kubeconfig(self.kubeconfig, self.server, self.ca_file, "admin", self.admin_token)
        for component in (kcm, scheduler):
            self._launch(component)
        for component in (kcm, scheduler):
            self._wait_healthy(component, deadline)
        self._wait_for(lambda: self._admin_get("/api/v1/namespaces/default/serviceaccounts/default") is not None,
                       deadline, "ServiceAccount default/default", "kube-controller-manager")
        self.timings["control_plane"] = time.monotonic() - (deadline - self.start_timeout)
        self._start_nodes(binaries, deadline)
        (w / "cluster.json").write_text(json.dumps(self.describe(), indent=2))
        self._log(f"[realnode] up: {self.server}, kubeconfig {self.kubeconfig}, nodes "
                  + ", ".join(f"{n.name}={n.ip}" for n in self.nodes))

    def apiserver_aggregation_flags(self, pki: pathlib.Path) -> list[str]:
        """The apiserver's aggregation-layer flags when the cluster has the option, else none."""
        return aggregation_layer_flags(pki) if self.aggregation_layer else []

    def _wait_healthy(self, component: _Component, deadline: float) -> None:
        # The control plane listens inside the hub namespace; probe it from there.
        in_netns(self.hub, lambda: LocalCluster._wait_healthy(self, component, deadline))

    def describe(self) -> dict:
        return {**super().describe(), "mode": "realnode", "aggregation_layer": self.aggregation_layer,
                "netns": [self.hub] + [n.netns for n in self.nodes],
                "nodes": {n.name: {"ip": n.ip, "podCIDR": n.pod_cidr, "netns": n.netns,
                                   "supervisor_pid": n.process.pid if n.process else None} for n in self.nodes}}

    # -- network -------------------------------------------------------------------------------------------------
    def _setup_network(self) -> None:
        for name in [self.hub] + [n.netns for n in self.nodes]:
            _ip("netns", "add", name)
            self._netns_created.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "addr", "add", f"{HUB_IP}/24", "dev", "br0")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for node in self.nodes:
            hub_end = f"v{node.name}"
            _ip("-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
            _ip("-n", self.hub, "link", "set", hub_end, "master", "br0", "up")
            _ip("-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", "eth0")
            _ip("-n", node.netns, "link", "set", "eth0", "up")
            _ip("-n", self.hub, "route", "add", node.pod_cidr, "via", node.ip)
            # Services are DNATed by kube-proxy after routing; without a route connect() fails first.
            _ip("-n", node.netns, "route", "add", SERVICE_CIDR, "dev", "eth0")
            for other in self.nodes:
                if other is not node:
                    _ip("-n", node.netns, "route", "add", other.pod_cidr, "via", other.ip)

    # -- nodes ---------------------------------------------------------------------------------------------------
    def _start_nodes(self, binaries: dict[str, pathlib.Path], deadline: float) -> None:
        hierarchies = _host_cgroup_hierarchies()
        bin_dir = node_binary_path("containerd").parent
        shim_dir = node_binary_path("containerd-shim-runc-v2").parent
        for node in self.nodes:
            self._write_node_files(node, binaries, hierarchies, f"{bin_dir}:{shim_dir}")
        # The kubelet writes host-wide sysctls at start. Hold a host-wide lock from before the first kubelet starts
        # until every node is Ready, then put the values back, so concurrent clusters never save each other's.
        lock_path = cache_root() / "realnode-sysctls.lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self._saved_sysctls = {k: _read_sysctl(k) for k in KUBELET_HOST_SYSCTLS}
                self._register()
                for node in self.nodes:
                    self._launch_supervisor(node)
                for node in self.nodes:
                    self._wait_supervisor_running(node, deadline)
                t0 = time.monotonic()
                for node in self.nodes:
                    self.wait_node_ready(node.name, timeout=max(1.0, deadline - time.monotonic()))
                self.timings["nodes_ready"] = time.monotonic() - t0
            finally:
                self._restore_sysctls()
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _restore_sysctls(self) -> None:
        for key, value in self._saved_sysctls.items():
            if _read_sysctl(key) != value:
                _write_sysctl(key, value)

    def _write_node_files(self, node: RealNode, binaries: dict[str, pathlib.Path], hierarchies: list[dict],
                          path_dirs: str) -> None:
        w = node.workdir
        for sub in ("logs", "containerd", "kubelet", "pod-logs", "cni-conf", "cni-ipam", "kubelet-pki"):
            (w / sub).mkdir(parents=True, exist_ok=True)
        (w / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        (w / "pod-resolv.conf").write_text("# no nameserver: nothing may resolve outside the cluster namespaces\n")
        (w / "hosts").write_text(f"127.0.0.1 localhost\n{node.ip} {node.name}\n"
                                 + "".join(f"{o.ip} {o.name}\n" for o in self.nodes if o is not node))
        (w / "cni-conf" / "10-pdpair.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "pdpair",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
                 "ipam": {"type": "host-local", "dataDir": str(w / "cni-ipam"),
                          "ranges": [[{"subnet": node.pod_cidr}]], "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ]}, indent=2))
        socket_path = "/run/containerd/containerd.sock"
        (w / "containerd.toml").write_text(f"""\
version = 3
root = "{w / 'containerd'}"
state = "/run/containerd"
[grpc]
  address = "{socket_path}"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
[plugins.'io.containerd.cri.v1.runtime']
  # No CAP_SYS_RESOURCE here: nothing may lower oom_score_adj below containerd's own.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "{w / 'cni-conf'}"
""")
        server = f"https://{HUB_IP}:{APISERVER_PORT}"
        _write_kubeconfig(w / "kubelet.kubeconfig", server, self.ca_file, f"system:node:{node.name}",
                          self._node_tokens[node.name])
        _write_kubeconfig(w / "kube-proxy.kubeconfig", server, self.ca_file, "system:kube-proxy",
                          self._node_tokens["kube-proxy"])
        kubelet_config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "failCgroupV1": False,  # this VM has cgroup v1 only
            "cgroupDriver": "cgroupfs", "cgroupRoot": node.cgroup_root,
            "containerRuntimeEndpoint": f"unix://{socket_path}",
            "address": node.ip, "port": 10250, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
            # The kubelet API is reachable only inside the harness's namespaces; the apiserver (logs, exec) is
            # its one client, so no client certificates: anonymous, always allowed.
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "oomScoreAdj": 0,  # a negative value needs CAP_SYS_RESOURCE, which this VM lacks
            "resolvConf": str(w / "pod-resolv.conf"),
            "failSwapOn": False,
            "podLogsDir": str(w / "pod-logs"),
            "mergeDefaultEvictionSettings": False,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            # Images are imported, never pulled: garbage collection would delete them for good.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "nodeStatusUpdateFrequency": "4s",
            "shutdownGracePeriod": "0s",
        }
        (w / "kubelet.yaml").write_text(yaml.safe_dump(kubelet_config, sort_keys=False))
        proxy_config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(w / "kube-proxy.kubeconfig")},
            "mode": "iptables", "clusterCIDR": CLUSTER_POD_CIDR, "hostnameOverride": node.name,
            "healthzBindAddress": "127.0.0.1:10256", "metricsBindAddress": "127.0.0.1:10249",
            "oomScoreAdj": 0,
            # 0 = leave the host-wide conntrack sysctls alone.
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
            "nodePortAddresses": [f"{node.ip}/32"],
        }
        (w / "kube-proxy.yaml").write_text(yaml.safe_dump(proxy_config, sort_keys=False))
        config = {
            "workdir": str(w), "harness_pid": os.getpid(), "bin_dir": path_dirs,
            "cgroup_hierarchies": hierarchies, "cgroup_root": node.cgroup_root,
            "ctr": str(binaries["ctr"]), "containerd_socket": socket_path,
            "images": [str(pause_archive_path())],
            "sysctls": {"net.ipv4.ip_forward": "1", "net.bridge.bridge-nf-call-iptables": "1"},
            "containerd_argv": [str(binaries["containerd"]), f"--config={w / 'containerd.toml'}"],
            "kubelet_argv": [str(binaries["kubelet"]), f"--config={w / 'kubelet.yaml'}",
                             f"--kubeconfig={w / 'kubelet.kubeconfig'}", f"--hostname-override={node.name}",
                             f"--node-ip={node.ip}", f"--root-dir={w / 'kubelet'}",
                             f"--cert-dir={w / 'kubelet-pki'}", "--v=1"],
            "kube_proxy_argv": [str(binaries["kube-proxy"]), f"--config={w / 'kube-proxy.yaml'}", "--v=1"],
        }
        (w / "supervisor-config.json").write_text(json.dumps(config, indent=2))

    def _launch_supervisor(self, node: RealNode) -> None:
        log_path = self.logs_dir / f"node-{node.name}.log"
        with open(log_path, "ab") as log_file:
            node.process = subprocess.Popen(
                ["ip", "netns", "exec", node.netns, sys.executable,
                 str(pathlib.Path(__file__).with_name("node_supervisor.py")),
                 str(node.workdir / "supervisor-config.json")],
                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=node.workdir)
        self._log(f"[realnode] started node {node.name} supervisor (pid {node.process.pid}) in netns {node.netns}")

    def node_log_tail(self, node: RealNode, component: str | None = None) -> str:
        path = (node.workdir / "logs" / f"{component}.log") if component else self.logs_dir / f"node-{node.name}.log"
        try:
            return _tail(path.read_text(errors="replace"))
        except FileNotFoundError:
            return "(no log)"

    def _wait_supervisor_running(self, node: RealNode, deadline: float) -> None:
        while True:
            state = node.state()
            if state.get("state") == "running":
                return
            if node.process.poll() is not None or state.get("error") or time.monotonic() > deadline:
                raise ClusterError(f"node {node.name} failed to start ({state.get('error') or 'deadline'}); "
                                   f"supervisor log:\n{self.node_log_tail(node)}\ncontainerd log:\n"
                                   f"{self.node_log_tail(node, 'containerd')}")
            time.sleep(0.1)

    def wait_node_ready(self, name: str, timeout: float = 60.0) -> dict:
        """Waits for the kubelet to register Node `name` and report Ready."""
        node = self.node(name)
        deadline = time.monotonic() + timeout
        last = "not registered"
        while True:
            obj = self._admin_get(f"/api/v1/nodes/{name}")
            if obj is not None:
                conditions = {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions", [])}
                if conditions.get("Ready") == "True":
                    return obj
                last = f"conditions {conditions}"
            if node.process is not None and node.process.poll() is not None:
                raise ClusterError(f"node {name} supervisor exited ({node.process.returncode}):\n"
                                   f"{self.node_log_tail(node)}\nkubelet log:\n{self.node_log_tail(node, 'kubelet')}")
            if time.monotonic() > deadline:
                raise ClusterError(f"node {name} not Ready after {timeout:.0f}s ({last}); kubelet log:\n"
                                   + self.node_log_tail(node, "kubelet"))
            time.sleep(0.2)

    # -- teardown ------------------------------------------------------------------------------------------------
    def _teardown(self) -> None:
        errors = []
        for node in self.nodes:
            if node.process and node.process.poll() is None:
                node.process.terminate()
        for node in self.nodes:
            if not node.process:
                continue
            try:
                node.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                node.process.kill()
                errors.append(f"node {node.name} supervisor killed after 60s")
                try:  # a stalled box may take a while to reap it; a teardown never raises for that
                    node.process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    errors.append(f"node {node.name} supervisor not reaped 60s after SIGKILL")
            state = node.state()
            if state.get("cgroups_left") or state.get("processes_left"):
                errors.append(f"node {node.name}: cgroups left {state.get('cgroups_left')}, "
                              f"processes left {state.get('processes_left')}")
            node.process = None
        self._stop_processes()
        if self._forwarder:
            self._forwarder.close()
            self._forwarder = None
        for name in reversed(self._netns_created):
            proc = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
            if proc.returncode != 0:
                errors.append(f"ip netns del {name}: {proc.stderr.strip()}")
        self._netns_created = []
        self._restore_sysctls()
        (_registry_dir() / f"{self.prefix}.json").unlink(missing_ok=True)
        if errors:
            self._log("[realnode] teardown problems: " + "; ".join(errors))

    def leftovers(self) -> list[str]:
        """What this cluster could have left on the host; empty after a clean stop()."""
        found = []
        netns = pathlib.Path("/run/netns")
        if netns.is_dir():
            found += [f"/run/netns/{p.name}" for p in netns.iterdir() if p.name.startswith(self.prefix)]
        for h in _host_cgroup_hierarchies():
            if h["fstype"] in ("cgroup", "cgroup2"):
                for n in self.nodes:
                    path = pathlib.Path("/sys/fs/cgroup") / h["name"] / n.cgroup_root.strip("/")
                    if path.exists():
                        found.append(str(path))
        for key, value in self._saved_sysctls.items():
            if _read_sysctl(key) != value:
                found.append(f"sysctl {key}={_read_sysctl(key)} (was {value})")
        for n in self.nodes:
            for pid in (n.state().get("pids") or {}).values():
                if pathlib.Path(f"/proc/{pid}").exists():
                    found.append(f"pid {pid} of node {n.name}")
        return found

    # -- API for tests ---------------------------------------------------------------------------------------
    def node_exec(self, node: str, argv: list[str], *, input: str | None = None, timeout: float = 60,
                  check: bool = True) -> subprocess.CompletedProcess:
        """Runs argv in node `node`'s network and mount namespace (as the kubelet and containerd see them)."""
        pid = self.node(node).pid("kubelet")
        proc = subprocess.run(["nsenter", "-t", str(pid), "-m", "-n", *argv], input=input, capture_output=True,
                              text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"{argv} in node {node} failed ({proc.returncode}):\n{_tail(proc.stdout + proc.stderr)}")
        return proc

    def import_image(self, archive: str | os.PathLike, nodes: list[str] | None = None) -> None:
        """Imports an OCI/docker archive into the containerd (k8s.io namespace) of every node (or `nodes`)."""
        import concurrent.futures

        targets = [n.name for n in self.nodes if nodes is None or n.name in nodes]
        argv = [str(node_binary_path("ctr")), "--address", "/run/containerd/containerd.sock", "-n", "k8s.io",
                "images", "import", str(archive)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(targets) or 1) as pool:
            for future in [pool.submit(self.node_exec, name, argv, timeout=900) for name in targets]:
                future.result()

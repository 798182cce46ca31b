#!/usr/bin/env python3
"""Real-node mode of the local cluster: the control plane of localcluster.py plus real nodes (containerd, runc,
CNI, kubelet, kube-proxy), every process inside network namespaces this harness creates, with no default route.

Layout (all addresses are RFC 2544 space, never eth0's and never a private range; see
../shared/notes/realnode.md for the network rule):

    netns <prefix>-hub     bridge br0 198.18.0.1/24: etcd, kube-apiserver (:6443), controller-manager, scheduler
    netns <prefix>-n<i>    eth0 198.18.0.(1+i)/24 (a veth whose peer is on br0 in the hub), node-local bridge
                           cni0 with pods 198.18.(63+i).0/24; containerd, kubelet, kube-proxy under one supervisor
    services               198.19.0.0/16; `kubernetes` = 198.19.0.1 -> 198.18.0.1:6443

The root namespace reaches the apiserver through a loopback listener (127.0.0.1:<port>) that this process forwards
into the hub, so `cluster.kubeconfig`, `cluster.kubectl()` and `cluster.api_client()` work as with LocalCluster.
Tests reach pods and Services from inside a node namespace with `cluster.node_exec()`.

    from devcluster.realnode import RealNodeCluster, build_node
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

import contextlib
import ctypes
import datetime
import fcntl
import hashlib
import io
import ipaddress
import json
import os
import pathlib
import secrets
import selectors
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from typing import Callable, Iterator

import yaml

if __package__ in (None, ""):  # run as a script: make `devcluster` importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from devcluster.localcluster import (  # noqa: E402
    GO_MODULES_DIR, KUBERNETES_VERSION, REPO_ROOT, BuildError, ClusterError, LocalCluster, _Component, _build_lock,
    NO_DEBUG_LDFLAGS, _kube_ldflags, _run_go, _tail, _write_kubeconfig, build, cache_root,
)

CONTAINERD_VERSION = "v2.4.2"
# runc, CNI plugins, iptables, conntrack come from Debian; hack/lib.sh ensure_realnode installs these packages.
DEBIAN_PACKAGES = ("runc", "containernetworking-plugins", "iptables", "nftables", "conntrack")
REQUIRED_HOST_FILES = {"/usr/sbin/runc": "runc", "/usr/lib/cni/bridge": "containernetworking-plugins",
                       "/usr/lib/cni/host-local": "containernetworking-plugins",
                       "/usr/lib/cni/loopback": "containernetworking-plugins",
                       "/usr/lib/cni/portmap": "containernetworking-plugins",
                       "/usr/sbin/iptables": "iptables", "/usr/sbin/conntrack": "conntrack"}
PAUSE_VERSION = "3.10.2"  # kubernetes v1.36.3 build/pause/Makefile TAG; the binary is compiled from its pause.c
PAUSE_IMAGE = f"localhost/pdpair/pause:{PAUSE_VERSION}"

HUB_IP = "198.18.0.1"
NODE_NET = ipaddress.ip_network("198.18.0.0/24")
CLUSTER_POD_CIDR = "198.18.64.0/18"   # kube-proxy's clusterCIDR; node i gets 198.18.(63+i).0/24
SERVICE_CIDR = "198.19.0.0/16"
KUBERNETES_SERVICE_IP = "198.19.0.1"
APISERVER_PORT = 6443
# The kubelet writes these host-wide sysctls at start (it cannot be told not to); they are put back.
KUBELET_HOST_SYSCTLS = ("vm.overcommit_memory", "kernel.panic", "kernel.panic_on_oops")

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL("libc.so.6", use_errno=True)

NODE_BINARIES = {"kubelet": KUBERNETES_VERSION, "kube-proxy": KUBERNETES_VERSION,
                 "containerd": CONTAINERD_VERSION, "containerd-shim-runc-v2": CONTAINERD_VERSION,
                 "ctr": CONTAINERD_VERSION}


# ---------------------------------------------------------------------------------------------------------------
# Build: kubelet + kube-proxy (devcluster/go/kube), containerd (devcluster/go/containerd), pause image
# ---------------------------------------------------------------------------------------------------------------

def node_binary_path(name: str) -> pathlib.Path:
    return cache_root() / "controlplane" / f"{name}-{NODE_BINARIES[name]}" / name


def pause_archive_path() -> pathlib.Path:
    return cache_root() / "controlplane" / f"pause-{PAUSE_VERSION}-{KUBERNETES_VERSION}" / "pause.oci.tar"


def _install_binary(built: pathlib.Path, dest: pathlib.Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.copy2(built, tmp)
    os.replace(tmp, dest)


def check_host_packages() -> None:
    missing = sorted({pkg for path, pkg in REQUIRED_HOST_FILES.items() if not os.path.exists(path)})
    if missing:
        raise BuildError(f"Debian packages missing for the real node: {' '.join(missing)}; install them with "
                         f"`apt-get install -y --no-install-recommends {' '.join(DEBIAN_PACKAGES)}` "
                         "(hack/lib.sh ensure_realnode does)")


def build_node(log: Callable[[str], None] = print) -> dict[str, pathlib.Path]:
    """Builds (or reuses) the control plane, kubelet, kube-proxy, containerd, shim, ctr and the pause image."""
    build(log=log)
    check_host_packages()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdpair-nodebuild-") as out:
        out_dir = pathlib.Path(out)
        with _build_lock("kube-node"):
            missing = [c for c in ("kubelet", "kube-proxy") if not node_binary_path(c).is_file()]
            if missing:
                t0 = time.monotonic()
                _run_go("kube", ["build", "-ldflags", _kube_ldflags(), "-o", f"{out_dir}/",
                                 *[f"./cmd/{c}" for c in missing]], GO_MODULES_DIR / "kube", log)
                for c in missing:
                    _install_binary(out_dir / c, node_binary_path(c))
                log(f"[build] {', '.join(missing)} built in {time.monotonic() - t0:.0f}s")
        with _build_lock("containerd"):
            names = ("containerd", "containerd-shim-runc-v2", "ctr")
            if not all(node_binary_path(n).is_file() for n in names):
                t0 = time.monotonic()
                env_before = os.environ.get("CGO_ENABLED")
                os.environ["CGO_ENABLED"] = "0"  # static: the shim is exec'd in other mount namespaces
                try:
                    _run_go("containerd", [
                        "build", "-tags", "no_btrfs no_devmapper no_zfs",
                        "-ldflags", " ".join([*NO_DEBUG_LDFLAGS,
                                              f"-X github.com/containerd/containerd/v2/version.Version={CONTAINERD_VERSION}"]),
                        "-o", f"{out_dir}/", *[f"github.com/containerd/containerd/v2/cmd/{n}" for n in names]],
                        GO_MODULES_DIR / "containerd", log)
                finally:
                    if env_before is None:
                        os.environ.pop("CGO_ENABLED", None)
                    else:
                        os.environ["CGO_ENABLED"] = env_before
                for n in names:
                    _install_binary(out_dir / n, node_binary_path(n))
                log(f"[build] containerd {CONTAINERD_VERSION} built in {time.monotonic() - t0:.0f}s")
        with _build_lock("pause"):
            if not pause_archive_path().is_file():
                _build_pause(out_dir, log)
    log(f"[build] real-node parts ready in {time.monotonic() - started:.1f}s")
    return {n: node_binary_path(n) for n in NODE_BINARIES}


def _kubernetes_module_dir() -> pathlib.Path:
    proc = subprocess.run(["go", "list", "-m", "-f", "{{.Dir}}", "k8s.io/kubernetes"], cwd=GO_MODULES_DIR / "kube",
                          capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise BuildError(f"cannot locate k8s.io/kubernetes in the module cache: {proc.stderr}")
    return pathlib.Path(proc.stdout.strip())


def _build_pause(out_dir: pathlib.Path, log: Callable[[str], None]) -> None:
    source = _kubernetes_module_dir() / "build" / "pause" / "linux" / "pause.c"
    binary = out_dir / "pause"
    cmd = ["gcc", "-Os", "-Wall", "-Werror", "-static", f"-DVERSION=v{PAUSE_VERSION}-pdpair", "-o", str(binary),
           str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"pause: `{' '.join(cmd)}` failed: {proc.stderr}")
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tar.gettarinfo(str(binary), arcname="pause")
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        info.mtime = 0
        with open(binary, "rb") as fh:
            tar.addfile(info, fh)
    dest = pause_archive_path()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(".pause.oci.tar.tmp")
    write_oci_archive(tmp, PAUSE_IMAGE, [layer.getvalue()],
                      {"Entrypoint": ["/pause"], "User": "65535:65535"})
    os.replace(tmp, dest)
    log(f"[build] pause image {PAUSE_IMAGE} from {source}")


def write_oci_archive(dest: pathlib.Path, ref: str, layers: list[bytes], config: dict) -> str:
    """Writes an OCI image layout tar (uncompressed layers) that `ctr images import` takes; returns the manifest
    digest. `ref` goes into the index's ref-name annotation, which is the image name after import."""
    with tempfile.TemporaryDirectory(prefix="pdpair-oci-") as tmp:
        paths = []
        for i, data in enumerate(layers):
            paths.append(pathlib.Path(tmp) / f"layer{i}.tar")
            paths[-1].write_bytes(data)
        return write_oci_archive_from_files(dest, ref, paths, config)


def write_oci_archive_from_files(dest: pathlib.Path, ref: str, layers: list[pathlib.Path], config: dict) -> str:
    """write_oci_archive for layer tar files (streamed, never read whole into memory)."""
    blobs: dict[str, bytes | pathlib.Path] = {}

    def blob(data: bytes) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    def file_blob(path: pathlib.Path) -> dict:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        digest = "sha256:" + h.hexdigest()
        blobs[digest] = path
        return {"digest": digest, "size": path.stat().st_size}

    layer_descs = [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **file_blob(p)} for p in layers]
    image_config = {
        "architecture": "amd64", "os": "linux", "config": config,
        "rootfs": {"type": "layers", "diff_ids": [d["digest"] for d in layer_descs]},
        # One history entry per layer, as every builder writes: buildah checks that an image built FROM this one
        # has as many non-empty history entries as layers, and refuses a second-generation child otherwise
        # ("history lists 2 non-empty layers, but we have 3 layers on disk": engine on engine-base on this base).
        "history": [{"created_by": f"pdpair: {p.name}"} for p in layers],
    }
    config_desc = {"mediaType": "application/vnd.oci.image.config.v1+json",
                   **blob(json.dumps(image_config, sort_keys=True).encode())}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": config_desc, "layers": layer_descs}
    manifest_desc = {"mediaType": "application/vnd.oci.image.manifest.v1+json",
                     **blob(json.dumps(manifest, sort_keys=True).encode()),
                     "annotations": {"org.opencontainers.image.ref.name": ref, "io.containerd.image.name": ref}}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [manifest_desc]}

    def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = 0o644
        tar.addfile(info, io.BytesIO(data))

    with tarfile.open(dest, "w") as tar:
        add(tar, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add(tar, "index.json", json.dumps(index).encode())
        for digest, data in blobs.items():
            name = f"blobs/sha256/{digest.split(':', 1)[1]}"
            if isinstance(data, pathlib.Path):
                info = tarfile.TarInfo(name)
                info.size = data.stat().st_size
                info.mode = 0o644
                with open(data, "rb") as fh:
                    tar.addfile(info, fh)
            else:
                add(tar, name, data)
    return manifest_desc["digest"]


# ---------------------------------------------------------------------------------------------------------------
# Network namespaces
# ---------------------------------------------------------------------------------------------------------------

def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def in_netns(netns: str, fn: Callable[[], object]) -> object:
    """Runs fn in a fresh thread that has joined network namespace `netns` (setns is per thread); sockets
    created there stay in that namespace. Returns fn's result or raises its exception."""
    result: dict = {}

    def target() -> None:
        try:
            with open(f"/run/netns/{netns}") as fh:
                if _libc.setns(fh.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({netns}) failed")
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{netns}", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result.get("value")


class LoopbackForwarder:
    """127.0.0.1:<port> in the root namespace -> host:port inside a network namespace (one thread per
    connection). This is how tests and the CLI user reach the apiserver without any route out of the cluster."""

    def __init__(self, netns: str, target: tuple[str, int]):
        self.netns = netns
        self.target = target
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="apiserver-forwarder", daemon=True)

    def start(self) -> "LoopbackForwarder":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            upstream = in_netns(self.netns, lambda: socket.create_connection(self.target, timeout=10))
        except OSError:
            conn.close()
            return
        upstream.settimeout(None)
        sel = selectors.DefaultSelector()
        sel.register(conn, selectors.EVENT_READ, upstream)
        sel.register(upstream, selectors.EVENT_READ, conn)
        try:
            while not self._closed:
                for key, _ in sel.select(timeout=1.0):
                    data = key.fileobj.recv(65536)
                    if not data:
                        return
                    key.data.sendall(data)
        except OSError:
            pass
        finally:
            sel.close()
            conn.close()
            upstream.close()


# ---------------------------------------------------------------------------------------------------------------
# Certificates: one CA; the apiserver's serving cert valid for every name clients use
# ---------------------------------------------------------------------------------------------------------------

def _write_serving_certs(directory: pathlib.Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdpair-realnode-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=7))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
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
# The cluster
# ---------------------------------------------------------------------------------------------------------------

def _host_cgroup_hierarchies() -> list[dict]:
    """The cgroup mounts under /sys/fs/cgroup as the host has them (the supervisor re-creates them)."""
    out = []
    for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        mountpoint = left.split()[4]
        fstype, _source, options = right.split()[:3]
        if fstype in ("cgroup", "cgroup2") and mountpoint.startswith("/sys/fs/cgroup/"):
            opts = ",".join(o for o in options.split(",") if o not in ("rw", "ro"))
            out.append({"name": mountpoint[len("/sys/fs/cgroup/"):], "fstype": fstype, "options": opts})
    for entry in pathlib.Path("/sys/fs/cgroup").iterdir():
        if entry.is_symlink():
            out.append({"name": entry.name, "fstype": "symlink", "symlink": os.readlink(entry)})
    if not out:
        raise ClusterError("no cgroup hierarchies mounted under /sys/fs/cgroup")
    return out


def _read_sysctl(key: str) -> str:
    return pathlib.Path("/proc/sys", key.replace(".", "/")).read_text().strip()


def _write_sysctl(key: str, value: str) -> None:
    pathlib.Path("/proc/sys", key.replace(".", "/")).write_text(value)


def _registry_dir() -> pathlib.Path:
    path = cache_root() / "realnode-clusters"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _pid_alive(pid: int) -> bool:
    return pathlib.Path(f"/proc/{pid}").exists()


def _remove_cgroup_tree(path: pathlib.Path, timeout: float = 15.0) -> None:
    """SIGKILLs every process left in the tree (containers outlive a killed supervisor), then removes it."""
    if not path.is_dir():
        return
    deadline = time.monotonic() + timeout
    dirs = sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [path]
    while True:
        pids = set()
        for d in dirs:
            with contextlib.suppress(OSError):
                pids |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
        if not pids or time.monotonic() > deadline:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        time.sleep(0.2)
    for sub in dirs:
        with contextlib.suppress(OSError):
            sub.rmdir()


def sweep_stale_clusters(log: Callable[[str], None] = lambda msg: None) -> list[str]:
    """Removes what clusters whose harness process died (SIGKILL, a killed test run) left behind: processes still
    in their namespaces, the namespaces, their cgroup trees, their work directory (unless kept), and (when no other
    cluster is alive) the host sysctls
    the kubelet changed. Every cluster records itself under ~/.cache/pdpair/realnode-clusters/ while it runs."""
    swept = []
    entries = []
    for path in _registry_dir().glob("*.json"):
        try:
            entries.append((path, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError):
            continue
    alive = [e for _, e in entries if _pid_alive(e["harness_pid"])]
    for path, entry in entries:
        if _pid_alive(entry["harness_pid"]):
            continue
        for netns in entry.get("netns", []):
            if not pathlib.Path(f"/run/netns/{netns}").exists():
                continue
            pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            deadline = time.monotonic() + 10
            while any(_pid_alive(int(p)) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.1)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
            swept.append(netns)
        for root in entry.get("cgroup_roots", []):
            for h in _host_cgroup_hierarchies():
                if h["fstype"] in ("cgroup", "cgroup2"):
                    target = pathlib.Path("/sys/fs/cgroup") / h["name"] / root.strip("/")
                    if target.exists():
                        _remove_cgroup_tree(target)
                        swept.append(str(target))
        workdir = pathlib.Path(entry.get("workdir") or "")
        if not entry.get("keep_workdir", True) and workdir.name.startswith("pdpair-cluster-") and workdir.is_dir():
            # its containerd state and images are ~10 GiB: a few killed runs filled the disk
            subprocess.run(["rm", "-rf", "--one-file-system", str(workdir)], capture_output=True)
            swept.append(str(workdir))
        if not alive:
            for key, value in (entry.get("saved_sysctls") or {}).items():
                if _read_sysctl(key) != value:
                    _write_sysctl(key, value)
                    swept.append(f"sysctl {key}={value}")
        path.unlink(missing_ok=True)
    if swept:
        log(f"[realnode] swept what dead clusters left: {swept}")
    return swept


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
                 keep_workdir: bool = False, log: Callable[[str], None] = lambda msg: None):
        super().__init__(workdir, start_timeout=start_timeout, keep_workdir=keep_workdir, log=log)
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

    def _wait_healthy(self, component: _Component, deadline: float) -> None:
        # The control plane listens inside the hub namespace; probe it from there.
        in_netns(self.hub, lambda: LocalCluster._wait_healthy(self, component, deadline))

    def describe(self) -> dict:
        return {**super().describe(), "mode": "realnode", "netns": [self.hub] + [n.netns for n in self.nodes],
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
                node.process.wait(timeout=10)
                errors.append(f"node {node.name} supervisor killed after 60s")
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

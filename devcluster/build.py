"""Go builds and their cache: the control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
kwok) and the real node's parts (kubelet, kube-proxy, containerd, its shim, ctr, the pause image), each built from
the Go modules under devcluster/go/ and cached by version under ${XDG_CACHE_HOME:-~/.cache}/pdpair/controlplane/;
add-ons built on demand (prometheus-adapter: `build_prometheus_adapter()`); kubectl and helm from hack/tools.sh.

    from devcluster.build import build, build_node, build_prometheus_adapter, kubectl_path, helm_path
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import io
import os
import pathlib
import shutil
import subprocess
import tarfile
import tempfile
import time
from typing import Callable, Iterator

from devcluster.errors import BuildError, ClusterError, _tail
from devcluster.oci import write_oci_archive

KUBERNETES_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.8.0"

CLUSTER_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = CLUSTER_DIR.parent
GO_MODULES_DIR = CLUSTER_DIR / "go"
TOOLS_SCRIPT = REPO_ROOT / "hack" / "tools.sh"

KUBE_COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
COMPONENT_VERSIONS = {
    "etcd": ETCD_VERSION,
    "kube-apiserver": KUBERNETES_VERSION,
    "kube-controller-manager": KUBERNETES_VERSION,
    "kube-scheduler": KUBERNETES_VERSION,
    "kwok": KWOK_VERSION,
}

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

# sigs.k8s.io/prometheus-adapter: the proxy lists no version of it (`go list -m -versions` answers 403) but serves
# the exact release v0.12.0 (its newest; go.mod `go 1.22.1`, k8s.io/* v0.30.0, no replace lines), which Go 1.26.8
# builds. Its own module (devcluster/go/prometheus-adapter) keeps k8s.io/* v0.30 apart from go/kube's v0.36.
PROMETHEUS_ADAPTER_VERSION = "v0.12.0"
ADDON_BINARIES = {"prometheus-adapter": PROMETHEUS_ADAPTER_VERSION}

NODE_BINARIES = {"kubelet": KUBERNETES_VERSION, "kube-proxy": KUBERNETES_VERSION,
                 "containerd": CONTAINERD_VERSION, "containerd-shim-runc-v2": CONTAINERD_VERSION,
                 "ctr": CONTAINERD_VERSION}


# ---------------------------------------------------------------------------------------------------------------
# Control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok (devcluster/go/{kube,etcd,kwok})
# ---------------------------------------------------------------------------------------------------------------

def cache_root() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "pdpair"


def component_dir(component: str) -> pathlib.Path:
    return cache_root() / "controlplane" / f"{component}-{COMPONENT_VERSIONS[component]}"


def binary_path(component: str) -> pathlib.Path:
    return component_dir(component) / component

def _run_go(module: str, args: list[str], cwd: pathlib.Path, log: Callable[[str], None],
            static: bool = False) -> None:
    """`static`: CGO_ENABLED=0 for this build only (a binary exec'd in other mount namespaces or images)."""
    env = dict(os.environ)
    if static:
        env["CGO_ENABLED"] = "0"
    env["GOFLAGS"] = (env.get("GOFLAGS", "") + " -buildvcs=false").strip()
    cmd = ["go", *args]
    log(f"[build] {module}: {' '.join(cmd)} (in {cwd.relative_to(REPO_ROOT)})")
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise BuildError(f"module {module}: `go` is not on PATH ({exc}); install Go >= 1.26") from exc
    if proc.returncode != 0:
        raise BuildError(
            f"module {module}: command `{' '.join(cmd)}` in {cwd} failed with exit code {proc.returncode}:\n"
            + _tail(proc.stdout + proc.stderr)
        )


def _check_kube_gomod() -> None:
    gomod = (GO_MODULES_DIR / "kube" / "go.mod").read_text()
    if f"k8s.io/kubernetes {KUBERNETES_VERSION}" not in gomod:
        raise BuildError(
            f"devcluster/go/kube/go.mod does not require k8s.io/kubernetes {KUBERNETES_VERSION}; regenerate it: "
            f"python devcluster/go/gen_kube_gomod.py {KUBERNETES_VERSION} --out devcluster/go/kube && "
            "(cd devcluster/go/kube && go mod tidy)"
        )


@contextlib.contextmanager
def _build_lock(name: str) -> Iterator[None]:
    """Serialise builds of one component across processes (several checkouts share the cache)."""
    lock_dir = cache_root() / "controlplane"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _install(built: pathlib.Path, component: str) -> None:
    dest_dir = component_dir(component)
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest_dir / f".{component}.tmp"
    shutil.copy2(built, tmp)
    os.replace(tmp, dest_dir / component)  # atomic: a reader never sees a half-written binary


# No symbol table or DWARF: the linker's slowest part for binaries this size, and nobody debugs them here. Not
# -trimpath: it changes every package's build-cache key, so a cache filled without it would be rebuilt whole.
NO_DEBUG_LDFLAGS = ("-s", "-w")


def _kube_ldflags() -> str:
    major, minor, _ = KUBERNETES_VERSION.lstrip("v").split(".")
    pkg = "k8s.io/component-base/version"
    return " ".join([
        *NO_DEBUG_LDFLAGS,
        f"-X {pkg}.gitVersion={KUBERNETES_VERSION}",
        f"-X {pkg}.gitMajor={major}",
        f"-X {pkg}.gitMinor={minor}",
        f"-X {pkg}.gitTreeState=clean",
    ])


def build(log: Callable[[str], None] = print) -> dict[str, pathlib.Path]:
    """Builds (or reuses from the cache) every control-plane binary; returns component -> binary path."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdpair-cpbuild-") as out:
        out_dir = pathlib.Path(out)
        with _build_lock("kube"):
            missing = [c for c in KUBE_COMPONENTS if not binary_path(c).is_file()]
            if missing:
                _check_kube_gomod()
                t0 = time.monotonic()
                _run_go("kube", ["build", "-ldflags", _kube_ldflags(), "-o", f"{out_dir}/",
                                 *[f"./cmd/{c}" for c in missing]], GO_MODULES_DIR / "kube", log)
                for c in missing:
                    _install(out_dir / c, c)
                log(f"[build] kube ({', '.join(missing)}) built in {time.monotonic() - t0:.0f}s")
        for component, module, package in (
            ("etcd", "etcd", "go.etcd.io/etcd/server/v3"),
            ("kwok", "kwok", "sigs.k8s.io/kwok/cmd/kwok"),
        ):
            with _build_lock(component):
                if binary_path(component).is_file():
                    continue
                t0 = time.monotonic()
                _run_go(module, ["build", "-ldflags", " ".join(NO_DEBUG_LDFLAGS), "-o", str(out_dir / component),
                                 package], GO_MODULES_DIR / module, log)
                _install(out_dir / component, component)
                log(f"[build] {component} built in {time.monotonic() - t0:.0f}s")
    paths = {c: binary_path(c) for c in COMPONENT_VERSIONS}
    log(f"[build] control plane ready in {time.monotonic() - started:.1f}s: {component_dir('etcd').parent}")
    return paths

# ---------------------------------------------------------------------------------------------------------------
# kubectl and helm (hack/tools.sh)
# ---------------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def tools_bin_dir() -> pathlib.Path:
    """Runs hack/tools.sh (cached after the first run) and returns the directory holding kubectl and helm."""
    proc = subprocess.run(["bash", str(TOOLS_SCRIPT)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"{TOOLS_SCRIPT} failed with exit code {proc.returncode}:\n{_tail(proc.stderr)}")
    return pathlib.Path(proc.stdout.strip().splitlines()[-1])


def kubectl_path() -> pathlib.Path:
    return tools_bin_dir() / "kubectl"


def helm_path() -> pathlib.Path:
    return tools_bin_dir() / "helm"


# ---------------------------------------------------------------------------------------------------------------
# Real node: kubelet + kube-proxy (devcluster/go/kube), containerd (devcluster/go/containerd), pause image
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
                # static: the shim is exec'd in other mount namespaces
                _run_go("containerd", [
                    "build", "-tags", "no_btrfs no_devmapper no_zfs",
                    "-ldflags", " ".join([*NO_DEBUG_LDFLAGS,
                                          f"-X github.com/containerd/containerd/v2/version.Version={CONTAINERD_VERSION}"]),
                    "-o", f"{out_dir}/", *[f"github.com/containerd/containerd/v2/cmd/{n}" for n in names]],
                    GO_MODULES_DIR / "containerd", log, static=True)
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


# ---------------------------------------------------------------------------------------------------------------
# Add-ons, not built by build()/build_node() (most uses never need them): prometheus-adapter, built by its first
# user and by hack/test.sh's background Go job (ensure_prometheus_adapter)
# ---------------------------------------------------------------------------------------------------------------

def addon_binary_path(name: str) -> pathlib.Path:
    return cache_root() / "controlplane" / f"{name}-{ADDON_BINARIES[name]}" / name


def build_prometheus_adapter(log: Callable[[str], None] = print) -> pathlib.Path:
    """Builds (or reuses) sigs.k8s.io/prometheus-adapter/cmd/adapter at PROMETHEUS_ADAPTER_VERSION from
    devcluster/go/prometheus-adapter: static (CGO_ENABLED=0, as upstream's Makefile builds it), so it runs in a
    one-layer image with nothing else in it (devcluster/prometheus_adapter.py). Cached like the control plane:
    ~/.cache/pdpair/controlplane/prometheus-adapter-<version>/prometheus-adapter, under a per-component lock."""
    dest = addon_binary_path("prometheus-adapter")
    with _build_lock("prometheus-adapter"):
        if dest.is_file():
            return dest
        gomod = (GO_MODULES_DIR / "prometheus-adapter" / "go.mod").read_text()
        if f"sigs.k8s.io/prometheus-adapter {PROMETHEUS_ADAPTER_VERSION}" not in gomod:
            raise BuildError(f"devcluster/go/prometheus-adapter/go.mod does not require sigs.k8s.io/prometheus-adapter "
                             f"{PROMETHEUS_ADAPTER_VERSION}; run `go get sigs.k8s.io/prometheus-adapter@"
                             f"{PROMETHEUS_ADAPTER_VERSION} && go mod tidy` there")
        with tempfile.TemporaryDirectory(prefix="pdpair-adapterbuild-") as out:
            t0 = time.monotonic()
            _run_go("prometheus-adapter", ["build", "-ldflags", " ".join(NO_DEBUG_LDFLAGS),
                                           "-o", f"{out}/prometheus-adapter",
                                           "sigs.k8s.io/prometheus-adapter/cmd/adapter"],
                    GO_MODULES_DIR / "prometheus-adapter", log, static=True)
            _install_binary(pathlib.Path(out) / "prometheus-adapter", dest)
            log(f"[build] prometheus-adapter {PROMETHEUS_ADAPTER_VERSION} built in "
                f"{time.monotonic() - t0:.0f}s: {dest}")
    return dest

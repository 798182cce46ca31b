#!/usr/bin/env python3
"""A real, local Kubernetes control plane for tests: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok (fake nodes), built from upstream Go modules and run on free loopback ports.

Python API (stable; other test suites depend on it):

    from devcluster.build import build, kubectl_path, helm_path
    from devcluster.localcluster import LocalCluster

    build()                                   # builds/caches the binaries (idempotent)
    with LocalCluster() as cluster:           # starts everything, waits for readiness
        cluster.kubeconfig                    # admin kubeconfig (system:masters token)
        cluster.add_node("node-a")            # kwok-managed fake Node, InternalIP 127.0.0.1
        cluster.create_namespace("ns1")       # waits for its default ServiceAccount
        path = cluster.service_account_kubeconfig("ns1", "operator")   # authenticates as that SA
        cluster.kubectl("get", "pods", "-A")  # our kubectl (hack/tools.sh), admin kubeconfig
        api = cluster.api_client()            # kubernetes.client.ApiClient as admin

CLI:
    python devcluster/localcluster.py build
    python devcluster/localcluster.py up --dir D [--background]   # writes D/kubeconfig
    python devcluster/localcluster.py down --dir D
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Callable

import yaml

if __package__ in (None, ""):  # run as a script: `devcluster.realnode` is imported for --real-nodes
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from devcluster.build import COMPONENT_VERSIONS, build, kubectl_path  # noqa: E402  (after the path fix above)
from devcluster.errors import COMPONENT_LOG_TAIL_CHARS, BuildError, ClusterError, _tail  # noqa: E402
from devcluster.kwok import FAKE_NODE_LABEL, POD_CIDR, _node_stage_configs  # noqa: E402
from devcluster.ports import free_port, pid_alive  # noqa: E402
from devcluster.processes import _Component, _die_with_parent, _write_kubeconfig, stop_child  # noqa: E402

SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
DEFAULT_NODE_CAPACITY = {"cpu": "64", "memory": "512Gi", "pods": "110"}


# ---------------------------------------------------------------------------------------------------------------
# Cluster
# ---------------------------------------------------------------------------------------------------------------

class LocalCluster:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok on free loopback ports.

    Use as a context manager, or call start()/stop(). All state lives in `workdir` (a fresh temp dir unless
    given); component logs are `workdir/logs/<component>.log`.
    """

    def __init__(self, workdir: str | os.PathLike | None = None, *, start_timeout: float = 120.0,
                 keep_workdir: bool = False, log: Callable[[str], None] = lambda msg: None):
        self._given_workdir = workdir is not None
        self.workdir = pathlib.Path(workdir) if workdir else pathlib.Path(tempfile.mkdtemp(prefix="pdpair-cluster-"))
        self.start_timeout = start_timeout
        self.keep_workdir = keep_workdir or self._given_workdir
        self._log = log
        self._components: list[_Component] = []
        self.admin_token = secrets.token_urlsafe(24)
        self._tokens = {
            "kube-controller-manager": secrets.token_urlsafe(24),
            "kube-scheduler": secrets.token_urlsafe(24),
            "kwok": secrets.token_urlsafe(24),
        }
        self.apiserver_port = 0
        self.etcd_port = 0
        self._api_client = None

    # -- paths -----------------------------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> pathlib.Path:
        return self.workdir / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    @property
    def ca_file(self) -> pathlib.Path:
        # kube-apiserver writes a self-signed serving cert (with its CA) into --cert-dir.
        return self.workdir / "apiserver-certs" / "apiserver.crt"

    @property
    def logs_dir(self) -> pathlib.Path:
        return self.workdir / "logs"

    # -- lifecycle -------------------------------------------------------------------------------------------
    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "LocalCluster":
        binaries = build(log=self._log)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(exist_ok=True)
        deadline = time.monotonic() + self.start_timeout
        # Free ports are picked by binding port 0 and releasing it; another test may grab one in between, so a
        # start that fails on a taken port is retried on new ports.
        for attempt in range(3):
            try:
                self._start_once(binaries, deadline)
                return self
            except ClusterError as exc:
                self._stop_processes()
                if "address already in use" in str(exc) and attempt < 2 and time.monotonic() < deadline:
                    self._log(f"[cluster] port clash, retrying on new ports: {str(exc).splitlines()[0]}")
                    shutil.rmtree(self.workdir / "etcd-data", ignore_errors=True)
                    os.replace(self.logs_dir, self.workdir / f"logs.failed-attempt-{attempt + 1}")
                    self.logs_dir.mkdir()
                    continue
                raise
        raise AssertionError("unreachable")

    def _start_once(self, binaries: dict[str, pathlib.Path], deadline: float) -> None:
        self._write_credentials()
        self.etcd_port, etcd_peer_port = free_port(), free_port()
        self.apiserver_port = free_port()
        kcm_port, scheduler_port = free_port(), free_port()
        w = self.workdir
        self._write_kubeconfigs()

        etcd = _Component("etcd", [
            str(binaries["etcd"]), "--name=local", f"--data-dir={w / 'etcd-data'}",
            f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{etcd_peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer_port}",
            f"--initial-cluster=local=http://127.0.0.1:{etcd_peer_port}",
            "--unsafe-no-fsync",  # test data; fsync on a shared disk costs seconds per write burst
            "--log-level=warn",
        ], f"http://127.0.0.1:{self.etcd_port}/health")
        apiserver = _Component("kube-apiserver", [
            str(binaries["kube-apiserver"]),
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            f"--secure-port={self.apiserver_port}", "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--cert-dir={w / 'apiserver-certs'}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={w / 'sa.pub'}",
            f"--service-account-signing-key-file={w / 'sa.key'}",
            "--authorization-mode=Node,RBAC",
            f"--token-auth-file={w / 'tokens.csv'}",
            "--allow-privileged=true",
            # The `kubernetes` Service cannot point at a loopback address; clients here use the kubeconfig.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
        ], f"{self.server}/readyz")
        kcm_kubeconfig = str(w / "kube-controller-manager.kubeconfig")
        kcm = _Component("kube-controller-manager", [
            str(binaries["kube-controller-manager"]),
            f"--kubeconfig={kcm_kubeconfig}",
            f"--authentication-kubeconfig={kcm_kubeconfig}", f"--authorization-kubeconfig={kcm_kubeconfig}",
            f"--secure-port={kcm_port}", "--bind-address=127.0.0.1", f"--cert-dir={w / 'kcm-certs'}",
            "--leader-elect=false",
            "--use-service-account-credentials=true",  # each controller acts as its own SA, under bootstrap RBAC
            f"--service-account-private-key-file={w / 'sa.key'}",
            f"--root-ca-file={self.ca_file}",
            "--profiling=false",
        ], f"https://127.0.0.1:{kcm_port}/healthz")
        scheduler_kubeconfig = str(w / "kube-scheduler.kubeconfig")
        scheduler = _Component("kube-scheduler", [
            str(binaries["kube-scheduler"]),
            f"--kubeconfig={scheduler_kubeconfig}",
            f"--authentication-kubeconfig={scheduler_kubeconfig}",
            f"--authorization-kubeconfig={scheduler_kubeconfig}",
            f"--secure-port={scheduler_port}", "--bind-address=127.0.0.1", f"--cert-dir={w / 'scheduler-certs'}",
            "--leader-elect=false",
            "--profiling=false",
        ], f"https://127.0.0.1:{scheduler_port}/healthz")
        stages_file = w / "kwok-stages.yaml"
        stages_file.write_text(yaml.safe_dump_all(_node_stage_configs(), sort_keys=False))
        kwok = _Component("kwok", [
            str(binaries["kwok"]),
            f"--kubeconfig={w / 'kwok.kubeconfig'}",
            f"--config={stages_file}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-label-selector={FAKE_NODE_LABEL[0]}={FAKE_NODE_LABEL[1]}",
            "--node-ip=127.0.0.1",
            f"--cidr={POD_CIDR}",
            "--node-lease-duration-seconds=40",
        ], None)

        self._launch(etcd)
        self._wait_healthy(etcd, deadline)
        self._launch(apiserver)
        self._wait_healthy(apiserver, deadline)
        _write_kubeconfig(self.kubeconfig, self.server, self.ca_file, "admin", self.admin_token)
        for component in (kcm, scheduler, kwok):
            self._launch(component)
        for component in (kcm, scheduler):
            self._wait_healthy(component, deadline)
        # kube-controller-manager's serviceaccount controller makes default/default; without it no pod can be
        # admitted, so it is the signal that the controllers really run.
        self._wait_for(lambda: self._admin_get("/api/v1/namespaces/default/serviceaccounts/default") is not None,
                       deadline, "ServiceAccount default/default (kube-controller-manager serviceaccount controller)",
                       "kube-controller-manager")
        self._check_alive(kwok)
        (w / "cluster.json").write_text(json.dumps(self.describe(), indent=2))
        self._log(f"[cluster] up: {self.server}, kubeconfig {self.kubeconfig}")

    def describe(self) -> dict:
        return {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "workdir": str(self.workdir),
            "pids": {c.name: c.process.pid for c in self._components if c.process},
            "versions": COMPONENT_VERSIONS,
        }

    def stop(self) -> None:
        self._stop_processes()
        if not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _stop_processes(self) -> None:
        # One by one in reverse order: clients before the apiserver, the apiserver before etcd. Stopping them all
        # at once leaves the apiserver draining requests against a dead etcd (seconds lost per cluster).
        for component in reversed(self._components):
            if not stop_child(component.process):
                print(f"localcluster: {component.name} (pid {component.process.pid}) not reaped 70 s after SIGTERM",
                      file=sys.stderr)
        self._components = []
        self._api_client = None

    # -- helpers for start -----------------------------------------------------------------------------------
    def _write_credentials(self) -> None:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        (self.workdir / "sa.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (self.workdir / "sa.pub").write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        # token,user,uid,"groups". kwok plays every kubelet, so it gets cluster-admin rather than Node identities.
        rows = [
            f'{self.admin_token},admin,uid-admin,"system:masters"',
            f"{self._tokens['kube-controller-manager']},system:kube-controller-manager,uid-kcm",
            f"{self._tokens['kube-scheduler']},system:kube-scheduler,uid-scheduler",
            f'{self._tokens["kwok"]},kwok,uid-kwok,"system:masters"',
        ]
        tokens = self.workdir / "tokens.csv"
        tokens.write_text("\n".join(rows) + "\n")
        tokens.chmod(0o600)

    def _write_kubeconfigs(self) -> None:
        users = {"kube-controller-manager": "system:kube-controller-manager",
                 "kube-scheduler": "system:kube-scheduler", "kwok": "kwok"}
        for component, user in users.items():
            _write_kubeconfig(self.workdir / f"{component}.kubeconfig", self.server, self.ca_file, user,
                              self._tokens[component])

    def _launch(self, component: _Component) -> None:
        component.log_path = self.logs_dir / f"{component.name}.log"
        log_file = open(component.log_path, "ab")
        try:
            component.process = subprocess.Popen(
                component.argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.workdir, preexec_fn=_die_with_parent, env={**os.environ, **component.env})
        finally:
            log_file.close()
        self._components.append(component)
        self._log(f"[cluster] started {component.name} (pid {component.process.pid})")

    def log_tail(self, name: str, limit: int = COMPONENT_LOG_TAIL_CHARS) -> str:
        path = self.logs_dir / f"{name}.log"
        try:
            return _tail(path.read_text(errors="replace"), limit)
        except FileNotFoundError:
            return "(no log)"

    def _check_alive(self, component: _Component) -> None:
        code = component.process.poll() if component.process else None
        if code is not None:
            raise ClusterError(f"{component.name} exited with code {code}; log {component.log_path}:\n"
                               + self.log_tail(component.name))

    def _wait_healthy(self, component: _Component, deadline: float) -> None:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # readiness probe only; real clients verify against ca_file
        headers = {"Authorization": f"Bearer {self.admin_token}"} if component.name == "kube-apiserver" else {}
        last = ""
        while True:
            self._check_alive(component)
            try:
                req = urllib.request.Request(component.health_url, headers=headers)
                with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
                    if resp.status == 200:
                        return
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}: {exc.read()[-500:].decode(errors='replace')}"
            except OSError as exc:
                last = str(exc)
            if time.monotonic() > deadline:
                raise ClusterError(f"{component.name} not healthy at {component.health_url} before the deadline "
                                   f"(last: {last}); log {component.log_path}:\n" + self.log_tail(component.name))
            time.sleep(0.25)

    def _wait_for(self, predicate: Callable[[], bool], deadline: float, what: str, log_of: str) -> None:
        while not predicate():
            for component in self._components:
                self._check_alive(component)
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out waiting for {what}; {log_of} log:\n" + self.log_tail(log_of))
            time.sleep(0.25)

    def _admin_get(self, path: str) -> dict | None:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        req = urllib.request.Request(self.server + path, headers={"Authorization": f"Bearer {self.admin_token}"})
        try:
            with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    # -- API for tests ---------------------------------------------------------------------------------------
    def restart(self, component: str, *, down_seconds: float = 0.0, timeout: float = 60.0) -> None:
        """SIGKILL one component (a crash, not a clean stop), keep it down `down_seconds`, start it again with the
        same arguments (ports, etcd data, certificates) and wait until it is healthy again.

        `component` is one of etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok.
        """
        index = next((i for i, c in enumerate(self._components) if c.name == component), None)
        if index is None:
            raise ValueError(f"no running component {component!r}; running: {[c.name for c in self._components]}")
        target = self._components.pop(index)
        if target.process is not None and target.process.poll() is None:
            target.process.kill()
            target.process.wait(timeout=10)
        time.sleep(down_seconds)
        self._launch(target)
        # Back to its place: stop() goes in reverse start order (clients before the apiserver before etcd).
        self._components.remove(target)
        self._components.insert(index, target)
        if target.health_url is not None:
            self._wait_healthy(target, time.monotonic() + timeout)
        else:
            time.sleep(0.5)
            self._check_alive(target)

    def api_client(self):
        """A kubernetes.client.ApiClient authenticated as the admin (system:masters)."""
        if self._api_client is None:
            from kubernetes import config
            self._api_client = config.new_client_from_config(config_file=str(self.kubeconfig))
        return self._api_client

    def env(self, kubeconfig: str | os.PathLike | None = None) -> dict[str, str]:
        """os.environ plus KUBECONFIG (admin, or the given one, e.g. a ServiceAccount's) for a subprocess."""
        return {**os.environ, "KUBECONFIG": str(kubeconfig or self.kubeconfig)}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60,
                kubeconfig: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
        cmd = [str(kubectl_path()), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"`kubectl {' '.join(args)}` failed with exit code {proc.returncode}:\n"
                               + _tail(proc.stdout + proc.stderr))
        return proc

    def add_node(self, name: str, ip: str = "127.0.0.1", labels: dict[str, str] | None = None, *,
                 capacity: dict[str, str] | None = None, wait: bool = True, timeout: float = 30.0) -> dict:
        """Creates a kwok-managed fake Node with InternalIP `ip`; by default waits until kwok marks it Ready.

        `capacity` adds to (or overrides) DEFAULT_NODE_CAPACITY, e.g. {"nvidia.com/gpu": "8"}.
        """
        from kubernetes import client

        resources = {**DEFAULT_NODE_CAPACITY, **(capacity or {})}
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {**(labels or {}), FAKE_NODE_LABEL[0]: FAKE_NODE_LABEL[1],
                                                   "kubernetes.io/hostname": name}},
            # Node status is kept on create, so kwok's templates find the address and capacity already there.
            "status": {"addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name}],
                       "capacity": resources, "allocatable": resources},
        }
        core = client.CoreV1Api(self.api_client())
        core.create_node(node)
        if wait:
            return self.wait_node_ready(name, timeout=timeout)
        return core.read_node(name).to_dict()

    def wait_node_ready(self, name: str, timeout: float = 30.0) -> dict:
        from kubernetes import client

        core = client.CoreV1Api(self.api_client())
        deadline = time.monotonic() + timeout
        while True:
            node = core.read_node(name)
            conditions = {c.type: c.status for c in (node.status.conditions or [])}
            if conditions.get("Ready") == "True":
                return node.to_dict()
            if time.monotonic() > deadline:
                raise ClusterError(f"node {name} not Ready after {timeout}s (conditions {conditions}); kwok log:\n"
                                   + self.log_tail("kwok"))
            for component in self._components:
                self._check_alive(component)
            time.sleep(0.2)

    def wait_crd_established(self, name: str, timeout: float = 60.0) -> dict:
        """Polls until the CRD `name` is Established. (`kubectl wait` fails at once while a freshly applied CRD
        has no status.conditions yet, which a large schema makes likely.)"""
        from kubernetes import client

        api = client.ApiextensionsV1Api(self.api_client())
        deadline = time.monotonic() + timeout
        while True:
            crd = api.read_custom_resource_definition(name)
            conditions = {c.type: c.status for c in ((crd.status and crd.status.conditions) or [])}
            if conditions.get("Established") == "True":
                return crd.to_dict()
            if time.monotonic() > deadline:
                raise ClusterError(f"CRD {name} not Established after {timeout}s (conditions {conditions})")
            time.sleep(0.2)

    def create_namespace(self, name: str, timeout: float = 30.0) -> None:
        """Creates a namespace and waits for its default ServiceAccount (pods are refused until it exists)."""
        from kubernetes import client

        core = client.CoreV1Api(self.api_client())
        core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        deadline = time.monotonic() + timeout
        self._wait_for(lambda: self._admin_get(f"/api/v1/namespaces/{name}/serviceaccounts/default") is not None,
                       deadline, f"ServiceAccount {name}/default", "kube-controller-manager")

    def service_account_token(self, namespace: str, name: str, expiration_seconds: int = 3600) -> str:
        """A bound token for the ServiceAccount, from the TokenRequest API (the SA must exist)."""
        from kubernetes import client

        core = client.CoreV1Api(self.api_client())
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                   "spec": {"expirationSeconds": expiration_seconds}}
        return core.create_namespaced_service_account_token(name, namespace, request).status.token

    def service_account_kubeconfig(self, namespace: str, name: str, *, expiration_seconds: int = 3600,
                                   create: bool = False) -> pathlib.Path:
        """Writes a kubeconfig that authenticates as ServiceAccount namespace/name and returns its path.

        The SA must exist (the chart creates it) unless create=True. Nothing is granted: RBAC decides.
        """
        if create:
            from kubernetes import client
            from kubernetes.client.rest import ApiException

            core = client.CoreV1Api(self.api_client())
            try:
                core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
            except ApiException as exc:
                if exc.status != 409:
                    raise
        token = self.service_account_token(namespace, name, expiration_seconds)
        path = self.workdir / "kubeconfigs" / f"sa-{namespace}-{name}.kubeconfig"
        path.parent.mkdir(exist_ok=True)
        _write_kubeconfig(path, self.server, self.ca_file, f"system:serviceaccount:{namespace}:{name}", token)
        return path


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------

def _cmd_up(args: argparse.Namespace) -> int:
    if args.aggregation_layer and not args.real_nodes:
        print("--aggregation-layer needs --real-nodes N (the kwok cluster has no aggregation layer option)",
              file=sys.stderr)
        return 2
    workdir = pathlib.Path(args.dir).resolve()
    pid_file = workdir / "localcluster.pid"
    if pid_file.exists() and pid_alive(int(pid_file.read_text())):
        print(f"a cluster is already running from {workdir} (pid {pid_file.read_text().strip()})", file=sys.stderr)
        return 1
    workdir.mkdir(parents=True, exist_ok=True)
    if args.background:
        if args.real_nodes:
            from devcluster.build import build_node
            build_node()
        else:
            build()  # build in the foreground so errors show here, not in a log
        log_path = workdir / "localcluster.log"
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen([sys.executable, __file__, "up", "--dir", str(workdir),
                                     "--timeout", str(args.timeout), "--real-nodes", str(args.real_nodes),
                                     *(["--aggregation-layer"] if args.aggregation_layer else [])],
                                    stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        ready = workdir / "cluster.json"
        deadline = time.monotonic() + args.timeout + 30
        while not (ready.exists() and pid_file.exists()):
            if proc.poll() is not None or time.monotonic() > deadline:
                print(f"cluster failed to start; log {log_path}:\n{_tail(log_path.read_text(errors='replace'))}",
                      file=sys.stderr)
                if proc.poll() is None:
                    proc.terminate()
                return 1
            time.sleep(0.25)
        print(f"cluster running in the background (pid {proc.pid}); kubeconfig {workdir / 'kubeconfig'}")
        print(f"stop it with: python {__file__} down --dir {workdir}")
        return 0

    stop_requested = False

    def request_stop(signum, frame):
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    for stale in ("cluster.json", "kubeconfig"):
        (workdir / stale).unlink(missing_ok=True)
    shutil.rmtree(workdir / "etcd-data", ignore_errors=True)
    if args.real_nodes:
        from devcluster.realnode import RealNodeCluster
        cluster = RealNodeCluster(workdir, nodes=args.real_nodes, start_timeout=args.timeout, keep_workdir=True,
                                  log=print, aggregation_layer=args.aggregation_layer)
    else:
        cluster = LocalCluster(workdir, start_timeout=args.timeout, keep_workdir=True, log=print)
    try:
        cluster.start()
        pid_file.write_text(str(os.getpid()))
        print(f"cluster up; export KUBECONFIG={cluster.kubeconfig}  (Ctrl-C or SIGTERM stops it)", flush=True)
        while not stop_requested:
            time.sleep(0.5)
    finally:
        cluster.stop()
        pid_file.unlink(missing_ok=True)
        (workdir / "cluster.json").unlink(missing_ok=True)
        left = cluster.leftovers() if hasattr(cluster, "leftovers") else []
        print(f"cluster stopped{'; LEFT BEHIND: ' + ', '.join(left) if left else ''}", flush=True)
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    workdir = pathlib.Path(args.dir).resolve()
    pid_file = workdir / "localcluster.pid"
    if not pid_file.exists():
        print(f"no running cluster recorded in {workdir}", file=sys.stderr)
        return 1
    pid = int(pid_file.read_text())
    if pid_alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while pid_alive(pid):
            if time.monotonic() > deadline:
                print(f"pid {pid} did not stop within 60s", file=sys.stderr)
                return 1
            time.sleep(0.2)
    pid_file.unlink(missing_ok=True)
    print(f"cluster in {workdir} stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Local Kubernetes control plane for pdpair tests.")
    sub = parser.add_subparsers(dest="command", required=True)
    build_cmd = sub.add_parser(
        "build", help="build and cache etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok")
    build_cmd.add_argument("--real-node", action="store_true",
                           help="also kubelet, kube-proxy, containerd and the pause image (devcluster/build.py)")
    up = sub.add_parser("up", help="start a cluster; writes DIR/kubeconfig")
    up.add_argument("--real-nodes", type=int, default=0, metavar="N",
                    help="N real nodes (containerd+kubelet+kube-proxy) in network namespaces instead of kwok")
    up.add_argument("--aggregation-layer", action="store_true",
                    help="real nodes only: front-proxy certs and aggregator routing for APIServices "
                         "(devcluster/prometheus_adapter.py)")
    up.add_argument("--dir", required=True)
    up.add_argument("--background", action="store_true", help="detach; pid in DIR/localcluster.pid")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for readiness")
    down = sub.add_parser("down", help="stop the cluster started with `up --dir DIR`")
    down.add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            if args.real_node:
                from devcluster.build import build_node
                build_node()
            else:
                build()
            return 0
        if args.command == "up":
            return _cmd_up(args)
        return _cmd_down(args)
    except (BuildError, ClusterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

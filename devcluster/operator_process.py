"""Run the operator for real on a local control plane: install the chart's CRD and RBAC, start
`python -m pdpair.operator` as a subprocess under the chart's ServiceAccount. Used by the e2e tests and the demo.

`cluster` is a devcluster.localcluster.LocalCluster (duck-typed: kubectl(), wait_crd_established(),
service_account_kubeconfig(), create_namespace()); `helm` is the path of a helm binary.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import yaml

from pdpair.operator.model import config
from devcluster.ports import free_port
from devcluster.processes import stop_child

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CHART_DIR = REPO_ROOT / "charts" / "pdpair"
CRD_DIR = pathlib.Path(os.environ.get("PDPAIR_CRD_DIR") or CHART_DIR / "crds")  # override: try an edited CRD
# What the operator runs as, from the chart: its identity and rights, and its API Priority and Fairness level (so
# the operator meets the apiserver's throttling as it does when installed with the chart).
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
              "PriorityLevelConfiguration", "FlowSchema")


def install_crd(cluster: Any) -> None:
    for path in sorted(CRD_DIR.glob("*.yaml")):
        cluster.kubectl("apply", "--server-side", "-f", str(path))
        name = yaml.safe_load(path.read_text())["metadata"]["name"]
        cluster.wait_crd_established(name)


def render_rbac(helm: str | os.PathLike, namespace: str, release: str = "pdpair",
                values: tuple[str, ...] = ()) -> tuple[str, str]:
    """The chart's RBAC and API priority objects (RBAC_KINDS) for `namespace` as YAML, and the operator
    ServiceAccount's name. `values`: more `helm template` arguments (e.g. `--set operator.watchNamespaces={a}`)."""
    env = {
        **os.environ,
        "HELM_CACHE_HOME": "/tmp/pdpair-helm/cache",
        "HELM_CONFIG_HOME": "/tmp/pdpair-helm/config",
        "HELM_DATA_HOME": "/tmp/pdpair-helm/data",
    }
    proc = subprocess.run(
        [str(helm), "template", release, str(CHART_DIR), "--namespace", namespace, *values],
        capture_output=True, text=True, env=env, timeout=120,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"helm template {CHART_DIR} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d and d.get("kind") in RBAC_KINDS]
    accounts = [d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"]
    if len(accounts) != 1:
        raise RuntimeError(f"expected one ServiceAccount in the rendered chart, found {accounts}")
    return yaml.safe_dump_all(docs), accounts[0]


def install_operator_rbac(cluster: Any, helm: str | os.PathLike, namespace: str, release: str = "pdpair",
                          values: tuple[str, ...] = ()) -> pathlib.Path:
    """Creates the namespace, applies the chart's RBAC, returns a kubeconfig of the operator ServiceAccount."""
    if cluster.kubectl("get", "namespace", namespace, check=False).returncode != 0:
        cluster.create_namespace(namespace)
    manifest, account = render_rbac(helm, namespace, release, values)
    cluster.kubectl("apply", "--server-side", "-f", "-", input=manifest)
    return cluster.service_account_kubeconfig(namespace, account)


class OperatorProcess:
    """`python -m pdpair.operator` in a subprocess; its log goes to `log_path`."""

    def __init__(
        self,
        kubeconfig: str | os.PathLike,
        namespace: str,
        port_pool: str,
        log_path: str | os.PathLike,
        extra_env: dict[str, str] | None = None,
        module: str = "pdpair.operator",
    ) -> None:
        self.module = module  # another entry point that runs the operator (e.g. with a crash point patched in)
        self.liveness_port = free_port()
        self.metrics_port = free_port()
        self.log_path = pathlib.Path(log_path)
        self.env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            config.ENV_OPERATOR_NAMESPACE: namespace,
            config.ENV_PORT_POOL: port_pool,
            config.ENV_LIVENESS_PORT: str(self.liveness_port),
            config.ENV_METRICS_PORT: str(self.metrics_port),
            config.ENV_PROBE_INTERVAL: "0.5",
            config.ENV_RESYNC_INTERVAL: "10",
            config.ENV_POOL_RETRY: "2",
            config.ENV_SWEEP_INTERVAL: "10",
            # One key per OperatorProcess, kept across its restarts (a SIGKILLed operator started again keeps
            # pushing the pods it made), as the chart's Secret does
            config.ENV_PEERS_KEY: secrets.token_urlsafe(32),
            **(extra_env or {}),
        }
        self.env.pop("KUBERNETES_SERVICE_HOST", None)  # never mistake this for in-cluster
        self.proc: subprocess.Popen | None = None

    def start(self, ready_timeout: float = 60.0) -> "OperatorProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module], env=self.env, stdout=log, stderr=subprocess.STDOUT,
            cwd=str(REPO_ROOT),
        )
        log.close()
        deadline = time.monotonic() + ready_timeout
        url = f"http://127.0.0.1:{self.liveness_port}/healthz"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the operator exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the operator's liveness endpoint did not answer within {ready_timeout}s:\n{self.log_tail()}")

    def log_tail(self, limit: int = 6000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return text[-limit:]

    def kill(self) -> None:
        """SIGKILL: no cleanup handlers run (the crash the leases must survive)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> None:
        if not self.proc or self.proc.poll() is not None:
            return
        stop_child(self.proc, grace_seconds=timeout)

    def __enter__(self) -> "OperatorProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

"""The product on a RealNodeCluster, as a user meets it: the tiny model on the nodes, `helm install` of the chart
with the operator image, an InferencePair whose pods run the engine image, completions from inside the cluster
network. Shared by tests/e2e_realnode/ and hack/demo_realnode.py.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid

from pdpair.contract import ANNOTATION_FENCED_POD, API_VERSION, GROUP, KIND, LEASE_NAME_PREFIX, PLURAL, VERSION
from devcluster.build import REPO_ROOT, helm_path

CHART = REPO_ROOT / "charts" / "pdpair"
OPERATOR_NS = "pdpair-system"
RELEASE = "pdpair"
MODEL_MOUNT = "/models/tiny"
SERVED_NAME = "tiny"
# tests/engine's flags (engines.py ENGINE_ARGS) minus the served name, which the pair sets itself.
ENGINE_ARGS = ["--dtype", "float32", "--enforce-eager", "--block-size", "32", "--max-model-len", "512",
               "--kv-cache-memory-bytes", str(64 * 2**20)]
ENGINE_ENV = [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"}, {"name": "HF_HUB_OFFLINE", "value": "1"},
              {"name": "VLLM_NO_USAGE_STATS", "value": "1"}, {"name": "TOKENIZERS_PARALLELISM", "value": "false"}]

# Runs inside a node's namespaces with the harness's interpreter: a greedy completion, its text printed as JSON.
# A refused connection is retried until `refused_for` seconds have passed: kube-proxy programs a Service's rules
# asynchronously after its endpoints turn ready (until then a ClusterIP answers with a reject), so "the pod is Ready"
# does not mean "the Service routes to it" yet. Any other error fails at once.
_COMPLETION_SNIPPET = """
import json, sys, time, urllib.error, urllib.request
url, model, prompt, max_tokens, refused_for = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
extra = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
deadline = time.monotonic() + refused_for
while True:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **extra})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            print(json.dumps(json.load(resp)["choices"][0]["text"]))
        break
    except urllib.error.URLError as exc:
        if not isinstance(exc.reason, ConnectionRefusedError) or time.monotonic() > deadline:
            raise
        time.sleep(0.5)
"""

# GET `url` from inside a node or pod; prints the HTTP status. Retries refused connections like the snippet above.
FETCH_STATUS_SNIPPET = """
import errno, sys, time, urllib.error, urllib.request
url, refused_for = sys.argv[1], float(sys.argv[2])
deadline = time.monotonic() + refused_for
while True:
    try:
        print(urllib.request.urlopen(url, timeout=10).status)
        break
    except urllib.error.URLError as exc:
        not_yet = isinstance(exc.reason, ConnectionRefusedError) or getattr(exc.reason, "errno", None) == errno.EHOSTUNREACH
        if not not_yet or time.monotonic() > deadline:
            raise
        time.sleep(0.5)
"""
# Measured: kube-proxy's first sync after an endpoint change took up to a few seconds on a busy 2-core machine;
# one CI run saw a refusal right after `kubectl wait --for=condition=Ready`, another "No route to host" (EHOSTUNREACH:
# the path to a pod on the other node not answering yet, seconds after both pods were Ready); both are retried
# until the deadline, anything else fails at once.
SERVICE_PROGRAMMING_SECONDS = 60.0


PROMPTS = ["The quick brown fox", "Kubernetes runs pods;", "Prefill computes the prompt,", "Hello world! 0123"]
ENGINE_START_TIMEOUT = 600.0


# Reads that wait loops repeat (every 0.5-1 s, for minutes while engines start) go through the cluster's one
# kubernetes ApiClient: a kept-alive connection, where each `kubectl get` is a process, a TLS handshake with the
# apiserver and a LoopbackForwarder thread, all taken from the engines the tests wait for (client CPU of one read of
# a 3-pod list on the 2-core box, 2026-12-07, against a local TLS stand-in: `kubectl get -o json` 53 ms, the pooled
# client 1.6 ms). Same objects as `kubectl get -o json` (a list's items carry no apiVersion/kind; nothing reads
# them). Everything else (apply, exec, logs, delete, events) stays kubectl.
API_READ_TIMEOUT = 60  # seconds, as cluster.kubectl's default


def read_pair(cluster, namespace: str, name: str) -> dict | None:
    """The InferencePair as JSON, or None when it cannot be read (gone): `kubectl get ... check=False`'s meaning."""
    from kubernetes import client

    try:
        resp = client.CustomObjectsApi(cluster.api_client()).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, _preload_content=False, _request_timeout=API_READ_TIMEOUT)
    except Exception:  # ApiException (404 ...) or a transport error: what a failed kubectl get returned as None
        return None
    return json.loads(resp.data)


def list_pods(cluster, namespace: str, selector: str = "") -> list[dict]:
    """The pods in `namespace` matching the label selector, as JSON (raises on a failed read, as kubectl did)."""
    from kubernetes import client

    resp = client.CoreV1Api(cluster.api_client()).list_namespaced_pod(
        namespace, label_selector=selector, _preload_content=False, _request_timeout=API_READ_TIMEOUT)
    return json.loads(resp.data)["items"]


def describe(cluster, ns: str) -> str:
    pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
    events = cluster.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False).stdout[-3000:]
    return f"pods:\n{pods}\nevents:\n{events}"


def pod_logs(cluster, ns: str, name: str) -> str:
    return cluster.kubectl("logs", "-n", ns, name, "--tail=60", check=False).stdout


# Runs in an engine container: every process but this one (PID 1 is vLLM's API server; its engine core is a child
# of it, and at TP > 1 the engine core's children are the TP workers), with its parent and vLLM's process title.
_PROCESSES_SNIPPET = r"""
import json, os
me = os.getpid()
out = []
for d in os.listdir("/proc"):
    if not d.isdigit() or int(d) == me:
        continue
    try:
        stat = open(f"/proc/{d}/stat").read()
        cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        continue
    comm = stat[stat.index("(") + 1:stat.rindex(")")]
    ppid = int(stat[stat.rindex(")") + 2:].split()[1])
    out.append({"pid": int(d), "ppid": ppid, "comm": comm, "cmdline": cmd[:300]})
print(json.dumps(out))
"""


def container_processes(cluster, ns: str, pod: str, container: str = "engine") -> list[dict]:
    """[{pid, ppid, comm, cmdline}] of the container's processes (pids as the container sees them)."""
    proc = cluster.kubectl("exec", "-n", ns, pod, "-c", container, "--", "python", "-c", _PROCESSES_SNIPPET)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def engine_core_pid(processes: list[dict]) -> int:
    """The vLLM engine core: a child of the API server (PID 1), titled VLLM::EngineCore by vLLM (its model runs in a
    VLLM::Worker child of it). PID 1 itself cannot be SIGKILLed from inside its PID namespace."""
    cores = [p for p in processes if p["ppid"] == 1 and "EngineCore" in (p["comm"] + p["cmdline"])]
    assert len(cores) == 1, f"expected one engine core process under PID 1, found: {json.dumps(processes, indent=1)}"
    return cores[0]["pid"]


def build_model(target: pathlib.Path) -> pathlib.Path:
    """tests/engine's tiny Llama (seeded, identical every build) in `target`, readable by the engine's uid 10001."""
    sys.path.insert(0, str(REPO_ROOT / "tests" / "engine"))
    from tiny_model import build_tiny_model

    path = build_tiny_model(target)
    # hostPath mounts the folder itself, so only it and its files need to be world-readable.
    for entry in [path, *path.rglob("*")]:
        extra = stat.S_IROTH | stat.S_IRGRP | (stat.S_IXOTH | stat.S_IXGRP if entry.is_dir() else 0)
        entry.chmod(entry.stat().st_mode | extra)
    return path


def model_volume(model_dir: pathlib.Path) -> dict:
    return {"name": "models", "hostPath": {"path": str(model_dir), "type": "Directory"}}


# vLLM's engine core needs about 160 MiB of /dev/shm (its shared-memory broadcast ring); a container's default
# /dev/shm is 64 MiB, so the engine fails with "Insufficient space in /dev/shm". The usual fix: a memory emptyDir.
SHM_VOLUME = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}
SHM_MOUNT = {"name": "dshm", "mountPath": "/dev/shm"}
MODEL_MOUNT_SPEC = {"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True}


def completion(cluster, node: str, host: str, port: int, prompt: str, max_tokens: int = 16,
               refused_for: float = SERVICE_PROGRAMMING_SECONDS, headers: dict[str, str] | None = None) -> str:
    """A greedy completion sent from inside node `node`'s network namespace (the cluster network); `headers` are
    added to the request (e.g. the router's X-Pdpair-Route and X-Request-Id). An HTTP error raises ClusterError."""
    proc = cluster.node_exec(node, [sys.executable, "-c", _COMPLETION_SNIPPET, f"http://{host}:{port}/v1/completions",
                                    SERVED_NAME, prompt, str(max_tokens), str(refused_for),
                                    json.dumps(headers or {})],
                             timeout=180 + refused_for)
    return json.loads(proc.stdout.strip().splitlines()[-1])


class Helm:
    """helm with private HELM_*_HOME folders and the cluster's admin kubeconfig."""

    def __init__(self, cluster):
        self.home = pathlib.Path(tempfile.mkdtemp(prefix="pdpair-helm-"))
        self.env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig),
                    **{f"HELM_{k}_HOME": str(self.home / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}

    def __call__(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(helm_path()), *args], capture_output=True, text=True, env=self.env, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
        return proc

    def close(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)


def install_operator(cluster, operator_ref: str, *extra_set: str) -> Helm:
    """`helm install` of charts/pdpair with the operator image built here (pullPolicy Never); waits for rollout."""
    helm = Helm(cluster)
    repo, tag = operator_ref.rsplit(":", 1)
    sets = [f"image.repository={repo}", f"image.tag={tag}", "image.pullPolicy=Never", *extra_set]
    helm("install", RELEASE, str(CHART), "--namespace", OPERATOR_NS, "--create-namespace",
         *[a for s in sets for a in ("--set", s)], "--wait", "--timeout", "180s")
    return helm


OPERATOR_SELECTOR = "app.kubernetes.io/name=pdpair,app.kubernetes.io/component=operator"
LEADER_LEASE = f"{RELEASE}-operator-leader"  # the chart's leader-election Lease (operator.leaderElection)


def operator_pods(cluster) -> list[dict]:
    return list_pods(cluster, OPERATOR_NS, OPERATOR_SELECTOR)


def leader_pod_name(cluster) -> str | None:
    """The operator pod holding the leader Lease (its holderIdentity is `<pod name>_<per-process suffix>`)."""
    from kubernetes import client

    try:
        resp = client.CoordinationV1Api(cluster.api_client()).read_namespaced_lease(
            LEADER_LEASE, OPERATOR_NS, _preload_content=False, _request_timeout=API_READ_TIMEOUT)
    except Exception:  # no Lease yet (404), or a failed read: what a failed kubectl get returned
        return None
    holder = (json.loads(resp.data).get("spec") or {}).get("holderIdentity") or ""
    return holder.rsplit("_", 1)[0] or None


def operator_logs(cluster, tail: int = 60) -> str:
    """The logs of every operator replica, each line prefixed with its pod (the standby's are short)."""
    return cluster.kubectl("logs", "-n", OPERATOR_NS, "-l", OPERATOR_SELECTOR, "--prefix", f"--tail={tail}",
                           check=False).stdout


def pair_manifest(name: str, namespace: str, engine_ref: str, model_dir: pathlib.Path, *, prefill_node: str = "n1",
                  decode_node: str = "n2", transport: str = "tcp", prefill_env: list[dict] | None = None,
                  decode_env: list[dict] | None = None, tensor_parallel_size: int = 1,
                  router_replicas: int | None = 1) -> dict:
    """An InferencePair on the tcp transport: prefill pinned to one node, decode (and the router) to another, the
    model from a hostPath volume through the per-role pod templates. `tensor_parallel_size` > 1 sets both roles'
    spec.<role>.tensorParallelSize (the CRD requires them equal); at 1 the field is left to the CRD's default.
    `prefill_env` / `decode_env`: extra engine env on every pod of that role (e.g. a TEST_ONLY_PDPAIR_* knob's path;
    the knob file itself is then created in one pod only). `router_replicas`: spec.router.replicas, 1 unless a test
    is about replicas (the real-node tests count and address one router; pinned to decode's node, two would share
    it); None leaves the CRD's default (2), as a user's pair would (the demo)."""
    def role(node: str, env: list[dict]) -> dict:
        tp = {} if tensor_parallel_size == 1 else {"tensorParallelSize": tensor_parallel_size}
        return {
            **tp,
            "args": ENGINE_ARGS,
            "template": {"spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "volumes": [model_volume(model_dir), SHM_VOLUME],
                "containers": [{"name": "engine", "imagePullPolicy": "Never", "env": ENGINE_ENV + env,
                                "volumeMounts": [MODEL_MOUNT_SPEC, SHM_MOUNT]}],
            }},
        }

    return {
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": MODEL_MOUNT, "servedModelName": SERVED_NAME, "image": engine_ref,
            "startupTimeoutSeconds": 600,
            "connector": {"transport": transport, "hangTimeoutSeconds": 30},
            "network": {"hostNetwork": True},
            "prefill": role(prefill_node, prefill_env or []),
            "decode": role(decode_node, decode_env or []),
            "router": {**({"replicas": router_replicas} if router_replicas is not None else {}),
                       "template": {"spec": {
                           "nodeSelector": {"kubernetes.io/hostname": decode_node},
                           "containers": [{"name": "router", "imagePullPolicy": "Never"}]}}},
        },
    }


def baseline_pod(name: str, namespace: str, engine_ref: str, model_dir: pathlib.Path, node: str) -> dict:
    """One engine without a connector, as a plain Pod on the pod network (port 8000): the reference output."""
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeName": node, "restartPolicy": "Never",
            "volumes": [model_volume(model_dir), SHM_VOLUME],
            "containers": [{
                "name": "engine", "image": engine_ref, "imagePullPolicy": "Never",
                "command": ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL_MOUNT,
                            "--served-model-name", SERVED_NAME, "--host", "0.0.0.0", "--port", "8000",
                            *ENGINE_ARGS],
                "env": ENGINE_ENV,
                "volumeMounts": [MODEL_MOUNT_SPEC, SHM_MOUNT],
                # Every 1 s, as the operator's engine probes (pod_defaults.STARTUP_PERIOD_SECONDS, READINESS_PROBE): the
                # cold-start comparisons (bench_cold_start, the demo) give both sides the same probe cadence. vLLM's
                # /health cannot be held as pdpair's probes are (pod_defaults.PROBE_WAIT_SECONDS): that is what a
                # plain vLLM pod gets, so the comparison keeps it.
                "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1},
            }],
        },
    }


def fenced_ports(leases: list[dict], pod_prefix: str = "") -> dict[int, str]:
    """Port -> fenced pod (`<ns>/<name>/<uid>`) of each fence Lease (JSON form) whose pod reference starts with
    `pod_prefix`: the tests' one reading of the operator's fences (quarantine-labelled Leases naming a pod)."""
    return {int(lease["metadata"]["name"].removeprefix(LEASE_NAME_PREFIX)): ref for lease in leases
            if (ref := (lease["metadata"].get("annotations") or {}).get(ANNOTATION_FENCED_POD, ""))
            and ref.startswith(pod_prefix)}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"

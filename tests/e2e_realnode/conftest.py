"""Fixtures shared by the real-node e2e modules. Expensive things (images, the tiny model, the single-engine
reference outputs, the operator's helm release, the shared serving pair) are built once for this package, with the
real-node cluster, and go with it after the package's last test; every module gets its own namespace.

The modules run in MODULE_ORDER, not alphabetically: the scenarios that share the serving pair
(serving_pair.py) come in the order where each leaves the pair as the next one needs it, and the modules with pairs
of their own come after the shared pair is deleted, so at most one pair's engines run at a time."""
import concurrent.futures
import json
import pathlib
import threading
import time
import uuid

import pytest

from devcluster.fixtures import real_cluster  # noqa: F401  (pytest finds fixtures by name)
from devcluster.images import engine_image, operator_image
from tests.e2e_realnode.serving_pair import ServingPair
from devcluster.product import (
    ENGINE_START_TIMEOUT, OPERATOR_NS, PROMPTS, baseline_pod, build_model, completion, describe, install_operator,
    pod_logs, unique,
)


MODULE_ORDER = (
    "test_realnode_cluster",      # the cluster itself; no engine
    "test_realnode_custom_metrics",  # Prometheus -> prometheus-adapter -> the custom metrics API; no engine
    "test_realnode_faults",       # creates the serving pair (e), helm upgrade (f), listener stopped (c)
    "test_realnode_pair",         # the serving pair's outputs, KV across nodes, health
    "test_realnode_signal_drop",  # the serving pair's signal drop -> ordered restart
    "test_realnode_rollout",      # Surge, Recreate, then the serving pair is deleted
    "test_realnode_demo",         # the README demo's pair beside a single engine, on this cluster (3 cold starts)
    "test_realnode_xpyd",         # a 2P2D pair of its own: every (P, D) route, scale under load, a decode deleted
    "test_realnode_tp2",          # a TP = 2 pair of its own
    "test_realnode_node_lost",    # a pair of its own: a stranger on its ports before the lease, then node n2 cut
                                  # off the cluster for a while, so last
)

# Modules that run only when named on the command line (pytest still collects a path given to it explicitly):
# scenarios kept out of hack/test.sh's `pytest tests/e2e_realnode`. Each module's docstring says what it costs.
collect_ignore: list[str] = []


def pytest_collection_modifyitems(config, items):
    """Runs this package's modules in MODULE_ORDER (a module missing from it runs last); other items keep their
    places. The hook sees the whole session's items, so it only permutes the slots this package's items hold."""
    here = pathlib.Path(__file__).parent
    slots = [i for i, item in enumerate(items) if pathlib.Path(str(item.path)).parent == here]
    rank = {name: i for i, name in enumerate(MODULE_ORDER)}
    ordered = sorted((items[i] for i in slots),
                     key=lambda item: rank.get(pathlib.Path(str(item.path)).stem, len(rank)))  # stable: file order
    for slot, item in zip(slots, ordered):
        items[slot] = item


@pytest.fixture
def cluster_ns(real_cluster):
    """A fresh namespace in the real-node cluster, deleted afterwards."""
    name = f"rn-{uuid.uuid4().hex[:8]}"
    real_cluster.create_namespace(name)
    yield name
    real_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


class PackageSetup:
    """What the package's engine modules need first, prepared in one background thread while the first modules (the
    cluster itself, the custom metrics API: no engine, no pair of theirs) run: the operator and engine images
    imported into both nodes, the baseline engine's pod created (it loads meanwhile), the operator's helm release
    installed, in that order. The fixtures below take their part from here, waiting for it with a deadline."""

    def __init__(self, cluster, model_dir: pathlib.Path):
        self.cluster, self.model_dir = cluster, model_dir
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="realnode-setup")
        self._lock = threading.Lock()
        self._jobs: dict[str, concurrent.futures.Future] = {}

    def _job(self, name: str, work):
        with self._lock:  # one job per name, in submit order (one worker)
            if name not in self._jobs:
                self._jobs[name] = self._pool.submit(work)
            return self._jobs[name]

    def _result(self, name: str, work, deadline: float):
        return self._job(name, work).result(timeout=deadline)

    def images(self) -> dict:
        return self._result("images", self._import_images, SETUP_DEADLINE)

    def baseline(self) -> tuple[str, float]:
        return self._result("baseline", self._create_baseline, SETUP_DEADLINE)

    def release(self):
        return self._result("release", self._install_operator, SETUP_DEADLINE)

    def start(self, *, baseline: bool, release: bool) -> None:
        self._job("images", self._import_images)
        if baseline:
            self._job("baseline", self._create_baseline)
        if release:
            self._job("release", self._install_operator)

    def _import_images(self) -> dict:
        built = {"operator": operator_image(), "engine": engine_image()}
        t0 = time.monotonic()
        for image in built.values():
            self.cluster.import_image(image.archive)
        print(f"[realnode-e2e] images imported into {len(self.cluster.nodes)} nodes in {time.monotonic() - t0:.1f}s")
        return built

    def _create_baseline(self) -> tuple[str, float]:
        """A single engine (no connector) as a plain Pod of the engine image, the model from a hostPath volume,
        created and not waited for: (its namespace, the time it was created)."""
        engine_ref = self.images()["engine"].ref
        namespace = unique("rn-baseline")
        self.cluster.create_namespace(namespace)
        pod = baseline_pod("baseline", namespace, engine_ref, self.model_dir, "n1")
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
        return namespace, time.monotonic()

    def _install_operator(self):
        """`helm install` of charts/pdpair with the image built here; the operator runs as a pod, in-cluster config.
        Sweeps every 10 s (chart default 60): the partition test waits for the sweep to free its fenced ports."""
        operator_ref = self.images()["operator"].ref
        t0 = time.monotonic()
        helm = install_operator(self.cluster, operator_ref, "operator.tuning.sweepIntervalSeconds=10")
        print(f"[realnode-e2e] helm install --wait took {time.monotonic() - t0:.1f}s")
        return helm

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        baseline = self._jobs.get("baseline")
        if baseline is not None and baseline.done() and baseline.exception() is None:
            self.cluster.kubectl("delete", "namespace", baseline.result()[0], "--wait=false", check=False)


# An import, a pod creation or a helm install --wait: minutes at most, even when the image builds it waits for are
# still running in the background (a cold run; their own deadlines apply there).
SETUP_DEADLINE = 3600.0


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("realnode-model") / "tiny")


@pytest.fixture(scope="module")
def namespace(real_cluster):
    name = unique("rn")
    real_cluster.create_namespace(name)
    yield name
    real_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="package")
def package_setup(real_cluster, model_dir):
    setup = PackageSetup(real_cluster, model_dir)
    yield setup
    setup.close()


@pytest.fixture(scope="package", autouse=True)
def _started_early(request):
    """Starts the package's setup before its first test when any collected test needs a part of it (a module run
    alone that needs none starts no cluster here)."""
    used = set().union(*(getattr(item, "fixturenames", ()) for item in request.session.items))
    if used & {"images", "baseline_outputs", "operator_release"}:
        request.getfixturevalue("package_setup").start(baseline="baseline_outputs" in used,
                                                       release="operator_release" in used)


@pytest.fixture(scope="package")
def images(package_setup):
    """Operator and engine images (cached by content), imported into both nodes' containerd."""
    return package_setup.images()


@pytest.fixture(scope="package")
def baseline_outputs(real_cluster, package_setup):
    """The single engine's greedy outputs for PROMPTS (and PROMPTS[0] again): the reference the pair's outputs must
    equal. The engine's namespace is deleted once they are read (not waited for: the pod's memory is back within its
    grace period, while the next engines load)."""
    namespace, t0 = package_setup.baseline()
    try:
        real_cluster.kubectl("wait", "-n", namespace, "--for=condition=Ready", "pod/baseline",
                             f"--timeout={int(ENGINE_START_TIMEOUT)}s", timeout=ENGINE_START_TIMEOUT + 30,
                             check=False)
        info = json.loads(real_cluster.kubectl("get", "pod", "-n", namespace, "baseline", "-o", "json").stdout)
        ready = {c["type"]: c["status"] for c in info["status"].get("conditions", [])}.get("Ready") == "True"
        assert ready, f"baseline engine pod not Ready:\n{describe(real_cluster, namespace)}\n" \
                      f"{pod_logs(real_cluster, namespace, 'baseline')}"
        print(f"[realnode-e2e] baseline engine pod Ready {time.monotonic() - t0:.1f}s after its creation")
        ip = info["status"]["podIP"]
        outputs = {p: completion(real_cluster, "n1", ip, 8000, p) for p in PROMPTS}
        outputs["__repeat__"] = completion(real_cluster, "n1", ip, 8000, PROMPTS[0])
        return outputs
    finally:
        real_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture(scope="package")
def operator_release(package_setup):
    """The operator's helm release (PackageSetup._install_operator). One release for the package: modules that
    change it (helm upgrade) must leave it serving."""
    helm = package_setup.release()
    yield helm
    helm("uninstall", "pdpair", "--namespace", OPERATOR_NS, "--wait", "--timeout", "120s")
    helm.close()


@pytest.fixture(scope="package")
def serving_pair(real_cluster, operator_release, images, model_dir):
    """The shared TP = 1 pair (serving_pair.py), in a namespace of its own; whatever is left of it is deleted after
    the package's last test (test_realnode_rollout deletes it on purpose and checks its leases go)."""
    namespace = unique("rn-serving")
    real_cluster.create_namespace(namespace)
    pair = ServingPair(real_cluster, namespace, images["engine"].ref, model_dir)
    yield pair
    print(f"[realnode-e2e] the serving pair was created by ready() {pair.created} time(s)")
    pair.delete()
    real_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)

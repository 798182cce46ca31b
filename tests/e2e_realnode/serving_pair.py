"""The real-node package's one shared TP = 1 pair, which the scenarios that need only "a serving pair" take turns on.

Every new pair generation is two vLLM cold starts one after the other (about 2.5 min on a quiet 2-core box, 5-8 min
loaded), so the scenarios whose meaning does not depend on a first start share one pair, in an order where each
fault leaves the pair in the state the next one needs (`conftest.MODULE_ORDER`, then file order):

    faults e   the leader deleted during the pair's first startup  -> creates it (generation 1, fresh on purpose)
    faults f   helm upgrade of the operator under load             -> same generation
    faults c   decode's listener stopped: ordered restart          -> generation + 1
    pair       outputs, KV across nodes, health of this generation -> same generation
    signal     prefill drops signals: alert, ordered restart        -> generation + 1
    rollout    Surge under load, then Recreate under load           -> + 1 each
    rollout    the pair deleted: its pods go, its leases are released

Each scenario starts with `ready()`, its precondition: the pair exists, is Ready with one Ready pod per role of its
current generation and no rollout in flight. A pair that a failed scenario left restarting or rolling gets time to
settle; one that never does (or is gone) is deleted and created again, so one failure does not cascade. Scenarios
assert relative to the generation and restart count they found, never to fixed numbers.

The pair is `pair_manifest` with prefill's signal-drop knob variable set (contract.ENV_TEST_DROP_SIGNALS_FILE) and
decode's stop-listener knob variable (contract.ENV_TEST_STOP_LISTENER_FILE): each does nothing until its scenario
creates the file inside the container, and the restart it causes recreates the pods with fresh filesystems.
"""
from __future__ import annotations

import json
import time

import yaml

from pdpair.contract import ENV_TEST_DROP_SIGNALS_FILE, ENV_TEST_STOP_LISTENER_FILE, GROUP, LABEL_PAIR, PLURAL
from devcluster.product import ENGINE_START_TIMEOUT, describe, list_pods, operator_logs, pair_manifest, read_pair
from devcluster.waiting import wait_for

NAME = "serving"
DROP_SIGNALS_KNOB = "/tmp/pdpair-drop-signals"  # the file that makes prefill drop every KV signal while it exists
STOP_LISTENER_KNOB = "/tmp/pdpair-stop-listener"  # the file that stops decode's side-channel loop once it exists
# Decode and prefill start together (prefill in the pass after decode), each within ENGINE_START_TIMEOUT; before the parallel
# start, one after the other, a busy 2-core machine took 12.5 min from apply to Ready (decode 8 min, prefill 4,
# router 0.5). The bound still allows two starts in a row: two engines loading at once on 2 cores slow each other.
READY_TIMEOUT = 2 * ENGINE_START_TIMEOUT + 120


class ServingPair:
    def __init__(self, cluster, namespace: str, engine_ref: str, model_dir):
        self.cluster, self.namespace, self.name = cluster, namespace, NAME
        self.engine_ref, self.model_dir = engine_ref, model_dir
        self.created = 0  # pairs ready() created (a clean full run: 0, faults e creates the first one itself)

    # --- reading ----------------------------------------------------------------------------------------------
    def manifest(self) -> dict:
        return pair_manifest(self.name, self.namespace, self.engine_ref, self.model_dir, prefill_node="n1",
                             decode_node="n2", prefill_env=[{"name": ENV_TEST_DROP_SIGNALS_FILE,
                                                             "value": DROP_SIGNALS_KNOB}],
                             decode_env=[{"name": ENV_TEST_STOP_LISTENER_FILE, "value": STOP_LISTENER_KNOB}])

    def get(self) -> dict | None:
        return read_pair(self.cluster, self.namespace, self.name)

    def status(self) -> dict:
        return (self.get() or {}).get("status") or {}

    def pods(self) -> dict[str, dict]:
        return {p["metadata"]["name"]: p for p in list_pods(self.cluster, self.namespace, f"{LABEL_PAIR}={self.name}")}

    def service(self) -> tuple[str, int]:
        svc = json.loads(self.cluster.kubectl("get", "service", self.name, "-n", self.namespace, "-o", "json").stdout)
        return svc["spec"]["clusterIP"], int(svc["spec"]["ports"][0]["port"])

    def diagnose(self) -> str:
        return "\n".join([describe(self.cluster, self.namespace), json.dumps(self.status(), indent=1)[-3000:],
                          "--- operator:\n" + operator_logs(self.cluster, tail=80)])

    def _settled(self) -> dict | None:
        """The status when the pair serves from one generation: Ready, no rollout, exactly its pods, all Ready."""
        status = self.status()
        if status.get("phase") != "Ready" or status.get("rollout"):
            return None
        generation = str(status.get("pairGeneration"))
        pods = list(self.pods().values())
        settled = len(pods) == 3 and all(
            p["metadata"]["labels"].get("pdpair.io/generation") == generation
            and not p["metadata"].get("deletionTimestamp")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
            for p in pods)
        return status if settled else None

    # --- acting -----------------------------------------------------------------------------------------------
    def apply(self) -> float:
        """Creates the pair (never over an existing one: that would roll back a scenario's spec change)."""
        t = time.monotonic()
        self.cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(self.manifest()))
        return t

    def delete(self) -> None:
        self.cluster.kubectl("delete", f"{PLURAL}.{GROUP}", self.name, "-n", self.namespace, "--ignore-not-found",
                             "--wait=true", "--timeout=120s", timeout=150)
        wait_for(lambda: not self.pods(), 180, f"the pods of pair {self.name} to go",
                 diagnose=lambda: describe(self.cluster, self.namespace), interval=1.0)

    def ready(self) -> dict:
        """The precondition of a shared scenario; returns the pair's status once it serves (see the module doc)."""
        if self.get() is not None:
            settled = self._settled()
            if settled:
                return settled
            try:
                return wait_for(self._settled, READY_TIMEOUT, f"the shared pair {self.name} to settle",
                                diagnose=self.diagnose, interval=1.0)
            except AssertionError as exc:
                print(f"[serving-pair] the pair left by an earlier scenario did not settle; creating it again:\n"
                      f"{str(exc)[-2000:]}")
            self.delete()
        self.created += 1
        t0 = self.apply()
        status = wait_for(self._settled, READY_TIMEOUT, f"the shared pair {self.name} Ready", diagnose=self.diagnose,
                          interval=1.0)
        print(f"[serving-pair] created {self.name}: apply -> Ready {time.monotonic() - t0:.1f}s")
        return status

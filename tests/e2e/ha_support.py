"""Shared by the operator HA and chaos tests (test_operator_ha.py, test_operator_chaos.py). Not a test module.

- `Replicas`: operator processes with leader election on (as the chart runs them), each under the chart's
  ServiceAccount; optionally supervised, i.e. restarted after it dies, as the kubelet would.
- `DecodeListeners`: plays the decode engines: keeps a real listening socket on every decode side-channel port that
  a pair lists in status, so the operator's probe gate opens (kwok pods run nothing; their IP is 127.0.0.1).
- `PodLedger`: every pod that ever existed in the namespace, from a watch that resumes after apiserver or etcd
  restarts (relist + diff on 410 Gone), so a duplicate pod per pair+role+generation cannot go unseen.
- `audit()`: the end-state invariants: no duplicate pod, no double restart, each port leased once, no orphan pod,
  no pair in a transitional phase.
"""

from __future__ import annotations

import collections
import re
import socket
import threading
import time
from dataclasses import dataclass, field

from pdpair.contract import (
    LABEL_GENERATION,
    LABEL_PAIR_UID,
    LABEL_ROLE,
    LEASE_NAME_PREFIX,
    PHASE_READY,
    PURPOSE_SIDECHANNEL,
    ROLE_DECODE,
)
from pdpair.operator.model import config as opconfig
from devcluster import operator_process
from tests.e2e.operator_helpers import NO_HEALTH, OPERATOR_NS
from devcluster.waiting import wait_for


@dataclass(frozen=True)
class ElectionTiming:
    lease_duration: float
    renew_deadline: float
    retry_period: float

    def env(self) -> dict[str, str]:
        return {
            opconfig.ENV_LEADER_ELECT: "true",
            opconfig.ENV_LEADER_LEASE_DURATION: str(self.lease_duration),
            opconfig.ENV_LEADER_RENEW_DEADLINE: str(self.renew_deadline),
            opconfig.ENV_LEADER_RETRY_PERIOD: str(self.retry_period),
        }

    @property
    def failover_bound(self) -> float:
        """The longest a standby can take to lead after the leader's last renewal: lease duration after it saw
        that renewal (seen within one retry period), plus one more retry period to notice the expiry."""
        return self.lease_duration + 2 * self.retry_period


def lease_holder(api, lease_name):
    import urllib3
    from kubernetes.client.exceptions import ApiException

    try:
        lease = api.coord.read_namespaced_lease(lease_name, OPERATOR_NS)
    except ApiException as exc:
        if exc.status == 404 or exc.status >= 500:
            return None
        raise
    except (OSError, urllib3.exceptions.HTTPError):  # the apiserver is restarting
        return None
    return lease.spec.holder_identity if lease.spec else None


class Replicas:
    """Operator replicas sharing one leader Lease (named after the test's namespace, so tests never share one)."""

    def __init__(self, platform, ns, pool, tmp_path, timing: ElectionTiming, api, env=None):
        self.platform, self.ns, self.pool, self.tmp_path = platform, ns, pool, tmp_path
        self.timing, self.api = timing, api
        self.lease_name = f"leader-{ns}"
        self.env = {**(NO_HEALTH if env is None else env), **timing.env(),
                    opconfig.ENV_LEADER_LEASE_NAME: self.lease_name, opconfig.ENV_WATCH_NAMESPACES: ns}
        self.procs: dict[str, operator_process.OperatorProcess] = {}
        self.incarnations = collections.Counter()
        self.exits: list[tuple[str, int]] = []  # (replica, exit code) of every process that ended
        self._reaped: set[int] = set()
        self._lock = threading.Lock()
        self._supervising = threading.Event()
        self._supervisor: threading.Thread | None = None

    def start(self, name: str) -> operator_process.OperatorProcess:
        cluster, kubeconfig = self.platform
        with self._lock:
            self.incarnations[name] += 1
            proc = operator_process.OperatorProcess(
                kubeconfig, OPERATOR_NS, self.pool, self.tmp_path / f"{name}.{self.incarnations[name]}.log",
                extra_env={**self.env, opconfig.ENV_POD_NAME: name},
            )
            self.procs[name] = proc
        return proc.start()  # returns once /healthz answers: the standby's own, or kopf's once it leads

    def leader(self) -> str | None:
        """The replica whose running process holds the Lease now (None: nobody, or a dead incarnation)."""
        holder = lease_holder(self.api, self.lease_name)
        if not holder:
            return None
        name = holder.rsplit("_", 1)[0]
        proc = self.procs.get(name)
        alive = proc is not None and proc.proc is not None and proc.proc.poll() is None
        # The identity's random suffix is logged by that process only ("<identity> is a candidate").
        return name if alive and holder in proc.log_tail(200_000) else None

    def wait_leader(self, timeout, other_than=None):
        def check():
            holder = lease_holder(self.api, self.lease_name)
            return holder if holder and holder != other_than else None
        what = "a leader" + (f" other than {other_than}" if other_than else "")
        holder = wait_for(check, timeout, what, interval=0.05)
        return holder.rsplit("_", 1)[0], holder

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.kill()
        self._reap(name, proc)

    def _reap(self, name, proc) -> None:
        with self._lock:
            if id(proc) not in self._reaped:
                self._reaped.add(id(proc))
                self.exits.append((name, proc.proc.returncode))

    def supervise(self, restart_delay: float = 0.5) -> None:
        """Restart any replica whose process ended (SIGKILLed by the test, or fenced after a missed renewal)."""
        self._supervising.set()

        def loop():
            while self._supervising.is_set():
                for name, proc in list(self.procs.items()):
                    if proc.proc is not None and proc.proc.poll() is not None and self._supervising.is_set():
                        self._reap(name, proc)
                        time.sleep(restart_delay)
                        try:
                            self.start(name)
                        except RuntimeError as exc:  # the apiserver may be down right now: try again next lap
                            print(f"supervisor: restarting {name} failed: {str(exc)[:300]}")
                time.sleep(0.2)

        self._supervisor = threading.Thread(target=loop, daemon=True)
        self._supervisor.start()

    def stop(self) -> None:
        self._supervising.clear()
        if self._supervisor is not None:
            self._supervisor.join(30)
        for proc in self.procs.values():
            proc.stop()

    def fenced_exits(self) -> int:
        from pdpair.operator.act.election import LOST_LEADERSHIP_EXIT_CODE

        return sum(1 for _, code in self.exits if code == LOST_LEADERSHIP_EXIT_CODE)

    def logs(self) -> str:
        return "\n".join(f"--- {p.log_path.name}\n{p.log_tail(3000)}" for p in self.procs.values())


class DecodeListeners:
    """A listening socket on each decode side-channel port listed in a pair's status (the engine's listener): the
    serving generation's (status.ports) and a Surge rollout's new one (status.rollout.ports)."""

    def __init__(self, api, ns):
        self.api, self.ns = api, ns
        self.sockets: dict[int, socket.socket] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                wanted = set()
                for pair in self.api.pairs(self.ns):
                    status = pair.get("status") or {}
                    for port in (status.get("ports") or []) + ((status.get("rollout") or {}).get("ports") or []):
                        if port.get("role") == ROLE_DECODE and port.get("purpose") == PURPOSE_SIDECHANNEL:
                            wanted.add(int(port["port"]))
                for port in wanted - set(self.sockets):
                    sock = socket.socket()
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind(("127.0.0.1", port))
                    sock.listen(64)
                    self.sockets[port] = sock
                for port in set(self.sockets) - wanted:
                    self.sockets.pop(port).close()
            except Exception:
                pass  # apiserver restarting: next lap
            self._stop.wait(0.2)

    def stop(self):
        self._stop.set()
        self._thread.join(10)
        for sock in self.sockets.values():
            sock.close()


class PodLedger:
    """Every pod uid ever seen in `ns`, by (pair uid, role, generation). A watch that survives restarts."""

    def __init__(self, api, ns):
        self.api, self.ns = api, ns
        self.seen: dict[str, tuple[str, str, str, str]] = {}  # pod uid -> (pair uid, role, generation, name)
        self.relists = 0
        self._stop = threading.Event()
        self._watch = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        if not self._ready.wait(30):
            raise AssertionError("the pod ledger's first list did not answer within 30s")

    def _note(self, pod):
        labels = pod.metadata.labels or {}
        self.seen.setdefault(pod.metadata.uid, (labels.get(LABEL_PAIR_UID, ""), labels.get(LABEL_ROLE, ""),
                                                labels.get(LABEL_GENERATION, ""), pod.metadata.name))

    def _run(self):
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        version = None
        while not self._stop.is_set():
            try:
                if version is None:
                    listed = self.api.core.list_namespaced_pod(self.ns)
                    for pod in listed.items:
                        self._note(pod)
                    version = listed.metadata.resource_version
                    self.relists += 1
                    self._ready.set()
                self._watch = watch.Watch()
                for event in self._watch.stream(self.api.core.list_namespaced_pod, self.ns, resource_version=version,
                                                timeout_seconds=60, allow_watch_bookmarks=True):
                    if self._stop.is_set():
                        return
                    pod = event["object"]
                    if event["type"] == "ERROR":
                        version = None  # 410 Gone: relist; pods created meanwhile are noted from the list
                        break
                    if event["type"] != "BOOKMARK":
                        self._note(pod)
                    version = pod.metadata.resource_version
            except ApiException as exc:
                if exc.status == 410:
                    version = None
                self._stop.wait(0.5)
            except Exception:
                self._stop.wait(0.5)  # apiserver down: resume from the last version seen

    def duplicates(self) -> dict[tuple[str, str, str], list[str]]:
        groups = collections.defaultdict(list)
        for uid, (pair_uid, role, generation, name) in self.seen.items():
            groups[(pair_uid, role, generation)].append(f"{name}/{uid[:8]}")
        return {key: names for key, names in groups.items() if len(names) > 1}

    def stop(self):
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()


@dataclass
class Expected:
    """What the test did to one pair: each restart trigger and each spec change is exactly one new generation."""
    restarts: int = 0
    rollouts: int = 0
    images: list[str] = field(default_factory=list)

    @property
    def generation(self) -> int:
        return 1 + self.restarts + self.rollouts


RESTART_EVENT = re.compile(r"ordered restart to generation (\d+)")


def restart_generations(api, ns) -> dict[str, set[int]]:
    """The generations each pair's Restarting Events announce. A leader killed between posting the Event and
    writing status makes its successor post the same generation again: that is one restart, not two."""
    found = collections.defaultdict(set)
    for event in api.events(ns):
        match = RESTART_EVENT.search(event.message or "") if event.reason == "Restarting" else None
        if match:
            found[event.involved_object.name].add(int(match.group(1)))
    return found


def converged(api, ns, expected: dict[str, Expected]):
    """Every pair Ready at its expected generation with exactly its two current pods, or None."""
    pairs = {p["metadata"]["name"]: p for p in api.pairs(ns)}
    if set(pairs) != set(expected):
        return None
    pods = api.pods(ns)
    for name, pair in pairs.items():
        status = pair.get("status") or {}
        if status.get("phase") != PHASE_READY or status.get("pairGeneration") != expected[name].generation:
            return None
        mine = [p for p in pods if p["metadata"]["labels"].get(LABEL_PAIR_UID) == pair["metadata"]["uid"]]
        if len(mine) != 2 or any(p["metadata"].get("deletion_timestamp") for p in mine):
            return None
    return pairs


def audit(api, ns, expected: dict[str, Expected], ledger: PodLedger, ports_per_pair: int,
          events_may_be_lost: bool = False) -> dict:
    """The invariants after convergence; raises AssertionError naming the first one broken.

    events_may_be_lost: an Event posted while the apiserver is down is dropped (kopf posts each once), so after
    apiserver restarts the Restarting Events may be fewer than the restarts, never more."""
    pairs = {p["metadata"]["name"]: p for p in api.pairs(ns)}
    uids = {p["metadata"]["uid"]: name for name, p in pairs.items()}

    dup = ledger.duplicates()
    assert dup == {}, f"a pod was created twice for one pair+role+generation: {dup}"

    announced = restart_generations(api, ns)
    for name, want in expected.items():
        status = pairs[name]["status"]
        assert int(status.get("restarts") or 0) == want.restarts, \
            f"{name}: status.restarts {status.get('restarts')} but {want.restarts} restarts were triggered"
        seen = len(announced.get(name, ()))
        assert seen <= want.restarts if events_may_be_lost else seen == want.restarts, \
            f"{name}: Restarting Events announce generations {sorted(announced.get(name, ()))} but " \
            f"{want.restarts} restarts were triggered"
        assert status["pairGeneration"] == want.generation, \
            f"{name}: generation {status['pairGeneration']}, expected {want.generation} ({want})"

    leases = api.leases(ns)
    by_port = collections.Counter(int(l.metadata.name.removeprefix(LEASE_NAME_PREFIX)) for l in leases)
    assert all(n == 1 for n in by_port.values())
    lease_ports = collections.defaultdict(set)
    for lease in leases:
        owner = lease.metadata.labels[LABEL_PAIR_UID]
        assert owner in uids, f"lease {lease.metadata.name} held for a pair that does not exist ({owner})"
        lease_ports[owner].add(int(lease.metadata.name.removeprefix(LEASE_NAME_PREFIX)))
    listed = collections.Counter()
    for uid, name in uids.items():
        ports = {int(p["port"]) for p in pairs[name]["status"].get("ports") or []}
        assert ports == lease_ports[uid], \
            f"{name}: status ports {sorted(ports)} != its leases {sorted(lease_ports[uid])}"
        assert len(ports) == ports_per_pair, f"{name}: {len(ports)} ports, expected {ports_per_pair}"
        listed.update(ports)
    twice = [port for port, n in listed.items() if n > 1]
    assert twice == [], f"ports listed by two pairs: {twice}"

    pods = api.pods(ns)
    orphans = []
    for pod in pods:
        labels = pod["metadata"]["labels"]
        name = uids.get(labels.get(LABEL_PAIR_UID))
        if name is None or labels.get(LABEL_GENERATION) != str(pairs[name]["status"]["pairGeneration"]):
            orphans.append(pod["metadata"]["name"])
    assert orphans == [], f"orphan pods (no pair, or an old generation): {orphans}"
    return {"pairs": len(pairs), "pods_seen": len(ledger.seen), "leases": len(leases),
            "restarts": sum(e.restarts for e in expected.values()),
            "rollouts": sum(e.rollouts for e in expected.values())}

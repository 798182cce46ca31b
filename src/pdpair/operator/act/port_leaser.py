"""Port leasing: one coordination.k8s.io/v1 Lease per claimed port, created if absent.

The API server makes "create if absent" atomic, so a 409 means another pair holds the port and we try the next.
The leases are the truth and `status.ports` is a copy: after a crash the operator lists the leases by pair uid and
adopts them. A pair that held no Lease at the start-up's full list, and that this process has not claimed for since,
is not listed (`PortLeaser._may_hold`: the operator is the only writer of pair Leases). The pure planner
(`required_blocks`, `choose_run`, `match_existing`) is apart from the API calls (`PortLeaser`), so it can be
table-tested.

Instances (xPyD, docs/xpyd.md section 1): every prefill and decode instance has its own blocks (side channel per
rank, metrics, http), keyed (role, instance, purpose); the router has one (instance 0). A Lease carries its instance
in the label pdpair.io/instance (absent: 0, a Lease made before instances existed), status.ports entries an
`instance` field only when it is > 0, named `<role>-<purpose>-<rank>-i<n>`: a 1P1D pair's leases and status are
what they were before instances.

A scale-up that hits the pool limit: `ensure` claims the new instances' blocks and runs out. It releases what that
call claimed (so pairs scaling up at once cannot starve each other by each holding a part), and, when the caller
says the pair has pods on that port set (`hoard_nothing=False`), keeps the blocks it adopted: the serving
instances' ports stay leased under their pods. The outcome is `exhausted` with the pool's message and
`assignments` = the kept blocks; the caller lists exactly those in status (they are leased), counts the ports as
incomplete (`observed.ports_complete` False, `pool_exhausted` True), creates no pod for an instance without its
blocks, and retries every PDPAIR_POOL_RETRY_SECONDS. With `hoard_nothing=True` (no pod on the set: a pair that
never started, or whose pods are all gone) both are released and `assignments` is empty: a waiting pair hoards
nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Awaitable, Callable, Mapping

from pdpair.contract import (
    ANNOTATION_FENCED_POD,
    ANNOTATION_QUARANTINE_NODE,
    ANNOTATION_QUARANTINE_REASON,
    FENCE_HOLDER_PREFIX,
    LABEL_INSTANCE,
    LABEL_PAIR,
    LABEL_PAIR_NAMESPACE,
    LABEL_PAIR_UID,
    LABEL_PORT_LEASE,
    LABEL_PORT_QUARANTINE,
    LABEL_PORT_SLOT,
    LABEL_PURPOSE,
    LABEL_ROLE,
    LEASE_NAME_PREFIX,
    MAX_REPLICAS,
    QUARANTINE_HOLDER_PREFIX,
)

from pdpair.operator.decide.busy_ports import quarantine_expired
from pdpair.operator.model.config import PortPool

from pdpair.operator.decide.port_blocks import (
    DEFAULT_SLOT,
    LABEL_VALUE_MAX,
    PortAssignment,
    PortBlock,
    assign,
    choose_run,
    describe,
    lease_instance,
    lease_name,
    lease_slot,
    match_existing,
    missing_blocks,
)

log = logging.getLogger(__name__)

# --- the API side ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PairRef:
    namespace: str
    name: str
    uid: str

    @property
    def holder(self) -> str:
        return f"{self.namespace}/{self.name}/{self.uid}"


@dataclass
class LeaseOutcome:
    assignments: list[PortAssignment] = field(default_factory=list)
    exhausted: bool = False
    adopted: int = 0
    claimed: int = 0
    released: int = 0
    message: str = ""
    slots: frozenset[str] = frozenset()  # every port set the pair held leases in, as read before claiming

    @property
    def complete(self) -> bool:
        return not self.exhausted and bool(self.assignments)


class PoolExhausted(Exception):
    pass


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """What the leaser reads of a Lease, from the apiserver's JSON.

    Not the kubernetes client's models: from client 35 on these are pydantic models, ~17 objects a Lease with its
    managedFields. A restarted operator's orphan sweep listed all 6000 Leases of 1000 pairs and held them while it
    asked about each pair: 100k model objects, 16.4 MiB (tracemalloc, docs/benchmarks.md)."""

    name: str
    uid: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    duration_seconds: int | None = None
    acquire_time: datetime | None = None
    renew_time: datetime | None = None

    @classmethod
    def from_json(cls, item: Mapping[str, Any]) -> LeaseRecord:
        meta = item.get("metadata") or {}
        spec = item.get("spec") or {}
        return cls(
            name=meta.get("name") or "", uid=meta.get("uid") or "",
            labels=meta.get("labels") or {}, annotations=meta.get("annotations") or {},
            duration_seconds=spec.get("leaseDurationSeconds"),
            acquire_time=_micro_time(spec.get("acquireTime")), renew_time=_micro_time(spec.get("renewTime")),
        )


def _micro_time(value: str | None) -> datetime | None:
    """A Lease's MicroTime (RFC 3339, e.g. 2026-12-06T01:02:03.000004Z); None when absent or unreadable (a
    quarantine without a time is over at once: busy_ports.quarantine_expired)."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


class PortLeaser:
    """Claims and releases port Leases with the official kubernetes client, off the event loop.

    `taken` is this process's best knowledge of held ports; the apiserver's 409 stays the arbiter, so a stale
    `taken` only costs a retry. Candidate picking is under an asyncio lock so concurrent pairs in this process
    don't race each other for the same port.
    """

    def __init__(self, coordination_api: Any, namespace: str, pool: PortPool) -> None:
        self.api = coordination_api
        self.namespace = namespace
        self.pool = pool
        self.taken: set[int] = set()
        self._reserved: set[int] = set()  # picked by a claim in flight, not yet created
        self._lock = asyncio.Lock()
        self._pool_ports: frozenset[int] | None = None  # built on first use
        # Pair uids that may hold a Lease: every uid in the last full list (refresh_taken, at start-up before any
        # pass) plus every pair this process has created a Lease for since. None until the first full list. The
        # operator is the only writer of pair Leases (one leader, or one replica with the chart's Recreate), so a
        # pair outside the set holds none, and its first pass needs no list to learn that: 1000 label-selected
        # lists of every port Lease while 1000 new pairs start (3.6 ms of apiserver CPU each with 6000 Leases).
        self._may_hold: set[str] | None = None

    # - low-level calls, each in a thread ------------------------------------------------------------
    async def _call(self, fn, *args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def list_leases(self, label_selector: str) -> list[LeaseRecord]:
        """The Leases the selector matches, as `LeaseRecord`s read from the apiserver's JSON (not the client's models:
        see LeaseRecord), 500 a page."""
        from pdpair.operator.act.kube_api import call_json  # an executor module: the planner imports this one's pure half

        items: list[LeaseRecord] = []
        token = None
        while True:
            page = await self._call(
                call_json,
                self.api.list_namespaced_lease,
                self.namespace,
                label_selector=label_selector,
                limit=500,
                _continue=token,
            )
            items.extend(LeaseRecord.from_json(item) for item in page.get("items") or ())
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items

    async def refresh_taken(self) -> int:
        """Reload every held port from the apiserver (start-up, and before declaring the pool exhausted)."""
        leases = await self.list_leases(f"{LABEL_PORT_LEASE}=true")
        ports = {p for p in (_lease_port(l) for l in leases) if p is not None}
        async with self._lock:
            self.taken = ports | self._reserved  # the apiserver is the truth, plus claims in flight
            self._may_hold = (self._may_hold or set()) | {lease.labels.get(LABEL_PAIR_UID, "") for lease in leases}
        return len(ports)

    def free_count(self) -> int:
        # Called after every reconcile pass (the pool gauge): a C-level set intersection, not a Python loop over
        # every held port (3.8 ms a pass with 6000 held ports, 13% of a core at idle for 1000 pairs).
        if self._pool_ports is None:
            self._pool_ports = frozenset(self.pool)
        return self.pool.size - len(self.taken & self._pool_ports)

    async def leases_of(self, pair_uid: str) -> list[Any]:
        return await self.list_leases(f"{LABEL_PORT_LEASE}=true,{LABEL_PAIR_UID}={pair_uid}")

    async def _create(self, pair: PairRef, role: str, purpose: str, port: int, slot: str = DEFAULT_SLOT,
                      instance: int = 0) -> LeaseRecord | None:
        """Create the lease; None when another holder has it (409)."""
        from kubernetes.client import V1Lease, V1LeaseSpec, V1ObjectMeta
        from kubernetes.client.exceptions import ApiException

        from pdpair.operator.act.kube_api import call_json

        if self._may_hold is not None:
            self._may_hold.add(pair.uid)  # before the call: a create whose reply is lost may still have been made
        body = V1Lease(
            metadata=V1ObjectMeta(
                name=lease_name(port),
                namespace=self.namespace,
                labels={
                    LABEL_PORT_LEASE: "true",
                    LABEL_PAIR: pair.name,
                    LABEL_PAIR_NAMESPACE: pair.namespace,
                    LABEL_PAIR_UID: pair.uid,
                    LABEL_ROLE: role,
                    LABEL_PURPOSE: purpose,
                    LABEL_PORT_SLOT: slot,
                    LABEL_INSTANCE: str(instance),  # always written, though absent reads as 0
                },
            ),
            spec=V1LeaseSpec(holder_identity=pair.holder),
        )
        try:
            return LeaseRecord.from_json(await self._call(call_json, self.api.create_namespaced_lease, self.namespace,
                                                          body))
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise

    async def _delete(self, name: str, uid: str | None) -> bool:
        """Delete one lease, only if it is still the one we mean (uid precondition); 404/409 are fine."""
        from kubernetes.client import V1DeleteOptions, V1Preconditions
        from kubernetes.client.exceptions import ApiException

        opts = V1DeleteOptions(preconditions=V1Preconditions(uid=uid) if uid else None)
        try:
            await self._call(self.api.delete_namespaced_lease, name, self.namespace, body=opts)
            return True
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise

    # - the pair-level operations --------------------------------------------------------------------
    async def _held(
        self, pair_uid: str, slot: str = DEFAULT_SLOT
    ) -> tuple[dict[tuple[str, int, str], list[int]], dict[int, str], frozenset[str]]:
        """The pair's leased ports of one port set by (role, instance, purpose), each lease's uid, and every port set
        the pair holds leases in (the same list says it: the planner releases a set a finished rollout left)."""
        held: dict[tuple[str, int, str], list[int]] = defaultdict(list)
        uids: dict[int, str] = {}
        slots: set[str] = set()
        if self._may_hold is not None and pair_uid not in self._may_hold:
            return held, uids, frozenset()  # no Lease of this pair existed at the last full list, none made since
        for lease in await self.leases_of(pair_uid):
            port = _lease_port(lease)
            if port is None:
                continue
            labels = lease.labels
            in_slot = lease_slot(labels)
            slots.add(in_slot)
            if in_slot != slot:
                continue
            held[(labels.get(LABEL_ROLE, ""), lease_instance(labels), labels.get(LABEL_PURPOSE, ""))].append(port)
            uids[port] = lease.uid
        return held, uids, frozenset(slots)

    async def held(self, pair: PairRef, slot: str = DEFAULT_SLOT) -> tuple[list[PortAssignment], frozenset[str]]:
        """What the pair holds in one port set now, changing nothing (ranks by port order within each role, instance
        and purpose), and every port set it holds leases in. A lease whose instance label is not ours to read (no
        instance of the CRD's range) is left out: status lists no entry the CRD would refuse."""
        held, _, slots = await self._held(pair.uid, slot)
        async with self._lock:
            self.taken.update(p for ports in held.values() for p in ports)
        return sorted(
            PortAssignment(role, purpose, rank, port, instance=instance)
            for (role, instance, purpose), ports in held.items() if 0 <= instance < MAX_REPLICAS
            for rank, port in enumerate(sorted(ports))
        ), slots

    async def ensure(
        self,
        pair: PairRef,
        blocks: tuple[PortBlock, ...],
        before_release: Callable[[set[int]], Awaitable[None]] | None = None,
        slot: str = DEFAULT_SLOT,
        hoard_nothing: bool = True,
    ) -> LeaseOutcome:
        """Make the pair hold exactly `blocks`: adopt what fits, release what doesn't, claim the rest.

        When the pool cannot satisfy every block, this call's partial claim is released; what was adopted is
        released too only with `hoard_nothing` (no pod of the pair is on this port set: a waiting pair hoards
        nothing), else kept and returned as `assignments` (pods are bound to those ports: a scale-up that hits the
        pool limit must not take the serving instances' ports away). Either way the outcome is `exhausted`; the
        caller reports PoolExhausted and retries later (module docstring).
        `before_release(ports)` is awaited before any of the pair's ports is released, so the caller can stop
        listing them first (status.ports never names a port the pair no longer holds).
        `slot` is the port set (the pair holds two during a Surge rollout); the other set is left alone.
        """
        for value in (pair.name, pair.namespace, pair.uid):
            if len(value) > LABEL_VALUE_MAX:
                raise ValueError(f"name {value!r} is longer than {LABEL_VALUE_MAX} characters (a label value)")
        held, uids, slots = await self._held(pair.uid, slot)
        outcome = LeaseOutcome(slots=slots)
        keep, release = match_existing(blocks, held)
        outcome.adopted = len(keep)
        if release and before_release is not None:
            await before_release(set(release))
        for port in release:
            outcome.released += await self._release_port(port, uids.get(port))
        async with self._lock:
            self.taken.update(a.port for a in keep)
        new: list[tuple[PortAssignment, str]] = []
        try:
            for block in missing_blocks(blocks, keep):
                got = await self._claim_block(pair, block, slot)
                new.extend(got)
        except PoolExhausted as exc:
            outcome.exhausted = True
            outcome.message = str(exc)
            drop = [(a.port, uid) for a, uid in new]
            if hoard_nothing:
                drop += [(a.port, uids.get(a.port)) for a in keep]
            else:
                outcome.assignments = sorted(keep)
            if drop and before_release is not None:
                await before_release({port for port, _ in drop})
            for port, uid in drop:
                outcome.released += await self._release_port(port, uid)
            return outcome
        outcome.claimed = len(new)
        outcome.assignments = sorted(keep + [a for a, _ in new])
        return outcome

    async def _claim_block(self, pair: PairRef, block: PortBlock, slot: str = DEFAULT_SLOT) -> list[tuple[PortAssignment, str]]:
        if block.fixed is not None:
            lease = await self._create(pair, block.role, block.purpose, block.fixed, slot, block.instance)
            if lease is None:
                raise PoolExhausted(f"port {block.fixed} ({block.role} {block.purpose}) is leased by another pair")
            async with self._lock:
                self.taken.add(block.fixed)
            return [(PortAssignment(block.role, block.purpose, 0, block.fixed, instance=block.instance),
                     lease.uid)]
        refreshed = False
        start_at: int | None = None
        while True:
            async with self._lock:
                first = choose_run(self.pool, self.taken, block.count, start_at)
                if first is not None:
                    run = set(range(first, first + block.count))
                    self.taken.update(run)  # reserve before the API calls
                    self._reserved.update(run)
            if first is None:
                if refreshed:
                    raise PoolExhausted(
                        f"no {block.count} free{' contiguous' if block.count > 1 else ''} port(s) for "
                        f"{describe(block)} in pool {self.pool.first}-{self.pool.last} "
                        f"({self.free_count()} free)"
                    )
                await self.refresh_taken()  # our view may be stale (ports freed elsewhere)
                refreshed, start_at = True, None
                continue
            got: list[tuple[PortAssignment, str]] = []
            clash = None
            try:
                for assignment in assign(block, first):
                    lease = await self._create(pair, block.role, block.purpose, assignment.port, slot,
                                               block.instance)
                    if lease is None:
                        clash = assignment.port
                        break
                    got.append((assignment, lease.uid))
            except BaseException:
                # An apiserver error or cancellation: what was created carries the pair uid, so the next
                # ensure() adopts or releases it; just forget the reservation.
                async with self._lock:
                    self._reserved.difference_update(range(first, first + block.count))
                    self.taken.difference_update(range(first + len(got), first + block.count))
                raise
            async with self._lock:
                self._reserved.difference_update(range(first, first + block.count))
            if clash is None:
                return got
            # Someone else holds `clash`: give back this run's claims and unreserved ports, try after it.
            for assignment, uid in got:
                await self._release_port(assignment.port, uid)
            async with self._lock:
                self.taken.difference_update(p for p in range(first, first + block.count) if p != clash)
                self.taken.add(clash)
            start_at = clash + 1

    async def _release_port(self, port: int, uid: str | None) -> int:
        deleted = await self._delete(lease_name(port), uid)
        async with self._lock:
            self.taken.discard(port)
        return int(deleted)

    async def release_slot(self, pair: PairRef, slot: str) -> int:
        """Delete every lease of one of the pair's port sets (the old or the failed generation of a Surge rollout,
        once its pods are gone and status no longer lists the ports; or such a set whose release a dead pass left
        undone, surge.release_left_slot)."""
        _, uids, _ = await self._held(pair.uid, slot)
        released = 0
        for port, uid in uids.items():
            released += await self._release_port(port, uid)
        return released

    async def release_pair(self, pair_uid: str) -> int:
        """Delete every lease of one pair (finalizer)."""
        released = 0
        for lease in await self.leases_of(pair_uid):
            port = _lease_port(lease)
            if port is not None:
                released += await self._release_port(port, lease.uid)
        return released

    # - quarantine: a port found busy on a node (busy_ports.py); fence: a port of a pod on a lost node (nodes.py) --
    async def quarantine(self, pair: PairRef, port: int, node: str, seconds: int, reason: str) -> bool:
        """Turn the pair's lease of `port` into a quarantine Lease (holder node-busy/<node>, leaseDurationSeconds
        `seconds`), in one update, so no moment leaves the port free for another pair. A port nobody leases is
        claimed as quarantined. True when the port is quarantined now (by this call or before); False when another
        pair holds it (nothing to do: it is not ours) or the lease changed under us (the next pass retries)."""
        return await self._hand_over(pair, port, f"{QUARANTINE_HOLDER_PREFIX}{node}", int(seconds),
                                     {ANNOTATION_QUARANTINE_NODE: node, ANNOTATION_QUARANTINE_REASON: reason[:1024]},
                                     f"quarantined for {seconds}s (busy on node {node}): {reason}")

    async def fence(self, pair: PairRef, port: int, node: str, pod: str, reason: str) -> bool:
        """Turn the pair's lease of `port` into a fence Lease (holder node-lost/<node>, no duration) held for as
        long as the pod `pod` (<namespace>/<name>/<uid>) exists or its node is lost: a pod on a lost node may still
        run and be bound to the port, however long the partition lasts. sweep_fences releases it once that pod is
        gone and the node is back (or deleted). Same answers as
        quarantine()."""
        return await self._hand_over(pair, port, f"{FENCE_HOLDER_PREFIX}{node}", None,
                                     {ANNOTATION_QUARANTINE_NODE: node, ANNOTATION_QUARANTINE_REASON: reason[:1024],
                                      ANNOTATION_FENCED_POD: pod},
                                     f"fenced to pod {pod} on lost node {node}: {reason}")

    async def _hand_over(self, pair: PairRef, port: int, holder: str, seconds: int | None,
                         annotations: dict[str, str], what: str) -> bool:
        from datetime import datetime, timezone

        from kubernetes.client import V1Lease, V1LeaseSpec, V1ObjectMeta
        from kubernetes.client.exceptions import ApiException

        now = datetime.now(timezone.utc)
        meta = V1ObjectMeta(
            name=lease_name(port), namespace=self.namespace,
            labels={LABEL_PORT_LEASE: "true", LABEL_PORT_QUARANTINE: "true"}, annotations=annotations,
        )
        spec = V1LeaseSpec(holder_identity=holder, lease_duration_seconds=seconds, acquire_time=now, renew_time=now)
        try:
            current = await self._call(self.api.read_namespaced_lease, lease_name(port), self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            current = None
        try:
            if current is None:
                await self._call(self.api.create_namespaced_lease, self.namespace, V1Lease(metadata=meta, spec=spec))
            else:
                labels = current.metadata.labels or {}
                if labels.get(LABEL_PORT_QUARANTINE) == "true":
                    return True
                if labels.get(LABEL_PAIR_UID) != pair.uid:
                    return False
                meta.resource_version = current.metadata.resource_version  # 409 if it changed since the read
                await self._call(self.api.replace_namespaced_lease, lease_name(port), self.namespace,
                                 V1Lease(metadata=meta, spec=spec))
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        async with self._lock:
            self.taken.add(port)
        log.info("port %d %s", port, what)
        return True

    async def sweep_quarantines(self, now: Any = None) -> list[int]:
        """Delete the quarantine Leases whose time is over; returns their ports (free for leasing again). Fence
        Leases have no time: sweep_fences ends them."""
        from datetime import datetime, timezone

        now = now or datetime.now(timezone.utc)
        freed: list[int] = []
        for lease in await self.list_leases(f"{LABEL_PORT_QUARANTINE}=true"):
            port = _lease_port(lease)
            if ANNOTATION_FENCED_POD in lease.annotations:
                continue
            if port is None or not quarantine_expired(lease.renew_time or lease.acquire_time, lease.duration_seconds,
                                                      now):
                continue
            if await self._release_port(port, lease.uid):
                freed.append(port)
        if freed:
            log.info("quarantine over for ports %s: free for leasing again", freed)
        return freed

    async def sweep_fences(self, pod_exists: Callable[[str, str, str], Awaitable[bool]],
                           node_lost: Callable[[str], Awaitable[bool]]) -> list[int]:
        """Delete the fence Leases whose pod is gone and whose node is no longer lost; returns their ports.
        `pod_exists(namespace, name, uid)` is awaited (True while a pod of that name and uid exists), and
        `node_lost(node)` (True while the node is still cut off): a pod force-deleted on a lost node (instances.heal)
        is gone from the API, but its containers run on until its kubelet is back and ends them."""
        freed: list[int] = []
        for lease in await self.list_leases(f"{LABEL_PORT_QUARANTINE}=true"):
            port = _lease_port(lease)
            ref = lease.annotations.get(ANNOTATION_FENCED_POD)
            if port is None or ref is None:
                continue
            namespace, _, rest = ref.partition("/")
            name, _, uid = rest.partition("/")
            if await pod_exists(namespace, name, uid):
                continue
            node = lease.annotations.get(ANNOTATION_QUARANTINE_NODE)
            if node and await node_lost(node):
                continue
            if await self._release_port(port, lease.uid):
                freed.append(port)
                log.info("port %d: its fenced pod %s is gone; free for leasing again", port, ref)
        return freed

    async def sweep_orphans(self, pair_uid_alive) -> int:
        """Delete leases whose pair no longer exists. `pair_uid_alive(namespace, name, uid)` is awaited.
        Quarantine Leases belong to no pair; sweep_quarantines ends them."""
        # Only (port, lease uid) per pair is kept across the awaits below: the orphan check of a restarted operator
        # asks the apiserver about every pair it does not reconcile yet, for as long as that takes.
        by_pair: dict[tuple[str, str, str], list[tuple[int, str]]] = defaultdict(list)
        for lease in await self.list_leases(f"{LABEL_PORT_LEASE}=true"):
            labels = lease.labels
            port = _lease_port(lease)
            if labels.get(LABEL_PORT_QUARANTINE) == "true" or port is None:
                continue
            key = (labels.get(LABEL_PAIR_NAMESPACE, ""), labels.get(LABEL_PAIR, ""), labels.get(LABEL_PAIR_UID, ""))
            by_pair[key].append((port, lease.uid))
        released = 0
        for (namespace, name, uid), group in by_pair.items():
            if await pair_uid_alive(namespace, name, uid):
                continue
            for port, lease_uid in group:
                released += await self._release_port(port, lease_uid)
            log.info("released %d orphaned port leases of %s/%s (uid %s)", len(group), namespace, name, uid)
        return released


def _lease_port(lease: LeaseRecord) -> int | None:
    name = lease.name
    if not name.startswith(LEASE_NAME_PREFIX):
        return None
    try:
        return int(name[len(LEASE_NAME_PREFIX):])
    except ValueError:
        return None

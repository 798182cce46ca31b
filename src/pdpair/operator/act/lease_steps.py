"""The executor's part for the pair's port leases: it carries out the lease plan the planner decides
(planner.prepare: lease or only read each port set, quarantine busy ports, fence a lost node's ports) with
port_leaser.PortLeaser's API calls, and keeps the reconciler's view of the leased ports (`ports`, `rollout_ports`)
in step. `LeaseSteps` is a part of `reconciler.PairReconciler` (its state lives there) and decides nothing."""

from __future__ import annotations

import time

from pdpair.contract import PURPOSE_SIDECHANNEL, ROLE_DECODE
from pdpair.operator.decide import busy_ports, leases, planner
from pdpair.operator.decide.port_blocks import ports_of, status_ports

# A pair's leases are re-read from the apiserver (the truth: someone may have deleted one) every this many resync
# intervals, not every pass: each re-read is a LIST that the apiserver answers by matching the pair's label against
# every port lease in the namespace (6000 at 1000 pairs). Once per resync interval it was a second LIST for every
# pair whose start took longer than that (all of them while 1000 pairs started) and 33 LISTs a second at rest.
LEASE_RECHECK_RESYNCS = 10


class LeaseSteps:
    """Mixed into PairReconciler: lease_serving, lease_rollout, quarantine_busy and fence_lost."""

    def _lease_recheck_seconds(self) -> float:
        return LEASE_RECHECK_RESYNCS * self.rt.config.resync_interval

    async def lease_serving(self, step: leases.LeaseStep) -> None:
        """Carry out the serving port set's lease step (leases.lease_steps); `self.ports` then mirrors the pair's
        leases exactly ([] or None: none held). Leases are re-read (the truth) every LEASE_RECHECK_RESYNCS resync
        intervals, or when the blocks change; after an exhausted pool, no sooner than pool_retry."""
        fresh = time.monotonic() - self.leases_checked_at < self._lease_recheck_seconds()
        if not step.leasing:
            if self.ports is None or not fresh:
                held, self.leased_slots = await self.rt.leaser.held(self.ref, step.slot)
                self.ports = status_ports(held)
                self.blocks = None  # unknown: re-leased (adopting what fits) once the other spec's pods are gone
                self.leases_checked_at = time.monotonic()
            return
        if self.ports is not None and step.blocks == self.blocks and fresh:
            return
        if self.pool_message and time.monotonic() < self.next_lease_try:
            return
        outcome = await self.rt.leaser.ensure(self.ref, step.blocks, before_release=self._unlist_ports, slot=step.slot,
                                              hoard_nothing=step.hoard_nothing)
        self.leases_checked_at, self.leased_slots = time.monotonic(), outcome.slots
        if outcome.exhausted:
            # Pods on the set: what they hold was kept (the planner starts no instance without ports); else none
            self.ports = status_ports(outcome.assignments) if outcome.assignments else None
            self.blocks = None
            if not self.pool_message:
                self.emit("Warning", "PoolExhausted", outcome.message)
            self.pool_message = outcome.message
            self.next_lease_try = time.monotonic() + self.rt.config.pool_retry
            return
        self.ports, self.blocks, self.pool_message = status_ports(outcome.assignments), step.blocks, ""
        if outcome.claimed or outcome.released:
            self.emit(
                "Normal",
                "PortsLeased",
                f"{len(outcome.assignments)} ports leased ({outcome.adopted} adopted, {outcome.claimed} claimed, "
                f"{outcome.released} released); decode side channel "
                f"{ports_of(self.ports, ROLE_DECODE, PURPOSE_SIDECHANNEL)}",
            )

    async def lease_rollout(self, step: leases.LeaseStep | None) -> None:
        """Carry out the lease step of a Surge rollout's other generation (leases.lease_steps); None: no rollout,
        nothing held for it here (a set left leased after a rollout is released by the plan: Plan.release_slot)."""
        if step is None:
            self.rollout_ports, self.rollout_blocks, self.rollout_pool_message = None, None, ""
            return
        fresh = time.monotonic() - self.rollout_checked_at < self._lease_recheck_seconds()
        if not step.leasing:
            if self.rollout_ports is None or not fresh:
                held, self.leased_slots = await self.rt.leaser.held(self.ref, step.slot)
                self.rollout_ports = status_ports(held)
                self.rollout_blocks, self.rollout_checked_at = None, time.monotonic()
            return
        if self.rollout_ports is not None and step.blocks == self.rollout_blocks and fresh:
            return
        outcome = await self.rt.leaser.ensure(self.ref, step.blocks, before_release=self._unlist_rollout_ports,
                                              slot=step.slot, hoard_nothing=step.hoard_nothing)
        self.rollout_checked_at, self.leased_slots = time.monotonic(), outcome.slots
        if outcome.exhausted:
            self.rollout_ports, self.rollout_blocks, self.rollout_pool_message = None, None, outcome.message
            return
        self.rollout_ports, self.rollout_blocks, self.rollout_pool_message = (
            status_ports(outcome.assignments), step.blocks, "")
        if outcome.claimed or outcome.released:
            self.emit("Normal", "PortsLeased",
                      f"generation {step.generation}: {len(outcome.assignments)} ports leased in port set {step.slot} "
                      f"({outcome.claimed} claimed); decode side channel "
                      f"{ports_of(self.rollout_ports, ROLE_DECODE, PURPOSE_SIDECHANNEL)}")

    async def _unlist_rollout_ports(self, ports: set[int]) -> None:
        """Drop ports from status.rollout.ports before their leases go (as _unlist_ports for status.ports)."""
        current = self.status.get("rollout") or {}
        listed = current.get("ports") or []
        kept = [p for p in listed if int(p.get("port", -1)) not in ports]
        if len(kept) != len(listed):
            await self._patch_status({"rollout": {**current, "ports": kept}})
        self.rollout_ports = None

    async def _unlist_ports(self, ports: set[int]) -> None:
        """Drop ports from status.ports before their leases go, so no two pairs ever list one port."""
        listed = self.status.get("ports") or []
        kept = [p for p in listed if int(p.get("port", -1)) not in ports]
        if len(kept) != len(listed):
            await self._patch_status({"ports": kept})
        self.ports = None

    async def quarantine_busy(self, prelude: planner.Prelude) -> None:
        """Carry out busy_ports.quarantines for the busy-port reports: each held pool port becomes a quarantine Lease
        on its node and is re-leased (lease_serving again), a PortInUse Event says so; a fixed port is reported once.
        Idempotent: a port already out of the pair's hands is not in the plan, so a restarted operator only goes on
        to the restart."""
        for report in prelude.busy:
            if self.ports is None:
                return
            (todo,) = busy_ports.quarantines([report], self.ports, prelude.serving.blocks, self.rt.leaser.pool)
            for port in todo.fixed:
                if (report.pod, port) not in self.unreplaceable_reported:
                    self.unreplaceable_reported.add((report.pod, port))
                    self.emit("Warning", "PortInUse",
                              f"{report.describe()}: port {port} is not the operator's to change (spec.router.port or "
                              f"outside the pool); free it on node {report.node} or change the spec")
            if not todo.ports:
                continue
            before = list(self.ports)
            ttl = self.rt.config.busy_port_quarantine
            await self._unlist_ports(set(todo.ports))  # status stops listing them before they change hands
            quarantined = [p for p in todo.ports
                           if await self.rt.leaser.quarantine(self.ref, p, report.node, ttl, report.describe())]
            self.leases_checked_at, self.blocks = 0.0, None  # re-read the leases now and claim what is missing
            await self.lease_serving(prelude.serving)
            moved = sorted({(p["role"], p["purpose"]) for p in before if int(p["port"]) in quarantined})
            replacement = ", ".join(
                f"{role} {purpose} {ports_of(self.ports, role, purpose) if self.ports else 'pending (pool exhausted)'}"
                for role, purpose in moved)
            self.emit("Warning", "PortInUse",
                      f"{report.describe()}: quarantined for {ttl}s (no pair is leased them), replacement {replacement}; "
                      f"restarting the pair decode-first on the new ports")
            self.log.warning("pair %s/%s: %s; quarantined %s, replacement %s", self.ref.namespace, self.ref.name,
                             report.describe(), quarantined, replacement)

    async def fence_lost(self, prelude: planner.Prelude) -> None:
        """Carry out leases.fences for the pods on lost nodes: each held pool port such a pod declares becomes a
        fence Lease held until that pod is gone (status stops listing it first), the pair is leased replacements,
        and a NodeLost Event says so. Idempotent: a port already fenced is no longer held, so it is not planned
        again (a restarted operator goes on to the restart)."""
        held = list(self.ports or []) + list(self.rollout_ports or [])
        todo = leases.fences(prelude.lost, held, self.rt.leaser.pool)
        if not todo:
            return
        serving = {int(p["port"]) for p in self.ports or []}
        rolling = {int(p["port"]) for p in self.rollout_ports or []}
        for fence in todo:
            ports = set(fence.ports)
            if ports & serving:
                await self._unlist_ports(ports & serving)  # status stops listing them before they change hands
            if ports & rolling:
                await self._unlist_rollout_ports(ports & rolling)
            fenced = [p for p in fence.ports
                      if await self.rt.leaser.fence(self.ref, p, fence.pod.node, fence.pod_ref, fence.why)]
            self.emit("Warning", "NodeLost",
                      f"{fence.why}: {fence.pod.role} pod {fence.pod.name} may still run there; its ports {fenced} "
                      f"are fenced to it until it is gone (no pair is leased them), replacements leased")
            self.log.warning("pair %s/%s: %s; %s pod %s: ports %s fenced", self.ref.namespace, self.ref.name,
                             fence.why, fence.pod.role, fence.pod.name, fenced)
        self.leases_checked_at, self.blocks = 0.0, None  # re-read the leases now and claim what is missing
        await self.lease_serving(prelude.serving)
        if prelude.rollout is not None:
            self.rollout_checked_at, self.rollout_blocks = 0.0, None
            await self.lease_rollout(prelude.rollout)

"""The executor's part for the peer push (docs/xpyd.md sections 3, 5, 6): pushes.py plans each pod's set (from
instances.py's), push.py builds and sends the bodies, and this sends each running prefill and router the set it was not told yet,
records a router's answer while an instance drains (`RouterDrainView`, what the planner reads to delete a drained
instance), and says when a failed push is tried again (`pass_timing.push_retry_delay`). `PeerSets` is a part of
`reconciler.PairReconciler` (its state lives there) and decides nothing."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Iterable

from pdpair.contract import (
    ANNOTATION_PEERS_DIGEST,
    PEERS_PATH,
    PURPOSE_HTTP,
    ROLE_DECODE,
    ROLE_PREFILL,
    ROLE_ROUTER,
)
from pdpair.contract.prefill_peers import prefill_body
from pdpair.contract.router_peers import router_body
from pdpair.operator.act import push
from pdpair.operator.decide import instances, pushes, surge
from pdpair.operator.decide.port_blocks import port_of
from pdpair.operator.model.config import ENV_PEERS_KEY
from pdpair.operator.model.observed import PodView, RouterDrainView, url_host


@dataclass(frozen=True)
class PushFailure:
    """A pod's push that has failed `count` times in a row; `answered`: the last failure was the pod's HTTP refusal
    (401, 404), not a timeout or a reset (pass_timing.push_retry_delay)."""

    cause: str  # the last failure, as logged (each new cause is logged once)
    count: int
    answered: bool


def engine_urls(pods: Iterable[PodView], ports: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """pod name -> (role, the engine URL the router is pushed for it: pushes.engine_url), for the engine pods with an
    address and an HTTP port in `ports`: how a router's answer (by URL) is read back as pods."""
    out = {}
    for p in pods:
        url = pushes.engine_url(p, ports) if p.role in instances.ENGINE_ROLES and p.ip else None
        if url is not None:
            out[p.name] = (p.role, url)
    return out


class PeerSets:
    """Mixed into PairReconciler: push_sets, read_routers and what they share."""

    def _ports_of_generation(self, generation: int) -> list[dict[str, Any]] | None:
        active = surge.active_rollout(self.status)
        if active and int(active.get("toGeneration") or 0) == generation and self.rollout_ports is not None:
            return self.rollout_ports
        return self.ports

    async def push_sets(self, pods: tuple[PodView, ...]) -> set[str]:
        """Send each running prefill and router of the pair the set pushes.py plans for it (the decodes a prefill
        pairs with, the instances a router sends to) unless this executor already sent that very set and the pod's
        annotation does not show it yet. A failed push is retried on the next pass (it is level-triggered), which
        comes back by pass_timing.push_retry_delay. A router's answer is recorded (`_record_router`) while an
        instance of its generation drains. Returns the uids of the routers whose answer was recorded."""
        answered: set[str] = set()
        live = {p.uid for p in pods if p.running}
        self.pushed = {uid: digest for uid, digest in self.pushed.items() if uid in live}
        generations = {p.generation for p in pods}
        tp = int((self.body["spec"].get(ROLE_DECODE) or {}).get("tensorParallelSize") or 1)
        due = [item for item in pushes.pushes(pods, {g: self._ports_of_generation(g) for g in generations}, tp)
               if item.digest != self.pushed.get(item.pod.uid)]
        # a pod with nothing (more) to send has no failing push
        self.push_failures = {uid: f for uid, f in self.push_failures.items() if uid in {i.pod.uid for i in due}}
        sends = []
        for item in due:
            pod, epoch = item.pod, int(time.time() * 1000)
            if pod.role == ROLE_PREFILL:
                body = prefill_body(epoch, pod.generation, item.decodes)
            else:
                body = router_body(epoch, pod.generation, list(item.members))
            sends.append((pod, f"http://{url_host(pod.ip or '')}:{item.port}{PEERS_PATH}", body, item.digest))
        if not sends:
            return answered
        token = await self._peers_token()
        timeout = self.rt.config.probe_timeout

        async def send(pod: PodView, url: str, body: dict[str, Any], digest: str) -> None:
            result = await push.push(self.rt.http(), url, token, body, timeout)
            if not result.ok:
                cause = f"{result.status} {result.error}"
                last = self.push_failures.get(pod.uid)
                self.push_failures[pod.uid] = PushFailure(cause, (last.count if last else 0) + 1,
                                                          answered=result.status is not None)
                if last is None or last.cause != cause:  # logged once per cause
                    if result.status == 401:
                        self.emit("Warning", "PeersPushRefused", f"{pod.role} {pod.name} refused the operator's "
                                  f"token: it took another operator key's token ({ENV_PEERS_KEY} changed, or unset "
                                  "across an operator restart); it takes the current one when it is re-created")
                    self.log.info("pair %s/%s: push to %s %s not taken yet (%s); retrying", self.ref.namespace,
                                  self.ref.name, pod.role, pod.name, cause)
                return
            self.push_failures.pop(pod.uid, None)
            self.pushed[pod.uid] = digest
            if pod.role == ROLE_ROUTER and self._record_router(pod, pods, result.answer, time.time()):
                answered.add(pod.uid)
            await self._patch_pod_annotations(pod.name, {ANNOTATION_PEERS_DIGEST: digest})
            self.emit("Normal", "PeersPushed", f"{pod.role} {pod.name}: told its current set ({digest})")

        await asyncio.gather(*(send(*item) for item in sends))
        return answered

    def _record_router(self, router: PodView, pods: tuple[PodView, ...], answer: Any, read_at: float) -> bool:
        """Record the answer of `router` (its generation's RouterDrainView) when an instance of that generation
        drains; an answer the view cannot read (malformed, or a router without `involved`) drops the view, so the
        planner falls back to the deadline. True when recorded."""
        if router.generation not in pushes.draining_generations(pods):
            return False
        ports = self._ports_of_generation(router.generation) or []
        urls = engine_urls((p for p in pods if p.generation == router.generation and p.draining_since is not None),
                            ports)
        view = RouterDrainView.from_answer(router.generation, answer, read_at, urls)
        if view is None:
            self.router_answers.pop(router.uid, None)
            self._merge_router_views(router.generation, pods)
            self._router_read_failed(router, "its peers answer has no per-instance 'involved' counts (a router "
                                             "image from before them?)")
            return False
        self.router_answers[router.uid] = view
        self._merge_router_views(router.generation, pods)
        self.router_read_failures.pop(router.uid, None)
        return True

    def _merge_router_views(self, generation: int, pods: tuple[PodView, ...]) -> None:
        """The generation's view for the planner: every running router replica's answer merged
        (RouterDrainView.merged), or none until each has answered (a replica not read could still send to a
        draining instance)."""
        uids = [p.uid for p in pods if p.role == ROLE_ROUTER and p.generation == generation and p.running
                and not p.deleting]
        views = [self.router_answers.get(uid) for uid in uids]
        if uids and all(v is not None for v in views):
            self.router_views[generation] = RouterDrainView.merged([v for v in views if v is not None])
        else:
            self.router_views.pop(generation, None)

    def _router_read_failed(self, router: PodView, cause: str) -> None:
        if self.router_read_failures.get(router.uid) != cause:  # logged once per cause
            self.router_read_failures[router.uid] = cause
            self.log.info("pair %s/%s: router %s's counts not read (%s): a draining instance waits for "
                          "spec.rollout.drainSeconds", self.ref.namespace, self.ref.name, router.name, cause)

    async def read_routers(self, pods: tuple[PodView, ...], answered: "set[str] | frozenset[str]" = frozenset()) -> None:
        """While an instance of a generation drains, read each of its running routers' current answer (`GET
        /pdpair/v1/peers`, the push's token and timeout) unless this pass's push just recorded one (`answered`),
        for the next pass's plan. A read that fails drops the view (the deadline decides), is logged once per
        cause, and is tried again next pass; views of generations where nothing drains are dropped."""
        draining = pushes.draining_generations(pods)
        self.router_views = {g: v for g, v in self.router_views.items() if g in draining}
        routers = {p.uid for p in pods if p.role == ROLE_ROUTER and p.running and not p.deleting}
        self.router_read_failures = {u: c for u, c in self.router_read_failures.items() if u in routers}
        self.router_answers = {u: v for u, v in self.router_answers.items()
                               if u in routers and v.generation in draining}
        reads = []
        for pod in pods:
            if pod.role != ROLE_ROUTER or not pod.running or pod.deleting or pod.generation not in draining or \
                    pod.uid in answered:
                continue
            port = port_of(self._ports_of_generation(pod.generation) or [], ROLE_ROUTER, PURPOSE_HTTP,
                           instance=pod.instance)
            if port is None or not pod.ip:
                continue
            reads.append((pod, f"http://{url_host(pod.ip)}:{port}{PEERS_PATH}"))
        if not reads:
            return
        token = await self._peers_token()

        async def read(pod: PodView, url: str) -> None:
            result = await push.read_peers(self.rt.http(), url, token, self.rt.config.probe_timeout)
            if not result.ok:
                self.router_answers.pop(pod.uid, None)
                self._merge_router_views(pod.generation, pods)
                self._router_read_failed(pod, f"{result.status} {result.error}")
                return
            self._record_router(pod, pods, result.answer, time.time())

        await asyncio.gather(*(read(*item) for item in reads))

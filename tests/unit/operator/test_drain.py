"""A scale-down's drain ends when the router of the instance's generation says it is done (operator/instances.py
`router_drained`, on the executor's observed.RouterDrainView), or at spec.rollout.drainSeconds at the latest.

The decision (pure, SimWorld of sim.py) and the executor's side (reconciler.push_sets / read_routers against the real
router app with stand-in engines: the PUT answer of the push that takes the mark, a GET while the drain runs, a
router that cannot be read).

Cost: about 1-2 s in all (pure, plus one router app and three stand-in engines on 127.0.0.1; no cluster, no engine,
no timing: a request is held in flight by an event the test sets)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import aiohttp
import pytest

from pdpair.operator.decide import recreate as d
from pdpair.operator.decide import instances
from pdpair.operator.model.pair_spec import PairSpec
from pdpair.operator.model.config import OperatorConfig, PortPool
from pdpair.operator.model.observed import PodView, RouterDrainView
from pdpair.operator.decide.planner import next_step
from pdpair.operator.act.push import pair_token
from pdpair.operator.act.reconciler import PairReconciler, Runtime
from pdpair.router.app import ROUTE_HEADER, make_app
from pdpair.router.config import RouterConfig
from tests.router_support import engine_server, serve
from tests.property_counts import cases
from tests.unit.operator.sim import SimWorld, simulate_until_ready
from tests.unit.router.test_router_push import GatedEngine, wait_for

DRAIN = 30


def spec(prefill: int = 1, decode: int = 1, router: bool = True) -> dict:
    """One router replica: the drain's evidence from several replicas is test_a_drain_waits_for_every_router_replica."""
    return {"model": "m", "image": "img:1", "router": {"enabled": router, "replicas": 1},
            "rollout": {"drainSeconds": DRAIN},
            "prefill": {"replicas": prefill}, "decode": {"replicas": decode}}


def view(world: SimWorld, read_at: float | None = None, generation: int = 1, answered: int | None = 1,
         choosable=(), involved=None) -> RouterDrainView:
    return RouterDrainView(generation, answered, world.now if read_at is None else read_at, frozenset(choosable),
                           dict(involved or {}))


def scaled_down(prefill: int = 1, decode: int = 2, to=(1, 1), router: bool = True) -> SimWorld:
    """A Ready pair scaled down to `to`, every surplus instance marked draining at world.now."""
    world = SimWorld(spec(prefill, decode, router))
    simulate_until_ready(world)
    world.spec = spec(*to, router=router)
    for _ in range(6):
        plan = next_step(world.spec, world.status, world.observe())
        if not plan.mark_draining:
            break
        world.apply(plan)
    return world


def plan_with(world: SimWorld, router_view: RouterDrainView | None) -> d.Plan:
    observed = world.observe()
    if router_view is not None:
        observed = dataclasses.replace(observed, router_views={router_view.generation: router_view})
    return next_step(world.spec, world.status, observed, world.now)


def test_an_acknowledged_idle_instance_is_deleted_at_once_and_the_message_says_so():
    """Cost: ~0.1 s, pure."""
    world = scaled_down()
    world.now += 0.5
    plan = plan_with(world, view(world, choosable={"p-decode-1"}))
    assert plan.delete == ("p-decode-1-1",) and "no request in flight involving it" in plan.message, plan.message


def test_a_mark_not_yet_taken_or_requests_in_flight_wait_and_the_next_pass_comes_within_a_second():
    """Cost: ~0.1 s, pure."""
    world = scaled_down()
    world.now += 0.5
    for router_view in (
        view(world, choosable={"p-decode-1-1", "p-decode-1"}),  # the push carrying the mark not taken yet
        view(world, read_at=world.now - 1),  # read before the mark
        view(world, involved={"p-decode-1-1": 2}),  # requests still involve it
        None,  # nothing read yet
    ):
        plan = plan_with(world, router_view)
        assert not plan.delete, router_view
        assert plan.wait_seconds is not None and plan.wait_seconds <= instances.DRAIN_POLL_SECONDS, router_view


def test_another_generations_answer_is_ignored():
    """Cost: ~0.1 s, pure."""
    world = scaled_down()
    world.now += 0.5
    assert not plan_with(world, view(world, generation=1, answered=2)).delete  # the router was pushed another set
    assert not plan_with(world, view(world, answered=None)).delete  # nothing pushed: the flags' set
    other = dataclasses.replace(view(world), generation=7)  # another generation's router
    observed = dataclasses.replace(world.observe(), router_views={7: other})
    assert not next_step(world.spec, world.status, observed, world.now).delete


def test_the_deadline_deletes_regardless_and_says_so():
    """Cost: ~0.1 s, pure."""
    world = scaled_down()
    world.now += DRAIN
    plan = plan_with(world, view(world, choosable={"p-decode-1-1"}, involved={"p-decode-1-1": 3}))
    assert plan.delete == ("p-decode-1-1",)
    assert "drain deadline" in plan.message and "3 request(s) still involving it" in plan.message, plan.message
    assert plan_with(world, None).delete == ("p-decode-1-1",)


def test_without_a_router_the_deadline_is_the_only_end_and_no_poll():
    """Cost: ~0.1 s, pure."""
    world = scaled_down(router=False)
    assert not any(p.role == "router" for p in world.pods.values())
    world.now += DRAIN - 5
    plan = plan_with(world, None)
    assert not plan.delete and plan.wait_seconds == pytest.approx(5)
    world.now += 5
    assert plan_with(world, None).delete == ("p-decode-1-1",)


def test_prefills_still_leave_before_decodes():
    """A decode the router says is drained waits while a prefill of the scale-down still drains; the prefill goes
    first as soon as it is drained too. Cost: ~0.1 s, pure."""
    world = scaled_down(prefill=2, decode=2)
    assert {n for n, p in world.pods.items() if p.draining_since is not None} == {"p-prefill-1-1", "p-decode-1-1"}
    world.now += 0.5
    busy_prefill = view(world, involved={"p-prefill-1-1": 1})
    plan = plan_with(world, busy_prefill)
    assert not plan.delete and plan.wait_seconds <= instances.DRAIN_POLL_SECONDS
    plan = plan_with(world, view(world))
    assert plan.delete == ("p-prefill-1-1",)
    world.apply(plan)
    assert plan_with(world, view(world)).delete == ("p-decode-1-1",)


def test_random_drains_never_delete_an_instance_the_router_still_involves():
    """Random views (50 scale-downs in CI, 200 with PDPAIR_FULL_PROPERTY_TESTS=1): a draining instance is deleted
    only at its deadline or when the view says it is drained (its generation, read after the mark, not choosable, 0
    involving it). Cost: ~0.3 s in CI, ~1 s full, pure."""
    import random

    rng = random.Random(4242)
    for _ in range(cases(ci=50, full=200)):
        world = scaled_down(prefill=rng.randint(1, 3), decode=rng.randint(2, 3), to=(1, 1))
        for _ in range(8):
            world.now += rng.choice((0.3, 1, 5))
            draining = [n for n, p in world.pods.items() if p.draining_since is not None]
            router_view = view(world, read_at=world.now - rng.choice((0, 0, 10)), answered=rng.choice((1, 1, 2)),
                               choosable={n for n in draining if rng.random() < 0.2},
                               involved={n: 1 for n in draining if rng.random() < 0.3})
            plan = plan_with(world, router_view)
            for name in plan.delete:
                pod = world.pods[name]
                assert world.now - pod.draining_since >= DRAIN or instances.router_drained(pod, router_view), plan
                assert pod.role == "prefill" or not any(
                    p.role == "prefill" and p.draining_since is not None for p in world.pods.values()), plan
            world.apply(plan)


# --- the executor: what the router answered reaches the next plan --------------------------------------------
UID = "uid-drain"


class Core:
    """Pod patches, Secret creates and Events: accepted and forgotten (the test hands the reconciler its pods). A
    call asking for the raw reply (`_preload_content=False`, api.call_dropped) gets an empty one, as the client's."""

    def __getattr__(self, name):
        return lambda *args, _preload_content=True, **kwargs: None if _preload_content else EmptyReply()


class EmptyReply:
    def read(self) -> bytes:
        return b"{}"

    def release_conn(self) -> None:
        pass


def pod(name: str, role: str, instance: int = 0, **kw) -> PodView:
    return PodView(name, role, 1, phase="Running", ready=True, ip="127.0.0.1", scheduled=True, uid=f"uid-{name}",
                   instance=instance, **{"peers_digest": "stale", **kw})


@pytest.mark.asyncio
async def test_the_executor_records_the_push_answer_then_reads_the_router_until_the_drain_ends():
    """A 1P2D generation drains decode 1 while a request is in flight to it: the push that takes the mark answers
    'leaving, 1 involved' (the plan waits); after the request ends a GET says 0 (the plan deletes it); a router that
    cannot be read drops the view (the deadline decides) and is logged once. Cost: ~1 s: the real router app and
    stand-in engines on 127.0.0.1, no cluster, no timing (a gated request)."""
    config = OperatorConfig(namespace="ops", port_pool=PortPool(20000, 20099), peers_key="k" * 32)
    token = pair_token(config.peers_key, UID)
    p0, d0, d1 = GatedEngine("prefill-0"), GatedEngine("decode-0"), GatedEngine("decode-1")
    runners, urls = [], {}
    for engine in (p0, d0, d1):
        runner, urls[engine] = await engine_server(engine)
        runners.append(runner)
    router_runner, router_url = await serve(make_app(RouterConfig(
        (urls[p0],), (urls[d0], urls[d1]), peers_token=token, debug_routing=True)))
    runners.append(router_runner)

    def port(url: str) -> int:
        return int(url.rsplit(":", 1)[1])

    ports = [{"role": "prefill", "purpose": "http", "port": port(urls[p0])},
             {"role": "prefill", "purpose": "metrics", "port": port(urls[p0])},
             {"role": "decode", "purpose": "http", "port": port(urls[d0])},
             {"role": "decode", "purpose": "metrics", "port": port(urls[d0])},
             {"role": "decode", "purpose": "http", "port": port(urls[d1]), "instance": 1},
             {"role": "decode", "purpose": "metrics", "port": port(urls[d1]), "instance": 1},
             {"role": "router", "purpose": "http", "port": port(router_url)}]
    records: list[logging.LogRecord] = []
    logger = logging.getLogger("test_drain.executor")
    logger.addHandler(type("H", (logging.Handler,), {"emit": lambda self, r: records.append(r)})())
    logger.setLevel(logging.INFO)
    body = {"metadata": {"name": "p", "namespace": "ns", "uid": UID, "generation": 1, "resourceVersion": "1"},
            "spec": spec(1, 1), "status": {"pairGeneration": 1, "phase": "Ready"}}
    rec = PairReconciler(Runtime(config=config, core=Core(), custom=None, leaser=None), body,
                         emit=lambda *event: None, logger=logger)
    rec.ports = ports
    marked = pod("p-decode-1-1", "decode", 1, draining_since=time.time() - 0.5)  # the executor's clock, as marked
    # the prefill is never pushed here (no digest: it has no side-channel ports in this test); the router is
    pods = (pod("p-prefill-1", "prefill", peers_digest=None), pod("p-decode-1", "decode"), marked,
            pod("p-router-1", "router"))

    def decide(now: float) -> instances.InstanceStep | None:
        return instances.instance_step(PairSpec(body["spec"]), pods, 1, now, router=rec.router_views.get(1))

    try:
        async with aiohttp.ClientSession() as client:
            d1.gate = asyncio.Event()
            slow = asyncio.create_task(client.post(router_url + "/v1/completions", json={"prompt": "x"},
                                                   headers={ROUTE_HEADER: "0,1"}))
            await wait_for("the request reached decode 1", lambda: d1.waiting == 1)
            answered = await rec.push_sets(pods)  # the router's set without decode 1: its answer is recorded
            assert answered == {"uid-p-router-1"}
            recorded = rec.router_views[1]
            assert recorded.involved == {"p-decode-1-1": 1} and "p-decode-1-1" not in recorded.choosable
            assert recorded.answered_generation == 1 and recorded.choosable == frozenset()  # only draining pods kept
            step = decide(recorded.read_at)
            assert step.kind == instances.WAIT_DRAIN and step.wait_seconds <= instances.DRAIN_POLL_SECONDS

            d1.gate.set()
            async with await slow as resp:
                assert resp.status == 200
            await rec.read_routers(pods)  # a GET: nothing involves decode 1 now
            assert rec.router_views[1].involved == {}
            step = decide(rec.router_views[1].read_at)
            assert step.kind == instances.DELETE and step.pod == "p-decode-1-1" and "no request" in step.message
            assert d1.arrived == 1  # nothing new was sent to it

        await router_runner.cleanup()  # the router goes away: its reads fail, the deadline decides, logged once
        for _ in range(3):
            await rec.read_routers(pods)
        assert 1 not in rec.router_views
        assert sum("counts not read" in r.getMessage() for r in records) == 1
        since = marked.draining_since
        assert decide(since + DRAIN - 1).kind == instances.WAIT_DRAIN and decide(since + DRAIN).kind == instances.DELETE
        await rec.read_routers((pods[0], pods[1], dataclasses.replace(marked, deleting=True), pods[3]))
        assert rec.router_views == {}  # nothing drains: no read, no view
    finally:
        if d1.gate is not None:
            d1.gate.set()  # a failed assertion above must not leave the request hanging
        for runner in reversed(runners):
            await runner.cleanup()


def test_a_drain_waits_for_every_router_replica():
    """Two router replicas: the generation's view is their answers merged (RouterDrainView.merged, as the executor
    builds it once every running replica answered). One replica idle and past the mark is not enough while the other
    still may choose the draining decode or has a request in flight involving it; both done: deleted at once."""
    world = scaled_down()
    name = next(p.name for p in world.pods.values() if p.draining_since is not None)
    done = view(world)
    for other in (view(world, choosable=[name]), view(world, involved={name: 1}),
                  view(world, read_at=world.now - 1), view(world, answered=None)):
        merged = RouterDrainView.merged([done, other])
        assert plan_with(world, merged).delete == (), other
    merged = RouterDrainView.merged([done, view(world)])
    assert plan_with(world, merged).delete == (name,)
    assert RouterDrainView.merged([view(world, involved={name: 2}), view(world, involved={name: 3, "x": 1})]
                                  ).involved == {name: 5, "x": 1}

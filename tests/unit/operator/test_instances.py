"""xPyD in the planner (operator/instances.py through recreate.recreate_state): a pair with several instances per
role starts, scales up and down, and tells each pod the right set, in the simulated world of sim.py.

Cost: about 2 s (pure; no cluster, no engine)."""

from __future__ import annotations

import dataclasses
import random

from pdpair.operator.decide import recreate as d
from pdpair.operator.decide import instances
from pdpair.operator.model.pair_spec import spec_fingerprint
from pdpair.operator.model.observed import PodView
from pdpair.operator.decide.planner import next_step
from pdpair.operator.decide.pushes import first_router_members
from tests.property_counts import cases
from tests.unit.operator.sim import SimWorld, simulate_until_ready

DRAIN = 30


def spec(prefill: int = 1, decode: int = 1, routers: int = 1) -> dict:
    """`routers`: spec.router.replicas (1 unless a test is about replicas: the plans below name one router)."""
    return {"model": "m", "image": "img:1", "router": {"enabled": True, "replicas": routers},
            "rollout": {"drainSeconds": DRAIN},
            "prefill": {"replicas": prefill}, "decode": {"replicas": decode}}


def live(world: SimWorld, role: str) -> list[PodView]:
    return sorted((p for p in world.pods.values() if p.role == role), key=lambda p: p.instance)


def test_replicas_are_not_a_pod_field():
    """Scaling must leave every pod alone, and a pair stored before the field existed keeps its fingerprint."""
    base = {"model": "m", "image": "img:1", "prefill": {"tensorParallelSize": 1}, "decode": {}}
    scaled = {**base, "prefill": {"tensorParallelSize": 1, "replicas": 3}, "decode": {"replicas": 2}}
    assert spec_fingerprint(scaled) == spec_fingerprint(base)
    assert spec_fingerprint({**base, "prefill": {"tensorParallelSize": 2}}) != spec_fingerprint(base)


def test_a_2p3d_pair_starts_every_instance_and_each_prefill_after_a_decode_runs():
    world = SimWorld(spec(prefill=2, decode=3))
    plans = simulate_until_ready(world)
    assert plans[-1].step == d.STEP_READY
    assert [p.instance for p in live(world, "decode")] == [0, 1, 2]
    assert [p.instance for p in live(world, "prefill")] == [0, 1]
    assert len(live(world, "router")) == 1
    creates = [line for line in world.log if line.startswith("create")]
    assert creates[0] == "create p-decode-1"  # decode instance 0 first, as a 1P1D pair
    first_prefill = creates.index("create p-prefill-1")
    assert all("decode" in c for c in creates[:first_prefill])
    assert plans[-1].role_status["prefill"]["readyOfDesired"] == "2/2"
    assert plans[-1].role_status["decode"]["readyOfDesired"] == "3/3"
    assert [i["pod"] for i in plans[-1].role_status["decode"]["instances"]] == ["p-decode-1", "p-decode-1-1",
                                                                              "p-decode-1-2"]


def test_a_1p1d_pair_plans_exactly_what_it_always_did():
    """replicas 1 on both roles never reaches instances.py: the same plans as a spec without the field."""
    with_field = SimWorld(spec())
    without = SimWorld({"model": "m", "image": "img:1", "router": {"enabled": True, "replicas": 1}})
    a = [(p.step, p.create, p.delete) for p in simulate_until_ready(with_field)]
    b = [(p.step, p.create, p.delete) for p in simulate_until_ready(without)]
    assert a == b
    assert all(p.step != d.STEP_INSTANCES for p in simulate_until_ready(SimWorld(spec())))


def test_scale_up_of_a_ready_pair_adds_instances_and_stays_ready():
    world = SimWorld(spec())
    simulate_until_ready(world)
    before = {p.name: p for p in world.pods.values()}
    world.spec = spec(prefill=2, decode=2)
    phases, creates = [], []
    for _ in range(10):
        plan = next_step(world.spec, world.status, world.observe())
        phases.append(plan.phase)
        if plan.step == d.STEP_READY:
            break
        assert plan.step == d.STEP_INSTANCES and not plan.delete
        creates.append((plan.create, plan.create_instance))
        world.apply(plan)
    assert set(phases) == {"Ready"}  # a scale-up never takes the pair out of Ready
    assert creates == [("decode", 1), ("prefill", 1)]
    for name, pod in before.items():
        assert world.pods[name] is pod  # no existing pod touched
    assert plan.pair_generation == 1


def test_scale_down_drains_first_then_deletes_prefill_before_decode_and_never_instance_0():
    world = SimWorld(spec(prefill=3, decode=2))
    simulate_until_ready(world)
    world.spec = spec(prefill=1, decode=1)
    # 1. every surplus instance is marked draining, one per pass, while the pair stays Ready
    marked = []
    for _ in range(5):
        plan = next_step(world.spec, world.status, world.observe())
        if not plan.mark_draining:
            break
        assert plan.phase == "Ready" and not plan.delete
        marked += plan.mark_draining
        world.apply(plan)
    assert sorted(marked) == ["p-decode-1-1", "p-prefill-1-1", "p-prefill-1-2"]
    # 2. the drain time is waited out: nothing is deleted before it, and the plan asks to pass again by then
    world.now += DRAIN - 5
    plan = next_step(world.spec, world.status, world.observe())
    assert not plan.delete and plan.wait_seconds is not None and 0 < plan.wait_seconds <= 5
    # 3. after it, prefills go before the decode
    world.now += 5
    deleted = []
    for _ in range(10):
        plan = next_step(world.spec, world.status, world.observe())
        if plan.step == d.STEP_READY:
            break
        deleted += plan.delete
        world.apply(plan)
    assert deleted[-1] == "p-decode-1-1" and set(deleted[:-1]) == {"p-prefill-1-1", "p-prefill-1-2"}
    assert sorted(world.pods) == ["p-decode-1", "p-prefill-1", "p-router-1"]


def test_a_draining_decode_leaves_the_router_at_once_and_the_prefills_when_it_stops():
    """A draining decode is out of the router's set (no new request) but stays in the prefills' sets while it runs:
    a request routed to it just before the mark still needs its KV (the real nodes showed a 500 otherwise). Another
    generation's decode is never in either."""
    pods = [PodView("d0", "decode", 2, ip="10.0.0.1", phase="Running", ready=True),
            PodView("d1", "decode", 2, ip="10.0.0.2", phase="Running", ready=True, instance=1, draining_since=5.0),
            PodView("d2", "decode", 2, ip="10.0.0.3", phase="Running", ready=False, instance=2),
            PodView("old", "decode", 1, ip="10.0.0.9", phase="Running", ready=True),
            PodView("p0", "prefill", 2, ip="10.0.0.4", phase="Running", ready=True),
            PodView("p1", "prefill", 2, ip="10.0.0.5", phase="Pending", ready=False, instance=1)]
    assert [p.name for p in instances.prefill_peers(pods, 2)] == ["d0", "d1", "d2"]  # running, its own generation
    assert [p.name for p in instances.router_members(pods, 2)] == ["d0", "p0"]  # Ready only
    assert instances.peers_digest(["a", "b"]) == instances.peers_digest(["b", "a"])


def test_a_deleted_decode_instance_is_recreated_without_a_restart():
    world = SimWorld(spec(prefill=1, decode=2))
    simulate_until_ready(world)
    world.pods.pop("p-decode-1-1")  # someone deleted it; it is gone
    plan = next_step(world.spec, world.status, world.observe())
    assert (plan.step, plan.create, plan.create_instance, plan.phase) == (d.STEP_INSTANCES, "decode", 1, "Ready")
    assert plan.pair_generation == 1


def test_random_scaling_keeps_the_instance_invariants():
    """Random scale sequences (50 in CI, 200 with PDPAIR_FULL_PROPERTY_TESTS=1): never two pods for one (role,
    generation, instance); a prefill is only ever
    created once decode 0 of its generation exists (running or not: the push brings its address); instance 0 is never removed by a scale; no pod is deleted
    before its drain; and after the last change the pods converge on the counts."""
    rng = random.Random(849)
    for _ in range(cases(ci=50, full=200)):
        world = SimWorld(spec(rng.randint(1, 4), rng.randint(1, 4)))
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.4:
                world.spec = spec(rng.randint(1, 4), rng.randint(1, 4))
            for _ in range(rng.randint(1, 12)):
                world.now += rng.choice((0, 1, 10, DRAIN))
                observed = world.observe()
                plan = next_step(world.spec, world.status, observed)
                if plan.create == "prefill":  # beside its generation's decode 0, never before it
                    assert any(p.role == "decode" and p.instance == 0 and p.generation == plan.pair_generation
                               for p in observed.pods)
                for name in plan.delete:
                    pod = world.pods[name]
                    assert pod.instance > 0, plan
                    assert pod.draining_since is not None and world.now - pod.draining_since >= DRAIN
                world.apply(plan)
                if plan.create and rng.random() < 0.5:  # this one starts slowly: Pending, no address yet
                    name = next(n for n, p in world.pods.items() if p.role == plan.create and p.instance ==
                                plan.create_instance and p.generation == plan.pair_generation)
                    world.pods[name] = dataclasses.replace(world.pods[name], phase="Pending", ready=False, ip=None)
                for name, pod in list(world.pods.items()):
                    if pod.phase == "Pending" and rng.random() < 0.3:
                        world.pods[name] = dataclasses.replace(pod, phase="Running", ready=True, ip="127.0.0.1")
                keys = [(p.role, p.generation, p.instance) for p in world.pods.values()]
                assert len(keys) == len(set(keys))
        for _ in range(60):
            world.now += DRAIN
            for name, pod in list(world.pods.items()):
                if pod.phase == "Pending":
                    world.pods[name] = dataclasses.replace(pod, phase="Running", ready=True, ip="127.0.0.1")
            plan = next_step(world.spec, world.status, world.observe())
            if plan.step == d.STEP_READY:
                break
            world.apply(plan)
        assert plan.step == d.STEP_READY, plan
        for role in ("prefill", "decode"):
            assert [p.instance for p in live(world, role)] == list(range(world.spec[role]["replicas"]))


def fail(world: SimWorld, name: str, **kw) -> None:
    world.pods[name] = dataclasses.replace(world.pods[name], **({"phase": "Failed", "ready": False} | kw))


def replace_alone(world: SimWorld, name: str) -> list[d.Plan]:
    """Plan passes until the pair is Ready with every instance again; each pass must keep phase Ready and the
    generation, and the only pod deleted is `name`."""
    generation = world.status["pairGeneration"]
    plans = []
    for _ in range(10):
        plan = next_step(world.spec, world.status, world.observe())
        plans.append(plan)
        assert plan.phase == "Ready" and plan.pair_generation == generation, plan
        assert set(plan.delete) <= {name}, plan
        if plan.step == d.STEP_READY and name in world.pods and not world.pods[name].failed:
            return plans
        world.apply(plan)
    raise AssertionError([p.step for p in plans])


def test_a_failed_decode_instance_is_replaced_alone_while_the_pair_serves():
    """decode instance 1 fails in a serving 2P2D pair: it is deleted and re-created under the same
    name, the pair stays Ready at its generation, no other pod is touched, and an Event says why."""
    world = SimWorld(spec(prefill=2, decode=2))
    simulate_until_ready(world)
    others = {n: p for n, p in world.pods.items() if n != "p-decode-1-1"}
    fail(world, "p-decode-1-1")
    plans = replace_alone(world, "p-decode-1-1")
    assert plans[0].step == d.STEP_INSTANCES and plans[0].delete == ("p-decode-1-1",) and plans[0].heals_alone
    assert plans[0].events[0][:2] == ("Warning", "InstanceReplacing") and "p-decode-1-1" in plans[0].events[0][2]
    assert plans[0].replaced_instance == ("decode", "pod_failed")
    assert "decode 1/2" in dict((c.type, c.message) for c in plans[0].conditions)["Ready"]
    assert (plans[1].create, plans[1].create_instance) == ("decode", 1)
    assert all(world.pods[n] is p for n, p in others.items())
    assert world.instance_restarts == (1, {"decode-1": (world.now,)})


def test_instance_0_is_replaced_alone_too_once_the_pair_served():
    """Decode 0 and prefill 0 are instances like the others once the generation served: a killed one is re-created
    beside the serving ones (not recreate.py's ordered start, which would take the pair out of Ready)."""
    for role, name in (("decode", "p-decode-1"), ("prefill", "p-prefill-1")):
        world = SimWorld(spec(prefill=2, decode=2))
        simulate_until_ready(world)
        fail(world, name, restarts=1, phase="Running")  # a container that restarted counts as failed
        plans = replace_alone(world, name)
        assert (plans[1].create, plans[1].create_instance) == (role, 0)


def test_the_last_serving_instance_of_a_role_failing_restarts_the_pair_in_order():
    """1P2D: prefill 0 is the only prefill: nothing serves without it, so the pair restarts in order (a new
    generation, the whole pair, the pair's own budget), as a 1P1D pair always did."""
    world = SimWorld(spec(prefill=1, decode=2))
    simulate_until_ready(world)
    fail(world, "p-prefill-1")
    plan = next_step(world.spec, world.status, world.observe())
    assert plan.step == d.STEP_BROKEN and not plan.heals_alone


def test_a_failed_router_is_replaced_alone_and_starts_with_the_serving_instances():
    """2P2D: the router fails; the engines keep their pods. The router is deleted and re-created (its own budget,
    "router-0"), the phase stays Ready while the Ready condition says the router is being replaced, and the new
    router starts with the lowest serving instance of each role (prefill 0 is down meanwhile: it is not one)."""
    world = SimWorld(spec(prefill=2, decode=2))
    simulate_until_ready(world)
    fail(world, "p-prefill-1")
    fail(world, "p-router-1")
    plan = next_step(world.spec, world.status, world.observe())
    assert plan.delete == ("p-router-1",) and plan.heals_alone and plan.phase == "Ready"
    ready = next(c for c in plan.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "RouterReplacing")
    assert set(plan.instance_restart_times) == {"router-0"}
    world.apply(plan)
    plan = next_step(world.spec, world.status, world.observe())  # prefill 0 next, alone too
    assert plan.delete == ("p-prefill-1",) and plan.phase == "Ready" and not plan.create
    world.apply(plan)
    plan = next_step(world.spec, world.status, world.observe())  # no router runs: it comes before prefill 0
    assert (plan.create, plan.create_instance, plan.phase) == ("router", 0, "Ready")
    first = first_router_members(world.pods.values(), plan.pair_generation)
    assert (first["prefill"].name, first["decode"].name) == ("p-prefill-1-1", "p-decode-1")


def test_two_router_replicas_start_after_router_0_and_one_failing_leaves_the_pair_ready():
    """spec.router.replicas 2 in 2P2D: router 1 is created once router 0 exists; when router 0 fails, router 1
    still serves: the Ready condition stays True while router 0 is replaced alone (its own budget, "router-0")."""
    world = SimWorld(spec(prefill=2, decode=2, routers=2))
    plans = simulate_until_ready(world)
    creates = [(p.create, p.create_instance) for p in plans if p.create]
    assert creates.index(("router", 1)) > creates.index(("router", 0))
    assert {"p-router-1", "p-router-1-1"} <= set(world.pods)
    fail(world, "p-router-1")
    plans = replace_alone(world, "p-router-1")
    assert plans[0].delete == ("p-router-1",) and set(plans[0].instance_restart_times) == {"router-0"}
    for plan in plans:
        ready = next(c for c in plan.conditions if c.type == "Ready")
        assert ready.status == "True", plan
    assert ("router", 0) in [(p.create, p.create_instance) for p in plans]


def test_router_replicas_scaled_down_go_highest_first_without_a_rollout():
    world = SimWorld(spec(prefill=2, decode=2, routers=3))
    simulate_until_ready(world)
    generation = world.status["pairGeneration"]
    world.spec = spec(prefill=2, decode=2, routers=1)
    deleted = []
    for _ in range(5):
        plan = next_step(world.spec, world.status, world.observe())
        assert plan.pair_generation == generation and plan.phase == "Ready"
        deleted += plan.delete
        world.apply(plan)
    assert deleted == ["p-router-1-2", "p-router-1-1"]


def test_a_1p1d_pair_still_restarts_as_a_whole():
    world = SimWorld(spec())
    simulate_until_ready(world)
    fail(world, "p-decode-1")
    assert next_step(world.spec, world.status, world.observe()).step == d.STEP_BROKEN


def test_a_starting_generation_is_not_healed_alone():
    """Before the generation served (status not Ready at it), a failed instance restarts the pair in order: the
    parallel start's ordering is recreate.py's, not the healer's."""
    world = SimWorld(spec(prefill=2, decode=2))
    simulate_until_ready(world)
    world.status["phase"] = "PrefillStarting"
    fail(world, "p-decode-1-1")
    assert next_step(world.spec, world.status, world.observe()).step == d.STEP_BROKEN


def test_each_instance_has_its_own_restart_budget_and_backoff():
    """restartPolicy per "<role>-<index>" (1P3D): decode 1's second failure waits out its backoff (the pair stays
    Ready and says so), decode 0 is replaced at once meanwhile (decode 2 serves), and decode 1's failure past maxRestarts restarts the pair
    in order (the pair's own budget counts that one)."""
    world = SimWorld({**spec(prefill=1, decode=3), "restartPolicy": {"maxRestarts": 2, "backoffSeconds": 10,
                                                                     "maxBackoffSeconds": 40}})
    simulate_until_ready(world)
    fail(world, "p-decode-1-1")
    replace_alone(world, "p-decode-1-1")
    world.now += 1
    fail(world, "p-decode-1-1")
    plan = next_step(world.spec, world.status, world.observe())
    assert plan.step == d.STEP_READY and not plan.delete and 8.5 <= plan.wait_seconds <= 9.5 and "backoff" in plan.message
    fail(world, "p-decode-1")
    plan = next_step(world.spec, world.status, world.observe())
    assert plan.delete == ("p-decode-1",)  # another instance, another budget
    world.apply(plan)
    world.now += 10
    replace_alone(world, "p-decode-1-1")
    assert world.instance_restarts[1]["decode-1"] == (1000.0, 1011.0)
    world.now += 60
    fail(world, "p-decode-1-1")
    plan = next_step(world.spec, world.status, world.observe())
    assert plan.step == d.STEP_BROKEN  # decode 1 spent its 2 restarts in the window


def test_a_hung_finding_about_one_instance_replaces_it_alone():
    """The health watch names the hung pod (status.health.pod and its uid): planner.plan replaces that instance,
    never a pair restart; a finding about a pod since replaced (same name, another uid) touches nothing."""
    from pdpair.operator.decide import planner
    from pdpair.operator.model.observed import Finding

    world = SimWorld(spec(prefill=2, decode=2))
    simulate_until_ready(world)
    world.pods["p-decode-1-1"] = dataclasses.replace(world.pods["p-decode-1-1"], uid="u-new")
    hung = Finding("hung", "decode p-decode-1-1 waits for 3 signals from 10.0.0.1:1 for 91 s", 1,
                   pod="p-decode-1-1", pod_uid="u-old")
    decided = planner.plan(world.spec, world.status, dataclasses.replace(world.observe(), health=hung), world.now)
    assert decided.restart is None and decided.steps.step == d.STEP_READY and not decided.steps.delete
    hung = dataclasses.replace(hung, pod_uid="u-new")
    decided = planner.plan(world.spec, world.status, dataclasses.replace(world.observe(), health=hung), world.now)
    assert decided.restart is None and decided.steps.delete == ("p-decode-1-1",)
    assert decided.steps.replaced_instance == ("decode", "hung")
    assert "waits for 3 signals" in decided.steps.message
    # The same finding in a 1P1D pair is the ordered restart it always was.
    world = SimWorld(spec())
    simulate_until_ready(world)
    hung = Finding("hung", "decode hung", 1, pod="p-decode-1")
    assert planner.plan(world.spec, world.status, dataclasses.replace(world.observe(), health=hung),
                        world.now).restart == hung


def test_a_watch_finding_that_instance_0_is_gone_does_not_restart_a_serving_xpyd_pair():
    """Decode 0 deleted by its own replacement: until the new decode 0 exists, the health watch finds no decode 0 and
    writes pod_vanished naming no pod. In a serving xPyD generation that is the healer's (it re-creates instance 0
    beside the serving decode), never a restart of the pair; in a 1P1D pair it still is one. Pure, milliseconds."""
    from pdpair.operator.decide import planner
    from pdpair.operator.model.observed import Finding

    world = SimWorld(spec(prefill=2, decode=2))
    simulate_until_ready(world)
    del world.pods["p-decode-1"]
    gone = Finding("pod_vanished", "decode pod is gone", 1)
    decided = planner.plan(world.spec, world.status, dataclasses.replace(world.observe(), health=gone), world.now)
    assert decided.restart is None and decided.outcome == planner.OUTCOME_STEP, decided
    assert (decided.steps.create, decided.steps.create_instance) == ("decode", 0)
    world = SimWorld(spec())
    simulate_until_ready(world)
    assert planner.plan(world.spec, world.status, dataclasses.replace(world.observe(), health=gone),
                        world.now).restart is not None


def test_random_failures_in_a_serving_2p3d_pair_never_take_it_out_of_ready():
    """Random single failures (50 in CI, 200 with PDPAIR_FULL_PROPERTY_TESTS=1; any engine instance, failed or
    restarted), each healed before the next: the pair stays Ready at generation 1 throughout and ends with every instance (a generous budget)."""
    rng = random.Random(7)
    world = SimWorld({**spec(prefill=2, decode=3), "restartPolicy": {"maxRestarts": 1000, "backoffSeconds": 0,
                                                                     "maxBackoffSeconds": 0}})
    simulate_until_ready(world)
    for _ in range(cases(ci=50, full=200)):
        world.now += 1
        name = rng.choice(sorted(n for n, p in world.pods.items() if p.role != "router"))
        fail(world, name, **rng.choice([{}, {"phase": "Running", "restarts": 2}]))
        replace_alone(world, name)
    assert world.status["pairGeneration"] == 1
    assert sorted(world.pods) == sorted(["p-decode-1", "p-decode-1-1", "p-decode-1-2", "p-prefill-1",
                                         "p-prefill-1-1", "p-router-1"])


def test_a_scale_up_past_the_pool_starts_only_the_instances_with_ports():
    """The pool could lease decode instance 1 but not 2 (ports.ensure kept the serving blocks): 1 is created, 2 waits
    and the plan says why; the pair stays Ready."""
    world = SimWorld(spec(prefill=1, decode=1))
    simulate_until_ready(world)
    world.spec = spec(prefill=1, decode=3)
    leased = {"decode": frozenset({0, 1}), "prefill": frozenset({0})}
    plan = next_step(world.spec, world.status, dataclasses.replace(world.observe(), leased_instances=leased))
    assert (plan.create, plan.create_instance, plan.phase) == ("decode", 1, "Ready")
    world.apply(plan)
    plan = next_step(world.spec, world.status, dataclasses.replace(world.observe(), leased_instances=leased))
    assert plan.create is None and "no ports for decode 2" in plan.message and plan.phase == "Ready"


def test_a_deleted_instance_that_ends_succeeded_is_no_restart():
    """vLLM exits 0 on SIGTERM: a decode instance >= 1 deleted by a scale-down (or by hand) is Succeeded while it goes.
    That is the deletion, not a failure (the real nodes showed a whole-pair restart before this rule); instance 0 so
    deleted in a serving pair is re-created alone like any other (instances.heal); only the last decode going is a
    restart (nothing is left to pair with)."""
    world = SimWorld(spec(prefill=1, decode=2))
    simulate_until_ready(world)
    world.pods["p-decode-1-1"] = dataclasses.replace(world.pods["p-decode-1-1"], phase="Succeeded", ready=False,
                                                    deleting=True)
    plan = next_step(world.spec, world.status, world.observe())
    assert plan.step != d.STEP_BROKEN and plan.phase == "Ready" and plan.pair_generation == 1
    world.pods["p-decode-1"] = dataclasses.replace(world.pods["p-decode-1"], phase="Succeeded", ready=False,
                                                  deleting=True)
    assert next_step(world.spec, world.status, world.observe()).step == d.STEP_BROKEN  # no decode serves


def test_a_draining_instance_that_fails_is_not_replaced():
    """A scale-down chose decode 2; it fails while it drains: no replacement, no Event, no budget spent; the drain
    deletes it and nothing re-creates it."""
    world = SimWorld(spec(prefill=1, decode=3))
    simulate_until_ready(world)
    world.spec = spec(prefill=1, decode=2)
    world.apply(next_step(world.spec, world.status, world.observe()))  # marks p-decode-1-2 draining
    assert world.pods["p-decode-1-2"].draining_since is not None
    fail(world, "p-decode-1-2")
    plan = next_step(world.spec, world.status, world.observe())
    assert plan.phase == "Ready" and not plan.delete and not plan.events and plan.replaced_instance is None
    world.now += DRAIN
    plan = next_step(world.spec, world.status, world.observe())
    assert plan.delete == ("p-decode-1-2",) and plan.replaced_instance is None
    world.apply(plan)
    assert next_step(world.spec, world.status, world.observe()).step == d.STEP_READY
    assert "p-decode-1-2" not in world.pods and world.instance_restarts == (0, {})

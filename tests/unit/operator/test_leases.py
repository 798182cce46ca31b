"""The port-lease decisions (leases.py, composed by planner.prepare): table tests and a property test over random
pod sets and rollout states. Pure: milliseconds, no cluster."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdpair.contract import ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER
from pdpair.operator.decide import busy_ports, leases
from pdpair.operator.decide import planner
from pdpair.operator.decide import surge as r
from pdpair.operator.decide.busy_ports import PortsInUse
from pdpair.operator.model.config import PortPool
from pdpair.operator.model.pair_spec import spec_fingerprint
from pdpair.operator.model.observed import PodView
from pdpair.operator.decide.port_blocks import other_slot
from tests.port_blocks_support import spec_blocks
from tests.crd_defaults import with_crd_defaults


def make_spec(**extra):
    return with_crd_defaults({"metadata": {"name": "p"}, "spec": {"model": "m", "image": "img:1", **extra}})["spec"]


V1 = make_spec(rolloutStrategy="Surge")
V2 = {**V1, "decode": {**V1["decode"], "args": ["--seed", "1"]}}
POOL = PortPool(20000, 20099)


def pod(role, gen, spec, raw=None, instance=0, deleting=False):
    # keywords past spec_hash: PodView.instance was inserted after it (positional "Running" would land there)
    suffix = f"-{instance}" if instance else ""
    return PodView(f"p-{role}-g{gen}{suffix}", role, gen, spec_fingerprint(spec), instance=instance, phase="Running",
                   ready=True, ip="10.0.0.1", deleting=deleting, scheduled=True, restarts=0,
                   uid=f"uid-{role}-{gen}{suffix}", raw=raw)


def serving_lease(spec, status, pods):
    """leases.serving_lease as a pass plans it (planner.prepare: the spec read once, the generations from status)."""
    return planner.prepare(spec, status, tuple(pods)).serving


def rollout_lease(spec, status, pods):
    return planner.prepare(spec, status, tuple(pods)).rollout


def probes(status, pods):
    return planner.prepare(V1, status, tuple(pods)).probes


def pair(gen, spec):
    return tuple(pod(role, gen, spec) for role in (ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER))


def rollout_status(phase, from_gen=1, to_gen=2, slot="b", spec=V2):
    serving = from_gen if phase != r.PHASE_DRAINING else to_gen
    return {"pairGeneration": serving, "portSlot": slot if phase == r.PHASE_DRAINING else other_slot(slot),
            "rollout": {"phase": phase, "fromGeneration": from_gen, "toGeneration": to_gen, "portSlot": slot,
                        "specHash": spec_fingerprint(spec)}}


def test_serving_set_is_leased_for_the_spec_when_every_pod_is_built_from_it():
    step = serving_lease(V1, {"pairGeneration": 1}, pair(1, V1))
    assert step.leasing and step.slot == "a" and step.blocks == spec_blocks(V1) and step.generation is None


def test_serving_set_is_only_read_while_a_pod_of_another_spec_exists():
    """A Recreate spec change or a TP change: the old pods may still be bound to the ports."""
    step = serving_lease(V2, {"pairGeneration": 1}, pair(1, V1))
    assert step.mode == leases.KEEP


def test_serving_slot_follows_status():
    assert serving_lease(V1, {"portSlot": "b"}, ()).slot == "b"


def test_no_rollout_set_without_a_rollout():
    assert rollout_lease(V2, {"pairGeneration": 1}, pair(1, V1)) is None


def test_rollout_set_is_leased_while_the_new_generation_comes_up():
    status = rollout_status(r.PHASE_PROGRESSING)
    step = rollout_lease(V2, status, pair(1, V1) + (pod(ROLE_DECODE, 2, V2),))
    assert step.leasing and step.slot == "b" and step.generation == 2
    # the serving set is kept as it is meanwhile: generation 1's pods are of another spec
    assert serving_lease(V2, status, pair(1, V1)).mode == leases.KEEP


def test_rollout_set_is_only_read_while_draining_or_rolling_back_or_for_another_spec():
    for phase in (r.PHASE_DRAINING, r.PHASE_ROLLING_BACK):
        step = rollout_lease(V2, rollout_status(phase), pair(1, V1) + pair(2, V2))
        assert step.mode == leases.KEEP, phase
    # the spec moved on during the rollout: the new generation's ports are not re-leased under its pods
    v3 = {**V1, "decode": {**V1["decode"], "args": ["--seed", "3"]}}
    assert rollout_lease(v3, rollout_status(r.PHASE_PROGRESSING), pair(2, V2)).mode == leases.KEEP


def test_draining_reads_the_old_generation_in_the_other_set():
    step = rollout_lease(V2, rollout_status(r.PHASE_DRAINING, slot="b"), pair(1, V1) + pair(2, V2))
    assert (step.generation, step.slot) == (1, "a")


HELD = [{"role": "decode", "purpose": "sidechannel", "rank": 0, "port": 20000},
        {"role": "prefill", "purpose": "sidechannel", "rank": 0, "port": 20001},
        {"role": "router", "purpose": "http", "rank": 0, "port": 20002}]
BUSY = PortsInUse("decode", "p-decode-g1", "n1", "port-preflight", (20000,))


def test_a_held_pool_port_is_quarantined_and_then_counts_as_replaced():
    blocks = spec_blocks(V1)
    (todo,) = busy_ports.quarantines([BUSY], HELD, blocks, POOL)
    assert todo.ports == (20000,) and todo.fixed == ()
    assert busy_ports.ports_replaced([BUSY], HELD, blocks, POOL) is None  # still held: quarantine first
    re_leased = [{**HELD[0], "port": 20005}] + HELD[1:]
    message = busy_ports.ports_replaced([BUSY], re_leased, blocks, POOL)
    assert message and "20000" in message and "decode ports [20005]" in message


def test_a_fixed_or_foreign_port_is_only_reported_and_never_counts_as_replaced():
    spec = make_spec(router={"port": 20002})
    busy = PortsInUse("router", "p-router-g1", "n1", "port-preflight", (20002, 31000))
    (todo,) = busy_ports.quarantines([busy], HELD, spec_blocks(spec), POOL)
    assert todo.ports == () and set(todo.fixed) == {20002, 31000}
    assert busy_ports.ports_replaced([busy], HELD[:2], spec_blocks(spec), POOL) is None


def test_prepare_composes_the_lease_steps_and_the_serving_generations_reports():
    raw = {"spec": {"nodeName": "n1"}, "status": {"initContainerStatuses": [
        {"name": "port-preflight", "state": {"terminated": {"message": "pdpair: ports in use on this node: 20000"}}}]}}
    pods = (pod(ROLE_DECODE, 1, V1, raw=raw), pod(ROLE_PREFILL, 1, V1))
    plan = planner.prepare(V1, {"pairGeneration": 1}, pods)
    assert plan.serving.leasing and plan.rollout is None
    assert [(b.pod, b.node, b.ports) for b in plan.busy] == [("p-decode-g1", "n1", (20000,))]


PHASES = st.sampled_from([None, r.PHASE_PROGRESSING, r.PHASE_DRAINING, r.PHASE_ROLLING_BACK])
SPECS = st.sampled_from([V1, V2])


@settings(derandomize=True)  # the example count is the hypothesis profile's (tests/property_counts.py)
@given(phase=PHASES, spec=SPECS, slot=st.sampled_from(["a", "b"]),
       pods=st.lists(st.tuples(st.sampled_from([ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER]), st.integers(1, 2), SPECS),
                     max_size=6))
def test_lease_steps_keep_generations_apart_and_never_move_ports_under_a_pod(phase, spec, slot, pods):
    """Over random pod sets and rollout states: the two generations' sets are disjoint (never the same slot), a set
    is re-leased only when no pod that may be bound to it is of another spec (leases outlive pods), and the rollout
    set is leased only for the spec being rolled out, while Progressing. 100 derandomized examples in CI, 3000 with
    PDPAIR_FULL_PROPERTY_TESTS=1."""
    views = tuple(pod(role, gen, s) for role, gen, s in {(p[0], p[1], spec_fingerprint(p[2])): p for p in pods}.values())
    status = rollout_status(phase, slot=slot) if phase else {"pairGeneration": 1, "portSlot": slot}
    plan = planner.prepare(spec, status, views)
    if plan.rollout is not None:
        assert plan.rollout.slot != plan.serving.slot
        if plan.rollout.leasing:
            assert phase == r.PHASE_PROGRESSING and spec_fingerprint(spec) == status["rollout"]["specHash"]
            assert all(p.spec_hash == spec_fingerprint(spec) for p in views if p.generation == plan.rollout.generation)
    else:
        assert phase is None
    if plan.serving.leasing:
        assert all(p.spec_hash == spec_fingerprint(spec) for p in views)


def test_listener_probes_name_each_generations_decode_until_it_was_seen_serving():
    """planner.prepare's listener probes: a running decode is probed (prefill or not: both start at once) until its generation
    was Ready with a Ready prefill (paired, so the listener accepted); a Progressing rollout's new decode likewise;
    a decode that does not run yet is not probed."""
    pending_decode = PodView("p-decode-g1", ROLE_DECODE, 1, spec_fingerprint(V1), "Pending", uid="u")
    assert probes({"pairGeneration": 1}, (pending_decode,)).serving is None
    decode = pod(ROLE_DECODE, 1, V1)
    assert probes({"pairGeneration": 1}, (decode,)).serving == decode
    assert probes({"pairGeneration": 1}, pair(1, V1)).serving == decode  # prefill exists: still
    assert probes({"pairGeneration": 1, "phase": "Ready"}, pair(1, V1)).serving is None
    status = rollout_status(r.PHASE_PROGRESSING)
    new_decode = pod(ROLE_DECODE, 2, V2)
    found = probes({**status, "phase": "Ready"}, pair(1, V1) + (new_decode, pod(ROLE_PREFILL, 2, V2)))
    assert found.serving is None and found.rollout == new_decode
    assert probes(rollout_status(r.PHASE_ROLLING_BACK), pair(1, V1) + (new_decode,)).rollout is None


def test_the_service_selects_the_serving_generation_only_during_a_rollout():
    assert planner.service_generation({"pairGeneration": 3}) is None
    assert planner.service_generation(rollout_status(r.PHASE_DRAINING)) == 2
    assert planner.service_generation(rollout_status(r.PHASE_PROGRESSING)) == 1


# --- instances (xPyD) ------------------------------------------------------------------------------
def instances(step):
    return {role: sorted({b.instance for b in step.blocks if b.role == role}) for role in (ROLE_DECODE, ROLE_PREFILL)}


def scaled(spec, decode=1, prefill=1):
    return {**spec, "decode": {**spec["decode"], "replicas": decode}, "prefill": {**spec["prefill"], "replicas": prefill}}


def test_scale_down_keeps_the_blocks_of_an_instance_whose_pod_still_exists():
    """replicas 3 -> 2 while decode instance 2's pod still exists (running, then being deleted): its blocks stay
    required, so ensure keeps them; once the pod is gone they are no longer required (released)."""
    spec = scaled(V1, decode=2)
    base = pair(1, spec) + (pod(ROLE_DECODE, 1, spec, instance=1),)
    for last in (pod(ROLE_DECODE, 1, spec, instance=2), pod(ROLE_DECODE, 1, spec, instance=2, deleting=True)):
        step = serving_lease(spec, {"pairGeneration": 1}, base + (last,))
        assert step.leasing and instances(step) == {ROLE_DECODE: [0, 1, 2], ROLE_PREFILL: [0]}
        assert not step.hoard_nothing
    step = serving_lease(spec, {"pairGeneration": 1}, base)
    assert instances(step) == {ROLE_DECODE: [0, 1], ROLE_PREFILL: [0]}


def test_scale_up_requires_the_new_instances_and_an_empty_set_hoards_nothing():
    spec = scaled(V1, decode=3, prefill=2)
    step = serving_lease(spec, {"pairGeneration": 1}, pair(1, spec))
    assert instances(step) == {ROLE_DECODE: [0, 1, 2], ROLE_PREFILL: [0, 1]}
    assert step.blocks == spec_blocks(spec) and not step.hoard_nothing  # pods on the set: keep what is held
    assert serving_lease(spec, {"pairGeneration": 1}, ()).hoard_nothing  # no pod: today's rule


def test_recreate_counts_every_generations_pods_on_the_serving_set():
    """Recreate keeps one port set across generations: an older generation's instance 1 still terminating keeps
    its blocks (the set is only read meanwhile, but the blocks are what it re-leases to once it is gone)."""
    spec = scaled(V1)
    step = serving_lease(spec, {"pairGeneration": 2}, pair(2, spec) + (pod(ROLE_PREFILL, 1, spec, instance=1,
                                                                                   deleting=True),))
    assert instances(step) == {ROLE_DECODE: [0], ROLE_PREFILL: [0, 1]}


def test_a_surge_rollouts_generations_count_only_on_their_own_set():
    old, new = scaled(V1, decode=3), scaled(V2, decode=2)
    status = rollout_status(r.PHASE_PROGRESSING, spec=new)
    pods = pair(1, old) + tuple(pod(ROLE_DECODE, 1, old, instance=i) for i in (1, 2)) + (pod(ROLE_DECODE, 2, new),)
    serving, rolling = serving_lease(new, status, pods), rollout_lease(new, status, pods)
    assert instances(serving) == {ROLE_DECODE: [0, 1, 2], ROLE_PREFILL: [0]} and not serving.hoard_nothing
    assert rolling.leasing and instances(rolling) == {ROLE_DECODE: [0, 1], ROLE_PREFILL: [0]}
    assert not rolling.hoard_nothing  # generation 2's decode is on the rollout set
    assert rollout_lease(new, status, pair(1, old)).hoard_nothing  # nothing of generation 2 yet
    # draining: generation 2 serves on set b, generation 1 (3 decodes, one terminating) is the other set's
    status = rollout_status(r.PHASE_DRAINING, spec=new)
    pods = pair(2, new) + (pod(ROLE_DECODE, 1, old), pod(ROLE_DECODE, 1, old, instance=2, deleting=True))
    serving, draining = serving_lease(new, status, pods), rollout_lease(new, status, pods)
    assert serving.slot == "b" and instances(serving) == {ROLE_DECODE: [0, 1], ROLE_PREFILL: [0]}
    assert draining.slot == "a" and instances(draining) == {ROLE_DECODE: [0, 1, 2], ROLE_PREFILL: [0]}


def test_a_busy_port_of_instance_1_is_quarantined():
    """Quarantines are per port: a report from instance 1's pod quarantines that held port (the re-lease then
    claims instance 1's block again: test_port_leaser.py)."""
    spec = scaled(V1, decode=2)
    held = HELD + [{"name": "decode-sidechannel-0-i1", "role": "decode", "purpose": "sidechannel", "rank": 0,
                    "port": 20003, "instance": 1}]
    busy = PortsInUse("decode", "p-decode-g1-1", "n1", "port-preflight", (20003,))
    (todo,) = busy_ports.quarantines([busy], held, spec_blocks(spec), POOL)
    assert todo.ports == (20003,) and todo.fixed == ()
    re_leased = held[:3] + [{**held[3], "port": 20007}]
    assert "decode ports [20000, 20007]" in busy_ports.ports_replaced([busy], re_leased, spec_blocks(spec), POOL)


def test_pod_labels_outside_the_crd_range_are_not_instances():
    spec = scaled(V1)
    assert instances(serving_lease(spec, {}, (pod(ROLE_DECODE, 1, spec, instance=99),))) == {
        ROLE_DECODE: [0], ROLE_PREFILL: [0]}

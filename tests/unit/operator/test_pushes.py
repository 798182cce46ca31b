"""decide/pushes.py: what each prefill and router of a pair is told, and when a push is due. Pure: milliseconds."""

from __future__ import annotations

from pdpair.contract import ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER
from pdpair.operator.decide import pushes
from pdpair.operator.decide.port_blocks import assign, port_of, status_ports
from pdpair.operator.model.observed import PodView
from tests.port_blocks_support import spec_blocks

SPEC = {"prefill": {"replicas": 2}, "decode": {"replicas": 2, "tensorParallelSize": 2}}


def _ports():
    out, first = [], 20000
    for block in spec_blocks(SPEC):
        out += assign(block, first)
        first += block.count
    return status_ports(out)


PORTS = _ports()


def pod(role, instance=0, generation=1, ready=True, ip="10.0.0.1", digest="old", draining=None, phase="Running"):
    return PodView(f"{role}-{instance}-g{generation}", role, generation, "h", phase=phase, ready=ready, ip=ip,
                   uid=f"u-{role}-{instance}-{generation}", instance=instance, peers_digest=digest,
                   draining_since=draining)


def test_a_prefill_is_told_every_running_decode_of_its_generation_with_its_side_channel_base_and_tp():
    decodes = (pod(ROLE_DECODE, 0, ip="10.0.0.2"), pod(ROLE_DECODE, 1, ip="fd00::3", ready=False),
               pod(ROLE_DECODE, 0, generation=2, ip="10.0.0.9"), pod(ROLE_DECODE, 2, phase="Pending", ip=None))
    prefill = pod(ROLE_PREFILL)
    (item,) = pushes.pushes((prefill,) + decodes, {1: PORTS}, decode_tp=2)
    assert item.pod == prefill and item.port == port_of(PORTS, ROLE_PREFILL, "metrics")
    assert [(d.index, d.host, d.tp) for d in item.decodes] == [(0, "10.0.0.2", 2), (1, "fd00::3", 2)]
    assert [d.port_base for d in item.decodes] == [pushes.side_base(PORTS, 0), pushes.side_base(PORTS, 1)]
    # told already (the annotation holds that digest): nothing is due
    told = pod(ROLE_PREFILL, digest=item.digest)
    assert pushes.pushes((told,) + decodes, {1: PORTS}, decode_tp=2) == []
    # a prefill created with this set records the same digest (pod_steps._manifest uses prefill_set)
    assert pushes.prefill_set((told,) + decodes, 1, PORTS, tp=1)[1] == item.digest


def test_a_router_is_told_the_ready_instances_not_draining_and_only_with_a_prefill_and_a_decode():
    router = pod(ROLE_ROUTER)
    prefill, decode = pod(ROLE_PREFILL, digest=None), pod(ROLE_DECODE)  # a prefill never told: not pushed
    draining = pod(ROLE_DECODE, 1, draining=5.0)
    (item,) = pushes.pushes((router, prefill, decode, draining), {1: PORTS}, decode_tp=1)
    assert item.pod == router and item.port == port_of(PORTS, ROLE_ROUTER, "http")
    assert [(m.role, m.index) for m in item.members] == [(ROLE_DECODE, 0), (ROLE_PREFILL, 0)]
    assert item.members[0].url == f"http://10.0.0.1:{port_of(PORTS, ROLE_DECODE, 'http')}"
    assert pushes.pushes((router, decode, draining), {1: PORTS}, decode_tp=1) == []  # no Ready prefill: keeps its set
    first = pushes.first_router_members((router, prefill, decode, draining), 1)
    assert set(first) == {ROLE_PREFILL, ROLE_DECODE} and first[ROLE_DECODE] == decode


def test_nothing_is_pushed_to_a_generation_without_ports_or_a_pod_that_does_not_run():
    world = (pod(ROLE_ROUTER), pod(ROLE_PREFILL), pod(ROLE_DECODE))
    assert pushes.pushes(world, {}, decode_tp=1) == []
    assert pushes.pushes(world, {1: None}, decode_tp=1) == []
    stopped = (pod(ROLE_ROUTER, phase="Pending"), pod(ROLE_PREFILL, phase="Pending"), pod(ROLE_DECODE))
    assert pushes.pushes(stopped, {1: PORTS}, decode_tp=1) == []
    assert pushes.draining_generations(world + (pod(ROLE_DECODE, 1, generation=3, draining=1.0),)) == {3}

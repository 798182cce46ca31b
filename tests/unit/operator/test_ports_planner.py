"""Table tests of the pure port planner (no cluster)."""

import pytest

from pdpair.contract import PURPOSE_HTTP, PURPOSE_METRICS, PURPOSE_SIDECHANNEL
from pdpair.operator.model.config import ConfigError, PortPool
from pdpair.operator.decide.port_blocks import (
    PortBlock,
    assign,
    choose_run,
    match_existing,
    missing_blocks,
    port_of,
    ports_of,
    status_ports,
)
from tests.port_blocks_support import spec_blocks


@pytest.mark.parametrize(
    "spec, expected_total, decode_side",
    [
        ({}, 8, 1),  # two router replicas by default
        ({"router": {"enabled": True, "replicas": 1}}, 7, 1),
        ({"router": {"enabled": False}}, 6, 1),
        ({"decode": {"tensorParallelSize": 4}, "prefill": {"tensorParallelSize": 4}}, 14, 4),
        ({"decode": {"tensorParallelSize": 2}, "network": {"portsPerRank": 3}}, 15, 6),
        ({"router": {"enabled": True, "port": 30000}}, 7, 1),  # router 0's fixed port is not the pool's
        ({"router": {"enabled": True, "port": 30000, "replicas": 1}}, 6, 1),
    ],
)
def test_required_blocks(spec, expected_total, decode_side):
    blocks = spec_blocks(spec)
    assert ports_needed(blocks) == expected_total
    side = next(b for b in blocks if b.role == "decode" and b.purpose == PURPOSE_SIDECHANNEL)
    assert side.count == decode_side and side.contiguous
    assert len({b.key for b in blocks}) == len(blocks)


def ports_needed(blocks) -> int:
    """Ports a pair takes from the pool (a fixed port is not the pool's)."""
    return sum(b.count for b in blocks if b.fixed is None)


def test_required_blocks_rejects_bad_sizes():
    with pytest.raises(ValueError, match="tensorParallelSize"):
        spec_blocks({"decode": {"tensorParallelSize": 0}})
    with pytest.raises(ValueError, match="portsPerRank"):
        spec_blocks({"network": {"portsPerRank": 0}})


@pytest.mark.parametrize(
    "taken, count, start_at, expected",
    [
        (set(), 1, None, 100),
        ({100}, 1, None, 101),
        ({101}, 2, None, 102),
        ({100, 102, 105}, 2, None, 103),
        ({100, 102, 105}, 3, None, 106),
        (set(range(100, 110)), 1, None, None),
        ({109}, 10, None, None),
        (set(), 10, None, 100),
        (set(), 11, None, None),
        (set(), 2, 108, 108),
        (set(), 2, 109, None),
    ],
)
def test_choose_run(taken, count, start_at, expected):
    assert choose_run(PortPool(100, 109), taken, count, start_at) == expected


def test_match_existing_keeps_whole_fitting_blocks_and_releases_the_rest():
    blocks = spec_blocks({"decode": {"tensorParallelSize": 2}, "prefill": {"tensorParallelSize": 2}})
    held = {
        ("decode", 0, PURPOSE_SIDECHANNEL): [201, 200],  # contiguous: kept
        ("prefill", 0, PURPOSE_SIDECHANNEL): [300, 302],  # not contiguous: released
        ("decode", 0, PURPOSE_HTTP): [400],
        ("router", 0, PURPOSE_METRICS): [500],  # not needed at all: released
        ("prefill", 0, PURPOSE_HTTP): [401, 402],  # too many: released
    }
    keep, release = match_existing(blocks, held)
    assert sorted(a.port for a in keep) == [200, 201, 400]
    assert sorted(release) == [300, 302, 401, 402, 500]
    missing = {b.key for b in missing_blocks(blocks, keep)}
    assert ("decode", 0, PURPOSE_SIDECHANNEL) not in missing
    assert ("prefill", 0, PURPOSE_SIDECHANNEL) in missing and ("router", 0, PURPOSE_HTTP) in missing


def test_status_ports_names_follow_the_crd():
    block = PortBlock("decode", PURPOSE_SIDECHANNEL, 3, contiguous=True)
    ports = status_ports(assign(block, 20010))
    assert [p["name"] for p in ports] == ["decode-sidechannel-0", "decode-sidechannel-1", "decode-sidechannel-2"]
    assert [p["port"] for p in ports] == [20010, 20011, 20012]


@pytest.mark.parametrize("text", ["abc", "1-", "70000-70001", "10-5", "0-10"])
def test_pool_parse_errors_name_the_variable(text):
    with pytest.raises(ConfigError, match="PDPAIR_PORT_POOL"):
        PortPool.parse(text)


def test_pool_parse():
    pool = PortPool.parse("20000-29999")
    assert pool.size == 10000 and 20000 in pool and 30000 not in pool


# --- instances (xPyD) ------------------------------------------------------------------------------
def keys(blocks):
    return sorted((b.role, b.instance, b.purpose) for b in blocks)


def engine_keys(role, *instances):
    return sorted((role, i, purpose) for i in instances for purpose in (PURPOSE_SIDECHANNEL, PURPOSE_METRICS, PURPOSE_HTTP))


ROUTER = [("router", 0, PURPOSE_HTTP), ("router", 1, PURPOSE_HTTP)]  # two router replicas by default


@pytest.mark.parametrize(
    "spec, instances, expected",
    [
        ({}, None, engine_keys("decode", 0) + engine_keys("prefill", 0) + ROUTER),  # no replicas: one instance each
        ({"decode": {"replicas": 3}, "prefill": {"replicas": 2}}, None,
         engine_keys("decode", 0, 1, 2) + engine_keys("prefill", 0, 1) + ROUTER),
        # scale-down 3 -> 2 while instance 2's pod still exists: leases.py names it, so its blocks stay required
        ({"decode": {"replicas": 2}}, {"decode": [0, 1, 2]}, engine_keys("decode", 0, 1, 2) + engine_keys("prefill", 0) + ROUTER),
        # a role absent from `instances` takes the spec's count; duplicates and order do not matter
        ({"prefill": {"replicas": 2}}, {"decode": (1, 0, 1)}, engine_keys("decode", 0, 1) + engine_keys("prefill", 0, 1) + ROUTER),
        ({"prefill": {"replicas": 0}, "decode": {"replicas": 0}}, None, ROUTER),
        ({"router": {"enabled": False}}, {"decode": [], "prefill": [4]}, engine_keys("prefill", 4)),
        # router replicas: the spec's count, and a replica's pod still on the set keeps its block
        ({"router": {"replicas": 3}}, None, engine_keys("decode", 0) + engine_keys("prefill", 0)
         + [("router", i, PURPOSE_HTTP) for i in range(3)]),
        ({"router": {"replicas": 1}}, {"router": [0, 2]}, engine_keys("decode", 0) + engine_keys("prefill", 0)
         + [("router", 0, PURPOSE_HTTP), ("router", 2, PURPOSE_HTTP)]),
    ],
)
def test_required_blocks_per_instance(spec, instances, expected):
    blocks = spec_blocks(spec, instances)
    assert keys(blocks) == sorted(expected)
    assert len({b.key for b in blocks}) == len(blocks)


def test_required_blocks_order_is_decode_instances_then_prefill_then_router():
    blocks = spec_blocks({"decode": {"replicas": 2, "tensorParallelSize": 2}, "prefill": {"replicas": 2}})
    assert [(b.role, b.instance) for b in blocks][:12:3] == [("decode", 0), ("decode", 1), ("prefill", 0),
                                                             ("prefill", 1)]
    assert [(b.role, b.instance) for b in blocks][12:] == [("router", 0), ("router", 1)]
    assert all(b.count == 2 and b.contiguous for b in blocks if b.role == "decode" and b.purpose == PURPOSE_SIDECHANNEL)
    assert ports_needed(blocks) == 2 * (2 + 2) + 2 * (1 + 2) + 2


def test_required_blocks_rejects_instances_outside_the_crd_range():
    with pytest.raises(ValueError, match="decode instance indexes must be 0..15"):
        spec_blocks({}, {"decode": [0, 16]})
    with pytest.raises(ValueError, match="prefill instance"):
        spec_blocks({}, {"prefill": [-1]})
    with pytest.raises(ValueError, match="tensorParallelSize"):  # the old errors stay
        spec_blocks({"decode": {"tensorParallelSize": 0}}, {"decode": [1]})


def test_match_existing_works_per_instance():
    blocks = spec_blocks({"decode": {"replicas": 2, "tensorParallelSize": 2}, "router": {"enabled": False}})
    held = {
        ("decode", 0, PURPOSE_SIDECHANNEL): [200, 201],  # kept
        ("decode", 1, PURPOSE_SIDECHANNEL): [210, 212],  # instance 1's, not contiguous: released
        ("decode", 1, PURPOSE_HTTP): [220],  # kept as instance 1's
        ("decode", 2, PURPOSE_HTTP): [230],  # an instance no block names (scaled down, pod gone): released
        ("prefill", 0, PURPOSE_METRICS): [240],  # kept
        ("prefill", -1, PURPOSE_HTTP): [250],  # a label we did not write (port_blocks.lease_instance): released
    }
    keep, release = match_existing(blocks, held)
    assert sorted((a.role, a.instance, a.purpose, a.rank, a.port) for a in keep) == [
        ("decode", 0, PURPOSE_SIDECHANNEL, 0, 200), ("decode", 0, PURPOSE_SIDECHANNEL, 1, 201),
        ("decode", 1, PURPOSE_HTTP, 0, 220), ("prefill", 0, PURPOSE_METRICS, 0, 240)]
    assert sorted(release) == [210, 212, 230, 250]
    missing = {b.key for b in missing_blocks(blocks, keep)}
    assert ("decode", 1, PURPOSE_SIDECHANNEL) in missing and ("decode", 1, PURPOSE_HTTP) not in missing
    assert ("decode", 1, PURPOSE_METRICS) in missing and ("decode", 0, PURPOSE_METRICS) in missing


def test_status_names_and_fields_for_instances():
    side = PortBlock("decode", PURPOSE_SIDECHANNEL, 2, contiguous=True, instance=1)
    http0, http2 = PortBlock("decode", PURPOSE_HTTP, 1), PortBlock("decode", PURPOSE_HTTP, 1, instance=2)
    ports = status_ports(assign(http2, 20000) + assign(side, 20010) + assign(http0, 20020))
    # grouped by instance (instance 0 first), then purpose and rank; "instance" only when > 0
    assert ports == [
        {"name": "decode-http-0", "role": "decode", "purpose": PURPOSE_HTTP, "rank": 0, "port": 20020},
        {"name": "decode-sidechannel-0-i1", "role": "decode", "purpose": PURPOSE_SIDECHANNEL, "rank": 0,
         "port": 20010, "instance": 1},
        {"name": "decode-sidechannel-1-i1", "role": "decode", "purpose": PURPOSE_SIDECHANNEL, "rank": 1,
         "port": 20011, "instance": 1},
        {"name": "decode-http-0-i2", "role": "decode", "purpose": PURPOSE_HTTP, "rank": 0, "port": 20000,
         "instance": 2},
    ]


def test_a_1p1d_pairs_status_is_what_it_was_before_instances():
    """Byte-identical with one router replica: same names, same keys, same order (instance 0 everywhere, no
    "instance" key); a second replica adds router-http-0-i1 after them."""
    blocks = spec_blocks({"decode": {"tensorParallelSize": 2}, "router": {"replicas": 1}})
    ports, first = [], 20000
    for block in blocks:
        ports += assign(block, first)
        first += block.count
    listed = status_ports(ports)
    assert [p["name"] for p in listed] == ["decode-http-0", "decode-metrics-0", "decode-sidechannel-0",
                                           "decode-sidechannel-1", "prefill-http-0", "prefill-metrics-0",
                                           "prefill-sidechannel-0", "router-http-0"]
    assert all(list(p) == ["name", "role", "purpose", "rank", "port"] for p in listed)
    ports, first = [], 20000
    for block in spec_blocks({"decode": {"tensorParallelSize": 2}}):
        ports += assign(block, first)
        first += block.count
    assert [p["name"] for p in status_ports(ports)][-2:] == ["router-http-0", "router-http-0-i1"]


def test_port_of_and_ports_of_filter_by_instance():
    listed = [
        {"name": "decode-sidechannel-0", "role": "decode", "purpose": PURPOSE_SIDECHANNEL, "rank": 0, "port": 100},
        {"name": "decode-sidechannel-1", "role": "decode", "purpose": PURPOSE_SIDECHANNEL, "rank": 1, "port": 101},
        {"name": "decode-sidechannel-0-i1", "role": "decode", "purpose": PURPOSE_SIDECHANNEL, "rank": 0, "port": 200,
         "instance": 1},
        {"name": "decode-sidechannel-1-i1", "role": "decode", "purpose": PURPOSE_SIDECHANNEL, "rank": 1, "port": 201,
         "instance": 1},
        {"name": "decode-http-0", "role": "decode", "purpose": PURPOSE_HTTP, "rank": 0, "port": 300, "instance": 0},
    ]
    assert port_of(listed, "decode", PURPOSE_SIDECHANNEL) == 100  # no "instance": 0
    assert port_of(listed, "decode", PURPOSE_SIDECHANNEL, 1) == 101
    assert port_of(listed, "decode", PURPOSE_SIDECHANNEL, 1, instance=1) == 201
    assert port_of(listed, "decode", PURPOSE_SIDECHANNEL, instance=2) is None
    assert port_of(listed, "decode", PURPOSE_HTTP) == 300  # an explicit 0 reads the same
    assert ports_of(listed, "decode", PURPOSE_SIDECHANNEL) == [100, 101]
    assert ports_of(listed, "decode", PURPOSE_SIDECHANNEL, instance=1) == [200, 201]
    assert ports_of(listed, "decode", PURPOSE_HTTP, instance=1) == []

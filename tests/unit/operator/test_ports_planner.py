"""Table tests of the pure port planner (no cluster)."""

import pytest

from pdpair.contract import PURPOSE_HTTP, PURPOSE_METRICS, PURPOSE_SIDECHANNEL
from pdpair.operator.config import ConfigError, PortPool
from pdpair.operator.ports import (
    PortBlock,
    assign,
    choose_run,
    match_existing,
    missing_blocks,
    ports_needed,
    required_blocks,
    status_ports,
)


@pytest.mark.parametrize(
    "spec, expected_total, decode_side",
    [
        ({}, 7, 1),
        ({"router": {"enabled": False}}, 6, 1),
        ({"decode": {"tensorParallelSize": 4}, "prefill": {"tensorParallelSize": 4}}, 13, 4),
        ({"decode": {"tensorParallelSize": 2}, "network": {"portsPerRank": 3}}, 14, 6),
        ({"router": {"enabled": True, "port": 30000}}, 6, 1),  # a fixed router port is not the pool's
    ],
)
def test_required_blocks(spec, expected_total, decode_side):
    blocks = required_blocks(spec)
    assert ports_needed(blocks) == expected_total
    side = next(b for b in blocks if b.role == "decode" and b.purpose == PURPOSE_SIDECHANNEL)
    assert side.count == decode_side and side.contiguous
    assert len({b.key for b in blocks}) == len(blocks)


def test_required_blocks_rejects_bad_sizes():
    with pytest.raises(ValueError, match="tensorParallelSize"):
        required_blocks({"decode": {"tensorParallelSize": 0}})
    with pytest.raises(ValueError, match="portsPerRank"):
        required_blocks({"network": {"portsPerRank": 0}})


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
    blocks = required_blocks({"decode": {"tensorParallelSize": 2}, "prefill": {"tensorParallelSize": 2}})
    held = {
        ("decode", PURPOSE_SIDECHANNEL): [201, 200],  # contiguous: kept
        ("prefill", PURPOSE_SIDECHANNEL): [300, 302],  # not contiguous: released
        ("decode", PURPOSE_HTTP): [400],
        ("router", PURPOSE_METRICS): [500],  # not needed at all: released
        ("prefill", PURPOSE_HTTP): [401, 402],  # too many: released
    }
    keep, release = match_existing(blocks, held)
    assert sorted(a.port for a in keep) == [200, 201, 400]
    assert sorted(release) == [300, 302, 401, 402, 500]
    missing = {b.key for b in missing_blocks(blocks, keep)}
    assert ("decode", PURPOSE_SIDECHANNEL) not in missing
    assert ("prefill", PURPOSE_SIDECHANNEL) in missing and ("router", PURPOSE_HTTP) in missing


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

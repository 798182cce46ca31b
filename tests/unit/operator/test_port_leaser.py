"""ports.PortLeaser per instance (xPyD), against an in-memory coordination API: the instance label, adoption per
(role, instance, purpose), a scale-up that finds the pool exhausted, and a busy port of instance 1 re-leased as
instance 1's. No cluster; milliseconds."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace


from pdpair.contract import (
    LABEL_INSTANCE,
    LABEL_PAIR,
    LABEL_PAIR_NAMESPACE,
    LABEL_PAIR_UID,
    LABEL_PORT_LEASE,
    LABEL_PORT_SLOT,
    LABEL_PURPOSE,
    LABEL_ROLE,
    PURPOSE_HTTP,
    PURPOSE_SIDECHANNEL,
    ROLE_DECODE,
)
from pdpair.operator.model.config import PortPool
from pdpair.operator.act.port_leaser import PairRef, PortLeaser
from pdpair.operator.decide.port_blocks import lease_name, status_ports
from tests.port_blocks_support import spec_blocks
from tests.unit.operator.fake_leases import Leases as FakeLeases

PAIR = PairRef("ns", "p", "uid-p")
ONE = {"router": {"enabled": False}}  # 1P1D without a router: 6 ports at TP 1
TWO_DECODES = {**ONE, "decode": {"replicas": 2}}  # 9 ports


class Leases(FakeLeases):
    def ours(self) -> dict[int, dict[str, str]]:
        """port -> labels of the pair's leases."""
        return {int(name.rsplit("-", 1)[1]): dict(lease.metadata.labels) for name, lease in self.items.items()
                if (lease.metadata.labels or {}).get(LABEL_PAIR_UID) == PAIR.uid}


def leaser(api: Leases, last: int) -> PortLeaser:
    return PortLeaser(api, "ops", PortPool(20000, last))


def test_leases_carry_their_instance_and_adopt_per_instance():
    api = Leases()
    outcome = asyncio.run(leaser(api, 20099).ensure(PAIR, spec_blocks(TWO_DECODES)))
    assert outcome.complete and outcome.claimed == 9
    labels = api.ours()
    assert sorted(l[LABEL_INSTANCE] for l in labels.values()) == ["0"] * 6 + ["1"] * 3  # "0" written too
    assert {(l[LABEL_ROLE], l[LABEL_PURPOSE]) for l in labels.values() if l[LABEL_INSTANCE] == "1"} == {
        (ROLE_DECODE, PURPOSE_SIDECHANNEL), (ROLE_DECODE, "metrics"), (ROLE_DECODE, PURPOSE_HTTP)}
    names = [p["name"] for p in status_ports(outcome.assignments)]
    assert names[:6] == ["decode-http-0", "decode-metrics-0", "decode-sidechannel-0",
                         "decode-http-0-i1", "decode-metrics-0-i1", "decode-sidechannel-0-i1"]
    # a restarted operator adopts every block (nothing claimed, nothing released) and reads the same
    again = asyncio.run(leaser(api, 20099).ensure(PAIR, spec_blocks(TWO_DECODES)))
    assert (again.adopted, again.claimed, again.released) == (9, 0, 0)
    assert again.assignments == outcome.assignments
    held, _ = asyncio.run(leaser(api, 20099).held(PAIR))
    assert held == outcome.assignments


def test_leases_made_before_instances_are_instance_0():
    """A lease without the instance label (made before instances) is adopted as instance 0's; a scale-up claims
    only instance 1's blocks."""
    api = Leases()
    asyncio.run(leaser(api, 20099).ensure(PAIR, spec_blocks(ONE)))
    for lease in api.items.values():
        del lease.metadata.labels[LABEL_INSTANCE]
    outcome = asyncio.run(leaser(api, 20099).ensure(PAIR, spec_blocks(TWO_DECODES)))
    assert (outcome.adopted, outcome.claimed, outcome.released) == (6, 3, 0) and outcome.complete


def test_scale_down_releases_an_instance_only_when_its_blocks_are_no_longer_required():
    api = Leases()
    asyncio.run(leaser(api, 20099).ensure(PAIR, spec_blocks(TWO_DECODES)))
    # replicas 2 -> 1 while instance 1's pod exists: leases.py still names instance 1 (test_leases.py)
    kept = asyncio.run(leaser(api, 20099).ensure(PAIR, spec_blocks(ONE, {ROLE_DECODE: [0, 1]})))
    assert (kept.released, len(api.ours())) == (0, 9)
    gone = asyncio.run(leaser(api, 20099).ensure(PAIR, spec_blocks(ONE)))  # its pod is gone
    assert gone.released == 3 and sorted(l[LABEL_INSTANCE] for l in api.ours().values()) == ["0"] * 6


def test_a_scale_up_that_exhausts_the_pool_keeps_the_serving_blocks_while_pods_exist():
    """6 ports serve 1P1D; the pool has 8: instance 1's side channel and metrics fit, its http does not. With pods
    on the set the adopted blocks stay leased and listed (before_release never names them), only this call's
    claim is released; without pods everything goes (a waiting pair hoards nothing)."""
    for hoard_nothing in (False, True):
        api = Leases()
        first = asyncio.run(leaser(api, 20007).ensure(PAIR, spec_blocks(ONE)))
        unlisted: list[set[int]] = []

        async def before_release(ports: set[int]) -> None:
            unlisted.append(set(ports))

        outcome = asyncio.run(leaser(api, 20007).ensure(PAIR, spec_blocks(TWO_DECODES),
                                                        before_release=before_release, hoard_nothing=hoard_nothing))
        assert outcome.exhausted and not outcome.complete and "decode instance 1 http" in outcome.message
        assert outcome.adopted == 6 and outcome.claimed == 0
        serving = {a.port for a in first.assignments}
        if hoard_nothing:
            assert outcome.assignments == [] and api.ours() == {} and outcome.released == 8
            assert unlisted == [serving | {20006, 20007}]
        else:
            assert outcome.assignments == first.assignments and set(api.ours()) == serving
            assert outcome.released == 2 and unlisted == [{20006, 20007}]  # the new claim only


def test_a_busy_port_of_instance_1_is_re_leased_as_instance_1s():
    api = Leases()
    leases = leaser(api, 20099)
    first = asyncio.run(leases.ensure(PAIR, spec_blocks(TWO_DECODES)))
    busy = next(a.port for a in first.assignments if a.instance == 1 and a.purpose == PURPOSE_HTTP)
    assert asyncio.run(leases.quarantine(PAIR, busy, "n1", 600, "busy"))
    assert busy not in api.ours()  # the quarantine Lease belongs to no pair
    again = asyncio.run(leases.ensure(PAIR, spec_blocks(TWO_DECODES), hoard_nothing=False))
    assert again.complete and (again.adopted, again.claimed, again.released) == (8, 1, 0)
    (new,) = set(a for a in again.assignments) - set(first.assignments)
    assert (new.role, new.instance, new.purpose) == (ROLE_DECODE, 1, PURPOSE_HTTP) and new.port != busy
    assert api.ours()[new.port][LABEL_INSTANCE] == "1" and api.ours()[new.port][LABEL_PORT_SLOT] == "a"
    assert new.as_status()["name"] == "decode-http-0-i1"


def test_unknown_instance_labels_are_released_and_not_listed():
    api = Leases()
    asyncio.run(leaser(api, 20099).ensure(PAIR, spec_blocks(ONE)))
    stray = SimpleNamespace(metadata=SimpleNamespace(name=lease_name(20050), uid="u-stray", labels={
        LABEL_PORT_LEASE: "true", LABEL_PAIR: "p", LABEL_PAIR_NAMESPACE: "ns", LABEL_PAIR_UID: PAIR.uid,
        LABEL_ROLE: ROLE_DECODE, LABEL_PURPOSE: PURPOSE_HTTP, LABEL_INSTANCE: "x"}), spec=None)
    api.items[lease_name(20050)] = stray
    held, _ = asyncio.run(leaser(api, 20099).held(PAIR))
    assert 20050 not in {a.port for a in held} and len(held) == 6
    outcome = asyncio.run(leaser(api, 20099).ensure(PAIR, spec_blocks(ONE)))
    assert outcome.released == 1 and 20050 not in api.ours()


def test_leases_are_read_as_plain_records_and_every_reply_gives_its_connection_back():
    """list_leases and the create read the apiserver's JSON (`_preload_content=False`) into LeaseRecords, not the
    client's pydantic models; a quarantine's times survive the round trip, and a quarantine whose time is over is
    released by the sweep. Milliseconds."""
    from datetime import datetime, timedelta, timezone

    from kubernetes.client import ApiClient, V1Lease, V1LeaseSpec, V1ObjectMeta

    from pdpair.contract import LABEL_PORT_QUARANTINE
    from pdpair.operator.act.port_leaser import LeaseRecord

    acquired = datetime(2026, 12, 6, 1, 2, 3, 4, tzinfo=timezone.utc)
    quarantine = V1Lease(
        metadata=V1ObjectMeta(name=lease_name(31000), uid="q-uid",
                              labels={LABEL_PORT_LEASE: "true", LABEL_PORT_QUARANTINE: "true"}),
        spec=V1LeaseSpec(holder_identity="node-busy/n1", lease_duration_seconds=60, acquire_time=acquired,
                         renew_time=acquired + timedelta(seconds=5)),
    )
    record = LeaseRecord.from_json(ApiClient().sanitize_for_serialization(quarantine))
    assert record == LeaseRecord(lease_name(31000), "q-uid", {LABEL_PORT_LEASE: "true", LABEL_PORT_QUARANTINE: "true"},
                                 {}, 60, acquired, acquired + timedelta(seconds=5))
    assert LeaseRecord.from_json({"metadata": {"name": "x"}, "spec": {"renewTime": "not a time"}}).renew_time is None

    replies = []

    class Counted(Leases):
        def list_namespaced_lease(self, *args, **kwargs):
            replies.append(reply := super().list_namespaced_lease(*args, **kwargs))
            return reply

    api = Counted()
    api.items[quarantine.metadata.name] = quarantine
    ports = leaser(api, 20099)
    assert asyncio.run(ports.sweep_quarantines(now=acquired + timedelta(seconds=64))) == []  # 1 s left
    assert asyncio.run(ports.sweep_quarantines(now=acquired + timedelta(seconds=65))) == [31000]
    assert not api.items
    assert asyncio.run(ports.ensure(PAIR, spec_blocks(ONE))).assignments
    assert {type(lease) for lease in asyncio.run(ports.leases_of(PAIR.uid))} == {LeaseRecord}
    assert replies and all(reply.released for reply in replies)


def test_a_pair_without_leases_at_the_full_list_is_not_listed_again_until_it_claims():
    """After the start-up's full list (refresh_taken) a pair that held no Lease then, and for which this process made
    none since, needs no list of its own: its first ensure() only creates. A pair that held Leases at the full list (a
    crashed operator's leftovers) is listed and adopts them, and so is a pair this process has claimed for (a pass
    that died between its creates and its status write). Milliseconds."""
    selectors = []

    class Counted(Leases):
        def list_namespaced_lease(self, namespace, label_selector="", **kwargs):
            selectors.append(label_selector)
            return super().list_namespaced_lease(namespace, label_selector=label_selector, **kwargs)

    api = Counted()
    left = PairRef("ns", "left", "uid-left")
    asyncio.run(leaser(api, 20099).ensure(left, spec_blocks(ONE)))  # another operator's, before this one started
    leftovers = {name for name, lease in api.items.items() if lease.metadata.labels[LABEL_PAIR_UID] == left.uid}
    ports = leaser(api, 20099)
    asyncio.run(ports.refresh_taken())
    selectors.clear()

    new = asyncio.run(ports.ensure(PAIR, spec_blocks(ONE)))
    assert new.claimed == 6 and new.adopted == 0
    assert not [s for s in selectors if PAIR.uid in s]  # no list for the new pair
    again = asyncio.run(ports.ensure(PAIR, spec_blocks(ONE)))  # its status write was lost: the next pass adopts
    assert again.adopted == 6 and again.claimed == 0 and [s for s in selectors if PAIR.uid in s]
    adopted = asyncio.run(ports.ensure(left, spec_blocks(ONE)))
    assert adopted.adopted == 6 and adopted.claimed == 0
    assert {name for name, lease in api.items.items() if lease.metadata.labels[LABEL_PAIR_UID] == left.uid} == leftovers

    unlisted = leaser(api, 20099)  # no full list yet (no start-up): every pair is listed
    assert asyncio.run(unlisted.held(PAIR))[0]

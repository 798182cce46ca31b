"""Table tests of the pure planner, and whole rollouts simulated until Ready."""

import pytest

from pdpair.contract import ANNOTATION_SPEC_HASH, LABEL_GENERATION, LABEL_ROLE
from pdpair.operator.decide import recreate as d
from pdpair.operator.model.pair_spec import spec_fingerprint
from pdpair.operator.model.observed import Observed, PodView
from pdpair.operator.decide.planner import next_step
from tests.unit.operator.sim import SimWorld, simulate_until_ready

SPEC = {"model": "m", "image": "img:1", "router": {"enabled": True, "replicas": 1}}  # one router: the ordered steps
H = spec_fingerprint(SPEC)


def pod(role, gen=1, phase="Running", ready=True, ip="10.0.0.1", deleting=False, spec_hash=H, scheduled=True):
    return PodView(f"p-{role}-{gen}", role, gen, spec_hash, phase, ready, ip if phase == "Running" else None,
                   deleting, scheduled, uid=f"uid-{role}-{gen}")


ROUTER_LOADING = pod("router", ready=False)  # created beside the loading engines, its /readyz not passing yet

CASES = [
    # name, status, observed, expected step, create, delete, phase
    ("no ports yet", {}, Observed(), d.STEP_LEASE_PORTS, None, (), "Pending"),
    ("pool exhausted", {}, Observed(pool_exhausted=True, pool_message="full"), d.STEP_POOL_EXHAUSTED, None, (), "Pending"),
    ("leased, nothing runs", {}, Observed(ports_complete=True), d.STEP_CREATE_DECODE, "decode", (), "DecodeStarting"),
    ("decode pending, not scheduled: prefill is created beside it at once", {"pairGeneration": 1},
     Observed((pod("decode", phase="Pending", scheduled=False),), ports_complete=True),
     d.STEP_CREATE_PREFILL, "prefill", (), "PrefillStarting"),
    ("both created, decode not running yet: no router (it needs decode's address)", {"pairGeneration": 1},
     Observed((pod("decode", phase="Pending"), pod("prefill", ready=False)), ports_complete=True),
     d.STEP_WAIT_DECODE_RUNNING, None, (), "PrefillStarting"),
    ("decode runs, not listening yet: prefill is created beside it", {"pairGeneration": 1},
     Observed((pod("decode", ready=False),), ports_complete=True, decode_listening=False),
     d.STEP_CREATE_PREFILL, "prefill", (), "PrefillStarting"),
    ("decode listens", {"pairGeneration": 1},
     Observed((pod("decode"),), ports_complete=True, decode_listening=True),
     d.STEP_CREATE_PREFILL, "prefill", (), "PrefillStarting"),
    ("prefill created, not running yet: no router (it needs prefill's address)", {"pairGeneration": 1},
     Observed((pod("decode", ready=False), pod("prefill", phase="Pending", ready=False)), ports_complete=True,
              decode_listening=False),
     d.STEP_WAIT_PREFILL_READY, None, (), "PrefillStarting"),
    ("prefill runs, both engines loading, decode not listening: the router is created beside them",
     {"pairGeneration": 1},
     Observed((pod("decode", ready=False), pod("prefill", ready=False)), ports_complete=True, decode_listening=False),
     d.STEP_CREATE_ROUTER, "router", (), "PrefillStarting"),
    ("prefill not ready (not paired yet), decode not listening", {"pairGeneration": 1},
     Observed((pod("decode", ready=False), pod("prefill", ready=False), ROUTER_LOADING), ports_complete=True,
              decode_listening=False),
     d.STEP_WAIT_PREFILL_READY, None, (), "PrefillStarting"),
    ("prefill not ready", {"pairGeneration": 1},
     Observed((pod("decode"), pod("prefill", ready=False), ROUTER_LOADING), ports_complete=True, decode_listening=True),
     d.STEP_WAIT_PREFILL_READY, None, (), "PrefillStarting"),
    ("both Ready but the operator has not seen the listener accept: no Ready", {"pairGeneration": 1},
     Observed((pod("decode"), pod("prefill"), pod("router")), ports_complete=True, decode_listening=False),
     d.STEP_WAIT_LISTENER, None, (), "PrefillStarting"),
    ("prefill ready, decode listens but is not Ready (still loading): no Ready", {"pairGeneration": 1},
     Observed((pod("decode", ready=False), pod("prefill"), ROUTER_LOADING), ports_complete=True, decode_listening=True),
     d.STEP_WAIT_DECODE_READY, None, (), "PrefillStarting"),
    ("engines Ready, listener seen, router not Ready yet", {"pairGeneration": 1},
     Observed((pod("decode"), pod("prefill"), ROUTER_LOADING), ports_complete=True, decode_listening=True),
     d.STEP_WAIT_ROUTER_READY, None, (), "PrefillStarting"),
    ("router missing (deleted by someone)", {"pairGeneration": 1},
     Observed((pod("decode"), pod("prefill")), ports_complete=True, decode_listening=True),
     d.STEP_CREATE_ROUTER, "router", (), "PrefillStarting"),
    ("a Ready generation stays Ready when a later probe fails (operator restart, loaded box)",
     {"pairGeneration": 1, "phase": "Ready"},
     Observed((pod("decode"), pod("prefill"), pod("router")), ports_complete=True, decode_listening=False),
     d.STEP_READY, None, (), "Ready"),
    ("all ready", {"pairGeneration": 1},
     Observed((pod("decode"), pod("prefill"), pod("router")), ports_complete=True, decode_listening=True),
     d.STEP_READY, None, (), "Ready"),
    ("old generation: prefill and router go first", {"pairGeneration": 2},
     Observed((pod("decode", 1), pod("prefill", 1), pod("router", 1)), ports_complete=True),
     d.STEP_DELETE_PREFILL, None, ("p-router-1", "p-prefill-1"), "Pending"),
    ("old prefill still terminating: decode waits", {"pairGeneration": 2},
     Observed((pod("decode", 1), pod("prefill", 1, deleting=True)), ports_complete=True),
     d.STEP_WAIT_GONE, None, (), "Pending"),
    ("old prefill gone: decode goes", {"pairGeneration": 2},
     Observed((pod("decode", 1),), ports_complete=True),
     d.STEP_DELETE_DECODE, None, ("p-decode-1",), "Pending"),
    ("old decode terminating: nothing new yet", {"pairGeneration": 2, "phase": "Restarting"},
     Observed((pod("decode", 1, deleting=True),), ports_complete=True),
     d.STEP_WAIT_GONE, None, (), "Restarting"),
    ("decode failed while prefill runs", {"pairGeneration": 1},
     Observed((pod("decode", phase="Failed"), pod("prefill")), ports_complete=True, decode_listening=True),
     d.STEP_BROKEN, None, (), "Restarting"),
    ("decode vanished while prefill runs", {"pairGeneration": 1},
     Observed((pod("prefill"),), ports_complete=True),
     d.STEP_BROKEN, None, (), "Restarting"),
]


@pytest.mark.parametrize("name, status, observed, step, create, delete, phase", CASES, ids=[c[0] for c in CASES])
def test_next_step(name, status, observed, step, create, delete, phase):
    plan = next_step(SPEC, status, observed)
    assert (plan.step, plan.create, plan.delete, plan.phase) == (step, create, delete, phase)


def test_prefill_is_created_in_the_pass_after_decode_and_never_before():
    """Parallel start: prefill is created beside decode before decode is scheduled (it learns decode's address from
    the operator's push, once decode has one), never before decode exists; the pairing order is the connector's
    (prefill retries until decode accepts) and prefill's readiness waits for it. Replaces the rule that prefill waits
    until decode runs (its address, then fixed in prefill's environment at creation)."""
    plan = next_step(SPEC, {"pairGeneration": 1}, Observed((), ports_complete=True, decode_listening=False))
    assert plan.create == "decode"
    for decode in (pod("decode", phase="Pending", scheduled=False), pod("decode", phase="Pending"),
                   pod("decode", ready=False)):
        plan = next_step(SPEC, {"pairGeneration": 1}, Observed((decode,), ports_complete=True, decode_listening=False))
        assert plan.create == "prefill", decode


def test_spec_change_bumps_generation_and_replaces_in_order():
    new_spec = {**SPEC, "image": "img:2"}
    world = SimWorld(new_spec, status={"pairGeneration": 1})
    for role in ("decode", "prefill", "router"):
        world.pods[f"p-{role}-1"] = pod(role, 1)
    plans = simulate_until_ready(world)
    assert plans[0].rolled_out and plans[0].pair_generation == 2
    assert world.log == [
        "delete p-router-1", "delete p-prefill-1", "delete p-decode-1",
        "create p-decode-2", "create p-prefill-2", "create p-router-2",
    ]
    assert plans[-1].step == d.STEP_READY and world.status["pairGeneration"] == 2


def test_restartpolicy_change_is_not_a_rollout():
    assert spec_fingerprint({**SPEC, "restartPolicy": {"maxRestarts": 1}}) == H
    assert spec_fingerprint({**SPEC, "decode": {"tensorParallelSize": 2}}) != H


def test_fresh_pair_reaches_ready_decode_first():
    world = SimWorld(SPEC)
    plans = simulate_until_ready(world)
    assert [p.step for p in plans] == [
        d.STEP_CREATE_DECODE, d.STEP_CREATE_PREFILL, d.STEP_CREATE_ROUTER, d.STEP_READY,
    ]
    assert world.status["pairGeneration"] == 1


def test_ready_waits_for_the_listener_the_operator_saw():
    """Both engines and the router start at once, but the pair is not Ready until the operator's own probe saw
    decode's listener accept on every rank."""
    world = SimWorld(SPEC, listening=lambda p: False)
    plans = simulate_until_ready(world)
    assert plans[-1].step == d.STEP_WAIT_LISTENER and plans[-1].probe_decode
    assert {p.role for p in world.pods.values()} == {"decode", "prefill", "router"}


def test_restart_request_replaces_in_order():
    world = SimWorld(SPEC, status={"pairGeneration": 3})
    for role in ("decode", "prefill", "router"):
        world.pods[f"p-{role}-3"] = pod(role, 3)
    plans = simulate_until_ready(world, restart_reason="decode hung")
    assert plans[0].pair_generation == 4 and plans[0].phase == "Restarting"
    assert world.log[:3] == ["delete p-router-3", "delete p-prefill-3", "delete p-decode-3"]
    assert world.log[3] == "create p-decode-4" and plans[-1].step == d.STEP_READY


def test_status_lag_after_crash_uses_pod_generation():
    # status says 1 but pods of generation 2 exist (SIGKILL between create and status write)
    plan = next_step(SPEC, {"pairGeneration": 1},
                         Observed((pod("decode", 2),), ports_complete=True, decode_listening=True))
    assert plan.pair_generation == 2 and plan.step == d.STEP_CREATE_PREFILL


def test_podview_from_pod():
    raw = {
        "metadata": {"name": "x", "uid": "u", "labels": {LABEL_ROLE: "decode", LABEL_GENERATION: "3"},
                     "annotations": {ANNOTATION_SPEC_HASH: "h"}},
        "spec": {"nodeName": "n1"},
        "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}],
                   "containerStatuses": [{"restartCount": 2}]},
    }
    view = PodView.from_pod(raw)
    assert (view.role, view.generation, view.ready, view.ip, view.scheduled, view.restarts) == (
        "decode", 3, True, "127.0.0.1", True, 2)


def test_a_prefill_that_never_becomes_ready_waits_without_a_deadline():
    """Inside the startup window a slow model load is no failure: the plan stays WaitPrefillReady (no restart, no
    Ready) however often it is asked; only the kubelet's startupProbe (spec.startupTimeoutSeconds) ends it."""
    observed = Observed((pod("decode"), pod("prefill", ready=False), ROUTER_LOADING), ports_complete=True,
                        decode_listening=True)
    status = {"pairGeneration": 1, "phase": "PrefillStarting"}
    for _ in range(100):
        plan = next_step(SPEC, status, observed)
        assert (plan.step, plan.phase, plan.pair_generation) == (d.STEP_WAIT_PREFILL_READY, "PrefillStarting", 1)
        assert not plan.delete and plan.create is None and plan.broken_reason is None
        assert {c.type: c.status for c in plan.conditions}["Ready"] == "False"


def test_teardown_order_is_router_and_prefill_then_decode():
    """desired.teardown, the one definition of the order, used by replacements (Recreate step 2, a Surge rollout's
    old or rolled-back generation) and by a deleted pair (planner.deleted_pair_teardown through deletion_step, executed by pair_teardown.py)."""
    from pdpair.operator.decide.planner import deleted_pair_teardown

    decode, prefill, router = pod("decode"), pod("prefill"), pod("router")
    going = d.teardown([decode, prefill, router])
    assert going.front and going.delete == (router.name, prefill.name)  # decode waits
    prefill_going = pod("prefill", deleting=True)
    # a replacement waits until prefill is gone (a new decode must not race an old prefill) ...
    assert d.teardown([decode, prefill_going]) == d.Teardown((), front=True)
    # ... a deleted pair deletes decode once prefill is being deleted (nothing replaces it)
    assert deleted_pair_teardown([decode, prefill_going]) == (decode.name,)
    assert deleted_pair_teardown([decode, prefill, router]) == (router.name, prefill.name)
    assert d.teardown([decode]) == d.Teardown((decode.name,), front=False)
    assert d.teardown([pod("decode", deleting=True)]) == d.Teardown((), front=False)
    assert deleted_pair_teardown([]) == ()


def test_a_proven_listener_keeps_the_message_its_probe_wrote():
    """A Ready generation's listener is not probed again (listener_proven); its condition keeps the message the
    probe wrote instead of flipping to a generic one on the next pass (each flip was a status write on an idle
    pair: tests/e2e/test_operator_scale_idle.py)."""
    pods = (pod("decode"), pod("prefill"), pod("router"))
    probed = next_step(SPEC, {"pairGeneration": 1},
                       Observed(pods, ports_complete=True, decode_listening=True,
                                probe_message="10.0.0.1 accepts on 20000"))
    assert probed.step == d.STEP_READY
    status = {"pairGeneration": 1, "phase": "Ready",
              "conditions": [{"type": c.type, "status": c.status, "reason": c.reason, "message": c.message}
                             for c in probed.conditions]}
    later = next_step(SPEC, status, Observed(pods, ports_complete=True, decode_listening=False))
    assert later.step == d.STEP_READY and later.conditions == probed.conditions

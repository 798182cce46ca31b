"""The pure side of "a leased port in use on a node" (busy_ports.py) and the preflight in front of each hostNetwork
container's command (pods.py)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from tests.pod_commands import without_preflight
from pdpair.contract import ports_in_use_message
from pdpair.operator.decide import busy_ports
from pdpair.operator.model.config import PortPool
from pdpair.operator.model.observed import PodView
from pdpair.operator.build.pod_defaults import LEGACY_PREFLIGHT_CONTAINER, PREFLIGHT_COMMAND, PREFLIGHT_SEPARATOR
from pdpair.operator.build.pods import engine_pod, router_pod
from pdpair.operator.decide.port_blocks import assign, status_ports
from tests.port_blocks_support import spec_blocks
from tests.crd_defaults import with_crd_defaults

POOL = PortPool(20000, 20099)


def failed_pod(name="p-decode-g1", role="decode", generation=1, node="n2", *, init=None, main=None, last=None):
    """A pod as the API server shows it after the kubelet ran it: the termination messages where they land."""
    def status(container, message, key="state"):
        return {"name": container, key: {"terminated": {"exitCode": 1, "reason": "Error", "message": message}}}

    pod_status = {"phase": "Failed"}
    if init is not None:
        # a pod made by an operator that ran the preflight as an init container
        pod_status["initContainerStatuses"] = [status("model-fetch", "done"), status(LEGACY_PREFLIGHT_CONTAINER, init)]
    if main is not None:
        pod_status["containerStatuses"] = [status("engine", main)]
    if last is not None:
        pod_status["containerStatuses"] = [status("engine", last, key="lastState")]
    raw = {"metadata": {"name": name, "labels": {"pdpair.io/role": role, "pdpair.io/generation": str(generation)}},
           "spec": {"nodeName": node}, "status": pod_status}
    return PodView.from_pod(raw)


def test_the_preflight_report_is_read_from_an_init_container_too():
    pod = failed_pod(init=ports_in_use_message([20002, 20000], "another process on this node holds them"))
    [report] = busy_ports.reports([pod], 1)
    assert (report.role, report.pod, report.node, report.container, report.ports) == \
        ("decode", "p-decode-g1", "n2", LEGACY_PREFLIGHT_CONTAINER, (20000, 20002))
    assert "ports 20000 20002 in use on node n2" in report.describe()


@pytest.mark.parametrize("where", ["main", "last"])
def test_the_preflights_and_the_connectors_report_is_read_from_the_engine_container(where):
    pod = failed_pod(**{where: "Traceback ...\n" + ports_in_use_message([20001], "side-channel listener")})
    [report] = busy_ports.reports([pod], 1)
    assert report.container == "engine" and report.ports == (20001,)


def test_other_failures_and_other_generations_are_not_reports():
    crashed = failed_pod(main="RuntimeError: CUDA out of memory")
    old = failed_pod(name="p-decode-g1", generation=1, init=ports_in_use_message([20000]))
    assert busy_ports.reports([crashed], 1) == []
    assert busy_ports.reports([old], 2) == []  # a stale pod of an older generation says nothing about now
    assert busy_ports.reports([PodView("p-decode-g2", "decode", 2)], 2) == []  # no raw object: nothing known


@pytest.mark.parametrize("busy, held, fixed, quarantine, cannot, replaced", [
    ((20000,), {20000, 20001, 20002}, (), (20000,), (), False),  # ours and in the pool: quarantine and replace
    ((20000, 20001), {20001, 20005}, (), (20001,), (), False),  # 20000 already quarantined (a restarted operator)
    ((20000,), {20005, 20006}, (), (), (), True),  # already replaced: only the restart is left
    ((30000,), {30000, 20000}, (30000,), (), (30000,), False),  # a fixed router port cannot move
    ((8080,), {20000}, (), (), (8080,), False),  # outside the pool: not the operator's
])
def test_plan(busy, held, fixed, quarantine, cannot, replaced):
    got = busy_ports.plan(busy, held, POOL, fixed)
    assert (got.quarantine, got.fixed, got.replaced) == (quarantine, cannot, replaced)


def test_quarantine_ends_after_its_duration():
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert not busy_ports.quarantine_expired(start, 600, start + timedelta(seconds=599))
    assert busy_ports.quarantine_expired(start, 600, start + timedelta(seconds=600))
    assert not busy_ports.quarantine_expired(start.replace(tzinfo=None), 600, start + timedelta(seconds=1))  # naive=UTC
    assert busy_ports.quarantine_expired(None, 600, start)  # cannot tell: not held forever
    assert busy_ports.quarantine_expired(start, None, start)


# --- the preflight in front of the container's command ---------------------------------------------------------
def pair(host_network=True, engine_container=None, init_containers=None):
    template = {"spec": {"containers": [engine_container or {"name": "engine"}],
                         **({"initContainers": init_containers} if init_containers else {})}}
    return with_crd_defaults({
        "metadata": {"name": "demo", "namespace": "ns1", "uid": "uid-1"},
        "spec": {"model": "/m", "image": "img:1", "network": {"hostNetwork": host_network},
                 "connector": {"transport": "tcp"},
                 "decode": {"tensorParallelSize": 2, "template": template}, "prefill": {}}})


def leased(p):
    ports, nxt = [], 20000
    for block in spec_blocks(p["spec"]):
        ports += assign(block, nxt)
        nxt += block.count
    return status_ports(ports)


def test_every_port_the_pod_uses_is_checked_right_before_the_engine_starts():
    """The preflight runs in the engine's own container, after every init container of the template, and becomes
    the engine (exec): no init container of ours (its start and the kubelet's relist cost both engines of every
    pair start up to seconds)."""
    user_init = {"name": "model-fetch", "image": "busybox"}
    engine = {"name": "engine", "imagePullPolicy": "Never", "securityContext": {"runAsNonRoot": True},
              "resources": {"limits": {"nvidia.com/gpu": 2, "memory": "8Gi"}, "requests": {"cpu": 4}}}
    p = pair(engine_container=engine, init_containers=[user_init])
    pod = engine_pod(p, "decode", 1, leased(p), "h")
    assert pod["spec"]["initContainers"] == [user_init]
    main = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    command = main["command"]
    assert command[:len(PREFLIGHT_COMMAND)] == PREFLIGHT_COMMAND
    cut = command.index(PREFLIGHT_SEPARATOR)
    assert sorted(map(int, command[len(PREFLIGHT_COMMAND):cut])) == sorted(c["containerPort"] for c in main["ports"])
    assert len(main["ports"]) == 4  # http, metrics, two side channels (TP 2)
    engine_argv = without_preflight(command)
    assert engine_argv == command[cut + 1:] and engine_argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]


def test_router_gets_it_too_and_a_pod_network_does_not():
    p = pair()
    ports = leased(p)
    router = router_pod(p, 1, ports, "h", "10.0.0.1", "10.0.0.2")
    command = router["spec"]["containers"][0]["command"]
    assert command[len(PREFLIGHT_COMMAND):command.index(PREFLIGHT_SEPARATOR)] == \
        [str(router["spec"]["containers"][0]["ports"][0]["containerPort"])]
    assert without_preflight(command)[:3] == ["python", "-m", "pdpair.router"]
    private = pair(host_network=False)
    pod = engine_pod(private, "decode", 1, leased(private), "h")
    assert "initContainers" not in pod["spec"]
    command = pod["spec"]["containers"][0]["command"]
    assert command[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"] and without_preflight(command) == command


def test_a_template_init_container_named_like_the_old_preflight_is_dropped():
    p = pair(init_containers=[{"name": LEGACY_PREFLIGHT_CONTAINER, "image": "evil", "command": ["true"]},
                              {"name": "model-fetch", "image": "busybox"}])
    inits = engine_pod(p, "decode", 1, leased(p), "h")["spec"]["initContainers"]
    assert [c["name"] for c in inits] == ["model-fetch"]

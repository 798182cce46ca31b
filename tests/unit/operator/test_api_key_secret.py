"""spec.apiKeySecret on the operator's side: the CRD's schema for it, VLLM_API_KEY by secretKeyRef on prefill, decode
and router (never a value, never a flag), the rollout a change of it makes, and a pod that cannot start because the
Secret or its key is missing, named in the pair's status. Pure: manifests, plans and the CRD file; no cluster."""

from __future__ import annotations

import copy
import dataclasses
import json

import jsonschema
import pytest

from pdpair import contract as c
from pdpair.operator.build.pods import engine_pod, router_pod
from pdpair.operator.decide import health, planner
from pdpair.operator.decide import recreate as d
from pdpair.operator.model.pair_spec import OMITTED_WHEN_ABSENT, POD_SPEC_FIELDS, spec_fingerprint
from pdpair.operator.model.conditions import FALSE, TRUE, Condition
from pdpair.operator.model.observed import Observed, PodView
from pdpair.operator.model.spec_fields import MissingDefaultedField, api_key_secret
from tests.crd_defaults import spec_schema, with_crd_defaults
from tests.unit.operator.test_pods import PAIR, leased

SECRET = {"name": "demo-api-key"}


def with_key(pair: dict, secret: dict | None = SECRET) -> dict:
    """`pair` as the apiserver returns it with spec.apiKeySecret set (the CRD's default key filled in)."""
    out = copy.deepcopy(pair)
    out["spec"]["apiKeySecret"] = copy.deepcopy(secret)
    return with_crd_defaults(out)


def all_pods(pair: dict) -> dict[str, dict]:
    return {"decode": engine_pod(pair, "decode", 1, leased(), "h"),
            "prefill": engine_pod(pair, "prefill", 1, leased(), "h", peer_host="10.0.0.1"),
            "router": router_pod(pair, 1, leased(), "h", "10.0.0.2", "10.0.0.1")}


def main_env(pod: dict) -> dict[str, dict]:
    return {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}


# --- the CRD ------------------------------------------------------------------------------------------------------
def test_the_crd_defaults_the_key_and_bounds_the_name_and_key():
    """The field's schema: `name` required, a DNS-1123 subdomain of at most 253; `key` defaults to api-key and is a
    Secret key name; the pattern, length and required checks run here with jsonschema (the CEL rules only on a real
    apiserver: tests/e2e/test_crd_validation.py). Cost: under 0.1 s."""
    schema = spec_schema()["properties"]["apiKeySecret"]
    assert schema["required"] == ["name"] and "default" not in schema  # absent stays absent: no key
    assert schema["properties"]["key"]["default"] == "api-key"
    assert "VLLM_API_KEY" in schema["description"] and "kubectl create secret generic" in schema["description"]
    plain = copy.deepcopy(schema)
    for node in (plain, *plain["properties"].values()):
        node.pop("x-kubernetes-validations", None)
    for good in ({"name": "a"}, {"name": "my-key.v2", "key": "token"}, {"name": "k" * 253, "key": ".hidden_1-x"}):
        jsonschema.validate(good, plain)
    for bad in ({}, {"key": "api-key"}, {"name": "My-Key"}, {"name": "-key"}, {"name": "key-"}, {"name": "a..b"},
                {"name": ""}, {"name": "k" * 254}, {"name": "a", "key": ""}, {"name": "a", "key": "a/b"},
                {"name": "a", "key": "a b"}, {"name": "a", "key": "k" * 254}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, plain)
    [key_rule] = schema["properties"]["key"]["x-kubernetes-validations"]
    assert key_rule["rule"] == "self != '.' && !self.startsWith('..')"
    assert key_rule["message"].startswith("spec.apiKeySecret.key must not be '.'")
    assert with_key(PAIR)["spec"]["apiKeySecret"] == {"name": "demo-api-key", "key": "api-key"}


def test_the_crd_refuses_an_api_key_flag_beside_the_secret():
    """With spec.apiKeySecret, `--api-key` in either role's args is refused at admission (vLLM would take the flag's
    key over the Secret's and refuse the router's): the spec-level rule names the field. Cost: milliseconds."""
    [rule] = [r for r in spec_schema()["x-kubernetes-validations"] if r.get("fieldPath") == ".apiKeySecret"]
    assert rule["rule"].startswith("!has(self.apiKeySecret) || ")
    for role in ("prefill", "decode"):
        for spelling in ("'--api-k'", "'--api_k'"):
            assert f"self.{role}.args.exists(a, a.startsWith('--api-k') || a.startsWith('--api_k'))" in rule["rule"]
            assert spelling in rule["rule"]
    assert "spec.apiKeySecret" in rule["message"] and "--api-key" in rule["message"]


def test_spec_fields_reads_the_secret_or_none():
    """api_key_secret: None without the field, (name, key) with it; a spec that skipped the CRD's default is an
    error naming the field, not a second default. Cost: milliseconds."""
    assert api_key_secret(PAIR["spec"]) is None
    assert api_key_secret(with_key(PAIR)["spec"]) == ("demo-api-key", "api-key")
    assert api_key_secret(with_key(PAIR, {"name": "s", "key": "k"})["spec"]) == ("s", "k")
    with pytest.raises(MissingDefaultedField, match="spec.apiKeySecret.key"):
        api_key_secret({**PAIR["spec"], "apiKeySecret": {"name": "s"}})


# --- the pods -------------------------------------------------------------------------------------------------------
def test_every_container_of_the_pair_takes_the_key_from_the_secret():
    """prefill, decode and router: VLLM_API_KEY from the Secret by secretKeyRef (name and key as written), never a
    value; nothing of it in any command line. Cost: milliseconds."""
    pair = with_key(PAIR, {"name": "demo-api-key", "key": "token"})
    for role, pod in all_pods(pair).items():
        entry = main_env(pod)[c.ENV_API_KEY]
        assert entry == {"name": c.ENV_API_KEY,
                         "valueFrom": {"secretKeyRef": {"name": "demo-api-key", "key": "token"}}}, role
        command = " ".join(pod["spec"]["containers"][0]["command"])
        assert "api-key" not in command and "api_key" not in command and "demo-api-key" not in command, role
        assert "args" not in pod["spec"]["containers"][0]


def test_without_the_field_no_container_gets_a_key():
    """Today's pods: no VLLM_API_KEY anywhere, and no reference to any API key Secret. Cost: milliseconds."""
    for role, pod in all_pods(PAIR).items():
        assert c.ENV_API_KEY not in main_env(pod), role
        assert "api-key" not in json.dumps(pod), role


def test_the_operator_entry_wins_over_a_user_value():
    """A user env VLLM_API_KEY (a value, in the pod spec for anyone to read) is replaced by the operator's reference
    when spec.apiKeySecret is set, so the engines and the router agree on one key. Cost: milliseconds."""
    pair = with_key(PAIR)
    pair["spec"]["decode"]["env"] = [{"name": "FOO", "value": "1"}, {"name": c.ENV_API_KEY, "value": "inline"}]
    pair["spec"]["router"]["template"] = {"spec": {"containers": [
        {"name": "router", "env": [{"name": c.ENV_API_KEY, "value": "inline"}]}]}}
    for role, pod in all_pods(pair).items():
        entries = [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == c.ENV_API_KEY]
        assert entries == [{"name": c.ENV_API_KEY,
                            "valueFrom": {"secretKeyRef": {"name": "demo-api-key", "key": "api-key"}}}], role
        assert "inline" not in json.dumps(pod), role


# --- the rollout ------------------------------------------------------------------------------------------------
def test_the_field_is_in_the_fingerprint_only_when_set():
    """apiKeySecret is a pod field: setting it, changing its name or key, or removing it changes the fingerprint the
    pods carry (pdpair.io/spec-hash), so it rolls out like any template change; absent (or null) it leaves the
    fingerprint of every pair without it as it was (test_spec_fingerprint.py pins the examples'). Cost: milliseconds."""
    assert "apiKeySecret" in POD_SPEC_FIELDS and "apiKeySecret" in OMITTED_WHEN_ABSENT
    base = PAIR["spec"]
    hashes = {spec_fingerprint(base),
              spec_fingerprint(with_key(PAIR)["spec"]),
              spec_fingerprint(with_key(PAIR, {"name": "other-key"})["spec"]),
              spec_fingerprint(with_key(PAIR, {"name": "demo-api-key", "key": "token"})["spec"])}
    assert len(hashes) == 4
    assert spec_fingerprint({**base, "apiKeySecret": None}) == spec_fingerprint(base)


def test_setting_the_key_on_a_serving_pair_rolls_it_out():
    """The planner, given the Ready pods of a pair without a key and its spec with one: a new generation, the old
    pods replaced in order (prefill and router first). Cost: milliseconds."""
    spec = {"model": "m", "image": "img:1", "router": {"enabled": True, "replicas": 1}}
    old = spec_fingerprint(spec)
    pods = tuple(PodView(f"p-{role}-1", role, 1, old, "Running", True, "10.0.0.1", False, True, 0, f"uid-{role}",
                         raw={"metadata": {"name": f"p-{role}-1"}, "status": {"phase": "Running"}})
                 for role in ("decode", "prefill", "router"))
    observed = Observed(pods, ports_complete=True, decode_listening=True, meta_generation=2)
    keyed = {**spec, "apiKeySecret": {"name": "demo-api-key", "key": "api-key"}}
    assert planner.plan(spec, {"pairGeneration": 1}, observed, 1e6).steps.step == d.STEP_READY
    rolled = planner.plan(keyed, {"pairGeneration": 1}, observed, 1e6).steps
    assert rolled.rolled_out and rolled.pair_generation == 2 and rolled.step == d.STEP_DELETE_PREFILL


# --- a missing Secret -----------------------------------------------------------------------------------------------
MISSING = 'secret "demo-api-key" not found'


def stuck_raw(name: str, message: str = MISSING, container: str = "engine") -> dict:
    """A pod as the kubelet reports it when the Secret its env names is missing: Pending, scheduled, the container
    waiting with CreateContainerConfigError (the kubelet retries; the pod starts once the Secret exists)."""
    return {"metadata": {"name": name}, "spec": {"nodeName": "n1"},
            "status": {"phase": "Pending", "podIP": "10.0.0.9",
                       "conditions": [{"type": "PodScheduled", "status": "True"}],
                       "containerStatuses": [{"name": container, "ready": False, "restartCount": 0, "started": False,
                                              "state": {"waiting": {"reason": "CreateContainerConfigError",
                                                                    "message": message}}}]}}


def test_a_pod_stuck_on_a_missing_secret_is_named_and_is_no_restart_reason():
    """pod_fact: no restart reason (a restart would meet the same error; the kubelet retries by itself), a message
    naming the pod, the container and the kubelet's words (the Secret's name); container_config_error is "" for a
    pod that merely waits to be created or pulls its image. Cost: milliseconds."""
    fact = health.pod_fact("decode", stuck_raw("demo-decode-g1"))
    assert fact.reason is None and not fact.pending_scheduling and fact.pod == "demo-decode-g1"
    assert fact.message == ('decode pod demo-decode-g1: container engine cannot be created '
                            f'(CreateContainerConfigError): {MISSING}')
    creating = stuck_raw("x")
    creating["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "ContainerCreating"}}
    assert health.container_config_error(creating) == "" and health.container_config_error(None) == ""
    init = stuck_raw("x", "couldn't find key api-key in Secret ns1/demo-api-key", container="setup")
    init["status"]["initContainerStatuses"] = init["status"].pop("containerStatuses")
    assert "container setup cannot be created" in health.container_config_error(init)
    verdict = health.pair_verdict([], {"decode": stuck_raw("demo-decode-g1"), "prefill": None})
    assert verdict.reason == health.REASON_POD_VANISHED  # the other facts keep their precedence


def test_the_pair_status_names_the_missing_secret():
    """A pair whose decode and prefill wait on a missing Secret: the plan waits (no restart), its message and the
    Ready condition (reason CreateContainerConfigError) name both pods and the Secret; once the containers start
    the ordinary message is back. Cost: milliseconds."""
    spec = {"model": "m", "image": "img:1", "router": {"enabled": True},
            "apiKeySecret": {"name": "demo-api-key", "key": "api-key"}}
    h = spec_fingerprint(spec)

    def view(role: str, raw: dict) -> PodView:
        return PodView.from_pod({**raw, "metadata": {**raw["metadata"], "labels": {
            c.LABEL_ROLE: role, c.LABEL_GENERATION: "1"}, "annotations": {c.ANNOTATION_SPEC_HASH: h}}})

    pods = (view("decode", stuck_raw("p-decode-g1")), view("prefill", stuck_raw("p-prefill-g1")))
    decided = planner.plan(spec, {"pairGeneration": 1}, Observed(pods, ports_complete=True, meta_generation=1), 1e6)
    assert decided.outcome == planner.OUTCOME_STEP and decided.restart is None
    steps = decided.steps
    assert steps.step == d.STEP_WAIT_DECODE_RUNNING and not steps.delete and not steps.create
    assert steps.message.startswith("waiting for the decode pod to run; decode pod p-decode-g1: container engine")
    assert steps.message.count(MISSING) == 2 and "prefill pod p-prefill-g1" in steps.message
    [ready] = [cond for cond in steps.conditions if cond.type == c.COND_READY]
    assert (ready.status, ready.reason) == (FALSE, "CreateContainerConfigError")
    assert ready.message.startswith("decode pod p-decode-g1: container engine cannot be created") and MISSING in ready.message

    running = {**stuck_raw("p-decode-g1"), "status": {"phase": "Pending", "containerStatuses": [
        {"name": "engine", "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}]}}
    calm = planner.plan(spec, {"pairGeneration": 1},
                        Observed((view("decode", running), pods[1]), ports_complete=True, meta_generation=1), 1e6)
    assert calm.steps.message.count(MISSING) == 1  # only prefill is still stuck
    [ready] = [cond for cond in calm.steps.conditions if cond.type == c.COND_READY]
    assert ready.message.startswith("prefill pod p-prefill-g1")


def test_a_surge_rollout_stuck_on_a_missing_secret_says_so_in_progressing():
    """While the serving generation keeps Ready True, a rollout's new pod stuck on its configuration is named in the
    Progressing condition (its status and reason kept) and the message. Cost: milliseconds."""
    steps = d.Plan("RollingOut", 2, c.PHASE_READY,
                   (Condition(c.COND_READY, TRUE, "Ready", "serving"),
                    Condition(c.COND_PROGRESSING, TRUE, "RollingOut", "generation 3 starting")), "rolling out")
    pod = PodView.from_pod({**stuck_raw("p-decode-g3"), "metadata": {"name": "p-decode-g3", "labels": {
        c.LABEL_ROLE: "decode", c.LABEL_GENERATION: "3"}}})
    named = planner.naming_config_errors(steps, (pod,))
    ready, progressing = named.conditions
    assert ready == steps.conditions[0]
    assert (progressing.status, progressing.reason) == (TRUE, "RollingOut")
    assert progressing.message.startswith("generation 3 starting; decode pod p-decode-g3") and MISSING in progressing.message
    assert MISSING in named.message
    deleting = dataclasses.replace(pod, deleting=True)  # a pod on its way out is not named
    assert planner.naming_config_errors(steps, (deleting,)) is steps

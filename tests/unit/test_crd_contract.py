"""The CRD file agrees with pdpair.contract (names, phases, conditions, roles, transports, env prefix).

Parses the YAML only; tests/e2e/test_crd_validation.py checks the same file on a real apiserver.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdpair import contract
from pdpair.operator.build import engine_args

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "charts" / "pdpair" / "crds" / "inferencepairs.pdpair.io.yaml"
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRD is 7,700 lines


@pytest.fixture(scope="module")
def crd() -> dict:
    return yaml.load(CRD_PATH.read_text(), Loader=YAML_LOADER)


@pytest.fixture(scope="module")
def version(crd) -> dict:
    [only] = [v for v in crd["spec"]["versions"] if v["name"] == contract.VERSION]
    return only


@pytest.fixture(scope="module")
def spec_schema(version) -> dict:
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


@pytest.fixture(scope="module")
def status_schema(version) -> dict:
    return version["schema"]["openAPIV3Schema"]["properties"]["status"]


def test_identity_matches_contract(crd):
    names = crd["spec"]["names"]
    assert crd["metadata"]["name"] == f"{contract.PLURAL}.{contract.GROUP}"
    assert crd["spec"]["group"] == contract.GROUP
    assert crd["spec"]["scope"] == "Namespaced"
    assert names["kind"] == contract.KIND
    assert names["plural"] == contract.PLURAL
    assert names["singular"] == contract.SINGULAR
    assert names["shortNames"] == [contract.SHORT_NAME]


def test_single_served_storage_version_with_status_subresource(crd, version):
    assert [v["name"] for v in crd["spec"]["versions"]] == [contract.VERSION]
    assert version["served"] is True and version["storage"] is True
    assert version["subresources"] == {"status": {}}


def test_phase_enum_is_contract_phases(status_schema):
    assert tuple(status_schema["properties"]["phase"]["enum"]) == contract.PHASES


def test_condition_types_are_contract_conditions(status_schema):
    conditions = status_schema["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    item = conditions["items"]
    assert tuple(item["properties"]["type"]["enum"]) == contract.CONDITIONS
    # metav1.Condition shape
    assert set(item["required"]) == {"type", "status", "lastTransitionTime", "reason", "message"}
    assert item["properties"]["status"]["enum"] == ["True", "False", "Unknown"]


def test_port_roles_cover_contract_roles(status_schema):
    port = status_schema["properties"]["ports"]["items"]["properties"]
    assert set(port["role"]["enum"]) == {*contract.ROLES, contract.ROLE_ROUTER}


def test_transport_enum_is_contract_transports(spec_schema):
    transport = spec_schema["properties"]["connector"]["properties"]["transport"]
    assert tuple(transport["enum"]) == contract.TRANSPORTS
    assert transport["default"] in contract.TRANSPORTS


def test_both_roles_share_one_schema(spec_schema):
    props = spec_schema["properties"]
    assert set(contract.ROLES) <= set(props)
    assert props[contract.ROLE_PREFILL] == props[contract.ROLE_DECODE]


def test_env_rule_reserves_the_prefix_of_every_contract_env_name(spec_schema):
    env = spec_schema["properties"][contract.ROLE_DECODE]["properties"]["env"]
    rules = " ".join(r["rule"] for r in env["items"]["x-kubernetes-validations"])
    prefixes = {name.split("_", 1)[0] + "_" for name in contract.POD_ENV}
    assert prefixes == {"PDPAIR_"}
    assert "startsWith('PDPAIR_')" in rules


def test_args_rules_are_the_generated_owned_flag_rules(spec_schema):
    """The args rules are engine_args' (one source of truth); regenerate with python -m pdpair.operator.build.engine_args."""
    for role in contract.ROLES:
        args = spec_schema["properties"][role]["properties"]["args"]
        assert args["x-kubernetes-validations"] == [
            {"rule": engine_args.LAST_ARG_RULE, "message": engine_args.LAST_ARG_MESSAGE}]
        assert args["items"]["x-kubernetes-validations"] == [
            {"rule": engine_args.ARG_RULE, "messageExpression": engine_args.ARG_MESSAGE_EXPRESSION,
             "message": engine_args.ARG_MESSAGE},
            {"rule": engine_args.ENV_REFERENCE_RULE, "messageExpression": engine_args.ENV_REFERENCE_MESSAGE_EXPRESSION,
             "message": engine_args.ENV_REFERENCE_MESSAGE}]
        # bounded, so the apiserver's cost estimate for the regex stays low
        assert args["maxItems"] <= 64 and args["items"]["maxLength"] <= 1024
    for flag in engine_args.OWNED_FLAGS:
        for option in (flag.option, *flag.aliases):
            assert option in engine_args.ARG_MESSAGE and option in engine_args.ARG_MESSAGE_EXPRESSION


def _gen_crd():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_crd", REPO / "hack" / "gen_crd.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shorthand_resources_and_tolerations_refuse_what_a_pod_would_as_the_templates_do(spec_schema):
    """spec.<role>.resources and .tolerations carry hack/gen_crd.py's rules (the templates' rules come from there)."""
    gen = _gen_crd()
    field = "spec.<role>.resources"
    for role in (contract.ROLE_PREFILL, contract.ROLE_DECODE):
        props = spec_schema["properties"][role]["properties"]
        resources = props["resources"]
        assert resources["x-kubernetes-validations"] == gen.resources_rules(field)
        for name in ("requests", "limits"):
            quantity = resources["properties"][name]["additionalProperties"]
            assert quantity["x-kubernetes-validations"] == gen.quantity_rules(field)
            assert quantity["maxLength"] <= gen.QUANTITY_MAX_LENGTH  # bounds the cost estimate of quantity()
            assert resources["properties"][name]["maxProperties"] <= gen.MAX_RESOURCES
        item_rules = props["tolerations"]["items"]["x-kubernetes-validations"]
        assert [r for r in item_rules if r.get("fieldPath") == ".tolerationSeconds"] == gen.toleration_rules()


def test_printer_columns(version):
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert columns["Phase"]["jsonPath"] == ".status.phase"
    assert columns["Ready"]["jsonPath"] == f'.status.conditions[?(@.type=="{contract.COND_READY}")].status'
    assert columns["Restarts"]["jsonPath"] == ".status.restarts"
    assert columns["Decode Port"]["jsonPath"] == f'.status.ports[?(@.name=="{contract.ROLE_DECODE}-sidechannel-0")].port'
    assert columns["Age"]["jsonPath"] == ".metadata.creationTimestamp"
    assert columns["Rollout"]["jsonPath"] == ".status.rollout.phase"  # a Surge rollout's phase, in -o wide
    default_columns = [c["name"] for c in version["additionalPrinterColumns"] if c.get("priority", 0) == 0]
    assert columns["P"]["jsonPath"] == ".status.prefill.readyOfDesired"  # xPyD: ready/desired per role
    assert columns["D"]["jsonPath"] == ".status.decode.readyOfDesired"
    assert default_columns == ["Phase", "Ready", "P", "D", "Restarts", "Decode Port", "Age"]


def test_pair_name_is_a_short_dns_1035_label(version):
    name = version["schema"]["openAPIV3Schema"]["properties"]["metadata"]["properties"]["name"]
    assert name["maxLength"] + len("-prefill-") + 9 <= 63  # room for a role and a 9-digit generation suffix
    assert name["pattern"] == "^[a-z]([-a-z0-9]*[a-z0-9])?$"


def _walk(schema: dict, path: str, into_templates: bool = True):
    yield path, schema
    if not into_templates and path.endswith(".template"):
        return
    for name, child in schema.get("properties", {}).items():
        yield from _walk(child, f"{path}.{name}", into_templates)
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]", into_templates)
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}", into_templates)


def test_every_spec_and_status_leaf_is_bounded(spec_schema, status_schema):
    """Strings carry maxLength or enum or a bounded format, arrays maxItems, maps maxProperties, integers a range.

    The pod templates are core/v1's own schema, generated by hack/gen_crd.py (tests/e2e/test_crd_generation.py
    checks it): Kubernetes bounds those fields when the operator creates the pod, not in its OpenAPI."""
    unbounded = []
    for path, node in [*_walk(spec_schema, "spec", into_templates=False), *_walk(status_schema, "status")]:
        if node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-int-or-string"):
            continue
        kind = node.get("type")
        if kind == "string" and not ({"maxLength", "enum"} & node.keys() or node.get("format") == "date-time"):
            unbounded.append(path)
        elif kind == "array" and "maxItems" not in node:
            unbounded.append(path)
        elif kind == "integer" and "minimum" not in node:
            unbounded.append(path)
        elif kind == "object" and "additionalProperties" in node and "maxProperties" not in node:
            unbounded.append(path)
    assert unbounded == []


def test_every_validation_rule_has_a_message_that_names_a_field(version):
    schema = version["schema"]["openAPIV3Schema"]
    rules = [r for _, node in _walk(schema, "") for r in node.get("x-kubernetes-validations", [])]
    assert len(rules) >= 10
    for rule in rules:
        assert "message" in rule, rule["rule"]
        # a field name such as spec.x.y, metadata.name, args, env[].name, tolerations[].value
        assert any(word in rule["message"] for word in ("spec.", "args", "env[]", "tolerations[]",
                                                         "status.ports", "template.", "containers[")), rule["message"]


def test_health_status_schema_and_column(version, status_schema):
    from pdpair.operator.decide import health
    from pdpair.operator.decide import health_status

    schema = status_schema["properties"]["health"]["properties"]
    assert tuple(schema["verdict"]["enum"]) == health_status.VERDICTS
    assert tuple(schema["reason"]["enum"]) == ("", *health.RESTART_REASONS)
    roles = schema["roles"]["properties"]
    assert set(roles) == {contract.ROLE_DECODE, contract.ROLE_PREFILL} and roles["decode"] == roles["prefill"]
    assert roles["decode"]["properties"]["state"]["enum"] == [s.value for s in health.PodState]
    # xPyD: the instances beyond the first, keyed <role>-<index>, each entry a roles entry (the apiserver prunes what
    # the schema does not declare, so a missing key here would silently drop what the watch writes)
    instances = schema["instances"]
    assert instances["additionalProperties"] == roles["decode"]
    assert instances["maxProperties"] >= 2 * (contract.MAX_REPLICAS - 1)
    assert schema["pod"]["type"] == "string" and schema["pod"]["maxLength"] == 253
    column = next(c for c in version["additionalPrinterColumns"] if c["name"] == "KV Health")
    assert (column["jsonPath"], column["priority"]) == (".status.health.verdict", 1)
    column = next(c for c in version["additionalPrinterColumns"] if c["name"] == "Decode Deficit")
    assert (column["jsonPath"], column["priority"]) == (".status.health.roles.decode.deficit", 1)


def test_every_key_the_health_watch_writes_is_in_the_schema(status_schema):
    """What observe writes for an unhealthy 1P2D pair (roles, instances, pod) is declared, key by key."""
    from pdpair.operator.decide import health
    from pdpair.operator.decide import health_status

    def scraped(role, instance):
        target = health.ScrapeTarget(role, f"p-{role}-g1-{instance}", "10.0.0.1", 20001, instance)
        metrics = health.PodMetrics({"peer": 2.0}, 40.0, 30.0, 1, 0.0, 3.0)
        return health.PodScrape(target, health.PodState.HUNG, "hung", metrics)

    written, _ = health_status.observe(None, 1, [scraped("prefill", 0), scraped("decode", 0), scraped("decode", 1)],
                                {"prefill": {"metadata": {"name": "p"}, "status": {"phase": "Running"}},
                                 "decode": {"metadata": {"name": "d"}, "status": {"phase": "Running"}}})
    schema = status_schema["properties"]["health"]
    assert set(written) <= set(schema["properties"]) and written["pod"] and written["instances"]
    entry = schema["properties"]["roles"]["properties"]["decode"]["properties"]
    for table in (written["roles"], written["instances"]):
        for value in table.values():
            assert set(value) <= set(entry), set(value) - set(entry)


# --- InferencePairRole: the per-role scale object (docs/xpyd.md section 2) ------------------------------------------
ROLE_CRD_PATH = REPO / "charts" / "pdpair" / "crds" / f"{contract.ROLE_OBJECT_PLURAL}.{contract.GROUP}.yaml"


@pytest.fixture(scope="module")
def role_crd() -> dict:
    return yaml.load(ROLE_CRD_PATH.read_text(), Loader=YAML_LOADER)


@pytest.fixture(scope="module")
def role_version(role_crd) -> dict:
    [only] = role_crd["spec"]["versions"]
    assert only["name"] == contract.VERSION and only["served"] is True and only["storage"] is True
    return only


def test_role_crd_identity_matches_contract(role_crd):
    names = role_crd["spec"]["names"]
    assert role_crd["metadata"]["name"] == f"{contract.ROLE_OBJECT_PLURAL}.{contract.GROUP}"
    assert role_crd["spec"]["group"] == contract.GROUP
    assert role_crd["spec"]["scope"] == "Namespaced"
    assert names["kind"] == contract.ROLE_OBJECT_KIND
    assert names["plural"] == contract.ROLE_OBJECT_PLURAL
    assert names["singular"] == contract.ROLE_OBJECT_SINGULAR
    assert names["shortNames"] == [contract.ROLE_OBJECT_SHORT_NAME]


def test_role_crd_has_the_scale_subresource_on_spec_and_status(role_version):
    assert role_version["subresources"] == {
        "status": {},
        "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                  "labelSelectorPath": ".status.selector"},
    }


def test_role_crd_spec_pair_and_role_are_immutable_and_replicas_bounded(role_version):
    schema = role_version["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]
    assert set(spec["required"]) == {"pair", "role", "replicas"}
    props = spec["properties"]
    for field in ("pair", "role"):
        assert [r["rule"] for r in props[field]["x-kubernetes-validations"]] == ["self == oldSelf"]
    assert tuple(props["role"]["enum"]) == contract.ROLES
    assert props["pair"]["type"] == "string" and props["pair"]["maxLength"] == 253
    replicas = props["replicas"]
    assert replicas["type"] == "integer" and replicas["minimum"] == 1 and replicas["maximum"] == contract.MAX_REPLICAS
    status = schema["properties"]["status"]["properties"]
    assert status["replicas"]["type"] == status["desired"]["type"] == "integer"
    assert status["selector"]["type"] == "string"


def test_role_crd_printer_columns(role_version):
    columns = {c["name"]: c["jsonPath"] for c in role_version["additionalPrinterColumns"]}
    assert columns == {"Pair": ".spec.pair", "Role": ".spec.role", "Desired": ".spec.replicas",
                       "Ready": ".status.replicas", "Age": ".metadata.creationTimestamp"}


def test_the_chart_installs_exactly_the_two_crds():
    found = sorted(p.name for p in (REPO / "charts" / "pdpair" / "crds").glob("*.yaml"))
    assert found == sorted([CRD_PATH.name, ROLE_CRD_PATH.name])


# --- spec.scaling: the P:D ratio band (operator/ratio_band.py) -----------------------------------------------------
def test_scaling_ratio_is_an_optional_bounded_band_with_a_follower_enum(spec_schema, status_schema):
    scaling = spec_schema["properties"]["scaling"]
    assert "default" not in scaling  # absent = no band: every pair made before the field is unchanged
    ratio = scaling["properties"]["ratio"]
    assert ratio["required"] == ["min", "max"]
    for end in ("min", "max"):
        bound = ratio["properties"][end]
        assert bound["type"] == "number" and bound["minimum"] == 0 and bound["exclusiveMinimum"] is True
        assert bound["maximum"] == contract.MAX_REPLICAS  # 16 prefill for 1 decode is the most there can be
    [rule] = ratio["x-kubernetes-validations"]
    assert rule["rule"] == "self.max >= self.min" and "spec.scaling.ratio.max must be >= spec.scaling.ratio.min" in \
        rule["message"]
    follower = scaling["properties"]["follower"]
    assert tuple(follower["enum"]) == contract.ROLES and follower["default"] == contract.ROLE_PREFILL
    record = status_schema["properties"]["scaling"]["properties"]
    assert tuple(record["leader"]["enum"]) == tuple(record["follower"]["enum"]) == contract.ROLES
    for key in ("leaderReplicas", "followerReplicas", "conflictReplicas"):
        assert record[key]["maximum"] == contract.MAX_REPLICAS

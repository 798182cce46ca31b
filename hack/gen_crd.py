#!/usr/bin/env python3
"""Write the pod-template schemas into the InferencePair CRD from the apiserver's own OpenAPI (core/v1).

    python hack/gen_crd.py --kubeconfig /tmp/c1/kubeconfig          # a running apiserver of the pinned release
    python hack/gen_crd.py --openapi api__v1_openapi.json            # the same document, read from a file
    python hack/gen_crd.py --kubeconfig ... --check                  # exit 1 (with a diff) if the CRD would change

The CRD file (charts/pdpair/crds/inferencepairs.pdpair.io.yaml) is hand-written except the regions between
`# >>> generated: <name>` and `# <<< generated: <name>`; this script rewrites only those, so comments, anchors and
the hand-written CEL rules elsewhere stay as they are. Each region is `template:` (a core/v1 PodTemplateSpec):

- $refs (and allOf wrappers) resolved; IntOrString and Quantity become x-kubernetes-int-or-string;
- descriptions dropped (like controller-gen maxDescLen=0): with them the three template schemas are 808 KB of
  JSON instead of 164 KB, half of etcd's 1.5 MiB object limit; defaults dropped (the apiserver defaults the pod itself), except on the
  keys of map lists, which a structural schema needs;
- x-kubernetes-list-type / list-map-keys / map-type kept (server-side apply merges by them);
  patch-strategy markers and unions dropped (not part of a CRD schema);
- metadata is labels and annotations only (plus name/namespace/generateName so they can be refused by name);
- ephemeralContainers left out (a pod cannot be created with them);
- PodSpec's `containers` is not required (the operator adds the engine container), and a few lists get a maxItems
  (the requests/limits maps a maxProperties, their quantities a maxLength) so the CEL rules that walk them have a
  bounded cost;
- the CEL rules that refuse operator-owned fields (restartPolicy, hostNetwork, the engine/router container's
  command, args, image, ports, PDPAIR_* env, port names, pdpair.io/ labels) are added at the matching schema node;
- so are the rules that refuse what no pod accepts (the pod's own validation would refuse it only when the operator
  creates the pod, after admission): a negative quantity in requests/limits, a request above its limit (containers,
  initContainers and the pod-level resources), a toleration's tolerationSeconds with an effect other than NoExecute.
  The role shorthands spec.<role>.resources and spec.<role>.tolerations carry the same rules, written by hand
  (tests/unit/test_crd_contract.py checks that they equal resources_rules() and toleration_rules()).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import pathlib
import re
import subprocess
import sys
from typing import Any

import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
CRD_PATH = REPO / "charts" / "pdpair" / "crds" / "inferencepairs.pdpair.io.yaml"
OPENAPI_PATH = "/openapi/v3/api/v1"
SCHEMAS = "#/components/schemas/"
POD_TEMPLATE = "io.k8s.api.core.v1.PodTemplateSpec"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
INT_OR_STRING = ("io.k8s.apimachinery.pkg.util.intstr.IntOrString", "io.k8s.apimachinery.pkg.api.resource.Quantity")
KEPT_EXTENSIONS = ("x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type")
# Bounds for the lists CEL rules walk (the apiserver refuses a rule whose worst-case cost is unbounded).
MAX_ITEMS = {"containers": 32, "initContainers": 32, "env": 256, "ports": 64}
# Resource names per requests/limits map, and the length of one quantity string: quantity() costs its argument's
# length, and an int-or-string without maxLength is costed as a 3 MiB string.
MAX_RESOURCES = 32
QUANTITY_MAX_LENGTH = 64
BEGIN = re.compile(r"^(?P<indent> *)# >>> generated: (?P<name>[a-z-]+)\b.*$")
END = "# <<< generated: {name}"

ENGINE = "engine"
ROUTER = "router"
# containerPort names the operator gives its own ports (pdpair.contract HTTP_PORT_NAME, METRICS_PORT_NAME, side-<rank>).
OWNED_PORT_NAMES = "p.name == 'http' || p.name == 'metrics' || p.name.startsWith('side-')"


def rule(rule_: str, message: str, field_path: str | None = None) -> dict[str, str]:
    out = {"rule": rule_}
    if field_path:
        out["fieldPath"] = field_path
    out["message"] = message
    return out


def metadata_rules() -> list[dict[str, str]]:
    return [
        rule("!has(self.name)", "template.metadata.name must not be set: the operator names the pods "
             "<pair>-<role>-g<generation>", ".name"),
        rule("!has(self.generateName)", "template.metadata.generateName must not be set: the operator names the pods",
             ".generateName"),
        rule("!has(self.namespace)", "template.metadata.namespace must not be set: the pods run in the pair's namespace",
             ".namespace"),
        rule("!has(self.labels) || self.labels.all(k, !k.startsWith('pdpair.io/'))",
             "template.metadata.labels must not use the pdpair.io/ prefix: the operator sets pdpair.io/pair, "
             "pdpair.io/pair-uid, pdpair.io/role and pdpair.io/generation", ".labels"),
        rule("!has(self.annotations) || self.annotations.all(k, !k.startsWith('pdpair.io/'))",
             "template.metadata.annotations must not use the pdpair.io/ prefix: the operator sets pdpair.io/spec-hash",
             ".annotations"),
    ]


def pod_spec_rules(main: str) -> list[dict[str, str]]:
    return [
        rule("!has(self.restartPolicy) || self.restartPolicy == 'Never'",
             "template.spec.restartPolicy must be Never (or unset): a crashed engine goes through the operator's "
             "ordered pair restart, never a lone kubelet restart", ".restartPolicy"),
        rule("!has(self.hostNetwork)",
             "template.spec.hostNetwork must not be set: set spec.network.hostNetwork (the port leases depend on it)",
             ".hostNetwork"),
        rule(f"!has(self.initContainers) || self.initContainers.all(c, c.name != '{main}')",
             f"template.spec.initContainers must not use the name {main}: it is the operator's {main} container",
             ".initContainers"),
    ]


def container_rules(main: str, shorthand: str) -> list[dict[str, str]]:
    """Rules on one item of template.spec.containers; `main` is the operator's container (engine or router)."""
    owned = f"the container named {main} is the operator's"
    return [
        rule(f"self.name != '{main}' || !has(self.command)",
             f"containers[{main}].command must not be set: {owned}, its command is built from the spec", ".command"),
        rule(f"self.name != '{main}' || !has(self.args)",
             f"containers[{main}].args must not be set: {shorthand}", ".args"),
        rule(f"self.name != '{main}' || !has(self.image)",
             f"containers[{main}].image must not be set: {owned}, it runs spec.image", ".image"),
        rule(f"self.name != '{main}' || !has(self.ports)",
             f"containers[{main}].ports must not be set: {owned}, its ports are leased by the operator", ".ports"),
        rule(f"self.name != '{main}' || !has(self.env) || self.env.all(e, !e.name.startsWith('PDPAIR_'))",
             f"containers[{main}].env must not set PDPAIR_* variables: the operator sets them", ".env"),
        rule(f"!has(self.ports) || self.ports.all(p, !has(p.name) || !({OWNED_PORT_NAMES}))",
             "containers[].ports[].name must not be http, metrics or side-<n>: the operator names its own ports so",
             ".ports"),
    ]


# A requests/limits value is an int-or-string: an int is a count, a string a quantity. Not a quantity at all is
# left to the schema's pattern (shorthand) or to the pod's validation (template), so these rules never error.
def _valid_quantity(v: str) -> str:
    return f"(type({v}) == int || isQuantity({v}))"


def _as_quantity(v: str) -> str:
    return f"(type({v}) == int ? quantity('0').add({v}) : quantity({v}))"


def quantity_rules(field: str) -> list[dict[str, str]]:
    """Rules on one value of a requests/limits map; `field` names the resources object in the message."""
    return [
        # (sign() is a global function in the apiserver's library, not the member its docs show: isLessThan instead)
        rule("type(self) == int ? self >= 0 : (!isQuantity(self) || !quantity(self).isLessThan(quantity('0')))",
             f"{field} requests and limits must not be negative: a pod refuses a negative quantity"),
    ]


def resources_rules(field: str) -> list[dict[str, str]]:
    """Rules on a core/v1 ResourceRequirements object; `field` names it in the message (e.g. spec.<role>.resources)."""
    req, lim = "self.requests[k]", "self.limits[k]"
    above = (f"k in self.limits && {_valid_quantity(req)} && {_valid_quantity(lim)} && "
             f"{_as_quantity(lim)}.isLessThan({_as_quantity(req)})")
    out = rule(f"!has(self.requests) || !has(self.limits) || !self.requests.exists(k, {above})",
               f"{field}.requests must not be above {field}.limits of the same resource: a pod refuses a request "
               "above its limit", ".requests")
    # One resource above its limit (the rule failed, so there is one), named once: a map's order is not stable, so a
    # second filter(...)[0] may name another. join() of them all is costed far above the budget.
    out["messageExpression"] = (
        f"'{field}.requests[' + self.requests.filter(k, {above})[0] + '] must not be above {field}.limits of the "
        "same resource: a pod refuses a request above its limit'")
    return [out]


def toleration_rules() -> list[dict[str, str]]:
    """Rules on one toleration (template.spec.tolerations[] and the shorthand spec.<role>.tolerations[])."""
    return [
        rule("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
             "tolerations[].tolerationSeconds needs tolerations[].effect NoExecute: it is how long the pod stays on "
             "a node after a NoExecute taint, and a pod refuses it with any other effect or none", ".tolerationSeconds"),
    ]


def bound_resources(node: dict[str, Any], field: str) -> None:
    """Bounds and rules on a core/v1 ResourceRequirements schema node (see MAX_RESOURCES)."""
    for name in ("requests", "limits"):
        quantities = node["properties"][name]
        quantities["maxProperties"] = MAX_RESOURCES
        quantities["additionalProperties"]["maxLength"] = QUANTITY_MAX_LENGTH
        quantities["additionalProperties"]["x-kubernetes-validations"] = quantity_rules(field)
    node["x-kubernetes-validations"] = resources_rules(field)


class Converter:
    """core/v1 OpenAPI v3 schema -> CRD structural schema (see the module docstring for what changes)."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.schemas = document["components"]["schemas"]

    def ref(self, name: str) -> dict[str, Any]:
        if name in INT_OR_STRING:
            return {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}
        if name == OBJECT_META:
            return self.template_metadata()
        return self.convert(self.schemas[name], (name,))

    def template_metadata(self) -> dict[str, Any]:
        string_map = {"type": "object", "additionalProperties": {"type": "string"}}
        return {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "generateName": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": copy.deepcopy(string_map),
                "annotations": copy.deepcopy(string_map),
            },
        }

    def convert(self, node: dict[str, Any], seen: tuple[str, ...], keep_default: bool = False) -> dict[str, Any]:
        if "$ref" in node:
            return self._ref(node["$ref"], seen)
        if "allOf" in node:
            if len(node["allOf"]) != 1:
                raise SystemExit(f"allOf with {len(node['allOf'])} entries is not handled ({seen[-1]})")
            merged = {k: v for k, v in node.items() if k != "allOf"}
            out = self.convert(node["allOf"][0], seen)
            if keep_default and "default" in merged:
                out["default"] = merged["default"]
            return out
        out: dict[str, Any] = {}
        for key in ("type", "format", "enum", "minimum", "maximum", "pattern", "maxLength", "minLength", "maxItems"):
            if key in node:
                out[key] = node[key]
        if keep_default and "default" in node:
            out["default"] = node["default"]
        if "oneOf" in node:
            raise SystemExit(f"oneOf outside IntOrString/Quantity is not handled ({seen[-1]})")
        if "properties" in node:
            out["type"] = "object"
            out["properties"] = {}
            for name, prop in node["properties"].items():
                out["properties"][name] = self.convert(prop, seen)
            if node.get("required"):
                out["required"] = list(node["required"])
        if "additionalProperties" in node and isinstance(node["additionalProperties"], dict):
            out["additionalProperties"] = self.convert(node["additionalProperties"], seen)
        if "items" in node:
            item = self.convert(node["items"], seen)
            for key in node.get("x-kubernetes-list-map-keys") or []:
                # A map list's keys must be required or defaulted in a structural schema.
                if key not in item.get("required", []):
                    default = self._default_of(node["items"], key)
                    if default is None:
                        raise SystemExit(f"map-list key {key} of {seen[-1]} is neither required nor defaulted")
                    item["properties"][key]["default"] = default
            out["items"] = item
        for key in KEPT_EXTENSIONS:
            if key in node:
                out[key] = node[key]
        return out

    def _ref(self, ref: str, seen: tuple[str, ...]) -> dict[str, Any]:
        if not ref.startswith(SCHEMAS):
            raise SystemExit(f"unexpected $ref {ref}")
        name = ref[len(SCHEMAS):]
        if name in seen:
            raise SystemExit(f"recursive schema {' -> '.join(seen + (name,))}: cannot be inlined in a CRD")
        if name in INT_OR_STRING or name == OBJECT_META:
            return self.ref(name)
        return self.convert(self.schemas[name], seen + (name,))

    def _default_of(self, items: dict[str, Any], key: str) -> Any:
        node = items
        while "$ref" in node or "allOf" in node:
            node = self.schemas[node["$ref"][len(SCHEMAS):]] if "$ref" in node else node["allOf"][0]
        prop = node["properties"][key]
        return prop.get("default")


def pod_template_schema(document: dict[str, Any], main: str, shorthand: str) -> dict[str, Any]:
    template = Converter(document).ref(POD_TEMPLATE)
    template["properties"]["metadata"]["x-kubernetes-validations"] = metadata_rules()
    spec = template["properties"]["spec"]
    spec.pop("required", None)  # the operator adds its container; a template may carry only metadata or volumes
    spec["properties"].pop("ephemeralContainers", None)
    spec["x-kubernetes-validations"] = pod_spec_rules(main)
    props = spec["properties"]
    for list_name in ("containers", "initContainers"):
        props[list_name]["maxItems"] = MAX_ITEMS[list_name]
        for sub in ("env", "ports"):
            props[list_name]["items"]["properties"][sub]["maxItems"] = MAX_ITEMS[sub]
    props["containers"]["items"]["x-kubernetes-validations"] = container_rules(main, shorthand)
    for list_name in ("containers", "initContainers"):
        bound_resources(props[list_name]["items"]["properties"]["resources"], f"template.spec.{list_name}[].resources")
    bound_resources(props["resources"], "template.spec.resources")
    props["tolerations"]["items"]["x-kubernetes-validations"] = toleration_rules()
    return template


def region_text(name: str, schema: dict[str, Any], indent: str) -> list[str]:
    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:  # every node written out: no anchors across regions
            return True

    body = yaml.dump({"template": schema}, Dumper=Dumper, sort_keys=False, width=10_000, default_flow_style=False)
    return [indent + line if line else line for line in body.splitlines()]


def regions(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    engine = pod_template_schema(
        document, ENGINE, "put extra vLLM flags in spec.<role>.args (the operator owns the rest of the command)")
    router = pod_template_schema(document, ROUTER, "the operator builds the router's arguments from the spec")
    return {
        "engine-template": described(engine, "core/v1 PodTemplateSpec of this role's pods. The container named "
                                             "engine runs vLLM (added if absent); see the owner table in docs/design.md."),
        "router-template": described(router, "core/v1 PodTemplateSpec of the router pod. The container named router "
                                             "runs pdpair.router (added if absent); see the owner table in docs/design.md."),
    }


def described(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"type": schema["type"], "description": description, **schema}


def render(crd_text: str, document: dict[str, Any]) -> str:
    wanted = regions(document)
    lines = crd_text.splitlines()
    out: list[str] = []
    found: set[str] = set()
    i = 0
    while i < len(lines):
        match = BEGIN.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        name, indent = match["name"], match["indent"]
        if name not in wanted:
            raise SystemExit(f"{CRD_PATH.name}: unknown generated region {name!r} (known: {sorted(wanted)})")
        end = indent + END.format(name=name)
        try:
            stop = lines.index(end, i + 1)
        except ValueError:
            raise SystemExit(f"{CRD_PATH.name}: region {name!r} has no closing line {end.strip()!r}") from None
        out.append(lines[i])
        out.extend(region_text(name, wanted[name], indent))
        out.append(lines[stop])
        found.add(name)
        i = stop + 1
    missing = set(wanted) - found
    if missing:
        raise SystemExit(f"{CRD_PATH.name}: no region for {sorted(missing)}")
    return "\n".join(out) + "\n"


def fetch_openapi(kubeconfig: str, kubectl: str) -> dict[str, Any]:
    proc = subprocess.run([kubectl, "--kubeconfig", kubeconfig, "get", "--raw", OPENAPI_PATH],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"kubectl get --raw {OPENAPI_PATH} failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--kubeconfig", help="read /openapi/v3/api/v1 from this apiserver")
    source.add_argument("--openapi", type=pathlib.Path, help="read the OpenAPI v3 document of core/v1 from a file")
    parser.add_argument("--kubectl", default="kubectl")
    parser.add_argument("--crd", type=pathlib.Path, default=CRD_PATH)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 with a diff if out of date")
    args = parser.parse_args(argv)
    document = fetch_openapi(args.kubeconfig, args.kubectl) if args.kubeconfig else json.loads(args.openapi.read_text())
    before = args.crd.read_text()
    after = render(before, document)
    if args.check:
        if before != after:
            sys.stdout.writelines(difflib.unified_diff(before.splitlines(True), after.splitlines(True),
                                                       "committed", "generated", n=2))
            print(f"{args.crd} is out of date: run python hack/gen_crd.py (see its docstring)", file=sys.stderr)
            return 1
        return 0
    if before != after:
        args.crd.write_text(after)
    print(f"{args.crd}: {len(after.encode())} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

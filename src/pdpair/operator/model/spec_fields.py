"""Spec fields the CRD defaults. The CRD is the one source of those defaults: the apiserver applies them on every
create, update and read (structural-schema defaulting), so the operator indexes them and never states a default
again. A missing one means the object did not pass through this chart's CRD (e.g. an older CRD is installed): a
clear error naming the field, instead of a silent second default that could disagree with the CRD."""

from __future__ import annotations

from typing import Any, Mapping

from pdpair.contract import DEFAULT_REPLICAS, DEFAULT_ROUTER_REPLICAS


class MissingDefaultedField(ValueError):
    """A field the CRD defaults is absent from a spec read from the API."""


def defaulted(spec: Mapping[str, Any], *path: str) -> Any:
    node: Any = spec
    for i, key in enumerate(path):
        if not isinstance(node, Mapping) or key not in node:
            field = ".".join(("spec", *path[: i + 1]))
            raise MissingDefaultedField(
                f"{field} is missing: the apiserver fills it from the InferencePair CRD's default; install the CRD "
                "of the chart that matches this operator (charts/pdpair/crds)")
        node = node[key]
    return node


def hang_timeout_seconds(spec: Mapping[str, Any]) -> float:
    return float(defaulted(spec, "connector", "hangTimeoutSeconds"))


def transport(spec: Mapping[str, Any]) -> str:
    return str(defaulted(spec, "connector", "transport"))


def transport_slots(spec: Mapping[str, Any]) -> int:
    return int(defaulted(spec, "connector", "slots"))


def layerwise_puts(spec: Mapping[str, Any]) -> bool | None:
    """spec.connector.layerwisePuts, or None when unset (the connector's own default applies: no CRD default, so a
    pair stored before the field existed keeps its fingerprint)."""
    value = (spec.get("connector") or {}).get("layerwisePuts")
    return None if value is None else bool(value)


def startup_timeout_seconds(spec: Mapping[str, Any]) -> int:
    return int(defaulted(spec, "startupTimeoutSeconds"))


def replicas(spec: Mapping[str, Any], role: str) -> int:
    """spec.<role>.replicas. Unlike the fields above it may be absent from a spec read from the API: a pair stored
    before the field existed is defaulted on read by a CRD that has it, but not by an older one, and either way it
    means one instance (docs/xpyd.md section 1); the contract's DEFAULT_REPLICAS is the CRD's default
    (tests/unit/test_contract_defaults.py)."""
    return int((spec.get(role) or {}).get("replicas", DEFAULT_REPLICAS))


def router_replicas(spec: Mapping[str, Any]) -> int:
    """spec.router.replicas: router pods per generation. Absent (a pair stored before the field existed, read through
    an older CRD) it is the contract's DEFAULT_ROUTER_REPLICAS, the CRD's default."""
    return int((spec.get("router") or {}).get("replicas", DEFAULT_ROUTER_REPLICAS))


def scaling_follower(spec: Mapping[str, Any]) -> str:
    """spec.scaling.follower: which role follows the P:D band (operator/ratio_band.py). Defaulted by the CRD
    wherever spec.scaling is written, and read only then (an absent spec.scaling is no band)."""
    return str(defaulted(spec, "scaling", "follower"))


def api_key_secret(spec: Mapping[str, Any]) -> tuple[str, str] | None:
    """spec.apiKeySecret as (Secret name, key), or None when the pair has no API key (the field is absent). The key
    is the CRD's default wherever the field is written, so a missing one is a missing default."""
    if not spec.get("apiKeySecret"):
        return None
    return str(spec["apiKeySecret"]["name"]), str(defaulted(spec, "apiKeySecret", "key"))

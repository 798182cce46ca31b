"""What the apiserver does to an InferencePair before the operator sees it: fill in the CRD's defaults
(structural-schema defaulting). Unit tests build specs by hand, so they pass them through this first; the operator
itself never states a default (pdpair.operator.model.spec_fields)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import yaml

from pdpair import contract

CRD_FILE = Path(__file__).resolve().parents[1] / "charts" / "pdpair" / "crds" / "inferencepairs.pdpair.io.yaml"
# libyaml's loader where PyYAML has it (same result): the CRD is 7,700 lines, 1.4 s with the pure-Python loader.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=4)
def _parsed_spec_schema(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    crd = yaml.load(Path(path).read_text(), Loader=_LOADER)
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == contract.VERSION]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _spec_schema_shared() -> dict[str, Any]:
    """The CRD's spec schema, parsed once per version of the file (the cache key is its mtime and size); callers
    must not change it."""
    stat = CRD_FILE.stat()
    return _parsed_spec_schema(str(CRD_FILE), stat.st_mtime_ns, stat.st_size)


def spec_schema() -> dict[str, Any]:
    return copy.deepcopy(_spec_schema_shared())


def _apply(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _apply(sub, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_apply(schema["items"], item) for item in value]
    return value


def with_crd_defaults(pair: dict[str, Any]) -> dict[str, Any]:
    """A copy of `pair` (a whole object with metadata and spec) with the CRD's defaults filled in."""
    out = copy.deepcopy(pair)
    out["spec"] = _apply(_spec_schema_shared(), out.get("spec") or {})
    return out

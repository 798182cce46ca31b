"""devcluster.product.pair_manifest: the per-role extra env lands on that role's engine container only (a real-node
test sets a TEST_ONLY_PDPAIR_* knob's path on every pod of one role, then creates the file in one pod)."""

from __future__ import annotations

import pathlib

from pdpair import contract
from devcluster.product import ENGINE_ENV, pair_manifest


def engine_env(manifest: dict, role: str) -> list[dict]:
    (container,) = manifest["spec"][role]["template"]["spec"]["containers"]
    return container["env"]


def test_each_role_gets_its_own_extra_env():
    slow = {"name": contract.ENV_TEST_SLOW_DECODE_FILE, "value": "/tmp/pdpair-slow-decode"}
    drop = {"name": contract.ENV_TEST_DROP_SIGNALS_FILE, "value": "/tmp/pdpair-drop-signals"}
    manifest = pair_manifest("p", "ns", "engine:dev", pathlib.Path("/models"), prefill_env=[drop], decode_env=[slow])
    assert engine_env(manifest, "decode") == ENGINE_ENV + [slow]
    assert engine_env(manifest, "prefill") == ENGINE_ENV + [drop]


def test_without_extra_env_both_roles_get_the_engine_env_alone():
    manifest = pair_manifest("p", "ns", "engine:dev", pathlib.Path("/models"))
    assert engine_env(manifest, "decode") == engine_env(manifest, "prefill") == ENGINE_ENV

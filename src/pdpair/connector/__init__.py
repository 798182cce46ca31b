"""pdpair's vLLM KV connector. vLLM loads it with
`{"kv_connector": "PdPairConnector", "kv_connector_module_path": "pdpair.connector", ...}`.

Importing this package is light (no vllm): `PdPairConnector` is resolved on first access, so the operator can import
`pdpair.connector.pod_server` without vLLM installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdpair.connector.connector import PdPairConnector

__all__ = ["PdPairConnector"]


def __getattr__(name: str) -> Any:
    if name == "PdPairConnector":
        from pdpair.connector.connector import PdPairConnector

        return PdPairConnector
    raise AttributeError(f"module 'pdpair.connector' has no attribute {name!r}")

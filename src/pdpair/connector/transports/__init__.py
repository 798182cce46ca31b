"""Pair transports: `tcp` (the native core, pdpair.native) and `flagcx` (ctypes binding of libflagcx).

`TRANSPORT_SPECS` holds, per value of PDPAIR_TRANSPORT, what the connector must know before the transport's module is
imported: the transport's own environment variables (read by PdPairConfig with the rest of the pod's), its cap on
PDPAIR_TRANSPORT_SLOTS, and the variables to set before its library loads. `build_transport(config)` (the worker) and
`make_transport(name)` (direct use) import only the transport asked for, so a pod without libflagcx can run tcp and
the other way round.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdpair.connector.transports.base import (
    DEFAULT_SIGNAL_SLOTS,
    RANK_DECODE,
    RANK_PREFILL,
    PairComm,
    PairTransport,
    SignalWaitTimeout,
    TransferRejected,
    TransportCounters,
    TransportError,
)
from pdpair.connector.transports.flagcx_abi import ENV_FLAGCX_PATH, ENV_LIB_PATH, ENV_USE_HETERO_COMM
from pdpair.contract import (
    ENV_TRANSPORT,
    FLAGCX_ENV_DEFAULTS,
    MAX_FLAGCX_TRANSPORT_SLOTS,
    MAX_TRANSPORT_SLOTS,
    TRANSPORT_FLAGCX,
    TRANSPORT_TCP,
    TRANSPORTS,
)

if TYPE_CHECKING:
    from pdpair.connector.config import PdPairConfig

__all__ = [
    "DEFAULT_SIGNAL_SLOTS",
    "RANK_DECODE",
    "RANK_PREFILL",
    "TRANSPORT_SPECS",
    "PairComm",
    "PairTransport",
    "SignalWaitTimeout",
    "TransferRejected",
    "TransportCounters",
    "TransportError",
    "TransportSpec",
    "build_transport",
    "make_transport",
    "transport_spec",
]


@dataclass(frozen=True)
class TransportSpec:
    """One transport as the connector sees it before importing it."""

    name: str  # the PDPAIR_TRANSPORT value
    module: str  # defines build(config: PdPairConfig) -> PairTransport
    env_names: tuple[str, ...] = ()  # its own variables, read by PdPairConfig into config.transport_env
    max_slots: int = MAX_TRANSPORT_SLOTS  # cap on PDPAIR_TRANSPORT_SLOTS ...
    max_slots_reason: str = ""  # ... and why, when it is below the contract's
    env_defaults: Mapping[str, str] = field(default_factory=dict)  # set before its library loads, unless the pod did

    def process_environment(self, transport_env: Mapping[str, str]) -> dict[str, str]:
        """Variables to set in this process before the transport's library loads: its defaults the pod left unset or
        empty (the pod's value always wins)."""
        return {name: value for name, value in self.env_defaults.items() if not transport_env.get(name)}


TRANSPORT_SPECS: dict[str, TransportSpec] = {
    TRANSPORT_TCP: TransportSpec(TRANSPORT_TCP, "pdpair.connector.transports.tcp"),
    TRANSPORT_FLAGCX: TransportSpec(
        TRANSPORT_FLAGCX,
        "pdpair.connector.transports.flagcx",
        env_names=(ENV_USE_HETERO_COMM, ENV_LIB_PATH, ENV_FLAGCX_PATH),
        max_slots=MAX_FLAGCX_TRANSPORT_SLOTS,
        max_slots_reason=f"FlagCX's IB request pool per connection holds {MAX_FLAGCX_TRANSPORT_SLOTS}",
        env_defaults=FLAGCX_ENV_DEFAULTS,  # one-sided ops on a same-vendor pair need a heterogeneous comm
    ),
}


def transport_spec(name: str) -> TransportSpec:
    """The spec of transport `name` (a value of PDPAIR_TRANSPORT); a clear error for any other name."""
    spec = TRANSPORT_SPECS.get(name)
    if spec is None:
        raise ValueError(f"{ENV_TRANSPORT}={name!r} is not a known transport; use one of {', '.join(TRANSPORTS)}")
    return spec


def build_transport(config: PdPairConfig) -> PairTransport:
    """The worker's transport, as PdPairConfig describes it: the transport's environment set first (its C library
    reads it when it loads, which its module's build does), then the module's build(config)."""
    for name, value in config.transport_environment().items():
        os.environ[name] = value
    return importlib.import_module(transport_spec(config.transport).module).build(config)


def make_transport(name: str, slots: int | None = None, blocking_seconds: float | None = None,
                   library_path: str | None = None) -> PairTransport:
    """The transport named `name` (a value of PDPAIR_TRANSPORT), for direct use (tests, benchmarks); the connector
    uses build_transport. A clear error for any other name.

    slots: request slots per peer connection; None keeps the transport's default (256 for both). blocking_seconds:
    flagcx's bound on a blocking call; tcp bounds every wait by the caller's deadline instead. library_path:
    libflagcx.so (None: flagcx looks in this process's environment)."""
    if name == TRANSPORT_TCP:
        from pdpair.connector.transports.tcp import TcpTransport

        return TcpTransport() if slots is None else TcpTransport(request_slots=slots)
    if name == TRANSPORT_FLAGCX:
        from pdpair.connector.transports.flagcx import FlagcxTransport

        return FlagcxTransport(slots=slots, blocking_seconds=blocking_seconds, library_path=library_path)
    raise ValueError(f"{ENV_TRANSPORT}={name!r} is not a known transport; use one of {', '.join(TRANSPORTS)}")

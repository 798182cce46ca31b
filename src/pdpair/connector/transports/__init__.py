"""Pair transports: `tcp` (the native core, pdpair.native) and `flagcx` (ctypes binding of libflagcx).

`make_transport(name)` imports only the transport asked for, so a pod without libflagcx can run tcp and the other way
round.
"""

from __future__ import annotations

from pdpair.connector.transports.base import (
    DEFAULT_SIGNAL_SLOTS,
    RANK_DECODE,
    RANK_PREFILL,
    PairComm,
    PairTransport,
    SignalWaitTimeout,
    TransportCounters,
    TransportError,
)
from pdpair.contract import ENV_TRANSPORT, TRANSPORT_FLAGCX, TRANSPORT_TCP, TRANSPORTS


def make_transport(name: str, slots: int | None = None, blocking_seconds: float | None = None,
                   library_path: str | None = None) -> PairTransport:
    """The transport named `name` (a value of PDPAIR_TRANSPORT); a clear error for any other name.

    slots: request slots per peer connection (PdPairConfig.transport_slots, from PDPAIR_TRANSPORT_SLOTS); None keeps
    the transport's default (256 for both). blocking_seconds: flagcx's bound on a blocking call
    (PdPairConfig.hang_timeout_seconds); tcp bounds every wait by the caller's deadline instead. library_path:
    libflagcx.so as the connector resolved it from PdPairConfig (None: flagcx looks in this process's environment,
    for direct use outside the connector)."""
    if name == TRANSPORT_TCP:
        from pdpair.connector.transports.tcp import TcpTransport

        return TcpTransport() if slots is None else TcpTransport(request_slots=slots)
    if name == TRANSPORT_FLAGCX:
        from pdpair.connector.transports.flagcx import FlagcxTransport

        return FlagcxTransport(slots=slots, blocking_seconds=blocking_seconds, library_path=library_path)
    raise ValueError(f"{ENV_TRANSPORT}={name!r} is not a known transport; use one of {', '.join(TRANSPORTS)}")

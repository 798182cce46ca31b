"""pdpair.native: a thin Python binding of the C transport in native/ (see README.md in this folder).

    ctx = Context(request_slots=256, token=generation)
    kv = ctx.register(buffer)                                   # or ctx.register_pointer(t.data_ptr(), nbytes, t)
    listener = ctx.listen("0.0.0.0", port)                      # decode side
    conn = listener.accept(timeout=30)
    conn = ctx.connect(host, port, timeout=30)                  # prefill side
    conn.put_signal(kv, 0, remote_region=0, remote_offset=0, nbytes=n, signal_slot=s)
    conn.wait_signal(s, expected=k, timeout=60)                 # raises WaitTimeout at the deadline

    ctx = Context(expect_transfers=True)                        # receiving side: writes only where it asked
    conn.expect(transfer_id, generation, s, [(region, offset, length), ...])   # before asking for the transfer
    conn.put_signal(..., transfer_id=transfer_id, generation=generation)       # the sending side tags its puts
    conn.retire(transfer_id, generation, timeout=1)             # done/failed: no byte of it lands afterwards

Every blocking call takes a timeout in seconds and releases the GIL. Errors raise TransportError (or a subclass)
carrying the C status name and the handle's last error text.
"""

from __future__ import annotations

from ._connection import Connection, Stats
from ._context import (
    DEFAULT_MAX_REGIONS,
    DEFAULT_MAX_TRANSFER_WINDOWS,
    DEFAULT_MAX_TRANSFERS,
    DEFAULT_REQUEST_SLOTS,
    DEFAULT_SIGNAL_SLOTS,
    Context,
    Listener,
)
from ._errors import (
    Closed,
    DataRejected,
    Fault,
    PeerClosed,
    Refusal,
    RemoteRejected,
    Status,
    TransportError,
    WaitTimeout,
)
from ._handle import Region
from ._pdpair_native import ffi, lib

__all__ = [
    "Closed",
    "Connection",
    "Context",
    "DataRejected",
    "DEFAULT_MAX_REGIONS",
    "DEFAULT_MAX_TRANSFERS",
    "DEFAULT_MAX_TRANSFER_WINDOWS",
    "DEFAULT_REQUEST_SLOTS",
    "DEFAULT_SIGNAL_SLOTS",
    "Fault",
    "Listener",
    "PeerClosed",
    "Refusal",
    "Region",
    "RemoteRejected",
    "Stats",
    "Status",
    "TransportError",
    "WaitTimeout",
    "version",
]

# The public classes are defined in the modules beside this one; they keep this package as their home, so reprs,
# tracebacks and pickles name them pdpair.native.X, the name callers import.
for _public in (Closed, Connection, Context, DataRejected, Fault, Listener, PeerClosed, Refusal, Region, RemoteRejected,
                Stats, Status, TransportError, WaitTimeout):
    _public.__module__ = __name__
del _public


def version() -> str:
    """The C library's version string, e.g. '0.1.0'."""
    return ffi.string(lib.pdpair_version_string()).decode()

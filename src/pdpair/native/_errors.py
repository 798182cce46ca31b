"""The C enums (Status, and Fault for test-only fault injection) and the exceptions a failed call raises: one
TransportError subclass per status a caller handles, chosen by `_raise`, with the handle's last-error text."""

from __future__ import annotations

import enum
from typing import Any

from ._pdpair_native import ffi, lib

# Names and values come from the C enum itself (no retyped numbers).
Status = enum.IntEnum(
    "Status",
    {name.removeprefix("PDPAIR_"): value for value, name in sorted(ffi.typeof("pdpair_status").elements.items())},
)
Fault = enum.IntEnum(
    "Fault",
    {name.removeprefix("PDPAIR_FAULT_"): value for value, name in sorted(ffi.typeof("pdpair_fault").elements.items())},
)
Refusal = enum.IntEnum(
    "Refusal",
    {name.removeprefix("PDPAIR_REFUSAL_"): value
     for value, name in sorted(ffi.typeof("pdpair_refusal").elements.items())},
)
Status.__doc__ = "pdpair_status codes; see native/include/pdpair/transport.h for each one's meaning."
Fault.__doc__ = "TEST ONLY fault injection kinds for Connection.set_fault."
Refusal.__doc__ = "Why a put was refused on arrival (Connection.slot_refusal; NONE: the slot is not failed)."


class TransportError(Exception):
    """A transport call failed. `status` is the Status, `status_name` its C name, `detail` the last-error text."""

    def __init__(self, status: int, detail: str = "", operation: str = ""):
        self.status = Status(status) if status in Status._value2member_map_ else status
        self.status_name = ffi.string(lib.pdpair_status_name(status)).decode()
        self.detail = detail
        self.operation = operation
        reason = ffi.string(lib.pdpair_strerror(status)).decode()
        text = f"{operation}: " if operation else ""
        text += f"{self.status_name}: {reason}"
        if detail:
            text += f" ({detail})"
        super().__init__(text)


class WaitTimeout(TransportError, TimeoutError):
    """The deadline passed (Status.TIMEOUT); the handle is still usable."""


class PeerClosed(TransportError, ConnectionError):
    """The peer closed the connection or died (Status.PEER_CLOSED)."""


class RemoteRejected(TransportError):
    """The peer refused a put (outside its regions, not a transfer it declared, outside the transfer's windows, or a
    checksum mismatch): it added no signal and counted none of the bytes. `detail` names the peer's reason."""


class DataRejected(TransportError):
    """wait_signal: a put meant for this slot was refused on this side (checksum mismatch, unknown or stale transfer,
    outside its windows). Its data must not be used. Raised at once, not at the deadline; the slot stays failed until
    reset_signal, alloc_signal or a new expect on it."""


class Closed(TransportError):
    """The handle was closed locally."""


_ERROR_CLASSES: dict[int, type[TransportError]] = {
    Status.TIMEOUT: WaitTimeout,
    Status.PEER_CLOSED: PeerClosed,
    Status.REMOTE_REJECTED: RemoteRejected,
    Status.CLOSED: Closed,
    Status.DATA_REJECTED: DataRejected,
}


def _raise(status: int, detail: str, operation: str) -> None:
    raise _ERROR_CLASSES.get(status, TransportError)(status, detail, operation)


def _last_error(getter: Any, ptr: Any) -> str:
    buf = ffi.new("char[512]")
    getter(ptr, buf, len(buf))
    return ffi.string(buf).decode(errors="replace")

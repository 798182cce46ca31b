"""Rank 1 (decode) of a flagcx pair in its own process, driven by test_flagcx_transport.py over stdin/stdout.

Protocol (one hex line each): reads the unique id; prints its region table; reads the sender's table; then reads
"<signals> <nbytes>", waits for that many signals on slot 0 and prints the sha256 of its first nbytes, or
"timeout <observed>".
"""

from __future__ import annotations

import ctypes
import hashlib
import sys

from pdpair.connector.transports.base import RANK_DECODE, SignalWaitTimeout, deadline_in
from pdpair.connector.transports.flagcx import FlagcxTransport

BUFFER_BYTES = 1 << 22


def main() -> int:
    transport = FlagcxTransport(blocking_seconds=30)
    uid = bytes.fromhex(sys.stdin.readline().strip())
    comm = transport.init_pair(uid, RANK_DECODE, deadline_in(30))
    dst = (ctypes.c_char * BUFFER_BYTES)()
    comm.register_region(ctypes.addressof(dst), BUFFER_BYTES)
    print(comm.local_region_table().hex(), flush=True)
    comm.set_peer_region_table(bytes.fromhex(sys.stdin.readline().strip()))
    signals, nbytes = (int(x) for x in sys.stdin.readline().split())
    try:
        comm.wait_signal(0, signals, deadline_in(30))
    except SignalWaitTimeout as exc:
        print(f"timeout {exc.observed}", flush=True)
        return 1
    print(hashlib.sha256(ctypes.string_at(ctypes.addressof(dst), nbytes)).hexdigest(), flush=True)
    sys.stdin.readline()  # the sender says when it is done, so neither side closes under the other
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

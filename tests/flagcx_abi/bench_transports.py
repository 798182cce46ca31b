"""Throughput of the flagcx binding (over the fake libflagcx) next to the tcp transport, one process, loopback.

  make -C tests/flagcx_abi && FLAGCX_LIB_PATH=tests/flagcx_abi/build/default/libflagcx.so \
      .venv/bin/python tests/flagcx_abi/bench_transports.py

It measures the ctypes layer's overhead per put and the fake's data path; it says nothing about real FlagCX on IB.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transport_suite import connect_pair, fill_random  # noqa: E402

from pdpair.connector.transports.base import deadline_in  # noqa: E402


def make(name: str, slots: int):
    if name == "flagcx":
        from pdpair.connector.transports.flagcx import FlagcxTransport

        return FlagcxTransport(slots=slots)
    from pdpair.connector.transports.tcp import TcpTransport

    return TcpTransport(request_slots=slots)


def run(name: str, puts: int, size: int, slots: int) -> tuple[float, int]:
    buffer = size * min(puts, 64)  # puts cycle through 64 chunk positions
    pair = connect_pair(make(name, slots), make(name, slots), buffer, buffer)
    try:
        fill_random(pair.src)
        span = len(pair.src) // size
        started = time.perf_counter()
        for k in range(puts):
            off = (k % span) * size
            pair.sender.put_signal(pair.src_region, off, pair.dst_region, off, size, signal_slot=0)
        pair.receiver.wait_signal(0, puts, deadline_in(120))
        elapsed = time.perf_counter() - started
        return elapsed, pair.sender.counters().requeues
    finally:
        pair.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transports", default="flagcx,tcp")
    parser.add_argument("--slots", type=int, default=256)
    args = parser.parse_args()
    cases = [(20000, 64), (2000, 64 * 1024), (200, 1 << 20)]
    print(f"{'transport':9} {'puts':>6} {'bytes':>8} {'seconds':>8} {'puts/s':>9} {'MB/s':>8} {'requeues':>8}")
    for name in args.transports.split(","):
        for puts, size in cases:
            elapsed, requeues = run(name, puts, size, args.slots)
            print(
                f"{name:9} {puts:6d} {size:8d} {elapsed:8.3f} {puts / elapsed:9.0f} "
                f"{puts * size / elapsed / 1e6:8.1f} {requeues:8d}"
            )


if __name__ == "__main__":
    main()

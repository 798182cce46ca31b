"""Benchmark of the native transport (pdpair.native) over loopback. A benchmark, not a test: it prints a table.

    .venv/bin/python tests/bench/bench_transport.py            # full run (~1 min on 2 cores)
    .venv/bin/python tests/bench/bench_transport.py --quick    # smaller volumes, for a smoke run

1. put+signal throughput for 64 KiB .. 4 MiB puts, as a RATIO to a plain TCP stream of the same bytes
   (socket.sendall / recv_into into the same kind of destination buffer), measured in the same run,
   interleaved trial by trial; the median of the trials is reported.
2. small put_signal latency: post on one connection until wait_signal returns on the other, p50/p99.
3. oversubscription: 10x more outstanding puts than request slots, 100k puts; requeues and lost signals.
4. the checksums' cost: the same put+signal stream with every put's CRC32C taken and checked, as a RATIO to one with
   both ends' BENCH ONLY `skip_checksums`, interleaved trial by trial in the same run (goal: >= 0.95 at 1 MiB and up).

    .venv/bin/python tests/bench/bench_transport.py --sections checksums   # only (4), about 30 s on 2 cores
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from pdpair.native import Connection, Context
import quiet  # noqa: E402  (tests/bench/quiet.py: the load guard)

KIB, MIB = 1024, 1024 * 1024
SIZES = (64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB)
DEST_BYTES = 64 * MIB  # puts land at rotating offsets of a 64 MiB region, like KV blocks would


def marry(ctx_a: Context, ctx_b: Context) -> tuple[Connection, Connection]:
    with ctx_a.listen("127.0.0.1", 0) as listener, ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(listener.accept, timeout=10)
        sender = ctx_b.connect("127.0.0.1", listener.port, timeout=10)
        return accepted.result(), sender


class PdpairStream:
    """b puts into a's region; a waits on one signal slot."""

    def __init__(self, slots: int = 256, skip_checksums: bool = False):
        self.recv_ctx = Context(request_slots=slots, skip_checksums=skip_checksums)
        self.send_ctx = Context(request_slots=slots, skip_checksums=skip_checksums)
        self.dest = bytearray(DEST_BYTES)
        self.src = bytearray(os.urandom(4 * MIB))
        self.recv_ctx.register(self.dest)
        self.send_ctx.register(self.src)
        self.receiver, self.sender = marry(self.recv_ctx, self.send_ctx)
        self.slot = self.receiver.alloc_signal()

    def run(self, size: int, count: int) -> float:
        self.receiver.reset_signal(self.slot)
        per_region = DEST_BYTES // size
        start = time.perf_counter()
        for i in range(count):
            self.sender.put_signal(0, 0, 0, (i % per_region) * size, size, self.slot)
        self.receiver.wait_signal(self.slot, count, timeout=120)
        elapsed = time.perf_counter() - start
        self.sender.flush(timeout=60)
        return elapsed

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


class TcpStream:
    """The baseline: one TCP connection over loopback, sendall() from a buffer, recv_into() the destination."""

    def __init__(self) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        self.tx = socket.create_connection(listener.getsockname(), timeout=10)
        self.rx, _ = listener.accept()
        listener.close()
        self.tx.settimeout(None)
        self.rx.settimeout(None)
        self.dest = memoryview(bytearray(DEST_BYTES))
        self.src = memoryview(bytearray(os.urandom(4 * MIB)))

    def run(self, size: int, count: int) -> float:
        per_region = DEST_BYTES // size
        total = size * count

        def receive() -> None:
            got = 0
            while got < total:
                i, within = divmod(got, size)
                off = (i % per_region) * size + within
                n = self.rx.recv_into(self.dest[off : (i % per_region) * size + size])
                if n == 0:
                    raise ConnectionError("baseline sender went away")
                got += n

        start = time.perf_counter()
        t = threading.Thread(target=receive)
        t.start()
        chunk = self.src[:size]
        for _ in range(count):
            self.tx.sendall(chunk)
        t.join()
        return time.perf_counter() - start

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


def box_busy_seconds() -> float:
    """CPU seconds all cores of the box spent busy since boot (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class CpuCounted:
    """A stream whose runs also count the box's busy CPU seconds (the bench runs alone: they are the stream's)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.busy: list[float] = []

    def run(self, size: int, count: int) -> float:
        before = box_busy_seconds()
        elapsed = self.stream.run(size, count)
        self.busy.append(box_busy_seconds() - before)
        return elapsed

    def close(self) -> None:
        self.stream.close()


def interleaved(measured, baseline, total_bytes: int, trials: int) -> list[dict]:
    """`measured` against `baseline` (each with run(size, count) -> seconds and close()) at every put size: a warm-up
    of each, then `trials` alternating trials (baseline first); rates from the medians. Both are closed after."""
    rows = []
    try:
        for size in SIZES:
            count = max(8, total_bytes // size)
            measured.run(size, max(4, count // 8))
            baseline.run(size, max(4, count // 8))
            measured_times, baseline_times = [], []
            for _ in range(trials):
                baseline_times.append(baseline.run(size, count))
                measured_times.append(measured.run(size, count))
            gb = size * count / 1e9
            measured_rate = gb / statistics.median(measured_times)
            baseline_rate = gb / statistics.median(baseline_times)
            row = {"size": size, "count": count, "measured_gbps": measured_rate, "baseline_gbps": baseline_rate,
                   "ratio": measured_rate / baseline_rate,
                   "ratios": [b / m for m, b in zip(measured_times, baseline_times)]}
            if isinstance(measured, CpuCounted) and isinstance(baseline, CpuCounted):
                # core-seconds per GB over all the trials (the warm-ups' counts are the first of each list): /proc/stat
                # counts in clock ticks (10 ms), so one trial of about 0.1 s would read +-10 %
                row["measured_cpu"] = sum(measured.busy[-trials:]) / (gb * trials)
                row["baseline_cpu"] = sum(baseline.busy[-trials:]) / (gb * trials)
            rows.append(row)
    finally:
        measured.close()
        baseline.close()
    return rows


def throughput(total_bytes: int, trials: int) -> list[dict]:
    """The transport against a plain TCP stream of the same bytes."""
    return interleaved(PdpairStream(), TcpStream(), total_bytes, trials)


def checksum_cost(total_bytes: int, trials: int) -> list[dict]:
    """Put+signal streams with checksums (the product) against none (both ends skip_checksums)."""
    return interleaved(CpuCounted(PdpairStream()), CpuCounted(PdpairStream(skip_checksums=True)), total_bytes, trials)


def latency(samples: int) -> dict:
    pd = PdpairStream()
    try:
        slot = pd.slot
        pd.receiver.reset_signal(slot)
        times = []
        for i in range(samples + 200):
            t0 = time.perf_counter_ns()
            pd.sender.put_signal(0, 0, 0, 0, 64, slot)
            pd.receiver.wait_signal(slot, i + 1, timeout=10)
            if i >= 200:  # warm-up
                times.append(time.perf_counter_ns() - t0)
    finally:
        pd.close()
    times.sort()
    return {"samples": samples, "p50_us": times[len(times) // 2] / 1e3,
            "p99_us": times[int(len(times) * 0.99)] / 1e3, "max_us": times[-1] / 1e3}


def oversubscription(total: int, size: int) -> dict:
    slots = 256
    pd = PdpairStream(slots=slots)
    window = 10 * slots
    try:
        slot = pd.slot
        max_outstanding = max_inflight = 0
        start = time.perf_counter()
        for i in range(total):
            req = pd.sender.put_signal(0, 0, 0, (i * size) % DEST_BYTES, size, slot)
            if i % 256 == 0:
                s = pd.sender.stats()
                max_outstanding = max(max_outstanding, s.posted - s.completed)
                max_inflight = max(max_inflight, s.inflight)
            if req > window:
                pd.sender.wait(req - window, timeout=60)
        value = pd.receiver.wait_signal(slot, total, timeout=120)
        elapsed = time.perf_counter() - start
        pd.sender.flush(timeout=60)
        stats, rstats = pd.sender.stats(), pd.receiver.stats()
    finally:
        pd.close()
    return {"puts": total, "size": size, "slots": slots, "window": window, "max_outstanding": max_outstanding,
            "max_inflight": max_inflight, "requeues": stats.requeues, "signals_sent": stats.signals_sent,
            "signals_received": rstats.signals_received, "wait_value": value,
            "lost": total - rstats.signals_received, "seconds": elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller volumes (smoke run)")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--bytes", type=int, default=512 * MIB, help="bytes per throughput trial")
    parser.add_argument("--sections", default="throughput,checksums,latency,oversubscription",
                        help="which measurements, comma-separated (default: all)")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    unknown = sections - {"throughput", "checksums", "latency", "oversubscription"}
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    quiet.require_quiet("bench_transport")  # exits when the box is too busy to measure
    total_bytes, trials, samples, puts = args.bytes, args.trials, 5000, 100_000
    if args.quick:
        total_bytes, trials, samples, puts = 64 * MIB, 3, 1000, 20_000

    print(f"# pdpair native transport benchmark (cores: {os.cpu_count()}, python {sys.version.split()[0]})")
    print(f"# command: {' '.join([os.path.basename(sys.executable), *sys.argv])}\n")
    if "throughput" in sections:
        print("## put+signal throughput vs plain TCP (loopback, same run, median of "
              f"{trials} interleaved trials, {total_bytes // MIB} MiB per trial)\n")
        print("| put size | puts/trial | pdpair GB/s | TCP GB/s | ratio | per-trial ratios |")
        print("|---|---|---|---|---|---|")
        for r in throughput(total_bytes, trials):
            print(f"| {r['size'] // KIB} KiB | {r['count']} | {r['measured_gbps']:.2f} | {r['baseline_gbps']:.2f} | "
                  f"**{r['ratio']:.2f}** | {', '.join(f'{x:.2f}' for x in r['ratios'])} |")
    if "checksums" in sections:
        print("\n## the checksums' cost: put+signal with CRC32C vs without (skip_checksums on both ends), median of "
              f"{trials} interleaved trials, {total_bytes // MIB} MiB per trial\n")
        print("CPU: the box's busy core-seconds per GB moved (all the trials together). Ceiling: the ratio the stream with\n"
              f"checksums would reach if it kept all {os.cpu_count()} cores busy at its CPU cost per GB, against the "
              "rate measured without.\n")
        print("| put size | puts/trial | with GB/s | without GB/s | ratio with / without | per-trial ratios | "
              "CPU s/GB with | CPU s/GB without | ceiling |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in checksum_cost(total_bytes, trials):
            ceiling = min(1.0, os.cpu_count() / r["measured_cpu"] / r["baseline_gbps"])
            print(f"| {r['size'] // KIB} KiB | {r['count']} | {r['measured_gbps']:.2f} | {r['baseline_gbps']:.2f} | "
                  f"**{r['ratio']:.2f}** | {', '.join(f'{x:.2f}' for x in r['ratios'])} | "
                  f"{r['measured_cpu']:.3f} | {r['baseline_cpu']:.3f} | {ceiling:.2f} |")
    ok = True
    if "latency" in sections:
        _print_latency(latency(samples))
    if "oversubscription" in sections:
        ok = _print_oversubscription(oversubscription(puts, 32 * KIB))
    quiet.report_after("bench_transport")
    return 0 if ok else 1


def _print_latency(lat: dict) -> None:
    print(f"\n## small put_signal latency (64 B, post -> wait_signal returns, {lat['samples']} samples)\n")
    print("| p50 | p99 | max |\n|---|---|---|")
    print(f"| {lat['p50_us']:.1f} us | {lat['p99_us']:.1f} us | {lat['max_us']:.1f} us |")


def _print_oversubscription(ov: dict) -> bool:
    print(f"\n## oversubscription ({ov['puts']} puts of {ov['size'] // KIB} KiB, {ov['slots']} slots, "
          f"up to {ov['window']} outstanding)\n")
    print("| max outstanding | max inflight | requeues | signals sent | signals received | wait returned at | lost |"
          " seconds |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {ov['max_outstanding']} | {ov['max_inflight']} | {ov['requeues']} | {ov['signals_sent']} | "
          f"{ov['signals_received']} | {ov['wait_value']} | {ov['lost']} | {ov['seconds']:.2f} |")
    ok = ov["lost"] == 0 and ov["wait_value"] == ov["puts"]
    if not ok:
        print("\nERROR: signals were lost", file=sys.stderr)
    return ok


if __name__ == "__main__":
    raise SystemExit(main())

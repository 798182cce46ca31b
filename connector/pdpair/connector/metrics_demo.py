"""A small process that serves real pdpair pod metrics, healthy or hung on purpose (tests and demos only).

    python -m pdpair.connector.metrics_demo --port 0 --role decode --hang-timeout 2 --deficit 3

It prints one JSON line on stdout once /metrics answers: {"port": N, "pid": P, "source": "accounts"}, then serves
until SIGTERM/SIGINT. The deficit is produced through the real `SignalAccounts` API: one transfer is opened that
expects `--expected` signals and receives only `expected - deficit` of them, and is never closed, so after
`--hang-timeout` seconds the pod is hung per the contract (/healthz 503, the alert rule fires).

`--deficit-after S` starts healthy and opens the short transfer only after S seconds. `--ok-every S` finishes one
complete transfer every S seconds, so counters move as in a live pod. `--generation` sets pdpair_pair_generation.
The operator's tests use it as the "pod" metrics endpoint; tests/e2e/test_prometheus_alert.py uses it as the
Prometheus scrape target.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import urllib.request

from pdpair import contract
from pdpair.connector.metrics import SignalAccounts, serve

PEER = "demo-peer:20000"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pdpair.connector.metrics_demo", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=0, help="port for /metrics and /healthz (0 = a free one)")
    p.add_argument("--addr", default="127.0.0.1", help="address to bind")
    p.add_argument("--role", choices=contract.ROLES, default=contract.ROLE_DECODE)
    p.add_argument("--hang-timeout", type=float, default=2.0, help="hang timeout in seconds")
    p.add_argument("--generation", type=int, default=1)
    p.add_argument("--deficit", type=int, default=0, help="signals missing from the stuck transfer (0 = healthy)")
    p.add_argument("--expected", type=int, default=8, help="signals the stuck transfer expects")
    p.add_argument("--deficit-after", type=float, default=0.0, help="seconds of health before the stuck transfer")
    p.add_argument("--ok-every", type=float, default=0.0, help="finish one complete transfer every S seconds")
    args = p.parse_args(argv)
    if not 0 <= args.deficit <= args.expected:
        p.error(f"--deficit must be in 0..--expected ({args.expected}), got {args.deficit}")
    if args.hang_timeout <= 0:
        p.error("--hang-timeout must be > 0")
    if args.deficit_after < 0 or args.ok_every < 0:
        p.error("--deficit-after and --ok-every must be >= 0")
    return args


def _open_stuck_transfer(accounts: SignalAccounts, args: argparse.Namespace) -> None:
    accounts.open_wait("demo-stuck", PEER, args.expected, time.monotonic() + args.hang_timeout)
    accounts.on_signals("demo-stuck", args.expected - args.deficit)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    accounts = SignalAccounts(args.role, args.hang_timeout, generation=args.generation)
    accounts.set_listener_ready(0, True)
    accounts.on_handshake(contract.OUTCOME_OK)
    accounts.set_transport_counters(PEER, inflight=0, slots=256, requeues=0)
    started = time.monotonic()
    stuck_opened = False
    if args.deficit and args.deficit_after == 0:
        _open_stuck_transfer(accounts, args)
        stuck_opened = True
    server = serve(args.port, accounts, addr=args.addr)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    urllib.request.urlopen(f"http://{args.addr}:{server.port}{contract.METRICS_PATH}", timeout=5).read()
    print(json.dumps({"port": server.port, "pid": _pid(), "source": "accounts"}), flush=True)
    next_ok = started + args.ok_every if args.ok_every else float("inf")
    finished = 0
    try:
        while not stop.is_set():
            now = time.monotonic()
            if args.deficit and not stuck_opened and now - started >= args.deficit_after:
                _open_stuck_transfer(accounts, args)
                stuck_opened = True
            if now >= next_ok:
                finished += 1
                tid = f"demo-ok-{finished}"
                accounts.open_wait(tid, PEER, 4, now + args.hang_timeout)
                accounts.on_signals(tid, 4)
                accounts.close_wait(tid, contract.OUTCOME_OK, nbytes=4096, seconds=0.002)
                next_ok = now + args.ok_every
            stop.wait(0.05)
    finally:
        server.stop()
    return 0


def _pid() -> int:
    import os

    return os.getpid()


if __name__ == "__main__":
    sys.exit(main())

"""A small process that serves real pdpair pod metrics, healthy or hung on purpose (tests and demos only).

    python -m tests.metrics_demo --port 0 --role decode --hang-timeout 2 --deficit 3 [--source native]

It prints one JSON line on stdout once /metrics answers: {"port": N, "pid": P, "source": ...}, then serves until
SIGTERM/SIGINT (exit 0).

The stuck transfer expects `--expected` signals and gets `expected - deficit` of them; it is never closed, so
`--hang-timeout` seconds after it opens the pod is hung per the contract (/healthz 503, PdPairSignalDeficit fires).
- `--source accounts` (default): the signals are reported through the real `SignalAccounts` API directly.
- `--source native`: a real loopback pair of the native TCP transport (`pdpair.native`) in this process. The
  "prefill" side posts `expected` put_signals, the last `deficit` of them with the transport's TEST-ONLY fault
  DROP_EVERY_NTH_SIGNAL(1); the "decode" side waits on the signal slot with the hang timeout as deadline and
  reports what arrived, exactly as the connector's worker does. Transport counters come from the connection.

When the stuck transfer opens: at start (default), after `--deficit-after S` seconds, or on SIGUSR1 with
`--deficit-on-sigusr1` (tests use it to know the exact moment). With `--listener-failed-on-sigusr2`, SIGUSR2 makes a
decode report its side-channel loop stopped (`pdpair_listener_failed` 1), as the connector does when the loop ends
without being asked. `--ok-every S` finishes one complete transfer every
S seconds so the counters move as in a live pod. `--generation` sets pdpair_pair_generation.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.request

from pdpair import contract
from pdpair.connector.pod_server import serve
from pdpair.connector.signals import SignalAccounts

PEER = "demo-peer:20000"
STUCK_ID = "demo-stuck"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.metrics_demo", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=0, help="port for /metrics and /healthz (0 = a free one)")
    p.add_argument("--addr", default="127.0.0.1", help="address to bind")
    p.add_argument("--role", choices=contract.ROLES, default=contract.ROLE_DECODE)
    p.add_argument("--hang-timeout", type=float, default=2.0, help="hang timeout in seconds")
    p.add_argument("--generation", type=int, default=1)
    p.add_argument("--source", choices=("accounts", "native"), default="accounts", help="where the deficit comes from")
    p.add_argument("--deficit", type=int, default=0, help="signals missing from the stuck transfer (0 = healthy)")
    p.add_argument("--expected", type=int, default=8, help="signals the stuck transfer expects")
    p.add_argument("--deficit-after", type=float, default=0.0, help="seconds of health before the stuck transfer")
    p.add_argument("--deficit-on-sigusr1", action="store_true", help="open the stuck transfer on SIGUSR1")
    p.add_argument("--ok-every", type=float, default=0.0, help="finish one complete transfer every S seconds")
    p.add_argument("--listener-failed-on-sigusr2", action="store_true",
                   help="decode: on SIGUSR2, report the side-channel loop stopped (pdpair_listener_failed 1)")
    args = p.parse_args(argv)
    if not 0 <= args.deficit <= args.expected:
        p.error(f"--deficit must be in 0..--expected ({args.expected}), got {args.deficit}")
    if args.expected < 1:
        p.error("--expected must be >= 1")
    if args.hang_timeout <= 0:
        p.error("--hang-timeout must be > 0")
    if args.deficit_after < 0 or args.ok_every < 0:
        p.error("--deficit-after and --ok-every must be >= 0")
    if args.deficit_on_sigusr1 and args.deficit_after:
        p.error("--deficit-on-sigusr1 and --deficit-after exclude each other")
    return args


class _NativeLoopback:
    """Two ends of a real pdpair.native connection in this process: `sender` (prefill) -> `receiver` (decode)."""

    def __init__(self, generation: int, nbytes: int = 4096) -> None:
        from pdpair import native

        self.native = native
        self.nbytes = nbytes
        self.decode_ctx = native.Context(token=generation)
        self.prefill_ctx = native.Context(token=generation)
        self.decode_ctx.register(bytearray(nbytes * 64))
        self.source = self.prefill_ctx.register(bytearray(b"\x5a" * nbytes))
        self.listener = self.decode_ctx.listen("127.0.0.1", 0)
        accepted: dict = {}
        acceptor = threading.Thread(target=lambda: accepted.update(conn=self.listener.accept(timeout=10)))
        acceptor.start()
        self.sender = self.prefill_ctx.connect("127.0.0.1", self.listener.port, timeout=10)
        acceptor.join(15)
        if "conn" not in accepted:
            raise RuntimeError("native loopback: the listener accepted no connection within 10s")
        self.receiver = accepted["conn"]
        self.sender.wait_remote_regions(1, timeout=10)
        self.peer = f"127.0.0.1:{self.listener.port}"
        # The drop fault is per connection: posts of concurrent transfers must not run while it is on.
        self._post_lock = threading.Lock()

    def transfer(self, accounts: SignalAccounts, transfer_id: str, expected: int, dropped: int, timeout: float) -> int:
        """One transfer of `expected` put_signals, the last `dropped` without their signal; returns signals seen."""
        slot = self.receiver.alloc_signal()
        deadline = time.monotonic() + timeout
        accounts.open_wait(transfer_id, self.peer, expected, deadline)
        with self._post_lock:
            try:
                for i in range(expected):
                    if i == expected - dropped:
                        self.sender.set_fault(self.native.Fault.DROP_EVERY_NTH_SIGNAL, 1)
                    self.sender.put_signal(self.source, 0, 0, (i % 64) * self.nbytes, self.nbytes, slot)
                self.sender.flush(timeout=timeout)
            finally:
                self.sender.set_fault(self.native.Fault.DROP_EVERY_NTH_SIGNAL, 0)
        received = 0
        while True:  # the worker's wait: short slices so the metrics follow the arrivals
            remaining = deadline - time.monotonic()
            try:
                received = self.receiver.wait_signal(slot, expected, timeout=max(0.0, min(0.1, remaining)))
            except self.native.WaitTimeout as exc:
                received = exc.value
            accounts.on_signals(transfer_id, received)
            if received >= expected or remaining <= 0:
                break
        if received >= expected:
            self.receiver.free_signal(slot)
        self.publish(accounts)
        return received

    def publish(self, accounts: SignalAccounts) -> None:
        s = self.sender.stats()
        accounts.set_transport_counters(self.peer, s.inflight, s.slots, s.requeues)

    def close(self) -> None:
        for handle in (self.sender, self.receiver, self.listener, self.prefill_ctx, self.decode_ctx):
            handle.close()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    accounts = SignalAccounts(args.role, args.hang_timeout, generation=args.generation)
    accounts.set_listener_ready(0, True)
    accounts.on_handshake(contract.OUTCOME_OK)
    loop = _NativeLoopback(args.generation) if args.source == "native" else None
    if loop is not None:
        loop.publish(accounts)
    else:
        accounts.set_transport_counters(PEER, inflight=0, slots=256, requeues=0)

    stop = threading.Event()
    trigger = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    if args.deficit_on_sigusr1:
        signal.signal(signal.SIGUSR1, lambda *_: trigger.set())
    # Handled in the loop below, not in the handler: the accounts' lock may be held by the interrupted main thread.
    listener_stop = threading.Event()
    if args.listener_failed_on_sigusr2:
        signal.signal(signal.SIGUSR2, lambda *_: listener_stop.set())

    def open_stuck() -> None:
        if loop is not None:
            # waits up to the hang timeout, as the worker does: run it beside the serving loop
            threading.Thread(
                target=loop.transfer,
                args=(accounts, STUCK_ID, args.expected, args.deficit, args.hang_timeout),
                name="demo-stuck-transfer",
                daemon=True,
            ).start()
        else:
            accounts.open_wait(STUCK_ID, PEER, args.expected, time.monotonic() + args.hang_timeout)
            accounts.on_signals(STUCK_ID, args.expected - args.deficit)

    started = time.monotonic()
    stuck_opened = False
    if args.deficit and args.deficit_after == 0 and not args.deficit_on_sigusr1:
        open_stuck()
        stuck_opened = True
    server = serve(args.port, accounts, addr=args.addr)
    try:
        urllib.request.urlopen(f"http://{args.addr}:{server.port}{contract.METRICS_PATH}", timeout=5).read()
        print(json.dumps({"port": server.port, "pid": os.getpid(), "source": args.source}), flush=True)
        next_ok = started + args.ok_every if args.ok_every else float("inf")
        finished = 0
        while not stop.is_set():
            now = time.monotonic()
            if listener_stop.is_set() and accounts.listener_failure is None:
                accounts.set_listener_failed("demo: side-channel loop stopped (SIGUSR2)")
                accounts.set_listener_ready(0, False)
            if args.deficit and not stuck_opened:
                if trigger.is_set() or (not args.deficit_on_sigusr1 and now - started >= args.deficit_after):
                    open_stuck()
                    stuck_opened = True
            if now >= next_ok:
                finished += 1
                tid = f"demo-ok-{finished}"
                began = time.monotonic()
                if loop is not None:
                    loop.transfer(accounts, tid, 4, 0, args.hang_timeout)
                else:
                    accounts.open_wait(tid, PEER, 4, now + args.hang_timeout)
                    accounts.on_signals(tid, 4)
                accounts.close_wait(tid, contract.OUTCOME_OK, nbytes=4 * 4096, seconds=time.monotonic() - began)
                next_ok = now + args.ok_every
            stop.wait(0.05)
    finally:
        server.stop()
        if loop is not None:
            loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

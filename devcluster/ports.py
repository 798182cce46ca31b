"""Loopback ports for the things tests start (apiservers, operators, engines, Prometheus, port pools).

One allocator for every test process on this machine, because the test command runs tiers side by side
(hack/test.sh, stage 2: two e2e workers beside the engine tier) and each used to pick ports on its own:
- bind(0) hands out a port from the kernel's ephemeral range, and outgoing connections draw from that same range:
  between the check and the server's bind (seconds for an operator, a minute for an engine) one can take it
  (a CI run of 0579f41: an operator's liveness port, EADDRINUSE). So ports come from below the ephemeral range.
- two processes choosing below it at random can choose the same port (or one inside the other's port pool) and
  only one bind wins. So every port handed out is *claimed* machine-wide first: a file per port under CLAIM_DIR,
  written under a lock; a claim ends when the process that made it exits or after CLAIM_TTL_SECONDS (by then the
  server bound it long ago, or never will).

Claims are never released by hand: a test holds its ports for its lifetime, and ports are plenty (22,768 below the
usual ephemeral range; a whole test run claims a few thousand).
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import random
import socket
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator

LOWEST_PORT = 10000
CLAIM_DIR = pathlib.Path(tempfile.gettempdir()) / "pdpair-port-claims"
CLAIM_TTL_SECONDS = 30 * 60
ATTEMPTS = 500


def ephemeral_port_range() -> tuple[int, int]:
    """This machine's net.ipv4.ip_local_port_range: ports the kernel hands to outgoing connections."""
    try:
        low, high = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive ports, each claimed for this process and with nothing bound to it now."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    low, high = LOWEST_PORT, ephemeral_port_range()[0]
    if high - low < count:
        raise RuntimeError(f"the ephemeral range starts at {high}: no room for {count} ports from {low}")
    rng = random.SystemRandom()
    with _claims_locked() as claims:
        for _ in range(ATTEMPTS):
            base = rng.randrange(low, high - count + 1)
            ports = range(base, base + count)
            if all(_claimable(claims / str(p)) and port_is_free(p) for p in ports):
                for port in ports:
                    (claims / str(port)).write_text(f"{os.getpid()}\n")
                return base
    raise RuntimeError(f"no {count} consecutive free, unclaimed ports in {low}-{high - 1} after {ATTEMPTS} tries")


def free_port_range(count: int) -> str:
    """`count` consecutive claimed, unbound ports as the chart's pool syntax: "first-last"."""
    base = free_port(count)
    return f"{base}-{base + count - 1}"


@contextmanager
def _claims_locked() -> Iterator[pathlib.Path]:
    CLAIM_DIR.mkdir(mode=0o777, parents=True, exist_ok=True)
    with open(CLAIM_DIR / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield CLAIM_DIR
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _claimable(claim: pathlib.Path) -> bool:
    """No claim, or one whose process has exited, or one older than CLAIM_TTL_SECONDS."""
    try:
        owner = int(claim.read_text().split()[0])
        age = time.time() - claim.stat().st_mtime
    except (FileNotFoundError, ValueError, IndexError):
        return True
    return age > CLAIM_TTL_SECONDS or not pid_alive(owner)


def pid_alive(pid: int) -> bool:
    """The process exists (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def port_is_free(port: int) -> bool:
    """Nothing is bound to `port` on any address of this host now."""
    # 0.0.0.0 rather than 127.0.0.1: a listener on any address of this host makes the bind fail.
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False

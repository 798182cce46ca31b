"""devcluster/ports.py, the one port allocator of every test process: claimed ports are never handed out twice
across processes, a port something is bound to is skipped, a claim ends with its process or its TTL.

Cost: about 2 s (two short Python subprocesses), no cluster, no engine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from devcluster import ports

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def claims(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "CLAIM_DIR", tmp_path / "claims")
    return tmp_path / "claims"


def narrow_range(monkeypatch, low: int, size: int) -> None:
    """Hand out only ports low .. low+size-1."""
    monkeypatch.setattr(ports, "LOWEST_PORT", low)
    monkeypatch.setattr(ports, "ephemeral_port_range", lambda: (low + size, 60999))


def unbound_port_run(size: int) -> int:
    """The first of `size` ports below the ephemeral range that nothing is bound to now."""
    for low in range(ports.ephemeral_port_range()[0] - size - 1, ports.LOWEST_PORT, -size):
        if all(ports.port_is_free(p) for p in range(low, low + size)):
            return low
    pytest.skip("no run of free ports on this machine")


def test_two_processes_drawing_from_a_small_range_never_get_the_same_port(claims):
    size, each = 400, 150  # without the claims, two random draws of 150 from 400 ports overlap all but surely
    low = unbound_port_run(size)
    script = textwrap.dedent(f"""
        import pathlib, sys
        from devcluster import ports
        ports.CLAIM_DIR = pathlib.Path({str(claims)!r})
        ports.LOWEST_PORT = {low}
        ports.ephemeral_port_range = lambda: ({low + size}, 60999)
        print(" ".join(str(ports.free_port()) for _ in range({each})))
        sys.stdout.flush()
        sys.stdin.read()  # stay alive (claims of a live process hold) until the test has both lists
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        drawn = [set(map(int, proc.stdout.readline().split())) for proc in procs]
    finally:
        for proc in procs:
            proc.communicate("", timeout=30)
    assert [len(d) for d in drawn] == [each, each]
    assert drawn[0].isdisjoint(drawn[1])
    assert all(low <= p < low + size for d in drawn for p in d)


def test_a_port_something_is_bound_to_is_skipped(claims, monkeypatch):
    low = unbound_port_run(2)
    narrow_range(monkeypatch, low, 2)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", low))
        assert ports.free_port() == low + 1
        with pytest.raises(RuntimeError, match="no 1 consecutive free, unclaimed ports"):
            ports.free_port()  # low is bound, low + 1 is claimed by this process


def test_a_run_of_ports_is_consecutive_and_all_claimed(claims, monkeypatch):
    low = unbound_port_run(8)
    narrow_range(monkeypatch, low, 8)
    assert ports.free_port_range(8) == f"{low}-{low + 7}"
    assert sorted(int(p.name) for p in claims.iterdir() if p.name.isdigit()) == list(range(low, low + 8))
    with pytest.raises(ValueError):
        ports.free_port(0)


def test_a_claim_ends_with_its_process_or_its_ttl(claims, monkeypatch):
    low = unbound_port_run(1)
    narrow_range(monkeypatch, low, 1)
    claims.mkdir()
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (claims / str(low)).write_text(f"{exited.stdout.strip()}\n")
    assert ports.free_port() == low  # its process has exited

    alive = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        (claims / str(low)).write_text(f"{alive.pid}\n")
        with pytest.raises(RuntimeError):
            ports.free_port()  # held by a live process
        old = time.time() - ports.CLAIM_TTL_SECONDS - 60
        os.utime(claims / str(low), (old, old))
        assert ports.free_port() == low  # older than the TTL
    finally:
        alive.communicate(b"", timeout=30)

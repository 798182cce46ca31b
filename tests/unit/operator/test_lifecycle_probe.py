"""The decode gate's probe (listener_probe.py): a listener accepts, a closed port refuses, and a TCP self-connect is
not mistaken for a listener."""

from __future__ import annotations

import asyncio
import socket

from pdpair.operator.act.listener_probe import accepts, connected_to_itself, probe_ranks


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _self_connect_succeeds(port: int) -> bool:
    """What a bare connect() reports when its source is the destination itself (TCP simultaneous open)."""
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.1", port)), 5)
    except OSError:
        return False
    writer.close()
    return True


def test_a_self_connect_is_not_a_listener():
    # The kernel really completes the connection with nobody listening: the old probe said "accepting" here.
    assert asyncio.run(_self_connect_succeeds(_unused_port())) is True
    # A fresh port (the first one sits in TIME_WAIT now, and binding it again would fail for another reason).
    port = _unused_port()
    assert asyncio.run(accepts("127.0.0.1", port, 5, local_addr=("127.0.0.1", port))) is False
    # ... and only the self-connect guard said no: a listener on a self-bound source still counts.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        assert asyncio.run(accepts("127.0.0.1", server.getsockname()[1], 5, local_addr=("127.0.0.1", _unused_port())))


def test_a_listener_accepts_and_a_closed_port_refuses():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        open_port = server.getsockname()[1]
        closed_port = _unused_port()
        result = asyncio.run(probe_ranks("127.0.0.1", [open_port, closed_port], 5))
    assert result.accepting == (open_port,)
    assert result.refusing == (closed_port,)
    assert not result.all_accept


def test_connected_to_itself_compares_address_and_port_only():
    assert connected_to_itself(("127.0.0.1", 5), ("127.0.0.1", 5))
    assert connected_to_itself(("::1", 5, 0, 0), ("::1", 5, 7, 0))
    assert not connected_to_itself(("127.0.0.1", 5), ("127.0.0.1", 6))
    assert connected_to_itself(None, ("127.0.0.1", 6))

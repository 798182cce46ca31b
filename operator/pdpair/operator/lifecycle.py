"""The decode-before-prefill gate: does decode's side-channel listener ACCEPT a TCP connection on every rank?

The operator probes podIP:port itself (pod Ready is not enough: the engine can be Ready before its KV listener
binds). Every probe has a short deadline and runs concurrently on the event loop; nothing here blocks it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeResult:
    host: str
    accepting: tuple[int, ...]
    refusing: tuple[int, ...]

    @property
    def all_accept(self) -> bool:
        return bool(self.accepting) and not self.refusing

    def describe(self) -> str:
        if self.all_accept:
            return f"{self.host} accepts on {_ports(self.accepting)}"
        return f"{self.host} does not accept on {_ports(self.refusing)}"


def _ports(ports: tuple[int, ...]) -> str:
    return ", ".join(str(p) for p in ports)


async def accepts(host: str, port: int, timeout: float) -> bool:
    """True when a TCP connection to host:port is accepted within `timeout` seconds."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), timeout)
    return True


async def probe_ranks(host: str, ports: list[int] | tuple[int, ...], timeout: float) -> ProbeResult:
    """Probe every side-channel port at once; one slow port costs at most `timeout`, not the sum."""
    if not ports:
        raise ValueError("no side-channel ports to probe")
    results = await asyncio.gather(*(accepts(host, p, timeout) for p in ports))
    accepting = tuple(p for p, ok in zip(ports, results) if ok)
    refusing = tuple(p for p, ok in zip(ports, results) if not ok)
    return ProbeResult(host, accepting, refusing)

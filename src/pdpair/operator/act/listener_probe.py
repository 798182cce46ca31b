"""The decode-before-prefill gate: does decode's side-channel listener ACCEPT a TCP connection on every rank?

The operator probes podIP:port itself (pod Ready is not enough: the engine can be Ready before its KV listener
binds). Every probe has a short deadline and runs concurrently on the event loop; nothing here blocks it. The
reconciler probes until a generation served (`probe_ranks`); after that the health watch probes it on its own tick
(`refused_ports`: only a refusal counts, so a listener that closes later is a `listener_lost` verdict, health.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, Callable

from pdpair.operator.model.observed import PodView


@dataclass(frozen=True)
class ProbeResult:
    host: str
    accepting: tuple[int, ...]
    refusing: tuple[int, ...]

    @property
    def all_accept(self) -> bool:
        return bool(self.accepting) and not self.refusing

    @property
    def message(self) -> str:
        """The DecodeListening condition's message."""
        if self.all_accept:
            return f"{self.host} accepts on {_ports(self.accepting)}"
        return f"{self.host} does not accept on {_ports(self.refusing)}"


def _ports(ports: tuple[int, ...]) -> str:
    return ", ".join(str(p) for p in ports)


ACCEPTED = "accepted"
REFUSED = "refused"  # a definite no: the host answered that nothing listens (RST), or the probe met itself
NO_ANSWER = "no answer"  # a timeout or an unreachable host: says nothing about the listener


async def accepts(host: str, port: int, timeout: float, *, local_addr: tuple[str, int] | None = None) -> bool:
    """True when a listener on host:port accepts a TCP connection within `timeout` seconds."""
    return await connect_outcome(host, port, timeout, local_addr=local_addr) == ACCEPTED


async def connect_outcome(host: str, port: int, timeout: float, *,
                          local_addr: tuple[str, int] | None = None) -> str:
    """ACCEPTED, REFUSED or NO_ANSWER for one TCP connect to host:port within `timeout` seconds. The health watch
    counts only REFUSED against a served listener: a timeout on a loaded operator or node is no evidence.

    A connection to itself is not a listener: when the operator shares decode's IP (an operator on hostNetwork,
    a test on loopback) and nothing listens on an ephemeral-range port, the kernel can pick that very port as the
    source, and the SYN meets itself (TCP simultaneous open), so connect() succeeds with nobody listening.
    `local_addr` pins the source address (tests use it to make that happen on purpose).
    """
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port, local_addr=local_addr), timeout)
    except ConnectionRefusedError:
        return REFUSED
    except (OSError, asyncio.TimeoutError):
        return NO_ANSWER
    try:
        itself = connected_to_itself(writer.get_extra_info("sockname"), writer.get_extra_info("peername"))
        return REFUSED if itself else ACCEPTED
    finally:
        writer.close()
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(writer.wait_closed(), timeout)


def connected_to_itself(sockname: Any, peername: Any) -> bool:
    """A self-connect: the local and peer (address, port) are the same (IPv6 flow info and scope ignored)."""
    if not sockname or not peername:
        return True  # no addresses: nothing we can call a listener
    return tuple(sockname[:2]) == tuple(peername[:2])


async def probe_ranks(host: str, ports: list[int] | tuple[int, ...], timeout: float) -> ProbeResult:
    """Probe every side-channel port at once; one slow port costs at most `timeout`, not the sum."""
    if not ports:
        raise ValueError("no side-channel ports to probe")
    results = await asyncio.gather(*(accepts(host, p, timeout) for p in ports))
    accepting = tuple(p for p, ok in zip(ports, results) if ok)
    refusing = tuple(p for p, ok in zip(ports, results) if not ok)
    return ProbeResult(host, accepting, refusing)


async def refused_ports(host: str, ports: list[int] | tuple[int, ...], timeout: float) -> tuple[int, ...] | None:
    """The health watch's probe of a served decode: the side-channel ports that refused (a definite "nothing listens
    here"), () when every port accepted, None when none refused and some gave no answer (no evidence either way)."""
    if not ports:
        raise ValueError("no side-channel ports to probe")
    outcomes = await asyncio.gather(*(connect_outcome(host, p, timeout) for p in ports))
    refused = tuple(p for p, o in zip(ports, outcomes) if o == REFUSED)
    if refused:
        return refused
    return () if all(o == ACCEPTED for o in outcomes) else None


class DecodeListenerGate:
    """One pair's probes of its decode listeners before they served (the planner names which: recreate.listener_probes):
    every rank of the pod probed at once (`probe_ranks`), a decode pod seen accepting on every rank remembered by uid
    and never probed again (a memory rebuilt by probing again after an operator restart), the last probe's message
    kept for the DecodeListening condition, and a DecodeListening Event the first time a pod accepts."""

    def __init__(self, timeout: float, emit: Callable[[str, str, str], None]) -> None:
        self.timeout = timeout
        self.emit = emit
        self.accepted: set[str] = set()  # pod uids whose listener accepted on every rank
        self.message = ""

    async def probe(self, decode: PodView, ranks: list[int]) -> tuple[bool, str]:
        """(whether `decode` accepts on every side-channel rank's port of `ranks`, the message of the last probe
        made); `ranks` empty: its ports are not leased yet, no probe."""
        if decode.uid in self.accepted:
            return True, self.message
        if not (decode.running and ranks):
            return False, self.message
        result = await probe_ranks(decode.ip, ranks, self.timeout)
        self.message = result.message
        if result.all_accept:
            self.accepted.add(decode.uid)
            self.emit("Normal", "DecodeListening", f"decode {decode.name}: {result.message}")
        return result.all_accept, self.message

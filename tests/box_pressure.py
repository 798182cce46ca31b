"""How much this box stalled while each test ran, from the kernel's pressure stall information (/proc/pressure).

CI runs on a 2-core VM whose disk and CPU other work shares. A failure that is really the box freezing a process for
seconds reads the same as a product bug; the stall seconds next to the failure tell them apart. Linux without PSI
(or a container that hides it) reports nothing, and nothing else changes.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass

RESOURCES = ("cpu", "memory", "io")


@dataclass(frozen=True)
class Snapshot:
    when: float
    stall_us: dict[str, int]  # "io full" -> microseconds stalled since boot
    load: tuple[float, float, float]


def snapshot() -> Snapshot | None:
    stall: dict[str, int] = {}
    for resource in RESOURCES:
        try:
            with open(f"/proc/pressure/{resource}") as f:
                for line in f:
                    kind, *fields = line.split()
                    stall[f"{resource} {kind}"] = int(dict(x.split("=") for x in fields)["total"])
        except (OSError, KeyError, ValueError):
            return None
    return Snapshot(time.monotonic(), stall, os.getloadavg())


@dataclass(frozen=True)
class Stalls:
    wall: float
    seconds: dict[str, float]  # "io full" -> seconds stalled during the interval
    load: tuple[float, float, float]

    def worst(self) -> float:
        return max(self.seconds.get("io full", 0.0), self.seconds.get("memory full", 0.0))

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items() if v >= 0.05) or "none"
        return (f"over {self.wall:.1f}s of wall time, stalled: {parts}; load average at the end "
                f"{self.load[0]:.1f} {self.load[1]:.1f} {self.load[2]:.1f}")


def between(start: Snapshot, end: Snapshot) -> Stalls:
    seconds = {k: (end.stall_us[k] - start.stall_us.get(k, 0)) / 1e6 for k in end.stall_us}
    return Stalls(end.when - start.when, seconds, end.load)


def busiest_processes(count: int = 8) -> str:
    """The processes using the most CPU over the next second (top), for a failure report."""
    try:
        out = subprocess.run(["top", "-b", "-n", "2", "-d", "1", "-w", "200", "-o", "%CPU"], capture_output=True,
                             text=True, timeout=15).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(top failed: {exc})"
    last = out.rsplit("\ntop - ", 1)[-1].splitlines()  # the second sample: CPU use during that second
    header = next((i for i, line in enumerate(last) if line.lstrip().startswith("PID")), None)
    if header is None:
        return "(top printed no process table)"
    return "\n".join(last[header: header + count + 1])

"""Where the box's CPU went between two moments: each process's user + system time, with the time of the children it
reaped (a kubectl, a runc, a probe's helper count for their parent), read from /proc and grouped by what the process
is. bench_cold_start's `--cpu` reports it for every pair start and every single engine start, to tell the engines'
own work from everything that competes with them for the box's cores (the control plane, the kubelets, containerd,
the operator, the router, the bench itself).

    before = snapshot(); ...; after = snapshot()
    seconds = spent(before, after)    # {"engines": 31.2, "kube-apiserver": 1.4, ...}, CPU seconds

Processes that started and exited between the two snapshots without being reaped by a process alive at the end are
missed; a pid reused in between is told apart by its start time. Linux only.
"""
from __future__ import annotations

import os

import quiet  # tests/bench/quiet.py: what a vLLM process looks like

TICKS = os.sysconf("SC_CLK_TCK")
# host processes by their comm (truncated to 15 characters by the kernel)
HOST = {"kube-apiserver": "kube-apiserver", "etcd": "etcd", "kubelet": "kubelets", "containerd": "containerd",
        "kube-controller": "kube-controller-manager", "kube-scheduler": "kube-scheduler", "kube-proxy": "kube-proxy"}
Snapshot = dict[tuple[int, int], tuple[str, float]]  # (pid, start time) -> (group, CPU seconds so far)


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def group(pid: int, comm: str) -> str:
    """What the process is: engines (vLLM, in any pod), operator, router, other pods, a control-plane or node
    component, the bench (this process), else "other"."""
    if pid == os.getpid():
        return "bench"
    try:
        cmdline, cgroup = _read(f"/proc/{pid}/cmdline"), _read(f"/proc/{pid}/cgroup")
    except OSError:
        return "other"
    if any(m in cmdline for m in quiet.ENGINE_MARKERS) or comm.startswith("VLLM::"):
        return "engines"
    if "kubepods" in cgroup:
        if "pdpair.router" in cmdline:
            return "router"
        if "pdpair.operator" in cmdline or "kopf" in cmdline:
            return "operator"
        return "other pods"
    if comm.startswith("containerd-shim"):
        return "containerd"
    return HOST.get(comm, "other")


def snapshot() -> Snapshot:
    out: Snapshot = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = _read(f"/proc/{entry}/stat")
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()  # fields[0] is the state, field 3 of stat(5)
        utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
        started = int(fields[19])
        out[(int(entry), started)] = (group(int(entry), comm), (utime + stime + cutime + cstime) / TICKS)
    return out


def box_busy() -> float:
    """CPU seconds the whole box spent busy since boot (every core): /proc/stat's first line without idle and
    iowait."""
    values = [int(x) for x in _read("/proc/stat").splitlines()[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / TICKS


def spent(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU seconds per group between the snapshots, largest first."""
    totals: dict[str, float] = {}
    for key, (name, seconds) in after.items():
        totals[name] = totals.get(name, 0.0) + seconds - before.get(key, (name, 0.0))[1]
    return {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1]) if round(v, 2) > 0}


class Window:
    """A measured window: `Window()` at its start, `.close()` at its end -> {"box": CPU seconds of the whole box,
    "groups": spent(...)}."""

    def __init__(self) -> None:
        self.busy, self.before = box_busy(), snapshot()

    def close(self) -> dict:
        return {"box": round(box_busy() - self.busy, 2), "groups": spent(self.before, snapshot())}

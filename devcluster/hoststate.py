"""What real nodes change on the host, and how it is put back: the host's cgroup hierarchies, the sysctls the
kubelet writes, the registry of running real-node clusters (~/.cache/pdpair/realnode-clusters/) and the sweep that
removes what dead clusters left (processes, namespaces, cgroup trees, work directories, sysctls)."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import time
from typing import Callable

from devcluster.build import cache_root
from devcluster.errors import ClusterError

# The kubelet writes these host-wide sysctls at start (it cannot be told not to); they are put back.
KUBELET_HOST_SYSCTLS = ("vm.overcommit_memory", "kernel.panic", "kernel.panic_on_oops")


def _host_cgroup_hierarchies() -> list[dict]:
    """The cgroup mounts under /sys/fs/cgroup as the host has them (the supervisor re-creates them)."""
    out = []
    for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        mountpoint = left.split()[4]
        fstype, _source, options = right.split()[:3]
        if fstype in ("cgroup", "cgroup2") and mountpoint.startswith("/sys/fs/cgroup/"):
            opts = ",".join(o for o in options.split(",") if o not in ("rw", "ro"))
            out.append({"name": mountpoint[len("/sys/fs/cgroup/"):], "fstype": fstype, "options": opts})
    for entry in pathlib.Path("/sys/fs/cgroup").iterdir():
        if entry.is_symlink():
            out.append({"name": entry.name, "fstype": "symlink", "symlink": os.readlink(entry)})
    if not out:
        raise ClusterError("no cgroup hierarchies mounted under /sys/fs/cgroup")
    return out


def _read_sysctl(key: str) -> str:
    return pathlib.Path("/proc/sys", key.replace(".", "/")).read_text().strip()


def _write_sysctl(key: str, value: str) -> None:
    pathlib.Path("/proc/sys", key.replace(".", "/")).write_text(value)


def _registry_dir() -> pathlib.Path:
    path = cache_root() / "realnode-clusters"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _pid_alive(pid: int) -> bool:
    return pathlib.Path(f"/proc/{pid}").exists()


def _remove_cgroup_tree(path: pathlib.Path, timeout: float = 15.0) -> None:
    """SIGKILLs every process left in the tree (containers outlive a killed supervisor), then removes it."""
    if not path.is_dir():
        return
    deadline = time.monotonic() + timeout
    dirs = sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [path]
    while True:
        pids = set()
        for d in dirs:
            with contextlib.suppress(OSError):
                pids |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
        if not pids or time.monotonic() > deadline:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        time.sleep(0.2)
    for sub in dirs:
        with contextlib.suppress(OSError):
            sub.rmdir()


def sweep_stale_clusters(log: Callable[[str], None] = lambda msg: None) -> list[str]:
    """Removes what clusters whose harness process died (SIGKILL, a killed test run) left behind: processes still
    in their namespaces, the namespaces, their cgroup trees, their work directory (unless kept), and (when no other
    cluster is alive) the host sysctls
    the kubelet changed. Every cluster records itself under ~/.cache/pdpair/realnode-clusters/ while it runs."""
    swept = []
    entries = []
    for path in _registry_dir().glob("*.json"):
        try:
            entries.append((path, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError):
            continue
    alive = [e for _, e in entries if _pid_alive(e["harness_pid"])]
    for path, entry in entries:
        if _pid_alive(entry["harness_pid"]):
            continue
        for netns in entry.get("netns", []):
            if not pathlib.Path(f"/run/netns/{netns}").exists():
                continue
            pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            deadline = time.monotonic() + 10
            while any(_pid_alive(int(p)) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.1)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
            swept.append(netns)
        for root in entry.get("cgroup_roots", []):
            for h in _host_cgroup_hierarchies():
                if h["fstype"] in ("cgroup", "cgroup2"):
                    target = pathlib.Path("/sys/fs/cgroup") / h["name"] / root.strip("/")
                    if target.exists():
                        _remove_cgroup_tree(target)
                        swept.append(str(target))
        workdir = pathlib.Path(entry.get("workdir") or "")
        if not entry.get("keep_workdir", True) and workdir.name.startswith("pdpair-cluster-") and workdir.is_dir():
            # its containerd state and images are ~10 GiB: a few killed runs filled the disk
            subprocess.run(["rm", "-rf", "--one-file-system", str(workdir)], capture_output=True)
            swept.append(str(workdir))
        if not alive:
            for key, value in (entry.get("saved_sysctls") or {}).items():
                if _read_sysctl(key) != value:
                    _write_sysctl(key, value)
                    swept.append(f"sysctl {key}={value}")
        path.unlink(missing_ok=True)
    if swept:
        log(f"[realnode] swept what dead clusters left: {swept}")
    return swept

#!/usr/bin/env python3
"""One real Kubernetes node: containerd, kubelet and kube-proxy started from ONE process inside the node's
network namespace, so that all three share one mount namespace (the kubelet's volume mounts must be visible to
containerd). Started by devcluster/realnode.py as `ip netns exec <node-netns> python3 node_supervisor.py CFG`;
stdlib only.

`ip netns exec` gives us a private mount namespace (mounts here never reach the host) and a fresh /sys without
the cgroup mounts, so this script:
  1. re-mounts the cgroup hierarchies the host has (the harness passes them in the config),
  2. mounts a tmpfs on /run (containerd's shim sockets live under the hard-coded /run/containerd/s) and
     bind-mounts a resolv.conf and hosts that point only at loopback over /etc's,
  3. starts containerd, imports the images it is given, starts the kubelet and kube-proxy,
  4. on SIGTERM (or if the harness dies: PR_SET_PDEATHSIG) stops them by PID, escalating to SIGKILL, kills every
     container and shim (it is their child subreaper, so they are its descendants), and removes the node's cgroup
     tree in every hierarchy. When the last process of this mount namespace exits, its mounts (pod netns
     bind-mounts, overlay rootfs, tmpfs) go with it.
Progress and PIDs are written to <workdir>/supervisor.json; the harness waits for "state": "running".
"""
from __future__ import annotations

import ctypes
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
STOP_GRACE_SECONDS = 10.0

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_stop = False


def log(msg: str) -> None:
    print(f"[supervisor {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stdout}{proc.stderr}")


def mount_cgroups(hierarchies: list[dict]) -> None:
    run("mount", "-t", "tmpfs", "-o", "mode=755", "cgroup", "/sys/fs/cgroup")
    for h in hierarchies:
        target = pathlib.Path("/sys/fs/cgroup") / h["name"]
        if h.get("symlink"):
            target.symlink_to(h["symlink"])
            continue
        target.mkdir(exist_ok=True)
        opts = ["-o", h["options"]] if h["options"] else []
        run("mount", "-t", h["fstype"], *opts, h["fstype"], str(target))


def cgroup_dirs(hierarchies: list[dict], cgroup_root: str, *, v1_only: bool = False) -> list[pathlib.Path]:
    # runc also creates the container's cgroup in the hybrid cgroup2 tree (/sys/fs/cgroup/unified), so removal
    # covers every hierarchy; creation only the v1 ones the kubelet checks.
    kinds = ("cgroup",) if v1_only else ("cgroup", "cgroup2")
    return [pathlib.Path("/sys/fs/cgroup") / h["name"] / cgroup_root.strip("/")
            for h in hierarchies if h["fstype"] in kinds]


def make_cgroup_root(hierarchies: list[dict], cgroup_root: str) -> None:
    for d in cgroup_dirs(hierarchies, cgroup_root, v1_only=True):
        d.mkdir(exist_ok=True)
        if (d / "cpuset.cpus").exists():  # a new cpuset cgroup starts empty; no task may join it until filled
            for f in ("cpuset.cpus", "cpuset.mems"):
                (d / f).write_text((d.parent / f).read_text())


def remove_cgroup_root(hierarchies: list[dict], cgroup_root: str, deadline: float) -> list[str]:
    left: list[str] = []
    for d in cgroup_dirs(hierarchies, cgroup_root):
        if not d.exists():
            continue
        for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [d]:
            while True:
                try:
                    sub.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:  # EBUSY while a killed task is still exiting
                    if time.monotonic() > deadline:
                        left.append(f"{sub}: {exc}")
                        break
                    time.sleep(0.1)
    return left


def descendants(root_pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root_pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def stop_process(proc: subprocess.Popen | None, name: str) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        log(f"{name} (pid {proc.pid}) ignored SIGTERM for {STOP_GRACE_SECONDS}s; SIGKILL")
        proc.kill()
        try:  # a stalled box may take a while to reap it; stopping never raises for that
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            log(f"{name} (pid {proc.pid}) not reaped 60s after SIGKILL")


def write_state(path: pathlib.Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)


def wait_for_socket(path: str, proc: subprocess.Popen, timeout: float, ctr: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"containerd exited with code {proc.returncode}")
        if os.path.exists(path):
            if subprocess.run([ctr, "--address", path, "version"], capture_output=True).returncode == 0:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"containerd socket {path} not serving after {timeout}s")
        time.sleep(0.1)


def main() -> int:
    cfg = json.loads(pathlib.Path(sys.argv[1]).read_text())
    workdir = pathlib.Path(cfg["workdir"])
    state_file = workdir / "supervisor.json"
    state: dict = {"state": "starting", "pid": os.getpid()}
    write_state(state_file, state)

    def on_signal(signum, frame):
        global _stop
        _stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != cfg["harness_pid"]:
        log("the harness is gone before start; exiting")  # PDEATHSIG was set too late to catch it
        return 1

    procs: dict[str, subprocess.Popen] = {}
    code = 0
    try:
        mount_cgroups(cfg["cgroup_hierarchies"])
        make_cgroup_root(cfg["cgroup_hierarchies"], cfg["cgroup_root"])
        run("mount", "-t", "tmpfs", "-o", "mode=755", "run", "/run")
        for src, dst in (("resolv.conf", "/etc/resolv.conf"), ("hosts", "/etc/hosts")):
            run("mount", "--bind", str(workdir / src), dst)
        for key, value in cfg["sysctls"].items():  # this namespace's own (per-netns) settings
            pathlib.Path("/proc/sys", key.replace(".", "/")).write_text(value)
        env = {**os.environ, "PATH": f"{cfg['bin_dir']}:/usr/sbin:/usr/bin:/sbin:/bin"}

        def start(name: str, argv: list[str]) -> subprocess.Popen:
            log_file = open(workdir / "logs" / f"{name}.log", "ab")
            proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=workdir)
            log_file.close()
            procs[name] = proc
            state.setdefault("pids", {})[name] = proc.pid
            write_state(state_file, state)
            log(f"started {name} (pid {proc.pid})")
            return proc

        containerd = start("containerd", cfg["containerd_argv"])
        wait_for_socket(cfg["containerd_socket"], containerd, 60, cfg["ctr"])
        for archive in cfg["images"]:
            run(cfg["ctr"], "--address", cfg["containerd_socket"], "-n", "k8s.io", "images", "import", archive)
        start("kubelet", cfg["kubelet_argv"])
        start("kube-proxy", cfg["kube_proxy_argv"])
        state["state"] = "running"
        write_state(state_file, state)
        while not _stop:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {proc.returncode}")
            reap()
            time.sleep(0.2)
    except Exception as exc:  # noqa: BLE001 - reported to the harness, then everything is stopped
        log(f"error: {exc}")
        state["error"] = str(exc)
        code = 1
    finally:
        state["state"] = "stopping"
        write_state(state_file, state)
        log("stopping")
        for name in ("kubelet", "kube-proxy"):
            stop_process(procs.get(name), name)
            log(f"{name} stopped")
        # Containers and shims: SIGKILL (the pods are throwaway), then containerd itself.
        containerd = procs.get("containerd")
        keep = {containerd.pid} if containerd else set()
        for pid in descendants(os.getpid()):
            if pid not in keep:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        log("containers and shims killed")
        stop_process(containerd, "containerd")
        log("containerd stopped")
        deadline = time.monotonic() + 15
        while descendants(os.getpid()) and time.monotonic() < deadline:
            for pid in descendants(os.getpid()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            reap()
            time.sleep(0.1)
        reap()
        left = remove_cgroup_root(cfg["cgroup_hierarchies"], cfg["cgroup_root"], time.monotonic() + 15)
        state["cgroups_left"] = left
        state["processes_left"] = descendants(os.getpid())
        state["state"] = "stopped"
        write_state(state_file, state)
        log(f"stopped (cgroups left: {left}, processes left: {state['processes_left']})")
    return code


if __name__ == "__main__":
    sys.exit(main())

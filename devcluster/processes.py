"""Child processes of a dev cluster: what one component is (_Component: argv, health URL, log), the death signal
that stops children when the harness dies, and the kubeconfig files the components and clients read."""
from __future__ import annotations

import ctypes
import pathlib
import signal
import subprocess
from dataclasses import dataclass, field

import yaml


def _die_with_parent() -> None:
    # Children get SIGTERM if the Python process that started them dies, so a killed test run leaves no cluster.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _write_kubeconfig(path: pathlib.Path, server: str, ca_file: pathlib.Path, user: str, token: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
        "current-context": "local",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)


@dataclass
class _Component:
    name: str
    argv: list[str]
    health_url: str | None  # None: alive-and-running is all we can check
    process: subprocess.Popen | None = None
    log_path: pathlib.Path | None = None
    env: dict = field(default_factory=dict)


def stop_child(process: subprocess.Popen | None, grace_seconds: float = 10.0, reap_seconds: float = 60.0) -> bool:
    """SIGTERM, then SIGKILL after `grace_seconds`; True once the child is reaped.

    Never raises: a teardown that raises on a slow exit fails a test that passed. On a stalled 2-core box
    (CI 2026-12-07: load 10.9) a SIGKILLed kube-apiserver took longer than 10 s to be reaped, so the reap after
    the kill waits `reap_seconds`; a child still not gone then is left to the death signal and reported as False.
    """
    if process is None:
        return True
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=grace_seconds)
        return True
    except subprocess.TimeoutExpired:
        process.kill()
    try:
        process.wait(timeout=reap_seconds)
        return True
    except subprocess.TimeoutExpired:
        return False

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

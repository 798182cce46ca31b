"""The real prometheus-operator CRDs (PodMonitor, ServiceMonitor, PrometheusRule), fetched at test time.

They come from the prometheus-operator root module's zip (`example/prometheus-operator-crd/`) through the Go
module proxy (`go mod download`, checksum-verified against sum.golang.org), and are copied into
`${XDG_CACHE_HOME:-~/.cache}/pdpair/prometheus-operator-crds/<version>/`. Nothing fetched is committed.

    python devcluster/monitoring_crds.py              # fetch (or reuse) and print the directory
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Iterator

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from devcluster.build import cache_root  # noqa: E402

PROMETHEUS_OPERATOR_MODULE = "github.com/prometheus-operator/prometheus-operator"
# The one pin. The proxy serves only some releases of the root module (v0.85.0 on 2026-11-30; v0.90.0 and
# v0.95.2 answer 403 "not available"); check with `go list -m -versions <module>`.
PROMETHEUS_OPERATOR_VERSION = "v0.85.0"
CRD_DIR_IN_MODULE = "example/prometheus-operator-crd"
MONITORING_GROUP = "monitoring.coreos.com"
# kind -> file in CRD_DIR_IN_MODULE
CRD_FILES = {
    "PodMonitor": f"{MONITORING_GROUP}_podmonitors.yaml",
    "ServiceMonitor": f"{MONITORING_GROUP}_servicemonitors.yaml",
    "PrometheusRule": f"{MONITORING_GROUP}_prometheusrules.yaml",
}
GO_DOWNLOAD_TIMEOUT_S = 300


class CRDFetchError(RuntimeError):
    pass


def crd_cache_dir(version: str = PROMETHEUS_OPERATOR_VERSION) -> pathlib.Path:
    return cache_root() / "prometheus-operator-crds" / version


def _download_command(version: str) -> list[str]:
    return ["go", "mod", "download", "-json", f"{PROMETHEUS_OPERATOR_MODULE}@{version}"]


def _module_dir(version: str) -> pathlib.Path:
    """`go mod download` of the root module; returns its extracted (read-only) directory in GOMODCACHE."""
    cmd = _download_command(version)
    env = {**os.environ, "GOFLAGS": "-mod=mod"}
    where = f"module {PROMETHEUS_OPERATOR_MODULE}@{version}: command `GOFLAGS=-mod=mod {' '.join(cmd)}`"
    # An empty working directory: no go.mod of ours can influence the download.
    with tempfile.TemporaryDirectory(prefix="pdpair-gomod-") as cwd:
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=GO_DOWNLOAD_TIMEOUT_S)
        except FileNotFoundError as exc:
            raise CRDFetchError(f"{where}: `go` is not on PATH ({exc}); install Go >= 1.26") from exc
        except subprocess.TimeoutExpired as exc:
            raise CRDFetchError(f"{where} did not finish within {GO_DOWNLOAD_TIMEOUT_S}s") from exc
    try:
        info = json.loads(proc.stdout)
    except json.JSONDecodeError:
        info = {}
    if proc.returncode != 0 or info.get("Error") or not info.get("Dir"):
        detail = info.get("Error") or (proc.stdout + proc.stderr).strip()[-2000:]
        raise CRDFetchError(f"{where} failed (exit code {proc.returncode}): {detail}")
    return pathlib.Path(info["Dir"])


def _check_crd(path: pathlib.Path, kind: str) -> None:
    import yaml

    doc = yaml.safe_load(path.read_text())
    ok = (isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition"
          and doc.get("spec", {}).get("group") == MONITORING_GROUP
          and doc.get("spec", {}).get("names", {}).get("kind") == kind)
    if not ok:
        raise CRDFetchError(f"{path} is not the {kind}.{MONITORING_GROUP} CustomResourceDefinition")


@contextlib.contextmanager
def _fetch_lock(version: str) -> Iterator[None]:
    """One fetch at a time across processes (several checkouts share the cache)."""
    lock_dir = crd_cache_dir(version).parent
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f".{version}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _cached(version: str) -> bool:
    return all((crd_cache_dir(version) / name).is_file() for name in CRD_FILES.values())


def prometheus_operator_crds(version: str = PROMETHEUS_OPERATOR_VERSION) -> pathlib.Path:
    """A directory holding the PodMonitor, ServiceMonitor and PrometheusRule CRDs of prometheus-operator
    `version` (file names in CRD_FILES); fetched once, then served from the cache. Raises CRDFetchError."""
    dest = crd_cache_dir(version)
    if _cached(version):
        return dest
    with _fetch_lock(version):
        if _cached(version):
            return dest
        source = _module_dir(version) / CRD_DIR_IN_MODULE
        staging = dest.parent / f".{version}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for kind, name in CRD_FILES.items():
            if not (source / name).is_file():
                raise CRDFetchError(f"module {PROMETHEUS_OPERATOR_MODULE}@{version} has no {CRD_DIR_IN_MODULE}/{name} "
                                    f"(looked in {source})")
            shutil.copyfile(source / name, staging / name)  # copyfile: the module cache's files are read-only
            _check_crd(staging / name, kind)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(staging, dest)  # a reader sees all three files or none
    return dest


def crd_names() -> list[str]:
    """plural.group of each CRD, e.g. podmonitors.monitoring.coreos.com."""
    return [name.removeprefix(f"{MONITORING_GROUP}_").removesuffix(".yaml") + f".{MONITORING_GROUP}"
            for name in CRD_FILES.values()]


def install_prometheus_operator_crds(cluster, version: str = PROMETHEUS_OPERATOR_VERSION,
                                     timeout_s: int = 60) -> list[str]:
    """Server-side applies the three CRDs to a LocalCluster and waits until they are Established; returns their
    names. Idempotent (several test modules may call it on the one session cluster)."""
    directory = prometheus_operator_crds(version)
    for name in CRD_FILES.values():
        # --server-side: these CRDs are too large for the last-applied annotation of a client-side apply.
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=pdpair-tests",
                        "-f", str(directory / name))
    names = crd_names()
    cluster.kubectl("wait", "--for=condition=Established", f"--timeout={timeout_s}s",
                    *[f"crd/{n}" for n in names], timeout=timeout_s + 10)
    return names


def main() -> int:
    started = time.monotonic()
    try:
        path = prometheus_operator_crds()
    except CRDFetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    print(f"({time.monotonic() - started:.2f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

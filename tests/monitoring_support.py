"""Shared by the monitoring tests: render the chart's monitoring objects, extract the rules, find promtool/prometheus.

The alert rules have one source, templates/monitoring/prometheusrule.yaml: every test that needs a rules file renders
the chart with helm and writes the PrometheusRule's `spec.groups` to a plain Prometheus rules file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml

from devcluster.build import helm_path

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "pdpair"
PROMTOOL_TESTS = REPO / "tests" / "promtool"
DASHBOARD = CHART / "dashboards" / "pdpair.json"
RELEASE = "rel"
NAMESPACE = "pdpair-system"
ALL_MONITORING_ON = (
    "monitoring.podMonitor.enabled=true",
    "monitoring.serviceMonitor.enabled=true",
    "monitoring.prometheusRule.enabled=true",
    "monitoring.dashboard.enabled=true",
)
APT_HINT = "install Debian's prometheus package: apt-get install -y prometheus (hack/test.sh does)"


def require_binary(name: str) -> str:
    """The path of `name` on PATH, or an AssertionError that says how to get it (a missing tool fails, never skips)."""
    path = shutil.which(name)
    if path is None:
        raise AssertionError(f"{name} not found on PATH: {APT_HINT}")
    return path


def helm(*args: str) -> subprocess.CompletedProcess:
    binary = helm_path()
    if not binary.exists():
        raise AssertionError(f"helm not found at {binary}: run hack/tools.sh")
    home = Path(tempfile.mkdtemp(prefix="pdpair-helm-home-"))
    try:
        env = {**os.environ, **{f"HELM_{k}_HOME": str(home / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}
        return subprocess.run([str(binary), *args], capture_output=True, text=True, env=env, timeout=120)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def render(*sets: str, monitoring_on: bool = True, release: str = RELEASE) -> list[dict]:
    """`helm template` of the chart with the monitoring pieces on (plus `--set` overrides); the parsed objects."""
    args = ["template", release, str(CHART), "--namespace", NAMESPACE]
    for s in (ALL_MONITORING_ON if monitoring_on else ()) + sets:
        args += ["--set", s]
    proc = helm(*args)
    assert proc.returncode == 0, f"helm template failed:\n{proc.stderr}"
    return [doc for doc in yaml.load_all(proc.stdout, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) if doc]


def render_error(*sets: str) -> str:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for s in ALL_MONITORING_ON + sets:
        args += ["--set", s]
    proc = helm(*args)
    assert proc.returncode != 0, f"helm template {' '.join(sets)} should have failed, rendered:\n{proc.stdout[:1500]}"
    return proc.stderr


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


def rules_from_chart(*sets: str) -> dict:
    """The rendered PrometheusRule as a plain rules file document: {"groups": [...]}."""
    rule = one(render(*sets), "PrometheusRule")
    return {"groups": rule["spec"]["groups"]}


def write_rules(directory: Path, *sets: str) -> Path:
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_from_chart(*sets), sort_keys=False))
    return path


def alert_rules(rules: dict) -> dict[str, dict]:
    return {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}

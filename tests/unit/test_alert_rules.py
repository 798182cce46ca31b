"""The alert pack under real promtool: `check rules` and `test rules` on the rules rendered from the chart."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdpair import contract
from tests.monitoring_support import PROMTOOL_TESTS, alert_rules, require_binary, rules_from_chart, write_rules

pytestmark = pytest.mark.prometheus

TEST_FILES = sorted(PROMTOOL_TESTS.glob("*_test.yaml"))


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([require_binary("promtool"), *args], capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """rules.yaml rendered from the chart (defaults) next to copies of the promtool test files."""
    write_rules(tmp_path)
    for f in TEST_FILES:
        shutil.copy(f, tmp_path / f.name)
    return tmp_path


def test_promtool_test_files_exist():
    assert TEST_FILES, f"no *_test.yaml in {PROMTOOL_TESTS}"


def test_check_rules(workdir):
    proc = promtool("check", "rules", "rules.yaml", cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(contract.ALERTS)} rules found" in proc.stdout


@pytest.mark.parametrize("test_file", TEST_FILES, ids=lambda p: p.name)
def test_rule_unit_tests(workdir, test_file):
    proc = promtool("test", "rules", test_file.name, cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_has_a_firing_and_a_silent_case():
    firing: set[str] = set()
    silent: set[str] = set()
    for f in TEST_FILES:
        for case in yaml.safe_load(f.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    assert firing >= set(contract.ALERTS), f"no firing case for {sorted(set(contract.ALERTS) - firing)}"
    assert silent >= set(contract.ALERTS), f"no silent case for {sorted(set(contract.ALERTS) - silent)}"


def test_promtool_notices_a_wrong_expectation(workdir):
    """The unit tests are sensitive: one changed expected annotation makes promtool fail."""
    text = (workdir / TEST_FILES[0].name).read_text()
    assert '"4 KV-transfer signals' in text
    (workdir / "wrong_test.yaml").write_text(text.replace('"4 KV-transfer signals', '"5 KV-transfer signals', 1))
    proc = promtool("test", "rules", "wrong_test.yaml", cwd=workdir)
    assert proc.returncode != 0 and "FAILED" in proc.stdout + proc.stderr


def test_promtool_refuses_a_broken_rule(tmp_path):
    rules = rules_from_chart()
    rules["groups"][0]["rules"][0]["expr"] = "sum by (pod) (pdpair_signal_deficit > "
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    proc = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert proc.returncode != 0


def test_values_shape_the_rendered_rules(tmp_path):
    write_rules(
        tmp_path,
        "monitoring.prometheusRule.alerts.signalDeficit.for=5s",
        "monitoring.prometheusRule.evaluationInterval=1s",
        "monitoring.prometheusRule.alerts.portPoolLow.enabled=false",
        "monitoring.prometheusRule.alerts.restartLoop.restarts=7",
        "monitoring.prometheusRule.alerts.restartLoop.window=2h",
        "monitoring.prometheusRule.alerts.nodeLost.window=1h",
        "monitoring.prometheusRule.alerts.nodeLost.severity=critical",
        "monitoring.prometheusRule.additionalLabels.team=serving",
    )
    proc = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rules = yaml.safe_load((tmp_path / "rules.yaml").read_text())
    assert rules["groups"][0]["interval"] == "1s"
    alerts = alert_rules(rules)
    assert contract.ALERT_PORT_POOL_LOW not in alerts
    assert alerts[contract.ALERT_SIGNAL_DEFICIT]["for"] == "5s"
    assert "[2h])) >= 7" in alerts[contract.ALERT_RESTART_LOOP]["expr"]
    assert '{reason="node_lost"}[1h])) > 0' in alerts[contract.ALERT_NODE_LOST]["expr"]
    assert alerts[contract.ALERT_NODE_LOST]["labels"]["severity"] == "critical"
    assert "in the last 1h" in alerts[contract.ALERT_NODE_LOST]["annotations"]["description"]
    assert all(a["labels"]["team"] == "serving" and a["labels"]["severity"] for a in alerts.values())

"""Operator configuration: a clear error naming the variable, at start."""

import subprocess
import sys

import pytest

from pdpair.operator.config import ConfigError, OperatorConfig

BASE = {"PDPAIR_OPERATOR_NAMESPACE": "pdpair-system"}


def test_defaults():
    cfg = OperatorConfig.from_env(BASE)
    assert cfg.namespace == "pdpair-system" and cfg.port_pool.size == 10000 and cfg.watch_namespaces == ()


def test_values():
    cfg = OperatorConfig.from_env({**BASE, "PDPAIR_PORT_POOL": "100-199", "PDPAIR_WATCH_NAMESPACES": "a, b,",
                                   "PDPAIR_PROBE_INTERVAL_SECONDS": "0.25"})
    assert (cfg.port_pool.first, cfg.port_pool.last, cfg.watch_namespaces, cfg.probe_interval) == (
        100, 199, ("a", "b"), 0.25)


@pytest.mark.parametrize("env, variable", [
    ({}, "PDPAIR_OPERATOR_NAMESPACE"),
    ({**BASE, "PDPAIR_PORT_POOL": "x"}, "PDPAIR_PORT_POOL"),
    ({**BASE, "PDPAIR_PROBE_INTERVAL_SECONDS": "0"}, "PDPAIR_PROBE_INTERVAL_SECONDS"),
    ({**BASE, "PDPAIR_PROBE_TIMEOUT_SECONDS": "soon"}, "PDPAIR_PROBE_TIMEOUT_SECONDS"),
    ({**BASE, "PDPAIR_LIVENESS_PORT": "70000"}, "PDPAIR_LIVENESS_PORT"),
])
def test_errors_name_the_variable(env, variable):
    with pytest.raises(ConfigError, match=variable):
        OperatorConfig.from_env(env)


@pytest.mark.parametrize("raw", ["0.5", "0", "-3", "1e3", "many"])
def test_api_threads_is_a_whole_number_at_least_one(raw):
    with pytest.raises(ConfigError, match="PDPAIR_API_THREADS"):
        OperatorConfig.from_env({**BASE, "PDPAIR_API_THREADS": raw})


def test_api_threads_and_timeout_are_read():
    cfg = OperatorConfig.from_env({**BASE, "PDPAIR_API_THREADS": "4", "PDPAIR_API_TIMEOUT_SECONDS": "2.5"})
    assert (cfg.api_threads, cfg.api_timeout) == (4, 2.5)


@pytest.mark.parametrize("variable", ["PDPAIR_PROBE_INTERVAL_SECONDS", "PDPAIR_HEALTH_INTERVAL_SECONDS",
                                      "PDPAIR_API_TIMEOUT_SECONDS"])
@pytest.mark.parametrize("raw", ["inf", "-inf", "nan", "Infinity", "0", "-1"])
def test_durations_must_be_finite_and_positive(variable, raw):
    with pytest.raises(ConfigError, match=f"{variable}: must be a finite number > 0"):
        OperatorConfig.from_env({**BASE, variable: raw})


def test_liveness_and_metrics_ports_must_differ():
    with pytest.raises(ConfigError, match="PDPAIR_LIVENESS_PORT and PDPAIR_OPERATOR_METRICS_PORT are both 9100"):
        OperatorConfig.from_env({**BASE, "PDPAIR_LIVENESS_PORT": "9100", "PDPAIR_OPERATOR_METRICS_PORT": "9100"})
    with pytest.raises(ConfigError, match="both 9090"):  # the default metrics port
        OperatorConfig.from_env({**BASE, "PDPAIR_LIVENESS_PORT": "9090"})
    # 0 means "pick a free port" for each, so two zeros do not collide
    cfg = OperatorConfig.from_env({**BASE, "PDPAIR_LIVENESS_PORT": "0", "PDPAIR_OPERATOR_METRICS_PORT": "0"})
    assert (cfg.liveness_port, cfg.metrics_port) == (0, 0)


def test_main_exits_2_with_the_message():
    proc = subprocess.run([sys.executable, "-m", "pdpair.operator"], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PDPAIR_PORT_POOL": "1-2"})
    assert proc.returncode == 2 and "PDPAIR_OPERATOR_NAMESPACE" in proc.stderr


def test_chart_deployment_sets_only_variables_the_operator_reads():
    import pathlib
    import re

    from pdpair.operator import config

    root = pathlib.Path(__file__).resolve().parents[3]
    template = (root / "charts" / "pdpair" / "templates" / "operator" / "deployment.yaml").read_text()
    in_chart = set(re.findall(r"PDPAIR_[A-Z_]+", template))
    read = {v for k, v in vars(config).items() if k.startswith("ENV_") and isinstance(v, str)}
    assert in_chart, "the chart's deployment sets no PDPAIR_* variable"
    assert in_chart <= read, f"the chart sets variables the operator ignores: {sorted(in_chart - read)}"
    assert read <= in_chart, f"the operator reads variables the chart cannot set: {sorted(read - in_chart)}"

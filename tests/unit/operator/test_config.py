"""Operator configuration: a clear error naming the variable, at start."""

import subprocess
import sys

import pytest

from pdpair.operator.model.config import ConfigError, OperatorConfig

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

    from pdpair.operator.model import config

    root = pathlib.Path(__file__).resolve().parents[3]
    template = (root / "charts" / "pdpair" / "templates" / "operator" / "deployment.yaml").read_text()
    in_chart = set(re.findall(r"PDPAIR_[A-Z_]+", template))
    read = {v for k, v in vars(config).items() if k.startswith("ENV_") and isinstance(v, str)}
    assert in_chart, "the chart's deployment sets no PDPAIR_* variable"
    assert in_chart <= read, f"the chart sets variables the operator ignores: {sorted(in_chart - read)}"
    assert read <= in_chart, f"the operator reads variables the chart cannot set: {sorted(read - in_chart)}"


# --- One declaration per setting (config.SETTINGS): everything else is generated from it or checked against it ---

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]
# Chart values whose default differs from the operator's on purpose.
CHART_DEFAULT_DIFFERS = {"operator.leaderElection.enabled": "the chart runs 2 replicas, so they campaign"}


def test_every_config_field_is_declared_once_with_its_default():
    import dataclasses

    from pdpair.operator.model import config

    fields = {f.name: f for f in dataclasses.fields(OperatorConfig)}
    declared = [s.field for s in config.SETTINGS if s.field]
    assert sorted(declared) == sorted(fields) and len(set(declared)) == len(declared)
    assert len({s.env for s in config.SETTINGS}) == len(config.SETTINGS)
    defaults = OperatorConfig.from_env(BASE)
    for s in config.SETTINGS:
        if s.field and s.field != "namespace":
            assert getattr(defaults, s.field) == s.default, s.env
            if fields[s.field].default is not dataclasses.MISSING:
                assert fields[s.field].default == s.default, s.env
    env_constants = {v for k, v in vars(config).items() if k.startswith("ENV_")}
    assert env_constants == {s.env for s in config.SETTINGS}


def test_operator_readme_table_is_generated_from_the_settings():
    from pdpair.operator.model import config

    readme = (ROOT / "src" / "pdpair" / "operator" / "README.md").read_text()
    block = readme.split("<!-- settings:begin -->\n", 1)[1].split("<!-- settings:end -->", 1)[0]
    assert block == config.settings_markdown(), "run `python -m pdpair.operator.model.config` and paste its table"


def _values_comment(lines, key_path):
    """The comment block just above `key_path`'s line in values.yaml, and the line itself."""
    indent, index = 0, 0
    for key in key_path:
        index = next(i for i in range(index, len(lines))
                     if lines[i].startswith(" " * indent + key + ":"))
        indent += 2
    comment = []
    i = index - 1
    while i >= 0 and lines[i].lstrip().startswith("#"):
        comment.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    return " ".join(comment), lines[index]


def test_chart_values_docs_and_template_agree_with_the_settings():
    import re

    import yaml

    from pdpair.operator.model import config

    values_text = (ROOT / "charts" / "pdpair" / "values.yaml").read_text()
    values = yaml.safe_load(values_text)
    chart_readme = (ROOT / "charts" / "pdpair" / "README.md").read_text()
    template = (ROOT / "charts" / "pdpair" / "templates" / "operator" / "deployment.yaml").read_text()
    [tuning_dict] = re.findall(r'range \$key, \$env := dict ((?:"[^"]+" ?)+)', template)
    template_tuning = dict(zip(*[iter(re.findall(r'"([^"]+)"', tuning_dict))] * 2))
    tuning = {}
    for s in config.SETTINGS:
        if not s.chart.startswith("operator."):
            continue
        path = s.chart.split(".")
        value = values
        for key in path:
            value = value[key]
        [row] = [line for line in chart_readme.splitlines() if line.startswith(f"| `{s.chart}` |")]
        comment, _ = _values_comment(values_text.splitlines(), path)
        if path[1] == "tuning":
            tuning[path[2]] = s.env
            # null in values.yaml: the operator's default applies, and both docs name it
            assert value is None, s.chart
            assert f"(default {s.shown_default})" in comment, (s.chart, comment)
            assert f"`null` ({s.shown_default})" in row, (s.chart, row)
        elif s.chart in CHART_DEFAULT_DIFFERS:
            assert value != s.default
        else:
            shown = (",".join(value) if isinstance(value, list) else str(value).lower() if isinstance(value, bool)
                     else str(value))
            assert shown == (s.shown_default if s.shown_default != "empty" else ""), (s.chart, value)
        assert s.env in comment or s.env in row or path[1] == "tuning", (s.chart, "names its variable")
    assert template_tuning == tuning


def test_docs_that_quote_a_default_quote_the_declared_one():
    """`PDPAIR_X (N)`, a number in parentheses after a variable in any Markdown file, must be the declared default
    (docs/design.md quotes several)."""
    import re

    from pdpair.operator.model import config

    quoted = 0
    for doc in ROOT.rglob("*.md"):
        if ".git" in doc.parts or ".venv" in doc.parts:
            continue
        text = doc.read_text(errors="replace")
        for s in config.SETTINGS:
            for found in re.findall(re.escape(s.env) + r"`? \(`?([0-9][0-9.]*)", text):
                quoted += 1
                assert found.strip("` ") == s.shown_default, (str(doc), s.env, found)
    assert quoted >= 3

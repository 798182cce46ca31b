"""PdPairConfig: the pod environment is validated once, with errors naming the variable."""

from __future__ import annotations

import pytest

from pdpair import contract
from pdpair.connector.config import ConfigError, PdPairConfig

DECODE = {contract.ENV_LISTEN_PORT_BASE: "20000", contract.ENV_GENERATION: "3", contract.ENV_HANG_TIMEOUT_SECONDS: "12"}
PREFILL = {contract.ENV_PEER_HOST: "10.0.0.9", contract.ENV_PEER_PORT_BASE: "20000"}


def test_decode_config_from_env():
    config = PdPairConfig.from_env("kv_consumer", {}, {**DECODE, contract.ENV_METRICS_PORT: "9100"})
    assert config.role == contract.ROLE_DECODE
    assert config.generation == 3 and config.hang_timeout_seconds == 12.0
    assert config.listen_port(2) == 20002 and config.metrics_port == 9100
    assert config.transport == contract.TRANSPORT_TCP
    assert config.send_lease_seconds > config.hang_timeout_seconds


def test_prefill_config_from_env():
    config = PdPairConfig.from_env("kv_producer", {"test_drop_signals_file": "/tmp/x"}, PREFILL)
    assert config.role == contract.ROLE_PREFILL and config.peer_port(1) == 20001
    assert config.test_drop_signals_file == "/tmp/x" and config.metrics_port is None


@pytest.mark.parametrize(
    ("kv_role", "env", "extra", "message"),
    [
        ("kv_both", DECODE, {}, "kv_role 'kv_both' is not supported"),
        ("kv_consumer", {}, {}, f"{contract.ENV_LISTEN_PORT_BASE} is required"),
        ("kv_producer", {contract.ENV_PEER_PORT_BASE: "1"}, {}, f"{contract.ENV_PEER_HOST} is required"),
        ("kv_producer", {contract.ENV_PEER_HOST: "h"}, {}, f"{contract.ENV_PEER_PORT_BASE} is required"),
        ("kv_consumer", {**DECODE, contract.ENV_TRANSPORT: "ib"}, {}, f"{contract.ENV_TRANSPORT}='ib'"),
        ("kv_consumer", {**DECODE, contract.ENV_HANG_TIMEOUT_SECONDS: "0"}, {}, "must be a finite number"),
        ("kv_consumer", {**DECODE, contract.ENV_HANG_TIMEOUT_SECONDS: "soon"}, {}, "is not a number"),
        ("kv_consumer", {**DECODE, contract.ENV_GENERATION: "-1"}, {}, "must be >= 0"),
        ("kv_consumer", {**DECODE, contract.ENV_LISTEN_PORT_BASE: "70000"}, {}, "not a port in 1..65535"),
        ("kv_consumer", {**DECODE, contract.ENV_ROLE: "prefill"}, {}, "contradicts kv_role"),
        ("kv_consumer", DECODE, {"surprise": 1}, "unknown kv_connector_extra_config keys"),
    ],
)
def test_bad_settings_fail_with_the_variable_named(kv_role, env, extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        PdPairConfig.from_env(kv_role, extra, env)

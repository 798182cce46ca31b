"""PdPairConfig: the pod environment is validated once, with errors naming the variable."""

from __future__ import annotations

import dataclasses
import re
import socket
import sys
from pathlib import Path

import pytest

from pdpair import contract
from pdpair.connector.config import DEFAULT_TRANSPORT_SLOTS, ConfigError, PdPairConfig, PeerAddress
from pdpair.connector.transports import make_transport
from pdpair.connector.transports.base import deadline_in

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from transport_suite import connect_pair  # noqa: E402
from tests.side_channel_support import TEST_SIDE_CHANNEL_KEY  # noqa: E402

TCP = {contract.ENV_TRANSPORT: contract.TRANSPORT_TCP, contract.ENV_SIDE_CHANNEL_KEY: TEST_SIDE_CHANNEL_KEY}
DECODE = {**TCP, contract.ENV_LISTEN_PORT_BASE: "20000", contract.ENV_GENERATION: "3",
          contract.ENV_HANG_TIMEOUT_SECONDS: "12"}
PREFILL = {**TCP, contract.ENV_PEER_HOST: "10.0.0.9", contract.ENV_PEER_PORT_BASE: "20000"}


def test_decode_config_from_env():
    config = PdPairConfig.from_env("kv_consumer", {"test_delay_listener_file": "/tmp/hold"},
                                   {**DECODE, contract.ENV_METRICS_PORT: "9100"})
    assert config.role == contract.ROLE_DECODE and config.test_delay_listener_file == "/tmp/hold"
    assert config.generation == 3 and config.hang_timeout_seconds == 12.0
    assert config.listen_port(2) == 20002 and config.metrics_port == 9100
    assert config.transport == contract.TRANSPORT_TCP
    assert config.send_lease_seconds > config.hang_timeout_seconds


def test_prefill_config_from_env():
    config = PdPairConfig.from_env("kv_producer", {"test_drop_signals_file": "/tmp/x"}, PREFILL)
    assert config.role == contract.ROLE_PREFILL and config.peer_port(1) == 20001
    assert config.test_drop_signals_file == "/tmp/x" and config.metrics_port is None


def test_drop_knob_from_the_test_only_env():
    """The operator owns kv_connector_extra_config, so a pair sets the drop knob through its prefill template env."""
    env = {**PREFILL, contract.ENV_TEST_DROP_SIGNALS_FILE: "/tmp/drop"}
    assert PdPairConfig.from_env("kv_producer", {}, env).test_drop_signals_file == "/tmp/drop"
    # the same path both ways is one setting
    same = PdPairConfig.from_env("kv_producer", {"test_drop_signals_file": "/tmp/drop"}, env)
    assert same.test_drop_signals_file == "/tmp/drop"
    assert PdPairConfig.from_env("kv_producer", {}, {**PREFILL, contract.ENV_TEST_DROP_SIGNALS_FILE: ""}) \
        .test_drop_signals_file is None
    assert PdPairConfig.from_env("kv_producer", {}, PREFILL).test_drop_signals_file is None


def test_drop_knob_env_is_not_an_operator_variable():
    # PDPAIR_* is the operator's (the CRD refuses it in a template's env), so the knob must live outside it
    assert not contract.ENV_TEST_DROP_SIGNALS_FILE.startswith("PDPAIR_")
    assert contract.ENV_TEST_DROP_SIGNALS_FILE not in contract.POD_ENV


def test_slow_decode_knob_from_the_extra_config_or_the_test_only_env():
    """Decode's slow-step knob, like the drop knob: the extra config in a bare engine, the env under the operator."""
    from_extra = PdPairConfig.from_env("kv_consumer", {"test_slow_decode_file": "/tmp/slow"}, DECODE)
    assert from_extra.test_slow_decode_file == "/tmp/slow"
    env = {**DECODE, contract.ENV_TEST_SLOW_DECODE_FILE: "/tmp/slow"}
    assert PdPairConfig.from_env("kv_consumer", {}, env).test_slow_decode_file == "/tmp/slow"
    # the same path both ways is one setting
    same = PdPairConfig.from_env("kv_consumer", {"test_slow_decode_file": "/tmp/slow"}, env)
    assert same.test_slow_decode_file == "/tmp/slow"
    assert PdPairConfig.from_env("kv_consumer", {}, {**DECODE, contract.ENV_TEST_SLOW_DECODE_FILE: ""}) \
        .test_slow_decode_file is None
    assert PdPairConfig.from_env("kv_consumer", {}, DECODE).test_slow_decode_file is None


def test_slow_decode_knob_env_is_not_an_operator_variable():
    assert contract.ENV_TEST_SLOW_DECODE_FILE == "TEST_ONLY_PDPAIR_SLOW_DECODE_FILE"
    assert not contract.ENV_TEST_SLOW_DECODE_FILE.startswith("PDPAIR_")
    assert contract.ENV_TEST_SLOW_DECODE_FILE not in contract.POD_ENV


def test_stop_listener_knob_is_decode_only_and_not_an_operator_variable():
    """Decode's stop-listener knob: the extra config or the TEST_ONLY_ env; on prefill the engine fails at start."""
    assert PdPairConfig.from_env("kv_consumer", {"test_stop_listener_file": "/tmp/stop"}, DECODE) \
        .test_stop_listener_file == "/tmp/stop"
    env = {**DECODE, contract.ENV_TEST_STOP_LISTENER_FILE: "/tmp/stop"}
    assert PdPairConfig.from_env("kv_consumer", {}, env).test_stop_listener_file == "/tmp/stop"
    assert PdPairConfig.from_env("kv_consumer", {}, DECODE).test_stop_listener_file is None
    with pytest.raises(ConfigError, match="decode only"):
        PdPairConfig.from_env("kv_producer", {"test_stop_listener_file": "/tmp/stop"}, PREFILL)
    assert not contract.ENV_TEST_STOP_LISTENER_FILE.startswith("PDPAIR_")
    assert contract.ENV_TEST_STOP_LISTENER_FILE not in contract.POD_ENV


def test_corrupt_puts_knob_is_prefill_and_tcp_only_and_not_an_operator_variable():
    """Prefill's corrupt-puts knob: the extra config in a bare engine, the TEST_ONLY_ env under the operator; on
    decode or with flagcx (no native fault to turn on) the engine fails at start, never runs without the fault."""
    assert PdPairConfig.from_env("kv_producer", {"test_corrupt_puts_file": "/tmp/bad"}, PREFILL) \
        .test_corrupt_puts_file == "/tmp/bad"
    env = {**PREFILL, contract.ENV_TEST_CORRUPT_PUTS_FILE: "/tmp/bad"}
    assert PdPairConfig.from_env("kv_producer", {}, env).test_corrupt_puts_file == "/tmp/bad"
    assert PdPairConfig.from_env("kv_producer", {"test_corrupt_puts_file": "/tmp/bad"}, env) \
        .test_corrupt_puts_file == "/tmp/bad"  # the same path both ways is one setting
    assert PdPairConfig.from_env("kv_producer", {}, {**PREFILL, contract.ENV_TEST_CORRUPT_PUTS_FILE: ""}) \
        .test_corrupt_puts_file is None
    assert PdPairConfig.from_env("kv_producer", {}, PREFILL).test_corrupt_puts_file is None
    assert contract.ENV_TEST_CORRUPT_PUTS_FILE == "TEST_ONLY_PDPAIR_CORRUPT_PUTS_FILE"
    assert not contract.ENV_TEST_CORRUPT_PUTS_FILE.startswith("PDPAIR_")
    assert contract.ENV_TEST_CORRUPT_PUTS_FILE not in contract.POD_ENV


@pytest.mark.parametrize(
    ("kv_role", "env", "extra", "message"),
    [
        ("kv_both", DECODE, {}, "kv_role 'kv_both' is not supported"),
        ("kv_consumer", TCP, {}, f"{contract.ENV_LISTEN_PORT_BASE} is required"),
        ("kv_producer", {**TCP, contract.ENV_PEER_PORT_BASE: "1"}, {}, f"{contract.ENV_PEER_HOST} is required"),
        ("kv_producer", {**TCP, contract.ENV_PEER_HOST: "h"}, {}, f"{contract.ENV_PEER_PORT_BASE} is required"),
        ("kv_producer", TCP, {}, f"{contract.ENV_PEER_HOST} is required on prefill"),
        ("kv_producer", {**TCP, contract.ENV_METRICS_PORT: "9", contract.ENV_PEERS_TOKEN: "t" * 20,
                         contract.ENV_PEER_PORT_BASE: "1"}, {}, f"{contract.ENV_PEER_PORT_BASE} is set without"),
        ("kv_consumer", {k: v for k, v in DECODE.items() if k != contract.ENV_TRANSPORT}, {},
         f"{contract.ENV_TRANSPORT} is required: one of flagcx, tcp"),
        ("kv_consumer", {**DECODE, contract.ENV_TRANSPORT: ""}, {}, f"{contract.ENV_TRANSPORT} is required"),
        ("kv_consumer", {**DECODE, contract.ENV_TRANSPORT: "ib"}, {}, f"{contract.ENV_TRANSPORT}='ib'"),
        ("kv_consumer", {**DECODE, contract.ENV_HANG_TIMEOUT_SECONDS: "0"}, {}, "must be a finite number"),
        ("kv_consumer", {**DECODE, contract.ENV_HANG_TIMEOUT_SECONDS: "soon"}, {}, "is not a number"),
        ("kv_consumer", {**DECODE, contract.ENV_GENERATION: "-1"}, {}, "must be >= 0"),
        ("kv_consumer", {**DECODE, contract.ENV_LISTEN_PORT_BASE: "70000"}, {}, "not a port in 1..65535"),
        ("kv_consumer", {**DECODE, contract.ENV_ROLE: "prefill"}, {}, "contradicts kv_role"),
        ("kv_consumer", DECODE, {"surprise": 1}, "unknown kv_connector_extra_config keys"),
        ("kv_producer", {**PREFILL, contract.ENV_TEST_DROP_SIGNALS_FILE: "/a"}, {"test_drop_signals_file": "/b"},
         "TEST_ONLY_PDPAIR_DROP_SIGNALS_FILE='/a' contradicts kv_connector_extra_config"),
        ("kv_consumer", {**DECODE, contract.ENV_TEST_DROP_SIGNALS_FILE: "/a"}, {}, "applies to prefill only"),
        ("kv_consumer", DECODE, {"test_drop_signals_file": "/a"}, "applies to prefill only"),
        ("kv_consumer", {**DECODE, contract.ENV_TEST_SLOW_DECODE_FILE: "/a"}, {"test_slow_decode_file": "/b"},
         "TEST_ONLY_PDPAIR_SLOW_DECODE_FILE='/a' contradicts kv_connector_extra_config test_slow_decode_file='/b'"),
        ("kv_producer", {**PREFILL, contract.ENV_TEST_SLOW_DECODE_FILE: "/a"}, {},
         "the slow-decode test knob (TEST_ONLY_PDPAIR_SLOW_DECODE_FILE or test_slow_decode_file"),
        ("kv_producer", PREFILL, {"test_slow_decode_file": "/a"}, "applies to decode only"),
        ("kv_producer", {**PREFILL, contract.ENV_TEST_CORRUPT_PUTS_FILE: "/a"}, {"test_corrupt_puts_file": "/b"},
         "TEST_ONLY_PDPAIR_CORRUPT_PUTS_FILE='/a' contradicts kv_connector_extra_config test_corrupt_puts_file='/b'"),
        ("kv_consumer", {**DECODE, contract.ENV_TEST_CORRUPT_PUTS_FILE: "/a"}, {},
         "the corrupt-puts test knob (TEST_ONLY_PDPAIR_CORRUPT_PUTS_FILE or test_corrupt_puts_file"),
        ("kv_consumer", DECODE, {"test_corrupt_puts_file": "/a"}, "applies to prefill only"),
        ("kv_producer", {**PREFILL, contract.ENV_TRANSPORT: "flagcx"}, {"test_corrupt_puts_file": "/a"},
         "test_corrupt_puts_file. needs the tcp transport"),
        ("kv_consumer", {**DECODE, contract.ENV_TRANSPORT_SLOTS: "many"}, {}, "PDPAIR_TRANSPORT_SLOTS='many' is not an"),
        ("kv_consumer", {**DECODE, contract.ENV_TRANSPORT_SLOTS: "0"}, {}, "PDPAIR_TRANSPORT_SLOTS=0 must be in 1..4096"),
        ("kv_consumer", {**DECODE, contract.ENV_TRANSPORT_SLOTS: "-3"}, {}, "PDPAIR_TRANSPORT_SLOTS=-3 must be in"),
        ("kv_consumer", {**DECODE, contract.ENV_TRANSPORT_SLOTS: "4097"}, {}, "PDPAIR_TRANSPORT_SLOTS=4097 must be in"),
        (
            "kv_consumer",
            {**DECODE, contract.ENV_TRANSPORT: "flagcx", contract.ENV_TRANSPORT_SLOTS: "257"},
            {},
            "PDPAIR_TRANSPORT_SLOTS=257 must be <= 256 with PDPAIR_TRANSPORT=flagcx",
        ),
    ],
)
def test_bad_settings_fail_with_the_variable_named(kv_role, env, extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        PdPairConfig.from_env(kv_role, extra, env)


def test_prefill_with_the_push_token_starts_without_a_decode():
    """The operator creates prefill beside a decode that has no address yet and pushes it later: with
    PDPAIR_PEERS_TOKEN (and the metrics port that serves the push) prefill's peer set may start empty."""
    env = {**TCP, contract.ENV_METRICS_PORT: "9", contract.ENV_PEERS_TOKEN: "t" * 20}
    config = PdPairConfig.from_env("kv_producer", {}, env)
    assert config.peer_set() == () and config.peer_host is None and config.peers_token == "t" * 20


def test_transport_slots_default_and_bounds():
    assert PdPairConfig.from_env("kv_consumer", {}, DECODE).transport_slots == DEFAULT_TRANSPORT_SLOTS == 256
    for raw, slots in (("1", 1), ("32", 32), ("4096", 4096), ("", 256)):
        env = {**DECODE, contract.ENV_TRANSPORT_SLOTS: raw}
        assert PdPairConfig.from_env("kv_consumer", {}, env).transport_slots == slots
    flagcx = {**DECODE, contract.ENV_TRANSPORT: "flagcx", contract.ENV_TRANSPORT_SLOTS: "256"}
    assert PdPairConfig.from_env("kv_consumer", {}, flagcx).transport_slots == 256


@pytest.mark.parametrize("slots", [3, 700])
def test_tcp_transport_gets_the_configured_request_slots(slots):
    """PDPAIR_TRANSPORT_SLOTS reaches the native core: the connection reports it and never has more in flight."""
    config = PdPairConfig.from_env("kv_producer", {}, {**PREFILL, contract.ENV_TRANSPORT_SLOTS: str(slots)})
    puts, size = 1500, 16
    pair = connect_pair(
        make_transport(config.transport, slots=config.transport_slots),
        make_transport(config.transport, slots=config.transport_slots),
        puts * size,
        puts * size,
    )
    try:
        assert pair.sender.counters().slots == slots
        assert pair.receiver.counters().slots == slots
        max_inflight = 0
        for k in range(puts):
            pair.sender.put_signal(pair.src_region, k * size, pair.dst_region, k * size, size, signal_slot=0)
            max_inflight = max(max_inflight, pair.sender.counters().inflight)
        pair.receiver.wait_signal(0, puts, deadline_in(60))
        assert max_inflight <= slots
        if slots == 3:
            assert pair.sender.counters().requeues > 0, "1500 puts through 3 slots never waited: the cap is not set"
    finally:
        pair.close()


def test_tcp_transport_refuses_bad_slots():
    with pytest.raises(ValueError, match="request_slots must be an int >= 1"):
        make_transport(contract.TRANSPORT_TCP, slots=0)


def test_flagcx_gets_hetero_comm_unless_the_pod_set_it():
    flagcx = {**DECODE, contract.ENV_TRANSPORT: contract.TRANSPORT_FLAGCX}
    config = PdPairConfig.from_env("kv_consumer", {}, flagcx)
    assert config.transport_environment() == {"FLAGCX_USE_HETERO_COMM": "1"}
    config = PdPairConfig.from_env("kv_consumer", {}, {**flagcx, "FLAGCX_USE_HETERO_COMM": "0"})
    assert config.transport_env["FLAGCX_USE_HETERO_COMM"] == "0" and config.transport_environment() == {}
    assert PdPairConfig.from_env("kv_consumer", {}, DECODE).transport_environment() == {}  # tcp loads no libflagcx


def test_prefill_peer_set_from_pdpair_peers():
    """PDPAIR_PEERS lists every decode, `host:portBase`, IPv6 in brackets; PDPAIR_PEER_HOST/_PORT_BASE alone are a
    one-element list (what the operator sets today); both given must agree. Cost: milliseconds."""
    peers = "10.0.0.9:20000, decode-1.pairs.svc:20010,[fd00::7]:20020"
    config = PdPairConfig.from_env("kv_producer", {}, {**TCP, contract.ENV_PEERS: peers})
    assert config.peer_set() == (PeerAddress("10.0.0.9", 20000), PeerAddress("decode-1.pairs.svc", 20010),
                                 PeerAddress("fd00::7", 20020))
    assert [p.label for p in config.peers] == ["10.0.0.9:20000", "decode-1.pairs.svc:20010", "[fd00::7]:20020"]
    assert config.peers[2].port(1) == 20021
    old = PdPairConfig.from_env("kv_producer", {}, PREFILL)
    assert old.peer_set() == (PeerAddress("10.0.0.9", 20000),) and old.peer_port(1) == 20001
    both = PdPairConfig.from_env("kv_producer", {}, {**PREFILL, contract.ENV_PEERS: peers})
    assert both.peers == config.peers
    # A config built in code with the old fields only still has its one decode.
    assert dataclasses.replace(old, peers=()).peer_set() == (PeerAddress("10.0.0.9", 20000),)


def test_prefill_instance_names_it_in_kv_transfer_params_and_hello():
    """PDPAIR_INSTANCE, or `<hostname>:<PDPAIR_HTTP_PORT>`: the same in the scheduler and every worker process."""
    config = PdPairConfig.from_env("kv_producer", {}, {**PREFILL, contract.ENV_INSTANCE: "pair-prefill-g3-0"})
    assert config.instance_id == "pair-prefill-g3-0"
    default = PdPairConfig.from_env("kv_producer", {}, {**PREFILL, contract.ENV_HTTP_PORT: "20007"})
    assert default.instance_id == f"{socket.gethostname()}:20007"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({contract.ENV_PEERS: "10.0.0.9:20000,,10.0.0.8:20000"}, "an empty entry"),
        ({contract.ENV_PEERS: "10.0.0.9:20000,"}, "an empty entry"),
        ({contract.ENV_PEERS: "10.0.0.9"}, "'10.0.0.9' is not host:portBase"),
        ({contract.ENV_PEERS: "fd00::7:20000"}, "put an IPv6 address in brackets"),
        ({contract.ENV_PEERS: "[fd00::zz]:20000"}, "is not an IPv6 address"),
        ({contract.ENV_PEERS: "[fd00::7]20000"}, "is not [ipv6]:portBase"),
        ({contract.ENV_PEERS: "10.0.0.9:http"}, "the port of '10.0.0.9:http' is not a number"),
        ({contract.ENV_PEERS: "10.0.0.9:0"}, "not in 1..65535"),
        ({contract.ENV_PEERS: "bad host:20000"}, "is not a host name"),
        ({contract.ENV_PEERS: "a:1,b:2,a:1"}, "decode a:1 is named twice"),
        ({contract.ENV_PEERS: "a:1", contract.ENV_PEER_HOST: "b", contract.ENV_PEER_PORT_BASE: "1"},
         "name a decode that is not in PDPAIR_PEERS"),
        ({contract.ENV_PEER_PORT_BASE: "1"}, "or PDPAIR_PEERS"),
        ({contract.ENV_PEERS: "a:1", contract.ENV_INSTANCE: "has space"}, "PDPAIR_INSTANCE='has space'"),
    ],
)
def test_bad_peer_settings_fail_with_the_variable_named(env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        PdPairConfig.from_env("kv_producer", {}, {**TCP, **env})


def test_pdpair_peers_is_prefill_only():
    with pytest.raises(ConfigError, match="PDPAIR_PEERS applies to prefill only"):
        PdPairConfig.from_env("kv_consumer", {}, {**DECODE, contract.ENV_PEERS: "a:1"})


def test_peers_token_enables_the_peer_push_on_prefill_only():
    """PDPAIR_PEERS_TOKEN: prefill's bearer token of PUT /pdpair/v1/peers, served on the metrics port."""
    token = "t" * 16
    env = {**PREFILL, contract.ENV_PEERS_TOKEN: token, contract.ENV_METRICS_PORT: "9100"}
    assert PdPairConfig.from_env("kv_producer", {}, env).peers_token == token
    assert token not in repr(PdPairConfig.from_env("kv_producer", {}, env))
    for bad_env, message in (
        ({**env, contract.ENV_PEERS_TOKEN: "short"}, "at least 16 printable ASCII"),
        ({**env, contract.ENV_PEERS_TOKEN: "with a space in it!"}, "without spaces"),
        ({k: v for k, v in env.items() if k != contract.ENV_METRICS_PORT}, "needs PDPAIR_METRICS_PORT"),
    ):
        with pytest.raises(ConfigError, match=message):
            PdPairConfig.from_env("kv_producer", {}, bad_env)
    with pytest.raises(ConfigError, match="PDPAIR_PEERS_TOKEN applies to prefill only"):
        PdPairConfig.from_env("kv_consumer", {}, {**DECODE, contract.ENV_PEERS_TOKEN: token})


@pytest.mark.parametrize("kv_role, env", [("kv_consumer", DECODE), ("kv_producer", PREFILL)])
def test_side_channel_key_is_required_on_both_roles_and_at_least_32_characters(kv_role, env):
    """Every Hello is authenticated with PDPAIR_SIDE_CHANNEL_KEY: a pod without it (or with a short one) fails at
    start naming the variable, never the value; a good one is kept out of the config's repr. Instant."""
    without = {k: v for k, v in env.items() if k != contract.ENV_SIDE_CHANNEL_KEY}
    with pytest.raises(ConfigError, match=f"{contract.ENV_SIDE_CHANNEL_KEY} is required on prefill and decode"):
        PdPairConfig.from_env(kv_role, {}, without)
    for bad in ("short-key", "x" * 31, "a key with spaces in it that is long enough", "é" * 40):
        with pytest.raises(ConfigError, match=f"{contract.ENV_SIDE_CHANNEL_KEY} must be at least 32") as info:
            PdPairConfig.from_env(kv_role, {}, {**without, contract.ENV_SIDE_CHANNEL_KEY: bad})
        assert bad not in str(info.value)
    config = PdPairConfig.from_env(kv_role, {}, env)
    assert config.side_channel_key == TEST_SIDE_CHANNEL_KEY and TEST_SIDE_CHANNEL_KEY not in repr(config)


def test_max_edges_is_a_decode_setting_with_a_default():
    """PDPAIR_MAX_EDGES: decode's cap on prefill edges per rank (default contract.DEFAULT_MAX_EDGES). Instant."""
    assert PdPairConfig.from_env("kv_consumer", {}, DECODE).max_edges == contract.DEFAULT_MAX_EDGES == 64
    assert PdPairConfig.from_env("kv_consumer", {}, {**DECODE, contract.ENV_MAX_EDGES: "3"}).max_edges == 3
    with pytest.raises(ConfigError, match=f"{contract.ENV_MAX_EDGES}=0 must be >= 1"):
        PdPairConfig.from_env("kv_consumer", {}, {**DECODE, contract.ENV_MAX_EDGES: "0"})
    with pytest.raises(ConfigError, match="applies to decode only"):
        PdPairConfig.from_env("kv_producer", {}, {**PREFILL, contract.ENV_MAX_EDGES: "3"})

"""Connector settings: the pod environment (names from pdpair.contract) plus vLLM's kv_transfer_config, validated once
at construction so a misconfigured pod fails at start with a message naming the variable."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdpair import contract
from pdpair.connector import deadlines
from pdpair.connector.transports import transport_spec

# Defaults shared with the operator and the CRD (hang timeout, slots and their bounds) are declared once, in
# pdpair.contract; a transport may cap PDPAIR_TRANSPORT_SLOTS lower (TransportSpec.max_slots).
from pdpair.contract import DEFAULT_HANG_TIMEOUT_SECONDS, DEFAULT_TRANSPORT_SLOTS, MAX_TRANSPORT_SLOTS

KV_ROLE_TO_ROLE = {"kv_producer": contract.ROLE_PREFILL, "kv_consumer": contract.ROLE_DECODE}


class ConfigError(ValueError):
    """A setting is missing or invalid; the message names it."""


# A metric label value (signals.py's rule): the instance id and a peer's address are both `peer` labels.
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9_.:\-\[\]/]{1,128}$")
_HOST_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.\-]{0,251}[A-Za-z0-9_])?$")


@dataclass(frozen=True, order=True)
class PeerAddress:
    """One decode prefill pairs with: its side-channel host and port base (TP rank r listens on port_base + r)."""

    host: str
    port_base: int

    def port(self, tp_rank: int) -> int:
        return self.port_base + tp_rank

    @property
    def label(self) -> str:
        """`host:portBase` (`[v6]:portBase`): the `peer` label of this decode's series on prefill, and its name in logs."""
        return f"[{self.host}]:{self.port_base}" if ":" in self.host else f"{self.host}:{self.port_base}"

    def __str__(self) -> str:
        return self.label


def parse_peer(text: str, what: str = contract.ENV_PEERS) -> PeerAddress:
    """`host:portBase` or `[ipv6]:portBase`; ConfigError naming `what` and the entry."""
    entry = text.strip()
    if entry.startswith("["):
        host, sep, port = entry[1:].partition("]:")
        if not sep:
            raise ConfigError(f"{what}: {entry!r} is not [ipv6]:portBase")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{what}: {host!r} in {entry!r} is not an IPv6 address") from None
    else:
        host, sep, port = entry.rpartition(":")
        if not sep or not host:
            raise ConfigError(f"{what}: {entry!r} is not host:portBase")
        if ":" in host:
            raise ConfigError(f"{what}: {entry!r}: put an IPv6 address in brackets, [{host}]:{port}")
        if not _HOST_NAME.match(host):
            raise ConfigError(f"{what}: {host!r} in {entry!r} is not a host name or IPv4 address")
    try:
        value = int(port)
    except ValueError:
        raise ConfigError(f"{what}: the port of {entry!r} is not a number") from None
    if not 1 <= value <= 65535:
        raise ConfigError(f"{what}: the port of {entry!r} is not in 1..65535")
    return PeerAddress(host, value)


def parse_peers(text: str, what: str = contract.ENV_PEERS) -> tuple[PeerAddress, ...]:
    """A comma-separated `host:portBase` list (see `parse_peer`): no empty entry, no decode named twice."""
    peers: list[PeerAddress] = []
    for entry in text.split(","):
        if not entry.strip():
            raise ConfigError(f"{what}={text!r}: an empty entry (a stray comma?)")
        peer = parse_peer(entry, what)
        if peer in peers:
            raise ConfigError(f"{what}={text!r}: decode {peer} is named twice")
        peers.append(peer)
    return tuple(peers)


def check_peer_set(peers: Iterable[PeerAddress], what: str = "peer set") -> tuple[PeerAddress, ...]:
    """A peer set given in code (PrefillWorker.set_peers): PeerAddress values, no duplicate."""
    out: list[PeerAddress] = []
    for peer in peers:
        if not isinstance(peer, PeerAddress):
            raise ConfigError(f"{what}: {peer!r} is not a PeerAddress")
        if peer in out:
            raise ConfigError(f"{what}: decode {peer} is named twice")
        out.append(peer)
    return tuple(out)


def default_instance(http_port: int | None) -> str:
    """This prefill's identity when PDPAIR_INSTANCE is unset: `<hostname>:<PDPAIR_HTTP_PORT>` (the scheduler and
    every TP worker process of one engine agree on it; the HTTP port is leased per instance)."""
    host = socket.gethostname() or "localhost"
    return f"{host}:{http_port}" if http_port else host


@dataclass(frozen=True)
class PdPairConfig:
    role: str  # contract.ROLE_PREFILL | contract.ROLE_DECODE
    generation: int
    pair: str
    namespace: str
    transport: str
    hang_timeout_seconds: float
    metrics_port: int | None  # None: no pod metrics server (e.g. several engines in one test process)
    listen_host: str
    listen_port_base: int | None  # decode
    peer_host: str | None  # prefill
    peer_port_base: int | None  # prefill
    # prefill: every decode to pair with (PDPAIR_PEERS, or the one of PDPAIR_PEER_HOST/_PORT_BASE); empty in a config
    # built in code with peer_host/peer_port_base only: `peer_set()` gives that one
    peers: tuple[PeerAddress, ...] = ()
    instance: str = ""  # prefill's identity (PDPAIR_INSTANCE; `instance_id` falls back to default_instance)
    peers_token: str | None = field(default=None, repr=False)  # prefill: PUT /pdpair/v1/peers bearer token
    # Both roles: the pair's side-channel key (PDPAIR_SIDE_CHANNEL_KEY); every Hello is authenticated with it (and the
    # TP rank channel derives its key from it). Required from the environment; a config built in code without it
    # cannot start a worker (check_side_channel_key).
    side_channel_key: str | None = field(default=None, repr=False)
    # Decode: most prefill edges per TP rank (PDPAIR_MAX_EDGES); a further prefill is refused until one leaves.
    max_edges: int = contract.DEFAULT_MAX_EDGES
    transport_slots: int = DEFAULT_TRANSPORT_SLOTS  # request slots per peer connection (puts in flight)
    # Prefill (PDPAIR_LAYERWISE_PUTS): serve a keyed Pull layer by layer while the step computing its prompt runs
    layerwise_puts: bool = contract.DEFAULT_LAYERWISE_PUTS
    http_port: int | None = None  # the engine's own API port (PDPAIR_HTTP_PORT): /readyz checks its /health
    # The pair's API key (VLLM_API_KEY, from spec.apiKeySecret; None: no key): vLLM itself reads the variable and
    # refuses a /v1 request without it, so the warm-up's requests to the engine's own API carry it (warmup.py).
    api_key: str | None = field(default=None, repr=False)
    # The transport's own variables as the pod set them (TransportSpec.env_names, e.g. flagcx's FLAGCX_LIB_PATH):
    # read here so the connector has one env reader; the transport's build reads them from here.
    transport_env: Mapping[str, str] = field(default_factory=dict, hash=False)
    # Test-only knobs, from kv_connector_extra_config (all but the corrupt-KV and delay-listener knobs also from their
    # contract.ENV_TEST_* variable); never set by the operator.
    test_corrupt_kv_file: str | None = None  # decode: while this file exists, received KV is overwritten
    test_drop_signals_file: str | None = None  # prefill: while it exists, the native sender drops every N-th signal
    test_corrupt_puts_file: str | None = None  # prefill (tcp): while it exists, every put has a byte flipped on the way
    test_delay_listener_file: str | None = None  # decode: while it exists, the ranks it names do not listen yet
    test_slow_decode_file: str | None = None  # decode: while it exists, each model step sleeps the ms it holds
    test_stop_listener_file: str | None = None  # decode: once it exists, the side-channel loop stops (as a bug would)

    @property
    def send_lease_seconds(self) -> float:
        return deadlines.send_lease_seconds(self.hang_timeout_seconds)

    def transport_environment(self) -> dict[str, str]:
        """Variables the transport's library reads, to set in this process before it loads: the transport's
        defaults the pod left unset (TransportSpec.env_defaults; the pod's value always wins)."""
        return transport_spec(self.transport).process_environment(self.transport_env)

    def listen_port(self, tp_rank: int) -> int:
        assert self.listen_port_base is not None
        return self.listen_port_base + tp_rank

    def peer_port(self, tp_rank: int) -> int:
        assert self.peer_port_base is not None
        return self.peer_port_base + tp_rank

    def peer_set(self) -> tuple[PeerAddress, ...]:
        """Prefill's decodes at start: `peers`, else the one of `peer_host`/`peer_port_base`."""
        if self.peers:
            return self.peers
        if self.peer_host is not None and self.peer_port_base is not None:
            return (PeerAddress(self.peer_host, self.peer_port_base),)
        return ()

    @property
    def instance_id(self) -> str:
        return self.instance or default_instance(self.http_port)

    @classmethod
    def from_env(
        cls, kv_role: str, extra_config: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> PdPairConfig:
        env = os.environ if environ is None else environ
        extra = dict(extra_config or {})
        role = KV_ROLE_TO_ROLE.get(kv_role)
        if role is None:
            raise ConfigError(
                f"kv_role {kv_role!r} is not supported by PdPairConnector: use kv_producer (prefill) or "
                "kv_consumer (decode)"
            )
        env_role = env.get(contract.ENV_ROLE)
        if env_role and env_role != role:
            raise ConfigError(f"{contract.ENV_ROLE}={env_role!r} contradicts kv_role={kv_role!r} (means {role!r})")

        # No default here: the CRD's spec.connector.transport default (flagcx) is the one source, and the operator
        # always sets the variable. A bare engine must say which transport it means.
        transport = env.get(contract.ENV_TRANSPORT, "")
        if not transport:
            raise ConfigError(f"{contract.ENV_TRANSPORT} is required: one of {', '.join(contract.TRANSPORTS)} "
                              "(the operator sets it from spec.connector.transport)")
        if transport not in contract.TRANSPORTS:
            raise ConfigError(f"{contract.ENV_TRANSPORT}={transport!r}: use one of {', '.join(contract.TRANSPORTS)}")

        generation = _int(env, contract.ENV_GENERATION, default=0, minimum=0)
        transport_slots = _transport_slots(env, transport)
        hang = _float(env, contract.ENV_HANG_TIMEOUT_SECONDS, default=DEFAULT_HANG_TIMEOUT_SECONDS)
        metrics_port = _port(env, contract.ENV_METRICS_PORT, required=False)
        http_port = _port(env, contract.ENV_HTTP_PORT, required=False)
        listen_base = _port(env, contract.ENV_LISTEN_PORT_BASE, required=role == contract.ROLE_DECODE)
        peers_text = (env.get(contract.ENV_PEERS) or "").strip()
        peers = parse_peers(peers_text) if peers_text else ()
        if peers and role != contract.ROLE_PREFILL:
            raise ConfigError(f"{contract.ENV_PEERS} applies to prefill only (decode accepts every prefill), not to {role}")
        peer_host = env.get(contract.ENV_PEER_HOST) or None
        # A prefill with the push token may start with no decode: the operator creates it beside a decode that has
        # no address yet and pushes the address once it has one (PUT /pdpair/v1/peers).
        pushed = bool(env.get(contract.ENV_PEERS_TOKEN))
        if role == contract.ROLE_PREFILL and not peers and not peer_host and not pushed:
            raise ConfigError(f"{contract.ENV_PEER_HOST} is required on prefill (the decode pod's address), "
                              f"or {contract.ENV_PEERS} (every decode's host:portBase), or {contract.ENV_PEERS_TOKEN} "
                              "(the operator's push brings the decodes)")
        peer_base = _port(env, contract.ENV_PEER_PORT_BASE,
                          required=role == contract.ROLE_PREFILL and not peers and bool(peer_host))
        if peer_base and not peer_host and not peers:
            raise ConfigError(f"{contract.ENV_PEER_PORT_BASE} is set without {contract.ENV_PEER_HOST}: set both (the "
                              "decode pod's address and side-channel base port), or neither")
        if peers and (peer_host or peer_base):
            if not (peer_host and peer_base) or PeerAddress(peer_host, peer_base) not in peers:
                raise ConfigError(
                    f"{contract.ENV_PEER_HOST}={peer_host or ''!r} / {contract.ENV_PEER_PORT_BASE}={peer_base or ''!r} "
                    f"name a decode that is not in {contract.ENV_PEERS}={peers_text!r}: set the list alone, or make "
                    "it include that decode"
                )
        elif peer_host and peer_base:
            peers = (PeerAddress(peer_host, peer_base),)
        if peers:
            peer_host, peer_base = peers[0].host, peers[0].port_base
        instance = env.get(contract.ENV_INSTANCE) or ""
        if instance and not _LABEL_VALUE.match(instance):
            raise ConfigError(f"{contract.ENV_INSTANCE}={instance!r}: use at most 128 of [A-Za-z0-9_.:-[]/] (it is a "
                              "metric label value on decode)")
        if not instance and role == contract.ROLE_PREFILL:
            instance = default_instance(http_port)
        peers_token = env.get(contract.ENV_PEERS_TOKEN) or None
        if peers_token is not None:
            if role != contract.ROLE_PREFILL:
                raise ConfigError(f"{contract.ENV_PEERS_TOKEN} applies to prefill only (decode has no peer set)")
            if metrics_port is None:
                raise ConfigError(f"{contract.ENV_PEERS_TOKEN} needs {contract.ENV_METRICS_PORT}: the peer push is "
                                  "served on the metrics port")
            if len(peers_token) < 16 or not peers_token.isascii() or any(c.isspace() for c in peers_token):
                raise ConfigError(f"{contract.ENV_PEERS_TOKEN} must be at least 16 printable ASCII characters "
                                  "without spaces")

        side_channel_key = env.get(contract.ENV_SIDE_CHANNEL_KEY) or ""
        check_side_channel_key(side_channel_key)
        max_edges = _int(env, contract.ENV_MAX_EDGES, default=contract.DEFAULT_MAX_EDGES, minimum=1)
        if env.get(contract.ENV_MAX_EDGES) and role != contract.ROLE_DECODE:
            raise ConfigError(f"{contract.ENV_MAX_EDGES} applies to decode only (prefill's edges are its peer set)")

        layerwise = _bool(env, contract.ENV_LAYERWISE_PUTS, default=contract.DEFAULT_LAYERWISE_PUTS)
        if env.get(contract.ENV_LAYERWISE_PUTS) and role != contract.ROLE_PREFILL:
            raise ConfigError(f"{contract.ENV_LAYERWISE_PUTS} applies to prefill only (the sender), not to {role}")

        corrupt = extra.pop("test_corrupt_kv_file", None)
        drop = _test_knob_file(extra, "test_drop_signals_file", env, contract.ENV_TEST_DROP_SIGNALS_FILE)
        if drop and role != contract.ROLE_PREFILL:
            raise ConfigError(f"the signal-drop test knob ({contract.ENV_TEST_DROP_SIGNALS_FILE} or "
                              f"test_drop_signals_file) applies to prefill only (the sender), not to {role}")
        corrupt_puts = _test_knob_file(extra, "test_corrupt_puts_file", env, contract.ENV_TEST_CORRUPT_PUTS_FILE)
        if corrupt_puts and role != contract.ROLE_PREFILL:
            raise ConfigError(f"the corrupt-puts test knob ({contract.ENV_TEST_CORRUPT_PUTS_FILE} or "
                              f"test_corrupt_puts_file) applies to prefill only (the sender), not to {role}")
        if corrupt_puts and transport != contract.TRANSPORT_TCP:
            raise ConfigError(f"the corrupt-puts test knob ({contract.ENV_TEST_CORRUPT_PUTS_FILE} or "
                              f"test_corrupt_puts_file) needs the tcp transport (its native fault), not {transport}")
        delay_listener = extra.pop("test_delay_listener_file", None)
        slow_decode = _test_knob_file(extra, "test_slow_decode_file", env, contract.ENV_TEST_SLOW_DECODE_FILE)
        if slow_decode and role != contract.ROLE_DECODE:
            raise ConfigError(f"the slow-decode test knob ({contract.ENV_TEST_SLOW_DECODE_FILE} or "
                              f"test_slow_decode_file) applies to decode only (its model steps), not to {role}")
        stop_listener = _test_knob_file(extra, "test_stop_listener_file", env, contract.ENV_TEST_STOP_LISTENER_FILE)
        if stop_listener and role != contract.ROLE_DECODE:
            raise ConfigError(f"the stop-listener test knob ({contract.ENV_TEST_STOP_LISTENER_FILE} or "
                              f"test_stop_listener_file) applies to decode only (its side-channel listener), not to "
                              f"{role}")
        if extra:
            raise ConfigError(f"unknown kv_connector_extra_config keys for PdPairConnector: {sorted(extra)}")
        return cls(
            role=role,
            generation=generation,
            pair=env.get(contract.ENV_PAIR, ""),
            namespace=env.get(contract.ENV_NAMESPACE, ""),
            transport=transport,
            hang_timeout_seconds=hang,
            metrics_port=metrics_port,
            http_port=http_port,
            api_key=env.get(contract.ENV_API_KEY) or None,
            listen_host="0.0.0.0",
            listen_port_base=listen_base,
            peer_host=peer_host,
            peer_port_base=peer_base,
            peers=peers,
            instance=instance,
            peers_token=peers_token,
            side_channel_key=side_channel_key,
            max_edges=max_edges,
            transport_slots=transport_slots,
            layerwise_puts=layerwise,
            transport_env={name: env[name] for name in transport_spec(transport).env_names if name in env},
            test_corrupt_kv_file=str(corrupt) if corrupt else None,
            test_drop_signals_file=drop,
            test_corrupt_puts_file=corrupt_puts,
            test_delay_listener_file=str(delay_listener) if delay_listener else None,
            test_slow_decode_file=slow_decode,
            test_stop_listener_file=stop_listener,
        )


MIN_SIDE_CHANNEL_KEY_CHARS = 32  # 32 random characters are >= 160 bits even from a small alphabet


def check_side_channel_key(key: str | None) -> str:
    """PDPAIR_SIDE_CHANNEL_KEY as both engine roles need it: at least MIN_SIDE_CHANNEL_KEY_CHARS printable ASCII
    characters without spaces. ConfigError naming the variable (never the value)."""
    name = contract.ENV_SIDE_CHANNEL_KEY
    if not key:
        raise ConfigError(f"{name} is required on prefill and decode: the pair's side-channel key (the operator sets it "
                          f"from the pair's Secret, key {contract.SIDE_CHANNEL_SECRET_KEY}); every Hello is "
                          "authenticated with it")
    if len(key) < MIN_SIDE_CHANNEL_KEY_CHARS or not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise ConfigError(f"{name} must be at least {MIN_SIDE_CHANNEL_KEY_CHARS} printable ASCII characters without "
                          f"spaces (got {len(key)} characters)")
    return key


def _test_knob_file(extra: dict[str, Any], key: str, env: Mapping[str, str], env_name: str) -> str | None:
    """A test knob's file path, from kv_connector_extra_config `key` or the TEST_ONLY_* variable `env_name` (the
    operator owns the extra config, so a pair under it can only use the variable). Pops `key` from `extra`."""
    from_extra = extra.pop(key, None)
    from_env = env.get(env_name) or None
    if from_extra and from_env and str(from_extra) != from_env:
        raise ConfigError(f"{env_name}={from_env!r} contradicts kv_connector_extra_config {key}={from_extra!r}: "
                          "set one")
    path = from_extra or from_env
    return str(path) if path else None


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in ("true", "false"):
        raise ConfigError(f"{name}={raw!r}: use true or false")
    return value == "true"


def _transport_slots(env: Mapping[str, str], transport: str) -> int:
    name = contract.ENV_TRANSPORT_SLOTS
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return DEFAULT_TRANSPORT_SLOTS
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer (request slots per peer connection)") from None
    if not 1 <= value <= MAX_TRANSPORT_SLOTS:
        raise ConfigError(f"{name}={value} must be in 1..{MAX_TRANSPORT_SLOTS} (request slots per peer connection)")
    spec = transport_spec(transport)
    if value > spec.max_slots:
        raise ConfigError(
            f"{name}={value} must be <= {spec.max_slots} with {contract.ENV_TRANSPORT}={transport}: "
            f"{spec.max_slots_reason}"
        )
    return value


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{name}={raw!r} must be a finite number of seconds > 0")
    return value


def _port(env: Mapping[str, str], name: str, required: bool) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        if required:
            raise ConfigError(f"{name} is required for this role")
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise ConfigError(f"{name}={value} is not a port in 1..65535")
    return value

"""Operator configuration from the environment, validated once at start with a clear error.

SETTINGS is the one declaration of every variable: its name, the OperatorConfig field it fills, its default, how it
is read and checked, what it means and the chart value that sets it. The dataclass defaults, `from_env`, the table
in operator/README.md (`python -m pdpair.operator.model.config` prints it) come from it; tests/unit/operator/test_config.py
checks the chart's README, values.yaml comments and deployment template against it.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

ENV_OPERATOR_NAMESPACE = "PDPAIR_OPERATOR_NAMESPACE"
ENV_PORT_POOL = "PDPAIR_PORT_POOL"
ENV_WATCH_NAMESPACES = "PDPAIR_WATCH_NAMESPACES"
ENV_PROBE_INTERVAL = "PDPAIR_PROBE_INTERVAL_SECONDS"
ENV_PROBE_TIMEOUT = "PDPAIR_PROBE_TIMEOUT_SECONDS"
ENV_RESYNC_INTERVAL = "PDPAIR_RESYNC_INTERVAL_SECONDS"
ENV_SWEEP_INTERVAL = "PDPAIR_SWEEP_INTERVAL_SECONDS"
ENV_POOL_RETRY = "PDPAIR_POOL_RETRY_SECONDS"
ENV_LIVENESS_PORT = "PDPAIR_LIVENESS_PORT"
ENV_METRICS_PORT = "PDPAIR_OPERATOR_METRICS_PORT"
ENV_API_THREADS = "PDPAIR_API_THREADS"
ENV_HEALTH_INTERVAL = "PDPAIR_HEALTH_INTERVAL_SECONDS"
ENV_API_TIMEOUT = "PDPAIR_API_TIMEOUT_SECONDS"
ENV_POD_GONE_TIMEOUT = "PDPAIR_POD_GONE_TIMEOUT_SECONDS"
ENV_BUSY_PORT_QUARANTINE = "PDPAIR_BUSY_PORT_QUARANTINE_SECONDS"
ENV_NODE_LOST_SECONDS = "PDPAIR_NODE_LOST_SECONDS"
ENV_LEADER_ELECT = "PDPAIR_LEADER_ELECT"
ENV_LEADER_LEASE_NAME = "PDPAIR_LEADER_LEASE_NAME"
ENV_LEADER_LEASE_DURATION = "PDPAIR_LEADER_LEASE_DURATION_SECONDS"
ENV_LEADER_RENEW_DEADLINE = "PDPAIR_LEADER_RENEW_DEADLINE_SECONDS"
ENV_LEADER_RETRY_PERIOD = "PDPAIR_LEADER_RETRY_PERIOD_SECONDS"
ENV_POD_NAME = "PDPAIR_POD_NAME"
ENV_PEERS_KEY = "PDPAIR_PEERS_KEY"
ENV_NETWORK_POLICY = "PDPAIR_NETWORK_POLICY"

DEFAULT_PORT_POOL = "20000-29999"
DEFAULT_LEADER_LEASE_NAME = "pdpair-operator-leader"


class ConfigError(ValueError):
    """The operator's environment is invalid; the message names the variable."""


@dataclass(frozen=True)
class PortPool:
    first: int
    last: int  # inclusive

    def __post_init__(self) -> None:
        if not (1 <= self.first <= self.last <= 65535):
            raise ConfigError(f"{ENV_PORT_POOL}: need 1 <= first <= last <= 65535, got {self.first}-{self.last}")

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.first <= port <= self.last

    def __iter__(self):
        return iter(range(self.first, self.last + 1))

    @classmethod
    def parse(cls, text: str) -> "PortPool":
        first, sep, last = text.strip().partition("-")
        try:
            low = int(first)
            high = int(last) if sep else low
        except ValueError:
            raise ConfigError(f"{ENV_PORT_POOL}: expected 'FIRST-LAST' such as 20000-29999, got {text!r}") from None
        return cls(low, high)


# ---------------------------------------------------------------------------------------------------------------
# How a variable's text is read and checked
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kind:
    convert: Callable[[str], Any]  # raises ValueError (or ConfigError) on text that is not of this kind
    expected: str  # "expected <this>, got ..."
    valid: Callable[[Any], bool] = lambda value: True
    rule: str = ""  # "must be <this>, got ..."


def _bool_word(raw: str) -> bool:
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    if raw.lower() not in words:
        raise ValueError(raw)
    return words[raw.lower()]


SECONDS = Kind(float, "a number", lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
COUNT = Kind(int, "a whole number >= 1", lambda v: v >= 1, ">= 1")
PORT = Kind(int, "a port number", lambda v: 0 <= v <= 65535, "0..65535")  # 0 = pick a free port (tests)
BOOL = Kind(_bool_word, "true or false")
TEXT = Kind(str, "text")
NAMESPACE_LIST = Kind(lambda raw: tuple(n.strip() for n in raw.split(",") if n.strip()), "a comma-separated list")
POOL = Kind(PortPool.parse, "'FIRST-LAST'")
# A Lease's name must be a DNS-1123 subdomain, as the apiserver demands.
LEASE_NAME = Kind(str, "a name", lambda v: len(v) <= 253 and bool(re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", v)),
                  "a valid Lease name (lower-case DNS-1123)")

# The key each pair's push token is derived from (push.pair_token): long enough for HMAC-SHA256, printable.
PEERS_KEY = Kind(str, "text", lambda v: len(v) >= 32 and v.isprintable() and " " not in v,
                 "at least 32 printable characters without spaces")

REQUIRED = object()


@dataclass(frozen=True)
class Setting:
    env: str
    field: str | None  # OperatorConfig's attribute; None: read elsewhere (`doc` says where)
    default: Any  # REQUIRED: no default, the operator refuses to start without it
    kind: Kind
    doc: str
    chart: str  # the chart value that sets it ("operator.…"), or "(what the chart derives it from)"

    def read(self, env: Mapping[str, str]) -> Any:
        raw = env.get(self.env, "").strip()
        if not raw:
            if self.default is REQUIRED:
                raise ConfigError(f"{self.env} must be set: {self.doc}")
            return self.default
        try:
            value = self.kind.convert(raw)
        except ValueError as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"{self.env}: expected {self.kind.expected}, got {raw!r}") from None
        if not self.kind.valid(value):
            raise ConfigError(f"{self.env}: must be {self.kind.rule}, got {raw!r}")
        return value

    @property
    def shown_default(self) -> str:
        """The default as the docs show it."""
        if self.default is REQUIRED:
            return "required"
        if isinstance(self.default, bool):
            return str(self.default).lower()
        if isinstance(self.default, float):
            return f"{self.default:g}"
        if isinstance(self.default, tuple):
            return "empty"
        return str(self.default)


SETTINGS: tuple[Setting, ...] = (
    Setting(ENV_OPERATOR_NAMESPACE, "namespace", REQUIRED, TEXT,
            "the namespace that holds the port leases (the operator's own)", "(the operator pod's namespace)"),
    Setting(ENV_PORT_POOL, "port_pool", PortPool.parse(DEFAULT_PORT_POOL), POOL,
            "the ports pairs are leased from, cluster-wide; below the nodes' ephemeral range",
            "operator.portPool"),
    Setting(ENV_WATCH_NAMESPACES, "watch_namespaces", (), NAMESPACE_LIST,
            "namespaces whose pairs this operator manages, comma-separated; empty: all", "operator.watchNamespaces"),
    Setting(ENV_PROBE_INTERVAL, "probe_interval", 1.0, SECONDS,
            "seconds between TCP probes of decode's side channel (nothing wakes the pair when a listener opens)",
            "operator.tuning.probeIntervalSeconds"),
    Setting(ENV_PROBE_TIMEOUT, "probe_timeout", 0.5, SECONDS, "deadline of one probe in seconds",
            "operator.tuning.probeTimeoutSeconds"),
    Setting(ENV_RESYNC_INTERVAL, "resync_interval", 30.0, SECONDS, "seconds between full reconciles of every pair",
            "operator.tuning.resyncIntervalSeconds"),
    Setting(ENV_SWEEP_INTERVAL, "sweep_interval", 60.0, SECONDS,
            "seconds between sweeps for leases whose pair is gone", "operator.tuning.sweepIntervalSeconds"),
    Setting(ENV_POOL_RETRY, "pool_retry", 5.0, SECONDS, "seconds before retrying a pair that found the pool exhausted",
            "operator.tuning.poolRetrySeconds"),
    Setting(ENV_HEALTH_INTERVAL, "health_interval", 10.0, SECONDS,
            "seconds between reads of the pods' signal metrics (health.py)", "operator.tuning.healthIntervalSeconds"),
    Setting(ENV_LIVENESS_PORT, "liveness_port", 8080, PORT,
            "kopf's /healthz; must differ from the metrics port (0: pick a free port, tests)", "operator.livenessPort"),
    Setting(ENV_METRICS_PORT, "metrics_port", 9090, PORT, "the operator's /metrics (0: pick a free port, tests)",
            "operator.metricsPort"),
    Setting(ENV_API_THREADS, "api_threads", 32, COUNT, "threads for blocking Kubernetes API calls",
            "operator.tuning.apiThreads"),
    Setting(ENV_API_TIMEOUT, "api_timeout", 30.0, SECONDS,
            "deadline of every Kubernetes API call the operator makes through the official client: read timeout = "
            "this, connect = min(5, this); a timed-out call fails that pass, retried like any API error (kopf's "
            "watches have their own, in handlers.configure)", "operator.tuning.apiTimeoutSeconds"),
    Setting(ENV_POD_GONE_TIMEOUT, "pod_gone_timeout", 600.0, SECONDS,
            "how long a deleted pair keeps its port leases while its pods terminate; then the ports of pods still "
            "there stay fenced to them and the rest are released, with a Warning Event naming those pods "
            "(docs/design.md, \"Port leases\")",
            "operator.tuning.podGoneTimeoutSeconds"),
    Setting(ENV_BUSY_PORT_QUARANTINE, "busy_port_quarantine", 600, COUNT,
            "seconds a leased port found in use on a node (a process outside Kubernetes holds it) is kept from every "
            "pair (busy_ports.py)", "operator.tuning.busyPortQuarantineSeconds"),
    Setting(ENV_NODE_LOST_SECONDS, "node_lost_seconds", 30.0, SECONDS,
            "a pair pod's node whose Ready condition is False or Unknown this long counts as lost (at once when it "
            "carries the node.kubernetes.io/unreachable taint): the pair is re-homed on Ready nodes (a serving xPyD "
            "pair: only that node's pods, force-deleted and re-created) and the pod's ports stay fenced to it until "
            "it is gone and its node is back (nodes.py; docs/design.md, \"Lost nodes\"). Long enough to "
            "ride out a kubelet restart, far below the 300 s after which the cluster would evict the pods",
            "operator.tuning.nodeLostSeconds"),
    Setting(ENV_NETWORK_POLICY, "network_policy", False, BOOL,
            "give each pair with spec.network.hostNetwork false a NetworkPolicy: only its own pods reach its engines, "
            "the operator's namespace only their metrics and side-channel ports (build/network_policy.py; "
            "hostNetwork pairs need host-firewall rules instead: charts/pdpair/README.md, \"Network isolation\")",
            "operator.networkPolicy.enabled"),
    Setting(ENV_LEADER_ELECT, "leader_elect", False, BOOL,
            "campaign for the leader Lease before acting (docs/design.md, \"Operator high availability\")",
            "operator.leaderElection.enabled"),
    Setting(ENV_LEADER_LEASE_NAME, "leader_lease_name", DEFAULT_LEADER_LEASE_NAME, LEASE_NAME,
            "the leader Lease, in the operator's namespace", "(`<fullname>-operator-leader`)"),
    Setting(ENV_LEADER_LEASE_DURATION, "leader_lease_duration", 15.0, SECONDS,
            "a standby takes the Lease this long after the last renewal it saw",
            "operator.leaderElection.leaseDurationSeconds"),
    Setting(ENV_LEADER_RENEW_DEADLINE, "leader_renew_deadline", 10.0, SECONDS,
            "the leader exits when no renewal succeeded for this long; retry < renew deadline < lease duration",
            "operator.leaderElection.renewDeadlineSeconds"),
    Setting(ENV_LEADER_RETRY_PERIOD, "leader_retry_period", 2.0, SECONDS,
            "seconds between renewals and between a standby's tries", "operator.leaderElection.retryPeriodSeconds"),
    Setting(ENV_PEERS_KEY, "peers_key", "", PEERS_KEY,
            "the key each pair's push token and side-channel key are derived from (HMACs of the pair's uid, "
            "push.pair_token, pair_secrets.side_channel_key), so the operator needs create and never get on Secrets; "
            "unset: a random key per process, and pods made before an operator restart refuse its pushes (a "
            "PeersPushRefused Event) until they are re-created (the side-channel key is kept: its Secret, once made, "
            "is not made again)",
            "(the chart's Secret `<fullname>-operator`, made once at install and kept on upgrade)"),
    Setting(ENV_POD_NAME, None, "the host name", TEXT,
            "the candidate's identity in the leader Lease, plus a per-process suffix (read by __main__)",
            "(the operator pod's name)"),
)

_BY_FIELD = {s.field: s for s in SETTINGS if s.field}


def _default(field: str) -> Any:
    return _BY_FIELD[field].default


@dataclass(frozen=True)
class OperatorConfig:
    # Every default comes from SETTINGS; namespace (required) and port_pool have none here, so a config built in
    # code names both.
    namespace: str
    port_pool: PortPool
    watch_namespaces: tuple[str, ...] = _default("watch_namespaces")
    probe_interval: float = _default("probe_interval")
    probe_timeout: float = _default("probe_timeout")
    resync_interval: float = _default("resync_interval")
    sweep_interval: float = _default("sweep_interval")
    pool_retry: float = _default("pool_retry")
    liveness_port: int = _default("liveness_port")
    metrics_port: int = _default("metrics_port")
    api_threads: int = _default("api_threads")
    health_interval: float = _default("health_interval")
    api_timeout: float = _default("api_timeout")
    pod_gone_timeout: float = _default("pod_gone_timeout")
    leader_elect: bool = _default("leader_elect")
    leader_lease_name: str = _default("leader_lease_name")
    leader_lease_duration: float = _default("leader_lease_duration")
    leader_renew_deadline: float = _default("leader_renew_deadline")
    leader_retry_period: float = _default("leader_retry_period")
    busy_port_quarantine: int = _default("busy_port_quarantine")
    node_lost_seconds: float = _default("node_lost_seconds")
    peers_key: str = _default("peers_key")
    network_policy: bool = _default("network_policy")

    def __post_init__(self) -> None:
        if not (self.leader_retry_period < self.leader_renew_deadline < self.leader_lease_duration):
            raise ConfigError(
                f"leader election needs {ENV_LEADER_RETRY_PERIOD} ({self.leader_retry_period:g}) < "
                f"{ENV_LEADER_RENEW_DEADLINE} ({self.leader_renew_deadline:g}) < {ENV_LEADER_LEASE_DURATION} "
                f"({self.leader_lease_duration:g}): the leader must stop before a standby may take over"
            )
        if self.liveness_port and self.liveness_port == self.metrics_port:
            raise ConfigError(
                f"{ENV_LIVENESS_PORT} and {ENV_METRICS_PORT} are both {self.metrics_port}: they must differ"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "OperatorConfig":
        env = os.environ if env is None else env
        return cls(**{s.field: s.read(env) for s in SETTINGS if s.field})


def settings_markdown() -> str:
    """The table of operator/README.md, "Configuration (environment)"."""
    rows = ["| variable | default | must be | chart value | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        chart = f"`{s.chart}`" if s.chart.startswith("operator.") else s.chart
        rows.append(f"| `{s.env}` | `{s.shown_default}` | {s.kind.rule or s.kind.expected} | {chart} | {s.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(settings_markdown(), end="")

"""Operator configuration from the environment, validated once at start with a clear error."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Mapping

ENV_OPERATOR_NAMESPACE = "PDPAIR_OPERATOR_NAMESPACE"
ENV_PORT_POOL = "PDPAIR_PORT_POOL"
ENV_WATCH_NAMESPACES = "PDPAIR_WATCH_NAMESPACES"  # comma-separated; empty means all namespaces
ENV_PROBE_INTERVAL = "PDPAIR_PROBE_INTERVAL_SECONDS"
ENV_PROBE_TIMEOUT = "PDPAIR_PROBE_TIMEOUT_SECONDS"
ENV_RESYNC_INTERVAL = "PDPAIR_RESYNC_INTERVAL_SECONDS"
ENV_SWEEP_INTERVAL = "PDPAIR_SWEEP_INTERVAL_SECONDS"
ENV_POOL_RETRY = "PDPAIR_POOL_RETRY_SECONDS"
ENV_LIVENESS_PORT = "PDPAIR_LIVENESS_PORT"
ENV_METRICS_PORT = "PDPAIR_OPERATOR_METRICS_PORT"
ENV_API_THREADS = "PDPAIR_API_THREADS"
ENV_HEALTH_INTERVAL = "PDPAIR_HEALTH_INTERVAL_SECONDS"
ENV_API_TIMEOUT = "PDPAIR_API_TIMEOUT_SECONDS"  # deadline of one Kubernetes API call (api.py)
# How long a deleted pair keeps its port leases while its pods terminate (handlers.release_ports).
ENV_POD_GONE_TIMEOUT = "PDPAIR_POD_GONE_TIMEOUT_SECONDS"
# Leader election (election.py): off runs one operator alone; the chart turns it on for its replicas.
ENV_LEADER_ELECT = "PDPAIR_LEADER_ELECT"  # true/false
ENV_LEADER_LEASE_NAME = "PDPAIR_LEADER_LEASE_NAME"
ENV_LEADER_LEASE_DURATION = "PDPAIR_LEADER_LEASE_DURATION_SECONDS"
ENV_LEADER_RENEW_DEADLINE = "PDPAIR_LEADER_RENEW_DEADLINE_SECONDS"
ENV_LEADER_RETRY_PERIOD = "PDPAIR_LEADER_RETRY_PERIOD_SECONDS"
ENV_POD_NAME = "PDPAIR_POD_NAME"  # the candidate's identity (downward API); a random suffix is added per process

DEFAULT_LEADER_LEASE_NAME = "pdpair-operator-leader"
# How long a port found busy on a node (a process outside Kubernetes holds it) is kept from every pair (busy_ports.py).
ENV_BUSY_PORT_QUARANTINE = "PDPAIR_BUSY_PORT_QUARANTINE_SECONDS"

DEFAULT_PORT_POOL = "20000-29999"


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


@dataclass(frozen=True)
class OperatorConfig:
    namespace: str
    port_pool: PortPool
    watch_namespaces: tuple[str, ...] = ()
    probe_interval: float = 1.0
    probe_timeout: float = 0.5
    resync_interval: float = 30.0
    sweep_interval: float = 60.0
    pool_retry: float = 5.0
    liveness_port: int = 8080
    metrics_port: int = 9090
    api_threads: int = 32
    health_interval: float = 10.0
    api_timeout: float = 30.0
    pod_gone_timeout: float = 600.0
    leader_elect: bool = False
    leader_lease_name: str = DEFAULT_LEADER_LEASE_NAME
    leader_lease_duration: float = 15.0
    leader_renew_deadline: float = 10.0
    leader_retry_period: float = 2.0
    busy_port_quarantine: int = 600

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
        namespace = env.get(ENV_OPERATOR_NAMESPACE, "").strip()
        if not namespace:
            raise ConfigError(f"{ENV_OPERATOR_NAMESPACE} must name the namespace that holds the port leases")
        watch = tuple(n.strip() for n in env.get(ENV_WATCH_NAMESPACES, "").split(",") if n.strip())
        return cls(
            namespace=namespace,
            port_pool=PortPool.parse(env.get(ENV_PORT_POOL, DEFAULT_PORT_POOL)),
            watch_namespaces=watch,
            probe_interval=_positive_float(env, ENV_PROBE_INTERVAL, 1.0),
            probe_timeout=_positive_float(env, ENV_PROBE_TIMEOUT, 0.5),
            resync_interval=_positive_float(env, ENV_RESYNC_INTERVAL, 30.0),
            sweep_interval=_positive_float(env, ENV_SWEEP_INTERVAL, 60.0),
            pool_retry=_positive_float(env, ENV_POOL_RETRY, 5.0),
            liveness_port=_port(env, ENV_LIVENESS_PORT, 8080),
            metrics_port=_port(env, ENV_METRICS_PORT, 9090),
            api_threads=_positive_int(env, ENV_API_THREADS, 32),
            health_interval=_positive_float(env, ENV_HEALTH_INTERVAL, 10.0),
            api_timeout=_positive_float(env, ENV_API_TIMEOUT, 30.0),
            pod_gone_timeout=_positive_float(env, ENV_POD_GONE_TIMEOUT, 600.0),
            leader_elect=_bool(env, ENV_LEADER_ELECT, False),
            leader_lease_name=_lease_name(env.get(ENV_LEADER_LEASE_NAME, "").strip() or DEFAULT_LEADER_LEASE_NAME),
            leader_lease_duration=_positive_float(env, ENV_LEADER_LEASE_DURATION, 15.0),
            leader_renew_deadline=_positive_float(env, ENV_LEADER_RENEW_DEADLINE, 10.0),
            leader_retry_period=_positive_float(env, ENV_LEADER_RETRY_PERIOD, 2.0),
            busy_port_quarantine=_positive_int(env, ENV_BUSY_PORT_QUARANTINE, 600),
        )


def _parse(env: Mapping[str, str], name: str, default, convert, expected: str, valid, rule: str):
    """One env setting: the default when unset, else `convert(raw)`; a clear error naming the variable otherwise."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = convert(raw)
    except ValueError:
        raise ConfigError(f"{name}: expected {expected}, got {raw!r}") from None
    if not valid(value):
        raise ConfigError(f"{name}: must be {rule}, got {raw!r}")
    return value


def _positive_float(env: Mapping[str, str], name: str, default: float) -> float:
    return _parse(env, name, default, float, "a number", lambda v: math.isfinite(v) and v > 0, "a finite number > 0")


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    return _parse(env, name, default, int, "a whole number >= 1", lambda v: v >= 1, ">= 1")


def _port(env: Mapping[str, str], name: str, default: int) -> int:
    # 0 = pick a free port (tests)
    return _parse(env, name, default, int, "a port number", lambda v: 0 <= v <= 65535, "0..65535")


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    return _parse(env, name, default, lambda raw: words[raw.lower()] if raw.lower() in words else _no(raw),
                  "true or false", lambda v: True, "true or false")


def _no(raw: str) -> bool:
    raise ValueError(raw)


def _lease_name(name: str) -> str:
    # a DNS-1123 subdomain, as the apiserver demands of a Lease's name
    if len(name) > 253 or not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name):
        raise ConfigError(f"{ENV_LEADER_LEASE_NAME}: {name!r} is not a valid Lease name (lower-case DNS-1123)")
    return name

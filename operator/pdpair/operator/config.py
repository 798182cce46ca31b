"""Operator configuration from the environment, validated once at start with a clear error."""

from __future__ import annotations

import math
import os
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
    busy_port_quarantine: int = 600

    def __post_init__(self) -> None:
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

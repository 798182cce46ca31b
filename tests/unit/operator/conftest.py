"""Fixtures shared by the health tests: real pod exporters (the connector's SignalAccounts on its /metrics server)
and a port nobody listens on."""

import socket

import pytest

from pdpair.connector.pod_server import serve
from pdpair.connector.signals import SignalAccounts
from pdpair.operator.decide.health import ScrapeTarget


@pytest.fixture
def exporter_pods():
    """start(role, generation, hang_timeout, pod=None) -> (accounts, target): an exporter on a free port, stopped at
    the end. The pod name defaults to `<role>-<port>`."""
    servers = []

    def start(role="decode", generation=1, hang_timeout=30.0, pod=None):
        accounts = SignalAccounts(role, hang_timeout, generation=generation)
        server = serve(0, accounts, addr="127.0.0.1")
        servers.append(server)
        return accounts, ScrapeTarget(role, pod or f"{role}-{server.port}", "127.0.0.1", server.port)

    yield start
    for s in servers:
        s.stop()


@pytest.fixture
def closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

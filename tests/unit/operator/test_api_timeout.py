"""api.TimedApi: a real kubernetes client call against an apiserver that never answers ends at the deadline."""

import socket
import threading
import time

import kubernetes
import pytest
import urllib3

from pdpair.operator.act.kube_api import CONNECT_TIMEOUT_CAP, TimedApi, request_timeout

# urllib3 wraps the read timeout in MaxRetryError even with retries=0
TIMED_OUT = (urllib3.exceptions.MaxRetryError, urllib3.exceptions.ReadTimeoutError)


@pytest.fixture
def silent_server():
    """A TCP server that accepts and then never sends a byte (a hung apiserver)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(5)
    for conn in accepted:
        conn.close()
    listener.close()


def _core(port: int) -> kubernetes.client.CoreV1Api:
    configuration = kubernetes.client.Configuration()
    configuration.host = f"http://127.0.0.1:{port}"
    configuration.retries = 0
    return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(configuration))


def test_request_timeout_caps_connect_only():
    assert request_timeout(30) == (CONNECT_TIMEOUT_CAP, 30)
    assert request_timeout(1.5) == (1.5, 1.5)


def test_every_call_ends_at_the_deadline(silent_server):
    core = TimedApi(_core(silent_server), 0.5)
    for call in (lambda: core.list_namespaced_pod("default"), lambda: core.read_namespace("default")):
        started = time.monotonic()
        with pytest.raises(TIMED_OUT, match=r"read timeout=0\.5"):
            call()
        assert time.monotonic() - started < 3.0


def test_caller_timeout_wins(silent_server):
    core = TimedApi(_core(silent_server), 60)
    started = time.monotonic()
    with pytest.raises(TIMED_OUT, match=r"read timeout=0\.3"):
        core.list_namespaced_pod("default", _request_timeout=(1, 0.3))
    assert time.monotonic() - started < 3.0


def test_attributes_pass_through():
    raw = _core(1)
    assert TimedApi(raw, 1).api_client is raw.api_client

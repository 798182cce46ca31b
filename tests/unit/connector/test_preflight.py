"""The port preflight (pdpair.connector.preflight) on real sockets, run the way a hostNetwork pod's container runs it
(in front of its command, which it execs on free ports)."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys

import pytest

from pdpair.connector import preflight
from pdpair.contract import parse_ports_in_use, ports_in_use_message
from devcluster.ports import free_port


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free now (devcluster/ports.py: claimed, below the ephemeral range)."""
    return [free_port() for _ in range(count)]


def run_preflight(ports, log_path, command=()):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), preflight.ENV_TERMINATION_LOG: str(log_path)}
    then = ["--", *command] if command else []
    return subprocess.run([sys.executable, "-m", "pdpair.connector.preflight", *map(str, ports), *then],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture
def termination_log(tmp_path):
    path = tmp_path / "termination-log"
    path.write_text("")  # the kubelet creates the file; the preflight only appends to one that exists
    return path


def test_all_ports_free_exits_0_and_writes_nothing(termination_log):
    ports = free_ports(3)
    proc = run_preflight(ports, termination_log)
    assert proc.returncode == 0, proc.stderr
    assert termination_log.read_text() == ""
    # it released every port it bound
    assert preflight.busy_ports(ports) == {}


def test_on_free_ports_it_becomes_the_command_and_passes_its_exit_status(termination_log):
    """As the pod runs it: `preflight PORTS -- COMMAND...` execs the command (its own process: the same pid, so the
    container's main process is the engine), which can bind every checked port."""
    ports = free_ports(2)
    script = ("import os, socket, sys; [socket.socket().bind(('0.0.0.0', int(p))) for p in sys.argv[1:]]; "
              "print('pid', os.getpid()); sys.exit(7)")
    proc = run_preflight(ports, termination_log, [sys.executable, "-c", script, *map(str, ports)])
    assert proc.returncode == 7, proc.stderr
    assert "are free on this node" in proc.stdout and "pid " in proc.stdout
    assert termination_log.read_text() == ""


def test_on_a_busy_port_the_command_never_runs(termination_log):
    [port] = free_ports(1)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        proc = run_preflight([port], termination_log, [sys.executable, "-c", "print('engine started')"])
    assert proc.returncode == preflight.EXIT_PORTS_IN_USE and "engine started" not in proc.stdout
    assert parse_ports_in_use(termination_log.read_text()) == (port,)


def test_a_command_that_cannot_run_is_named(termination_log):
    proc = run_preflight(free_ports(1), termination_log, ["/nonexistent/engine"])
    assert proc.returncode == preflight.EXIT_NO_COMMAND and "/nonexistent/engine" in proc.stderr


def test_a_listener_and_a_bound_socket_of_another_process_are_both_reported_in_one_go(termination_log):
    free, listened, bound = free_ports(3)
    with socket.socket() as listener, socket.socket() as only_bound:
        listener.bind(("127.0.0.1", listened))  # on loopback only: binding 0.0.0.0 still clashes
        listener.listen()
        only_bound.bind(("0.0.0.0", bound))  # bound, never listening (no SO_REUSEADDR): a clash too
        proc = run_preflight([free, listened, bound], termination_log)
        assert proc.returncode == preflight.EXIT_PORTS_IN_USE
        message = termination_log.read_text()
        assert parse_ports_in_use(message) == tuple(sorted((listened, bound)))
        assert str(free) not in message.splitlines()[0]
        assert parse_ports_in_use(proc.stderr) == tuple(sorted((listened, bound)))
        # the foreign sockets are untouched
        assert listener.getsockname()[1] == listened
        with socket.create_connection(("127.0.0.1", listened), timeout=5):
            pass


def test_time_wait_leftover_is_not_a_clash(termination_log):
    """A connection closed by the server side leaves TIME_WAIT on the port; the engines bind with SO_REUSEADDR,
    so that is no failure and the preflight must not call it one."""
    [port] = free_ports(1)
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    conn, _ = server.accept()
    conn.close()  # the server closes first: its side goes to TIME_WAIT
    client.close()
    server.close()
    proc = run_preflight([port], termination_log)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("args", [[], ["http"], ["0"], ["70000"], ["20000", "--"], ["--", "true"]])
def test_bad_arguments_exit_2(args, termination_log):
    proc = run_preflight(args, termination_log)
    assert proc.returncode == preflight.EXIT_USAGE and "usage" in proc.stderr
    assert termination_log.read_text() == ""


def test_no_termination_log_outside_a_pod(tmp_path, monkeypatch):
    monkeypatch.setenv(preflight.ENV_TERMINATION_LOG, str(tmp_path / "absent"))
    assert preflight.report_ports_in_use([20000]) is False
    assert not (tmp_path / "absent").exists()


def test_report_bind_failure_only_for_address_in_use(termination_log, monkeypatch):
    monkeypatch.setenv(preflight.ENV_TERMINATION_LOG, str(termination_log))
    assert preflight.report_bind_failure(20001, PermissionError(errno.EACCES, "denied"), "x") is False
    assert termination_log.read_text() == ""
    assert preflight.report_bind_failure(20001, OSError(errno.EADDRINUSE, "in use"), "the metrics server") is True
    assert parse_ports_in_use(termination_log.read_text()) == (20001,)


@pytest.mark.parametrize("message, ports", [
    (ports_in_use_message([20003]), (20003,)),
    (ports_in_use_message([20005, 20003, 20005], "detail"), (20003, 20005)),
    ("some crash\npdpair: ports in use on this node: 1, 2 x 70000\n", (1, 2)),
    ("pdpair: ports in use on this node:", ()),
    ("Error: port 20003 in use", ()),
    ("", ()),
    (None, ()),
])
def test_the_message_round_trips_and_nothing_else_parses(message, ports):
    assert parse_ports_in_use(message) == ports

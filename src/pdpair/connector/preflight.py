"""Preflight of an engine pod on the host network: can every port the pod will use be bound on this node?

The operator runs it as the first step of each hostNetwork pair pod's own container (pods.py), with the pod's
containerPorts as arguments, then `--` and the container's real command, which it becomes (exec) once every port is
free:

    python -m pdpair.connector.preflight 20000 20001 20002 -- python -m vllm.entrypoints.openai.api_server ...

(It was the pod's last init container until the parallel start was measured: an init container's exit reaches the
kubelet only at its next relist, up to a second later, and its own container start costs as much again, on the
path of both engines of every pair start. Run in place, it costs one small Python start.) Without `--` it only
checks and exits 0.

It binds and listens on each port (0.0.0.0, SO_REUSEADDR, as uvicorn, zmq and the metrics server do, so a
TIME_WAIT leftover is no failure but any listener or bound socket of another process is), all at once, then closes
them. On a busy port it writes `pdpair: ports in use on this node: <ports>` (pdpair.contract) to the termination
message file and exits 1; the operator reads that from the pod's status, quarantines the ports and leases the pair
others. It imports only the standard library and pdpair.contract, so it takes well under a second.

`report_bind_failure` is the same report for the race the preflight cannot see (a port taken between the preflight
and the engine's own bind): the connector calls it when its side-channel or metrics bind fails.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from typing import Iterable

from pdpair.contract import ports_in_use_message

# Kubernetes' default terminationMessagePath; the kubelet creates the file, so outside a pod nothing is written.
TERMINATION_LOG = "/dev/termination-log"
ENV_TERMINATION_LOG = "PDPAIR_TERMINATION_LOG"  # tests point it elsewhere
EXIT_PORTS_IN_USE = 1
EXIT_USAGE = 2
EXIT_NO_COMMAND = 127  # the shell's "command not found"


def busy_ports(ports: Iterable[int], host: str = "0.0.0.0") -> dict[int, str]:
    """{port: why} for each port that cannot be bound and listened on now; {} when all can."""
    busy: dict[int, str] = {}
    held: list[socket.socket] = []
    try:
        for port in sorted(set(ports)):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, port))
                sock.listen(1)
            except OSError as exc:
                busy[port] = os.strerror(exc.errno) if exc.errno else str(exc)
    finally:
        for sock in held:
            sock.close()
    return busy


def termination_log_path() -> str:
    return os.environ.get(ENV_TERMINATION_LOG) or TERMINATION_LOG


def report_ports_in_use(ports: Iterable[int], detail: str = "") -> bool:
    """Append the ports-in-use line to the termination message file, if this runs in a container that has one."""
    path = termination_log_path()
    if not os.path.exists(path):
        return False
    try:
        with open(path, "a", encoding="utf-8") as out:
            out.write(ports_in_use_message(ports, detail))
        return True
    except OSError:
        return False  # a read-only or odd file: the pod still fails, only the operator's hint is lost


def report_bind_failure(port: int, exc: BaseException, what: str) -> bool:
    """Report `port` when `exc` is an address-in-use error (OSError or zmq.ZMQError); other errors are not ours."""
    if getattr(exc, "errno", None) != errno.EADDRINUSE:
        return False
    return report_ports_in_use([port], f"{what} could not bind port {port}: {exc}")


def main(argv: list[str] | None = None, execvp=os.execvp) -> int:
    args = sys.argv[1:] if argv is None else argv
    command: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, command = args[:cut], args[cut + 1:]
        if not command:
            print("usage: python -m pdpair.connector.preflight PORT... [-- COMMAND...]: nothing after --",
                  file=sys.stderr)
            return EXIT_USAGE
    try:
        ports = [int(a) for a in args]
    except ValueError:
        print(f"usage: python -m pdpair.connector.preflight PORT... [-- COMMAND...]; got {args!r}", file=sys.stderr)
        return EXIT_USAGE
    if not ports or any(not 1 <= p <= 65535 for p in ports):
        print(f"usage: python -m pdpair.connector.preflight PORT... (1..65535); got {args!r}", file=sys.stderr)
        return EXIT_USAGE
    busy = busy_ports(ports)
    if not busy:
        print(f"pdpair preflight: ports {' '.join(map(str, sorted(set(ports))))} are free on this node", flush=True)
        if command:
            try:
                execvp(command[0], command)  # becomes the container's command (returns only in tests)
            except OSError as exc:
                print(f"pdpair preflight: cannot run {command[0]!r}: {exc}", file=sys.stderr)
                return EXIT_NO_COMMAND
        return 0
    detail = "; ".join(f"{port}: {why}" for port, why in sorted(busy.items()))
    message = ports_in_use_message(busy, f"another process on this node holds them ({detail})")
    sys.stderr.write(message)
    report_ports_in_use(busy, f"another process on this node holds them ({detail})")
    return EXIT_PORTS_IN_USE


if __name__ == "__main__":
    sys.exit(main())

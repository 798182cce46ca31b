"""`python -m pdpair.operator`: validate the environment, then run the kopf operator.

Watches all namespaces unless PDPAIR_WATCH_NAMESPACES names some. Liveness on :PDPAIR_LIVENESS_PORT/healthz,
operator metrics on :PDPAIR_OPERATOR_METRICS_PORT (served by metrics.py when present).

With PDPAIR_LEADER_ELECT=true (the chart's replicas), the process first campaigns for the leader Lease
(election.py). A standby runs no kopf at all, so it cannot reconcile or write pods, port leases or status; it only
serves /healthz (so it stays live and Ready) and an empty /metrics, and reads the Lease every retry period. Once it
leads, kopf starts; if a renewal misses the renew deadline the process exits at once (fencing); on SIGTERM kopf
stops its handlers and the Lease is released so the standby takes over within one retry period.
"""

from __future__ import annotations

import argparse
import http.server
import logging
import os
import signal
import socket
import sys
import threading
import uuid

from pdpair.operator.model.config import ENV_POD_NAME, ConfigError, OperatorConfig

log = logging.getLogger("pdpair.operator")


class _StandbyHandler(http.server.BaseHTTPRequestHandler):
    """/healthz: live (so the pod is Ready and counts for the PodDisruptionBudget). /metrics: a valid exposition with
    no series, so a ServiceMonitor scraping both replicas sees the standby up instead of a refused target."""

    PAGES = {
        "/healthz": ("application/json", b'{"leader": false}\n'),
        "/metrics": ("text/plain; version=0.0.4; charset=utf-8",
                     b"# standby replica: the leader exports the operator metrics\n"),
    }

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        content_type, body = self.PAGES.get(self.path.split("?")[0], ("text/plain", b"not found\n"))
        self.send_response(200 if self.path.split("?")[0] in self.PAGES else 404)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:  # probes every few seconds: not worth a log line each
        pass


def _serve_standby(port: int) -> http.server.ThreadingHTTPServer:
    http.server.ThreadingHTTPServer.allow_reuse_address = True
    server = http.server.ThreadingHTTPServer(("0.0.0.0", port), _StandbyHandler)
    threading.Thread(target=server.serve_forever, name=f"pdpair-standby-{port}", daemon=True).start()
    return server


def candidate_identity(env: dict[str, str] | None = None) -> str:
    """Pod name (or host name) plus a per-process suffix: a restarted container is a new candidate that waits for
    the old incarnation's Lease to expire rather than resuming it."""
    env = os.environ if env is None else env
    base = env.get(ENV_POD_NAME, "").strip() or socket.gethostname()
    return f"{base}_{uuid.uuid4().hex[:8]}"


def _elector(config: OperatorConfig):
    """This process's candidate for the leader Lease (not campaigning yet)."""
    import kubernetes

    from pdpair.operator.act.election import ElectionSettings, LeaderElector

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    settings = ElectionSettings(
        lease_name=config.leader_lease_name, namespace=config.namespace, identity=candidate_identity(),
        lease_duration=config.leader_lease_duration, renew_deadline=config.leader_renew_deadline,
        retry_period=config.leader_retry_period,
    )
    return LeaderElector(kubernetes.client.CoordinationV1Api(kubernetes.client.ApiClient()), settings)


def _elect(config: OperatorConfig, elector) -> None:
    """Blocks until this process leads; then the elector renews, fenced."""
    from pdpair.operator.act.election import exit_now

    servers = [_serve_standby(port) for port in (config.liveness_port, config.metrics_port) if port]
    try:
        elector.wait_for_leadership()
    finally:
        for server in servers:  # kopf's /healthz and the operator's /metrics take these ports from now on
            server.shutdown()
            server.server_close()
    elector.keep_leading(exit_now)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdpair.operator", description=__doc__)
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = OperatorConfig.from_env()
    except ConfigError as exc:
        print(f"pdpair operator: bad configuration: {exc}", file=sys.stderr)
        return 2

    from pdpair.operator.glue.memory import tune_gc, tune_malloc

    tune_malloc()  # before kopf and the API threads allocate (memory.py)
    tune_gc()

    import kopf

    from pdpair.operator.glue import handlers  # noqa: F401  (registers the handlers)
    from pdpair.operator.glue import kopf_internals

    kopf_internals.install()  # kopf's watch events without managedFields, before any watch starts

    elector = None
    if config.leader_elect:
        # A SIGTERM while campaigning, or after winning and before kopf takes the signal over, ends through the
        # finally below, which releases the Lease if this process holds it (seen on a starved box: a standby that
        # won just as the replicas were stopped kept the Lease until it expired).
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        elector = _elector(config)
    try:
        if elector is not None:
            _elect(config, elector)
        kopf.run(
            standalone=True,  # no kopf peering: exclusivity comes from the leader Lease (or from running one replica)
            clusterwide=not config.watch_namespaces,
            namespaces=config.watch_namespaces,
            liveness_endpoint=f"http://0.0.0.0:{config.liveness_port}/healthz",
            memo=kopf.Memo(config=config),
        )
    finally:
        if elector is not None:
            elector.release()  # kopf has stopped every handler: nothing of ours still acts
    return 0


if __name__ == "__main__":
    sys.exit(main())

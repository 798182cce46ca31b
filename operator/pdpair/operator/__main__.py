"""`python -m pdpair.operator`: validate the environment, then run the kopf operator.

Watches all namespaces unless PDPAIR_WATCH_NAMESPACES names some. Liveness on :PDPAIR_LIVENESS_PORT/healthz,
operator metrics on :PDPAIR_OPERATOR_METRICS_PORT (served by metrics.py when present).
"""

from __future__ import annotations

import argparse
import logging
import sys

from .config import ConfigError, OperatorConfig


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

    import kopf

    from . import handlers  # noqa: F401  (registers the handlers)

    kopf.run(
        standalone=True,  # one operator replica; no kopf peering objects
        clusterwide=not config.watch_namespaces,
        namespaces=config.watch_namespaces,
        liveness_endpoint=f"http://0.0.0.0:{config.liveness_port}/healthz",
        memo=kopf.Memo(config=config),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

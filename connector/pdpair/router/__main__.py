"""`python -m pdpair.router --port P --prefill URL --decode URL` (also installed as `pdpair-router`)."""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

from pdpair.router.app import RouterConfig, make_app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdpair-router", description=__doc__)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True, help="prefill engine base URL, e.g. http://10.0.0.5:8000")
    parser.add_argument("--decode", required=True, help="decode engine base URL")
    parser.add_argument("--prefill-timeout", type=float, default=120.0, help="seconds for the prefill answer")
    parser.add_argument("--decode-timeout", type=float, default=600.0, help="seconds for the whole decode answer")
    parser.add_argument("--connect-timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = make_app(RouterConfig(args.prefill, args.decode, args.prefill_timeout, args.decode_timeout, args.connect_timeout))
    except ValueError as exc:
        parser.error(str(exc))
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()

"""A round-robin HTTP proxy over whole engines, for the benchmarks' data-parallel baseline (not a product part).

    python tests/bench/rr_proxy.py --port P --backend http://127.0.0.1:A --backend http://127.0.0.1:B

bench_pd_latency.py runs two one-core single engines behind it ("dp"): the same two cores a P/D pair gets, used as
data parallelism, so its table says when P/D pays on this model and when it does not. One hop through aiohttp, as
the P/D setups have through pdpair.router, so neither side is spared a proxy. Each request goes whole to the next
backend in turn; streamed bodies are passed through chunk by chunk.
"""

from __future__ import annotations

import argparse
import itertools

import aiohttp
from aiohttp import web

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


def build_app(backends: list[str]) -> web.Application:
    turn = itertools.cycle(backends)
    app = web.Application()

    async def session(app: web.Application):
        app["client"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900))
        yield
        await app["client"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        backend = next(turn)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        body = await request.read()
        async with app["client"].request(request.method, backend + request.rel_url.path_qs, data=body,
                                         headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", action="append", required=True, help="an engine's base URL (repeat: 2 or more)")
    args = parser.parse_args()
    if len(args.backend) < 2:
        parser.error("--backend: give at least two engines (one is the single setup, no proxy needed)")
    web.run_app(build_app(args.backend), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()

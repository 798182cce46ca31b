"""Shared by the router tests (tests/unit/router/): real aiohttp servers standing in for the vLLM engines (their HTTP
side only), and the router served on a free port."""

from __future__ import annotations

import asyncio

from aiohttp import web

PARAMS = {"do_remote_prefill": True, "remote_request_id": "cmpl-prefill-1", "remote_generation": 0}


class Engine:
    """A tiny HTTP engine that records what it received and answers as told."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.received: list[tuple[str, dict, dict]] = []
        self.status = 200
        self.delay = 0.0
        self.params: dict | None = PARAMS
        self.peers: list[int] = []  # the client port of each request's connection
        self.drop_first = 0  # drop the connection of this many first requests without an answer
        self.stream_chunks = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n', b"data: [DONE]\n\n"]
        self.kv_usage: float | None = None  # served on /metrics as vLLM's vllm:kv_cache_usage_perc when set
        self.metrics_scrapes = 0
        self.ready = True  # its readiness (/readyz and /health): 200 when True, else 503
        self.ready_delay = 0.0  # seconds before the readiness answer (one that never comes in time)
        self.release = asyncio.Event()  # set: delayed answers (delay, ready_delay) come now (the test is done)
        self.ready_asked = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append((request.path, body, request.headers.copy()))
        self.peers.append(request.transport.get_extra_info("peername")[1])
        if self.drop_first:
            self.drop_first -= 1
            request.transport.abort()
            return web.Response()
        if self.delay:
            try:
                await asyncio.wait_for(self.release.wait(), self.delay)
            except asyncio.TimeoutError:
                pass
        if self.status != 200:
            return web.json_response({"error": f"{self.name} failed"}, status=self.status)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for chunk in self.stream_chunks:
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        answer = {"id": f"{self.name}-answer", "choices": [{"text": self.name}]}
        if self.params is not None:
            answer["kv_transfer_params"] = self.params
        return web.json_response(answer)

    async def readiness(self, request: web.Request) -> web.Response:
        self.ready_asked += 1
        if self.ready_delay:
            try:
                await asyncio.wait_for(self.release.wait(), self.ready_delay)
            except asyncio.TimeoutError:
                pass
        return web.Response(status=200 if self.ready else 503, text=f"{self.name} ready={self.ready}")

    async def metrics(self, request: web.Request) -> web.Response:
        self.metrics_scrapes += 1
        if self.kv_usage is None:
            return web.Response(status=404)
        return web.Response(text=(
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {self.kv_usage}\n'
        ))


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def engine_app(engine: Engine) -> web.Application:
    """The stand-in engine's routes: completions, chat, /metrics, /readyz and /health."""
    app = web.Application()
    app.router.add_post("/v1/completions", engine.handle)
    app.router.add_post("/v1/chat/completions", engine.handle)
    app.router.add_get("/metrics", engine.metrics)
    app.router.add_get("/readyz", engine.readiness)
    app.router.add_get("/health", engine.readiness)
    return app


async def engine_server(engine: Engine) -> tuple[web.AppRunner, str]:
    return await serve(engine_app(engine))


async def start_engines(n_prefill: int, n_decode: int, runners: list) -> tuple[list[Engine], list[Engine], dict]:
    """n_prefill and n_decode stand-ins, each served on a free port (its runner appended to `runners` for cleanup):
    (prefills, decodes, {name: base URL})."""
    prefills = [Engine(f"prefill-{i}") for i in range(n_prefill)]
    decodes = [Engine(f"decode-{i}") for i in range(n_decode)]
    urls = {}
    for engine in prefills + decodes:
        runner, urls[engine.name] = await engine_server(engine)
        runners.append(runner)
    return prefills, decodes, urls

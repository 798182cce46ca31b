"""tests/bench/bench_xpyd.py's helpers: the router's --log-choices lines read back per instance (against the real
router app and the fake engines of tests/router_support.py), the spread, the prompt counts, the checks and the
markdown table. No engine; about 1 s."""

from __future__ import annotations

import asyncio
import logging
import pathlib
import sys

import aiohttp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import bench_xpyd as bx  # noqa: E402

from pdpair.router.app import ROUTE_HEADER, make_app  # noqa: E402
from pdpair.router.config import RouterConfig  # noqa: E402
from tests.router_support import serve, start_engines  # noqa: E402

TOKEN = "t" * 32


def test_prompts_spread_and_topologies():
    assert [bx.prompts_for(c, 64) for c in (1, 4, 8, 16, 64)] == [16, 16, 32, 64, 64]
    assert bx.prompts_for(1, 10) == 10 and bx.prompts_for(16, 10) == 10
    assert bx.deviation_pct([32, 32]) == 0 and bx.deviation_pct([40, 24]) == 25.0
    assert bx.deviation_pct([65]) is None and bx.deviation_pct([0, 0]) is None
    assert bx.spread_cell([33, 32]) == "33 / 32 (1.5 %)"
    assert bx.spread_cell([65]) == "65" and bx.spread_cell([]) == "–"
    assert bx.parse_topologies("2p2d, 1P1D") == ["2P2D", "1P1D"]
    for bad in ("3P1D", ",", ""):
        with pytest.raises(ValueError):
            bx.parse_topologies(bad)


def _row(rps: float, failed: int = 0, per_instance: dict | None = None, **extra) -> dict:
    row = {"requests_per_s": rps, "output_tokens_per_s": 32 * rps, "ttft_ms_p50": 10.0, "ttft_ms_p99": 20.0,
           "tpot_ms_p50": 5.0, "tpot_ms_p99": 6.0, "failed": failed, "load_average_before": 1.5, **extra}
    if per_instance is not None:
        row["per_instance"] = per_instance
    return row


def test_checks_and_table():
    report = {
        "concurrency": {
            "c1": {"single": _row(5.0), "2P2D": _row(4.0, per_instance={"prefill": [9, 8], "decode": [17, 0]},
                                                 throughput_ratio_to_single=0.8)},
            "c16": {"single": _row(30.0), "1P2D": _row(20.0, per_instance={"prefill": [65], "decode": [33, 32]}),
                    "2P2D": _row(22.0, failed=2, per_instance={"prefill": [45, 20], "decode": [33, 32]},
                                 outstanding_after={"decode 1": 1})},
        },
        "greedy": {"1P2D": {"equal": 8, "checked": 8, "mismatches": []},
                   "2P2D": {"equal": 15, "checked": 16, "mismatches": ["prompt 3 via prefill 1, decode 0: differs"]}},
    }
    checks = bx.evaluate(report, 20.0)
    # c1's uneven decodes are not judged (the limit is at 16 clients); c16's prefill 45/20 is (38.5 %)
    assert not checks["passed"] and checks["spread_checked"]
    assert len(checks["failures"]) == 4, checks["failures"]
    assert any("prefill requests [45, 20], 38.5 %" in f for f in checks["failures"])
    assert any("2 failed requests" in f for f in checks["failures"])
    assert any("outstanding" in f for f in checks["failures"])
    assert any("2P2D: greedy 15/16" in f for f in checks["failures"])
    report["checks"] = checks
    table = bx.markdown(report)
    assert "| 16 | 1P2D | 20.00 | 640 | 10 / 20 | 5.0 / 6.0 | 0 | – | 65 | 33 / 32 (1.5 %) | 1.5 |" in table
    assert "| 1 | 2P2D | 4.00 | 128 | 10 / 20 | 5.0 / 6.0 | 0 | 0.80 | 9 / 8 (5.9 %) | 17 / 0 (100 %) | 1.5 |" in table
    assert "1P2D 8/8, 2P2D 15/16" in table and "Checks: FAILED" in table

    clean = {"concurrency": {"c1": {"single": _row(5.0), "2P1D": _row(4.0, per_instance={"prefill": [9, 8],
                                                                                         "decode": [17]})}}}
    checks = bx.evaluate(clean, 20.0)
    assert checks["passed"] and not checks["spread_checked"]  # no level of 16 clients: said so in the table
    clean["checks"] = checks
    assert "not checked" in bx.markdown(clean)


@pytest.mark.asyncio
async def test_choices_and_outstanding_read_back_from_the_real_router(caplog, monkeypatch):
    """What the benchmark reads: the router's --log-choices lines per instance, forced ones apart, equal to what each
    (fake) engine received; GET /pdpair/v1/peers with the token shows nothing outstanding afterwards."""
    runners: list = []
    prefills, decodes, urls = await start_engines(2, 2, runners)
    monkeypatch.setenv("PDPAIR_PEERS_TOKEN", TOKEN)
    config = RouterConfig(tuple(urls[e.name] for e in prefills), tuple(urls[e.name] for e in decodes),
                          peers_token=TOKEN, log_choices=True, debug_routing=True)
    runner, router = await serve(make_app(config))
    runners.append(runner)
    caplog.set_level(logging.INFO, logger="pdpair.router")
    try:
        async with aiohttp.ClientSession() as client:
            async def one(headers=None):
                async with client.post(router + "/v1/completions", json={"prompt": "x", "max_tokens": 4},
                                       headers=headers) as resp:
                    await resp.read()
                    assert resp.status == 200

            await asyncio.gather(*(one() for _ in range(16)))
            await one({ROUTE_HEADER: "1,0"})
        choices = bx.parse_choices(caplog.text)
        assert len(choices) == 17 and choices.count((1, 0, True)) == 1
        counts = bx.per_instance(choices, 2, 2)
        assert counts == {"prefill": [len(prefills[0].received), len(prefills[1].received) - 1],
                          "decode": [len(decodes[0].received) - 1, len(decodes[1].received)]}
        assert sum(counts["decode"]) == 16
        state = await asyncio.to_thread(bx.peers_state, router, TOKEN)
        assert [m["index"] for m in state["decodes"]] == [0, 1]
        assert bx.outstanding_left(state) == {}
        assert bx.outstanding_left({"prefills": [{"index": 1, "outstanding": 2}], "decodes": [],
                                    "leaving": [{"role": "decode", "url": "u", "outstanding": 1}]}) == {
            "prefill 1": 2, "leaving decode u": 1}
    finally:
        for r in reversed(runners):
            await r.cleanup()

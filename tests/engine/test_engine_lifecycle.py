"""Decode engines created, used and deleted in a row in ONE process (three at TP = 1, two at TP = 2), on the same
side-channel and metrics ports (the seed's EADDRINUSE case). vLLM's LLM class runs in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so the connector's threads and sockets live in that process and must be gone
before the next engine binds the same ports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pdpair import contract

from engines import ENGINE_ENV, free_port
from tests.side_channel_support import TEST_SIDE_CHANNEL_KEY

HERE = Path(__file__).parent


def _decode_env(listen_port: int, metrics_port: int) -> dict[str, str]:
    """A decode engine's environment for three_engines.py: ours, not the caller's PDPAIR_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDPAIR_")}
    env.update(ENGINE_ENV)
    env.update({
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        contract.ENV_ROLE: contract.ROLE_DECODE,
        contract.ENV_GENERATION: "1",
        contract.ENV_LISTEN_PORT_BASE: str(listen_port),
        contract.ENV_METRICS_PORT: str(metrics_port),
        contract.ENV_HANG_TIMEOUT_SECONDS: "5",
        contract.ENV_TRANSPORT: contract.TRANSPORT_TCP,
        contract.ENV_SIDE_CHANNEL_KEY: TEST_SIDE_CHANNEL_KEY,
    })
    return env


def test_three_engines_in_a_row_reuse_the_same_ports(tiny_model, tmp_path):
    listen_port, metrics_port = free_port(), free_port()
    env = _decode_env(listen_port, metrics_port)
    result = subprocess.run(
        [sys.executable, str(HERE / "three_engines.py"), str(tiny_model), str(listen_port), str(metrics_port), "3"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    rounds = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    detail = f"rc={result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"
    assert len(rounds) == 3, detail
    for r in rounds:
        assert r["during"]["sidechannel"] == ["listening"] and r["during"]["metrics"] == "listening", detail
        assert "pdpair-sidechannel-decode-r0" in r["during"]["threads"], detail
        assert r["after"] == {"sidechannel": ["free"], "metrics": "free", "threads": [], "rank_sockets": [],
                              "workers": 0}, detail
    assert rounds[0]["tokens"] == rounds[1]["tokens"] == rounds[2]["tokens"], detail
    assert "Address already in use" not in result.stderr and "EADDRINUSE" not in result.stderr
    assert result.returncode == 0, detail


def test_two_tp2_engines_in_a_row_reuse_the_same_ports(tiny_model):
    """The seed's first failure at tensor parallel 2: vLLM spawns one worker process per rank, rank r listens on
    base + r, rank 0 serves the metrics port and rank 1 its local rank socket. All of it must be gone (ports free,
    rank socket closed, worker processes exited, no pdpair thread here) before the next engine binds the same ports.
    Two rounds: the second binds every port the first held (the TP = 1 test above goes three rounds). Cost: about
    75 s on the 2-core box, two TP = 2 engine starts (each three rounds took about 115 s)."""
    listen_port, metrics_port = free_port(2), free_port()
    env = _decode_env(listen_port, metrics_port)
    result = subprocess.run(
        [sys.executable, str(HERE / "three_engines.py"), str(tiny_model), str(listen_port), str(metrics_port),
         "2", "2"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    rounds = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    detail = f"rc={result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"
    assert len(rounds) == 2, detail
    for r in rounds:
        assert r["during"]["sidechannel"] == ["listening", "listening"], detail
        assert r["during"]["metrics"] == "listening", detail
        assert r["during"]["rank_sockets"] == [f"@pdpair-metrics-{metrics_port}-rank-1"], detail
        assert r["during"]["workers"] >= 2, detail  # one process per rank
        assert r["after"] == {"sidechannel": ["free", "free"], "metrics": "free", "threads": [], "rank_sockets": [],
                              "workers": 0}, detail
    assert rounds[0]["tokens"] == rounds[1]["tokens"], detail
    for rank in (0, 1):  # each rank's worker closed its listener itself on every round (a clean shutdown, not a kill)
        closed = f"pdpair-sidechannel-decode-r{rank}: listener on port {listen_port + rank} closed"
        assert result.stderr.count(closed) == 2, detail
    assert "Address already in use" not in result.stderr and "EADDRINUSE" not in result.stderr
    assert result.returncode == 0, detail

"""Create, use and delete N decode engines in a row in ONE process, on the same side-channel and metrics ports.

Run by test_engine_lifecycle.py in a subprocess (vLLM's in-process engine, VLLM_ENABLE_V1_MULTIPROCESSING=0, so the
connector's worker and scheduler sides live in this very process). Prints one JSON line per engine and exits 0 only
if every engine listened on the same ports while alive and freed them (and its threads) after shutdown.
"""

from __future__ import annotations

import gc
import json
import socket
import sys
import threading
import time


def port_state(port: int) -> str:
    """'listening' if something accepts TCP on it, 'free' if we can bind it, else 'busy'."""
    with socket.socket() as probe:
        probe.settimeout(1)
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            return "listening"
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
            return "free"
        except OSError as exc:
            return f"busy: {exc}"


def pdpair_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("pdpair"))


def main(model: str, listen_port: int, metrics_port: int, rounds: int) -> int:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ok = True
    for round_no in range(1, rounds + 1):
        started = time.monotonic()
        llm = LLM(
            model=model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=512,
            kv_cache_memory_bytes=32 * 2**20, served_model_name="tiny",
            kv_transfer_config=KVTransferConfig(
                kv_connector="PdPairConnector", kv_connector_module_path="pdpair.connector", kv_role="kv_consumer"
            ),
        )
        during = {"sidechannel": port_state(listen_port), "metrics": port_state(metrics_port), "threads": pdpair_threads()}
        out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=4, temperature=0))
        tokens = list(out[0].outputs[0].token_ids)
        llm.llm_engine.engine_core.shutdown()
        del llm, out
        gc.collect()
        after = {"sidechannel": port_state(listen_port), "metrics": port_state(metrics_port), "threads": pdpair_threads()}
        good = (
            during["sidechannel"] == "listening" and during["metrics"] == "listening" and len(tokens) == 4
            and after["sidechannel"] == "free" and after["metrics"] == "free" and not after["threads"]
        )
        ok &= good
        print(json.dumps({"round": round_no, "during": during, "tokens": tokens, "after": after, "ok": good,
                          "seconds": round(time.monotonic() - started, 1)}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 3))

"""Create, use and delete N decode engines in a row in ONE process, on the same side-channel and metrics ports.

Run by test_engine_lifecycle.py in a subprocess (vLLM's in-process engine, VLLM_ENABLE_V1_MULTIPROCESSING=0, so the
connector's scheduler side, and at TP = 1 its worker side, live in this very process; at TP > 1 vLLM spawns one
worker process per rank). Prints one JSON line per engine and exits 0 only if every engine listened on the same ports
(one per rank) while alive and freed them, its threads, its worker processes and its rank sockets after shutdown.
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


def child_processes() -> list[int]:
    """Live children of this process, except multiprocessing's resource tracker (one per process, by design)."""
    import psutil

    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(child.cmdline()):
                alive.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return sorted(alive)


def rank_sockets(metrics_port: int) -> list[str]:
    """Abstract Unix sockets the ranks > 0 export their metrics on (pdpair.connector.rank_channel.rank_socket_name)."""
    prefix = f"@pdpair-metrics-{metrics_port}-rank-"
    with open("/proc/net/unix") as table:
        return sorted({line.split()[-1] for line in table if line.split()[-1].startswith(prefix)})


def wait_until(check, timeout: float = 30.0):
    """Worker processes exit asynchronously after shutdown returns; poll (bounded) until `check()` is falsy."""
    deadline = time.monotonic() + timeout
    while (value := check()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def main(model: str, listen_port: int, metrics_port: int, rounds: int, tp: int = 1) -> int:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ok = True
    for round_no in range(1, rounds + 1):
        started = time.monotonic()
        llm = LLM(
            model=model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=512,
            kv_cache_memory_bytes=32 * 2**20, served_model_name="tiny", tensor_parallel_size=tp,
            kv_transfer_config=KVTransferConfig(
                kv_connector="PdPairConnector", kv_connector_module_path="pdpair.connector", kv_role="kv_consumer"
            ),
        )
        during = {"sidechannel": [port_state(listen_port + r) for r in range(tp)], "metrics": port_state(metrics_port),
                  "threads": pdpair_threads(), "rank_sockets": rank_sockets(metrics_port),
                  "workers": len(child_processes())}
        out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=4, temperature=0))
        tokens = list(out[0].outputs[0].token_ids)
        llm.llm_engine.engine_core.shutdown()
        del llm, out
        gc.collect()
        leftover_workers = wait_until(child_processes)
        after = {"sidechannel": [port_state(listen_port + r) for r in range(tp)], "metrics": port_state(metrics_port),
                 "threads": pdpair_threads(), "rank_sockets": rank_sockets(metrics_port),
                 "workers": len(leftover_workers)}
        good = (
            during["sidechannel"] == ["listening"] * tp and during["metrics"] == "listening" and len(tokens) == 4
            and len(during["rank_sockets"]) == tp - 1
            and after["sidechannel"] == ["free"] * tp and after["metrics"] == "free" and not after["threads"]
            and not after["rank_sockets"] and not after["workers"]
        )
        ok &= good
        print(json.dumps({"round": round_no, "during": during, "tokens": tokens, "after": after, "ok": good,
                          "seconds": round(time.monotonic() - started, 1)}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 3,
                  int(sys.argv[5]) if len(sys.argv) > 5 else 1))

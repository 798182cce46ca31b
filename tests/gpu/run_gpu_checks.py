"""GPU checks of the flagcx binding and of tcp staging, run BY HAND on a machine with 2 NVIDIA GPUs (not in CI, and
not a pytest module: pytest collects test_*.py only). Prints one PASS/FAIL line per check and exits non-zero if any
check failed.

    FLAGCX_SRC=/path/FlagCX-old:/path/FlagCX-new  PYTHONPATH=src  python3 tests/gpu/run_gpu_checks.py

FLAGCX_SRC: one or more upstream FlagCX source trees (':'-separated; never committed here). Each is built with
`make USE_NVIDIA=1` against the NCCL of the `nvidia-nccl-cu13`/`-cu12` wheel (a libnccl.so link is made in a temp
dir) and needs nlohmann's json.hpp under third-party/json/single_include. Checks:
  build        the tree builds and gives build/lib/libflagcx.so
  load         flagcxGetVersion and the API generation probe
  gpu1-pair    two processes, ranks on GPUs 0 and 1, init_pair succeeds (the helper-thread device bug), then a GPU
               region registration answers flagcxNotSupported with a clear message (no RDMA HCA here)
  no-device    control: the same pair without the device binding fails (NCCL "Duplicate GPU")
  tp2          one process with two rank threads on GPUs 0 and 1, each paired with a rank in another process
  leak         threads and fds of a process after 1 and after 20 init/close cycles (recorded, not judged)
  tcp-staging  CUDA tensors over the tcp transport through pinned host staging, two processes (GPU 0 -> GPU 1):
               bytes equal; throughput as a ratio to a plain pinned copy + TCP stream of the same bytes in the run
  rdma-flush   cuFlushGPUDirectRDMAWrites, which the binding calls after a wait on a GPU comm, runs on this GPU
  layerwise-staging  layer-wise puts from CUDA KV caches (one GPU is enough): the connector's own prefill and decode
               workers over tcp with staging; a keyed Pull waits, then each of 8 layers is written on the current
               stream AFTER a 20 ms GPU sleep and announced at once (`layer_written`, as vLLM's save_kv_layer is
               called before the kernels ran): decode must receive the written values, never the stale ones, which
               shows the per-layer copy is ordered after the model's write; `layerwise-staging control` (run last)
               takes that ordering out and must see stale bytes (the check can fail)
Each rank's transport is built the way the connector's worker builds it (worker_transport: PdPairConfig from a
pod's variables, FLAGCX_PATH or FLAGCX_LIB_PATH resolved from the config by build_transport, set_device), so the checks
cover that path and not only FlagcxTransport.
Options: --out DIR writes results.json there; --skip-build uses existing build/lib/libflagcx.so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

SCRIPT = Path(__file__).resolve()
# The pinned FlagCX commits (abbreviated) and the API generation each must load as (docs/gpu.md, "The two API
# generations"); a tree whose directory name holds one is judged against it. images/engine-cuda/Dockerfile builds one
# of them (its FLAGCX_COMMIT / FLAGCX_GENERATION); tests/unit/test_engine_cuda_image.py keeps the two in step.
FLAGCX_PINNED_COMMITS = {"6493e5f8": "mr-index", "0c721293": "window"}
RESULTS: list[dict] = []
# --cpu-dry-run (on a machine without GPUs, against tests/flagcx_abi's fake): the same orchestration, CPU tensors.
DRY_RUN = os.environ.get("PDPAIR_GPU_CHECKS_DRY_RUN") == "1"


def sync() -> None:
    if not DRY_RUN:
        import torch

        torch.cuda.synchronize()


def report(check: str, ok: bool, detail: str) -> None:
    RESULTS.append({"check": check, "ok": ok, "detail": detail})
    print(f"{'PASS' if ok else 'FAIL'} {check}: {detail}", flush=True)


def note(check: str, detail: str) -> None:
    RESULTS.append({"check": check, "ok": None, "detail": detail})
    print(f"INFO {check}: {detail}", flush=True)


# --- child processes: one JSON line per message over stdin/stdout ------------------------------------------------


class Child:
    def __init__(self, role: str, args: dict, env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--child", role, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        # A reader thread, not select(): a buffered readline may already hold the next line.
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 180) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError("child did not answer in time") from None
        if not line:
            raise RuntimeError(f"child exited ({self.proc.wait(10)})")
        return json.loads(line)

    def finish(self) -> None:
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def child_send(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def child_recv() -> dict:
    return json.loads(sys.stdin.readline())


def proc_counts() -> dict:
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd"))}


# --- flagcx ranks -------------------------------------------------------------------------------------------------


def pod_environment(lib: str, rank: int) -> dict[str, str]:
    """What the operator would give a pod of this rank (0 prefill, 1 decode) using this library: a FlagCX tree as
    FLAGCX_PATH when lib is its build/lib/libflagcx.so, else FLAGCX_LIB_PATH."""
    from pdpair import contract

    env = {contract.ENV_TRANSPORT: contract.TRANSPORT_FLAGCX, contract.ENV_HANG_TIMEOUT_SECONDS: "60",
           # the pair's side-channel key, required on both roles (these checks start no side channel)
           contract.ENV_SIDE_CHANNEL_KEY: "gpu-checks-side-channel-key-0123456789abcdef"}
    if rank == 0:
        env.update({contract.ENV_PEER_HOST: "127.0.0.1", contract.ENV_PEER_PORT_BASE: "20000"})
    else:
        env[contract.ENV_LISTEN_PORT_BASE] = "20000"
    path = Path(lib)
    if path.parts[-3:] == ("build", "lib", "libflagcx.so"):
        env["FLAGCX_PATH"] = str(path.parents[2])
    else:
        env["FLAGCX_LIB_PATH"] = str(path)
    return env


def worker_transport(lib: str, rank: int, device: int | None):
    """The transport as the connector's worker builds it (worker._Worker.__init__ and _prepare): PdPairConfig from the
    pod's variables, then build_transport: its transport environment (FLAGCX_USE_HETERO_COMM=1) set before libflagcx
    loads, the library resolved from the config (not from this process's environment), slots and the blocking bound
    from the config; then the KV caches' device handed over with set_device."""
    from pdpair.connector.config import PdPairConfig
    from pdpair.connector.transports import build_transport

    config = PdPairConfig.from_env("kv_producer" if rank == 0 else "kv_consumer", environ=pod_environment(lib, rank))
    transport = build_transport(config)
    if os.path.realpath(transport.lib.path) != os.path.realpath(lib):
        raise RuntimeError(f"the config resolved {transport.lib.path}, expected {lib}")
    if device is not None:
        transport.set_device(device)
    return transport


def child_flagcx(args: dict) -> None:
    """Rank threads of flagcx pairs. args: lib, ranks [{pair, rank, device}], register, cycles, bind_device."""
    import torch

    from pdpair.connector.transports.base import deadline_in

    if not DRY_RUN:
        torch.cuda.init()
    ranks = args["ranks"]
    counts = [proc_counts()]
    for _cycle in range(args.get("cycles", 1)):
        bind = args.get("bind_device", True) and not DRY_RUN
        transports = [worker_transport(args["lib"], r["rank"], r["device"] if bind else None) for r in ranks]
        uids = {}
        for r, t in zip(ranks, transports):
            if r["rank"] == 0:
                uids[str(r["pair"])] = t.create_unique_id().hex()
        child_send({"uids": uids})
        all_uids = child_recv()["uids"]
        results: list[dict] = [{} for _ in ranks]

        def run(i: int) -> None:
            r, t = ranks[i], transports[i]
            out = results[i]
            out.update(pair=r["pair"], rank=r["rank"], device=r["device"])
            started = time.monotonic()
            try:
                comm = t.init_pair(bytes.fromhex(all_uids[str(r["pair"])]), r["rank"], deadline_in(args.get("init_seconds", 90)))
            except Exception as exc:  # noqa: BLE001 - reported
                out.update(init="error", error=f"{type(exc).__name__}: {exc}", init_s=time.monotonic() - started)
                return
            out.update(init="ok", init_s=round(time.monotonic() - started, 3), generation=comm.generation)
            if args.get("register"):
                buf = torch.empty(64 << 20, dtype=torch.uint8, device="cpu" if DRY_RUN else f"cuda:{r['device']}")
                try:
                    comm.register_region(buf.data_ptr(), buf.numel())
                    out.update(register="ok")
                except Exception as exc:  # noqa: BLE001 - reported
                    out.update(register="error", register_error=f"{type(exc).__name__}: {exc}")
                if out.get("register") == "ok" and args.get("try_put"):
                    # Both ranks registered the same size, so our own table stands in for the peer's.
                    comm.set_peer_region_table(comm.local_region_table())
                    started = time.monotonic()
                    try:
                        if r["rank"] == 0:
                            comm.put_signal(0, 0, 0, 0, 4096, signal_slot=0)
                            comm.flush(deadline_in(10))
                        else:
                            comm.wait_signal(0, 1, deadline_in(10))
                        out.update(put="ok")
                    except Exception as exc:  # noqa: BLE001 - reported
                        out.update(put=f"{type(exc).__name__}: {exc}")
                    out.update(put_s=round(time.monotonic() - started, 2))
            comm.close()

        threads = [threading.Thread(target=run, args=(i,), name=f"rank-thread-{i}") for i in range(len(ranks))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(240)
        for t in transports:
            t.close()
        counts.append(proc_counts())
        child_send({"results": results})
    child_send({"counts": counts})


def flagcx_pairs(lib: str, a: list[dict], b: list[dict], register: bool, cycles: int = 1, bind_device: bool = True,
                 init_seconds: float | None = None, try_put: bool = False):
    """Run two child processes with the given rank threads; per cycle the rank-0 uids are swapped between them."""
    # FLAGCX_USE_HETERO_COMM comes from PdPairConfig.transport_environment, as in a pod. The fake answers like
    # upstream on a machine without an RDMA HCA (NotSupported, or a window without a registration) when told to.
    env: dict[str, str] = {"FAKE_FLAGCX_NO_RDMA": "1"} if DRY_RUN else {}
    # Without the device binding init may hang instead of failing: give the control a short deadline.
    common = {"lib": lib, "register": register, "cycles": cycles, "bind_device": bind_device,
              "init_seconds": init_seconds or (90 if bind_device else 20), "try_put": try_put}
    ca, cb = Child("flagcx", {**common, "ranks": a}, env), Child("flagcx", {**common, "ranks": b}, env)
    try:
        results = []
        for _ in range(cycles):
            ua, ub = ca.recv()["uids"], cb.recv()["uids"]
            merged = {**ua, **ub}
            ca.send({"uids": merged})
            cb.send({"uids": merged})
            results.append(ca.recv(300)["results"] + cb.recv(300)["results"])
        counts = (ca.recv()["counts"], cb.recv()["counts"])
        return results, counts
    finally:
        ca.finish()
        cb.finish()


# --- tcp staging ----------------------------------------------------------------------------------------------------

LAYERS, BLOCKS, CHUNK = (4, 32, 64 * 1024) if DRY_RUN else (16, 256, 256 * 1024)  # GPU: 1 GiB per side
TRIALS = 3


def _kv(device: str, fill: bool):
    import torch

    gen = torch.Generator(device=device).manual_seed(1234)
    shape = (BLOCKS, CHUNK // 2)
    if fill:
        return [torch.randint(-30000, 30000, shape, dtype=torch.int16, device=device, generator=gen) for _ in range(LAYERS)]
    return [torch.zeros(shape, dtype=torch.int16, device=device) for _ in range(LAYERS)]


def _digest(tensors, blocks) -> str:
    h = hashlib.sha256()
    for t in tensors:
        for b in blocks:
            h.update(t[b].cpu().numpy().tobytes())
    return h.hexdigest()


def child_tcp_send(args: dict) -> None:
    import torch

    from pdpair.connector.staging import HostStaging, block_runs
    from pdpair.connector.transports.base import deadline_in
    from pdpair.connector.transports.tcp import TcpTransport

    device = args["device"]
    if not DRY_RUN:
        torch.cuda.set_device(device)
    kv = _kv(device, True)
    staging = HostStaging(kv, [BLOCKS * CHUNK] * LAYERS)
    transport = TcpTransport()
    child_send({"uid": transport.create_unique_id().hex()})
    comm = transport.init_pair(bytes.fromhex(child_recv()["uid_ack"]), 0, deadline_in(60))
    regions = [comm.register_region(p, BLOCKS * CHUNK) for p in staging.host_ptrs]
    child_send({"table": comm.local_region_table().hex()})
    comm.set_peer_region_table(bytes.fromhex(child_recv()["table"]))
    src_blocks = list(range(BLOCKS))
    dst_blocks = [(b * 7 + 3) % BLOCKS for b in src_blocks]  # a permutation: blocks land elsewhere
    child_send({"digest": _digest(kv, src_blocks), "dst_blocks": dst_blocks})
    base_pinned = torch.empty(LAYERS * BLOCKS * CHUNK, dtype=torch.uint8, pin_memory=not DRY_RUN)
    for trial in range(TRIALS):
        # staged pdpair transfer
        child_recv()  # go
        sync()
        start = time.time()
        copies = staging.to_host([block_runs(src_blocks, CHUNK)] * LAYERS)
        for layer in range(LAYERS):
            HostStaging.wait(copies[layer])
            for s, d in zip(src_blocks, dst_blocks):
                comm.put_signal(regions[layer], s * CHUNK, regions[layer], d * CHUNK, CHUNK, signal_slot=trial)
        comm.flush(deadline_in(120))
        child_send({"start": start})
        # baseline: one pinned copy per layer + a plain TCP stream of the same bytes
        port = child_recv()["port"]
        sock = socket.create_connection(("127.0.0.1", port))
        sync()
        start = time.time()
        view = memoryview(base_pinned.numpy())
        for layer in range(LAYERS):
            part = base_pinned[layer * BLOCKS * CHUNK : (layer + 1) * BLOCKS * CHUNK]
            part.copy_(kv[layer].view(torch.uint8).reshape(-1))
            sock.sendall(view[layer * BLOCKS * CHUNK : (layer + 1) * BLOCKS * CHUNK])
        sock.close()
        child_send({"start": start})
    child_recv()
    comm.close()
    transport.close()


def child_tcp_recv(args: dict) -> None:
    import torch

    from pdpair.connector.staging import HostStaging, block_runs
    from pdpair.connector.transports.base import deadline_in
    from pdpair.connector.transports.tcp import TcpTransport

    device = args["device"]
    if not DRY_RUN:
        torch.cuda.set_device(device)
    kv = _kv(device, False)
    staging = HostStaging(kv, [BLOCKS * CHUNK] * LAYERS)
    transport = TcpTransport()
    uid = bytes.fromhex(child_recv()["uid"])
    comm_box: list = []
    joiner = threading.Thread(target=lambda: comm_box.append(transport.init_pair(uid, 1, deadline_in(60))))
    joiner.start()
    child_send({"joining": True})
    joiner.join(90)
    comm = comm_box[0]
    for p in staging.host_ptrs:
        comm.register_region(p, BLOCKS * CHUNK)
    comm.set_peer_region_table(bytes.fromhex(child_recv()["table"]))
    child_send({"table": comm.local_region_table().hex()})
    dst_blocks = child_recv()["dst_blocks"]
    base_pinned = torch.empty(LAYERS * BLOCKS * CHUNK, dtype=torch.uint8, pin_memory=not DRY_RUN)
    base_dst = torch.empty(LAYERS * BLOCKS * CHUNK, dtype=torch.uint8, device=device)
    for trial in range(TRIALS):
        child_send({"ready": trial})
        comm.wait_signal(trial, LAYERS * BLOCKS, deadline_in(120))
        staging.to_device([block_runs(dst_blocks, CHUNK)] * LAYERS)
        end = time.time()
        digest = _digest(kv, dst_blocks) if trial == 0 else None
        if trial == 0:
            for t in kv:
                t.zero_()  # the next trials must rewrite every byte
            sync()
        listener = socket.create_server(("127.0.0.1", 0))
        child_send({"end": end, "digest": digest, "port": listener.getsockname()[1]})
        conn, _ = listener.accept()
        view = memoryview(base_pinned.numpy())
        got = 0
        while got < len(view):
            n = conn.recv_into(view[got:])
            if n == 0:
                break
            got += n
        base_dst.copy_(base_pinned, non_blocking=True)
        sync()
        end = time.time()
        conn.close()
        listener.close()
        child_send({"end": end, "bytes": got})
    child_recv()
    comm.close()


def main_tcp_staging(gpus: int = 2) -> None:
    devices = ("cpu", "cpu") if DRY_RUN else ("cuda:0", "cuda:1" if gpus >= 2 else "cuda:0")
    send, recv = Child("tcp-send", {"device": devices[0]}), Child("tcp-recv", {"device": devices[1]})
    try:
        uid = send.recv()["uid"]
        recv.send({"uid": uid})
        recv.recv()  # rank 1 is joining
        send.send({"uid_ack": uid})
        recv.send({"table": send.recv()["table"]})
        send.send({"table": recv.recv()["table"]})
        hello = send.recv()
        recv.send({"dst_blocks": hello["dst_blocks"]})
        nbytes = LAYERS * BLOCKS * CHUNK
        staged, plain, digests = [], [], []
        for trial in range(TRIALS):
            recv.recv()  # ready
            send.send({"go": trial})
            started = send.recv()["start"]
            done = recv.recv(300)
            staged.append(nbytes / (done["end"] - started) / 1e9)
            if done["digest"]:
                digests.append(done["digest"])
            send.send({"port": done["port"]})
            started = send.recv()["start"]
            base = recv.recv(300)
            plain.append(nbytes / (base["end"] - started) / 1e9)
        send.send({"bye": 1})
        recv.send({"bye": 1})
        same = digests == [hello["digest"]]
        report("tcp-staging bytes", same, f"sha256 of {LAYERS}x{BLOCKS} blocks of {CHUNK} B after {devices[0]} -> host -> "
               f"tcp -> host -> {devices[1]} (two processes) {'equals' if same else 'DIFFERS from'} the sender's")
        ratio = statistics.median(staged) / statistics.median(plain)
        note("tcp-staging throughput", f"staged {statistics.median(staged):.2f} GB/s, plain pinned copy + TCP stream "
             f"{statistics.median(plain):.2f} GB/s, ratio {ratio:.2f} (median of {TRIALS}; trials staged "
             f"{[round(x, 2) for x in staged]}, plain {[round(x, 2) for x in plain]}; {nbytes >> 20} MiB each)")
    finally:
        send.finish()
        recv.finish()


# --- build -----------------------------------------------------------------------------------------------------------


# --- layer-wise puts from CUDA KV caches --------------------------------------------------------------------------
def _vllm_stand_ins() -> None:
    """The GPU machine has torch but not vLLM (nothing can be installed there but what is carried in, and vLLM's
    wheel is far over that limit). The connector's workers import three trivial vLLM base classes (the scheduler's
    metadata base, the stats container and the Prometheus exporter base) and one function; where vLLM does not
    import, these stand-ins take their place, with the same fields the workers use. Nothing else of vLLM runs in the
    check: it drives the workers as the engine's forward would (layer_written, start_load_kv, step_computed)."""
    import dataclasses
    import types

    try:
        import vllm  # noqa: F401
        return
    except ImportError:
        pass

    @dataclasses.dataclass
    class KVConnectorStats:
        data: dict = dataclasses.field(default_factory=dict)

    class KVConnectorMetadata:
        pass

    class KVConnectorPromMetrics:
        def __init__(self, *args, **kwargs) -> None:
            pass

    modules = {
        "vllm": {},
        "vllm.distributed": {},
        "vllm.distributed.kv_transfer": {},
        "vllm.distributed.kv_transfer.kv_connector": {},
        "vllm.distributed.kv_transfer.kv_connector.v1": {},
        "vllm.distributed.kv_transfer.kv_connector.v1.base": {"KVConnectorMetadata": KVConnectorMetadata},
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics": {"KVConnectorStats": KVConnectorStats,
                                                                  "KVConnectorPromMetrics": KVConnectorPromMetrics},
        "vllm.v1": {},
        "vllm.v1.metrics": {},
        "vllm.v1.metrics.utils": {"create_metric_per_engine": lambda *a, **k: None},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
    note("layerwise-staging", "vLLM is not installed here: its three base classes are stood in for (_vllm_stand_ins)")


def main_layerwise_staging(gpus: int = 1, control: bool = False) -> None:
    """`control`: the same with the staging stream's wait on the model's stream taken out (the copy may then run
    before the write): decode must see stale bytes, which shows the check can fail (GPU only)."""
    import torch

    _vllm_stand_ins()
    check = "layerwise-staging control" if control else "layerwise-staging"
    if control:
        torch.cuda.Stream.wait_stream = lambda self, other: None  # this process only, and it ends after the check

    from pdpair import contract
    from pdpair.connector.config import PdPairConfig
    from pdpair.connector.decode_worker import DecodeWorker
    from pdpair.connector.prefill_worker import PrefillWorker
    from pdpair.connector.scheduler import PdPairConnectorMetadata, RecvRequest, StreamRequest

    prefill_device = "cpu" if DRY_RUN else "cuda:0"
    decode_device = "cpu" if DRY_RUN else f"cuda:{1 if gpus > 1 else 0}"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    def config(role: str) -> PdPairConfig:
        prefill = role == contract.ROLE_PREFILL
        return PdPairConfig(role=role, generation=1, pair="gpu-check", namespace="default",
                            transport=contract.TRANSPORT_TCP, hang_timeout_seconds=30.0, metrics_port=None,
                            listen_host="127.0.0.1", listen_port_base=None if prefill else port,
                            peer_host="127.0.0.1" if prefill else None, peer_port_base=port if prefill else None,
                            instance="prefill-0" if prefill else "",
                            side_channel_key="layerwise-gpu-check-side-channel-key-0123")

    layers, blocks = 8, 16
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    shape = (blocks, 2, 32, 8, 64)  # 128 KiB of float32 per block and layer
    prefill_kv = {n: torch.zeros(shape, dtype=torch.float32, device=prefill_device) for n in names}
    decode_kv = {n: torch.full(shape, -1.0, dtype=torch.float32, device=decode_device) for n in names}
    decode = DecodeWorker(config(contract.ROLE_DECODE), 0, 1, 32, "0.32.0")
    prefill = PrefillWorker(config(contract.ROLE_PREFILL), 0, 1, 32, "0.32.0")
    try:
        decode.register_kv_caches(decode_kv, blocks)
        prefill.register_kv_caches(prefill_kv, blocks)
        if not (prefill.side.connected.wait(30) and decode.side.connected.wait(30)):
            report(check, False, "the pair never formed")
            return
        key, digest = "t-" + "f" * 32, bytes(range(32))
        src, dst = [1, 2, 3, 4], [9, 10, 11, 12]
        decode.start_load_kv(PdPairConnectorMetadata(reqs_to_recv=[
            RecvRequest("d1", key, 0, dst, "prefill-0", digest, keyed=True)]))
        time.sleep(0.3)  # the Pull is parked on prefill
        streams = [StreamRequest("p1", key, src, digest)]
        started = time.monotonic()
        for layer, name in enumerate(names):
            if not DRY_RUN:
                torch.cuda._sleep(40_000_000)  # ~20 ms of GPU time queued before this layer's write
            for block in src:
                prefill_kv[name][block].fill_(1000 * (layer + 1) + block)
            prefill.layer_written(name, streams)  # announced before the kernels ran, as vLLM does
        announced = time.monotonic()
        prefill.start_load_kv(PdPairConnectorMetadata(reqs_to_stream=streams))
        prefill.step_computed()
        deadline = time.monotonic() + 30
        finished: set[str] = set()
        failed: set[str] = set()
        while "d1" not in finished | failed and time.monotonic() < deadline:
            done, bad = decode.get_transfer_results(True)
            finished |= done
            failed |= bad
        loaded = time.monotonic()
        if DRY_RUN is False:
            torch.cuda.synchronize()
        wrong = [f"layer {layer}" for layer, name in enumerate(names)
                 if not torch.equal(decode_kv[name][dst].cpu(), prefill_kv[name][src].cpu())]
        stale = [f"layer {layer}" for layer, name in enumerate(names)
                 if bool((decode_kv[name][dst].cpu() == 0).any())]
        ok = "d1" in finished and not wrong and not stale
        if control:
            ok = "d1" in finished and bool(stale)  # without the ordering the copy must have read the old bytes
        report(check, ok,
               f"{'loaded' if 'd1' in finished else 'NOT loaded'} ({'failed' if failed else 'ok'}): "
               f"{layers} layers x {len(src)} blocks {prefill_device} -> host -> {decode_device}; "
               f"announced in {1000 * (announced - started):.1f} ms, loaded {1000 * (loaded - started):.1f} ms after "
               f"the first write was queued; wrong: {wrong or 'none'}; stale (zeros): {stale or 'none'}")
    finally:
        prefill.shutdown()
        decode.shutdown()


def nccl_home(workdir: Path) -> Path:
    """A CCL_HOME for FlagCX's Makefile made of links into the nvidia-nccl wheel (include/nccl.h, lib/libnccl.so)."""
    headers = [h for entry in sys.path if entry and Path(entry, "nvidia").is_dir()
               for h in Path(entry, "nvidia").glob("**/include/nccl.h")]
    if not headers:
        raise RuntimeError("no nvidia-nccl wheel with include/nccl.h on sys.path")
    root = headers[0].parent.parent
    home = workdir / "nccl"
    (home / "lib").mkdir(parents=True, exist_ok=True)
    if not (home / "include").exists():
        (home / "include").symlink_to(root / "include")
    libs = sorted((root / "lib").glob("libnccl.so*"))
    for lib in libs:
        if not (home / "lib" / lib.name).exists():
            (home / "lib" / lib.name).symlink_to(lib)
    if not (home / "lib" / "libnccl.so").exists():
        (home / "lib" / "libnccl.so").symlink_to(libs[0])
    return home


def device_home() -> str:
    if Path("/usr/local/cuda/include/cuda_runtime.h").exists():
        return "/usr/local/cuda"
    import shutil

    nvcc = shutil.which("nvcc")
    return str(Path(nvcc).resolve().parent.parent) if nvcc else "/usr/local/cuda"


def build(tree: Path, nccl: Path, skip: bool) -> Path | None:
    lib = tree / "build" / "lib" / "libflagcx.so"
    if skip and lib.exists():
        return lib
    started = time.monotonic()
    cmd = ["make", "-C", str(tree), "-j", str(os.cpu_count() or 8), "USE_NVIDIA=1", f"DEVICE_HOME={device_home()}",
           f"CCL_HOME={nccl}"]
    if Path("/usr/include/nlohmann/json.hpp").exists():
        # The system's json.hpp wins over third-party/ for some includes: use it for all (no mixed versions).
        cmd.append("JSON_INCLUDE_DIR=/usr/include")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    took = time.monotonic() - started
    if proc.returncode != 0 or not lib.exists():
        report(f"build {tree.name}", False, f"make failed ({proc.returncode}) after {took:.0f}s: {proc.stderr[-1500:]}")
        return None
    report(f"build {tree.name}", True, f"{lib} in {took:.0f}s")
    return lib


# --- the checks per library ----------------------------------------------------------------------------------------


def flagcx_checks(tree: Path, lib: Path, expected_generation: str | None, gpus: int = 2) -> None:
    name = tree.name
    try:
        from pdpair.connector.transports.flagcx_abi import FlagcxLibrary

        loaded = FlagcxLibrary(str(lib))
        ok = expected_generation is None or loaded.generation == expected_generation
        report(f"{name} load", ok, f"flagcxGetVersion {loaded.version}, API generation {loaded.generation}"
               f"{'' if ok else f' (expected {expected_generation})'}, caller-allocated uid {loaded.caller_allocated_uid}")
    except Exception as exc:  # noqa: BLE001
        report(f"{name} load", False, f"{type(exc).__name__}: {exc}")
        return

    if gpus < 2:
        # A FlagCX pair is an NCCL communicator underneath, and NCCL refuses two ranks on one GPU.
        try:
            (results,), _ = flagcx_pairs(str(lib), [{"pair": 0, "rank": 0, "device": 0}],
                                         [{"pair": 0, "rank": 1, "device": 0}], register=False, bind_device=True,
                                         init_seconds=30)
            note(f"{name} one-gpu pair", "; ".join(f"rank {r['rank']} on GPU 0: {r.get('init')} {r.get('error', '')[:400]}"
                                                  for r in results))
        except Exception as exc:  # noqa: BLE001
            note(f"{name} one-gpu pair", f"{type(exc).__name__}: {exc}")
        for check in ("gpu1-pair init", "register NotSupported", "no-device control", "tp2 init", "leak"):
            print(f"NOT RUN {name} {check}: needs 2 GPUs, this machine has {gpus}", flush=True)
            RESULTS.append({"check": f"{name} {check}", "ok": None, "detail": f"not run: {gpus} GPU"})
        return

    # two processes, GPUs 0 and 1; then a GPU registration
    try:
        (results,), _ = flagcx_pairs(str(lib), [{"pair": 0, "rank": 0, "device": 0}],
                                     [{"pair": 0, "rank": 1, "device": 1}], register=True, try_put=True)
        # The generation tells that the library the config resolved in the child is the one built from this tree.
        inits = [r.get("init") == "ok" and r.get("generation") in (expected_generation, None) for r in results]
        report(f"{name} gpu1-pair init", all(inits), "; ".join(
            f"rank {r['rank']} on GPU {r['device']}: {r.get('init')} in {r.get('init_s')}s "
            f"{r.get('generation', '')} {r.get('error', '')}" for r in results))
        regs = [r.get("register_error", r.get("register", "")) for r in results]
        clear = all("flagcxNotSupported" in e and "one-sided" in e for e in regs)
        report(f"{name} register NotSupported", clear, " | ".join(regs))
        puts = [f"rank {r['rank']}: {r['put']} ({r.get('put_s')}s)" for r in results if "put" in r]
        if puts:
            note(f"{name} put after a successful registration", " | ".join(puts))
    except Exception as exc:  # noqa: BLE001
        report(f"{name} gpu1-pair", False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")

    # control: the old binding behaviour (no device in the helper threads)
    try:
        (results,), _ = flagcx_pairs(str(lib), [{"pair": 0, "rank": 0, "device": 0}],
                                     [{"pair": 0, "rank": 1, "device": 1}], register=False, bind_device=False)
        failed = any(r.get("init") != "ok" for r in results)
        note(f"{name} no-device control", ("init FAILS without the device binding, as reported: " if failed else
                                          "init succeeded even without the device binding: ")
             + "; ".join(f"rank {r['rank']}: {r.get('init')} {r.get('error', '')[:300]}" for r in results))
    except Exception as exc:  # noqa: BLE001
        note(f"{name} no-device control", f"{type(exc).__name__}: {exc}")

    # TP=2: one process, rank threads on GPUs 0 and 1; the peer process crosses the GPUs (pairs need two devices)
    try:
        (results,), _ = flagcx_pairs(
            str(lib),
            [{"pair": 0, "rank": 0, "device": 0}, {"pair": 1, "rank": 0, "device": 1}],
            [{"pair": 0, "rank": 1, "device": 1}, {"pair": 1, "rank": 1, "device": 0}],
            register=False,
        )
        report(f"{name} tp2 init", all(r.get("init") == "ok" for r in results), "; ".join(
            f"pair {r['pair']} rank {r['rank']} GPU {r['device']}: {r.get('init')} {r.get('init_s')}s "
            f"{r.get('error', '')}" for r in results))
    except Exception as exc:  # noqa: BLE001
        report(f"{name} tp2 init", False, f"{type(exc).__name__}: {exc}")

    # leak: 20 init/close cycles (no registration: it fails here, and a failed comm is deliberately not destroyed)
    try:
        cycles = 20
        results, counts = flagcx_pairs(str(lib), [{"pair": 0, "rank": 0, "device": 0}],
                                       [{"pair": 0, "rank": 1, "device": 1}], register=False, cycles=cycles)
        ok = all(r.get("init") == "ok" for cycle in results for r in cycle)
        a, b = counts
        note(f"{name} leak", f"{cycles} init/close cycles ({'all ok' if ok else 'SOME FAILED'}): rank 0 process threads "
             f"{a[0]['threads']} -> {a[1]['threads']} after 1 -> {a[-1]['threads']} after {cycles}, fds {a[0]['fds']} -> "
             f"{a[1]['fds']} -> {a[-1]['fds']}; rank 1 process threads {b[0]['threads']} -> {b[1]['threads']} -> "
             f"{b[-1]['threads']}, fds {b[0]['fds']} -> {b[1]['fds']} -> {b[-1]['fds']}")
    except Exception as exc:  # noqa: BLE001
        note(f"{name} leak", f"{type(exc).__name__}: {exc}")
    if True:  # the path a pod on these machines takes: init, registration answers NotSupported, close, re-pair
        try:
            results, counts = flagcx_pairs(str(lib), [{"pair": 0, "rank": 0, "device": 0}],
                                           [{"pair": 0, "rank": 1, "device": 1}], register=True, cycles=cycles)
            outcome = sorted({str(r.get("register")) + ":" + r.get("register_error", "")[:60] for cycle in results
                              for r in cycle})
            a, b = counts
            note(f"{name} leak with registration", f"{cycles} init/register/close cycles (registration: {outcome}): "
                 f"rank 0 threads {a[0]['threads']} -> {a[1]['threads']} -> {a[-1]['threads']}, fds {a[0]['fds']} -> "
                 f"{a[1]['fds']} -> {a[-1]['fds']}; rank 1 threads {b[0]['threads']} -> {b[1]['threads']} -> "
                 f"{b[-1]['threads']}, fds {b[0]['fds']} -> {b[1]['fds']} -> {b[-1]['fds']}")
        except Exception as exc:  # noqa: BLE001
            note(f"{name} leak with registration", f"{type(exc).__name__}: {exc}")


def rdma_flush_check(device: int) -> None:
    try:
        import torch

        from pdpair.connector.transports import flagcx_calls

        torch.cuda.set_device(device)
        torch.zeros(1, device=f"cuda:{device}")
        flagcx_calls._driver_flush_rdma_writes()
        detail = f"cuFlushGPUDirectRDMAWrites(current ctx, to owner) returned CUDA_SUCCESS on GPU {device}"
        try:
            from cuda.bindings import driver

            consts = (driver.CUflushGPUDirectRDMAWritesTarget.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                      driver.CUflushGPUDirectRDMAWritesScope.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER)
            values = tuple(int(c) for c in consts)
            ordering = driver.cuDeviceGetAttribute(
                driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING, device)
            detail += f"; enum values {values} (binding uses (0, 100)); GPU_DIRECT_RDMA_WRITES_ORDERING = {ordering}"
            ok = values == (0, 100)
        except Exception as exc:  # noqa: BLE001
            detail += f"; enum cross-check unavailable ({exc})"
            ok = True
        report("rdma-flush", ok, detail)
    except Exception as exc:  # noqa: BLE001
        report("rdma-flush", False, f"{type(exc).__name__}: {exc}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="")
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--child", nargs=2)
    opts = parser.parse_args()
    if opts.child:
        role, args = opts.child[0], json.loads(opts.child[1])
        {"flagcx": child_flagcx, "tcp-send": child_tcp_send, "tcp-recv": child_tcp_recv}[role](args)
        return 0

    if DRY_RUN:
        fake = os.environ["FLAGCX_LIB_PATH"]
        for generation, path in (("mr-index", fake), ("window", fake.replace("/default/", "/window-api/"))):
            flagcx_checks(Path(f"fake-{generation}"), Path(path), generation)
        main_tcp_staging()
        main_layerwise_staging()
        return finish(opts)

    import torch

    note("machine", f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"NOTE: {gpus} GPU: the pair checks need 2 and are listed as NOT RUN", flush=True)
    trees = [Path(p) for p in os.environ.get("FLAGCX_SRC", "").split(":") if p]
    if trees:
        workdir = Path("/tmp/pdpair-gpu-checks")
        workdir.mkdir(exist_ok=True)
        nccl = nccl_home(workdir)
        if os.environ.get("PDPAIR_GPU_CHECKS_LIBPATH") != "1":
            # libflagcx needs libnccl.so.2 and libcudart at load: the loader reads LD_LIBRARY_PATH only at start
            cuda_lib = Path(device_home()) / "lib64"
            os.environ["LD_LIBRARY_PATH"] = f"{nccl / 'lib'}:{cuda_lib}:{os.environ.get('LD_LIBRARY_PATH', '')}"
            os.environ["PDPAIR_GPU_CHECKS_LIBPATH"] = "1"
            os.execv(sys.executable, [sys.executable, str(SCRIPT), *sys.argv[1:]])
        for tree in trees:
            lib = build(tree, nccl, opts.skip_build)
            if lib is not None:
                generation = next((g for c, g in FLAGCX_PINNED_COMMITS.items() if c in tree.name), None)
                flagcx_checks(tree, lib, generation, gpus)
    else:
        report("flagcx", False, "FLAGCX_SRC not set: no FlagCX tree to build")
    rdma_flush_check(gpus - 1)
    try:
        main_tcp_staging(gpus)
    except Exception as exc:  # noqa: BLE001
        report("tcp-staging", False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        main_layerwise_staging(gpus)
    except Exception as exc:  # noqa: BLE001
        report("layerwise-staging", False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    # last: it takes out the staging stream's ordering for the rest of this process
    try:
        main_layerwise_staging(gpus, control=True)
    except Exception as exc:  # noqa: BLE001
        report("layerwise-staging control", False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    return finish(opts)


def finish(opts: argparse.Namespace) -> int:
    if opts.out:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        Path(opts.out, "results.json").write_text(json.dumps(RESULTS, indent=1))
    failed = [r["check"] for r in RESULTS if r["ok"] is False]
    print(f"{len(RESULTS)} checks, {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

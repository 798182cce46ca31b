"""Start real vLLM OpenAI servers (and the pdpair router) as subprocesses on free ports, for tests and benchmarks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from pdpair import contract
from devcluster.ports import free_port  # noqa: F401  (the engine tests and benchmarks take it from here)
from tests.side_channel_support import TEST_SIDE_CHANNEL_KEY

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
}
ENGINE_ARGS = [
    "--dtype", "float32",
    "--enforce-eager",
    "--block-size", "32",
    "--max-model-len", "512",
    "--kv-cache-memory-bytes", str(64 * 2**20),
    "--served-model-name", "tiny",
]
START_TIMEOUT_SECONDS = 300.0
# PDPAIR_INSTANCE of every prefill these tests start: the `peer` label of its edge on decode (signals, deficit).
PREFILL_INSTANCE = "test-prefill"


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_post(url: str, body: dict, timeout: float = 120.0, headers: dict | None = None) -> tuple[int, dict, dict]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = {"raw": raw.decode(errors="replace")}
        return exc.code, payload, dict(exc.headers)


@dataclass
class Process:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    http_port: int
    proc: subprocess.Popen | None = None
    _log: object = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> Process:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_bytes(self) -> int:
        """Resident memory of the whole process tree (API server, engine core, TP workers), now."""
        import psutil

        assert self.proc is not None
        root = psutil.Process(self.proc.pid)
        total = 0
        for proc in [root, *root.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the whole process tree has used so far (its live processes; a bench takes
        differences over a phase)."""
        import psutil

        assert self.proc is not None
        root = psutil.Process(self.proc.pid)
        total = 0.0
        for proc in [root, *root.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                pass
        return total

    def wait_healthy(self, timeout: float = START_TIMEOUT_SECONDS, path: str = "/health",
                     interval: float = 0.5) -> float:
        """Seconds until GET path answers 200, polled every `interval`; fails with the log tail if the process dies
        or time runs out."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log tail:\n{self.log()[-4000:]}")
            try:
                status, _ = http_get(self.url + path, timeout=2)
                if status == 200:
                    return time.monotonic() - started
            except OSError:
                pass
            time.sleep(interval)
        raise TimeoutError(f"{self.name} not healthy within {timeout}s; log tail:\n{self.log()[-4000:]}")

    def wait_log(self, text: str, timeout: float) -> None:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if text in self.log():
                return
            if not self.alive():
                raise RuntimeError(f"{self.name} exited while waiting for {text!r}; log tail:\n{self.log()[-4000:]}")
            time.sleep(0.25)
        raise TimeoutError(f"{self.name}: {text!r} not logged within {timeout}s; log tail:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._close_log()
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: vLLM's engine-core child goes too
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def engine(
    name: str,
    model_dir: Path,
    log_dir: Path,
    *,
    kv_role: str | None = None,
    pdpair_env: dict[str, str] | None = None,
    extra_config: dict | None = None,
    kv_transfer_config: dict | None = None,
    extra_env: dict[str, str] | None = None,
    failure_policy: str | None = None,
    tensor_parallel_size: int = 1,
    extra_args: tuple[str, ...] = (),
) -> Process:
    """A vLLM server; with kv_role it runs PdPairConnector, with kv_transfer_config any connector, else none;
    `extra_args` are more of vLLM's flags (e.g. --kv-events-config)."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), *ENGINE_ARGS, *extra_args]
    if tensor_parallel_size != 1:
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]  # one gloo worker process per rank on the CPU
    if kv_role is not None:
        kv_transfer_config = {
            "kv_connector": "PdPairConnector",
            "kv_connector_module_path": "pdpair.connector",
            "kv_role": kv_role,
            "kv_connector_extra_config": extra_config or {},
        }
        if failure_policy is not None:
            kv_transfer_config["kv_load_failure_policy"] = failure_policy
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDPAIR_")}
    env.update(ENGINE_ENV)
    env.update(pdpair_env or {})
    if pdpair_env:  # as the operator sets it: the connector's /readyz checks the engine's own /health on this port
        env.setdefault(contract.ENV_HTTP_PORT, str(port))
    env.update(extra_env or {})
    return Process(name, argv, env, log_dir / f"{name}.log", port)


def pair_env(role: str, *, generation: int, listen_base: int | None = None, peer_base: int | None = None,
             metrics_port: int | None = None, hang_timeout: float = 10.0) -> dict[str, str]:
    env = {
        contract.ENV_ROLE: role,
        contract.ENV_PAIR: "test-pair",
        contract.ENV_NAMESPACE: "default",
        contract.ENV_GENERATION: str(generation),
        contract.ENV_TRANSPORT: contract.TRANSPORT_TCP,
        contract.ENV_HANG_TIMEOUT_SECONDS: str(hang_timeout),
        contract.ENV_SIDE_CHANNEL_KEY: TEST_SIDE_CHANNEL_KEY,  # the pair's key, as the operator sets it from a Secret
    }
    if listen_base is not None:
        env[contract.ENV_LISTEN_PORT_BASE] = str(listen_base)
    if peer_base is not None:
        env[contract.ENV_PEER_HOST] = "127.0.0.1"
        env[contract.ENV_PEER_PORT_BASE] = str(peer_base)
        env[contract.ENV_INSTANCE] = PREFILL_INSTANCE  # decode's `peer` label of this prefill's edge
    if metrics_port is not None:
        env[contract.ENV_METRICS_PORT] = str(metrics_port)
    return env


def router(log_dir: Path, prefill_url: str, decode_url: str, decode_timeout: float = 120.0,
           extra_env: dict[str, str] | None = None, extra_args: tuple[str, ...] = (), name: str = "router") -> Process:
    port = free_port()
    argv = [sys.executable, "-m", "pdpair.router", "--host", "127.0.0.1", "--port", str(port),
            "--prefill", prefill_url, "--decode", decode_url, "--decode-timeout", str(decode_timeout), *extra_args]
    return Process(name, argv, {**os.environ, **(extra_env or {})}, log_dir / f"{name}.log", port)


@contextmanager
def running_pair(decode: Process, prefill: Process, log_dir: Path, decode_timeout: float = 60.0) -> Iterator[Process]:
    """Start decode and prefill, wait until they are healthy and paired, put a router in front; yield the router.

    Every process that was started is stopped on the way out, in reverse order, even when a start fails.
    """
    started: list[Process] = []
    try:
        for proc in (decode, prefill):
            started.append(proc.start())
        for proc in (decode, prefill):
            proc.wait_healthy()
        prefill.wait_log("paired with decode", 60)
        rtr = router(log_dir, prefill.url, decode.url, decode_timeout=decode_timeout)
        started.append(rtr.start())
        rtr.wait_healthy(60)
        yield rtr
    finally:
        for proc in reversed(started):
            proc.stop()

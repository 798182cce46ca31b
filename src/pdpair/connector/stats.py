"""vLLM-native connector stats: a serialisable container the worker fills, and the Prometheus exporter vLLM's
API server builds from it (series `vllm:pdpair_*` on vLLM's own /metrics). The pod metrics of the contract live in
metrics.py on PDPAIR_METRICS_PORT; these are the per-engine view inside vLLM. Units: seconds and bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

_LISTS = ("transfer_seconds", "transfer_bytes")
# Per-request stage durations, seconds (timeline.py names the stages). Decode: Pull sent -> first signal, first ->
# last signal, last signal -> vLLM told (get_finished). Prefill: Pull received -> first put (includes a Pull parked
# until the block ids came), first put -> flush done.
STAGES = ("pull_to_first_signal", "first_to_last_signal", "last_signal_to_engine", "pull_to_first_put", "push")
_STAGE_KEYS = tuple(f"stage_{stage}_seconds" for stage in STAGES)
_COUNTS = ("transfers_ok", "transfers_failed", "transfers_timed_out")


@dataclass
class PdPairKVConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {**{k: [] for k in _LISTS + _STAGE_KEYS}, **{k: 0 for k in _COUNTS}}

    def record_transfer(self, seconds: float, nbytes: int) -> None:
        self.data["transfer_seconds"].append(float(seconds))
        self.data["transfer_bytes"].append(int(nbytes))
        self.data["transfers_ok"] += 1

    def record_stage(self, stage: str, seconds: float) -> None:
        self.data[f"stage_{stage}_seconds"].append(float(seconds))

    def record_failure(self, timed_out: bool) -> None:
        self.data["transfers_timed_out" if timed_out else "transfers_failed"] += 1

    def clone_and_reset(self) -> PdPairKVConnectorStats:
        old = PdPairKVConnectorStats(data=self.data)
        self.reset()
        return old

    def aggregate(self, other: KVConnectorStats) -> PdPairKVConnectorStats:
        for key in _LISTS + _STAGE_KEYS:
            self.data.setdefault(key, []).extend(other.data.get(key, []))
        for key in _COUNTS:
            self.data[key] += other.data.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = self.data["transfer_seconds"]
        nbytes = self.data["transfer_bytes"]
        stages = {
            f"Avg {stage.replace('_', ' ')} (ms)": round(1000 * sum(values) / len(values), 3)
            for stage, key in zip(STAGES, _STAGE_KEYS)
            if (values := self.data.get(key))
        }
        return {
            "Num successful transfers": self.data["transfers_ok"],
            "Num failed transfers": self.data["transfers_failed"],
            "Num timed-out transfers": self.data["transfers_timed_out"],
            "Avg xfer time (ms)": round(1000 * sum(seconds) / len(seconds), 3) if seconds else 0.0,
            "Total MB transferred": round(sum(nbytes) / 2**20, 3),
            **stages,
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _LISTS + _STAGE_KEYS + _COUNTS)


class PdPairPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        seconds = self._histogram_cls(
            name="vllm:pdpair_kv_transfer_seconds",
            documentation="pdpair KV transfer duration (decode side: Pull sent to last signal).",
            buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
            labelnames=labelnames,
        )
        nbytes = self._counter_cls(
            name="vllm:pdpair_kv_transfer_bytes",
            documentation="pdpair KV bytes received.",
            labelnames=labelnames,
        )
        outcomes = self._counter_cls(
            name="vllm:pdpair_kv_transfers",
            documentation="pdpair KV transfers by outcome.",
            labelnames=[*labelnames, "outcome"],
        )
        stage_seconds = self._histogram_cls(
            name="vllm:pdpair_stage_seconds",
            documentation="pdpair per-request stage durations (decode: pull_to_first_signal, first_to_last_signal, "
                          "last_signal_to_engine; prefill: pull_to_first_put, push).",
            buckets=[0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0],
            labelnames=[*labelnames, "stage"],
        )
        self.stages = {
            stage: {idx: stage_seconds.labels(*values, stage) for idx, values in per_engine_labelvalues.items()}
            for stage in STAGES
        }
        self.seconds = create_metric_per_engine(seconds, per_engine_labelvalues)
        self.bytes = create_metric_per_engine(nbytes, per_engine_labelvalues)
        self.outcomes = {
            outcome: {idx: outcomes.labels(*values, outcome) for idx, values in per_engine_labelvalues.items()}
            for outcome in ("ok", "error", "timeout")
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for value in transfer_stats_data.get("transfer_seconds", []):
            self.seconds[engine_idx].observe(value)
        for stage, key in zip(STAGES, _STAGE_KEYS):
            for value in transfer_stats_data.get(key, []):
                self.stages[stage][engine_idx].observe(value)
        total = sum(transfer_stats_data.get("transfer_bytes", []))
        if total:
            self.bytes[engine_idx].inc(total)
        for key, outcome in (("transfers_ok", "ok"), ("transfers_failed", "error"), ("transfers_timed_out", "timeout")):
            count = transfer_stats_data.get(key, 0)
            if count:
                self.outcomes[outcome][engine_idx].inc(count)

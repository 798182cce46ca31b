"""Wire types of the side channel (msgspec), the compatibility hash, and the per-request kv_transfer_params.

Every side-channel message is two ZMQ frames: the sender's compatibility hash (ascii hex) and the msgpack body.
The receiver compares the hash BEFORE decoding the body, so a peer built from another connector version, another
vLLM or another KV layout fails with a message naming both hashes instead of a msgpack error. The Hello carries a
third frame, the hash's factors as JSON, so the mismatch can be explained in the log.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec

# Version history:
#   1: first version. Handshake: Hello -> Accepted or Refused; both init the pair and register;
#      Regions -> Welcome (prefill connects, decode answers OK);
#      per request Pull (decode -> prefill: blocks, signal slot, expected count) -> PullDone | PullFailed;
#      one put_signal per (layer, block), so expected signals = layers x blocks.
#   2: any prefill to any decode (xPyD). Hello carries `instance`, the prefill's identity (PDPAIR_INSTANCE);
#      prefill's kv_transfer_params carry it as `remote_instance`, and decode sends that request's Pull on the edge of
#      that prefill (decode refuses nothing new: a prefill it is not paired with fails the load at once).
PDPAIR_CONNECTOR_VERSION = 2

# Keys of kv_transfer_params. do_remote_* are vLLM's (the router and vLLM's own proxy use them); the rest are ours.
PARAM_DO_REMOTE_DECODE = "do_remote_decode"
PARAM_DO_REMOTE_PREFILL = "do_remote_prefill"
PARAM_REMOTE_REQUEST_ID = "remote_request_id"
PARAM_REMOTE_PAIR = "remote_pair"
PARAM_REMOTE_INSTANCE = "remote_instance"  # the prefill that computed the request (its PDPAIR_INSTANCE); version >= 2
PARAM_REMOTE_GENERATION = "remote_generation"
PARAM_REMOTE_NUM_TOKENS = "remote_num_tokens"
PARAM_REMOTE_NUM_BLOCKS = "remote_num_blocks"
PARAM_CONNECTOR_VERSION = "pdpair_connector_version"


class CompatibilityError(RuntimeError):
    """The peer's compatibility hash differs from ours (other connector version, vLLM or KV layout)."""


class KvLayout(msgspec.Struct, frozen=True):
    """What both sides must agree on to copy blocks byte for byte."""

    layer_names: list[str]
    chunk_bytes: list[int]  # bytes of one block of one layer, per layer
    block_size: int  # tokens per block
    dtype: str
    tp_size: int


def compatibility_factors(layout: KvLayout, vllm_version: str) -> dict[str, Any]:
    return {
        "connector_version": PDPAIR_CONNECTOR_VERSION,
        "vllm_version": vllm_version,
        "layer_names": layout.layer_names,
        "chunk_bytes": layout.chunk_bytes,
        "block_size": layout.block_size,
        "dtype": layout.dtype,
        "tp_size": layout.tp_size,
    }


def compatibility_hash(factors: dict[str, Any]) -> str:
    canonical = json.dumps(factors, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()[:16]


# --- messages --------------------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello", frozen=True):
    """prefill -> decode: who I am and the transport's unique id; both sides then init the pair."""

    generation: int
    pair: str
    tp_rank: int
    transport: str
    unique_id: bytes
    instance: str = ""  # the prefill's identity (PDPAIR_INSTANCE): one edge per instance on decode, a new Hello
    # from the same instance replaces its edge


class Accepted(msgspec.Struct, tag="accepted", frozen=True):
    """decode -> prefill: the Hello is valid; decode is initialising its side of the pair now."""


class Regions(msgspec.Struct, tag="regions", frozen=True):
    """prefill -> decode, after init + register: prefill's region table (one region per layer, in layer order)."""

    table: bytes
    region_indices: list[int]


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    """decode -> prefill: OK, with decode's region table; transfers may start."""

    table: bytes
    region_indices: list[int]
    num_blocks: int


class Refused(msgspec.Struct, tag="refused", frozen=True):
    """decode -> prefill: the handshake is refused (generation mismatch, transport mismatch, init failure)."""

    reason: str


class Pull(msgspec.Struct, tag="pull", frozen=True):
    """decode -> prefill: put the prefill request's blocks [first_block, first_block + len(dst_block_ids)) into
    decode's `dst_block_ids`, one put_signal per (layer, block) into `signal_slot`, `expected_signals` in all.
    An empty `dst_block_ids` only releases the prefill blocks (decode had everything cached)."""

    transfer_id: str  # decode's request id
    remote_request_id: str  # prefill's request id
    first_block: int
    dst_block_ids: list[int]
    signal_slot: int
    expected_signals: int


class PullDone(msgspec.Struct, tag="pull_done", frozen=True):
    """prefill -> decode: every put of a Pull was posted and completed locally."""

    transfer_id: str
    nbytes: int


class PullFailed(msgspec.Struct, tag="pull_failed", frozen=True):
    """prefill -> decode: the Pull cannot be served; decode fails the request at once instead of at the deadline."""

    transfer_id: str
    reason: str


Message = Hello | Accepted | Regions | Welcome | Refused | Pull | PullDone | PullFailed

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message, local_hash: str) -> list[bytes]:
    return [local_hash.encode("ascii"), _encoder.encode(message)]


def decode(frames: list[bytes], local_hash: str) -> Message:
    """Check the hash frame first, then decode the body; CompatibilityError names both hashes."""
    if len(frames) < 2:
        raise CompatibilityError(f"malformed side-channel message: {len(frames)} frame(s), expected >= 2")
    peer_hash = frames[0].decode("ascii", "replace")
    if peer_hash != local_hash:
        raise CompatibilityError(
            f"peer compatibility hash {peer_hash} != local {local_hash} (connector version, vLLM version or KV "
            "layout differ; see the factors logged with the Hello)"
        )
    return _decoder.decode(frames[1])

"""Wire types of the side channel (msgspec), the compatibility hash, the handshake's authentication, and the
per-request kv_transfer_params.

Every side-channel message is two ZMQ frames: the sender's compatibility hash (ascii hex) and the msgpack body.
The receiver compares the hash BEFORE decoding the body, so a peer built from another connector version, another
vLLM or another KV layout fails with a message naming both hashes instead of a msgpack error. The Hello carries a
third frame, the hash's factors as JSON, so the mismatch can be explained in the log. The one exception is decode's
reading of a Hello and a Proof (`decode_handshake`): it decodes them whatever the hash, because the hash may be named
to a peer only after that peer proved it holds the pair's side-channel key (an unauthenticated peer learns nothing of
decode), and a prefill of another build that holds the key must still be told why it is refused.

Every field is bounded when it is decoded (msgspec constraints below): a peer's input is refused as a
`msgspec.ValidationError` before any code acts on it. The bounds follow what a real peer can send: the instance is a
metric label (config.py's rule), a uid is at most `MAX_UNIQUE_ID_BYTES`, a region table at most `MAX_TABLE_BYTES`.

Authentication (HMAC-SHA256 with PDPAIR_SIDE_CHANNEL_KEY, `proof`): prefill's Hello carries a fresh nonce; decode
answers `Challenge` with its own nonce (and nothing about itself); prefill answers `Proof` = HMAC over the transcript
(both nonces, prefill's hash frame and the Hello's body as sent, so every Hello field is covered); decode checks it in
constant time before anything changes, then answers `Accepted` with its own proof over the same transcript (a
different role label, so neither proof can be replayed as the other), which prefill checks before init_pair.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Annotated, Any

import msgspec

from pdpair import contract
# Version history:
#   1: first version. Handshake: Hello -> Accepted or Refused; both init the pair and register;
#      Regions -> Welcome (prefill connects, decode answers OK);
#      per request Pull (decode -> prefill: blocks, signal slot, expected count) -> PullDone | PullFailed;
#      one put_signal per (layer, block), so expected signals = layers x blocks.
#   2: any prefill to any decode (xPyD). Hello carries `instance`, the prefill's identity (PDPAIR_INSTANCE);
#      prefill's kv_transfer_params carry it as `remote_instance`, and decode sends that request's Pull on the edge of
#      that prefill (decode refuses nothing new: a prefill it is not paired with fails the load at once).
#   3: authenticated handshake. Hello carries a nonce and a required, label-shaped instance; decode answers
#      Challenge (its nonce), prefill answers Proof (HMAC-SHA256 with the pair's side-channel key over both nonces
#      and the Hello as sent), decode answers Accepted with its own proof, or a Refused that names nothing of decode
#      until the peer is authenticated. Every field is bounded at decode time.
#   4: verified transfers. Pull carries a transfer tag (`transfer_tag`, `transfer_generation`) that prefill puts on
#      every put of it; decode's transport accepts only puts of transfers it declared, inside their blocks, with a
#      matching checksum (tcp: native protocol 3), and fails the load at once when one is refused.
#      Since 2026-12-06 Welcome may carry decode's `api_port` (absent reads 0: a decode of before then pairs as ever,
#      and prefill frees its held requests at their lease's end only).
#      Since 2026-12-07 a Pull may carry `prompt_digest` (absent reads empty: not checked) and its `remote_request_id`
#      may be the router's transfer key (`pdpair_transfer_key`) instead of prefill's own request id (both legs at
#      once, below); prefill then answers `PullStarted` when it starts serving such a Pull (decode's wait for the
#      transfer, and the health verdict on it, count from there, not from the Pull).
PDPAIR_CONNECTOR_VERSION = 4

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
# Router -> prefill: the base URL of the decode the router chose for the request (`http://host:port`). Prefill frees
# the request's held blocks at once when its edge to that decode is lost, instead of holding them for the lease.
PARAM_REMOTE_DECODE_URL = contract.KV_PARAM_REMOTE_DECODE_URL
MAX_DECODE_URL_CHARS = 300  # a URL longer than this is ignored (the param comes with the client's request)
# Prefill -> decode: HMAC-SHA256, with a key derived from the pair's side-channel key, over the request's reference
# (`remote_request_id`, pair, instance, generation, token count) and a digest of the prompt tokens prefill computed.
# Decode loads a prompt's KV only when the tag verifies against its OWN request's tokens: params copied onto another
# prompt, a reference edited (block or token counts), forged or missing, make decode compute the prompt itself, so
# the KV it loads is always the one prefill computed for this very prompt, whoever sent the params.
PARAM_REMOTE_KV_TAG = "remote_kv_tag"
# Router -> both engines, when it sends both legs at once (the router's --concurrent-legs): a fresh random key that
# names the transfer before prefill has computed anything. Prefill holds the request's blocks under it as well as
# under its own request id; decode's params name it as `remote_request_id`, with the prefill's instance, pair and
# generation (the router learned them from that prefill's earlier answers), so decode allocates and sends its Pull at
# once, and prefill parks the Pull until the prompt is computed. No `remote_kv_tag` can exist yet: instead the Pull
# carries the SHA-256 of decode's prompt (`Pull.prompt_digest`) and prefill serves it only when that is the digest of
# the prompt it computed, so decode still loads only KV computed for its own prompt.
PARAM_TRANSFER_KEY = contract.KV_PARAM_TRANSFER_KEY
TRANSFER_KEY_PATTERN = r"^t-[0-9a-f]{32}$"  # what the router makes (uuid4 hex); any other value is ignored


def kv_tag_key(side_channel_key: str) -> bytes:
    """The key of `remote_kv_tag`, derived from the pair's side-channel key (never the key itself)."""
    return derive_secret(side_channel_key.encode(), b"", "kv-transfer-params", 32)


def prompt_digest(token_ids, count: int) -> bytes:
    """SHA-256 of the first `count` prompt token ids (as little-endian int64): what prefill computed the KV of."""
    import array

    return hashlib.sha256(array.array("q", list(token_ids[:count])).tobytes()).digest()


def kv_tag(key: bytes, params: dict[str, Any], token_ids) -> str | None:
    """The tag of `params` (request id, pair, instance, generation, token count) for a prompt of `token_ids`; None
    when a field is missing or not of its type (such params cannot verify)."""
    try:
        fields = [str(params[PARAM_REMOTE_REQUEST_ID]), str(params[PARAM_REMOTE_PAIR]),
                  str(params[PARAM_REMOTE_INSTANCE]), int(params[PARAM_REMOTE_GENERATION]),
                  int(params[PARAM_REMOTE_NUM_TOKENS])]
    except (KeyError, TypeError, ValueError, OverflowError):  # e.g. a float('inf') generation
        return None
    count = fields[-1]
    if count < 0 or count > len(token_ids):
        return None
    body = json.dumps(fields, separators=(",", ":")).encode() + b"\0" + prompt_digest(token_ids, count)
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def kv_tag_verifies(key: bytes, params: dict[str, Any], token_ids) -> bool:
    """Whether `params` carry the tag prefill made for a prompt of exactly these tokens, all of them (a longer
    prompt with the same beginning needs KV prefill never computed): constant time."""
    claimed = params.get(PARAM_REMOTE_KV_TAG)
    if not isinstance(claimed, str) or params.get(PARAM_REMOTE_NUM_TOKENS) != len(token_ids):
        return False
    expected = kv_tag(key, params, token_ids)
    return expected is not None and hmac.compare_digest(claimed, expected)


def decode_api_address(url: object) -> tuple[str, int] | None:
    """(host, port) of a `remote_decode_url`, lower-case and without an IPv6 literal's brackets (how the peer set
    writes decode's host), or None for anything else: it arrives with the request, so it is only ever compared."""
    if not isinstance(url, str) or len(url) > MAX_DECODE_URL_CHARS:
        return None
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or not port:
        return None
    return parts.hostname.lower(), port


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


# --- bounds of wire fields ------------------------------------------------------------------------
NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256
# A metric label value (config.py's rule for PDPAIR_INSTANCE; decode labels the edge's series with it).
INSTANCE_PATTERN = r"^[A-Za-z0-9_.:\-\[\]/]{1,128}$"
# A transport's unique id: flagcx's is 256 bytes, tcp's a short JSON object; 4 KiB leaves room for both.
MAX_UNIQUE_ID_BYTES = 4096
# A region table: tcp's is a short JSON object; flagcx's holds one size per region (one region per layer) and the slot
# count. 256 KiB is room for ~10000 regions; a model has at most a few hundred layers.
MAX_TABLE_BYTES = 256 * 1024
MAX_REGIONS = 16384  # region indices in Regions / Welcome (one per layer)
# Block ids in one Pull: a request's blocks (2M tokens at 16 tokens per block; vLLM's longest contexts are 1M).
MAX_PULL_BLOCKS = 1 << 17
MAX_TEXT = 4096  # reasons, pair names
MAX_ID = 1024  # request ids (signals.py's bound on a transfer id)
# The largest frame any peer can need: a Pull of MAX_PULL_BLOCKS block ids (at most 5 bytes each in msgpack for a
# u32) or a region table with its indices, plus 64 KiB for the other fields and framing: 1.3 MiB. ZMQ_MAXMSGSIZE on
# both sides' sockets: libzmq drops the connection of a peer that announces a larger frame before allocating it.
MAX_MESSAGE_BYTES = max(5 * MAX_PULL_BLOCKS, MAX_TABLE_BYTES + 5 * MAX_REGIONS) + 64 * 1024

_U63 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_U32 = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
_Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
_Id = Annotated[str, msgspec.Meta(max_length=MAX_ID)]
_Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
_Proof = Annotated[bytes, msgspec.Meta(min_length=PROOF_BYTES, max_length=PROOF_BYTES)]
_Table = Annotated[bytes, msgspec.Meta(max_length=MAX_TABLE_BYTES)]
_Indices = Annotated[list[_U32], msgspec.Meta(max_length=MAX_REGIONS)]


# --- messages --------------------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello", frozen=True):
    """prefill -> decode: who I am, the transport's unique id and a fresh nonce. Nothing acts on it before the
    sender proved the key (Challenge / Proof)."""

    generation: _U63
    pair: Annotated[str, msgspec.Meta(max_length=253)]
    tp_rank: Annotated[int, msgspec.Meta(ge=0, lt=65536)]
    transport: Annotated[str, msgspec.Meta(max_length=32)]
    unique_id: Annotated[bytes, msgspec.Meta(max_length=MAX_UNIQUE_ID_BYTES)]
    # the prefill's identity (PDPAIR_INSTANCE): one edge per instance on decode, an authenticated Hello from the same
    # instance replaces its edge once its handshake completes
    instance: Annotated[str, msgspec.Meta(pattern=INSTANCE_PATTERN)]
    nonce: _Nonce


class Challenge(msgspec.Struct, tag="challenge", frozen=True):
    """decode -> prefill: prove the pair's key over the transcript with this nonce. Says nothing about decode."""

    nonce: _Nonce


class Proof(msgspec.Struct, tag="proof", frozen=True):
    """prefill -> decode: HMAC-SHA256(key, "prefill" + transcript)."""

    mac: _Proof


class Accepted(msgspec.Struct, tag="accepted", frozen=True):
    """decode -> prefill: the Hello is authenticated and valid; decode is initialising its side of the pair now.
    `proof` = HMAC-SHA256(key, "decode" + transcript): prefill pairs only with a decode of its own pair."""

    proof: _Proof


class Regions(msgspec.Struct, tag="regions", frozen=True):
    """prefill -> decode, after init + register: prefill's region table (one region per layer, in layer order)."""

    table: _Table
    region_indices: _Indices


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    """decode -> prefill: OK, with decode's region table; transfers may start. `api_port`: decode's own API port
    (PDPAIR_HTTP_PORT, 0 when not set): with the side channel's host it is the address the router names decode by
    (`remote_decode_url`), so prefill knows which of its held requests were for a decode whose edge is lost."""

    table: _Table
    region_indices: _Indices
    num_blocks: _U63
    api_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0


class Refused(msgspec.Struct, tag="refused", frozen=True):
    """decode -> prefill: the handshake is refused. Before the peer proved the key only `NOT_ACCEPTED` or `BUSY`;
    afterwards the reason may name the mismatch (generation, transport, rank, hash), the peer being the pair's own."""

    reason: _Text


class Pull(msgspec.Struct, tag="pull", frozen=True):
    """decode -> prefill: put the prefill request's blocks [first_block, first_block + len(dst_block_ids)) into
    decode's `dst_block_ids`, one put_signal per (layer, block) into `signal_slot`, `expected_signals` in all.
    An empty `dst_block_ids` only releases the prefill blocks (decode had everything cached)."""

    transfer_id: _Id  # decode's request id
    remote_request_id: _Id  # prefill's request id
    first_block: _U32
    dst_block_ids: Annotated[list[_U32], msgspec.Meta(max_length=MAX_PULL_BLOCKS)]
    signal_slot: _U32
    expected_signals: _U63
    # The tag prefill puts on every put of this Pull (decode declared it before sending the Pull); 0 = untagged, which
    # a decode with transfer checks refuses (a release-only Pull sends nothing).
    transfer_tag: _U63 = 0
    transfer_generation: _U32 = 0
    # SHA-256 of decode's prompt tokens (prompt_digest(tokens, len(tokens))); empty: not checked. Prefill serves a
    # Pull that carries one only for a request whose prompt has that digest, and a Pull naming a transfer key only
    # with one.
    prompt_digest: Annotated[bytes, msgspec.Meta(max_length=32)] = b""


class PullStarted(msgspec.Struct, tag="pull_started", frozen=True):
    """prefill -> decode: the Pull that named a transfer key is being served now (its prompt is computed); decode's
    transfer deadline and its health accounts start here (the wait before is prefill computing, not a transfer)."""

    transfer_id: _Id


class PullDone(msgspec.Struct, tag="pull_done", frozen=True):
    """prefill -> decode: every put of a Pull was posted and completed locally."""

    transfer_id: _Id
    nbytes: _U63


class PullFailed(msgspec.Struct, tag="pull_failed", frozen=True):
    """prefill -> decode: the Pull cannot be served; decode fails the request at once instead of at the deadline."""

    transfer_id: _Id
    reason: _Text


Message = Hello | Challenge | Proof | Accepted | Regions | Welcome | Refused | Pull | PullStarted | PullDone | PullFailed

# The only refusals an unauthenticated peer gets: they say nothing of decode (hash, generation, rank, transport).
NOT_ACCEPTED = "not accepted"
BUSY = "busy: too many handshakes in progress; retry"

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message, local_hash: str | bytes) -> list[bytes]:
    """[hash frame, body]. Decode answers a peer that has not proved the key with that peer's own hash frame
    (`local_hash` as bytes), so even the frames say nothing of decode's build."""
    frame = local_hash if isinstance(local_hash, bytes) else local_hash.encode("ascii")
    return [frame, _encoder.encode(message)]


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


def decode_handshake(frames: list[bytes]) -> tuple[Hello | Proof, str]:
    """Decode's reading of a Hello or a Proof: (the message, the peer's hash frame as text), whatever the hash (it is
    checked, and may be named, once the peer is authenticated; see the module docstring). Raises ValueError
    (msgspec's errors are ValueErrors) when the body is neither."""
    if len(frames) < 2:
        raise ValueError(f"malformed side-channel message: {len(frames)} frame(s), expected >= 2")
    message = _decoder.decode(frames[1])
    if not isinstance(message, (Hello, Proof)):
        raise ValueError(f"expected a Hello or a Proof under another compatibility hash, got {type(message).__name__}")
    return message, frames[0].decode("ascii", "replace")[:64]


def transcript(hash_frame: bytes, hello_body: bytes, decode_nonce: bytes) -> bytes:
    """What both proofs cover: prefill's hash frame and Hello body as sent (its nonce, generation, pair, rank,
    transport, uid and instance) and decode's nonce, each length-prefixed so no two transcripts read the same."""
    parts = (b"pdpair-side-channel-v3", hash_frame, hello_body, decode_nonce)
    return b"".join(len(p).to_bytes(8, "big") + p for p in parts)


def proof(key: bytes, role: str, transcript_bytes: bytes) -> bytes:
    """HMAC-SHA256(key, role + transcript); `role` is "prefill" or "decode" (a proof is never valid as the other)."""
    return hmac.new(key, role.encode() + b"\0" + transcript_bytes, hashlib.sha256).digest()


def proof_matches(key: bytes, role: str, transcript_bytes: bytes, mac: bytes) -> bool:
    """Constant-time check of a peer's proof (hmac.compare_digest)."""
    return hmac.compare_digest(proof(key, role, transcript_bytes), mac)


def derive_secret(key: bytes, transcript_bytes: bytes, purpose: str, size: int = 8) -> bytes:
    """A per-handshake secret both authenticated sides derive and nobody else can (e.g. the tcp data connection's
    token): HMAC-SHA256(key, "derive:" + purpose + transcript), first `size` bytes."""
    return hmac.new(key, b"derive:" + purpose.encode() + b"\0" + transcript_bytes, hashlib.sha256).digest()[:size]

"""Tensor parallel 2 on real vLLM engines: the seed's startup-hang case (prefill sends its uid to a decode listener
per rank, then each pair of ranks inits its communicator and registers its KV), on the native tcp transport.

One TP = 2 prefill, one TP = 2 decode (two gloo worker processes each) and the router, shared by the tests in file
order (each engine takes a minute or more to start on this box):
1. prefill is started first, with decode absent: it serves /health and retries on BOTH ranks;
2. decode starts with rank 1's listener held back (test knob `test_delay_listener_file`): rank 0 pairs, rank 1 does
   not; the operator's own probe (`probe_ranks`) refuses the pod; a request fails at once instead of hanging;
   releasing the knob lets rank 1 pair and the pair serve;
3. outputs equal a plain TP = 1 engine's (run while decode starts, then stopped to free memory) and a TP = 2
   engine's (the prefill engine answering alone, with no transfer involved) token for token;
4. each rank's side channel, pair, regions and signal accounts are separate and visible, labelled by rank;
5. a signal drop on rank 1 only: the request fails at the deadline, rank 1's deficit shows, /healthz and the
   operator's scrape judge the pod hung;
6. a process that is not one of prefill's ranks sends rank 1 peer sets on the TP rank channel without the key: they
   are refused, nothing is applied, the pair serves;
7. one decode worker killed: the pair fails visibly (errors within bounded time), never a silent hang.
Three TP = 2 engines re-created in one process are in test_engine_lifecycle.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import re
import secrets
import signal
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from engines import PREFILL_INSTANCE, Process, engine, free_port, http_get, pair_env, router
from test_pd_engine import completion, metric_in, tokens

from pdpair import contract
from pdpair.connector.rank_channel import PeerRanks, rank_channel_key, rank_socket_name
from tests.side_channel_support import OTHER_KEY_BYTES, TEST_SIDE_CHANNEL_KEY
from pdpair.operator.decide.health import PodState, ScrapeTarget
from pdpair.operator.act.scrape import scrape_pods
from pdpair.operator.act.listener_probe import probe_ranks
from devcluster.waiting import wait_for

UNREACHABLE_RETRY_SECONDS = 60  # the operator scrape of the rank-1 signal-drop test, asked again while a pod is silent

TP = 2
# The KV deadline of both engines. With 8 s, CI once failed the first request after rank 1 paired: rank 1's
# signals came 8 to 10 s after its Pull (they did come: "the late signals arrived"), and an earlier passing run had a
# request take 25 s at the same point. Neither reproduced here in 7 runs, 5 of them beside two CPU hogs. 30 s covers
# both; it lengthens only the signal-drop test, which waits out the deadline on purpose.
HANG_TIMEOUT_SECONDS = 30.0
# How long the router waits for decode's answer. A 6-token answer takes 2 to 9 s here, but CI once saw decode's
# workers spend over 60 s in one step (vLLM: "No available shared memory broadcast block found in 60 seconds") and
# recover by 78 s, after its KV had arrived in 50 ms; 60 s failed that request.
ROUTER_DECODE_TIMEOUT_SECONDS = 180.0
# How long a client waits for an answer through the router: the router's own wait for decode, plus a minute.
COMPLETION_TIMEOUT_SECONDS = ROUTER_DECODE_TIMEOUT_SECONDS + 60.0
# A listening port accepts at once; the timeout only bounds a probe of a box too busy to run it promptly.
PROBE_TIMEOUT_SECONDS = 10.0
# Decode's rank 0 serves /metrics and /healthz and asks rank 1 over a Unix socket, giving it 1 s. CI once froze
# decode's workers for about 10 s right after a failed load: rank 1 answered after rank 0 had given up (its series
# were absent from that read) and one read took over 5 s. A read here waits out such a freeze, up to this long, and
# then asserts on what it got: a series that is never exported still fails.
METRICS_READ_SECONDS = 60.0
# Short answers: a TP = 2 decode step costs a gloo all-reduce per layer, slow on a busy 2-core box.
MAX_TOKENS = 6
# Deadline for a TP = 2 engine to come up: three process layers import vLLM; on the shared box at load 40+ that has
# taken over 5 minutes (a deadline, not a wait: a healthy engine returns at once).
TP2_START_TIMEOUT_SECONDS = 900.0
GENERATION = 3
# Prefill's PDPAIR_PEERS_TOKEN, as the operator gives every prefill pod: with it, rank 0 serves the peer push and each
# other rank takes peer sets from rank 0 over the TP rank channel (what the rank-channel test attacks).
PEERS_TOKEN = "tp2-test-peers-token-0123456789"
# Each request's stage stamps in the engine logs (kept under the test's tmp dir): a failure here can be read back.
TIMELINE_ENV = {"PDPAIR_TIMELINE_LOG": "1"}
# Fresh prompts (decode's prefix cache must not hold them), 1 to 5 blocks of 32 tokens.
PROMPTS = [
    "Tensor parallel two: each rank holds one KV head.",
    "Rank zero pairs with rank zero, rank one with rank one. " * 3,
    "The operator probes every side-channel port before prefill starts. " * 5,
    "0 1 2 3 4 5 6 7 8 9 " * 9,
]
# Bytes one rank moves per KV block: layers x (K, V) x block tokens x KV heads per rank x head_dim x float32.
BYTES_PER_BLOCK_PER_RANK = 2 * 2 * 32 * (2 // TP) * 32 * 4


@dataclass
class Tp2Pair:
    prefill: Process
    decode: Process
    router: Process
    listen_base: int
    decode_metrics: str
    prefill_metrics: str
    hold_listener_knob: Path
    drop_knob: Path
    tp1_outputs: dict[str, list[int]]
    prefill_healthy_while_decode_absent: bool
    prefill_readyz_while_decode_absent: tuple[int, bytes]  # prefill's readiness (/readyz) then: 503, not paired
    rss: dict[str, int]


def worker_pid(proc: Process, rank: int) -> int:
    """The pid of the worker process of TP `rank`, from the connector's own start-up log line."""
    match = re.search(rf"\(pdpair pid=(\d+)\)[^\n]*PdPairConnector worker side \(TP rank {rank} of {TP}\)", proc.log())
    assert match, f"{proc.name}: no start-up log line of TP rank {rank}"
    return int(match.group(1))


def failed(status: int, payload: dict) -> bool:
    return status >= 500 or payload.get("choices", [{}])[0].get("finish_reason") == "error"


@pytest.fixture(scope="module")
def tp2(tiny_model, tmp_path_factory, plain_engine) -> Tp2Pair:
    logs = tmp_path_factory.mktemp("tp2-logs")
    knobs = tmp_path_factory.mktemp("tp2-knobs")
    hold, drop = knobs / "hold-listener", knobs / "drop-signals"
    hold.write_text("1")  # decode's rank 1 does not listen until the test removes this file
    listen_base = free_port(TP)
    decode_metrics, prefill_metrics = free_port(), free_port()
    prefill = engine(
        "prefill-tp2", tiny_model, logs, kv_role="kv_producer", tensor_parallel_size=TP,
        pdpair_env=pair_env("prefill", generation=GENERATION, peer_base=listen_base, metrics_port=prefill_metrics,
                            hang_timeout=HANG_TIMEOUT_SECONDS),
        extra_config={"test_drop_signals_file": str(drop)},
        extra_env={**TIMELINE_ENV, contract.ENV_PEERS_TOKEN: PEERS_TOKEN},
    )
    decode = engine(
        "decode-tp2", tiny_model, logs, kv_role="kv_consumer", tensor_parallel_size=TP,
        pdpair_env=pair_env("decode", generation=GENERATION, listen_base=listen_base, metrics_port=decode_metrics,
                            hang_timeout=HANG_TIMEOUT_SECONDS),
        extra_config={"test_delay_listener_file": str(hold)}, extra_env=TIMELINE_ENV,
    )
    started: list[Process] = []
    try:
        # Prefill first, on purpose, next to a plain TP = 1 engine that gives the reference outputs: the session's
        # (conftest.PlainEngine), already warm after test_pd_engine.py; started here when this module runs alone.
        started.append(prefill.start())
        baseline = plain_engine.get()
        prefill.wait_healthy(TP2_START_TIMEOUT_SECONDS)
        for rank in range(TP):
            prefill.wait_log(f"pdpair-sidechannel-prefill-r{rank}: handshake attempt 2 ", 60)
        healthy_before = http_get(prefill.url + "/health")[0] == 200
        readyz_before = http_get(f"http://127.0.0.1:{prefill_metrics}/readyz")
        started.append(decode.start())
        baseline.wait_healthy()  # its requests overlap decode's start-up
        tp1_outputs = {}
        for prompt in PROMPTS:
            status, payload = ask(baseline.url, prompt)
            assert status == 200, payload
            tp1_outputs[prompt] = tokens(payload)
        baseline_rss = baseline.rss_bytes()
        plain_engine.release()  # memory: only the pair runs from here on
        decode.wait_healthy(TP2_START_TIMEOUT_SECONDS)
        for proc in (prefill, decode):  # the first request of a TP = 2 engine is slow (warm-up): not in the timings
            status, payload = ask(proc.url, f"Warm-up of {proc.name}, computed locally.")
            assert status == 200, payload
        prefill.wait_log("pdpair-sidechannel-prefill-r0: paired with decode", 60)
        rtr = router(logs, prefill.url, decode.url, decode_timeout=ROUTER_DECODE_TIMEOUT_SECONDS)
        started.append(rtr.start())
        rtr.wait_healthy(60)
        rss = {"prefill": prefill.rss_bytes(), "decode": decode.rss_bytes(), "baseline_tp1": baseline_rss}
        print(f"\nRSS of each process tree: TP = 2 prefill {rss['prefill'] / 2**30:.2f} GiB, TP = 2 decode "
              f"{rss['decode'] / 2**30:.2f} GiB (API server + engine core + 2 workers), TP = 1 plain engine "
              f"{baseline_rss / 2**30:.2f} GiB")
        yield Tp2Pair(prefill, decode, rtr, listen_base, f"http://127.0.0.1:{decode_metrics}",
                      f"http://127.0.0.1:{prefill_metrics}", hold, drop, tp1_outputs, healthy_before, readyz_before, rss)
    finally:
        for proc in reversed(started):
            proc.stop()
        for knob in (hold, drop):
            if knob.exists():
                knob.unlink()
        if os.environ.get("PDPAIR_KEEP_ENGINE_LOGS"):
            print(f"engine logs kept in {logs}")


def ranked(base_url: str, name: str, rank: int, **labels: str) -> float:
    """`name`'s value for TP rank `rank`, read from the engine's merged /metrics once that rank answers there."""
    status, exposition = read_once_answered(base_url + "/metrics", lambda text: f'rank="{rank}"' in text)
    assert status == 200, f"{base_url}/metrics: {status} {exposition[:200]!r}"
    return metric_in(exposition, name, {"rank": str(rank), **labels}, where=f"{base_url}/metrics")


def healthz(base_url: str) -> tuple[int, dict]:
    """/healthz once every rank answers it (a rank that did not answer rank 0 in time reads 'rank_unreachable')."""
    status, body = read_once_answered(base_url + "/healthz",
                                      lambda text: json.loads(text).get("status") != "rank_unreachable")
    return status, json.loads(body)


def read_once_answered(url: str, answered) -> tuple[int, str]:
    """GET `url` until `answered(body)` holds, retrying reads that time out, for up to METRICS_READ_SECONDS; then
    return the last answer, whatever it says, for the caller to assert on."""
    deadline = time.monotonic() + METRICS_READ_SECONDS
    while True:
        try:
            status, body = http_get(url, timeout=max(1.0, deadline - time.monotonic()))
        except (TimeoutError, urllib.error.URLError) as exc:
            if not isinstance(getattr(exc, "reason", exc), TimeoutError) or time.monotonic() >= deadline:
                raise
            continue
        text = body.decode()
        if answered(text) or time.monotonic() >= deadline:
            return status, text
        time.sleep(1.0)


def ask(url: str, prompt: str) -> tuple[int, dict]:
    return completion(url, prompt, MAX_TOKENS, timeout=COMPLETION_TIMEOUT_SECONDS)


def test_prefill_started_before_decode_retries_on_every_rank(tp2):
    assert tp2.prefill_healthy_while_decode_absent, "prefill must serve /health while decode is still absent"
    # ...but it is not ready: its readiness (the operator's probe for prefill pods) waits for the pairing
    status, body = tp2.prefill_readyz_while_decode_absent
    assert status == 503 and json.loads(body)["paired"] == {"0": False, "1": False}, (status, body)
    for rank in range(TP):
        assert ranked(tp2.prefill_metrics, "pdpair_handshakes_total", rank, outcome="retry") >= 2
    assert ranked(tp2.prefill_metrics, "pdpair_handshakes_total", 0, outcome="ok") == 1


def test_decode_listening_on_rank_0_only_holds_prefill_back_without_a_hang(tp2):
    try:
        half_paired_pair_refuses_to_proceed(tp2)
    finally:
        tp2.hold_listener_knob.unlink(missing_ok=True)  # later tests need the whole pair even if this one failed
    ports = [tp2.listen_base + rank for rank in range(TP)]
    tp2.prefill.wait_log("pdpair-sidechannel-prefill-r1: paired with decode", 60)
    # Probed until both accept, within 60 s: one probe of both listeners, right after the pairing, found neither
    # accepting within its 10 s at load 44 in CI (the decode log had both listening), and the tests after this one
    # then saw a pair that never served through rank 1. A listener that is really gone never accepts.
    probes = []
    wait_for(lambda: (probes.append(asyncio.run(probe_ranks("127.0.0.1", ports, timeout=PROBE_TIMEOUT_SECONDS)))
                      or probes[-1].all_accept), 60, "both decode listeners accept", interval=1.0,
             diagnose=lambda: probes[-1].describe())
    if len(probes) > 1:
        print(f"both listeners accepted at probe {len(probes)}; the first: {probes[0].describe()}")
    # Paired on both ranks and serving: /readyz starts the warm-up completion (connector/warmup.py), ready once done.
    status, body = wait_for(lambda: (lambda r: r if r[0] == 200 else None)(http_get(tp2.prefill_metrics + "/readyz")),
                            120, "prefill's /readyz 200 (paired, warmed up)", interval=0.5)
    ready = json.loads(body)
    assert ready["paired"] == {"0": True, "1": True} and ready["status"] == "ok", ready
    assert ready["warmup"].startswith("ok"), ready
    status, payload = ask(tp2.router.url, "Both ranks are paired now.")
    assert status == 200 and len(tokens(payload)) == MAX_TOKENS, payload


def half_paired_pair_refuses_to_proceed(tp2) -> None:
    ports = [tp2.listen_base + rank for rank in range(TP)]
    probe = asyncio.run(probe_ranks("127.0.0.1", ports, timeout=PROBE_TIMEOUT_SECONDS))
    assert probe.accepting == (ports[0],) and probe.refusing == (ports[1],), probe.describe()
    assert not probe.all_accept  # the operator would not start prefill against this decode
    assert ranked(tp2.decode_metrics, "pdpair_listener_ready", 0) == 1
    assert ranked(tp2.decode_metrics, "pdpair_listener_ready", 1) == 0
    # Prefill's rank 1 keeps retrying (bounded backoff), never sends its uid, never inits a pair.
    retries = ranked(tp2.prefill_metrics, "pdpair_handshakes_total", 1, outcome="retry")
    wait_for(lambda: ranked(tp2.prefill_metrics, "pdpair_handshakes_total", 1, outcome="retry") > retries, 30,
             "prefill rank 1 retries again", interval=0.5)
    assert ranked(tp2.prefill_metrics, "pdpair_handshakes_total", 1, outcome="ok") == 0
    assert "pdpair-sidechannel-prefill-r1: paired" not in tp2.prefill.log()
    assert http_get(tp2.prefill.url + "/health")[0] == 200
    status, body = http_get(tp2.prefill_metrics + "/readyz")  # serving, half paired: not ready
    assert status == 503 and json.loads(body)["paired"] == {"0": True, "1": False}, (status, body)

    # A request cannot proceed on a half-paired pair, and it does not wait for the deadline either: rank 0 moves its
    # half of the KV, rank 1 has no pair, so it fails the load without opening a signal wait.
    def count(rank: int, outcome: str) -> float:
        return ranked(tp2.decode_metrics, "pdpair_kv_transfers_total", rank, outcome=outcome)

    before = {(r, o): count(r, o) for r in range(TP) for o in ("ok", "error")}
    timeouts = [ranked(tp2.decode_metrics, "pdpair_signal_wait_timeouts_total", r) for r in range(TP)]
    started = time.monotonic()
    status, payload = ask(tp2.router.url, "Half a pair cannot serve this prompt.")
    elapsed = time.monotonic() - started
    assert failed(status, payload), f"status {status}: {json.dumps(payload)[:400]}"
    assert elapsed < HANG_TIMEOUT_SECONDS, elapsed  # failed at once (about a second here), not at the deadline
    assert f"prefill '{PREFILL_INSTANCE}'" in tp2.decode.log() and "is not paired with this decode's rank 1" in tp2.decode.log()
    assert count(1, "error") == before[1, "error"] + 1
    assert count(0, "ok") == before[0, "ok"] + 1 and count(0, "error") == before[0, "error"]
    assert [ranked(tp2.decode_metrics, "pdpair_signal_wait_timeouts_total", r) for r in range(TP)] == timeouts
    print(f"\nhalf-paired request failed after {elapsed:.1f}s (hang timeout {HANG_TIMEOUT_SECONDS:g}s)")


def test_outputs_equal_single_engines_at_tp2_and_tp1(tp2):
    def counters() -> dict[tuple[str, int], float]:
        out = {}
        for r in range(TP):
            out["pdpair_kv_transfers_total", r] = ranked(tp2.decode_metrics, "pdpair_kv_transfers_total", r,
                                                         outcome="ok")
            out["pdpair_kv_transfer_bytes_total", r] = ranked(tp2.decode_metrics, "pdpair_kv_transfer_bytes_total", r)
            out["pdpair_signals_expected_total", r] = ranked(tp2.decode_metrics, "pdpair_signals_expected_total", r,
                                                             peer=PREFILL_INSTANCE)
        return out

    before = counters()
    for prompt in PROMPTS:
        status, alone = ask(tp2.prefill.url, prompt)  # a TP = 2 engine computing it all itself
        assert status == 200, alone
        status, via_pair = ask(tp2.router.url, prompt)
        assert status == 200, via_pair
        assert tokens(via_pair) == tokens(alone) == tp2.tp1_outputs[prompt], f"prompt {prompt[:40]!r}"
    moved = {key: value - before[key] for key, value in counters().items()}
    for rank in range(TP):
        assert moved["pdpair_kv_transfers_total", rank] == len(PROMPTS), moved
    # Each rank moved its own shard of the KV (one KV head of two) for every request: the same bytes and signal
    # counts on both ranks, in whole blocks.
    assert moved["pdpair_kv_transfer_bytes_total", 0] == moved["pdpair_kv_transfer_bytes_total", 1] > 0, moved
    assert moved["pdpair_kv_transfer_bytes_total", 0] % BYTES_PER_BLOCK_PER_RANK == 0, moved
    assert moved["pdpair_signals_expected_total", 0] == moved["pdpair_signals_expected_total", 1] > 0, moved


def test_each_rank_has_its_own_side_channel_pair_regions_and_accounts(tp2):
    for rank in range(TP):
        assert ranked(tp2.decode_metrics, "pdpair_listener_ready", rank) == 1
        # At least one handshake per rank: a prefill that sees its decode's side channel drop pairs again by design,
        # and in CI at load 35 (this module's engines beside the e2e tier) rank 0 once did (2026-12-06), so the
        # count is not pinned to 1; what each rank paired with, and over which pair, is checked below.
        assert ranked(tp2.decode_metrics, "pdpair_handshakes_total", rank, outcome="ok") >= 1
        assert ranked(tp2.prefill_metrics, "pdpair_handshakes_total", rank, outcome="ok") >= 1
        # Decode's rank r waits only for signals from prefill's rank r, on its own pair communicator (the edge's `peer`
        # label is the prefill's instance; the rank label keeps the ranks apart).
        peer = PREFILL_INSTANCE
        expected = ranked(tp2.decode_metrics, "pdpair_signals_expected_total", rank, peer=peer)
        assert expected > 0 and ranked(tp2.decode_metrics, "pdpair_signals_received_total", rank, peer=peer) == expected
        assert ranked(tp2.decode_metrics, "pdpair_signal_deficit", rank, peer=peer) == 0
        assert ranked(tp2.decode_metrics, "pdpair_transport_slots", rank, peer=peer) > 0
        # Prefill's rank r reached its decode (peer = decode's host:portBase; rank r connects to base + r).
        assert ranked(tp2.prefill_metrics, "pdpair_transport_slots", rank,
                      peer=f"127.0.0.1:{tp2.listen_base}") > 0
    for rank in range(TP):
        assert re.search(rf"pdpair-sidechannel-decode-r{rank}: paired with prefill test-pair rank {rank} ",
                         tp2.decode.log())
    status, health = healthz(tp2.decode_metrics)
    assert status == 200 and set(health["ranks"]) == {"0", "1"}, health


def rank_channel_stranger(metrics_port: int, rank: int, request: bytes) -> tuple[bytes, bytes]:
    """As a process that is not one of the pod's ranks: connect to TP rank `rank`'s abstract socket, read its nonce
    line, send `request` (the nonce line's hex is put in for `{nonce}`), read until the rank closes. Returns (the nonce
    line, everything the rank sent after it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(PROBE_TIMEOUT_SECONDS)
        sock.connect(rank_socket_name(metrics_port, rank))
        received = b""
        while b"\n" not in received:
            chunk = sock.recv(4096)
            assert chunk, f"rank {rank} closed before its nonce line: {received!r}"
            received += chunk
        nonce_line, _, after = received.partition(b"\n")
        sock.sendall(request.replace(b"{nonce}", nonce_line.strip()))
        while chunk := sock.recv(65536):
            after += chunk
    return nonce_line, after


def peers_state(tp2) -> dict:
    """Prefill's peer set and pairing per rank, as the operator reads them (GET of the peer push, on rank 0, which
    asks rank 1 over the rank channel with the key)."""
    def read() -> tuple[int, dict]:
        request = urllib.request.Request(tp2.prefill_metrics + contract.PEERS_PATH,
                                         headers={"Authorization": f"Bearer {PEERS_TOKEN}"})
        try:
            with urllib.request.urlopen(request, timeout=METRICS_READ_SECONDS) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    # 502 while rank 0 did not get rank 1's answer in time (a busy box): read again, as the operator does
    status, state = wait_for(lambda: (lambda r: r if r[0] != 502 else None)(read()), METRICS_READ_SECONDS,
                             "prefill's peer state from every rank", interval=1.0)
    assert status == 200, state
    return state


def test_rank_channel_refuses_a_peer_set_without_the_key(tp2):
    """A process that is not one of prefill's ranks connects to rank 1's abstract socket (`rank_socket_name`, what
    any hostNetwork pod of the node can reach) and sends peer sets that would repoint rank 1 at a decode that does
    not exist, or unpair it: with no MAC, with a MAC made with another pair's key, with a random MAC. Each gets the
    nonce line and then nothing (the connection closes), and nothing is applied: rank 1's peer set and pairing (read
    with the key as rank 0 reads them, and through prefill's peer push as the operator does) are what they were, no
    side-channel handshake happens on either side, prefill logs the refusals, and the pair still serves a completion.
    The same exchange with the pair's key and no peer set is answered (the stranger's requests were well formed but
    for the MAC). 3.8 s on the module's pair (run alone, at load average 2-8); vLLM cold starts: 0."""
    # Run alone, this test finds rank 1's listener still held back (the knob of the half-paired test): release it.
    tp2.hold_listener_knob.unlink(missing_ok=True)
    tp2.prefill.wait_log("pdpair-sidechannel-prefill-r1: paired with decode", 120)
    port = int(tp2.prefill_metrics.rsplit(":", 1)[1])
    wait_for(lambda: http_get(tp2.prefill_metrics + "/readyz")[0] == 200, 120, "prefill's /readyz 200", interval=0.5)
    key = rank_channel_key(TEST_SIDE_CHANNEL_KEY)
    decode_peer = f"127.0.0.1:{tp2.listen_base}"

    def rank1_as_rank0() -> dict:
        snapshot = PeerRanks(port, (1,), key, timeout=PROBE_TIMEOUT_SECONDS).fetch({})[1]
        assert isinstance(snapshot, dict), snapshot
        return {"peers": snapshot["peers"], "paired": snapshot["paired"]}

    def handshakes_ok() -> tuple[float, float]:
        return (ranked(tp2.prefill_metrics, "pdpair_handshakes_total", 1, outcome="ok"),
                ranked(tp2.decode_metrics, "pdpair_handshakes_total", 1, outcome="ok"))

    before_rank1, before_push, before_ok = rank1_as_rank0(), peers_state(tp2), handshakes_ok()
    assert before_rank1 == {"peers": {decode_peer: True}, "paired": True}, before_rank1
    assert before_push["ranks"]["1"] == {decode_peer: True} and before_push["paired"] == {decode_peer: True}, before_push
    elsewhere = free_port(TP)  # a decode nobody runs: rank 1 would leave its decode for it

    def mac(with_key: bytes, nonce_hex: bytes, body: bytes) -> bytes:
        # rank_channel's request MAC, made here as a stranger would make it
        return hmac.new(with_key, b"request\0" + bytes.fromhex(nonce_hex.decode()) + body,
                        hashlib.sha256).hexdigest().encode()

    other_key = rank_channel_key(OTHER_KEY_BYTES)
    sent = 0
    for decodes in ([{"host": "127.0.0.1", "portBase": elsewhere}], []):
        body = json.dumps({"decodes": decodes, "nonce": secrets.token_hex(16)}).encode()
        for request in (body + b"\n",  # no MAC at all
                        b"{nonce} " + body + b"\n",  # a MAC field that is not one
                        secrets.token_hex(32).encode() + b" " + body + b"\n"):  # a random MAC
            nonce_line, after = rank_channel_stranger(port, 1, request)
            assert len(bytes.fromhex(nonce_line.decode())) == 16 and after == b"", (nonce_line, after)
            sent += 1
        # another pair's key, on this exchange's own nonce (what a rank of another pair on the node could make)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(PROBE_TIMEOUT_SECONDS)
            sock.connect(rank_socket_name(port, 1))
            nonce_hex = sock.recv(64).strip()
            sock.sendall(mac(other_key, nonce_hex, body) + b" " + body + b"\n")
            assert sock.recv(65536) == b"", "a refused request must get nothing back"
            sent += 1
    # The pair's key on the same exchange, with no peer set: answered (the requests above differ only by their MAC).
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(PROBE_TIMEOUT_SECONDS)
        sock.connect(rank_socket_name(port, 1))
        nonce_hex = sock.recv(64).strip()
        body = json.dumps({"nonce": secrets.token_hex(16)}).encode()
        sock.sendall(mac(key, nonce_hex, body) + b" " + body + b"\n")
        assert sock.recv(65536), "the pair's key must be answered"
    time.sleep(1.0)  # had anything been applied, rank 1's edge would be closing or retrying by now
    assert rank1_as_rank0() == before_rank1
    after_push = peers_state(tp2)
    assert after_push["ranks"] == before_push["ranks"] and after_push["epoch"] == before_push["epoch"], after_push
    assert handshakes_ok() == before_ok, "no side-channel handshake may follow a refused peer set"
    wait_for(lambda: f"TP rank channel '{rank_socket_name(port, 1)[1:]}': refused" in tp2.prefill.log(), 30,
             "prefill's rank 1 logs the refusals", interval=0.5)
    assert f"decode 127.0.0.1:{elsewhere}" not in tp2.prefill.log()
    status, payload = ask(tp2.router.url, "A stranger on the rank channel changed nothing.")
    assert status == 200 and len(tokens(payload)) == MAX_TOKENS, payload
    print(f"\n{sent} forged peer sets refused on rank 1's channel; its peers {before_rank1['peers']}")


def test_signal_drop_on_rank_1_only_fails_at_the_deadline_and_the_pod_is_judged_hung(tp2):
    timeouts = {r: ranked(tp2.decode_metrics, "pdpair_signal_wait_timeouts_total", r) for r in range(TP)}
    tp2.drop_knob.write_text("2@1")  # prefill's rank 1 omits every 2nd signal; rank 0 sends all of its own
    try:
        started = time.monotonic()
        status, payload = ask(tp2.router.url, "Rank one loses half of its signals here. " * 3)
        elapsed = time.monotonic() - started
    finally:
        tp2.drop_knob.unlink()
    assert failed(status, payload), f"status {status}: {json.dumps(payload)[:400]}"
    assert HANG_TIMEOUT_SECONDS * 0.8 <= elapsed <= HANG_TIMEOUT_SECONDS + 20, elapsed
    assert "rank 1's transport drops every 2-th signal" in tp2.prefill.log()
    assert "rank 0's transport drops" not in tp2.prefill.log()

    assert ranked(tp2.decode_metrics, "pdpair_signal_deficit", 1, peer=PREFILL_INSTANCE) > 0
    assert ranked(tp2.decode_metrics, "pdpair_signal_deficit", 0, peer=PREFILL_INSTANCE) == 0
    assert ranked(tp2.decode_metrics, "pdpair_signal_wait_timeouts_total", 1) == timeouts[1] + 1
    assert ranked(tp2.decode_metrics, "pdpair_signal_wait_timeouts_total", 0) == timeouts[0]
    status, health = healthz(tp2.decode_metrics)
    assert status == 503 and health["status"] == "hung", health
    assert health["transfer"]["rank"] == 1 and health["transfer"]["expected"] > health["transfer"]["received"]
    assert health["ranks"]["0"]["status"] == "ok" and health["ranks"]["1"]["status"] == "hung", health

    # The operator's own health scrape, on the real pods' exposition, judges decode hung and prefill healthy. A scrape
    # that gets no answer in time is judged unreachable, which is the scrape's verdict on a starved box, not this
    # test's subject (a cold CI run, image builds beside it at load 22, saw decode's /metrics miss 5 s once): it is
    # asked again, for up to UNREACHABLE_RETRY_SECONDS, until both pods answer.
    port = int(tp2.decode_metrics.rsplit(":", 1)[1]), int(tp2.prefill_metrics.rsplit(":", 1)[1])

    def scrape():
        scrapes = asyncio.run(scrape_pods(
            [ScrapeTarget("decode", "decode-tp2", "127.0.0.1", port[0]),
             ScrapeTarget("prefill", "prefill-tp2", "127.0.0.1", port[1])],
            expected_generation=GENERATION, hang_timeout_seconds=HANG_TIMEOUT_SECONDS, timeout=5.0,
        ))
        return None if any(s.state == PodState.UNREACHABLE for s in scrapes) else scrapes

    scrapes = wait_for(scrape, UNREACHABLE_RETRY_SECONDS, "both pods' metrics answering the operator's scrape",
                       interval=1.0)
    assert [s.state for s in scrapes] == [PodState.HUNG, PodState.HEALTHY], [s.message for s in scrapes]
    assert f"from {PREFILL_INSTANCE} rank 1" in scrapes[0].message, scrapes[0].message


def test_killing_one_decode_worker_fails_the_pair_visibly(tp2):
    """Last: it breaks the pair. vLLM notices a dead worker and shuts the engine down; every request gets an answer
    (an error) within bounded time, prefill notices the side channel drop, nothing waits forever."""
    os.kill(worker_pid(tp2.decode, 1), signal.SIGKILL)
    started = time.monotonic()
    status, payload = ask(tp2.router.url, "Is anyone still decoding?")
    assert failed(status, payload) or status >= 400, f"status {status}: {json.dumps(payload)[:400]}"
    assert time.monotonic() - started < 90
    wait_for(lambda: not tp2.decode.alive() or http_get_status(tp2.decode.url) != 200, 90, "decode stops serving",
             interval=0.5)
    tp2.prefill.wait_log("closed the side channel", 90)
    assert http_get(tp2.prefill.url + "/health")[0] == 200  # prefill itself is fine: it waits for a new decode


def http_get_status(url: str) -> int:
    try:
        return http_get(url + "/health", timeout=5)[0]
    except OSError:
        return 0

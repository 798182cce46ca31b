"""Layer-wise puts (PDPAIR_LAYERWISE_PUTS): with both legs at once, prefill serves decode's Pull while the step that
computes the prompt runs, putting layer k as soon as the model wrote it (the connector's `save_kv_layer`), instead of
every layer after the request finished. The workers run without vLLM's engine, as in test_connector_workers.py: real
KV tensors, the real tcp transport and side channels on localhost; `layer_written` / `step_computed` are the calls
vLLM's forward makes. The scheduler's side is driven with the fields vLLM hands it. The engine tier runs the same
path through real engines (`tests/engine/test_pd_engine.py`, both legs at once). Cost: about 4 s in all.
"""

from __future__ import annotations

import dataclasses
import time
import types

import pytest
import torch

from pdpair import contract
from pdpair.connector.config import ConfigError, PdPairConfig
from pdpair.connector.decode_worker import DecodeWorker
from pdpair.connector.metadata import PARAM_DO_REMOTE_DECODE, PARAM_TRANSFER_KEY, prompt_digest
from pdpair.connector.prefill_worker import PrefillWorker
from pdpair.connector.scheduler import (
    PdPairConnectorMetadata,
    PdPairScheduler,
    RecvRequest,
    SendRequest,
    StreamRequest,
)
from tests.unit.connector.test_connector_workers import (
    DEADLINE,
    LAYERS,
    _pair,
    config,
    settle,
)

KEY = "t-" + "e" * 32
DIGEST = bytes(range(32))


@pytest.fixture
def pair(request):
    """A paired decode and prefill worker, with the hang timeout a test gives as the fixture's parameter (30 s)."""
    yield from _pair(hang=getattr(request, "param", 30.0))


def keyed_pull(decode: DecodeWorker, blocks: list[int]) -> None:
    decode.start_load_kv(PdPairConnectorMetadata(reqs_to_recv=[
        RecvRequest("d1", KEY, 0, blocks, "prefill-0", DIGEST, keyed=True)]))


def stream(prefill: PrefillWorker, request_id: str, blocks: list[int]) -> None:
    prefill.start_load_kv(PdPairConnectorMetadata(reqs_to_stream=[StreamRequest(request_id, KEY, blocks, DIGEST)]))


def finish(prefill: PrefillWorker, request_id: str, blocks: list[int], aborted: bool = False) -> None:
    """The request's SendRequest, as the step after its finish brings it."""
    prefill.start_load_kv(PdPairConnectorMetadata(reqs_to_send=[
        SendRequest(request_id, blocks, time.monotonic() + 60, transfer_key=None if aborted else KEY,
                    prompt_digest=b"" if aborted else DIGEST, aborted=aborted)]))


def reported(prefill: PrefillWorker, request_id: str, within: float = DEADLINE) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if request_id in prefill.get_transfer_results():
            return True
        time.sleep(0.01)
    return False


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_each_layer_is_put_once_the_model_wrote_it_and_the_finish_frees_the_blocks_at_once(pair):
    """Decode's keyed Pull comes first; the step computing the prompt starts (the stream); nothing reaches decode
    before layer 0 is written, layer 0 does before layer 1 is, and the load completes with the last layer, before the
    request finished. Its SendRequest, one step later, is reported sent at once (the serve already ended)."""
    decode, prefill, decode_kv, prefill_kv = pair
    keyed_pull(decode, [6, 7])
    time.sleep(0.2)  # the Pull is parked on prefill: nothing is computed yet
    stream(prefill, "p1", [2, 3])
    time.sleep(0.3)
    assert all(bool((decode_kv[name] == -1).all()) for name in LAYERS), "a layer was put before the model wrote it"
    prefill.layer_written(LAYERS[0])
    wait_for(lambda: torch.equal(decode_kv[LAYERS[0]][6], prefill_kv[LAYERS[0]][2]) and
             torch.equal(decode_kv[LAYERS[0]][7], prefill_kv[LAYERS[0]][3]), "layer 0 was not put once written")
    assert bool((decode_kv[LAYERS[1]] == -1).all()), "layer 1 was put before the model wrote it"
    assert not decode.get_transfer_results()[0], "the load settled before its last layer"
    prefill.layer_written(LAYERS[1])
    _, failed = settle(decode, {"d1"}, idle=True)
    assert failed == set()
    assert torch.equal(decode_kv[LAYERS[1]][6], prefill_kv[LAYERS[1]][2])
    assert torch.equal(decode_kv[LAYERS[1]][7], prefill_kv[LAYERS[1]][3])
    prefill.step_computed()
    assert "p1" not in prefill.get_transfer_results(), "blocks reported sent before the request finished"
    finish(prefill, "p1", [2, 3])
    assert reported(prefill, "p1"), "the finished request's blocks were not freed after its streamed serve"
    assert KEY not in prefill._keys and "p1" not in prefill._streams and not prefill._streams._served_early


def test_the_stream_begins_at_the_steps_first_layer_as_vllm_calls_the_loads_after_the_forward(pair):
    """vLLM 0.32 calls start_load_kv after the forward when no load is synchronous: the step's streamed requests
    come with its first `save_kv_layer` (from the bound metadata), so layer 0 is put while layer 1 is computed;
    start_load_kv after the forward does not begin them twice."""
    decode, prefill, decode_kv, prefill_kv = pair
    keyed_pull(decode, [6])
    time.sleep(0.2)
    requests = [StreamRequest("p6", KEY, [3], DIGEST)]
    prefill.layer_written(LAYERS[0], requests)
    wait_for(lambda: torch.equal(decode_kv[LAYERS[0]][6], prefill_kv[LAYERS[0]][3]), "layer 0 was not put")
    assert bool((decode_kv[LAYERS[1]] == -1).all())
    prefill.layer_written(LAYERS[1], requests)
    prefill.start_load_kv(PdPairConnectorMetadata(reqs_to_stream=requests))
    prefill.step_computed()
    _, failed = settle(decode, {"d1"}, idle=True)
    assert failed == set() and torch.equal(decode_kv[LAYERS[1]][6], prefill_kv[LAYERS[1]][3])
    assert "p6" in prefill._streams and not prefill._streams.step, "begun twice, or the step not ended"
    finish(prefill, "p6", [3])
    assert reported(prefill, "p6")


def test_a_pull_that_comes_after_the_step_is_served_before_the_request_finished(pair):
    """The step ended (every layer written) before decode's Pull came: it is served from the stream at once,
    without waiting for the request's finish; the finish then frees the blocks."""
    decode, prefill, decode_kv, prefill_kv = pair
    stream(prefill, "p2", [4])
    prefill.layer_written(LAYERS[0])  # layer 1 is never named: the end of the step covers it
    prefill.step_computed()
    keyed_pull(decode, [1])
    _, failed = settle(decode, {"d1"}, idle=True)
    assert failed == set()
    assert all(torch.equal(decode_kv[name][1], prefill_kv[name][4]) for name in LAYERS)
    finish(prefill, "p2", [4])
    assert reported(prefill, "p2")


def test_without_a_pull_during_the_step_the_finished_request_is_served_as_before(pair):
    decode, prefill, decode_kv, prefill_kv = pair
    stream(prefill, "p3", [5])
    prefill.step_computed()
    finish(prefill, "p3", [5])
    assert "p3" not in prefill._streams
    keyed_pull(decode, [2])
    _, failed = settle(decode, {"d1"}, idle=True)
    assert failed == set() and all(torch.equal(decode_kv[name][2], prefill_kv[name][5]) for name in LAYERS)
    assert reported(prefill, "p3")


@pytest.mark.parametrize("pair", [0.5], indirect=True, ids=["hang-0.5s"])
def test_a_prompt_never_computed_fails_the_load_within_the_hang_timeout(pair):
    """The stream's step never writes a layer (a stalled prefill): the load fails within decode's bound, decode is
    not left waiting; the request's abort then frees its blocks at once (no serve reads them)."""
    decode, prefill, decode_kv, _ = pair
    stream(prefill, "p4", [2])
    started = time.monotonic()
    keyed_pull(decode, [3])
    _, failed = settle(decode, {"d1"}, idle=True)
    assert failed == {"d1"}
    assert time.monotonic() - started < 0.5 + 5
    assert all(bool((decode_kv[name][3] == -1).all()) for name in LAYERS)
    wait_for(lambda: not prefill._serving, "the failed serve never ended")
    finish(prefill, "p4", [2], aborted=True)
    assert reported(prefill, "p4")


def test_an_aborted_request_is_held_while_its_serve_reads_it_and_never_served_again(pair):
    """The request is aborted while its streamed serve waits for layer 1: its blocks are held (vLLM would reuse
    them) until the serve ended, then reported sent exactly once; a second Pull naming its key is refused."""
    decode, prefill, decode_kv, prefill_kv = pair
    keyed_pull(decode, [6])
    stream(prefill, "p5", [1])
    prefill.layer_written(LAYERS[0])
    wait_for(lambda: torch.equal(decode_kv[LAYERS[0]][6], prefill_kv[LAYERS[0]][1]), "layer 0 was not put")
    finish(prefill, "p5", [1], aborted=True)
    time.sleep(0.2)
    assert "p5" not in prefill.get_transfer_results(), "an aborted request's blocks were freed while a serve read them"
    prefill.layer_written(LAYERS[1])
    settle(decode, {"d1"}, idle=True)
    assert reported(prefill, "p5")
    decode.start_load_kv(PdPairConnectorMetadata(reqs_to_recv=[
        RecvRequest("d2", KEY, 0, [5], "prefill-0", DIGEST, keyed=True)]))
    assert not prefill._source_of(types.SimpleNamespace(remote_request_id=KEY)), "an aborted request is servable"
    assert "p5" not in prefill.get_transfer_results(), "reported twice"


# --- the scheduler's side ----------------------------------------------------------------------------------------
def scheduler(layerwise: bool = True) -> PdPairScheduler:
    cfg = dataclasses.replace(config(contract.ROLE_PREFILL, 20000), layerwise_puts=layerwise)
    return PdPairScheduler(cfg, block_size=4)


def request(request_id: str, prompt: list[int], keyed: bool = True):
    from vllm.v1.request import RequestStatus

    params = {PARAM_DO_REMOTE_DECODE: True}
    if keyed:
        params[PARAM_TRANSFER_KEY] = KEY
    return types.SimpleNamespace(request_id=request_id, prompt_token_ids=prompt, kv_transfer_params=params,
                                 status=RequestStatus.RUNNING, num_computed_tokens=0)


def step(sched: PdPairScheduler, request_id: str, blocks: list[int], computed: int, scheduled: int):
    new = types.SimpleNamespace(req_id=request_id, block_ids=(blocks,), num_computed_tokens=computed)
    output = types.SimpleNamespace(scheduled_new_reqs=[new], num_scheduled_tokens={request_id: scheduled},
                                   total_num_scheduled_tokens=scheduled)
    return sched.build_connector_meta(output)


def test_the_scheduler_streams_a_keyed_prompt_computed_in_one_step_only():
    prompt = list(range(10))
    sched = scheduler()
    req = request("r1", prompt)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = step(sched, "r1", [7, 8, 9], 0, 10)
    assert meta.reqs_to_stream == [StreamRequest("r1", KEY, [7, 8, 9], prompt_digest(prompt, len(prompt)))]
    assert step(sched, "r1", [7, 8, 9], 0, 10).reqs_to_stream == [], "streamed twice"
    chunked = scheduler()
    chunked.get_num_new_matched_tokens(request("r2", prompt), 0)
    assert step(chunked, "r2", [1, 2], 0, 8).reqs_to_stream == [], "a prompt computed over two steps was streamed"
    off = scheduler(layerwise=False)
    off.get_num_new_matched_tokens(request("r3", prompt), 0)
    assert step(off, "r3", [1, 2, 3], 0, 10).reqs_to_stream == []
    sequential = scheduler()
    sequential.get_num_new_matched_tokens(request("r4", prompt, keyed=False), 0)
    assert step(sequential, "r4", [1, 2, 3], 0, 10).reqs_to_stream == [], "no Pull can name a request without a key"


def test_an_aborted_streamed_request_keeps_its_blocks_for_the_worker_to_free():
    from vllm.v1.request import RequestStatus

    sched = scheduler()
    req = request("r1", list(range(10)))
    sched.get_num_new_matched_tokens(req, 0)
    step(sched, "r1", [7, 8, 9], 0, 10)
    req.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req, [7, 8, 9]) == (True, None)
    (held,) = sched.build_connector_meta(types.SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                                                               total_num_scheduled_tokens=0)).reqs_to_send
    assert held.aborted and held.block_ids == [7, 8, 9] and held.transfer_key is None
    never = scheduler()
    other = request("r2", list(range(10)))
    never.get_num_new_matched_tokens(other, 0)
    other.status = RequestStatus.FINISHED_ABORTED
    assert never.request_finished(other, [1, 2, 3]) == (False, None), "an unstreamed abort is freed by vLLM at once"


def test_the_setting_is_read_on_prefill_and_refused_elsewhere():
    env = {contract.ENV_TRANSPORT: contract.TRANSPORT_TCP, contract.ENV_PEER_HOST: "10.0.0.2",
           contract.ENV_PEER_PORT_BASE: "20000", contract.ENV_SIDE_CHANNEL_KEY: "k" * 32}
    assert PdPairConfig.from_env("kv_producer", environ=env).layerwise_puts is contract.DEFAULT_LAYERWISE_PUTS
    assert PdPairConfig.from_env("kv_producer", environ={**env, contract.ENV_LAYERWISE_PUTS: "false"}).layerwise_puts \
        is False
    with pytest.raises(ConfigError, match=contract.ENV_LAYERWISE_PUTS):
        PdPairConfig.from_env("kv_producer", environ={**env, contract.ENV_LAYERWISE_PUTS: "yes"})
    decode_env = {contract.ENV_TRANSPORT: contract.TRANSPORT_TCP, contract.ENV_LISTEN_PORT_BASE: "20000",
                  contract.ENV_SIDE_CHANNEL_KEY: "k" * 32, contract.ENV_LAYERWISE_PUTS: "true"}
    with pytest.raises(ConfigError, match="prefill only"):
        PdPairConfig.from_env("kv_consumer", environ=decode_env)

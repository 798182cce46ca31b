"""Prefill's layer-wise puts (PDPAIR_LAYERWISE_PUTS; the connector README, "Layer-wise puts"): the requests whose
prompt a step computes, servable layer by layer while that step runs.

`LayerStreams` is the prefill worker's book of them (one per TP rank). The engine thread begins a step's streams
(at its first `save_kv_layer`: vLLM 0.32 starts the step's loads after the forward), marks each layer written, and
ends the step; a push thread waits for the layer it is to put next; the request's finish (its SendRequest, one step
later) ends its stream. Every method runs under the worker's lock (`progress` is its condition), except where it
says otherwise.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from pdpair.connector.scheduler import StreamRequest


@dataclass
class LayerStream:
    """A request whose prompt the current (or a past) step computes, servable before it finished: `written[k]` once
    the model wrote layer k (`events[k]`: the GPU copy or write to wait for, None on CPU), `computed` once the
    step's forward ended. At most one Pull is served from it (`attached`); from the request's finish on (its
    SendRequest) it is served as any held request."""

    request: StreamRequest
    written: list[bool]
    events: list = field(default_factory=list)
    computed: bool = False
    attached: bool = False
    # time.monotonic() stamps, for the timeline: the step's start, each layer's write
    started: float = field(default_factory=time.monotonic)
    written_at: list = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def block_ids(self) -> list[int]:
        return self.request.block_ids

    @property
    def prompt_digest(self) -> bytes:
        return self.request.prompt_digest


class LayerStreams:
    def __init__(self, progress: threading.Condition) -> None:
        self._progress = progress
        self._by_request: dict[str, LayerStream] = {}
        self._by_key: dict[str, str] = {}  # the router's transfer key -> request id
        # the running step's streams (engine thread only: begun, marked and ended there)
        self.step: list[LayerStream] = []
        # request id -> when its streamed serve ended before its SendRequest came (that send is reported at once)
        self._served_early: dict[str, float] = {}
        self.closed = False  # the worker shuts down: a wait for a layer gives up

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_request

    def begin(self, requests: list[StreamRequest], layers: int) -> bool:
        """The step's streamed requests become servable, once each; True when any is new."""
        new = [request for request in requests if request.request_id not in self._by_request]
        for request in new:
            stream = LayerStream(request, [False] * layers, [None] * layers, written_at=[None] * layers)
            self._by_request[request.request_id] = stream
            self._by_key.setdefault(request.transfer_key, request.request_id)
            self.step.append(stream)
        return bool(new)

    def end(self, request_id: str) -> bool:
        """The request finished (its SendRequest came): a later Pull is served from the send. True when its
        streamed serve had already ended, so the send is reported sent at once."""
        stream = self._by_request.pop(request_id, None)
        if stream is not None and self._by_key.get(stream.request.transfer_key) == request_id:
            del self._by_key[stream.request.transfer_key]
        return self._served_early.pop(request_id, None) is not None

    def servable(self, key: str) -> LayerStream | None:
        """The stream a Pull naming this transfer key may be served from: begun, not finished, no Pull on it yet."""
        stream = self._by_request.get(self._by_key.get(key, ""))
        return stream if stream is not None and not stream.attached else None

    def claim(self, stream: LayerStream) -> bool:
        """Take the stream for one Pull; False when its request finished or another Pull took it meanwhile."""
        if self._by_request.get(stream.request_id) is not stream or stream.attached:
            return False
        stream.attached = True
        return True

    def serve_ended(self, request_id: str) -> None:
        """Its streamed serve ended before the request finished: the send, when it comes, is reported at once."""
        if request_id in self._by_request:
            self._served_early[request_id] = time.monotonic()

    def forget_older_than(self, bound: float) -> None:
        """Bookkeeping bound only: early ends whose send never came (the send lease passed)."""
        for request_id in [r for r, at in self._served_early.items() if at < bound]:
            del self._served_early[request_id]

    def mark_written(self, streams: list[LayerStream], layers: list[int], events: dict) -> None:
        now = time.monotonic()
        for stream in streams:
            for layer in layers:
                stream.written[layer] = True
                stream.events[layer] = events[layer]
                stream.written_at[layer] = now
        self._progress.notify_all()

    def mark_computed(self, streams: list[LayerStream]) -> None:
        for stream in streams:
            stream.computed = True
        self._progress.notify_all()

    def wait_written(self, stream: LayerStream, layer: int, bound: float) -> tuple[bool, object]:
        """Push thread: wait until the model wrote `layer` of the streamed request, at most until `bound`
        (time.monotonic()) or the worker's shutdown: (written, the event to wait for)."""
        while not (stream.written[layer] or stream.computed):
            left = bound - time.monotonic()
            if left <= 0 or self.closed:
                return False, None
            self._progress.wait(left)
        return True, stream.events[layer]

    def close(self) -> None:
        self.closed = True
        self._progress.notify_all()


def pending_layers(streams: list[LayerStream]) -> list[int]:
    """The layers some of these streams have not seen written (the step's end covers them)."""
    return sorted({layer for stream in streams for layer, done in enumerate(stream.written) if not done})

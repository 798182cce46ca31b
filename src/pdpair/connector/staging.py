"""Host staging of GPU KV caches, for transports that move host memory only (`tcp`: its C core reads and writes
through plain CPU pointers, so a CUDA pointer handed to it would be read from the host).

Each KV region (one per layer) gets a pinned host mirror of the same size; the transport registers the mirror.
- Sender (prefill): `to_host` copies the blocks of a pull device -> mirror, layer by layer on a side stream, each
  layer with its own event; the worker puts layer k as soon as its event completes, while the later layers' copies
  run (copy and network overlap). The mirror is not written again until the pull's flush returned.
- Receiver (decode): the signals say the bytes are in the mirror (the tcp core writes the data before the +1);
  `to_device` then copies the blocks mirror -> device and waits for that copy, so the KV is on the GPU before vLLM
  is told the load finished. This is also the ordering answer for staged transfers: the consumer reads device memory
  only after a copy that started after the signal.
Cost: pinned host memory equal to the KV cache, allocated once at registration.

Works on CPU tensors too (no pinning, no streams), which is how CI exercises it; tests/gpu/ runs it on CUDA.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch


def block_runs(block_ids: Iterable[int], chunk_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges (offset, nbytes) covering the blocks, adjacent blocks merged into one range (one copy each)."""
    runs: list[tuple[int, int]] = []
    for block in sorted(set(block_ids)):
        offset = block * chunk_bytes
        if runs and runs[-1][0] + runs[-1][1] == offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + chunk_bytes)
        else:
            runs.append((offset, chunk_bytes))
    return runs


def byte_view(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A uint8 view of `nbytes` of the tensor's storage from its first element (same device, no copy)."""
    start = tensor.storage_offset() * tensor.element_size()
    storage = tensor.untyped_storage()
    if start + nbytes > storage.nbytes():
        raise ValueError(f"{nbytes} bytes from byte {start} exceed the tensor's storage ({storage.nbytes()} bytes)")
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, start, (nbytes,), (1,))


class HostStaging:
    """Pinned host mirrors of device regions; `host_ptrs` are what the transport registers."""

    def __init__(self, tensors: Sequence[torch.Tensor], region_sizes: Sequence[int]):
        if len(tensors) != len(region_sizes):
            raise ValueError(f"{len(tensors)} tensors but {len(region_sizes)} region sizes")
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"KV caches on several devices: {sorted(str(d) for d in devices)}")
        self.device = devices.pop()
        self.cuda = self.device.type == "cuda"
        self._device_bytes = [byte_view(t, size) for t, size in zip(tensors, region_sizes)]
        self.mirrors = [torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda) for size in region_sizes]
        self.host_ptrs = [m.data_ptr() for m in self.mirrors]
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._lock = threading.Lock()  # one stream, several decode waiters

    @property
    def nbytes(self) -> int:
        return sum(m.numel() for m in self.mirrors)

    def to_host(self, runs_per_layer: Sequence[list[tuple[int, int]]]) -> list[torch.cuda.Event | None]:
        """Start device -> mirror copies; one event per layer (None when already done: CPU tensors)."""
        events: list[torch.cuda.Event | None] = []
        with self._lock:
            for layer, runs in enumerate(runs_per_layer):
                events.append(self._copy(self.mirrors[layer], self._device_bytes[layer], runs))
        return events

    def layer_to_host(self, layer: int, runs: list[tuple[int, int]]) -> torch.cuda.Event | None:
        """Layer-wise puts: start one layer's device -> mirror copy, ordered after the work already queued on the
        device's current stream (the model's write of that layer); its event (None: done, CPU tensors)."""
        with self._lock:
            return self._copy(self.mirrors[layer], self._device_bytes[layer], runs)

    def to_device(self, runs_per_layer: Sequence[list[tuple[int, int]]]) -> None:
        """Copy mirror -> device and return once the device holds the bytes."""
        with self._lock:
            last = None
            for layer, runs in enumerate(runs_per_layer):
                last = self._copy(self._device_bytes[layer], self.mirrors[layer], runs) or last
        if last is not None:
            last.synchronize()  # one stream: the last event covers every copy before it

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int]]) -> torch.cuda.Event | None:
        if self._stream is None:
            for offset, nbytes in runs:
                dst[offset : offset + nbytes].copy_(src[offset : offset + nbytes])
            return None
        # The side stream must not start before work already queued on the device's current stream (the KV writes
        # of the step that produced these blocks).
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for offset, nbytes in runs:
                dst[offset : offset + nbytes].copy_(src[offset : offset + nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    @staticmethod
    def wait(event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()

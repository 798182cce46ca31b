"""How the `flagcx` transport calls into libflagcx, below its semantics: on the worker's CUDA device (NCCL under
FlagCX binds a communicator to the calling thread's current device, and a fresh thread's is device 0:
`DeviceBinding` makes the worker's device current in each thread before a call and flushes GPUDirect RDMA writes
after a completed wait), C calls that take no timeout run in a helper thread under the caller's deadline
(`call_with_deadline`), and host-side waits poll with a growing sleep that never passes the deadline (`Backoff`).
Separate from flagcx.py, which keeps the transport's semantics (pair setup, regions, puts, waits)."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any

from pdpair.connector.transports.base import TransportError, seconds_left


# --- the worker's CUDA device ------------------------------------------------------------------------------------


def _torch_set_device(index: int) -> None:
    import torch  # only on a GPU worker; the binding itself never needs torch

    torch.cuda.set_device(index)


# CUDA driver API (libcuda.so.1 ships with the driver, whatever the runtime version): cuFlushGPUDirectRDMAWrites.
CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX = 0
CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER = 100
_libcuda: Any = None


def _driver_flush_rdma_writes() -> None:
    """Make RDMA writes into the current device that happened before this call visible to that device's kernels.
    A no-op on platforms whose GPUDirect RDMA writes are already ordered (the driver knows)."""
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuFlushGPUDirectRDMAWrites.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.cuFlushGPUDirectRDMAWrites.restype = ctypes.c_int
        _libcuda = lib
    code = _libcuda.cuFlushGPUDirectRDMAWrites(
        CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX, CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER
    )
    if code != 0:
        raise TransportError(f"cuFlushGPUDirectRDMAWrites failed: CUresult {code}")


class DeviceBinding:
    """The CUDA device every libflagcx call must run on, made current in the calling thread before the call.

    NCCL (under FlagCX) binds a communicator to the calling thread's current device; a thread the binding starts
    begins on device 0, so without this every worker not on GPU 0 (every TP rank > 0) fails with "Duplicate GPU".
    index None: nothing is set (CPU-only process, or a library without devices)."""

    def __init__(
        self,
        index: int | None = None,
        setter: Callable[[int], None] | None = None,
        flusher: Callable[[], None] | None = None,
    ):
        if index is not None and (not isinstance(index, int) or isinstance(index, bool) or index < 0):
            raise ValueError(f"CUDA device index must be an int >= 0, got {index!r}")
        self.index = index
        self._setter = setter or _torch_set_device
        self._flusher = flusher or _driver_flush_rdma_writes

    def apply(self) -> None:
        """Make the device current in this thread (cheap when it already is)."""
        if self.index is not None:
            self._setter(self.index)

    def flush_rdma_writes(self) -> None:
        """After a signal was seen in HOST memory, before the GPU data it announces is used: the NIC's writes into
        GPU memory and its atomic into host memory take different PCIe paths, so seeing the counter does not by
        itself order the data for the GPU (NCCL flushes for the same reason)."""
        if self.index is not None:
            self.apply()
            self._flusher()


# --- blocking calls with a deadline ------------------------------------------------------------------------------


def call_with_deadline(
    what: str, deadline: float, fn: Callable[[], int], device: DeviceBinding | None = None
) -> int:
    """Run a C call that has no timeout of its own in a helper thread, on `device`; TransportError if it overruns
    `deadline`. ctypes releases the GIL during the call. An overrunning call keeps its thread (it cannot be cancelled)."""
    result: list[int] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            if device is not None:
                device.apply()
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            error.append(exc)

    worker = threading.Thread(target=run, name=f"flagcx-{what}", daemon=True)
    worker.start()
    worker.join(seconds_left(deadline))
    if worker.is_alive():
        raise TransportError(f"{what} did not return by its deadline; the communicator is unusable")
    if error:
        raise error[0]
    return result[0]


class Backoff:
    """Sleep that grows from `first` to `cap` seconds, never past the deadline."""

    def __init__(self, deadline: float, first: float = 20e-6, cap: float = 2e-3):
        self.deadline = deadline
        self.delay = first
        self.cap = cap

    def sleep(self) -> bool:
        """Sleep once; False once the deadline has passed."""
        left = seconds_left(self.deadline)
        if left <= 0:
            return False
        time.sleep(min(self.delay, left))
        self.delay = min(self.delay * 2, self.cap)
        return True

"""Host staging of KV caches (pdpair.connector.staging) through the real tcp transport. CI has no GPU, so the tensors
here are CPU tensors (same copies, no pinning or streams); tests/gpu/run_gpu_checks.py runs the CUDA path by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pdpair.connector.staging import HostStaging, block_runs, byte_view
from pdpair.connector.transports.base import deadline_in
from pdpair.connector.transports.tcp import TcpTransport

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from transport_suite import SETUP_SECONDS, connect_pair  # noqa: E402,F401


def test_block_runs_merge_adjacent_blocks_and_drop_repeats():
    assert block_runs([5, 1, 2, 2, 7, 6], 100) == [(100, 200), (500, 300)]
    assert block_runs([], 64) == []


def test_byte_view_is_the_tensors_storage_and_checks_bounds():
    t = torch.arange(16, dtype=torch.int32).reshape(4, 4)[1:]  # storage offset 4 elements = 16 bytes
    view = byte_view(t, 48)
    assert bytes(view[:4].tolist()) == (4).to_bytes(4, "little")
    view[:4] = 0  # writes land in the tensor itself
    assert int(t[0, 0]) == 0
    with pytest.raises(ValueError, match="exceed the tensor's storage"):
        byte_view(t, 49)


def _kv(layers: int, blocks: int, fill: bool) -> list[torch.Tensor]:
    shape = (blocks, 2, 16, 8)  # block dimension first, as the connector requires
    if fill:
        return [torch.randn(shape, dtype=torch.float16) for _ in range(layers)]
    return [torch.zeros(shape, dtype=torch.float16) for _ in range(layers)]


def test_staged_blocks_arrive_in_the_receivers_tensors():
    layers, blocks = 3, 8
    src, dst = _kv(layers, blocks, True), _kv(layers, blocks, False)
    chunk = src[0][0].numel() * src[0].element_size()
    send = HostStaging(src, [chunk * blocks] * layers)
    recv = HostStaging(dst, [chunk * blocks] * layers)
    t0, t1 = TcpTransport(), TcpTransport()
    uid = t0.create_unique_id()
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        f0 = pool.submit(t0.init_pair, uid, 0, deadline_in(SETUP_SECONDS))
        f1 = pool.submit(t1.init_pair, uid, 1, deadline_in(SETUP_SECONDS))
        sender, receiver = f0.result(), f1.result()
    try:
        src_idx = [sender.register_region(p, chunk * blocks) for p in send.host_ptrs]
        dst_idx = [receiver.register_region(p, chunk * blocks) for p in recv.host_ptrs]
        sender.set_peer_region_table(receiver.local_region_table())
        receiver.set_peer_region_table(sender.local_region_table())
        src_blocks, dst_blocks = [1, 2, 6], [4, 5, 0]
        copies = send.to_host([block_runs(src_blocks, chunk)] * layers)
        for layer in range(layers):
            HostStaging.wait(copies[layer])
            for s, d in zip(src_blocks, dst_blocks):
                sender.put_signal(src_idx[layer], s * chunk, dst_idx[layer], d * chunk, chunk, signal_slot=2)
        receiver.wait_signal(2, layers * len(src_blocks), deadline_in(30))
        assert all(bool((t == 0).all()) for t in dst)  # nothing on the "device" before the copy back
        recv.to_device([block_runs(dst_blocks, chunk)] * layers)
        for layer in range(layers):
            for s, d in zip(src_blocks, dst_blocks):
                assert torch.equal(dst[layer][d], src[layer][s])
            untouched = [b for b in range(blocks) if b not in dst_blocks]
            assert bool((dst[layer][untouched] == 0).all())
    finally:
        sender.close()
        receiver.close()


def test_tcp_declares_host_memory_only():
    assert TcpTransport.supports_device_memory is False


def test_staging_refuses_mixed_devices_and_mismatched_sizes():
    with pytest.raises(ValueError, match="region sizes"):
        HostStaging([torch.zeros(4)], [])


def test_worker_regions_register_the_host_mirrors_when_staging():
    """KvRegions (worker.py) hands the transport the mirrors' addresses, not the KV tensors', when staging."""
    from pdpair.connector.worker import KvRegions

    kv = {f"layer.{i}": t for i, t in enumerate(_kv(2, 4, True))}
    direct = KvRegions.from_kv_caches(kv, 4)
    staged = KvRegions.from_kv_caches(kv, 4, stage_on_host=True)
    assert direct.staging is None and staged.staging is not None
    registered: list[tuple[int, int]] = []

    class Recorder:
        def register_region(self, ptr: int, size: int) -> int:
            registered.append((ptr, size))
            return len(registered) - 1

    assert staged.register(Recorder()) == [0, 1]
    assert [p for p, _ in registered] == staged.staging.host_ptrs
    assert not set(staged.staging.host_ptrs) & set(direct.ptrs)
    assert staged.runs([3, 1, 2]) == [[(direct.chunk_bytes[0], 3 * direct.chunk_bytes[0])]] * 2

"""The flagcx transport's ctypes layer against the test-only fake libflagcx (tests/flagcx_abi/, built on the native
TCP core). Real FlagCX needs CUDA+NCCL+InfiniBand and cannot run here; the fake exports the same C symbols."""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))

from transport_suite import TRANSFER_SECONDS, TransportSuite, connect_pair, fill_random  # noqa: E402

from pdpair.connector.transports import make_transport  # noqa: E402
from pdpair.connector.transports.base import (  # noqa: E402
    RANK_DECODE,
    RANK_PREFILL,
    SignalWaitTimeout,
    TransportError,
    deadline_in,
)
from pdpair.connector.transports.flagcx import FlagcxTransport  # noqa: E402
from pdpair.connector.transports.flagcx_abi import (  # noqa: E402
    ENV_FLAGCX_PATH,
    ENV_LIB_PATH,
    GENERATION_MR_INDEX,
    GENERATION_WINDOW,
    RESULT_NAMES,
    FlagcxError,
    FlagcxLibraryError,
    result_name,
)

FAKE_DIR = REPO / "tests" / "flagcx_abi"
FAKE_ENV_KNOBS = (
    "FAKE_FLAGCX_REQUIRE_DEVICE",
    "FAKE_FLAGCX_ASYNC_ERROR",
    "FAKE_FLAGCX_NO_RDMA",
    "FAKE_FLAGCX_VERSION",
    "FAKE_FLAGCX_REQUEST_POOL",
    "FAKE_FLAGCX_POOL_FULL",
    "FAKE_FLAGCX_FAIL_PUT_WITH",
    "FAKE_FLAGCX_TIMEOUT_MS",
    "FAKE_FLAGCX_HOMOGENEOUS",
)


@pytest.fixture(scope="session")
def fake_libs() -> dict[str, str]:
    """Build the fake libflagcx variants (make -C tests/flagcx_abi); a build failure fails the tests."""
    proc = subprocess.run(["make", "-C", str(FAKE_DIR)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"make -C {FAKE_DIR} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    variants = ("default", "uid-ptr", "window-api", "no-put-signal")
    libs = {v: str(FAKE_DIR / "build" / v / "libflagcx.so") for v in variants}
    for path in libs.values():
        assert os.path.isfile(path), f"make did not produce {path}"
    return libs


@pytest.fixture(autouse=True)
def flagcx_env(fake_libs, monkeypatch):
    """Point the binding at the default fake and clear the fake's knobs."""
    monkeypatch.setenv(ENV_LIB_PATH, fake_libs["default"])
    monkeypatch.delenv(ENV_FLAGCX_PATH, raising=False)
    for knob in FAKE_ENV_KNOBS:
        monkeypatch.delenv(knob, raising=False)
    return fake_libs


class TestFlagcxSharedSuite(TransportSuite):
    """The transfer tests the tcp transport passes, through ctypes and the fake library."""

    def new_transport(self, slots: int) -> FlagcxTransport:
        return FlagcxTransport(slots=slots, blocking_seconds=TRANSFER_SECONDS)


def flagcx_pair(slots: int = 256, src_size: int = 4096, dst_size: int | None = None, **kwargs):
    t0 = FlagcxTransport(slots=slots, **kwargs)
    t1 = FlagcxTransport(slots=slots, **kwargs)
    return connect_pair(t0, t1, src_size, src_size if dst_size is None else dst_size)


# --- loading: library path, version, generation, symbols ---------------------------------------------------------


def test_missing_library_names_both_env_vars(monkeypatch):
    monkeypatch.delenv(ENV_LIB_PATH)
    with pytest.raises(FlagcxLibraryError) as info:
        FlagcxTransport()
    assert ENV_LIB_PATH in str(info.value) and ENV_FLAGCX_PATH in str(info.value)
    with pytest.raises(FlagcxLibraryError, match=ENV_LIB_PATH):
        make_transport("flagcx")


def test_lib_path_to_nothing_names_var_and_path(monkeypatch, tmp_path):
    missing = tmp_path / "nope" / "libflagcx.so"
    monkeypatch.setenv(ENV_LIB_PATH, str(missing))
    with pytest.raises(FlagcxLibraryError, match=rf"{ENV_LIB_PATH}=.*nope"):
        FlagcxTransport()


def test_flagcx_path_tree_is_searched(monkeypatch, tmp_path, fake_libs):
    (tmp_path / "build" / "lib").mkdir(parents=True)
    (tmp_path / "build" / "lib" / "libflagcx.so").symlink_to(fake_libs["default"])
    monkeypatch.delenv(ENV_LIB_PATH)
    monkeypatch.setenv(ENV_FLAGCX_PATH, str(tmp_path))
    assert FlagcxTransport().lib.path == os.path.realpath(fake_libs["default"])
    monkeypatch.setenv(ENV_FLAGCX_PATH, str(tmp_path / "empty"))
    with pytest.raises(FlagcxLibraryError, match=ENV_FLAGCX_PATH):
        FlagcxTransport()


def test_lib_path_may_be_a_directory(monkeypatch, fake_libs):
    monkeypatch.setenv(ENV_LIB_PATH, os.path.dirname(fake_libs["uid-ptr"]))
    assert FlagcxTransport().lib.path == os.path.realpath(fake_libs["uid-ptr"])


def test_not_a_shared_library(monkeypatch, tmp_path):
    bogus = tmp_path / "libflagcx.so"
    bogus.write_text("not an ELF file")
    monkeypatch.setenv(ENV_LIB_PATH, str(bogus))
    with pytest.raises(FlagcxLibraryError, match="cannot load"):
        FlagcxTransport()


@pytest.mark.parametrize("reported", ["20000", "9999", "10100"])
def test_version_outside_supported_range_is_refused(monkeypatch, reported):
    monkeypatch.setenv("FAKE_FLAGCX_VERSION", reported)
    with pytest.raises(FlagcxLibraryError) as info:
        FlagcxTransport()
    message = str(info.value)
    assert f"reports {reported}" in message and "supports 10000..10099" in message


def test_version_in_range_loads(monkeypatch):
    monkeypatch.setenv("FAKE_FLAGCX_VERSION", "10003")
    assert FlagcxTransport().lib.version == 10003


def test_missing_symbol_is_named(monkeypatch, fake_libs):
    monkeypatch.setenv(ENV_LIB_PATH, fake_libs["no-put-signal"])
    with pytest.raises(FlagcxLibraryError) as info:
        FlagcxTransport()
    assert "flagcxPutSignal" in str(info.value)
    assert "flagcxReadCounter" not in str(info.value)


def test_generation_is_probed(monkeypatch, fake_libs):
    assert FlagcxTransport().generation == GENERATION_MR_INDEX
    monkeypatch.setenv(ENV_LIB_PATH, fake_libs["window-api"])
    assert FlagcxTransport().generation == GENERATION_WINDOW


def test_library_allocated_unique_id_variant_transfers(monkeypatch, fake_libs):
    monkeypatch.setenv(ENV_LIB_PATH, fake_libs["uid-ptr"])
    transport = FlagcxTransport()
    assert transport.lib.caller_allocated_uid is False
    pair = flagcx_pair(src_size=1 << 16)
    try:
        data = fill_random(pair.src)
        pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, len(data), signal_slot=0)
        pair.receiver.wait_signal(0, 1, deadline_in(TRANSFER_SECONDS))
        assert bytes(pair.dst) == data
    finally:
        pair.close()


# --- error codes -------------------------------------------------------------------------------------------------


def test_result_names_cover_every_code():
    assert [RESULT_NAMES[c] for c in range(10)] == [
        "flagcxSuccess",
        "flagcxUnhandledDeviceError",
        "flagcxSystemError",
        "flagcxInternalError",
        "flagcxInvalidArgument",
        "flagcxInvalidUsage",
        "flagcxRemoteError",
        "flagcxInProgress",
        "flagcxUnhandledCCLError",
        "flagcxNotSupported",
    ]
    assert result_name(42) == "unknown flagcxResult_t 42"


@pytest.mark.parametrize("code", [1, 2, 4, 5, 6, 8, 9])
def test_put_error_code_becomes_named_exception(monkeypatch, code):
    monkeypatch.setenv("FAKE_FLAGCX_FAIL_PUT_WITH", str(code))
    pair = flagcx_pair()
    try:
        with pytest.raises(FlagcxError) as info:
            pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, 8, signal_slot=0)
        assert info.value.code == code
        assert info.value.result_name == RESULT_NAMES[code]
        assert RESULT_NAMES[code] in str(info.value) and "flagcxPutSignal" in str(info.value)
        assert "FAKE_FLAGCX_FAIL_PUT_WITH" in str(info.value)  # the library's last-error text is carried along
        assert pair.sender.counters().inflight == 0  # a refused post is not counted in flight
    finally:
        pair.close()


def test_internal_error_fails_fast_and_says_it_is_permanent(monkeypatch):
    """Upstream returns flagcxInternalError from PutSignal when the comm has no RMA proxy: retrying cannot help."""
    monkeypatch.setenv("FAKE_FLAGCX_FAIL_PUT_WITH", "3")
    pair = flagcx_pair(blocking_seconds=30)
    try:
        started = time.monotonic()
        with pytest.raises(FlagcxError) as info:
            pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, 8, signal_slot=0)
        assert time.monotonic() - started < 5  # not the 30 s a retry loop would take
        assert info.value.result_name == "flagcxInternalError" and "permanent" in str(info.value)
    finally:
        pair.close()


def test_garbage_unique_id_is_invalid_argument():
    transport = FlagcxTransport()
    with pytest.raises(FlagcxError) as info:
        transport.init_pair(b"\x01" * 256, RANK_DECODE, deadline_in(5))
    assert info.value.result_name == "flagcxInvalidArgument"
    # A peer's id of the wrong length is a TransportError like every other refusal of the pair (decode's side
    # channel checks it with check_unique_id before answering the Hello).
    with pytest.raises(TransportError, match="256 bytes"):
        transport.init_pair(b"short", RANK_DECODE, deadline_in(5))
    with pytest.raises(TransportError, match="256 bytes, got 257"):
        transport.check_unique_id(b"\x01" * 257)
    transport.check_unique_id(b"\x01" * 256)


# --- the upstream request-pool bug -------------------------------------------------------------------------------


def _burst(pair, puts: int, size: int = 32) -> bytes:
    data = fill_random(pair.src)
    for k in range(puts):
        pair.sender.put_signal(pair.src_region, k * size, pair.dst_region, k * size, size, signal_slot=0)
    return data


def test_slot_cap_avoids_the_request_pool_drop_bug(monkeypatch):
    """The fake drops puts silently once 8 are outstanding (upstream between PR #443 and #446); 8 slots keep us
    below that, so all 3000 puts and signals arrive."""
    monkeypatch.setenv("FAKE_FLAGCX_REQUEST_POOL", "8")
    monkeypatch.setenv("FAKE_FLAGCX_POOL_FULL", "drop")
    puts, size = 3000, 32
    pair = flagcx_pair(slots=8, src_size=puts * size)
    try:
        data = _burst(pair, puts, size)
        pair.receiver.wait_signal(0, puts, deadline_in(TRANSFER_SECONDS))
        assert bytes(pair.dst) == data
        assert pair.receiver.read_signal(0) == puts
        assert pair.sender.counters().requeues > 0
    finally:
        pair.close()


def test_without_the_cap_the_simulated_bug_loses_signals(monkeypatch):
    """Control for the test above: with more slots than the pool, the fake really drops puts and the wait fails
    at its deadline (instead of hanging)."""
    monkeypatch.setenv("FAKE_FLAGCX_REQUEST_POOL", "8")
    monkeypatch.setenv("FAKE_FLAGCX_POOL_FULL", "drop")
    puts, size = 3000, 32
    pair = flagcx_pair(slots=256, src_size=puts * size, blocking_seconds=2)
    try:
        try:
            _burst(pair, puts, size)
        except TransportError:
            pass  # once 256 dropped puts count as in flight forever, the cap itself gives up at its deadline
        with pytest.raises(SignalWaitTimeout) as info:
            pair.receiver.wait_signal(0, puts, deadline_in(1))
        assert info.value.observed < puts
    finally:
        pair.close()


def test_slot_cap_keeps_posts_below_an_erroring_pool(monkeypatch):
    """With the cap at the pool size the pool never fills, so no post errors and all 3000 puts arrive; with more
    slots than the pool the InternalError surfaces at once (no silent retry)."""
    monkeypatch.setenv("FAKE_FLAGCX_REQUEST_POOL", "8")
    monkeypatch.setenv("FAKE_FLAGCX_POOL_FULL", "error")
    puts, size = 3000, 32
    pair = flagcx_pair(slots=8, src_size=puts * size)
    try:
        data = _burst(pair, puts, size)
        pair.receiver.wait_signal(0, puts, deadline_in(TRANSFER_SECONDS))
        pair.sender.flush(deadline_in(TRANSFER_SECONDS))
        assert bytes(pair.dst) == data
    finally:
        pair.close()
    pair = flagcx_pair(slots=64, src_size=puts * size)
    try:
        with pytest.raises(FlagcxError, match="unable to allocate requests"):
            _burst(pair, puts, size)
    finally:
        pair.close()


# --- deadlines on calls that have none upstream ------------------------------------------------------------------


def test_init_pair_deadline_when_peer_never_joins(monkeypatch):
    monkeypatch.setenv("FAKE_FLAGCX_TIMEOUT_MS", "3000")  # lets the fake's helper thread end soon after
    transport = FlagcxTransport()
    uid = transport.create_unique_id()
    started = time.monotonic()
    with pytest.raises(TransportError, match="flagcxCommInitRank"):
        transport.init_pair(uid, RANK_DECODE, deadline_in(0.5))
    assert time.monotonic() - started < 3


def test_mismatched_registration_hits_deadline_and_breaks_comm(monkeypatch):
    monkeypatch.setenv("FAKE_FLAGCX_TIMEOUT_MS", "3000")
    pair = flagcx_pair(blocking_seconds=0.5)
    extra = (ctypes.c_char * 64)()
    try:
        started = time.monotonic()
        with pytest.raises(TransportError, match="same regions"):
            pair.sender.register_region(ctypes.addressof(extra), 64)  # the receiver registers nothing more
        assert time.monotonic() - started < 3
        with pytest.raises(TransportError, match="unusable"):
            pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, 8, signal_slot=0)
    finally:
        time.sleep(3)  # let the fake's bounded wait end before the comm's memory goes
        pair.close()


def test_duplicate_registration_refused():
    pair = flagcx_pair()
    try:
        with pytest.raises(ValueError, match="already registered"):
            pair.sender.register_region(ctypes.addressof(pair.src), 16)
    finally:
        pair.close()


def test_peer_table_must_be_a_flagcx_table():
    pair = flagcx_pair()
    try:
        with pytest.raises(TransportError, match="not a flagcx region table"):
            pair.sender.set_peer_region_table(b"TCPX" + bytes(20))
    finally:
        pair.close()


def test_put_before_peer_table_refused():
    t0, t1 = FlagcxTransport(), FlagcxTransport()
    pair = connect_pair(t0, t1, 64, 64)
    try:
        fresh = FlagcxTransport()
        assert fresh.slots == 256  # default: FlagCX's request pool per connection
        pair.sender._peer = None  # as right after init, before the handshake sent the table
        with pytest.raises(TransportError, match="set_peer_region_table"):
            pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, 8, signal_slot=0)
    finally:
        pair.close()


def test_the_transport_reads_no_connector_environment(monkeypatch):
    """Slots and the blocking bound come from PdPairConfig through make_transport, never from the environment
    behind the config's back (the config validates them; a second reader would disagree with it)."""
    monkeypatch.setenv("PDPAIR_TRANSPORT_SLOTS", "32")
    monkeypatch.setenv("PDPAIR_HANG_TIMEOUT_SECONDS", "7")
    transport = FlagcxTransport()
    assert (transport.slots, transport.blocking_seconds) == (256, 60.0)
    configured = make_transport("flagcx", slots=16, blocking_seconds=9.5)
    assert (configured.slots, configured.blocking_seconds) == (16, 9.5)
    with pytest.raises(ValueError, match="slots"):
        FlagcxTransport(slots=0)


def test_make_transport_passes_the_configured_slots(monkeypatch):
    """PdPairConfig.transport_slots reaches the flagcx comm (the env is set to something else to prove it)."""
    monkeypatch.setenv("PDPAIR_TRANSPORT_SLOTS", "200")
    t0, t1 = make_transport("flagcx", slots=5), make_transport("flagcx", slots=5)
    assert t0.slots == 5
    pair = connect_pair(t0, t1, 64, 64)
    try:
        assert pair.sender.counters().slots == 5
    finally:
        pair.close()


@pytest.mark.parametrize("slots", [0, 257, 4096])
def test_flagcx_slots_beyond_the_request_pool_are_refused(slots):
    with pytest.raises(ValueError, match=r"PDPAIR_TRANSPORT_SLOTS\) must be in 1..256"):
        make_transport("flagcx", slots=slots)


# --- two processes -----------------------------------------------------------------------------------------------


def test_transfer_between_two_processes(fake_libs):
    _two_process_transfer(fake_libs["default"], count=64)


def _two_process_transfer(lib_path: str, count: int) -> None:
    env = {**os.environ, ENV_LIB_PATH: lib_path}
    peer = subprocess.Popen(
        [sys.executable, str(FAKE_DIR / "peer_process.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        transport = FlagcxTransport(blocking_seconds=30)
        uid = transport.create_unique_id()
        peer.stdin.write(uid.hex() + "\n")
        peer.stdin.flush()
        comm = transport.init_pair(uid, RANK_PREFILL, deadline_in(30))
        chunk = 1 << 16
        src = (ctypes.c_char * (chunk * count))()
        data = fill_random(src)
        comm.register_region(ctypes.addressof(src), len(src))
        comm.set_peer_region_table(bytes.fromhex(peer.stdout.readline().strip()))
        peer.stdin.write(comm.local_region_table().hex() + "\n")
        peer.stdin.write(f"{count} {len(data)}\n")
        peer.stdin.flush()
        for k in range(count):
            comm.put_signal(0, k * chunk, 0, k * chunk, chunk, signal_slot=0)
        answer = peer.stdout.readline().strip()
        assert answer == hashlib.sha256(data).hexdigest()
        comm.flush(deadline_in(30))
        peer.stdin.write("done\n")
        peer.stdin.flush()
        assert peer.wait(30) == 0
        comm.close()
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()


# --- a peer that goes away ---------------------------------------------------------------------------------------


def test_wait_fails_early_when_the_peer_is_gone():
    """The host-side wait checks the comm's async error, so a dead peer fails the wait long before its deadline."""
    pair = flagcx_pair()
    try:
        pair.sender.close()
        started = time.monotonic()
        with pytest.raises(FlagcxError) as info:
            pair.receiver.wait_signal(0, 1, deadline_in(20))
        assert time.monotonic() - started < 5
        assert info.value.result_name == "flagcxRemoteError"
    finally:
        pair.close()


def test_put_to_a_closed_peer_is_a_named_error():
    pair = flagcx_pair()
    try:
        pair.receiver.close()
        deadline = deadline_in(10)
        with pytest.raises(FlagcxError) as info:
            while time.monotonic() < deadline:  # the close reaches the sender asynchronously
                pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, 8, signal_slot=0)
                time.sleep(0.01)
        assert info.value.result_name == "flagcxRemoteError"
    finally:
        pair.close()


def test_homogeneous_comm_fails_at_init_with_a_hint(monkeypatch):
    monkeypatch.setenv("FAKE_FLAGCX_HOMOGENEOUS", "1")
    with pytest.raises(FlagcxError) as info:
        flagcx_pair()
    assert info.value.call == "flagcxReadCounter" and info.value.result_name == "flagcxInvalidArgument"
    assert "FLAGCX_USE_HETERO_COMM=1" in str(info.value)


def test_counters_during_puts_are_always_within_zero_and_slots():
    """counters() (a metrics scrape, another thread) once saw inflight=-1: it read posted and completed while a put
    was between its post and its count. Hammer it during a burst through 4 slots; every sample must be 0..slots."""
    slots, puts, size = 4, 20000, 8
    pair = flagcx_pair(slots=slots, src_size=puts * size)
    samples: list[int] = []
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            samples.append(pair.sender.counters().inflight)

    scraper = threading.Thread(target=scrape, name="test-counters-scraper")
    try:
        scraper.start()
        _burst(pair, puts, size)
        pair.receiver.wait_signal(0, puts, deadline_in(TRANSFER_SECONDS))
        pair.sender.flush(deadline_in(TRANSFER_SECONDS))
    finally:
        done.set()
        scraper.join(10)
        pair.close()
    assert len(samples) > 1000, f"the scraper only ran {len(samples)} times: the test proves nothing"
    bad = sorted({value for value in samples if not 0 <= value <= slots})
    assert not bad, f"inflight outside 0..{slots}: {bad[:10]}"
    assert max(samples) > 0, "no put was ever seen in flight: the scraper did not overlap the burst"


def test_timeout_says_when_the_library_cannot_report_async_errors(monkeypatch):
    """Upstream answers flagcxCommGetAsyncError with NotSupported for hetero comms; a timeout must say that a failure
    elsewhere can only look like this timeout."""
    pair = flagcx_pair()
    try:
        with pytest.raises(SignalWaitTimeout) as info:
            pair.receiver.wait_signal(0, 1, deadline_in(0.2))
        assert "asynchronous errors" not in str(info.value)  # this library reports them
    finally:
        pair.close()
    monkeypatch.setenv("FAKE_FLAGCX_ASYNC_ERROR", "unsupported")
    pair = flagcx_pair()
    try:
        with pytest.raises(SignalWaitTimeout) as info:
            pair.receiver.wait_signal(0, 1, deadline_in(0.2))
        assert "cannot report asynchronous errors" in str(info.value) and "flagcxNotSupported" in str(info.value)
    finally:
        pair.close()


# --- the worker's CUDA device ------------------------------------------------------------------------------------


def _device_pair(device: int | None, flushes: list[str] | None = None, **kwargs):
    lib = FlagcxTransport().lib.cdll
    lib.fakeFlagcxSetDevice.argtypes = [ctypes.c_int]
    calls: list[tuple[str, int]] = []

    def setter(index: int) -> None:
        calls.append((threading.current_thread().name, index))
        lib.fakeFlagcxSetDevice(index)

    def flusher() -> None:
        (flushes if flushes is not None else []).append(threading.current_thread().name)

    t0 = FlagcxTransport(device=device, device_setter=setter, device_flusher=flusher, **kwargs)
    t1 = FlagcxTransport(device=device, device_setter=setter, device_flusher=flusher, **kwargs)
    return connect_pair(t0, t1, 4096, 4096), calls


def test_calls_run_on_the_workers_device_in_every_thread(monkeypatch):
    """FAKE_FLAGCX_REQUIRE_DEVICE=1 refuses init, registration, puts and destroy from a thread whose current device
    is not 1, as NCCL does (a new thread is on device 0). With device=1 the whole pair life works, including puts
    from a thread that is not the one that registered."""
    monkeypatch.setenv("FAKE_FLAGCX_REQUIRE_DEVICE", "1")
    pair, calls = _device_pair(1)
    try:
        data = fill_random(pair.src)
        put_errors: list[BaseException] = []

        def put() -> None:
            try:
                pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, len(data), signal_slot=0)
            except BaseException as exc:  # noqa: BLE001
                put_errors.append(exc)

        side_thread = threading.Thread(target=put, name="test-side-channel")
        side_thread.start()
        side_thread.join(30)
        assert put_errors == []
        pair.receiver.wait_signal(0, 1, deadline_in(TRANSFER_SECONDS))
        assert bytes(pair.dst) == data
    finally:
        pair.close()
    assert {index for _, index in calls} == {1}
    names = {name for name, _ in calls}
    assert any(n.startswith("flagcx-flagcxCommInitRank") for n in names)
    assert any(n.startswith("flagcx-flagcxOneSideRegister") for n in names)
    assert "test-side-channel" in names


def test_without_the_device_init_fails_like_nccl(monkeypatch):
    """Control for the test above: the binding's old behaviour (no device set in its helper thread)."""
    monkeypatch.setenv("FAKE_FLAGCX_REQUIRE_DEVICE", "1")
    with pytest.raises(FlagcxError) as info:
        _device_pair(None)
    assert info.value.result_name == "flagcxInvalidUsage" and "Duplicate GPU" in str(info.value)


def test_device_index_is_validated():
    with pytest.raises(ValueError, match="CUDA device index"):
        FlagcxTransport(device=-1)


# --- the window API generation (upstream HEAD) ---------------------------------------------------------------------


@pytest.fixture
def window_lib(monkeypatch, fake_libs):
    monkeypatch.setenv(ENV_LIB_PATH, fake_libs["window-api"])


def _two_region_window_pair(size: int = 1 << 16):
    """Two regions a side, so window k must land in the peer's window k (not always region 0)."""
    t0, t1 = FlagcxTransport(), FlagcxTransport()
    pair = connect_pair(t0, t1, size, size)
    extra_src = (ctypes.c_char * size)()
    extra_dst = (ctypes.c_char * size)()
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(pair.sender.register_region, ctypes.addressof(extra_src), size)
        b = pool.submit(pair.receiver.register_region, ctypes.addressof(extra_dst), size)
        assert (a.result(), b.result()) == (1, 1)
    pair.sender.set_peer_region_table(pair.receiver.local_region_table())
    pair.receiver.set_peer_region_table(pair.sender.local_region_table())
    return pair, extra_src, extra_dst


def test_window_generation_moves_bytes_into_the_right_window(window_lib):
    pair, extra_src, extra_dst = _two_region_window_pair()
    try:
        assert pair.sender.generation == GENERATION_WINDOW and pair.receiver.num_signal_slots == 1
        data0, data1 = fill_random(pair.src), fill_random(extra_src)
        pair.sender.put_signal(0, 1000, 1, 5000, 3000, signal_slot=0)  # region 0 -> peer window 1
        pair.sender.put_signal(1, 0, 0, 0, 4096, signal_slot=0)  # region 1 -> peer window 0
        pair.receiver.wait_signal(0, 2, deadline_in(TRANSFER_SECONDS))
        assert bytes(extra_dst)[5000:8000] == data0[1000:4000]
        assert bytes(extra_dst)[:5000] == bytes(5000)
        assert bytes(pair.dst)[:4096] == data1[:4096]
        assert pair.receiver.read_signal(0) == 2  # exactly +1 per put
        pair.sender.flush(deadline_in(TRANSFER_SECONDS))
        assert pair.sender.counters().inflight == 0
    finally:
        pair.close()


def test_window_generation_counted_waits_see_data_before_signal(window_lib):
    """One counter per direction: the k-th signal means the first k chunks are there."""
    chunk, count = 64 * 1024, 32
    pair = flagcx_pair(src_size=chunk * count)
    try:
        data = fill_random(pair.src)
        problems: list[str] = []

        def receive() -> None:
            deadline = deadline_in(TRANSFER_SECONDS)
            for k in range(count):
                pair.receiver.wait_signal(0, k + 1, deadline)
                got = ctypes.string_at(ctypes.addressof(pair.dst) + k * chunk, chunk)
                if got != data[k * chunk : (k + 1) * chunk]:
                    problems.append(f"chunk {k} incomplete at signal {k + 1}")

        receiver = threading.Thread(target=receive)
        receiver.start()
        for k in range(count):
            pair.sender.put_signal(pair.src_region, k * chunk, pair.dst_region, k * chunk, chunk, signal_slot=0)
        receiver.join(TRANSFER_SECONDS + 5)
        assert not receiver.is_alive() and problems == []
    finally:
        pair.close()


def test_window_generation_has_one_slot_and_caps_inflight(window_lib, monkeypatch):
    monkeypatch.setenv("FAKE_FLAGCX_REQUEST_POOL", "8")
    monkeypatch.setenv("FAKE_FLAGCX_POOL_FULL", "drop")
    puts, size = 2000, 32
    pair = flagcx_pair(slots=8, src_size=puts * size)
    try:
        with pytest.raises(ValueError, match="signal_slot 1 outside the peer's 1 slots"):
            pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, 8, signal_slot=1)
        with pytest.raises(ValueError, match="outside 0..0"):
            pair.receiver.read_signal(1)
        data = _burst(pair, puts, size)
        pair.receiver.wait_signal(0, puts, deadline_in(TRANSFER_SECONDS))
        assert bytes(pair.dst) == data and pair.receiver.read_signal(0) == puts
    finally:
        pair.close()


def test_window_generation_without_a_window_names_the_variable(window_lib, monkeypatch):
    """Upstream registers no window (and returns success) when the comm has no symmetric one-sided path, e.g. a
    homogeneous comm; the binding must stop there with a hint instead of putting through a NULL window. The fake
    does the same for a non-symmetric request, which is how this test gets there."""
    import pdpair.connector.transports.flagcx as flagcx_module

    monkeypatch.setattr(flagcx_module, "FLAGCX_WIN_COLL_SYMMETRIC", 0)
    with pytest.raises(FlagcxError) as info:
        flagcx_pair()
    assert info.value.result_name == "flagcxNotSupported" and "FLAGCX_USE_HETERO_COMM=1" in str(info.value)
    assert "flagcxCommWindowRegister" in str(info.value)


def test_window_generation_device_is_set_for_puts(window_lib, monkeypatch):
    monkeypatch.setenv("FAKE_FLAGCX_REQUIRE_DEVICE", "1")
    pair, calls = _device_pair(1)
    try:
        data = fill_random(pair.src)
        pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, len(data), signal_slot=0)
        pair.receiver.wait_signal(0, 1, deadline_in(TRANSFER_SECONDS))
        assert bytes(pair.dst) == data
    finally:
        pair.close()
    assert any(n.startswith("flagcx-flagcxCommWindowRegister") for n, _ in calls)


def test_window_generation_two_processes(fake_libs, window_lib):
    _two_process_transfer(fake_libs["window-api"], count=1)


def test_a_completed_wait_flushes_rdma_writes_on_a_device_comm(monkeypatch):
    """Ordering of GPU data vs a host signal: once the counter is seen, the binding flushes GPUDirect RDMA writes
    (cuFlushGPUDirectRDMAWrites on a GPU) before wait_signal returns; a timed-out wait does not."""
    flushes: list[str] = []
    pair, _ = _device_pair(0, flushes)
    try:
        with pytest.raises(SignalWaitTimeout):
            pair.receiver.wait_signal(0, 1, deadline_in(0.1))
        assert flushes == []
        pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, 8, signal_slot=0)
        pair.receiver.wait_signal(0, 1, deadline_in(TRANSFER_SECONDS))
        assert flushes == [threading.current_thread().name]
    finally:
        pair.close()
    assert FlagcxTransport().device.index is None  # a CPU process: nothing to flush, torch never imported for it


def test_closing_an_mr_index_comm_warns_about_the_upstream_teardown_leak(caplog, monkeypatch, fake_libs):
    """Real FlagCX before PR #522 keeps the one-sided state of a closed same-vendor comm; the log must say so on
    every close (and the window generation, which tears its hetero comm down, must not)."""
    pair = flagcx_pair()
    with caplog.at_level("WARNING", logger="pdpair.connector.transports.flagcx"):
        pair.close()
    leaks = [r.getMessage() for r in caplog.records if "PR #522" in r.getMessage()]
    assert len(leaks) == 2 and "re-pairs pile them up" in leaks[0]
    caplog.clear()
    monkeypatch.setenv(ENV_LIB_PATH, fake_libs["window-api"])
    pair = flagcx_pair()
    with caplog.at_level("WARNING", logger="pdpair.connector.transports.flagcx"):
        pair.close()
    assert not [r for r in caplog.records if "PR #522" in r.getMessage()]


@pytest.mark.parametrize("variant", ["default", "window-api"])
def test_without_rdma_registration_reports_not_supported(variant, monkeypatch, fake_libs):
    """What the real libraries do on our GPU machines (no RDMA HCA): the mr-index API answers NotSupported at
    registration; the window API registers a window WITHOUT a memory registration and fails only at the put with
    InvalidArgument. The binding probes the window and reports NotSupported at registration for both."""
    monkeypatch.setenv(ENV_LIB_PATH, fake_libs[variant])
    monkeypatch.setenv("FAKE_FLAGCX_NO_RDMA", "1")
    with pytest.raises(FlagcxError) as info:
        flagcx_pair()
    assert info.value.result_name == "flagcxNotSupported" and "one-sided ops need the IB RDMA net adaptor" in str(info.value)
    expected_call = "flagcxOneSideRegister" if variant == "default" else "flagcxCommWindowRegister"
    assert str(info.value).startswith(expected_call)


def test_a_comm_that_failed_with_an_error_code_is_destroyed_not_leaked(monkeypatch, caplog):
    """Only a call that never returned leaves a comm open; NotSupported at registration (our GPU machines) must not
    leak a comm per re-pair."""
    from concurrent.futures import ThreadPoolExecutor

    import pdpair.connector.transports.flagcx as flagcx_module

    monkeypatch.setenv("FAKE_FLAGCX_NO_RDMA", "1")
    t0, t1 = FlagcxTransport(), FlagcxTransport()
    uid = t0.create_unique_id()
    buffers = [(ctypes.c_char * 64)() for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        comms = [f.result() for f in [pool.submit(t0.init_pair, uid, RANK_PREFILL, deadline_in(30)),
                                      pool.submit(t1.init_pair, uid, RANK_DECODE, deadline_in(30))]]
        for comm, buf in zip(comms, buffers):
            with pytest.raises(FlagcxError, match="flagcxNotSupported"):
                comm.register_region(ctypes.addressof(buf), 64)
    destroyed: list[int] = []
    real_destroy = comms[0]._lib.fn["flagcxCommDestroy"]
    monkeypatch.setitem(comms[0]._lib.fn, "flagcxCommDestroy", lambda c: destroyed.append(c) or real_destroy(c))
    handles = [comm._comm for comm in comms]
    with caplog.at_level("WARNING", logger=flagcx_module.__name__):
        for comm in comms:
            comm.close()
    assert destroyed == handles
    assert not [r for r in caplog.records if "never returned" in r.getMessage()]


def test_the_connector_finds_libflagcx_through_its_config_not_the_process_environment(monkeypatch, fake_libs):
    """PdPairConfig is the connector's one env reader: the library the worker loads (build_transport) is the one the
    config read, whatever the process environment says by the time the transport is made."""
    from pdpair import contract
    from pdpair.connector.config import PdPairConfig
    from pdpair.connector.transports import build_transport
    from tests.side_channel_support import TEST_SIDE_CHANNEL_KEY

    pod_env = {contract.ENV_TRANSPORT: "flagcx", contract.ENV_LISTEN_PORT_BASE: "20000", contract.ENV_GENERATION: "1",
               ENV_LIB_PATH: fake_libs["uid-ptr"], contract.ENV_TRANSPORT_SLOTS: "7",
               contract.ENV_SIDE_CHANNEL_KEY: TEST_SIDE_CHANNEL_KEY}
    config = PdPairConfig.from_env("kv_consumer", {}, pod_env)
    monkeypatch.setenv(ENV_LIB_PATH, "/nonexistent/libflagcx.so")
    monkeypatch.delenv("FLAGCX_USE_HETERO_COMM", raising=False)  # build_transport sets it; restored after the test
    transport = build_transport(config)
    assert transport.lib.path == os.path.realpath(fake_libs["uid-ptr"])
    assert (transport.slots, transport.blocking_seconds) == (7, config.hang_timeout_seconds)
    assert os.environ["FLAGCX_USE_HETERO_COMM"] == "1"
    unset = PdPairConfig.from_env("kv_consumer", {}, {k: v for k, v in pod_env.items() if k != ENV_LIB_PATH})
    with pytest.raises(FlagcxLibraryError) as info:
        build_transport(unset)
    assert ENV_LIB_PATH in str(info.value) and ENV_FLAGCX_PATH in str(info.value)

"""ctypes binding of libflagcx: symbol lookup, prototypes, return codes and both one-sided API generations.

Only the C ABI lives here; `flagcx.py` builds the `flagcx` transport (PairTransport / PairComm) on top of it.

FlagCX has shipped two one-sided APIs under the same symbol names; the binding speaks both and picks one per library:
- `mr-index` (PR #443, 2026-04, up to PR #494, 2026-06): `flagcxOneSideRegister`, `flagcxOneSideSignalRegister`,
  `flagcxPutSignal(comm, peer, srcOff, dstOff, size, sigOff, srcMr, dstMr, sigValue)`. Signals address a slot (byte
  offset), so each request gets its own counter.
- `window` (PR #494 onward, upstream HEAD): `flagcxCommWindowRegister(comm, buf, size, &win, flags, allocator)`,
  `flagcxPutSignal(localbuff, count, dtype, peer, peerWin, peerWinOffset, flags, comm, stream)`. The library chooses
  the signal offset itself (the sender's rank), so a pair has ONE counter per direction: a window comm offers one
  signal slot.
In both the signal buffer is ours, in host memory (`FLAGCX_PTR_HOST`), and the receiver polls it on the host with a
deadline; the API's own `flagcxWaitSignal` waits on a device stream with no timeout, so it is never used to wait.
`flagcxGetVersion` returns 10000 (1.0.0) in both and the exported names are the same, so neither the version nor the
symbol table can tell them apart: a probe call (`flagcxWaitSignal` with a NULL comm: the old one refuses it, the
window API's `nDesc == 0` no-op accepts it) decides at load.

Library: `FLAGCX_LIB_PATH` (the .so file, or a directory holding libflagcx.so), else `FLAGCX_PATH` (a FlagCX tree:
build/lib/libflagcx.so or lib/libflagcx.so). CI loads a fake of this ABI (tests/flagcx_abi/); tests/gpu/ runs the
real one by hand.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

from pdpair.connector.transports.base import TransportError
from pdpair.contract import TRANSPORT_FLAGCX

# The logger keeps the name it had before the binding moved out of flagcx.py: log filters and readers know it.
log = logging.getLogger("pdpair.connector.transports.flagcx")

ENV_LIB_PATH = "FLAGCX_LIB_PATH"
ENV_FLAGCX_PATH = "FLAGCX_PATH"
# Read by libflagcx itself when it loads: one-sided ops on a same-vendor pair need 1 (a heterogeneous comm).
ENV_USE_HETERO_COMM = "FLAGCX_USE_HETERO_COMM"

LIBRARY_NAME = "libflagcx.so"
# flagcxGetVersion() = MAJOR*10000 + MINOR*100 + PATCH; upstream reports 1.0.0 for the whole bound generation.
SUPPORTED_VERSION_MIN = 10000
SUPPORTED_VERSION_MAX = 10099
UNIQUE_ID_BYTES = 256
FLAGCX_PTR_HOST = 0x1
SIGNAL_BYTES = 8
FLAGCX_WIN_COLL_SYMMETRIC = 0x1  # a window with the same MR index on every rank (the only kind usable one-sided)
FLAGCX_MEM_CCL = 0  # flagcxMemAllocator_t: a buffer the caller allocated (not NVSHMEM)
FLAGCX_UINT8 = 1  # flagcxDataType_t
# Window API: the receiver's signal buffer holds one counter per sender rank (a pair: 2), at offset rank * 8.
WINDOW_SIGNAL_COUNTERS = 2

GENERATION_MR_INDEX = "mr-index"
GENERATION_WINDOW = "window"

RESULT_NAMES = {
    0: "flagcxSuccess",
    1: "flagcxUnhandledDeviceError",
    2: "flagcxSystemError",
    3: "flagcxInternalError",
    4: "flagcxInvalidArgument",
    5: "flagcxInvalidUsage",
    6: "flagcxRemoteError",
    7: "flagcxInProgress",
    8: "flagcxUnhandledCCLError",
    9: "flagcxNotSupported",
}
RESULT_MEANINGS = {
    0: "success",
    1: "unhandled device (CUDA) error",
    2: "system error",
    3: "internal error",
    4: "invalid argument",
    5: "invalid usage",
    6: "remote error",
    7: "in progress",
    8: "unhandled CCL error",
    9: "not supported",
}
SUCCESS = 0
INTERNAL_ERROR = 3
INVALID_ARGUMENT = 4
NOT_SUPPORTED = 9


def result_name(code: int) -> str:
    """The flagcxResult_t name of `code` (never fails)."""
    return RESULT_NAMES.get(code, f"unknown flagcxResult_t {code}")


class FlagcxLibraryError(TransportError):
    """libflagcx could not be used: not found, wrong version or API generation, or a missing symbol."""


class FlagcxError(TransportError):
    """A libflagcx call returned a non-success flagcxResult_t."""

    def __init__(self, call: str, code: int, detail: str = ""):
        self.call = call
        self.code = code
        self.result_name = result_name(code)
        hint = ""
        if code == NOT_SUPPORTED and call.startswith(("flagcxPut", "flagcxOneSide", "flagcxCommWindowRegister")):
            hint = " (one-sided ops need the IB RDMA net adaptor: is FLAGCX_FORCE_NET_SOCKET set, or no HCA found?)"
        elif code == INVALID_ARGUMENT and call == "flagcxPutSignal (window API)":
            hint = " (a window without an RDMA memory registration gives this: is there an RDMA HCA?)"
        elif code == INTERNAL_ERROR and call.startswith("flagcxPut"):
            hint = (
                " (permanent: upstream returns it when the communicator has no RMA proxy, i.e. one-sided setup did "
                "not happen; a full request ring blocks inside the library instead)"
            )
        elif code == INVALID_ARGUMENT and call == "flagcxReadCounter":
            # Only heterogeneous comms get the RMA proxy; on a homogeneous one every one-sided call is a no-op.
            hint = " (one-sided ops need a heterogeneous communicator: set FLAGCX_USE_HETERO_COMM=1)"
        meaning = RESULT_MEANINGS.get(code, "unknown code")
        super().__init__(
            f"{call} failed: {self.result_name} ({code}, {meaning}){': ' + detail if detail else ''}{hint}"
        )


# --- loading -----------------------------------------------------------------------------------------------------


def find_library_path(environ: dict[str, str] | os._Environ[str] | None = None) -> str:
    """Where libflagcx.so is, from FLAGCX_LIB_PATH or FLAGCX_PATH; FlagcxLibraryError naming the variable if not."""
    env = os.environ if environ is None else environ
    lib_path = env.get(ENV_LIB_PATH, "")
    if lib_path:
        candidate = os.path.join(lib_path, LIBRARY_NAME) if os.path.isdir(lib_path) else lib_path
        if not os.path.isfile(candidate):
            raise FlagcxLibraryError(f"{ENV_LIB_PATH}={lib_path!r}: no such file ({candidate})")
        return candidate
    root = env.get(ENV_FLAGCX_PATH, "")
    if root:
        tried = [os.path.join(root, "build", "lib", LIBRARY_NAME), os.path.join(root, "lib", LIBRARY_NAME)]
        for candidate in tried:
            if os.path.isfile(candidate):
                return candidate
        raise FlagcxLibraryError(f"{ENV_FLAGCX_PATH}={root!r}: no {LIBRARY_NAME} at {' or '.join(tried)}")
    raise FlagcxLibraryError(
        f"libflagcx not configured: set {ENV_LIB_PATH} to libflagcx.so (or its directory) or {ENV_FLAGCX_PATH} "
        f"to a FlagCX build tree (transport {TRANSPORT_FLAGCX!r})"
    )


_c_int_p = ctypes.POINTER(ctypes.c_int)
_c_uint64_p = ctypes.POINTER(ctypes.c_uint64)
_c_void_p_p = ctypes.POINTER(ctypes.c_void_p)

# symbol -> (restype, argtypes), declared by us from the upstream headers at 6493e5f8 (mr-index) and 0c721293 (window).
_COMMON_PROTOTYPES: dict[str, tuple[Any, list[Any]]] = {
    "flagcxGetVersion": (ctypes.c_int, [_c_int_p]),
    "flagcxGetErrorString": (ctypes.c_char_p, [ctypes.c_int]),
    "flagcxGetLastError": (ctypes.c_char_p, [ctypes.c_void_p]),
    # flagcxGetUniqueId: argtypes depend on the variant, set in FlagcxLibrary.__init__
    "flagcxGetUniqueId": (ctypes.c_int, [ctypes.c_void_p]),
    "flagcxCommInitRank": (ctypes.c_int, [_c_void_p_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]),
    "flagcxCommDestroy": (ctypes.c_int, [ctypes.c_void_p]),
    "flagcxOneSideSignalRegister": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]),
    "flagcxPutSignal": (ctypes.c_int, []),  # per generation, below
    # Called only as the generation probe (NULL comm / nDesc 0): mr-index prototype; the first argument is 0 either way.
    "flagcxWaitSignal": (
        ctypes.c_int,
        [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_void_p],
    ),
    "flagcxReadCounter": (ctypes.c_int, [ctypes.c_void_p, _c_uint64_p]),
}
_GENERATION_PROTOTYPES: dict[str, dict[str, tuple[Any, list[Any]]]] = {
    GENERATION_MR_INDEX: {
        "flagcxOneSideRegister": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]),
        "flagcxPutSignal": (
            ctypes.c_int,
            [
                ctypes.c_void_p,  # comm
                ctypes.c_int,  # peer
                ctypes.c_size_t,  # srcOffset
                ctypes.c_size_t,  # dstOffset
                ctypes.c_size_t,  # size
                ctypes.c_size_t,  # signalOffset
                ctypes.c_int,  # srcMrIdx
                ctypes.c_int,  # dstMrIdx
                ctypes.c_uint64,  # signalValue
            ],
        ),
    },
    GENERATION_WINDOW: {
        # Used only as a probe after flagcxCommWindowRegister (see FlagcxPairComm._register_window).
        "flagcxOneSideRegister": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]),
        # The allocator argument came with the NVSHMEM windows; a build without it ignores the extra register.
        "flagcxCommWindowRegister": (
            ctypes.c_int,
            [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, _c_void_p_p, ctypes.c_int, ctypes.c_int],
        ),
        "flagcxCommWindowDeregister": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]),
        "flagcxPutSignal": (
            ctypes.c_int,
            [
                ctypes.c_void_p,  # localbuff (inside a registered window)
                ctypes.c_size_t,  # count
                ctypes.c_int,  # datatype
                ctypes.c_int,  # peer
                ctypes.c_void_p,  # peerWin
                ctypes.c_size_t,  # peerWinOffset
                ctypes.c_uint,  # flags
                ctypes.c_void_p,  # comm
                ctypes.c_void_p,  # stream (NULL: the proxy path, source ready at the call)
            ],
        ),
    },
}
# Present in both generations but only as a hint: upstream answers NotSupported for hetero comms.
_OPTIONAL_PROTOTYPES: dict[str, tuple[Any, list[Any]]] = {
    "flagcxCommGetAsyncError": (ctypes.c_int, [ctypes.c_void_p, _c_int_p]),
}
# Added together with the caller-allocated flagcxGetUniqueId (PR #480); before it the library allocated the id.
_CALLER_ALLOCATED_UID_MARKER = "flagcxDeviceHandleInit"


class FlagcxLibrary:
    """A loaded, checked libflagcx with its prototypes declared."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.cdll = ctypes.CDLL(path)
        except OSError as exc:
            raise FlagcxLibraryError(f"cannot load {path}: {exc}") from exc
        missing = [name for name in _COMMON_PROTOTYPES if not hasattr(self.cdll, name)]
        if missing:
            raise FlagcxLibraryError(
                f"{path} lacks symbol(s) {', '.join(missing)} of the one-sided FlagCX API; "
                f"this binding needs a FlagCX build with one-sided RDMA support (PR #443 or later)"
            )
        self.fn: dict[str, Any] = {}
        self._declare(_COMMON_PROTOTYPES)
        self._declare(_OPTIONAL_PROTOTYPES, optional=True)
        self.caller_allocated_uid = hasattr(self.cdll, _CALLER_ALLOCATED_UID_MARKER)
        self.fn["flagcxGetUniqueId"].argtypes = [ctypes.c_void_p if self.caller_allocated_uid else _c_void_p_p]
        self.version = self._check_version()
        self.generation = self._probe_generation()
        generation_symbols = _GENERATION_PROTOTYPES[self.generation]
        missing = [name for name in generation_symbols if not hasattr(self.cdll, name)]
        if missing:
            raise FlagcxLibraryError(
                f"{path} has the {self.generation} API generation (by the flagcxWaitSignal probe) but lacks "
                f"{', '.join(missing)}; unknown FlagCX build"
            )
        self._declare(generation_symbols)

    def _declare(self, prototypes: dict[str, tuple[Any, list[Any]]], optional: bool = False) -> None:
        for name, (restype, argtypes) in prototypes.items():
            if optional and not hasattr(self.cdll, name):
                continue
            func = getattr(self.cdll, name)
            func.restype = restype
            func.argtypes = argtypes
            self.fn[name] = func

    def _check_version(self) -> int:
        version = ctypes.c_int(-1)
        code = self.fn["flagcxGetVersion"](ctypes.byref(version))
        if code != SUCCESS:
            raise FlagcxLibraryError(f"{self.path}: flagcxGetVersion failed: {result_name(code)} ({code})")
        if not SUPPORTED_VERSION_MIN <= version.value <= SUPPORTED_VERSION_MAX:
            raise FlagcxLibraryError(
                f"{self.path}: flagcxGetVersion reports {version.value} ({_version_text(version.value)}); "
                f"this binding supports {SUPPORTED_VERSION_MIN}..{SUPPORTED_VERSION_MAX} "
                f"({_version_text(SUPPORTED_VERSION_MIN)} to {_version_text(SUPPORTED_VERSION_MAX)})"
            )
        return version.value

    def _probe_generation(self) -> str:
        # mr-index: flagcxWaitSignal(comm=NULL, ...) -> flagcxInvalidArgument. Window API: the same registers read as
        # flagcxWaitSignal(nDesc=0, ...) -> flagcxSuccess. Neither dereferences a pointer.
        code = self.fn["flagcxWaitSignal"](None, 0, 0, 0, None)
        if code == SUCCESS:
            return GENERATION_WINDOW
        if code == INVALID_ARGUMENT:
            return GENERATION_MR_INDEX
        raise FlagcxLibraryError(
            f"{self.path}: generation probe flagcxWaitSignal(NULL comm / nDesc 0) returned {result_name(code)} "
            f"({code}); expected flagcxInvalidArgument (mr-index API) or flagcxSuccess (window API): unknown FlagCX "
            f"API generation"
        )

    def last_error(self, comm: int | None) -> str:
        text = self.fn["flagcxGetLastError"](comm)
        return text.decode(errors="replace") if text else ""

    def check(self, call: str, code: int, comm: int | None = None) -> None:
        if code != SUCCESS:
            raise FlagcxError(call, code, self.last_error(comm))


def _version_text(version: int) -> str:
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


_libraries: dict[str, FlagcxLibrary] = {}
_libraries_lock = threading.Lock()


def load_library(path: str | None = None) -> FlagcxLibrary:
    """Load and check libflagcx (path from the environment when None). Version and generation are checked on
    every call, so a changed library is noticed; the handle is loaded once per path."""
    resolved = os.path.realpath(path or find_library_path())
    with _libraries_lock:
        lib = _libraries.get(resolved)
        if lib is None:
            lib = FlagcxLibrary(resolved)
            _libraries[resolved] = lib
            log.info("loaded %s (flagcxGetVersion %d, %s API)", resolved, lib.version, lib.generation)
        else:
            lib.version = lib._check_version()
        return lib



def _libc_free(ptr: int | None) -> None:
    if ptr:
        libc = ctypes.CDLL(None)
        libc.free.argtypes = [ctypes.c_void_p]
        libc.free.restype = None
        libc.free(ptr)

/*
 * The slice of libflagcx's C ABI that pdpair binds (src/pdpair/connector/transports/flagcx_abi.py), declared
 * here by us from reading upstream's public header; no upstream code. TEST ONLY: the fake in fake_flagcx.c
 * implements exactly these symbols so the ctypes binding can be exercised on machines without CUDA/NCCL/IB.
 *
 * Two generations under the same names: the "one-sided, MR-index" API that FlagCX shipped from PR #443 (2026-04)
 * until PR #494 (2026-06), and the NCCL-aligned window API that replaced flagcxPutSignal/flagcxWaitSignal from then on
 * (upstream HEAD 0c721293). FAKE_WINDOW_API builds the window generation.
 */
#ifndef PDPAIR_FLAGCX_ABI_H
#define PDPAIR_FLAGCX_ABI_H

#include <stddef.h>
#include <stdint.h>

#define FLAGCX_API __attribute__((visibility("default")))

typedef enum {
    flagcxSuccess = 0,
    flagcxUnhandledDeviceError = 1,
    flagcxSystemError = 2,
    flagcxInternalError = 3,
    flagcxInvalidArgument = 4,
    flagcxInvalidUsage = 5,
    flagcxRemoteError = 6,
    flagcxInProgress = 7,
    flagcxUnhandledCCLError = 8,
    flagcxNotSupported = 9,
} flagcxResult_t;

#define FLAGCX_UNIQUE_ID_BYTES 256
typedef struct {
    char internal[FLAGCX_UNIQUE_ID_BYTES];
} flagcxUniqueId;

typedef struct flagcxComm *flagcxComm_t;
typedef void *flagcxStream_t;
typedef struct flagcxWindow *flagcxWindow_t;

/* flagcxDataType_t values the window API's count is in (flagcxUint8 = 1 is what pdpair passes). */
#define FLAGCX_UINT8 1
/* Window flags; only symmetric windows take part in one-sided operations. */
#define FLAGCX_WIN_COLL_SYMMETRIC 0x01

/* Pointer kinds of flagcxOneSideSignalRegister. */
#define FLAGCX_PTR_HOST 0x1
#define FLAGCX_PTR_CUDA 0x2
#define FLAGCX_PTR_DMABUF 0x4

FLAGCX_API flagcxResult_t flagcxGetVersion(int *version);
FLAGCX_API const char *flagcxGetErrorString(flagcxResult_t result);
FLAGCX_API const char *flagcxGetLastError(flagcxComm_t comm);

#ifdef FAKE_UID_LIBRARY_ALLOCATED
/* Before PR #480 the library allocated the id (calloc) and handed back a pointer. */
FLAGCX_API flagcxResult_t flagcxGetUniqueId(flagcxUniqueId **unique_id);
#else
/* From PR #480 the caller provides the 256-byte id; that PR also added flagcxDeviceHandleInit. */
FLAGCX_API flagcxResult_t flagcxGetUniqueId(flagcxUniqueId *unique_id);
FLAGCX_API flagcxResult_t flagcxDeviceHandleInit(void **device_handle);
#endif

FLAGCX_API flagcxResult_t flagcxCommInitRank(flagcxComm_t *comm, int nranks, flagcxUniqueId *comm_id, int rank);
FLAGCX_API flagcxResult_t flagcxCommDestroy(flagcxComm_t comm);
FLAGCX_API flagcxResult_t flagcxCommGetAsyncError(flagcxComm_t comm, flagcxResult_t *async_error);

/* Collective: the k-th call on every rank forms MR index k. */
FLAGCX_API flagcxResult_t flagcxOneSideRegister(flagcxComm_t comm, void *buff, size_t size);
/* One signal buffer per comm, registered after the first data buffer; 64-bit counters at byte offsets. */
FLAGCX_API flagcxResult_t flagcxOneSideSignalRegister(flagcxComm_t comm, void *buff, size_t size, int ptr_type);

#if !defined(FAKE_OMIT_PUT_SIGNAL) && !defined(FAKE_WINDOW_API)
/* Write size bytes from local MR src_mr_idx at src_offset to the peer's MR dst_mr_idx at dst_offset, then add
 * signal_value to the 64-bit counter at signal_offset of the peer's signal buffer. */
FLAGCX_API flagcxResult_t flagcxPutSignal(flagcxComm_t comm, int peer, size_t src_offset, size_t dst_offset,
                                          size_t size, size_t signal_offset, int src_mr_idx, int dst_mr_idx,
                                          uint64_t signal_value);
#endif

#ifdef FAKE_WINDOW_API
/* Collective: the k-th window on every rank shares MR index k. Symmetric windows only (else *win = NULL). */
FLAGCX_API flagcxResult_t flagcxCommWindowRegister(flagcxComm_t comm, void *buff, size_t size, flagcxWindow_t *win,
                                                   int win_flags, int allocator);
FLAGCX_API flagcxResult_t flagcxCommWindowDeregister(flagcxComm_t comm, flagcxWindow_t win, int allocator);
/* Write count elements from localbuff (inside a registered window) to peerWin at peerWinOffset, then add 1 to the
 * counter at (sender rank * 8) of the peer's signal buffer. stream NULL: the source is ready at the call. */
FLAGCX_API flagcxResult_t flagcxPutSignal(const void *localbuff, size_t count, int datatype, int peer,
                                          flagcxWindow_t peer_win, size_t peer_win_offset, unsigned int flags,
                                          flagcxComm_t comm, flagcxStream_t stream);
typedef struct {
    uint64_t op_count;
    int peer;
} fakeWaitSignalDesc;
/* The newer generation's signature (nDesc == 0 is a no-op that succeeds). */
FLAGCX_API flagcxResult_t flagcxWaitSignal(int n_desc, const fakeWaitSignalDesc *descs, flagcxComm_t comm,
                                           flagcxStream_t stream);
#else
/* Device-stream wait (no timeout upstream). pdpair calls it only as a generation probe with comm == NULL. */
FLAGCX_API flagcxResult_t flagcxWaitSignal(flagcxComm_t comm, int peer, size_t signal_offset, uint64_t expected,
                                           flagcxStream_t stream);
#endif

/* Number of this rank's one-sided operations that completed (monotonic, all peers together). */
FLAGCX_API flagcxResult_t flagcxReadCounter(flagcxComm_t comm, uint64_t *count);

/* TEST ONLY, not upstream: the calling thread's "current CUDA device" (0 in a new thread, as in CUDA). With
 * FAKE_FLAGCX_REQUIRE_DEVICE=N every call that takes the device upstream refuses a thread whose device is not N,
 * the way NCCL refuses two ranks on one GPU. */
FLAGCX_API void fakeFlagcxSetDevice(int device);

#endif /* PDPAIR_FLAGCX_ABI_H */

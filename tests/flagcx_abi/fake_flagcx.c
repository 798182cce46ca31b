/*
 * TEST ONLY: a fake libflagcx.so that exports the C symbols pdpair's ctypes binding uses (flagcx_abi.h), built on
 * pdpair's native TCP core. FlagCX itself needs CUDA, NCCL and InfiniBand, none of which exist on our CI machines;
 * this library lets the binding's real ctypes calls move real bytes and signals between two communicators.
 * It is never shipped or loaded in production (see README.md).
 *
 * Mapping onto the native core
 *   uid            {magic, nonce, host, port} of a listener that flagcxGetUniqueId opens in this process.
 *   comm           a 2-rank pair: one pdpair context + one connection (rank 0 accepts, rank 1 connects).
 *   MR index k     the k-th flagcxOneSideRegister = native region k. Registration is collective upstream, so the
 *                  call returns only once the peer has registered its k-th buffer too.
 *   signal buffer  the user's host buffer. Signals travel as native put_signal increments (after the data, exactly
 *                  +1) and a mirror thread copies the native counters into the buffer with 64-bit atomic stores,
 *                  which is what an RDMA fetch-and-add into host memory looks like to a CPU reader.
 *   completions    flagcxReadCounter = native requests completed (minus rejected), one per put.
 *
 * Environment knobs (read at flagcxCommInitRank / flagcxGetVersion):
 *   FAKE_FLAGCX_VERSION=N        flagcxGetVersion reports N (default 10000, what upstream reports).
 *   FAKE_FLAGCX_REQUEST_POOL=N   simulate the IB adaptor's fixed request pool: a put finding N requests
 *                                outstanding fails ...
 *   FAKE_FLAGCX_POOL_FULL=error  ... with flagcxInternalError and "NET/IB : unable to allocate requests" (default),
 *                       =drop   ... or is silently dropped while returning success (upstream between PR #443 and
 *                                #446: the proxy thread freed the descriptor, losing the put and its signal).
 *   FAKE_FLAGCX_FAIL_PUT_WITH=C  every flagcxPutSignal returns code C (to test error-code mapping).
 *   FAKE_FLAGCX_DROP_FILE=PATH   while the file PATH exists, every put is silently dropped while returning success
 *                                (the same loss as POOL_FULL=drop, switched on and off by a test at any time).
 *   FAKE_FLAGCX_HOMOGENEOUS=1    behave like a homogeneous comm (FLAGCX_USE_HETERO_COMM unset): no RMA proxy, so
 *                                flagcxReadCounter answers flagcxInvalidArgument.
 *   FAKE_FLAGCX_HOST=ADDR        address put in the uid and listened on (default 127.0.0.1).
 *   FAKE_FLAGCX_TIMEOUT_MS=N     bound of the fake's own blocking calls (default 600000); upstream has none.
 *   FAKE_FLAGCX_REQUIRE_DEVICE=N calls that take the calling thread's device upstream (init, registrations, puts,
 *                                destroy) fail with flagcxInvalidUsage unless fakeFlagcxSetDevice(N) ran in that
 *                                thread (a new thread is on device 0, as in CUDA).
 *   FAKE_FLAGCX_ASYNC_ERROR=unsupported  flagcxCommGetAsyncError answers flagcxNotSupported, as upstream does for
 *                                hetero comms.
 *   FAKE_FLAGCX_NO_RDMA=1        like upstream without an RDMA HCA: flagcxOneSideRegister answers flagcxNotSupported,
 *                                and (window API) flagcxCommWindowRegister makes a window with no registration, on
 *                                which flagcxPutSignal answers flagcxInvalidArgument.
 *
 * FAKE_WINDOW_API builds the window generation: flagcxCommWindowRegister gives window k = native region k, and
 * flagcxPutSignal(localbuff, count, dtype, peer, peerWin, offset, flags, comm, stream) finds the source region by
 * address and bumps the counter at the SENDER's rank in the peer's signal buffer, as upstream does.
 */
#define _GNU_SOURCE
#include "flagcx_abi.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "pdpair/transport.h"

#define FAKE_UID_MAGIC 0x3158434746454b46ULL /* "FKEFGCX1" */
#define FAKE_VERSION_DEFAULT 10000           /* FLAGCX_VERSION(1, 0, 0): upstream's constant */
#define FAKE_MAX_SIGNAL_SLOTS 65536u
#define FAKE_MAX_REGIONS 4096u

typedef struct {
    uint64_t magic;
    uint64_t nonce;
    uint16_t port;
    char host[64];
} fake_uid_payload;
_Static_assert(sizeof(fake_uid_payload) <= FLAGCX_UNIQUE_ID_BYTES, "uid payload too big");

typedef enum { POOL_FULL_ERROR, POOL_FULL_DROP } pool_full_mode;

struct flagcxComm {
    int rank;
    pdpair_context *ctx;
    pdpair_conn *conn;
    pthread_mutex_t mu;
    char last_error[512];

    uintptr_t *region_bases; /* for upstream's "already registered" dedup */
    size_t *region_sizes;    /* window API: the source region is found by address */
    uint32_t region_count;

    _Atomic(uint64_t) *signal_buf; /* the user's buffer */
    uint32_t signal_slots;
    pthread_t mirror;
    bool mirror_started;
    atomic_bool stop;

    int64_t timeout_ms;
    uint64_t request_pool; /* 0 = unlimited */
    pool_full_mode pool_full;
    int fail_put_with;
    bool homogeneous; /* upstream gives only heterogeneous comms an RMA proxy */
    bool async_unsupported;
    bool no_rdma; /* FAKE_FLAGCX_NO_RDMA: like upstream without an RDMA HCA */
    int require_device; /* -1: any */
    uint64_t dropped; /* puts lost by the simulated pool bug */
    char *drop_file;  /* FAKE_FLAGCX_DROP_FILE: puts are dropped while it exists */
};

/* uids made by flagcxGetUniqueId in this process, waiting for rank 0's flagcxCommInitRank. */
typedef struct pending_uid {
    uint64_t nonce;
    pdpair_context *ctx;
    pdpair_listener *listener;
    struct pending_uid *next;
} pending_uid;
static pthread_mutex_t g_pending_mu = PTHREAD_MUTEX_INITIALIZER;
static pending_uid *g_pending;
static __thread char g_thread_error[512];
static __thread int g_thread_device; /* 0 in every new thread, like CUDA's current device */

#ifdef FAKE_WINDOW_API
struct flagcxWindow {
    uint32_t index;
    size_t size;
};
#endif

FLAGCX_API void fakeFlagcxSetDevice(int device) { g_thread_device = device; }

static const char *const RESULT_NAMES[] = {
    "flagcxSuccess",       "flagcxUnhandledDeviceError", "flagcxSystemError", "flagcxInternalError",
    "flagcxInvalidArgument", "flagcxInvalidUsage",       "flagcxRemoteError", "flagcxInProgress",
    "flagcxUnhandledCCLError", "flagcxNotSupported",
};

static long long env_ll(const char *name, long long fallback);
#define env_ll_early env_ll

static flagcxResult_t fail(flagcxComm_t comm, flagcxResult_t code, const char *fmt, ...) {
    char *dst = comm ? comm->last_error : g_thread_error;
    size_t cap = comm ? sizeof(comm->last_error) : sizeof(g_thread_error);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, cap, fmt, ap);
    va_end(ap);
    if (comm != NULL) snprintf(g_thread_error, sizeof(g_thread_error), "%s", comm->last_error);
    return code;
}

/* The calling thread must be on the required device (FAKE_FLAGCX_REQUIRE_DEVICE), as NCCL binds ranks to it. */
static flagcxResult_t check_device(flagcxComm_t comm, const char *call) {
    int required = comm != NULL ? comm->require_device : (int)env_ll_early("FAKE_FLAGCX_REQUIRE_DEVICE", -1);
    if (required >= 0 && g_thread_device != required)
        return fail(comm, flagcxInvalidUsage,
                    "fake flagcx: %s called from a thread on device %d; this rank's device is %d (NCCL would say: "
                    "Duplicate GPU detected)",
                    call, g_thread_device, required);
    return flagcxSuccess;
}

static flagcxResult_t from_native(pdpair_status st) {
    switch (st) {
    case PDPAIR_OK: return flagcxSuccess;
    case PDPAIR_IN_PROGRESS: return flagcxInProgress;
    case PDPAIR_INVALID_ARGUMENT: return flagcxInvalidArgument;
    case PDPAIR_CLOSED:
    case PDPAIR_EXHAUSTED: return flagcxInvalidUsage;
    case PDPAIR_PEER_CLOSED:
    case PDPAIR_REMOTE_REJECTED:
    case PDPAIR_PROTOCOL_ERROR:
    case PDPAIR_CONNECTION_REFUSED: return flagcxRemoteError;
    default: return flagcxSystemError;
    }
}

static flagcxResult_t fail_native(flagcxComm_t comm, pdpair_status st, const char *what) {
    char detail[256] = "";
    if (comm != NULL && comm->conn != NULL) pdpair_conn_last_error(comm->conn, detail, sizeof(detail));
    else if (comm != NULL && comm->ctx != NULL) pdpair_context_last_error(comm->ctx, detail, sizeof(detail));
    return fail(comm, from_native(st), "fake flagcx: %s failed: %s (%s)%s%s", what, pdpair_status_name(st),
                pdpair_strerror(st), detail[0] ? ": " : "", detail);
}

static long long env_ll(const char *name, long long fallback) {
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') return fallback;
    char *end = NULL;
    errno = 0;
    long long n = strtoll(v, &end, 10);
    if (errno != 0 || end == v || *end != '\0') return fallback;
    return n;
}

static const char *fake_host(void) {
    const char *h = getenv("FAKE_FLAGCX_HOST");
    return (h != NULL && *h != '\0') ? h : "127.0.0.1";
}

static pdpair_status make_context(uint64_t token, pdpair_context **out) {
    pdpair_context_options opts;
    pdpair_context_options_init(&opts);
    opts.request_slots = 1024; /* the native core queues beyond this; the fake's own pool knob is separate */
    opts.signal_slots = FAKE_MAX_SIGNAL_SLOTS;
    opts.max_regions = FAKE_MAX_REGIONS;
    opts.token = token;
    return pdpair_context_create(&opts, out);
}

/* ---------------------------------------------------------------------------------------------------------- */

FLAGCX_API flagcxResult_t flagcxGetVersion(int *version) {
    if (version == NULL) return fail(NULL, flagcxInvalidArgument, "flagcxGetVersion: version is NULL");
    *version = (int)env_ll("FAKE_FLAGCX_VERSION", FAKE_VERSION_DEFAULT);
    return flagcxSuccess;
}

FLAGCX_API const char *flagcxGetErrorString(flagcxResult_t result) {
    if ((int)result >= 0 && (size_t)result < sizeof(RESULT_NAMES) / sizeof(RESULT_NAMES[0]))
        return RESULT_NAMES[result];
    return "unknown flagcxResult_t";
}

FLAGCX_API const char *flagcxGetLastError(flagcxComm_t comm) {
    return comm != NULL ? comm->last_error : g_thread_error;
}

static flagcxResult_t make_uid(flagcxUniqueId *uid) {
    fake_uid_payload p;
    memset(&p, 0, sizeof(p));
    p.magic = FAKE_UID_MAGIC;
    if (getrandom(&p.nonce, sizeof(p.nonce), 0) != (ssize_t)sizeof(p.nonce))
        return fail(NULL, flagcxSystemError, "fake flagcx: getrandom failed: %s", strerror(errno));
    snprintf(p.host, sizeof(p.host), "%s", fake_host());

    pending_uid *pend = calloc(1, sizeof(*pend));
    if (pend == NULL) return fail(NULL, flagcxSystemError, "fake flagcx: out of memory");
    pend->nonce = p.nonce;
    pdpair_status st = make_context(p.nonce, &pend->ctx);
    if (st == PDPAIR_OK) st = pdpair_listen(pend->ctx, p.host, 0, &pend->listener);
    if (st != PDPAIR_OK) {
        if (pend->ctx) pdpair_context_destroy(pend->ctx);
        free(pend);
        return fail(NULL, from_native(st), "fake flagcx: bootstrap listener on %s: %s", p.host,
                    pdpair_strerror(st));
    }
    p.port = pdpair_listener_port(pend->listener);
    pthread_mutex_lock(&g_pending_mu);
    pend->next = g_pending;
    g_pending = pend;
    pthread_mutex_unlock(&g_pending_mu);

    memset(uid, 0, sizeof(*uid));
    memcpy(uid->internal, &p, sizeof(p));
    return flagcxSuccess;
}

#ifdef FAKE_UID_LIBRARY_ALLOCATED
FLAGCX_API flagcxResult_t flagcxGetUniqueId(flagcxUniqueId **unique_id) {
    if (unique_id == NULL) return fail(NULL, flagcxInvalidArgument, "flagcxGetUniqueId: unique_id is NULL");
    flagcxUniqueId *uid = calloc(1, sizeof(*uid));
    if (uid == NULL) return fail(NULL, flagcxSystemError, "fake flagcx: out of memory");
    flagcxResult_t r = make_uid(uid);
    if (r != flagcxSuccess) {
        free(uid);
        return r;
    }
    *unique_id = uid;
    return flagcxSuccess;
}
#else
FLAGCX_API flagcxResult_t flagcxGetUniqueId(flagcxUniqueId *unique_id) {
    if (unique_id == NULL) return fail(NULL, flagcxInvalidArgument, "flagcxGetUniqueId: unique_id is NULL");
    return make_uid(unique_id);
}

FLAGCX_API flagcxResult_t flagcxDeviceHandleInit(void **device_handle) {
    (void)device_handle;
    return fail(NULL, flagcxNotSupported, "fake flagcx: no devices");
}
#endif

static pending_uid *take_pending(uint64_t nonce) {
    pthread_mutex_lock(&g_pending_mu);
    pending_uid **pp = &g_pending;
    while (*pp != NULL && (*pp)->nonce != nonce) pp = &(*pp)->next;
    pending_uid *found = *pp;
    if (found != NULL) *pp = found->next;
    pthread_mutex_unlock(&g_pending_mu);
    return found;
}

static void comm_free(flagcxComm_t comm) {
    if (comm->conn) pdpair_conn_close(comm->conn);
    if (comm->ctx) pdpair_context_destroy(comm->ctx);
    pthread_mutex_destroy(&comm->mu);
    free(comm->region_bases);
    free(comm->region_sizes);
    free(comm->drop_file);
    free(comm);
}

FLAGCX_API flagcxResult_t flagcxCommInitRank(flagcxComm_t *out, int nranks, flagcxUniqueId *comm_id, int rank) {
    if (out == NULL || comm_id == NULL)
        return fail(NULL, flagcxInvalidArgument, "flagcxCommInitRank: comm or commId is NULL");
    *out = NULL;
    flagcxResult_t dev = check_device(NULL, "flagcxCommInitRank");
    if (dev != flagcxSuccess) return dev;
    if (nranks != 2) return fail(NULL, flagcxNotSupported, "fake flagcx: only pair communicators (nranks=2)");
    if (rank != 0 && rank != 1) return fail(NULL, flagcxInvalidArgument, "flagcxCommInitRank: rank %d", rank);
    fake_uid_payload p;
    memcpy(&p, comm_id->internal, sizeof(p));
    if (p.magic != FAKE_UID_MAGIC || p.host[sizeof(p.host) - 1] != '\0')
        return fail(NULL, flagcxInvalidArgument, "flagcxCommInitRank: not a unique id made by flagcxGetUniqueId");

    flagcxComm_t comm = calloc(1, sizeof(*comm));
    if (comm == NULL) return fail(NULL, flagcxSystemError, "fake flagcx: out of memory");
    pthread_mutex_init(&comm->mu, NULL);
    comm->rank = rank;
    comm->timeout_ms = env_ll("FAKE_FLAGCX_TIMEOUT_MS", 600000);
    long long pool = env_ll("FAKE_FLAGCX_REQUEST_POOL", 0);
    comm->request_pool = pool > 0 ? (uint64_t)pool : 0;
    const char *mode = getenv("FAKE_FLAGCX_POOL_FULL");
    comm->pool_full = (mode != NULL && strcmp(mode, "drop") == 0) ? POOL_FULL_DROP : POOL_FULL_ERROR;
    comm->fail_put_with = (int)env_ll("FAKE_FLAGCX_FAIL_PUT_WITH", 0);
    comm->homogeneous = env_ll("FAKE_FLAGCX_HOMOGENEOUS", 0) != 0;
    const char *async_mode = getenv("FAKE_FLAGCX_ASYNC_ERROR");
    comm->async_unsupported = async_mode != NULL && strcmp(async_mode, "unsupported") == 0;
    comm->require_device = (int)env_ll("FAKE_FLAGCX_REQUIRE_DEVICE", -1);
    comm->no_rdma = env_ll("FAKE_FLAGCX_NO_RDMA", 0) != 0;
    const char *drop_file = getenv("FAKE_FLAGCX_DROP_FILE");
    if (drop_file != NULL && drop_file[0] != '\0' && (comm->drop_file = strdup(drop_file)) == NULL) {
        comm_free(comm);
        return fail(NULL, flagcxSystemError, "fake flagcx: out of memory");
    }

    pdpair_status st;
    if (rank == 0) {
        pending_uid *pend = take_pending(p.nonce);
        if (pend == NULL) {
            comm_free(comm);
            return fail(NULL, flagcxInvalidUsage,
                        "fake flagcx: rank 0 must call flagcxCommInitRank in the process that made the unique id "
                        "(and only once per id)");
        }
        comm->ctx = pend->ctx;
        st = pdpair_accept(pend->listener, comm->timeout_ms, &comm->conn);
        pdpair_listener_close(pend->listener);
        free(pend);
        if (st != PDPAIR_OK) {
            flagcxResult_t r = fail_native(comm, st, "rank 0 waiting for rank 1 (bootstrap accept)");
            comm_free(comm); /* fail() copied the text to the thread's error, which flagcxGetLastError(NULL) reads */
            return r;
        }
    } else {
        st = make_context(p.nonce, &comm->ctx);
        if (st == PDPAIR_OK) st = pdpair_connect(comm->ctx, p.host, p.port, comm->timeout_ms, &comm->conn);
        if (st != PDPAIR_OK) {
            flagcxResult_t r = fail_native(comm, st, "rank 1 connecting to rank 0 (bootstrap connect)");
            comm_free(comm);
            return r;
        }
    }
    *out = comm;
    return flagcxSuccess;
}

static void *mirror_main(void *arg) {
    flagcxComm_t comm = arg;
    uint64_t seen = UINT64_MAX;
    unsigned idle_us = 20;
    bool rescan = true;
    struct timespec last_scan;
    clock_gettime(CLOCK_MONOTONIC, &last_scan);
    while (!atomic_load(&comm->stop)) {
        pdpair_conn_stats stats;
        if (pdpair_conn_get_stats(comm->conn, &stats, sizeof(stats)) != PDPAIR_OK) break;
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        long since_ms = (now.tv_sec - last_scan.tv_sec) * 1000 + (now.tv_nsec - last_scan.tv_nsec) / 1000000;
        bool broken = pdpair_conn_state(comm->conn) != PDPAIR_OK;
        bool changed = stats.signals_received != seen;
        /* Scan on a change, once more after it (the stat may be bumped before the slot), and every 50 ms. */
        if (changed || rescan || broken || since_ms >= 50) {
            seen = stats.signals_received;
            rescan = changed;
            last_scan = now;
            for (uint32_t slot = 0; slot < comm->signal_slots; slot++) {
                uint64_t v = 0;
                if (pdpair_conn_read_signal(comm->conn, slot, &v) != PDPAIR_OK) continue;
                if (atomic_load_explicit(&comm->signal_buf[slot], memory_order_relaxed) != v)
                    atomic_store_explicit(&comm->signal_buf[slot], v, memory_order_release);
            }
        }
        if (broken) break; /* after a last scan: nothing more can arrive */
        if (changed) {
            idle_us = 20;
        } else {
            usleep(idle_us);
            if (idle_us < 1000) idle_us *= 2;
        }
    }
    return NULL;
}

FLAGCX_API flagcxResult_t flagcxCommDestroy(flagcxComm_t comm) {
    if (comm == NULL) return fail(NULL, flagcxInvalidArgument, "flagcxCommDestroy: comm is NULL");
    flagcxResult_t dev = check_device(comm, "flagcxCommDestroy");
    if (dev != flagcxSuccess) return dev;
    atomic_store(&comm->stop, true);
    if (comm->mirror_started) pthread_join(comm->mirror, NULL);
    comm_free(comm);
    return flagcxSuccess;
}

FLAGCX_API flagcxResult_t flagcxCommGetAsyncError(flagcxComm_t comm, flagcxResult_t *async_error) {
    if (comm == NULL || async_error == NULL)
        return fail(comm, flagcxInvalidArgument, "flagcxCommGetAsyncError: NULL argument");
    if (comm->async_unsupported) return flagcxNotSupported; /* upstream, hetero comm */
    pdpair_status st = pdpair_conn_state(comm->conn);
    *async_error = from_native(st);
    if (st != PDPAIR_OK) fail_native(comm, st, "connection");
    return flagcxSuccess;
}

/* Native region k for the k-th buffer, collective like upstream's all-gather of MR keys. *index = UINT32_MAX when
 * the address was registered before (upstream: success, and no new index). */
static flagcxResult_t register_region(flagcxComm_t comm, void *buff, size_t size, const char *call, uint32_t *index) {
    *index = UINT32_MAX;
    if (comm == NULL || buff == NULL || size == 0)
        return fail(comm, flagcxInvalidArgument, "%s: NULL comm/buffer or size 0", call);
    flagcxResult_t dev = check_device(comm, call);
    if (dev != flagcxSuccess) return dev;
    pthread_mutex_lock(&comm->mu);
    for (uint32_t i = 0; i < comm->region_count; i++) {
        if (comm->region_bases[i] == (uintptr_t)buff) {
            pthread_mutex_unlock(&comm->mu);
            return flagcxSuccess;
        }
    }
    uintptr_t *bases = realloc(comm->region_bases, (comm->region_count + 1) * sizeof(*bases));
    if (bases != NULL) comm->region_bases = bases;
    size_t *sizes = realloc(comm->region_sizes, (comm->region_count + 1) * sizeof(*sizes));
    if (sizes != NULL) comm->region_sizes = sizes;
    if (bases == NULL || sizes == NULL) {
        pthread_mutex_unlock(&comm->mu);
        return fail(comm, flagcxSystemError, "fake flagcx: out of memory");
    }
    uint32_t native_index = 0;
    pdpair_status st = pdpair_context_register(comm->ctx, buff, size, &native_index);
    if (st != PDPAIR_OK) {
        pthread_mutex_unlock(&comm->mu);
        return fail_native(comm, st, "registering a buffer");
    }
    comm->region_bases[comm->region_count] = (uintptr_t)buff;
    comm->region_sizes[comm->region_count] = size;
    comm->region_count++;
    uint32_t count = comm->region_count;
    pthread_mutex_unlock(&comm->mu);
    st = pdpair_conn_wait_remote_regions(comm->conn, count, comm->timeout_ms);
    if (st != PDPAIR_OK) return fail_native(comm, st, "waiting for the peer's matching registration");
    *index = native_index;
    return flagcxSuccess;
}

FLAGCX_API flagcxResult_t flagcxOneSideRegister(flagcxComm_t comm, void *buff, size_t size) {
    if (comm != NULL && comm->no_rdma) return flagcxNotSupported; /* upstream: no iput in the net adaptor */
    uint32_t index;
    return register_region(comm, buff, size, "flagcxOneSideRegister", &index);
}

#ifdef FAKE_WINDOW_API
FLAGCX_API flagcxResult_t flagcxCommWindowRegister(flagcxComm_t comm, void *buff, size_t size, flagcxWindow_t *win,
                                                   int win_flags, int allocator) {
    (void)allocator;
    if (win == NULL || *win != NULL) return fail(comm, flagcxInvalidArgument, "flagcxCommWindowRegister: *win");
    if (comm != NULL && (comm->homogeneous || !(win_flags & FLAGCX_WIN_COLL_SYMMETRIC))) {
        *win = NULL; /* upstream: success and no window when there is no symmetric one-sided path */
        return flagcxSuccess;
    }
    uint32_t index;
    if (comm != NULL && comm->no_rdma) {
        /* Upstream without RDMA: a symmetric window is made, but without a memory registration (mrIndex -1). */
        struct flagcxWindow *w = calloc(1, sizeof(*w));
        if (w == NULL) return fail(comm, flagcxSystemError, "fake flagcx: out of memory");
        w->index = UINT32_MAX;
        w->size = size;
        *win = w;
        return flagcxSuccess;
    }
    flagcxResult_t r = register_region(comm, buff, size, "flagcxCommWindowRegister", &index);
    if (r != flagcxSuccess) return r;
    if (index == UINT32_MAX) return fail(comm, flagcxInvalidUsage, "fake flagcx: buffer already has a window");
    struct flagcxWindow *w = calloc(1, sizeof(*w));
    if (w == NULL) return fail(comm, flagcxSystemError, "fake flagcx: out of memory");
    w->index = index;
    w->size = size;
    *win = w;
    return flagcxSuccess;
}

FLAGCX_API flagcxResult_t flagcxCommWindowDeregister(flagcxComm_t comm, flagcxWindow_t win, int allocator) {
    (void)comm;
    (void)allocator;
    free(win); /* the native region stays until the comm goes, as MRs do upstream until destroy */
    return flagcxSuccess;
}
#endif

FLAGCX_API flagcxResult_t flagcxOneSideSignalRegister(flagcxComm_t comm, void *buff, size_t size, int ptr_type) {
    if (comm == NULL || buff == NULL)
        return fail(comm, flagcxInvalidArgument, "flagcxOneSideSignalRegister: NULL comm or buffer");
    flagcxResult_t dev = check_device(comm, "flagcxOneSideSignalRegister");
    if (dev != flagcxSuccess) return dev;
    if (ptr_type != FLAGCX_PTR_HOST && ptr_type != FLAGCX_PTR_CUDA && ptr_type != FLAGCX_PTR_DMABUF)
        return fail(comm, flagcxInvalidArgument, "flagcxOneSideSignalRegister: invalid ptrType %d", ptr_type);
    if (ptr_type != FLAGCX_PTR_HOST)
        return fail(comm, flagcxNotSupported, "fake flagcx: only FLAGCX_PTR_HOST signal buffers (no GPU here)");
    if (size == 0 || size % sizeof(uint64_t) != 0 || ((uintptr_t)buff % sizeof(uint64_t)) != 0 ||
        size / sizeof(uint64_t) > FAKE_MAX_SIGNAL_SLOTS)
        return fail(comm, flagcxInvalidArgument,
                    "flagcxOneSideSignalRegister: buffer must be 8-byte aligned, size a multiple of 8, at most "
                    "%u counters",
                    FAKE_MAX_SIGNAL_SLOTS);
    pthread_mutex_lock(&comm->mu);
    if (comm->region_count == 0) {
        pthread_mutex_unlock(&comm->mu);
        /* Upstream reuses the connections the first data registration built. */
        return fail(comm, flagcxNotSupported,
                    "flagcxOneSideSignalRegister: register a data buffer first (no full-mesh connections yet)");
    }
    if (comm->signal_buf != NULL) { /* upstream: one per comm, later calls are no-ops */
        pthread_mutex_unlock(&comm->mu);
        return flagcxSuccess;
    }
    comm->signal_buf = (_Atomic(uint64_t) *)buff;
    comm->signal_slots = (uint32_t)(size / sizeof(uint64_t));
    int rc = pthread_create(&comm->mirror, NULL, mirror_main, comm);
    comm->mirror_started = rc == 0;
    pthread_mutex_unlock(&comm->mu);
    if (rc != 0) return fail(comm, flagcxSystemError, "fake flagcx: pthread_create: %s", strerror(rc));
    return flagcxSuccess;
}

#if !defined(FAKE_OMIT_PUT_SIGNAL) || defined(FAKE_WINDOW_API)
/* The data, then exactly +1 on the peer's counter `slot`, with the simulated request pool in between. */
static flagcxResult_t post_put_signal(flagcxComm_t comm, uint32_t src_idx, size_t src_offset, uint32_t dst_idx,
                                      size_t dst_offset, size_t size, uint32_t slot) {
    if (comm->signal_buf == NULL)
        return fail(comm, flagcxInvalidUsage, "flagcxPutSignal: flagcxOneSideSignalRegister was not called");
    if (comm->drop_file != NULL && access(comm->drop_file, F_OK) == 0) {
        __atomic_add_fetch(&comm->dropped, 1, __ATOMIC_RELAXED);
        return flagcxSuccess; /* a put lost on the way: reported as posted, never sent */
    }
    if (comm->request_pool > 0) {
        pdpair_conn_stats stats;
        if (pdpair_conn_get_stats(comm->conn, &stats, sizeof(stats)) == PDPAIR_OK &&
            stats.posted - stats.completed >= comm->request_pool) {
            if (comm->pool_full == POOL_FULL_DROP) {
                __atomic_add_fetch(&comm->dropped, 1, __ATOMIC_RELAXED);
                return flagcxSuccess; /* the simulated bug: reported as posted, never sent */
            }
            return fail(comm, flagcxInternalError, "NET/IB : unable to allocate requests (fake pool of %llu)",
                        (unsigned long long)comm->request_pool);
        }
    }
    pdpair_status st;
    if (size == 0) st = pdpair_signal(comm->conn, slot, NULL); /* upstream: size 0 posts only the atomic */
    else st = pdpair_put_signal(comm->conn, src_idx, src_offset, dst_idx, dst_offset, size, slot, NULL);
    if (st != PDPAIR_OK) return fail_native(comm, st, "flagcxPutSignal");
    return flagcxSuccess;
}
#endif

#if !defined(FAKE_OMIT_PUT_SIGNAL) && !defined(FAKE_WINDOW_API)
FLAGCX_API flagcxResult_t flagcxPutSignal(flagcxComm_t comm, int peer, size_t src_offset, size_t dst_offset,
                                          size_t size, size_t signal_offset, int src_mr_idx, int dst_mr_idx,
                                          uint64_t signal_value) {
    if (comm == NULL) return fail(NULL, flagcxInvalidArgument, "flagcxPutSignal: comm is NULL");
    flagcxResult_t dev = check_device(comm, "flagcxPutSignal");
    if (dev != flagcxSuccess) return dev;
    if (comm->fail_put_with != 0)
        return fail(comm, (flagcxResult_t)comm->fail_put_with, "fake flagcx: FAKE_FLAGCX_FAIL_PUT_WITH=%d",
                    comm->fail_put_with);
    if (peer != 1 - comm->rank)
        return fail(comm, flagcxInvalidArgument, "flagcxPutSignal: peer %d out of range for rank %d of 2", peer,
                    comm->rank);
    /* Stricter than upstream on purpose: the pdpair contract is exactly +1 per put (a running total, the seed's
     * bug, would let later waits pass early), so the test ABI refuses anything else. */
    if (signal_value != 1)
        return fail(comm, flagcxInvalidArgument, "fake flagcx: signalValue %llu refused (pdpair adds exactly 1)",
                    (unsigned long long)signal_value);
    if (signal_offset % sizeof(uint64_t) != 0)
        return fail(comm, flagcxInvalidArgument, "flagcxPutSignal: signalOffset %zu is not 8-byte aligned",
                    signal_offset);
    if (src_mr_idx < 0 || dst_mr_idx < 0)
        return fail(comm, flagcxInvalidArgument, "flagcxPutSignal: negative MR index");
    return post_put_signal(comm, (uint32_t)src_mr_idx, src_offset, (uint32_t)dst_mr_idx, dst_offset, size,
                           (uint32_t)(signal_offset / sizeof(uint64_t)));
}
#endif

#ifdef FAKE_WINDOW_API
static size_t datatype_bytes(int datatype) {
    static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2}; /* flagcxDataType_t 0..9 */
    return (datatype >= 0 && datatype < 10) ? sizes[datatype] : 0;
}

FLAGCX_API flagcxResult_t flagcxPutSignal(const void *localbuff, size_t count, int datatype, int peer,
                                          flagcxWindow_t peer_win, size_t peer_win_offset, unsigned int flags,
                                          flagcxComm_t comm, flagcxStream_t stream) {
    (void)flags;
    if (comm == NULL || peer_win == NULL)
        return fail(comm, flagcxInvalidArgument, "flagcxPutSignal: comm or peerWin is NULL");
    flagcxResult_t dev = check_device(comm, "flagcxPutSignal");
    if (dev != flagcxSuccess) return dev;
    if (stream != NULL) return fail(comm, flagcxNotSupported, "fake flagcx: no device streams");
    if (comm->fail_put_with != 0)
        return fail(comm, (flagcxResult_t)comm->fail_put_with, "fake flagcx: FAKE_FLAGCX_FAIL_PUT_WITH=%d",
                    comm->fail_put_with);
    if (peer != 1 - comm->rank)
        return fail(comm, flagcxInvalidArgument, "flagcxPutSignal: peer %d out of range (nRanks=2)", peer);
    if (peer_win->index == UINT32_MAX) return flagcxInvalidArgument; /* upstream: dstMrIdx < 0, no message */
    size_t elem = datatype_bytes(datatype);
    if (elem == 0) return fail(comm, flagcxInvalidArgument, "flagcxPutSignal: datatype %d", datatype);
    size_t size = count * elem;
    /* Source: the registered region holding localbuff (upstream: VA range lookup over the MR table). */
    uint32_t src_idx = UINT32_MAX;
    size_t src_offset = 0;
    pthread_mutex_lock(&comm->mu);
    for (uint32_t i = 0; i < comm->region_count; i++) {
        uintptr_t base = comm->region_bases[i];
        if ((uintptr_t)localbuff >= base && (uintptr_t)localbuff < base + comm->region_sizes[i]) {
            src_idx = i;
            src_offset = (uintptr_t)localbuff - base;
            break;
        }
    }
    pthread_mutex_unlock(&comm->mu);
    if (src_idx == UINT32_MAX)
        return fail(comm, flagcxInvalidArgument, "flagcxPutSignal: localbuff %p not in any registered MR", localbuff);
    /* Upstream: the sender writes its own rank's slot of the receiver's signal buffer, +1. */
    return post_put_signal(comm, src_idx, src_offset, peer_win->index, peer_win_offset, size, (uint32_t)comm->rank);
}

FLAGCX_API flagcxResult_t flagcxWaitSignal(int n_desc, const fakeWaitSignalDesc *descs, flagcxComm_t comm,
                                           flagcxStream_t stream) {
    (void)descs;
    (void)stream;
    if (n_desc == 0) return flagcxSuccess;
    return fail(comm, flagcxNotSupported, "fake flagcx: no device streams");
}
#else
FLAGCX_API flagcxResult_t flagcxWaitSignal(flagcxComm_t comm, int peer, size_t signal_offset, uint64_t expected,
                                           flagcxStream_t stream) {
    (void)peer;
    (void)signal_offset;
    (void)expected;
    if (comm == NULL) return fail(NULL, flagcxInvalidArgument, "flagcxWaitSignal: comm is NULL");
    if (stream == NULL) return fail(comm, flagcxInvalidArgument, "flagcxWaitSignal: stream is NULL");
    return fail(comm, flagcxNotSupported, "fake flagcx: no device streams");
}
#endif

FLAGCX_API flagcxResult_t flagcxReadCounter(flagcxComm_t comm, uint64_t *count) {
    if (comm == NULL || count == NULL) return fail(comm, flagcxInvalidArgument, "flagcxReadCounter: NULL argument");
    if (comm->homogeneous) return flagcxInvalidArgument; /* upstream: heteroComm/rmaProxy NULL, no message */
    pdpair_conn_stats stats;
    pdpair_status st = pdpair_conn_get_stats(comm->conn, &stats, sizeof(stats));
    if (st != PDPAIR_OK) return fail_native(comm, st, "reading completions");
    *count = stats.completed - stats.rejected; /* upstream counts only successful completions */
    return flagcxSuccess;
}

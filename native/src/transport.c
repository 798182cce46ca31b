/* Context, listener and connection; the per-connection sender and receiver threads.
 *
 * Locking: ctx->mu (regions, connection list) may be taken before conn->mu, never after it.
 * Each connection has one mutex for its state; the signal counters are C11 atomics that the receiver
 * increments with release order after the payload bytes are in place, so an acquire read of a counter
 * guarantees the data is visible. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "wire.h"

#define DEFAULT_REQUEST_SLOTS 256
#define DEFAULT_SIGNAL_SLOTS 4096
#define DEFAULT_MAX_REGIONS 4096
#define MAX_TIMEOUT_MS 1000000000000LL   /* ~31 years: keeps deadline arithmetic far from overflow */
#define SEND_BATCH_FRAMES 64              /* frames per sendmsg */
#define SEND_BATCH_BYTES (4u << 20)       /* payload bytes per sendmsg, so acks are not starved */
/* Headers and small payloads are read through a staging buffer (many small frames per recv). The fill is kept
 * small so it never swallows much of a large payload, which would then cost a second copy: remainders of at
 * least RECV_DIRECT_BYTES are received straight into the destination region. */
#define RECV_BUFFER_BYTES (8u << 10)
#define RECV_DIRECT_BYTES (8u << 10)

/* --- small helpers ----------------------------------------------------------------------------------------- */
uint64_t pdpair_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t pdpair_deadline_ns(int64_t timeout_ms)
{
    if (timeout_ms < 0) timeout_ms = 0;
    if (timeout_ms > MAX_TIMEOUT_MS) timeout_ms = MAX_TIMEOUT_MS;
    return pdpair_now_ns() + (uint64_t)timeout_ms * 1000000ull;
}

int pdpair_poll_ms_left(uint64_t deadline_ns)
{
    uint64_t now = pdpair_now_ns();
    if (now >= deadline_ns) return 0;
    uint64_t ms = (deadline_ns - now + 999999ull) / 1000000ull;
    return ms > 1000000000ull ? 1000000000 : (int)ms;
}

int pdpair_cond_init_monotonic(pthread_cond_t *cv)
{
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(cv, &attr);
    pthread_condattr_destroy(&attr);
    return rc;
}

void pdpair_cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, uint64_t deadline_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(deadline_ns / 1000000000ull),
                          .tv_nsec = (long)(deadline_ns % 1000000000ull)};
    pthread_cond_timedwait(cv, mu, &ts);
}

void pdpair_format_error(char *buf, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, PDPAIR_ERRLEN, fmt, ap);
    va_end(ap);
}

size_t pdpair_copy_error(const char *src, char *buf, size_t len)
{
    size_t n = strlen(src);
    if (buf && len > 0) {
        size_t k = n < len - 1 ? n : len - 1;
        memcpy(buf, src, k);
        buf[k] = '\0';
    }
    return n;
}

/* --- structures ---------------------------------------------------------------------------------------------- */
struct region {
    uint8_t *addr;
    uint64_t size;
};

struct pdpair_context {
    pthread_mutex_t mu;
    int refs; /* the caller's + one per listener + one per connection */
    bool destroyed;
    pdpair_context_options opts;
    struct region *regions;            /* capacity opts.max_regions; entries never change once published */
    _Atomic uint32_t region_count;     /* published with release after the entry is written */
    pdpair_conn **conns;               /* live connections, told about new regions */
    size_t nconns, conns_cap;
    char err[PDPAIR_ERRLEN];
};

struct pdpair_listener {
    pdpair_context *ctx;
    int fd, wake_fd;
    uint16_t port;
    pthread_mutex_t mu;
    pthread_cond_t idle_cv;
    int users;
    bool closing;
    char err[PDPAIR_ERRLEN];
};

/* A thread blocked in wait_signal / wait / flush, on the stack of that thread, linked under conn->mu, so the
 * receiver wakes waiters only when one of them is satisfied (not once per frame). */
struct waiter {
    struct waiter *next;
    uint32_t slot;   /* wait_signal: slot and expected value */
    uint64_t target; /* wait_signal: expected value; wait/flush: request id */
};

static void waiter_add(struct waiter **list, struct waiter *w)
{
    w->next = *list;
    *list = w;
}

static void waiter_remove(struct waiter **list, struct waiter *w)
{
    for (; *list; list = &(*list)->next) {
        if (*list == w) {
            *list = w->next;
            return;
        }
    }
}

struct op {
    const uint8_t *src;
    uint64_t seq, remote_offset, length;
    uint32_t remote_region, slot;
    uint8_t flags;
};

struct pdpair_conn {
    pdpair_context *ctx;
    int fd;
    pthread_t sender, receiver;
    bool threads_started;

    pthread_mutex_t mu;
    pthread_cond_t send_cv;   /* sender: work may be available */
    pthread_cond_t done_cv;   /* completion, remote regions, state changes */
    pthread_cond_t sig_cv;    /* signal counters changed */
    pthread_cond_t idle_cv;   /* close: the last API caller left */
    int users;
    struct waiter *done_waiting, *sig_waiting;
    bool closing;
    pdpair_status state;      /* OK until the connection breaks; sticky afterwards */
    char err[PDPAIR_ERRLEN];

    uint32_t slots;
    /* requests: ids 1..next_seq posted, ..sent_seq handed to the socket, ..acked_seq completed */
    uint64_t next_seq, sent_seq, acked_seq, flushed_seq;
    struct op *queue;         /* ring of posted, unsent requests */
    size_t q_head, q_len, q_cap;
    uint64_t *rejected;       /* ids the peer refused, ascending */
    size_t n_rejected, rejected_cap;

    /* things the sender owes the peer */
    uint64_t ack_to_send, ack_sent;
    uint64_t *rejects_out;
    size_t n_rejects_out, rejects_out_cap;
    uint32_t regions_announced;

    /* peer's regions */
    uint64_t *remote_sizes;
    uint32_t n_remote, remote_cap;

    /* local signal counters */
    uint32_t signal_slots;
    _Atomic uint64_t *signals;
    uint8_t *signal_used;

    /* receiver-thread only */
    uint64_t recv_seq;

    /* fault injection (TEST ONLY) */
    uint64_t fault_drop_every, fault_signal_count;
    bool fault_skip_bounds, fault_hold_sends;

    pdpair_conn_stats stats;
};

/* --- context -------------------------------------------------------------------------------------------------- */
void pdpair_context_options_init(pdpair_context_options *opts)
{
    if (!opts) return;
    memset(opts, 0, sizeof *opts);
    opts->request_slots = DEFAULT_REQUEST_SLOTS;
    opts->signal_slots = DEFAULT_SIGNAL_SLOTS;
    opts->max_regions = DEFAULT_MAX_REGIONS;
}

pdpair_status pdpair_context_create(const pdpair_context_options *opts, pdpair_context **out)
{
    if (!out) return PDPAIR_INVALID_ARGUMENT;
    *out = NULL;
    pdpair_context_options o;
    pdpair_context_options_init(&o);
    if (opts) {
        if (opts->reserved != 0) return PDPAIR_INVALID_ARGUMENT;
        if (opts->request_slots) o.request_slots = opts->request_slots;
        if (opts->signal_slots) o.signal_slots = opts->signal_slots;
        if (opts->max_regions) o.max_regions = opts->max_regions;
        o.token = opts->token;
    }
    if (o.max_regions > WIRE_MAX_REGIONS || o.signal_slots > (1u << 24) || o.request_slots > (1u << 20))
        return PDPAIR_INVALID_ARGUMENT;
    pdpair_context *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return PDPAIR_NO_MEMORY;
    ctx->regions = calloc(o.max_regions, sizeof *ctx->regions);
    if (!ctx->regions) {
        free(ctx);
        return PDPAIR_NO_MEMORY;
    }
    pthread_mutex_init(&ctx->mu, NULL);
    ctx->opts = o;
    ctx->refs = 1;
    atomic_init(&ctx->region_count, 0);
    *out = ctx;
    return PDPAIR_OK;
}

static void context_unref(pdpair_context *ctx)
{
    pthread_mutex_lock(&ctx->mu);
    bool last = --ctx->refs == 0;
    pthread_mutex_unlock(&ctx->mu);
    if (!last) return;
    pthread_mutex_destroy(&ctx->mu);
    free(ctx->conns);
    free(ctx->regions);
    free(ctx);
}

pdpair_status pdpair_context_destroy(pdpair_context *ctx)
{
    if (!ctx) return PDPAIR_INVALID_ARGUMENT;
    pthread_mutex_lock(&ctx->mu);
    bool again = ctx->destroyed;
    ctx->destroyed = true;
    pthread_mutex_unlock(&ctx->mu);
    if (again) return PDPAIR_CLOSED;
    context_unref(ctx);
    return PDPAIR_OK;
}

size_t pdpair_context_last_error(pdpair_context *ctx, char *buf, size_t len)
{
    if (!ctx) return pdpair_copy_error("", buf, len);
    pthread_mutex_lock(&ctx->mu);
    size_t n = pdpair_copy_error(ctx->err, buf, len);
    pthread_mutex_unlock(&ctx->mu);
    return n;
}

uint32_t pdpair_context_region_count(pdpair_context *ctx)
{
    return ctx ? atomic_load_explicit(&ctx->region_count, memory_order_acquire) : 0;
}

pdpair_status pdpair_context_register(pdpair_context *ctx, void *addr, uint64_t size, uint32_t *region_out)
{
    if (!ctx) return PDPAIR_INVALID_ARGUMENT;
    pthread_mutex_lock(&ctx->mu);
    pdpair_status st = PDPAIR_OK;
    uint32_t n = atomic_load_explicit(&ctx->region_count, memory_order_relaxed);
    if (ctx->destroyed) {
        st = PDPAIR_CLOSED;
        pdpair_format_error(ctx->err, "register: the context is destroyed");
    } else if (!addr || size == 0 || (uintptr_t)addr + size < (uintptr_t)addr) {
        st = PDPAIR_INVALID_ARGUMENT;
        pdpair_format_error(ctx->err, "register: need a non-NULL address and a size > 0 (got %p, %llu)", addr,
                            (unsigned long long)size);
    } else if (n >= ctx->opts.max_regions) {
        st = PDPAIR_EXHAUSTED;
        pdpair_format_error(ctx->err, "register: the region table is full (max_regions=%u)", ctx->opts.max_regions);
    } else {
        ctx->regions[n].addr = addr;
        ctx->regions[n].size = size;
        atomic_store_explicit(&ctx->region_count, n + 1, memory_order_release);
        if (region_out) *region_out = n;
        for (size_t i = 0; i < ctx->nconns; i++) { /* their senders announce it */
            pdpair_conn *c = ctx->conns[i];
            pthread_mutex_lock(&c->mu);
            pthread_cond_signal(&c->send_cv);
            pthread_mutex_unlock(&c->mu);
        }
    }
    pthread_mutex_unlock(&ctx->mu);
    return st;
}

static bool local_range_ok(pdpair_context *ctx, uint32_t region, uint64_t offset, uint64_t nbytes,
                           const uint8_t **addr_out)
{
    uint32_t n = atomic_load_explicit(&ctx->region_count, memory_order_acquire);
    if (region >= n) return false;
    const struct region *r = &ctx->regions[region];
    if (offset > r->size || nbytes > r->size - offset) return false;
    *addr_out = r->addr + offset;
    return true;
}

/* --- connection state ----------------------------------------------------------------------------------------- */
/* First error wins; wakes everybody and unblocks the thread that may sit in send/recv. */
static void conn_break_locked(pdpair_conn *c, pdpair_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void conn_break_locked(pdpair_conn *c, pdpair_status st, const char *fmt, ...)
{
    if (c->state != PDPAIR_OK) return;
    c->state = st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    pthread_cond_broadcast(&c->send_cv);
    pthread_cond_broadcast(&c->done_cv);
    pthread_cond_broadcast(&c->sig_cv);
    if (c->fd >= 0) shutdown(c->fd, SHUT_RDWR);
}

static bool push_u64(uint64_t **arr, size_t *n, size_t *cap, uint64_t v)
{
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 16;
        uint64_t *p = realloc(*arr, nc * sizeof *p);
        if (!p) return false;
        *arr = p;
        *cap = nc;
    }
    (*arr)[(*n)++] = v;
    return true;
}

/* API entry/exit: callers are counted so close can wait for them before freeing. */
static pdpair_status conn_enter(pdpair_conn *c)
{
    pthread_mutex_lock(&c->mu);
    if (c->closing) {
        pthread_mutex_unlock(&c->mu);
        return PDPAIR_CLOSED;
    }
    c->users++;
    return PDPAIR_OK;
}

static void conn_leave(pdpair_conn *c)
{
    if (--c->users == 0 && c->closing) pthread_cond_broadcast(&c->idle_cv);
    pthread_mutex_unlock(&c->mu);
}

/* --- sender thread ------------------------------------------------------------------------------------------- */
static pdpair_status send_iov(pdpair_conn *c, struct iovec *iov, int niov, int *err)
{
    while (niov > 0) {
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
        ssize_t n = sendmsg(c->fd, &msg, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return pdpair_net_errno_status(errno);
        }
        size_t left = (size_t)n;
        while (niov > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            niov--;
        }
        if (niov > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return PDPAIR_OK;
}

static void *sender_main(void *arg)
{
    pdpair_conn *c = arg;
    uint8_t headers[SEND_BATCH_FRAMES][WIRE_FRAME_SIZE];
    struct iovec iov[2 * SEND_BATCH_FRAMES];
    pdpair_context *ctx = c->ctx;

    pthread_mutex_lock(&c->mu);
    while (c->state == PDPAIR_OK) {
        int nf = 0, niov = 0;
        uint64_t payload = 0, signals = 0;
        struct wire_frame f;
        /* rejects go before the ack that covers them */
        size_t nrej = 0;
        while (nrej < c->n_rejects_out && nf < SEND_BATCH_FRAMES) {
            f = (struct wire_frame){.type = WIRE_REJECT, .region = PDPAIR_REMOTE_REJECTED,
                                    .seq = c->rejects_out[nrej++]};
            wire_encode(headers[nf], &f);
            iov[niov++] = (struct iovec){headers[nf++], WIRE_FRAME_SIZE};
        }
        if (nrej) {
            memmove(c->rejects_out, c->rejects_out + nrej, (c->n_rejects_out - nrej) * sizeof *c->rejects_out);
            c->n_rejects_out -= nrej;
        }
        if (c->n_rejects_out == 0 && c->ack_to_send > c->ack_sent && nf < SEND_BATCH_FRAMES) {
            f = (struct wire_frame){.type = WIRE_ACK, .seq = c->ack_to_send};
            c->ack_sent = c->ack_to_send;
            wire_encode(headers[nf], &f);
            iov[niov++] = (struct iovec){headers[nf++], WIRE_FRAME_SIZE};
        }
        uint32_t nreg = atomic_load_explicit(&ctx->region_count, memory_order_acquire);
        while (c->regions_announced < nreg && nf < SEND_BATCH_FRAMES) {
            uint32_t i = c->regions_announced++;
            f = (struct wire_frame){.type = WIRE_REGION, .region = i, .length = ctx->regions[i].size};
            wire_encode(headers[nf], &f);
            iov[niov++] = (struct iovec){headers[nf++], WIRE_FRAME_SIZE};
        }
        while (c->q_len > 0 && !c->fault_hold_sends && c->sent_seq - c->acked_seq < c->slots &&
               nf < SEND_BATCH_FRAMES && payload < SEND_BATCH_BYTES) {
            struct op *o = &c->queue[c->q_head];
            c->q_head = (c->q_head + 1) % c->q_cap;
            c->q_len--;
            c->sent_seq = o->seq;
            f = (struct wire_frame){.type = WIRE_DATA, .flags = o->flags, .region = o->remote_region,
                                    .slot = o->slot, .seq = o->seq, .offset = o->remote_offset,
                                    .length = o->length};
            wire_encode(headers[nf], &f);
            iov[niov++] = (struct iovec){headers[nf++], WIRE_FRAME_SIZE};
            if (o->length) iov[niov++] = (struct iovec){(void *)o->src, o->length};
            payload += o->length;
            signals += (o->flags & WIRE_FLAG_SIGNAL) != 0;
        }
        if (nf == 0) {
            pthread_cond_wait(&c->send_cv, &c->mu);
            continue;
        }
        /* Counted when committed to the socket, so they are current before any ack of these frames. */
        c->stats.bytes_sent += payload;
        c->stats.signals_sent += signals;
        pthread_mutex_unlock(&c->mu);
        int err = 0;
        pdpair_status st = send_iov(c, iov, niov, &err);
        pthread_mutex_lock(&c->mu);
        if (st != PDPAIR_OK) {
            conn_break_locked(c, st, "send failed: %s", strerror(err));
            break;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* --- receiver thread ----------------------------------------------------------------------------------------- */
struct reader {
    pdpair_conn *c;
    uint8_t *buf;
    size_t pos, end;
    pdpair_status st;
    int err;
};

static bool recv_some(struct reader *r, void *dst, size_t len, size_t *got)
{
    for (;;) {
        ssize_t n = recv(r->c->fd, dst, len, 0);
        if (n > 0) {
            *got = (size_t)n;
            return true;
        }
        if (n < 0 && errno == EINTR) continue;
        r->err = n == 0 ? 0 : errno;
        r->st = n == 0 ? PDPAIR_PEER_CLOSED : pdpair_net_errno_status(errno);
        return false;
    }
}

/* Read exactly len bytes into dst (dst NULL = discard). Large remainders bypass the staging buffer. */
static bool read_exact(struct reader *r, uint8_t *dst, uint64_t len)
{
    while (len > 0) {
        if (r->pos < r->end) {
            size_t k = r->end - r->pos;
            if (k > len) k = (size_t)len;
            if (dst) {
                memcpy(dst, r->buf + r->pos, k);
                dst += k;
            }
            r->pos += k;
            len -= k;
            continue;
        }
        size_t got;
        if (dst && len >= RECV_DIRECT_BYTES) {
            size_t want = len > (1u << 30) ? (1u << 30) : (size_t)len;
            if (!recv_some(r, dst, want, &got)) return false;
            dst += got;
            len -= got;
        } else {
            r->pos = r->end = 0;
            if (!recv_some(r, r->buf, RECV_BUFFER_BYTES, &got)) return false;
            r->end = got;
        }
    }
    return true;
}

static void handle_data(pdpair_conn *c, struct reader *r, const struct wire_frame *f, bool *fatal)
{
    pdpair_context *ctx = c->ctx;
    if (f->seq != c->recv_seq + 1) {
        pthread_mutex_lock(&c->mu);
        conn_break_locked(c, PDPAIR_PROTOCOL_ERROR, "request id %llu out of order (expected %llu)",
                          (unsigned long long)f->seq, (unsigned long long)(c->recv_seq + 1));
        pthread_mutex_unlock(&c->mu);
        *fatal = true;
        return;
    }
    c->recv_seq = f->seq;
    bool has_signal = (f->flags & WIRE_FLAG_SIGNAL) != 0;
    bool ok = true;
    uint8_t *dst = NULL;
    if (f->flags & WIRE_FLAG_NODATA) {
        if (f->length != 0) {
            pthread_mutex_lock(&c->mu);
            conn_break_locked(c, PDPAIR_PROTOCOL_ERROR, "payload on a no-data frame");
            pthread_mutex_unlock(&c->mu);
            *fatal = true;
            return;
        }
    } else {
        /* The receiver's own bounds check: nothing is written outside a registered region. */
        uint32_t n = atomic_load_explicit(&ctx->region_count, memory_order_acquire);
        if (f->region >= n || f->offset > ctx->regions[f->region].size ||
            f->length > ctx->regions[f->region].size - f->offset)
            ok = false;
        else
            dst = ctx->regions[f->region].addr + f->offset;
    }
    if (has_signal && f->slot >= c->signal_slots) ok = false;
    if (!read_exact(r, ok ? dst : NULL, f->length)) {
        *fatal = true;
        return;
    }
    if (ok && has_signal) atomic_fetch_add_explicit(&c->signals[f->slot], 1, memory_order_release);

    pthread_mutex_lock(&c->mu);
    if (!ok && !push_u64(&c->rejects_out, &c->n_rejects_out, &c->rejects_out_cap, f->seq)) {
        conn_break_locked(c, PDPAIR_NO_MEMORY, "out of memory recording a rejected put");
        *fatal = true;
    }
    c->ack_to_send = f->seq;
    if (ok) {
        c->stats.bytes_received += f->length;
        if (has_signal) {
            c->stats.signals_received++;
            uint64_t v = atomic_load_explicit(&c->signals[f->slot], memory_order_relaxed);
            for (struct waiter *w = c->sig_waiting; w; w = w->next) {
                if (w->slot == f->slot && v >= w->target) {
                    pthread_cond_broadcast(&c->sig_cv);
                    break;
                }
            }
        }
    }
    pthread_cond_signal(&c->send_cv);
    pthread_mutex_unlock(&c->mu);
}

static void *receiver_main(void *arg)
{
    pdpair_conn *c = arg;
    struct reader r = {.c = c, .buf = malloc(RECV_BUFFER_BYTES)};
    if (!r.buf) {
        pthread_mutex_lock(&c->mu);
        conn_break_locked(c, PDPAIR_NO_MEMORY, "out of memory for the receive buffer");
        pthread_mutex_unlock(&c->mu);
        return NULL;
    }
    for (;;) {
        uint8_t h[WIRE_FRAME_SIZE];
        struct wire_frame f;
        bool fatal = false;
        if (!read_exact(&r, h, WIRE_FRAME_SIZE)) break;
        wire_decode(h, &f);
        if (f.type == WIRE_DATA) {
            handle_data(c, &r, &f, &fatal);
            if (fatal) break;
            continue;
        }
        pthread_mutex_lock(&c->mu);
        switch (f.type) {
        case WIRE_ACK:
            if (f.seq <= c->acked_seq || f.seq > c->sent_seq) {
                conn_break_locked(c, PDPAIR_PROTOCOL_ERROR, "ack %llu outside (%llu, %llu]",
                                  (unsigned long long)f.seq, (unsigned long long)c->acked_seq,
                                  (unsigned long long)c->sent_seq);
                fatal = true;
                break;
            }
            c->stats.completed += f.seq - c->acked_seq;
            c->acked_seq = f.seq;
            for (struct waiter *w = c->done_waiting; w; w = w->next) {
                if (c->acked_seq >= w->target) {
                    pthread_cond_broadcast(&c->done_cv);
                    break;
                }
            }
            if (c->q_len) pthread_cond_signal(&c->send_cv);
            break;
        case WIRE_REJECT:
            if (f.seq <= c->acked_seq || f.seq > c->sent_seq ||
                (c->n_rejected && c->rejected[c->n_rejected - 1] >= f.seq)) {
                conn_break_locked(c, PDPAIR_PROTOCOL_ERROR, "reject of request %llu is out of order",
                                  (unsigned long long)f.seq);
                fatal = true;
                break;
            }
            if (!push_u64(&c->rejected, &c->n_rejected, &c->rejected_cap, f.seq)) {
                conn_break_locked(c, PDPAIR_NO_MEMORY, "out of memory recording a rejection");
                fatal = true;
                break;
            }
            c->stats.rejected++;
            snprintf(c->err, sizeof c->err, "peer rejected request %llu (outside its regions or signal slots)",
                     (unsigned long long)f.seq);
            break;
        case WIRE_REGION:
            if (f.region != c->n_remote || c->n_remote >= WIRE_MAX_REGIONS) {
                conn_break_locked(c, PDPAIR_PROTOCOL_ERROR, "region %u announced out of order", f.region);
                fatal = true;
                break;
            }
            if (c->n_remote == c->remote_cap) {
                uint32_t nc = c->remote_cap ? c->remote_cap * 2 : 16;
                uint64_t *p = realloc(c->remote_sizes, nc * sizeof *p);
                if (!p) {
                    conn_break_locked(c, PDPAIR_NO_MEMORY, "out of memory for the peer's region table");
                    fatal = true;
                    break;
                }
                c->remote_sizes = p;
                c->remote_cap = nc;
            }
            c->remote_sizes[c->n_remote++] = f.length;
            pthread_cond_broadcast(&c->done_cv);
            break;
        default:
            conn_break_locked(c, PDPAIR_PROTOCOL_ERROR, "unknown frame type %u", f.type);
            fatal = true;
        }
        pthread_mutex_unlock(&c->mu);
        if (fatal) break;
    }
    if (r.st != PDPAIR_OK) {
        pthread_mutex_lock(&c->mu);
        if (r.st == PDPAIR_PEER_CLOSED)
            conn_break_locked(c, r.st, r.err ? "connection reset by peer" : "peer closed the connection");
        else
            conn_break_locked(c, r.st, "receive failed: %s", strerror(r.err));
        pthread_mutex_unlock(&c->mu);
    }
    free(r.buf);
    return NULL;
}

/* --- handshake and connection setup --------------------------------------------------------------------------- */
static void conn_free(pdpair_conn *c)
{
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->send_cv);
    pthread_cond_destroy(&c->done_cv);
    pthread_cond_destroy(&c->sig_cv);
    pthread_cond_destroy(&c->idle_cv);
    free(c->queue);
    free(c->rejected);
    free(c->rejects_out);
    free(c->remote_sizes);
    free((void *)c->signals);
    free(c->signal_used);
    free(c);
}

static void ctx_remove_conn(pdpair_context *ctx, pdpair_conn *c)
{
    pthread_mutex_lock(&ctx->mu);
    for (size_t i = 0; i < ctx->nconns; i++) {
        if (ctx->conns[i] == c) {
            ctx->conns[i] = ctx->conns[--ctx->nconns];
            break;
        }
    }
    pthread_mutex_unlock(&ctx->mu);
}

/* Send our hello and read the peer's within the deadline, both at once so neither side can block the other.
 * wake_fd (or -1) aborts the exchange when it becomes readable (listener shutdown). */
static pdpair_status exchange_hello(int fd, int wake_fd, const uint8_t *out, size_t out_len, uint8_t **in_out,
                                    size_t *in_len_out, uint64_t deadline_ns, char *err)
{
    size_t sent = 0, got = 0, want = WIRE_HELLO_SIZE;
    uint8_t *in = malloc(WIRE_HELLO_SIZE);
    if (!in) return PDPAIR_NO_MEMORY;
    while (sent < out_len || got < want) {
        struct pollfd p[2] = {{.fd = fd, .events = (short)((sent < out_len ? POLLOUT : 0) |
                                                           (got < want ? POLLIN : 0))},
                              {.fd = wake_fd, .events = POLLIN}};
        int n = poll(p, wake_fd >= 0 ? 2 : 1, pdpair_poll_ms_left(deadline_ns));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            pdpair_format_error(err, "handshake poll: %s", strerror(errno));
            free(in);
            return PDPAIR_SYSTEM;
        }
        if (n == 0) {
            pdpair_format_error(err, "handshake did not finish before the deadline");
            free(in);
            return PDPAIR_TIMEOUT;
        }
        if (wake_fd >= 0 && p[1].revents) {
            pdpair_format_error(err, "listener closed during the handshake");
            free(in);
            return PDPAIR_CLOSED;
        }
        if (sent < out_len && (p[0].revents & (POLLOUT | POLLERR | POLLHUP))) {
            ssize_t k = send(fd, out + sent, out_len - sent, MSG_NOSIGNAL);
            if (k < 0 && errno != EAGAIN && errno != EINTR) {
                pdpair_format_error(err, "handshake send: %s", strerror(errno));
                free(in);
                return pdpair_net_errno_status(errno);
            }
            if (k > 0) sent += (size_t)k;
        }
        if (got < want && (p[0].revents & (POLLIN | POLLERR | POLLHUP))) {
            ssize_t k = recv(fd, in + got, want - got, 0);
            if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR)) {
                int e = k == 0 ? 0 : errno;
                pdpair_format_error(err, "peer hung up during the handshake%s%s", e ? ": " : "",
                                    e ? strerror(e) : "");
                free(in);
                return k == 0 ? PDPAIR_PEER_CLOSED : pdpair_net_errno_status(e);
            }
            if (k > 0) got += (size_t)k;
            if (got == WIRE_HELLO_SIZE && want == WIRE_HELLO_SIZE) {
                if (wire_get_u32(in) != WIRE_MAGIC) {
                    pdpair_format_error(err, "the peer is not a pdpair transport (bad magic)");
                    free(in);
                    return PDPAIR_PROTOCOL_ERROR;
                }
                uint32_t nreg = wire_get_u32(in + 24);
                if (nreg > WIRE_MAX_REGIONS) {
                    pdpair_format_error(err, "the peer announced %u regions (max %u)", nreg, WIRE_MAX_REGIONS);
                    free(in);
                    return PDPAIR_PROTOCOL_ERROR;
                }
                want = WIRE_HELLO_SIZE + (size_t)nreg * 8;
                uint8_t *bigger = realloc(in, want);
                if (!bigger) {
                    free(in);
                    return PDPAIR_NO_MEMORY;
                }
                in = bigger;
            }
        }
    }
    *in_out = in;
    *in_len_out = got;
    return PDPAIR_OK;
}

/* Takes ownership of fd (closes it on failure). */
static pdpair_status conn_establish(pdpair_context *ctx, int fd, int wake_fd, uint64_t deadline_ns, char *err,
                                    pdpair_conn **out)
{
    pdpair_conn *c = calloc(1, sizeof *c);
    if (!c) {
        close(fd);
        return PDPAIR_NO_MEMORY;
    }
    c->ctx = ctx;
    c->fd = fd;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->send_cv, NULL);
    pdpair_cond_init_monotonic(&c->done_cv);
    pdpair_cond_init_monotonic(&c->sig_cv);
    pthread_cond_init(&c->idle_cv, NULL);
    c->slots = ctx->opts.request_slots;
    c->signal_slots = ctx->opts.signal_slots;
    c->stats.slots = c->slots;
    c->signals = calloc(c->signal_slots, sizeof *c->signals);
    c->signal_used = calloc(c->signal_slots, 1);
    const char *drop = getenv("PDPAIR_TEST_DROP_SIGNAL_EVERY");
    if (drop && *drop) c->fault_drop_every = strtoull(drop, NULL, 10);

    pdpair_status st = PDPAIR_OK;
    uint8_t *hello = NULL, *peer = NULL;
    size_t peer_len = 0;
    bool listed = false;
    if (!c->signals || !c->signal_used) {
        st = PDPAIR_NO_MEMORY;
        goto fail;
    }
    for (uint32_t i = 0; i < c->signal_slots; i++) atomic_init(&c->signals[i], 0);

    /* Snapshot the regions for the hello and join the context's list in one step: every region is either in
     * the hello or announced later by the sender, never both, never neither. */
    pthread_mutex_lock(&ctx->mu);
    uint32_t nreg = atomic_load_explicit(&ctx->region_count, memory_order_relaxed);
    size_t hello_len = WIRE_HELLO_SIZE + (size_t)nreg * 8;
    hello = malloc(hello_len);
    if (hello && ctx->nconns == ctx->conns_cap) {
        size_t ncap = ctx->conns_cap ? ctx->conns_cap * 2 : 8;
        pdpair_conn **p = realloc(ctx->conns, ncap * sizeof *p);
        if (p) {
            ctx->conns = p;
            ctx->conns_cap = ncap;
        }
    }
    if (!hello || ctx->nconns == ctx->conns_cap) {
        pthread_mutex_unlock(&ctx->mu);
        st = PDPAIR_NO_MEMORY;
        goto fail;
    }
    memset(hello, 0, WIRE_HELLO_SIZE);
    wire_put_u32(hello, WIRE_MAGIC);
    wire_put_u32(hello + 4, PDPAIR_PROTOCOL_VERSION);
    wire_put_u64(hello + 8, ctx->opts.token);
    wire_put_u32(hello + 16, c->signal_slots);
    wire_put_u32(hello + 20, c->slots);
    wire_put_u32(hello + 24, nreg);
    for (uint32_t i = 0; i < nreg; i++) wire_put_u64(hello + WIRE_HELLO_SIZE + 8 * i, ctx->regions[i].size);
    c->regions_announced = nreg;
    ctx->conns[ctx->nconns++] = c;
    ctx->refs++;
    listed = true;
    pthread_mutex_unlock(&ctx->mu);

    pdpair_net_tune(fd);
    st = pdpair_net_set_blocking(fd, false, err);
    if (st != PDPAIR_OK) goto fail;
    st = exchange_hello(fd, wake_fd, hello, hello_len, &peer, &peer_len, deadline_ns, err);
    if (st != PDPAIR_OK) goto fail;
    uint32_t version = wire_get_u32(peer + 4);
    uint64_t token = wire_get_u64(peer + 8);
    if (version != PDPAIR_PROTOCOL_VERSION) {
        pdpair_format_error(err, "protocol version mismatch: peer %u, here %u", version, PDPAIR_PROTOCOL_VERSION);
        st = PDPAIR_PROTOCOL_ERROR;
        goto fail;
    }
    if (token != ctx->opts.token) {
        pdpair_format_error(err, "handshake token mismatch: peer %llu, here %llu", (unsigned long long)token,
                            (unsigned long long)ctx->opts.token);
        st = PDPAIR_PROTOCOL_ERROR;
        goto fail;
    }
    c->n_remote = wire_get_u32(peer + 24);
    c->remote_cap = c->n_remote ? c->n_remote : 16;
    c->remote_sizes = malloc(c->remote_cap * sizeof *c->remote_sizes);
    if (!c->remote_sizes) {
        st = PDPAIR_NO_MEMORY;
        goto fail;
    }
    for (uint32_t i = 0; i < c->n_remote; i++) c->remote_sizes[i] = wire_get_u64(peer + WIRE_HELLO_SIZE + 8 * i);
    free(peer);
    peer = NULL;
    free(hello);
    hello = NULL;

    st = pdpair_net_set_blocking(fd, true, err);
    if (st != PDPAIR_OK) goto fail;
    if (pthread_create(&c->receiver, NULL, receiver_main, c) != 0) {
        pdpair_format_error(err, "cannot start the receiver thread");
        st = PDPAIR_SYSTEM;
        goto fail;
    }
    if (pthread_create(&c->sender, NULL, sender_main, c) != 0) {
        pthread_mutex_lock(&c->mu);
        conn_break_locked(c, PDPAIR_SYSTEM, "cannot start the sender thread");
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->receiver, NULL);
        pdpair_format_error(err, "cannot start the sender thread");
        st = PDPAIR_SYSTEM;
        goto fail;
    }
    c->threads_started = true;
    *out = c;
    return PDPAIR_OK;

fail:
    if (st == PDPAIR_NO_MEMORY && !*err) pdpair_format_error(err, "out of memory setting up the connection");
    free(hello);
    free(peer);
    if (listed) {
        ctx_remove_conn(ctx, c);
        context_unref(ctx);
    }
    close(fd);
    conn_free(c);
    return st;
}

pdpair_status pdpair_connect(pdpair_context *ctx, const char *host, uint16_t port, int64_t timeout_ms,
                             pdpair_conn **out)
{
    if (!ctx || !out) return PDPAIR_INVALID_ARGUMENT;
    *out = NULL;
    char err[PDPAIR_ERRLEN] = "";
    pdpair_status st;
    int fd = -1;
    if (timeout_ms < 0) {
        pdpair_format_error(err, "connect: timeout must be >= 0 ms (got %lld)", (long long)timeout_ms);
        st = PDPAIR_INVALID_ARGUMENT;
    } else {
        uint64_t deadline = pdpair_deadline_ns(timeout_ms);
        st = pdpair_net_connect(host, port, deadline, &fd, err);
        if (st == PDPAIR_OK) st = conn_establish(ctx, fd, -1, deadline, err, out);
    }
    if (st != PDPAIR_OK) {
        pthread_mutex_lock(&ctx->mu);
        memcpy(ctx->err, err, sizeof err);
        pthread_mutex_unlock(&ctx->mu);
    }
    return st;
}

/* --- listener ------------------------------------------------------------------------------------------------- */
pdpair_status pdpair_listen(pdpair_context *ctx, const char *host, uint16_t port, pdpair_listener **out)
{
    if (!ctx || !out) return PDPAIR_INVALID_ARGUMENT;
    *out = NULL;
    char err[PDPAIR_ERRLEN] = "";
    pdpair_listener *l = calloc(1, sizeof *l);
    if (!l) return PDPAIR_NO_MEMORY;
    l->fd = l->wake_fd = -1;
    pdpair_status st = pdpair_net_listen(host, port, &l->fd, &l->port, err);
    if (st == PDPAIR_OK) {
        l->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (l->wake_fd < 0) {
            pdpair_format_error(err, "eventfd: %s", strerror(errno));
            st = PDPAIR_SYSTEM;
        }
    }
    if (st != PDPAIR_OK) {
        if (l->fd >= 0) close(l->fd);
        free(l);
        pthread_mutex_lock(&ctx->mu);
        memcpy(ctx->err, err, sizeof err);
        pthread_mutex_unlock(&ctx->mu);
        return st;
    }
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->idle_cv, NULL);
    l->ctx = ctx;
    pthread_mutex_lock(&ctx->mu);
    ctx->refs++;
    pthread_mutex_unlock(&ctx->mu);
    *out = l;
    return PDPAIR_OK;
}

uint16_t pdpair_listener_port(pdpair_listener *l) { return l ? l->port : 0; }

size_t pdpair_listener_last_error(pdpair_listener *l, char *buf, size_t len)
{
    if (!l) return pdpair_copy_error("", buf, len);
    pthread_mutex_lock(&l->mu);
    size_t n = pdpair_copy_error(l->err, buf, len);
    pthread_mutex_unlock(&l->mu);
    return n;
}

pdpair_status pdpair_accept(pdpair_listener *l, int64_t timeout_ms, pdpair_conn **out)
{
    if (!l || !out) return PDPAIR_INVALID_ARGUMENT;
    *out = NULL;
    pthread_mutex_lock(&l->mu);
    if (l->closing) {
        pthread_mutex_unlock(&l->mu);
        return PDPAIR_CLOSED;
    }
    l->users++;
    pthread_mutex_unlock(&l->mu);

    char err[PDPAIR_ERRLEN] = "";
    pdpair_status st = PDPAIR_OK;
    if (timeout_ms < 0) {
        pdpair_format_error(err, "accept: timeout must be >= 0 ms (got %lld)", (long long)timeout_ms);
        st = PDPAIR_INVALID_ARGUMENT;
    }
    uint64_t deadline = pdpair_deadline_ns(timeout_ms < 0 ? 0 : timeout_ms);
    unsigned probes = 0;
    while (st == PDPAIR_OK) {
        int fd = accept4(l->fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd >= 0) {
            st = conn_establish(l->ctx, fd, l->wake_fd, deadline, err, out);
            if (st != PDPAIR_PEER_CLOSED) break;
            /* It hung up before finishing its hello: a TCP probe or port scan, not a peer. Keep waiting. */
            probes++;
            st = PDPAIR_OK;
            continue;
        }
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            pdpair_format_error(err, "accept: %s", strerror(errno));
            st = pdpair_net_errno_status(errno);
            break;
        }
        struct pollfd p[2] = {{.fd = l->fd, .events = POLLIN}, {.fd = l->wake_fd, .events = POLLIN}};
        int n = poll(p, 2, pdpair_poll_ms_left(deadline));
        if (n < 0 && errno != EINTR) {
            pdpair_format_error(err, "accept poll: %s", strerror(errno));
            st = PDPAIR_SYSTEM;
        } else if (n > 0 && p[1].revents) {
            pdpair_format_error(err, "listener closed");
            st = PDPAIR_CLOSED;
        } else if (n == 0) {
            pdpair_format_error(err, "no peer connected before the deadline (%u connection(s) hung up before "
                                "the handshake)", probes);
            st = PDPAIR_TIMEOUT;
        }
    }

    pthread_mutex_lock(&l->mu);
    if (st != PDPAIR_OK) memcpy(l->err, err, sizeof err);
    if (--l->users == 0 && l->closing) pthread_cond_broadcast(&l->idle_cv);
    pthread_mutex_unlock(&l->mu);
    return st;
}

pdpair_status pdpair_listener_shutdown(pdpair_listener *l)
{
    if (!l) return PDPAIR_INVALID_ARGUMENT;
    pthread_mutex_lock(&l->mu);
    if (!l->closing) {
        l->closing = true;
        uint64_t one = 1;
        ssize_t wr = write(l->wake_fd, &one, sizeof one); /* wakes accept() in other threads */
        (void)wr;
    }
    pthread_mutex_unlock(&l->mu);
    return PDPAIR_OK;
}

pdpair_status pdpair_listener_close(pdpair_listener *l)
{
    if (!l) return PDPAIR_INVALID_ARGUMENT;
    pdpair_listener_shutdown(l);
    pthread_mutex_lock(&l->mu);
    while (l->users > 0) pthread_cond_wait(&l->idle_cv, &l->mu);
    pthread_mutex_unlock(&l->mu);
    close(l->fd);
    close(l->wake_fd);
    pdpair_context *ctx = l->ctx;
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->idle_cv);
    free(l);
    context_unref(ctx);
    return PDPAIR_OK;
}

/* --- posts ---------------------------------------------------------------------------------------------------- */
static pdpair_status post(pdpair_conn *c, const struct op *proto, bool has_data, uint32_t local_region,
                          uint64_t local_offset, uint64_t *request_out)
{
    pdpair_status st = conn_enter(c);
    if (st != PDPAIR_OK) return st;
    struct op o = *proto;
    if (c->state != PDPAIR_OK) {
        st = c->state;
        goto out;
    }
    if (has_data) {
        if (!local_range_ok(c->ctx, local_region, local_offset, o.length, &o.src)) {
            snprintf(c->err, sizeof c->err, "put: local range region %u [%llu, +%llu) is not registered",
                     local_region, (unsigned long long)local_offset, (unsigned long long)o.length);
            st = PDPAIR_INVALID_ARGUMENT;
            goto out;
        }
        if (!c->fault_skip_bounds &&
            (o.remote_region >= c->n_remote || o.remote_offset > c->remote_sizes[o.remote_region] ||
             o.length > c->remote_sizes[o.remote_region] - o.remote_offset)) {
            snprintf(c->err, sizeof c->err, "put: remote range region %u [%llu, +%llu) is outside the peer's %u "
                     "known regions", o.remote_region, (unsigned long long)o.remote_offset,
                     (unsigned long long)o.length, c->n_remote);
            st = PDPAIR_INVALID_ARGUMENT;
            goto out;
        }
    }
    if ((o.flags & WIRE_FLAG_SIGNAL) && !c->fault_skip_bounds && o.slot >= c->signal_slots) {
        /* Both ends use the same context options in practice; the peer re-checks against its own count. */
        snprintf(c->err, sizeof c->err, "signal slot %u out of range (%u slots)", o.slot, c->signal_slots);
        st = PDPAIR_INVALID_ARGUMENT;
        goto out;
    }
    if ((o.flags & WIRE_FLAG_SIGNAL) && c->fault_drop_every &&
        ++c->fault_signal_count % c->fault_drop_every == 0) {
        o.flags &= (uint8_t)~WIRE_FLAG_SIGNAL; /* TEST ONLY: the data still goes, the signal does not */
        c->stats.signals_dropped_by_fault++;
    }
    if (c->q_len == c->q_cap) {
        size_t ncap = c->q_cap ? c->q_cap * 2 : 1024;
        struct op *q = malloc(ncap * sizeof *q);
        if (!q) {
            snprintf(c->err, sizeof c->err, "out of memory growing the request queue");
            st = PDPAIR_NO_MEMORY;
            goto out;
        }
        for (size_t i = 0; i < c->q_len; i++) q[i] = c->queue[(c->q_head + i) % c->q_cap];
        free(c->queue);
        c->queue = q;
        c->q_cap = ncap;
        c->q_head = 0;
    }
    /* Every slot taken (sent-not-acked plus already queued): this post waits its turn. Never dropped. */
    if ((c->sent_seq - c->acked_seq) + c->q_len >= c->slots) c->stats.requeues++;
    o.seq = ++c->next_seq;
    c->queue[(c->q_head + c->q_len) % c->q_cap] = o;
    c->q_len++;
    c->stats.posted++;
    if (request_out) *request_out = o.seq;
    pthread_cond_signal(&c->send_cv);
out:
    conn_leave(c);
    return st;
}

pdpair_status pdpair_put(pdpair_conn *c, uint32_t local_region, uint64_t local_offset, uint32_t remote_region,
                         uint64_t remote_offset, uint64_t nbytes, uint64_t *request_out)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    struct op o = {.remote_region = remote_region, .remote_offset = remote_offset, .length = nbytes};
    return post(c, &o, true, local_region, local_offset, request_out);
}

pdpair_status pdpair_put_signal(pdpair_conn *c, uint32_t local_region, uint64_t local_offset,
                                uint32_t remote_region, uint64_t remote_offset, uint64_t nbytes,
                                uint32_t remote_signal_slot, uint64_t *request_out)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    struct op o = {.remote_region = remote_region, .remote_offset = remote_offset, .length = nbytes,
                   .slot = remote_signal_slot, .flags = WIRE_FLAG_SIGNAL};
    return post(c, &o, true, local_region, local_offset, request_out);
}

pdpair_status pdpair_signal(pdpair_conn *c, uint32_t remote_signal_slot, uint64_t *request_out)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    struct op o = {.slot = remote_signal_slot, .flags = WIRE_FLAG_SIGNAL | WIRE_FLAG_NODATA};
    return post(c, &o, false, 0, 0, request_out);
}

/* --- completion ----------------------------------------------------------------------------------------------- */
static bool was_rejected(pdpair_conn *c, uint64_t lo_exclusive, uint64_t hi_inclusive)
{
    /* binary search for the first rejected id > lo_exclusive */
    size_t a = 0, b = c->n_rejected;
    while (a < b) {
        size_t m = a + (b - a) / 2;
        if (c->rejected[m] <= lo_exclusive) a = m + 1;
        else b = m;
    }
    return a < c->n_rejected && c->rejected[a] <= hi_inclusive;
}

static pdpair_status request_status_locked(pdpair_conn *c, uint64_t request)
{
    if (request == 0 || request > c->next_seq) {
        snprintf(c->err, sizeof c->err, "request %llu was never posted on this connection",
                 (unsigned long long)request);
        return PDPAIR_INVALID_ARGUMENT;
    }
    if (request <= c->acked_seq) return was_rejected(c, request - 1, request) ? PDPAIR_REMOTE_REJECTED : PDPAIR_OK;
    if (c->closing) return PDPAIR_CLOSED;
    if (c->state != PDPAIR_OK) return c->state;
    return PDPAIR_IN_PROGRESS;
}

pdpair_status pdpair_conn_test(pdpair_conn *c, uint64_t request)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    pdpair_status st = conn_enter(c);
    if (st != PDPAIR_OK) return st;
    st = request_status_locked(c, request);
    conn_leave(c);
    return st;
}

static pdpair_status wait_acked_locked(pdpair_conn *c, uint64_t request, uint64_t deadline)
{
    for (;;) {
        pdpair_status st = request_status_locked(c, request);
        if (st != PDPAIR_IN_PROGRESS) return st;
        if (pdpair_now_ns() >= deadline) return PDPAIR_TIMEOUT;
        struct waiter w = {.target = request};
        waiter_add(&c->done_waiting, &w);
        pdpair_cond_wait_until(&c->done_cv, &c->mu, deadline);
        waiter_remove(&c->done_waiting, &w);
    }
}

pdpair_status pdpair_conn_wait(pdpair_conn *c, uint64_t request, int64_t timeout_ms)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    if (timeout_ms < 0) return PDPAIR_INVALID_ARGUMENT;
    uint64_t deadline = pdpair_deadline_ns(timeout_ms);
    pdpair_status st = conn_enter(c);
    if (st != PDPAIR_OK) return st;
    st = wait_acked_locked(c, request, deadline);
    conn_leave(c);
    return st;
}

pdpair_status pdpair_conn_flush(pdpair_conn *c, int64_t timeout_ms)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    if (timeout_ms < 0) return PDPAIR_INVALID_ARGUMENT;
    uint64_t deadline = pdpair_deadline_ns(timeout_ms);
    pdpair_status st = conn_enter(c);
    if (st != PDPAIR_OK) return st;
    uint64_t target = c->next_seq;
    if (target == 0) {
        st = c->state;
    } else {
        st = wait_acked_locked(c, target, deadline);
        if (st == PDPAIR_OK || st == PDPAIR_REMOTE_REJECTED) {
            uint64_t from = c->flushed_seq;
            st = was_rejected(c, from, target) ? PDPAIR_REMOTE_REJECTED : PDPAIR_OK;
            if (target > c->flushed_seq) c->flushed_seq = target;
        }
    }
    conn_leave(c);
    return st;
}

/* --- signals -------------------------------------------------------------------------------------------------- */
uint32_t pdpair_conn_signal_slots(pdpair_conn *c) { return c ? c->signal_slots : 0; }

pdpair_status pdpair_conn_read_signal(pdpair_conn *c, uint32_t slot, uint64_t *value_out)
{
    if (!c || !value_out) return PDPAIR_INVALID_ARGUMENT;
    if (slot >= c->signal_slots) return PDPAIR_INVALID_ARGUMENT;
    *value_out = atomic_load_explicit(&c->signals[slot], memory_order_acquire);
    return PDPAIR_OK;
}

pdpair_status pdpair_conn_reset_signal(pdpair_conn *c, uint32_t slot)
{
    if (!c || slot >= c->signal_slots) return PDPAIR_INVALID_ARGUMENT;
    atomic_store_explicit(&c->signals[slot], 0, memory_order_release);
    return PDPAIR_OK;
}

pdpair_status pdpair_conn_alloc_signal(pdpair_conn *c, uint32_t *slot_out)
{
    if (!c || !slot_out) return PDPAIR_INVALID_ARGUMENT;
    pdpair_status st = conn_enter(c);
    if (st != PDPAIR_OK) return st;
    st = PDPAIR_EXHAUSTED;
    for (uint32_t i = 0; i < c->signal_slots; i++) {
        if (!c->signal_used[i]) {
            c->signal_used[i] = 1;
            atomic_store_explicit(&c->signals[i], 0, memory_order_release);
            *slot_out = i;
            st = PDPAIR_OK;
            break;
        }
    }
    if (st == PDPAIR_EXHAUSTED) snprintf(c->err, sizeof c->err, "all %u signal slots are allocated", c->signal_slots);
    conn_leave(c);
    return st;
}

pdpair_status pdpair_conn_free_signal(pdpair_conn *c, uint32_t slot)
{
    if (!c || slot >= c->signal_slots) return PDPAIR_INVALID_ARGUMENT;
    pdpair_status st = conn_enter(c);
    if (st != PDPAIR_OK) return st;
    if (!c->signal_used[slot]) {
        snprintf(c->err, sizeof c->err, "signal slot %u is not allocated", slot);
        st = PDPAIR_INVALID_ARGUMENT;
    }
    c->signal_used[slot] = 0;
    conn_leave(c);
    return st;
}

pdpair_status pdpair_conn_wait_signal(pdpair_conn *c, uint32_t slot, uint64_t expected, int64_t timeout_ms,
                                      uint64_t *value_out)
{
    if (!c || slot >= c->signal_slots || timeout_ms < 0) return PDPAIR_INVALID_ARGUMENT;
    uint64_t deadline = pdpair_deadline_ns(timeout_ms);
    pdpair_status st = conn_enter(c);
    if (st != PDPAIR_OK) return st;
    uint64_t v;
    for (;;) {
        /* The receiver adds under release and then takes mu to wake us; we hold mu from this load until
         * we sleep, so no increment can slip between the check and the wait. */
        v = atomic_load_explicit(&c->signals[slot], memory_order_acquire);
        if (v >= expected) {
            st = PDPAIR_OK;
            break;
        }
        if (c->closing) {
            st = PDPAIR_CLOSED;
            break;
        }
        if (c->state != PDPAIR_OK) {
            st = c->state;
            break;
        }
        if (pdpair_now_ns() >= deadline) {
            st = PDPAIR_TIMEOUT;
            snprintf(c->err, sizeof c->err, "signal slot %u reached %llu of %llu before the deadline", slot,
                     (unsigned long long)v, (unsigned long long)expected);
            break;
        }
        struct waiter w = {.slot = slot, .target = expected};
        waiter_add(&c->sig_waiting, &w);
        pdpair_cond_wait_until(&c->sig_cv, &c->mu, deadline);
        waiter_remove(&c->sig_waiting, &w);
    }
    if (value_out) *value_out = v;
    conn_leave(c);
    return st;
}

/* --- peer regions, stats, faults, state ----------------------------------------------------------------------- */
uint32_t pdpair_conn_remote_region_count(pdpair_conn *c)
{
    if (!c || conn_enter(c) != PDPAIR_OK) return 0;
    uint32_t n = c->n_remote;
    conn_leave(c);
    return n;
}

pdpair_status pdpair_conn_remote_region_size(pdpair_conn *c, uint32_t region, uint64_t *size_out)
{
    if (!c || !size_out) return PDPAIR_INVALID_ARGUMENT;
    pdpair_status st = conn_enter(c);
    if (st != PDPAIR_OK) return st;
    if (region < c->n_remote) *size_out = c->remote_sizes[region];
    else st = PDPAIR_INVALID_ARGUMENT;
    conn_leave(c);
    return st;
}

pdpair_status pdpair_conn_wait_remote_regions(pdpair_conn *c, uint32_t count, int64_t timeout_ms)
{
    if (!c || timeout_ms < 0) return PDPAIR_INVALID_ARGUMENT;
    uint64_t deadline = pdpair_deadline_ns(timeout_ms);
    pdpair_status st = conn_enter(c);
    if (st != PDPAIR_OK) return st;
    for (;;) {
        if (c->n_remote >= count) break;
        if (c->closing) { st = PDPAIR_CLOSED; break; }
        if (c->state != PDPAIR_OK) { st = c->state; break; }
        if (pdpair_now_ns() >= deadline) { st = PDPAIR_TIMEOUT; break; }
        pdpair_cond_wait_until(&c->done_cv, &c->mu, deadline);
    }
    conn_leave(c);
    return st;
}

pdpair_status pdpair_conn_get_stats(pdpair_conn *c, pdpair_conn_stats *stats, size_t stats_size)
{
    if (!c || !stats) return PDPAIR_INVALID_ARGUMENT;
    pdpair_status st = conn_enter(c);
    if (st != PDPAIR_OK) return st;
    pdpair_conn_stats s = c->stats;
    s.inflight = c->sent_seq - c->acked_seq;
    s.queued = c->q_len;
    s.remote_regions = c->n_remote;
    conn_leave(c);
    memcpy(stats, &s, stats_size < sizeof s ? stats_size : sizeof s);
    return PDPAIR_OK;
}

pdpair_status pdpair_conn_state(pdpair_conn *c)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    pdpair_status st = conn_enter(c);
    if (st != PDPAIR_OK) return st;
    st = c->state;
    conn_leave(c);
    return st;
}

pdpair_status pdpair_conn_set_fault(pdpair_conn *c, int fault, uint64_t n)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    pdpair_status st = conn_enter(c);
    if (st != PDPAIR_OK) return st;
    switch (fault) {
    case PDPAIR_FAULT_NONE:
        c->fault_drop_every = 0;
        c->fault_skip_bounds = false;
        c->fault_hold_sends = false;
        pthread_cond_signal(&c->send_cv);
        break;
    case PDPAIR_FAULT_DROP_EVERY_NTH_SIGNAL:
        c->fault_drop_every = n;
        c->fault_signal_count = 0;
        break;
    case PDPAIR_FAULT_SKIP_SENDER_BOUNDS_CHECK:
        c->fault_skip_bounds = n != 0;
        break;
    case PDPAIR_FAULT_HOLD_SENDS:
        c->fault_hold_sends = n != 0;
        pthread_cond_signal(&c->send_cv);
        break;
    default:
        snprintf(c->err, sizeof c->err, "unknown fault kind %d", fault);
        st = PDPAIR_INVALID_ARGUMENT;
    }
    conn_leave(c);
    return st;
}

size_t pdpair_conn_last_error(pdpair_conn *c, char *buf, size_t len)
{
    if (!c) return pdpair_copy_error("", buf, len);
    pthread_mutex_lock(&c->mu);
    size_t n = pdpair_copy_error(c->err, buf, len);
    pthread_mutex_unlock(&c->mu);
    return n;
}

pdpair_status pdpair_conn_shutdown(pdpair_conn *c)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    pthread_mutex_lock(&c->mu);
    c->closing = true;
    conn_break_locked(c, PDPAIR_CLOSED, "closed locally");
    pthread_cond_broadcast(&c->done_cv);
    pthread_cond_broadcast(&c->sig_cv);
    pthread_mutex_unlock(&c->mu);
    return PDPAIR_OK;
}

pdpair_status pdpair_conn_close(pdpair_conn *c)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    pdpair_conn_shutdown(c);
    pthread_mutex_lock(&c->mu);
    while (c->users > 0) pthread_cond_wait(&c->idle_cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    shutdown(c->fd, SHUT_RDWR);
    if (c->threads_started) {
        pthread_join(c->sender, NULL);
        pthread_join(c->receiver, NULL);
    }
    pdpair_context *ctx = c->ctx;
    ctx_remove_conn(ctx, c);
    close(c->fd);
    conn_free(c);
    context_unref(ctx);
    return PDPAIR_OK;
}

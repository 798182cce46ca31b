/* The receiver thread: reads frames, checks each put (regions, declared transfer and windows), places payloads
 * straight into the regions while checksumming them, adds signals only after the bytes are in place and their
 * checksum matched, and queues acks and rejects for the sender (it never writes to the socket itself). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "core.h"
#include "wire.h"

/* Headers and small payloads are read through a staging buffer (many small frames per recv). The fill is kept
 * small so it never swallows much of a large payload, which would then cost a second copy: remainders of at
 * least RECV_DIRECT_BYTES are received straight into the destination region. */
#define RECV_BUFFER_BYTES (8u << 10)
#define RECV_DIRECT_BYTES (8u << 10)

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

static bool push_reject(pdpair_conn *c, uint64_t seq, uint32_t reason)
{
    if (c->n_rejects_out == c->rejects_out_cap) {
        size_t nc = c->rejects_out_cap ? c->rejects_out_cap * 2 : 16;
        struct reject_out *p = realloc(c->rejects_out, nc * sizeof *p);
        if (!p) return false;
        c->rejects_out = p;
        c->rejects_out_cap = nc;
    }
    c->rejects_out[c->n_rejects_out++] = (struct reject_out){seq, reason};
    return true;
}

struct reader {
    pdpair_conn *c;
    uint8_t *buf;
    size_t pos, end;
    pdpair_status st;
    int err;
    uint32_t crc; /* CRC32C of the bytes read_exact placed since it was reset */
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
        r->st = n == 0 ? PDPAIR_PEER_CLOSED : pdpi_net_errno_status(errno);
        return false;
    }
}

/* Read exactly len bytes into dst (dst NULL = discard). Large remainders bypass the staging buffer. With `crc`, the
 * bytes placed are checksummed into r->crc piece by piece as they land, while they are still in the cache. */
static bool read_exact(struct reader *r, uint8_t *dst, uint64_t len, bool crc)
{
    while (len > 0) {
        if (r->pos < r->end) {
            size_t k = r->end - r->pos;
            if (k > len) k = (size_t)len;
            if (dst) {
                memcpy(dst, r->buf + r->pos, k);
                if (crc) r->crc = pdpi_crc32c(r->crc, dst, k);
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
            if (crc) r->crc = pdpi_crc32c(r->crc, dst, got);
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

_Static_assert((int)WIRE_REJECT_BOUNDS == (int)PDPAIR_REFUSAL_BOUNDS &&
                   (int)WIRE_REJECT_TRANSFER == (int)PDPAIR_REFUSAL_TRANSFER &&
                   (int)WIRE_REJECT_WINDOW == (int)PDPAIR_REFUSAL_WINDOW &&
                   (int)WIRE_REJECT_CHECKSUM == (int)PDPAIR_REFUSAL_CHECKSUM &&
                   (int)WIRE_REJECT_INCOMPLETE == (int)PDPAIR_REFUSAL_INCOMPLETE,
               "a slot's refusal is the wire reason: the two enums must agree");

/* Which check refuses this put (0 = none), under conn->mu. On acceptance in expectation mode, *e is its transfer. */
static uint32_t check_put_locked(pdpair_conn *c, const struct wire_frame *f, bool has_signal, uint8_t **dst,
                                 struct expectation **e, uint32_t *win)
{
    pdpair_context *ctx = c->ctx;
    *e = NULL;
    *win = UINT32_MAX;
    if (!(f->flags & WIRE_FLAG_NODATA)) {
        /* The receiver's own bounds check: nothing is written outside a registered region. */
        uint32_t n = atomic_load_explicit(&ctx->region_count, memory_order_acquire);
        if (f->region >= n || f->offset > ctx->regions[f->region].size ||
            f->length > ctx->regions[f->region].size - f->offset)
            return WIRE_REJECT_BOUNDS;
        *dst = ctx->regions[f->region].addr + f->offset;
    }
    if (has_signal && f->slot >= c->signal_slots) return WIRE_REJECT_BOUNDS;
    if (!ctx->opts.expect_transfers) return 0;
    /* Writes only where this side asked: a declared, unretired transfer of this generation, inside its windows,
     * signalling its own slot. Id 0 (untagged) is never declared. */
    *e = f->transfer ? pdpi_expect_find_locked(c, f->transfer, f->generation) : NULL;
    if (!*e) return WIRE_REJECT_TRANSFER;
    /* complete: every signal it declared came, so anything more of it is a duplicate or a replay */
    if ((*e)->signals_max && (*e)->signals_seen >= (*e)->signals_max) return WIRE_REJECT_TRANSFER;
    if (has_signal && f->slot != (*e)->slot) return WIRE_REJECT_WINDOW;
    /* Each window written once, front to back: a put must continue one (a second write of a block, or a put into
     * another put's place, is refused) */
    if (!(f->flags & WIRE_FLAG_NODATA) && f->length > 0 &&
        (*win = pdpi_expect_window(*e, f->region, f->offset, f->length)) == UINT32_MAX)
        return WIRE_REJECT_WINDOW;
    /* The signal that completes the transfer, before every byte came (a put cut short, or one that never came):
     * signals alone would call it complete. */
    if (has_signal && (*e)->signals_max && (*e)->signals_seen + 1 == (*e)->signals_max &&
        (*e)->bytes_seen + f->length < (*e)->bytes_max)
        return WIRE_REJECT_INCOMPLETE;
    return 0;
}

static void handle_data(pdpair_conn *c, struct reader *r, const struct wire_frame *f, bool *fatal)
{
    if (f->seq != c->recv_seq + 1) {
        pthread_mutex_lock(&c->mu);
        pdpi_conn_break_locked(c, PDPAIR_PROTOCOL_ERROR, "request id %llu out of order (expected %llu)",
                               (unsigned long long)f->seq, (unsigned long long)(c->recv_seq + 1));
        pthread_mutex_unlock(&c->mu);
        *fatal = true;
        return;
    }
    c->recv_seq = f->seq;
    bool has_signal = (f->flags & WIRE_FLAG_SIGNAL) != 0;
    if ((f->flags & WIRE_FLAG_NODATA) && f->length != 0) {
        pthread_mutex_lock(&c->mu);
        pdpi_conn_break_locked(c, PDPAIR_PROTOCOL_ERROR, "payload on a no-data frame");
        pthread_mutex_unlock(&c->mu);
        *fatal = true;
        return;
    }
    uint8_t *dst = NULL;
    struct expectation *e = NULL;
    uint32_t win = UINT32_MAX; /* the window of e this put continues (a put with data) */
    pthread_mutex_lock(&c->mu);
    uint32_t reason = check_put_locked(c, f, has_signal, &dst, &e, &win);
    /* e's slot, read now: e may be retired (and freed) once the receiver lets go of it below */
    uint32_t exp_slot = e ? e->slot : UINT32_MAX;
    if (!reason && e && f->length > 0) {
        /* Retire waits while this is set, so the transfer's windows stay ours until the payload is in. */
        c->recv_active_id = f->transfer;
        c->recv_active_gen = f->generation;
    }
    pthread_mutex_unlock(&c->mu);

    bool check_crc = !reason && !c->ctx->opts.skip_checksums;
    r->crc = 0;
    if (!read_exact(r, reason ? NULL : dst, f->length, check_crc)) {
        /* A payload cut short (peer gone): never signalled. recv_active stays set only on a broken connection,
         * which retire also accepts as the end of the write. */
        pthread_mutex_lock(&c->mu);
        c->recv_active_id = 0;
        pthread_cond_broadcast(&c->retire_cv);
        pthread_mutex_unlock(&c->mu);
        *fatal = true;
        return;
    }
    if (check_crc && r->crc != f->crc) reason = WIRE_REJECT_CHECKSUM;

    pthread_mutex_lock(&c->mu);
    if (c->recv_active_id) {
        c->recv_active_id = 0;
        pthread_cond_broadcast(&c->retire_cv);
    }
    c->ack_to_send = f->seq;
    if (!reason) {
        c->stats.bytes_received += f->length;
        if (exp_slot != UINT32_MAX) {
            /* Looked up again: a zero-length put holds no claim on its transfer, which may be retired meanwhile. */
            struct expectation *now = pdpi_expect_find_locked(c, f->transfer, f->generation);
            if (now) { /* `win` indexes the same table: a transfer with a put in flight is never retired */
                if (win != UINT32_MAX) now->windows[win].filled += f->length;
                now->bytes_seen += f->length;
                if (has_signal) now->signals_seen++;
            }
        }
        if (has_signal) {
            /* release: whoever reads this value with acquire sees the payload */
            uint64_t v = atomic_fetch_add_explicit(&c->signals[f->slot], 1, memory_order_release) + 1;
            c->stats.signals_received++;
            for (struct waiter *w = c->sig_waiting; w; w = w->next) {
                if (w->slot == f->slot && v >= w->target) {
                    pthread_cond_broadcast(&c->sig_cv);
                    break;
                }
            }
        }
    } else {
        if (reason == WIRE_REJECT_TRANSFER) c->stats.refused_unknown_transfer++;
        else if (reason == WIRE_REJECT_WINDOW) c->stats.refused_out_of_window++;
        else if (reason == WIRE_REJECT_CHECKSUM) c->stats.refused_checksum++;
        else if (reason == WIRE_REJECT_INCOMPLETE) c->stats.refused_incomplete++;
        /* The waiter of the slot this put named, and of the transfer it claimed, learns now, not at its deadline:
         * the signal it waits for will never come, and a corrupt payload may sit in its windows. */
        if (has_signal) pdpi_signal_fail_locked(c, f->slot, reason);
        if (exp_slot != UINT32_MAX) pdpi_signal_fail_locked(c, exp_slot, reason);
        if (!push_reject(c, f->seq, reason)) {
            pdpi_conn_break_locked(c, PDPAIR_NO_MEMORY, "out of memory recording a rejected put");
            *fatal = true;
        }
    }
    pthread_cond_signal(&c->send_cv);
    pthread_mutex_unlock(&c->mu);
}

static const char *reject_text(uint64_t reason)
{
    switch (reason) { /* the peer's word: only these fixed texts are shown, never its number echoed raw */
    case WIRE_REJECT_BOUNDS: return "outside its regions or signal slots";
    case WIRE_REJECT_TRANSFER: return "not a transfer it expects: unknown, retired, complete or another generation";
    case WIRE_REJECT_WINDOW: return "outside the transfer's windows or signal slot, or not where its window goes on";
    case WIRE_REJECT_CHECKSUM: return "payload checksum mismatch";
    case WIRE_REJECT_INCOMPLETE: return "the transfer's last signal came before all of its bytes";
    default: return "reason not given";
    }
}

void *pdpi_receiver_main(void *arg)
{
    pdpair_conn *c = arg;
    struct reader r = {.c = c, .buf = malloc(RECV_BUFFER_BYTES)};
    if (!r.buf) {
        pthread_mutex_lock(&c->mu);
        pdpi_conn_break_locked(c, PDPAIR_NO_MEMORY, "out of memory for the receive buffer");
        pthread_mutex_unlock(&c->mu);
        return NULL;
    }
    for (;;) {
        uint8_t h[WIRE_FRAME_SIZE];
        struct wire_frame f;
        bool fatal = false;
        if (!read_exact(&r, h, WIRE_FRAME_SIZE, false)) break;
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
                pdpi_conn_break_locked(c, PDPAIR_PROTOCOL_ERROR, "ack %llu outside (%llu, %llu]",
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
                pdpi_conn_break_locked(c, PDPAIR_PROTOCOL_ERROR, "reject of request %llu is out of order",
                                       (unsigned long long)f.seq);
                fatal = true;
                break;
            }
            if (!push_u64(&c->rejected, &c->n_rejected, &c->rejected_cap, f.seq)) {
                pdpi_conn_break_locked(c, PDPAIR_NO_MEMORY, "out of memory recording a rejection");
                fatal = true;
                break;
            }
            c->stats.rejected++;
            snprintf(c->err, sizeof c->err, "peer rejected request %llu (%s)", (unsigned long long)f.seq,
                     reject_text(f.offset));
            break;
        case WIRE_REGION:
            if (f.region != c->n_remote || c->n_remote >= WIRE_MAX_REGIONS) {
                pdpi_conn_break_locked(c, PDPAIR_PROTOCOL_ERROR, "region %u announced out of order", f.region);
                fatal = true;
                break;
            }
            if (c->n_remote == c->remote_cap) {
                uint32_t nc = c->remote_cap ? c->remote_cap * 2 : 16;
                uint64_t *p = realloc(c->remote_sizes, nc * sizeof *p);
                if (!p) {
                    pdpi_conn_break_locked(c, PDPAIR_NO_MEMORY, "out of memory for the peer's region table");
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
            pdpi_conn_break_locked(c, PDPAIR_PROTOCOL_ERROR, "unknown frame type %u", f.type);
            fatal = true;
        }
        pthread_mutex_unlock(&c->mu);
        if (fatal) break;
    }
    if (r.st != PDPAIR_OK) {
        pthread_mutex_lock(&c->mu);
        if (r.st == PDPAIR_PEER_CLOSED)
            pdpi_conn_break_locked(c, r.st, r.err ? "connection reset by peer" : "peer closed the connection");
        else
            pdpi_conn_break_locked(c, r.st, "receive failed: %s", strerror(r.err));
        pthread_mutex_unlock(&c->mu);
    }
    free(r.buf);
    return NULL;
}

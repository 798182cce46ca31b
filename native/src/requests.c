/* Requests: posting put / put_signal / signal, tagged or not (never blocks, never drops: the queue grows), and
 * their completion (test, wait, flush). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>

#include "core.h"
#include "wire.h"

static pdpair_status post(pdpair_conn *c, const struct op *proto, bool has_data, uint32_t local_region,
                          uint64_t local_offset, uint64_t *request_out)
{
    struct op o = *proto;
    /* The checksum is taken here, in the posting thread and outside the connection's lock: posts from several
     * threads checksum in parallel, and the sender thread only sends. Regions never change once registered, so the
     * range check needs no lock either. */
    bool local_ok = !has_data || pdpi_local_range_ok(c->ctx, local_region, local_offset, o.length, &o.src);
    if (has_data && local_ok && !c->ctx->opts.skip_checksums) o.crc = pdpi_crc32c(0, o.src, o.length);
    pdpair_status st = pdpi_conn_enter(c);
    if (st != PDPAIR_OK) return st;
    if (c->state != PDPAIR_OK) {
        st = c->state;
        goto out;
    }
    if (has_data) {
        if (!local_ok) {
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
    if ((o.flags & WIRE_FLAG_SIGNAL) && pdpi_fault_drops_signal_locked(c))
        o.flags &= (uint8_t)~WIRE_FLAG_SIGNAL; /* TEST ONLY: the data still goes, the signal does not */
    if (has_data && o.length > 0 && pdpi_fault_corrupts_put_locked(c)) o.corrupt = true; /* TEST ONLY */
    pdpi_fault_apply_locked(c, &o, has_data);                                            /* TEST ONLY */
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
    pdpi_conn_leave(c);
    return st;
}

pdpair_status pdpair_put_tagged(pdpair_conn *c, uint64_t transfer_id, uint32_t generation, uint32_t local_region,
                                uint64_t local_offset, uint32_t remote_region, uint64_t remote_offset, uint64_t nbytes,
                                uint64_t *request_out)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    struct op o = {.remote_region = remote_region, .remote_offset = remote_offset, .length = nbytes,
                   .transfer = transfer_id, .generation = generation};
    return post(c, &o, true, local_region, local_offset, request_out);
}

pdpair_status pdpair_put_signal_tagged(pdpair_conn *c, uint64_t transfer_id, uint32_t generation,
                                       uint32_t local_region, uint64_t local_offset, uint32_t remote_region,
                                       uint64_t remote_offset, uint64_t nbytes, uint32_t remote_signal_slot,
                                       uint64_t *request_out)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    struct op o = {.remote_region = remote_region, .remote_offset = remote_offset, .length = nbytes,
                   .slot = remote_signal_slot, .flags = WIRE_FLAG_SIGNAL, .transfer = transfer_id,
                   .generation = generation};
    return post(c, &o, true, local_region, local_offset, request_out);
}

pdpair_status pdpair_signal_tagged(pdpair_conn *c, uint64_t transfer_id, uint32_t generation,
                                   uint32_t remote_signal_slot, uint64_t *request_out)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    struct op o = {.slot = remote_signal_slot, .flags = WIRE_FLAG_SIGNAL | WIRE_FLAG_NODATA,
                   .transfer = transfer_id, .generation = generation};
    return post(c, &o, false, 0, 0, request_out);
}

pdpair_status pdpair_put(pdpair_conn *c, uint32_t local_region, uint64_t local_offset, uint32_t remote_region,
                         uint64_t remote_offset, uint64_t nbytes, uint64_t *request_out)
{
    return pdpair_put_tagged(c, 0, 0, local_region, local_offset, remote_region, remote_offset, nbytes, request_out);
}

pdpair_status pdpair_put_signal(pdpair_conn *c, uint32_t local_region, uint64_t local_offset,
                                uint32_t remote_region, uint64_t remote_offset, uint64_t nbytes,
                                uint32_t remote_signal_slot, uint64_t *request_out)
{
    return pdpair_put_signal_tagged(c, 0, 0, local_region, local_offset, remote_region, remote_offset, nbytes,
                                    remote_signal_slot, request_out);
}

pdpair_status pdpair_signal(pdpair_conn *c, uint32_t remote_signal_slot, uint64_t *request_out)
{
    return pdpair_signal_tagged(c, 0, 0, remote_signal_slot, request_out);
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
    pdpair_status st = pdpi_conn_enter(c);
    if (st != PDPAIR_OK) return st;
    st = request_status_locked(c, request);
    pdpi_conn_leave(c);
    return st;
}

static pdpair_status wait_acked_locked(pdpair_conn *c, uint64_t request, uint64_t deadline)
{
    for (;;) {
        pdpair_status st = request_status_locked(c, request);
        if (st != PDPAIR_IN_PROGRESS) return st;
        if (pdpi_now_ns() >= deadline) return PDPAIR_TIMEOUT;
        struct waiter w = {.target = request};
        waiter_add(&c->done_waiting, &w);
        pdpi_cond_wait_until(&c->done_cv, &c->mu, deadline);
        waiter_remove(&c->done_waiting, &w);
    }
}

pdpair_status pdpair_conn_wait(pdpair_conn *c, uint64_t request, int64_t timeout_ms)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    if (timeout_ms < 0) return PDPAIR_INVALID_ARGUMENT;
    uint64_t deadline = pdpi_deadline_ns(timeout_ms);
    pdpair_status st = pdpi_conn_enter(c);
    if (st != PDPAIR_OK) return st;
    st = wait_acked_locked(c, request, deadline);
    pdpi_conn_leave(c);
    return st;
}

pdpair_status pdpair_conn_flush(pdpair_conn *c, int64_t timeout_ms)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    if (timeout_ms < 0) return PDPAIR_INVALID_ARGUMENT;
    uint64_t deadline = pdpi_deadline_ns(timeout_ms);
    pdpair_status st = pdpi_conn_enter(c);
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
    pdpi_conn_leave(c);
    return st;
}

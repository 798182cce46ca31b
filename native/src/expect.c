/* Declared transfers (expectation mode): pdpair_conn_expect / pdpair_conn_retire, and the lookups the receiver
 * makes before it writes a put. A bounded hash table per connection (max_transfers entries, windows counted against
 * max_transfer_windows): a full table is an error for the caller, never growth driven by the peer. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>

#include "core.h"

/* After a retire that had to break the connection, how long to wait for the receiver to leave the payload it was
 * writing. Breaking shuts the socket down, so its recv returns at once; this only keeps the wait bounded. */
#define RETIRE_AFTER_BREAK_MS 2000

static uint32_t slot_of(const pdpair_conn *c, uint64_t id)
{
    /* Fibonacci hashing: transfer ids may be sequential or hashes; either spreads over the table. */
    return (uint32_t)((id * 0x9E3779B97F4A7C15ull) >> 32) & (c->expect_cap - 1);
}

struct expectation *pdpi_expect_find_locked(pdpair_conn *c, uint64_t id, uint32_t generation)
{
    if (!c->expect || id == 0) return NULL;
    for (uint32_t i = slot_of(c, id);; i = (i + 1) & (c->expect_cap - 1)) {
        struct expectation *e = &c->expect[i];
        if (e->id == 0) return NULL;
        if (e->id == id) return e->generation == generation ? e : NULL;
    }
}

uint32_t pdpi_expect_window(const struct expectation *e, uint32_t region, uint64_t offset, uint64_t length)
{
    /* the last window starting at or before (region, offset) */
    uint32_t a = 0, b = e->nwindows;
    while (a < b) {
        uint32_t m = a + (b - a) / 2;
        const struct window *w = &e->windows[m];
        if (w->region < region || (w->region == region && w->start <= offset)) a = m + 1;
        else b = m;
    }
    if (a == 0) return UINT32_MAX;
    const struct window *w = &e->windows[a - 1];
    bool continues = w->region == region && offset == w->start + w->filled && length <= w->end - offset;
    return continues ? a - 1 : UINT32_MAX;
}

static int window_cmp(const void *pa, const void *pb)
{
    const struct window *x = pa, *y = pb;
    if (x->region != y->region) return x->region < y->region ? -1 : 1;
    return x->start < y->start ? -1 : x->start > y->start;
}

/* Linear probing with backward-shift deletion (no tombstones, so lookups never slow down as transfers come and go). */
static void remove_entry(pdpair_conn *c, struct expectation *e)
{
    uint32_t mask = c->expect_cap - 1, i = (uint32_t)(e - c->expect);
    c->expect_windows -= e->nwindows;
    c->n_expect--;
    free(e->windows);
    for (uint32_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        if (c->expect[j].id == 0) break;
        uint32_t home = slot_of(c, c->expect[j].id);
        /* entry j may move into the hole at i unless its home lies cyclically in (i, j] */
        bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (stays) continue;
        c->expect[i] = c->expect[j];
        i = j;
    }
    c->expect[i] = (struct expectation){0};
}

pdpair_status pdpair_conn_expect(pdpair_conn *c, uint64_t transfer_id, uint32_t generation, uint32_t signal_slot,
                                 uint64_t expected_signals, const pdpair_window *windows, size_t nwindows)
{
    if (!c || (nwindows && !windows)) return PDPAIR_INVALID_ARGUMENT;
    pdpair_context *ctx = c->ctx;
    /* Checked and sorted before taking the lock: the windows are the caller's, the regions never change once
     * registered. */
    struct window *ws = NULL;
    pdpair_status st = PDPAIR_OK;
    char why[160] = "";
    if (transfer_id == 0) {
        snprintf(why, sizeof why, "transfer id 0 is reserved for untagged puts");
        st = PDPAIR_INVALID_ARGUMENT;
    } else if (signal_slot >= c->signal_slots) {
        snprintf(why, sizeof why, "signal slot %u out of range (%u slots)", signal_slot, c->signal_slots);
        st = PDPAIR_INVALID_ARGUMENT;
    } else if (nwindows > ctx->opts.max_transfer_windows) {
        snprintf(why, sizeof why, "%zu windows exceed max_transfer_windows=%u", nwindows,
                 ctx->opts.max_transfer_windows);
        st = PDPAIR_EXHAUSTED;
    } else if (nwindows && !(ws = malloc(nwindows * sizeof *ws))) {
        st = PDPAIR_NO_MEMORY;
        snprintf(why, sizeof why, "out of memory for %zu windows", nwindows);
    }
    for (size_t i = 0; st == PDPAIR_OK && i < nwindows; i++) {
        const pdpair_window *w = &windows[i];
        const uint8_t *addr;
        if (w->reserved || w->length == 0 || !pdpi_local_range_ok(ctx, w->region, w->offset, w->length, &addr)) {
            snprintf(why, sizeof why, "window %zu (region %u [%llu, +%llu)) is empty or outside the local regions",
                     i, w->region, (unsigned long long)w->offset, (unsigned long long)w->length);
            st = PDPAIR_INVALID_ARGUMENT;
            break;
        }
        ws[i] = (struct window){w->region, w->offset, w->offset + w->length, 0};
    }
    uint32_t n = 0;
    uint64_t bytes = 0;
    if (st == PDPAIR_OK && nwindows) {
        /* Sorted for the lookup; never overlapping, so every byte belongs to one window and is written once. */
        qsort(ws, nwindows, sizeof *ws, window_cmp);
        for (size_t i = 1; i < nwindows; i++) {
            if (ws[i].region == ws[i - 1].region && ws[i].start < ws[i - 1].end) {
                snprintf(why, sizeof why, "windows overlap in region %u at offset %llu", ws[i].region,
                         (unsigned long long)ws[i].start);
                st = PDPAIR_INVALID_ARGUMENT;
                break;
            }
        }
        n = (uint32_t)nwindows;
        for (uint32_t i = 0; i < n; i++) bytes += ws[i].end - ws[i].start;
    }

    pdpair_status entered = pdpi_conn_enter(c);
    if (entered != PDPAIR_OK) {
        free(ws);
        return entered;
    }
    if (st == PDPAIR_OK && !c->expect) {
        uint32_t cap = 16;
        while (cap < 2 * ctx->opts.max_transfers) cap *= 2;
        c->expect = calloc(cap, sizeof *c->expect);
        if (!c->expect) {
            st = PDPAIR_NO_MEMORY;
            snprintf(why, sizeof why, "out of memory for the transfer table");
        } else {
            c->expect_cap = cap;
        }
    }
    uint32_t i = 0;
    if (st == PDPAIR_OK) {
        for (i = slot_of(c, transfer_id); c->expect[i].id != 0; i = (i + 1) & (c->expect_cap - 1)) {
            if (c->expect[i].id == transfer_id) {
                snprintf(why, sizeof why, "transfer %llu is already declared (generation %u): retire it first",
                         (unsigned long long)transfer_id, c->expect[i].generation);
                st = PDPAIR_INVALID_ARGUMENT;
                break;
            }
        }
    }
    if (st == PDPAIR_OK) { /* the table has a free entry at i whenever this passes: cap >= 2 x max_transfers */
        if (c->n_expect >= ctx->opts.max_transfers) {
            snprintf(why, sizeof why, "%u transfers outstanding (max_transfers): retire finished ones first",
                     c->n_expect);
            st = PDPAIR_EXHAUSTED;
        } else if (c->expect_windows + n > ctx->opts.max_transfer_windows) {
            snprintf(why, sizeof why, "%llu + %u windows exceed max_transfer_windows=%u",
                     (unsigned long long)c->expect_windows, n, ctx->opts.max_transfer_windows);
            st = PDPAIR_EXHAUSTED;
        }
    }
    if (st == PDPAIR_OK) {
        c->expect[i] = (struct expectation){.id = transfer_id, .generation = generation, .slot = signal_slot,
                                            .signals_max = expected_signals, .bytes_max = bytes, .windows = ws,
                                            .nwindows = n};
        ws = NULL;
        c->n_expect++;
        c->expect_windows += n;
        c->stats.transfers_outstanding = c->n_expect;
        c->signal_failed[signal_slot] = 0; /* a new transfer on this slot starts clean */
    } else {
        snprintf(c->err, sizeof c->err, "expect transfer %llu: %s", (unsigned long long)transfer_id, why);
    }
    pdpi_conn_leave(c);
    free(ws);
    return st;
}

pdpair_status pdpair_conn_retire(pdpair_conn *c, uint64_t transfer_id, uint32_t generation, int64_t timeout_ms)
{
    if (!c || timeout_ms < 0) return PDPAIR_INVALID_ARGUMENT;
    uint64_t deadline = pdpi_deadline_ns(timeout_ms);
    pdpair_status st = pdpi_conn_enter(c);
    if (st != PDPAIR_OK) return st;
    struct expectation *e = pdpi_expect_find_locked(c, transfer_id, generation);
    if (!e) {
        snprintf(c->err, sizeof c->err, "retire: transfer %llu generation %u is not declared",
                 (unsigned long long)transfer_id, generation);
        pdpi_conn_leave(c);
        return PDPAIR_INVALID_ARGUMENT;
    }
    /* Removed first: from now on the receiver refuses its puts. Then wait for a put already being received into its
     * windows (the receiver checked the tag before this call), so none of its bytes land after we return. */
    remove_entry(c, e);
    c->stats.transfers_outstanding = c->n_expect;
    bool busy = c->recv_active_id == transfer_id && c->recv_active_gen == generation;
    while (busy && c->state == PDPAIR_OK && pdpi_now_ns() < deadline) {
        pdpi_cond_wait_until(&c->retire_cv, &c->mu, deadline);
        busy = c->recv_active_id == transfer_id && c->recv_active_gen == generation;
    }
    if (busy) {
        /* Still arriving at the deadline (a stalled peer): stop the write by breaking the connection. Broken by
         * something else meanwhile: the receiver is leaving the payload anyway; report that error. */
        st = c->state == PDPAIR_OK ? PDPAIR_TIMEOUT : c->state;
        pdpi_conn_break_locked(c, PDPAIR_CONNECTION_ERROR,
                               "retire of transfer %llu: one of its puts was still arriving after %lld ms",
                               (unsigned long long)transfer_id, (long long)timeout_ms);
        uint64_t until = pdpi_deadline_ns(RETIRE_AFTER_BREAK_MS);
        while (c->recv_active_id == transfer_id && c->recv_active_gen == generation && pdpi_now_ns() < until)
            pdpi_cond_wait_until(&c->retire_cv, &c->mu, until);
    }
    pdpi_conn_leave(c);
    return st;
}

void pdpi_expect_free(pdpair_conn *c)
{
    for (uint32_t i = 0; c->expect && i < c->expect_cap; i++) free(c->expect[i].windows);
    free(c->expect);
    c->expect = NULL;
}

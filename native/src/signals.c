/* Local signal slots: counters the peer adds to; read, reset, allocate, free, and wait for a value. */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdio.h>

#include "core.h"

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
    pdpair_status st = pdpi_conn_enter(c);
    if (st != PDPAIR_OK) return st;
    atomic_store_explicit(&c->signals[slot], 0, memory_order_release);
    c->signal_failed[slot] = 0;
    pdpi_conn_leave(c);
    return PDPAIR_OK;
}

void pdpi_signal_fail_locked(pdpair_conn *c, uint32_t slot, uint32_t reason)
{
    if (slot >= c->signal_slots || c->signal_failed[slot]) return;
    c->signal_failed[slot] = (uint8_t)(reason ? reason : PDPAIR_REFUSAL_BOUNDS); /* the first refusal's reason */
    for (struct waiter *w = c->sig_waiting; w; w = w->next) {
        if (w->slot == slot) {
            pthread_cond_broadcast(&c->sig_cv);
            break;
        }
    }
}

pdpair_status pdpair_conn_slot_refusal(pdpair_conn *c, uint32_t slot, int *refusal_out)
{
    if (!c || !refusal_out || slot >= c->signal_slots) return PDPAIR_INVALID_ARGUMENT;
    pdpair_status st = pdpi_conn_enter(c);
    if (st != PDPAIR_OK) return st;
    *refusal_out = c->signal_failed[slot];
    pdpi_conn_leave(c);
    return PDPAIR_OK;
}

pdpair_status pdpair_conn_alloc_signal(pdpair_conn *c, uint32_t *slot_out)
{
    if (!c || !slot_out) return PDPAIR_INVALID_ARGUMENT;
    pdpair_status st = pdpi_conn_enter(c);
    if (st != PDPAIR_OK) return st;
    st = PDPAIR_EXHAUSTED;
    for (uint32_t i = 0; i < c->signal_slots; i++) {
        if (!c->signal_used[i]) {
            c->signal_used[i] = 1;
            c->signal_failed[i] = 0;
            atomic_store_explicit(&c->signals[i], 0, memory_order_release);
            *slot_out = i;
            st = PDPAIR_OK;
            break;
        }
    }
    if (st == PDPAIR_EXHAUSTED) snprintf(c->err, sizeof c->err, "all %u signal slots are allocated", c->signal_slots);
    pdpi_conn_leave(c);
    return st;
}

pdpair_status pdpair_conn_free_signal(pdpair_conn *c, uint32_t slot)
{
    if (!c || slot >= c->signal_slots) return PDPAIR_INVALID_ARGUMENT;
    pdpair_status st = pdpi_conn_enter(c);
    if (st != PDPAIR_OK) return st;
    if (!c->signal_used[slot]) {
        snprintf(c->err, sizeof c->err, "signal slot %u is not allocated", slot);
        st = PDPAIR_INVALID_ARGUMENT;
    }
    c->signal_used[slot] = 0;
    pdpi_conn_leave(c);
    return st;
}

pdpair_status pdpair_conn_wait_signal(pdpair_conn *c, uint32_t slot, uint64_t expected, int64_t timeout_ms,
                                      uint64_t *value_out)
{
    if (!c || slot >= c->signal_slots || timeout_ms < 0) return PDPAIR_INVALID_ARGUMENT;
    uint64_t deadline = pdpi_deadline_ns(timeout_ms);
    pdpair_status st = pdpi_conn_enter(c);
    if (st != PDPAIR_OK) return st;
    uint64_t v;
    for (;;) {
        /* The receiver adds under release and then takes mu to wake us; we hold mu from this load until
         * we sleep, so no increment can slip between the check and the wait. */
        v = atomic_load_explicit(&c->signals[slot], memory_order_acquire);
        if (c->signal_failed[slot]) {
            /* before the value: a refused put's bytes may be in place even if other puts reached the count */
            st = PDPAIR_DATA_REJECTED;
            snprintf(c->err, sizeof c->err, "signal slot %u: a put meant for it was refused here (see the "
                     "connection's refused_* counters)", slot);
            break;
        }
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
        if (pdpi_now_ns() >= deadline) {
            st = PDPAIR_TIMEOUT;
            snprintf(c->err, sizeof c->err, "signal slot %u reached %llu of %llu before the deadline", slot,
                     (unsigned long long)v, (unsigned long long)expected);
            break;
        }
        struct waiter w = {.slot = slot, .target = expected};
        waiter_add(&c->sig_waiting, &w);
        pdpi_cond_wait_until(&c->sig_cv, &c->mu, deadline);
        waiter_remove(&c->sig_waiting, &w);
    }
    if (value_out) *value_out = v;
    pdpi_conn_leave(c);
    return st;
}

/* Fault injection (TEST ONLY): the switches tests use to produce the failures the transport must survive. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>

#include "core.h"

pdpair_status pdpair_conn_set_fault(pdpair_conn *c, int fault, uint64_t n)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    pdpair_status st = pdpi_conn_enter(c);
    if (st != PDPAIR_OK) return st;
    switch (fault) {
    case PDPAIR_FAULT_NONE:
        c->fault_drop_every = 0;
        c->fault_skip_bounds = false;
        c->fault_hold_sends = false;
        c->fault_corrupt_puts = 0;
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
    case PDPAIR_FAULT_CORRUPT_PUTS:
        c->fault_corrupt_puts = n;
        break;
    default:
        snprintf(c->err, sizeof c->err, "unknown fault kind %d", fault);
        st = PDPAIR_INVALID_ARGUMENT;
    }
    pdpi_conn_leave(c);
    return st;
}

void pdpi_fault_init_from_env(pdpair_conn *c)
{
    const char *drop = getenv("PDPAIR_TEST_DROP_SIGNAL_EVERY");
    if (drop && *drop) c->fault_drop_every = strtoull(drop, NULL, 10);
}

bool pdpi_fault_drops_signal_locked(pdpair_conn *c)
{
    if (!c->fault_drop_every || ++c->fault_signal_count % c->fault_drop_every != 0) return false;
    c->stats.signals_dropped_by_fault++;
    return true;
}

bool pdpi_fault_corrupts_put_locked(pdpair_conn *c)
{
    if (!c->fault_corrupt_puts) return false;
    c->fault_corrupt_puts--;
    return true;
}

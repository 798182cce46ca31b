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
        c->fault_misaddress_puts = 0;
        c->fault_stale_tag_puts = 0;
        c->fault_truncate_puts = 0;
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
    case PDPAIR_FAULT_MISADDRESS_PUTS:
        c->fault_misaddress_puts = n;
        break;
    case PDPAIR_FAULT_STALE_TAG_PUTS:
        c->fault_stale_tag_puts = n;
        break;
    case PDPAIR_FAULT_TRUNCATE_PUTS:
        c->fault_truncate_puts = n;
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

void pdpi_fault_apply_locked(pdpair_conn *c, struct op *o, bool has_data)
{
    if (o->transfer && (o->transfer != c->tag_last_id || o->generation != c->tag_last_gen)) {
        c->tag_prev_id = c->tag_last_id;
        c->tag_prev_gen = c->tag_last_gen;
        c->tag_last_id = o->transfer;
        c->tag_last_gen = o->generation;
    }
    if (o->transfer && c->fault_stale_tag_puts) {
        c->fault_stale_tag_puts--;
        if (c->tag_prev_id) { /* the previous transfer's tag: retired by now, its blocks maybe reused */
            o->transfer = c->tag_prev_id;
            o->generation = c->tag_prev_gen;
        } else { /* no previous transfer on this connection: another generation of this one */
            o->generation++;
        }
    }
    if (!has_data || o->length == 0) return;
    if (c->fault_misaddress_puts) {
        c->fault_misaddress_puts--;
        o->remote_offset = 0; /* in bounds: the length already fit the region at a higher offset */
    }
    if (c->fault_truncate_puts) {
        c->fault_truncate_puts--;
        o->length /= 2;
        o->crc = c->ctx->opts.skip_checksums ? 0 : pdpi_crc32c(0, o->src, o->length);
    }
}

/* A connection's shared state: API entry and exit (so close can wait for callers), the sticky break, and the
 * calls that only read it (state, last error, stats, the peer's regions) or end it (shutdown). */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "core.h"

/* First error wins; wakes everybody and unblocks the thread that may sit in send/recv. */
void pdpi_conn_break_locked(pdpair_conn *c, pdpair_status st, const char *fmt, ...)
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

/* API entry/exit: callers are counted so close can wait for them before freeing. */
pdpair_status pdpi_conn_enter(pdpair_conn *c)
{
    pthread_mutex_lock(&c->mu);
    if (c->closing) {
        pthread_mutex_unlock(&c->mu);
        return PDPAIR_CLOSED;
    }
    c->users++;
    return PDPAIR_OK;
}

void pdpi_conn_leave(pdpair_conn *c)
{
    if (--c->users == 0 && c->closing) pthread_cond_broadcast(&c->idle_cv);
    pthread_mutex_unlock(&c->mu);
}

uint32_t pdpair_conn_remote_region_count(pdpair_conn *c)
{
    if (!c || pdpi_conn_enter(c) != PDPAIR_OK) return 0;
    uint32_t n = c->n_remote;
    pdpi_conn_leave(c);
    return n;
}

pdpair_status pdpair_conn_remote_region_size(pdpair_conn *c, uint32_t region, uint64_t *size_out)
{
    if (!c || !size_out) return PDPAIR_INVALID_ARGUMENT;
    pdpair_status st = pdpi_conn_enter(c);
    if (st != PDPAIR_OK) return st;
    if (region < c->n_remote) *size_out = c->remote_sizes[region];
    else st = PDPAIR_INVALID_ARGUMENT;
    pdpi_conn_leave(c);
    return st;
}

pdpair_status pdpair_conn_wait_remote_regions(pdpair_conn *c, uint32_t count, int64_t timeout_ms)
{
    if (!c || timeout_ms < 0) return PDPAIR_INVALID_ARGUMENT;
    uint64_t deadline = pdpi_deadline_ns(timeout_ms);
    pdpair_status st = pdpi_conn_enter(c);
    if (st != PDPAIR_OK) return st;
    for (;;) {
        if (c->n_remote >= count) break;
        if (c->closing) { st = PDPAIR_CLOSED; break; }
        if (c->state != PDPAIR_OK) { st = c->state; break; }
        if (pdpi_now_ns() >= deadline) { st = PDPAIR_TIMEOUT; break; }
        pdpi_cond_wait_until(&c->done_cv, &c->mu, deadline);
    }
    pdpi_conn_leave(c);
    return st;
}

pdpair_status pdpair_conn_get_stats(pdpair_conn *c, pdpair_conn_stats *stats, size_t stats_size)
{
    if (!c || !stats) return PDPAIR_INVALID_ARGUMENT;
    pdpair_status st = pdpi_conn_enter(c);
    if (st != PDPAIR_OK) return st;
    pdpair_conn_stats s = c->stats;
    s.inflight = c->sent_seq - c->acked_seq;
    s.queued = c->q_len;
    s.remote_regions = c->n_remote;
    pdpi_conn_leave(c);
    memcpy(stats, &s, stats_size < sizeof s ? stats_size : sizeof s);
    return PDPAIR_OK;
}

pdpair_status pdpair_conn_state(pdpair_conn *c)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    pdpair_status st = pdpi_conn_enter(c);
    if (st != PDPAIR_OK) return st;
    st = c->state;
    pdpi_conn_leave(c);
    return st;
}

size_t pdpair_conn_last_error(pdpair_conn *c, char *buf, size_t len)
{
    if (!c) return pdpi_copy_error("", buf, len);
    pthread_mutex_lock(&c->mu);
    size_t n = pdpi_copy_error(c->err, buf, len);
    pthread_mutex_unlock(&c->mu);
    return n;
}

pdpair_status pdpair_conn_shutdown(pdpair_conn *c)
{
    if (!c) return PDPAIR_INVALID_ARGUMENT;
    pthread_mutex_lock(&c->mu);
    c->closing = true;
    pdpi_conn_break_locked(c, PDPAIR_CLOSED, "closed locally");
    pthread_cond_broadcast(&c->done_cv);
    pthread_cond_broadcast(&c->sig_cv);
    pthread_mutex_unlock(&c->mu);
    return PDPAIR_OK;
}

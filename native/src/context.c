/* Context: options, the registered regions, and the list of live connections told about new regions. */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "wire.h"

#define DEFAULT_REQUEST_SLOTS 256
#define DEFAULT_SIGNAL_SLOTS 4096
#define DEFAULT_MAX_REGIONS 4096
/* One outstanding transfer per signal slot by default (the connector holds one slot per Pull in flight). */
#define DEFAULT_MAX_TRANSFERS 4096
/* 24 MiB of windows at most per connection, allocated only as transfers are declared: e.g. 64 loads of 512 scattered
 * blocks (no two adjacent) in 32 layers each. */
#define DEFAULT_MAX_TRANSFER_WINDOWS (1u << 20)
#define LIMIT_MAX_TRANSFERS (1u << 20)

void pdpair_context_options_init(pdpair_context_options *opts)
{
    if (!opts) return;
    memset(opts, 0, sizeof *opts);
    opts->request_slots = DEFAULT_REQUEST_SLOTS;
    opts->signal_slots = DEFAULT_SIGNAL_SLOTS;
    opts->max_regions = DEFAULT_MAX_REGIONS;
    opts->max_transfers = DEFAULT_MAX_TRANSFERS;
    opts->max_transfer_windows = DEFAULT_MAX_TRANSFER_WINDOWS;
}

pdpair_status pdpair_context_create(const pdpair_context_options *opts, pdpair_context **out)
{
    if (!out) return PDPAIR_INVALID_ARGUMENT;
    *out = NULL;
    pdpair_context_options o;
    pdpair_context_options_init(&o);
    if (opts) {
        if (opts->reserved != 0 || opts->expect_transfers > 1 || opts->skip_checksums > 1)
            return PDPAIR_INVALID_ARGUMENT;
        if (opts->request_slots) o.request_slots = opts->request_slots;
        if (opts->signal_slots) o.signal_slots = opts->signal_slots;
        if (opts->max_regions) o.max_regions = opts->max_regions;
        o.token = opts->token;
        o.expect_transfers = opts->expect_transfers;
        o.skip_checksums = opts->skip_checksums;
        if (opts->max_transfers) o.max_transfers = opts->max_transfers;
        if (opts->max_transfer_windows) o.max_transfer_windows = opts->max_transfer_windows;
    }
    if (o.max_regions > WIRE_MAX_REGIONS || o.signal_slots > (1u << 24) || o.request_slots > (1u << 20) ||
        o.max_transfers > LIMIT_MAX_TRANSFERS)
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

void pdpi_context_unref(pdpair_context *ctx)
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
    pdpi_context_unref(ctx);
    return PDPAIR_OK;
}

size_t pdpair_context_last_error(pdpair_context *ctx, char *buf, size_t len)
{
    if (!ctx) return pdpi_copy_error("", buf, len);
    pthread_mutex_lock(&ctx->mu);
    size_t n = pdpi_copy_error(ctx->err, buf, len);
    pthread_mutex_unlock(&ctx->mu);
    return n;
}

pdpair_status pdpair_context_set_token(pdpair_context *ctx, uint64_t token)
{
    if (!ctx) return PDPAIR_INVALID_ARGUMENT;
    pthread_mutex_lock(&ctx->mu);
    ctx->opts.token = token; /* read under ctx->mu by every handshake (pdpi_conn_establish) */
    pthread_mutex_unlock(&ctx->mu);
    return PDPAIR_OK;
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
        pdpi_format_error(ctx->err, "register: the context is destroyed");
    } else if (!addr || size == 0 || (uintptr_t)addr + size < (uintptr_t)addr) {
        st = PDPAIR_INVALID_ARGUMENT;
        pdpi_format_error(ctx->err, "register: need a non-NULL address and a size > 0 (got %p, %llu)", addr,
                          (unsigned long long)size);
    } else if (n >= ctx->opts.max_regions) {
        st = PDPAIR_EXHAUSTED;
        pdpi_format_error(ctx->err, "register: the region table is full (max_regions=%u)", ctx->opts.max_regions);
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

bool pdpi_local_range_ok(pdpair_context *ctx, uint32_t region, uint64_t offset, uint64_t nbytes,
                         const uint8_t **addr_out)
{
    uint32_t n = atomic_load_explicit(&ctx->region_count, memory_order_acquire);
    if (region >= n) return false;
    const struct region *r = &ctx->regions[region];
    if (offset > r->size || nbytes > r->size - offset) return false;
    *addr_out = r->addr + offset;
    return true;
}

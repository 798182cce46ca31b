/* A connection's life: the hello exchange, establishing a connection (shared by connect and accept), connect,
 * and close. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core.h"
#include "wire.h"

static void conn_free(pdpair_conn *c)
{
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->send_cv);
    pthread_cond_destroy(&c->done_cv);
    pthread_cond_destroy(&c->sig_cv);
    pthread_cond_destroy(&c->idle_cv);
    pthread_cond_destroy(&c->retire_cv);
    pdpi_expect_free(c);
    free(c->queue);
    free(c->rejected);
    free(c->rejects_out);
    free(c->remote_sizes);
    free((void *)c->signals);
    free(c->signal_used);
    free(c->signal_failed);
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

/* Equal without an early exit: the time taken says nothing about how much of a guessed token was right. */
static bool token_equal(uint64_t a, uint64_t b)
{
    volatile uint64_t diff = a ^ b;
    return diff == 0;
}

/* The peer's hello header is in: right protocol and (constant-time) right token? */
static pdpair_status check_peer_header(const uint8_t *in, uint64_t token, char *err)
{
    uint32_t version = wire_get_u32(in + 4);
    if (version != PDPAIR_PROTOCOL_VERSION) {
        pdpi_format_error(err, "protocol version mismatch: peer %u, here %u", version, PDPAIR_PROTOCOL_VERSION);
        return PDPAIR_PROTOCOL_ERROR;
    }
    if (!token_equal(wire_get_u64(in + 8), token)) {
        /* Neither value is named: the error text reaches logs, and the token is the connection's secret. */
        pdpi_format_error(err, "handshake token mismatch (a peer that does not hold this pair's token)");
        return PDPAIR_PROTOCOL_ERROR;
    }
    return PDPAIR_OK;
}

/* Send our hello and read the peer's within the deadline. The connecting side (`accepting` false) sends and reads
 * at once; the listener's side reads the peer's whole hello and checks it against `token` before it sends a byte,
 * so a peer without the token never sees the listener's hello (or its token). wake_fd (or -1) aborts the exchange
 * when it becomes readable (listener shutdown). */
static pdpair_status exchange_hello(int fd, int wake_fd, const uint8_t *out, size_t out_len, uint8_t **in_out,
                                    size_t *in_len_out, uint64_t deadline_ns, bool accepting, uint64_t token,
                                    char *err)
{
    size_t sent = 0, got = 0, want = WIRE_HELLO_SIZE;
    uint8_t *in = malloc(WIRE_HELLO_SIZE);
    if (!in) return PDPAIR_NO_MEMORY;
    while (sent < out_len || got < want) {
        bool may_send = sent < out_len && (!accepting || got == want);
        struct pollfd p[2] = {{.fd = fd, .events = (short)((may_send ? POLLOUT : 0) |
                                                           (got < want ? POLLIN : 0))},
                              {.fd = wake_fd, .events = POLLIN}};
        int n = poll(p, wake_fd >= 0 ? 2 : 1, pdpi_poll_ms_left(deadline_ns));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            pdpi_format_error(err, "handshake poll: %s", strerror(errno));
            free(in);
            return PDPAIR_SYSTEM;
        }
        if (n == 0) {
            pdpi_format_error(err, "handshake did not finish before the deadline");
            free(in);
            return PDPAIR_TIMEOUT;
        }
        if (wake_fd >= 0 && p[1].revents) {
            pdpi_format_error(err, "listener closed during the handshake");
            free(in);
            return PDPAIR_CLOSED;
        }
        if (may_send && (p[0].revents & (POLLOUT | POLLERR | POLLHUP))) {
            ssize_t k = send(fd, out + sent, out_len - sent, MSG_NOSIGNAL);
            if (k < 0 && errno != EAGAIN && errno != EINTR) {
                pdpi_format_error(err, "handshake send: %s", strerror(errno));
                free(in);
                return pdpi_net_errno_status(errno);
            }
            if (k > 0) sent += (size_t)k;
        }
        if (got < want && (p[0].revents & (POLLIN | POLLERR | POLLHUP))) {
            ssize_t k = recv(fd, in + got, want - got, 0);
            if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR)) {
                int e = k == 0 ? 0 : errno;
                pdpi_format_error(err, "peer hung up during the handshake%s%s%s", e ? ": " : "",
                                  e ? strerror(e) : "",
                                  accepting ? "" : " (a listener closes a peer whose token or protocol it refuses)");
                free(in);
                return k == 0 ? PDPAIR_PEER_CLOSED : pdpi_net_errno_status(e);
            }
            if (k > 0) got += (size_t)k;
            if (got == WIRE_HELLO_SIZE && want == WIRE_HELLO_SIZE) {
                if (wire_get_u32(in) != WIRE_MAGIC) {
                    pdpi_format_error(err, "the peer is not a pdpair transport (bad magic)");
                    free(in);
                    return PDPAIR_PROTOCOL_ERROR;
                }
                pdpair_status checked = check_peer_header(in, token, err);
                if (checked != PDPAIR_OK) {
                    free(in);
                    return checked;
                }
                uint32_t nreg = wire_get_u32(in + 24);
                if (nreg > WIRE_MAX_REGIONS) {
                    pdpi_format_error(err, "the peer announced %u regions (max %u)", nreg, WIRE_MAX_REGIONS);
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
pdpair_status pdpi_conn_establish(pdpair_context *ctx, int fd, int wake_fd, uint64_t deadline_ns, bool accepting,
                                  char *err, pdpair_conn **out)
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
    pdpi_cond_init_monotonic(&c->done_cv);
    pdpi_cond_init_monotonic(&c->sig_cv);
    pthread_cond_init(&c->idle_cv, NULL);
    pdpi_cond_init_monotonic(&c->retire_cv);
    c->slots = ctx->opts.request_slots;
    c->signal_slots = ctx->opts.signal_slots;
    c->stats.slots = c->slots;
    c->signals = calloc(c->signal_slots, sizeof *c->signals);
    c->signal_used = calloc(c->signal_slots, 1);
    c->signal_failed = calloc(c->signal_slots, 1);
    pdpi_fault_init_from_env(c);

    pdpair_status st = PDPAIR_OK;
    uint8_t *hello = NULL, *peer = NULL;
    size_t peer_len = 0;
    bool listed = false;
    if (!c->signals || !c->signal_used || !c->signal_failed) {
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
    uint64_t token = ctx->opts.token; /* pdpair_context_set_token may change it: read once, under ctx->mu */
    wire_put_u64(hello + 8, token);
    wire_put_u32(hello + 16, c->signal_slots);
    wire_put_u32(hello + 20, c->slots);
    wire_put_u32(hello + 24, nreg);
    for (uint32_t i = 0; i < nreg; i++) wire_put_u64(hello + WIRE_HELLO_SIZE + 8 * i, ctx->regions[i].size);
    c->regions_announced = nreg;
    ctx->conns[ctx->nconns++] = c;
    ctx->refs++;
    listed = true;
    pthread_mutex_unlock(&ctx->mu);

    pdpi_net_tune(fd);
    st = pdpi_net_set_blocking(fd, false, err);
    if (st != PDPAIR_OK) goto fail;
    /* exchange_hello checked the peer's version and token as soon as its header was in */
    st = exchange_hello(fd, wake_fd, hello, hello_len, &peer, &peer_len, deadline_ns, accepting, token, err);
    if (st != PDPAIR_OK) goto fail;
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

    st = pdpi_net_set_blocking(fd, true, err);
    if (st != PDPAIR_OK) goto fail;
    if (pthread_create(&c->receiver, NULL, pdpi_receiver_main, c) != 0) {
        pdpi_format_error(err, "cannot start the receiver thread");
        st = PDPAIR_SYSTEM;
        goto fail;
    }
    if (pthread_create(&c->sender, NULL, pdpi_sender_main, c) != 0) {
        pthread_mutex_lock(&c->mu);
        pdpi_conn_break_locked(c, PDPAIR_SYSTEM, "cannot start the sender thread");
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->receiver, NULL);
        pdpi_format_error(err, "cannot start the sender thread");
        st = PDPAIR_SYSTEM;
        goto fail;
    }
    c->threads_started = true;
    *out = c;
    return PDPAIR_OK;

fail:
    if (st == PDPAIR_NO_MEMORY && !*err) pdpi_format_error(err, "out of memory setting up the connection");
    free(hello);
    free(peer);
    if (listed) {
        ctx_remove_conn(ctx, c);
        pdpi_context_unref(ctx);
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
        pdpi_format_error(err, "connect: timeout must be >= 0 ms (got %lld)", (long long)timeout_ms);
        st = PDPAIR_INVALID_ARGUMENT;
    } else {
        uint64_t deadline = pdpi_deadline_ns(timeout_ms);
        st = pdpi_net_connect(host, port, deadline, &fd, err);
        if (st == PDPAIR_OK) st = pdpi_conn_establish(ctx, fd, -1, deadline, false, err, out);
    }
    if (st != PDPAIR_OK) {
        pthread_mutex_lock(&ctx->mu);
        memcpy(ctx->err, err, sizeof err);
        pthread_mutex_unlock(&ctx->mu);
    }
    return st;
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
    pdpi_context_unref(ctx);
    return PDPAIR_OK;
}

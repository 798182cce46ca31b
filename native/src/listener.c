/* Listener: a bound TCP port; accept establishes a connection, skipping connections that hang up before their
 * hello, send a wrong one, or stay silent past PDPAIR_ACCEPT_HELLO_MS. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core.h"

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

pdpair_status pdpair_listen(pdpair_context *ctx, const char *host, uint16_t port, pdpair_listener **out)
{
    if (!ctx || !out) return PDPAIR_INVALID_ARGUMENT;
    *out = NULL;
    char err[PDPAIR_ERRLEN] = "";
    pdpair_listener *l = calloc(1, sizeof *l);
    if (!l) return PDPAIR_NO_MEMORY;
    l->fd = l->wake_fd = -1;
    pdpair_status st = pdpi_net_listen(host, port, &l->fd, &l->port, err);
    if (st == PDPAIR_OK) {
        l->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (l->wake_fd < 0) {
            pdpi_format_error(err, "eventfd: %s", strerror(errno));
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
    if (!l) return pdpi_copy_error("", buf, len);
    pthread_mutex_lock(&l->mu);
    size_t n = pdpi_copy_error(l->err, buf, len);
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
        pdpi_format_error(err, "accept: timeout must be >= 0 ms (got %lld)", (long long)timeout_ms);
        st = PDPAIR_INVALID_ARGUMENT;
    }
    uint64_t deadline = pdpi_deadline_ns(timeout_ms < 0 ? 0 : timeout_ms);
    unsigned probes = 0, refused = 0, silent = 0;
    char last[PDPAIR_ERRLEN] = "";
    while (st == PDPAIR_OK) {
        int fd = accept4(l->fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd >= 0) {
            /* One connection's hello gets at most PDPAIR_ACCEPT_HELLO_MS: one that stays silent must not hold the
             * real peer, queued behind it, until accept's own deadline. */
            uint64_t hello_deadline = pdpi_deadline_ns(PDPAIR_ACCEPT_HELLO_MS);
            bool own_deadline = hello_deadline < deadline;
            st = pdpi_conn_establish(l->ctx, fd, l->wake_fd, own_deadline ? hello_deadline : deadline, true, err, out);
            if (st == PDPAIR_PEER_CLOSED) {
                probes++; /* it hung up before finishing its hello: a TCP probe or port scan, not a peer */
            } else if (st == PDPAIR_PROTOCOL_ERROR) {
                refused++; /* a wrong hello (magic, version, token): closed unanswered */
            } else if (st == PDPAIR_TIMEOUT && own_deadline) {
                silent++;
            } else {
                break;
            }
            memcpy(last, err, sizeof last);
            err[0] = '\0';
            st = PDPAIR_OK; /* keep waiting for the real peer */
            continue;
        }
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            pdpi_format_error(err, "accept: %s", strerror(errno));
            st = pdpi_net_errno_status(errno);
            break;
        }
        struct pollfd p[2] = {{.fd = l->fd, .events = POLLIN}, {.fd = l->wake_fd, .events = POLLIN}};
        int n = poll(p, 2, pdpi_poll_ms_left(deadline));
        if (n < 0 && errno != EINTR) {
            pdpi_format_error(err, "accept poll: %s", strerror(errno));
            st = PDPAIR_SYSTEM;
        } else if (n > 0 && p[1].revents) {
            pdpi_format_error(err, "listener closed");
            st = PDPAIR_CLOSED;
        } else if (n == 0) {
            pdpi_format_error(err, "no peer completed the handshake before the deadline (%u connection(s) hung up, "
                              "%u sent a wrong hello, %u stayed silent past %d ms%s%s)", probes, refused, silent,
                              PDPAIR_ACCEPT_HELLO_MS, last[0] ? "; last: " : "", last);
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
    pdpi_context_unref(ctx);
    return PDPAIR_OK;
}

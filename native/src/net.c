/* Socket helpers: listen with SO_REUSEADDR, connect with a deadline, tuning. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "internal.h"

pdpair_status pdpi_net_errno_status(int err)
{
    switch (err) {
    case ECONNREFUSED: return PDPAIR_CONNECTION_REFUSED;
    case EADDRINUSE: return PDPAIR_ADDRESS_IN_USE;
    case ECONNRESET:
    case EPIPE: return PDPAIR_PEER_CLOSED;
    case ETIMEDOUT:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case ENETDOWN:
    case ECONNABORTED: return PDPAIR_CONNECTION_ERROR;
    case ENOMEM:
    case ENOBUFS: return PDPAIR_NO_MEMORY;
    default: return PDPAIR_SYSTEM;
    }
}

pdpair_status pdpi_net_set_blocking(int fd, bool blocking, char *err)
{
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, blocking ? (flags & ~O_NONBLOCK) : (flags | O_NONBLOCK)) < 0) {
        pdpi_format_error(err, "fcntl(O_NONBLOCK): %s", strerror(errno));
        return PDPAIR_SYSTEM;
    }
    return PDPAIR_OK;
}

void pdpi_net_tune(int fd)
{
    int one = 1, idle = 5, interval = 1, count = 3;
    unsigned int user_timeout_ms = 10000;
    /* Best effort: a failure here only weakens dead-peer detection, the waits still have deadlines. */
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    (void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
    (void)setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof user_timeout_ms);
}

static pdpair_status resolve(const char *host, uint16_t port, bool passive, struct addrinfo **out, char *err)
{
    struct addrinfo hints;
    char service[8];
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : AI_ADDRCONFIG);
    snprintf(service, sizeof service, "%u", (unsigned)port);
    int rc = getaddrinfo(host && *host ? host : NULL, service, &hints, out);
    if (rc != 0) {
        pdpi_format_error(err, "cannot resolve '%s': %s", host ? host : "", gai_strerror(rc));
        return rc == EAI_MEMORY ? PDPAIR_NO_MEMORY : PDPAIR_INVALID_ARGUMENT;
    }
    return PDPAIR_OK;
}

pdpair_status pdpi_net_listen(const char *host, uint16_t port, int *fd_out, uint16_t *port_out, char *err)
{
    struct addrinfo *ais = NULL;
    pdpair_status st = resolve(host, port, true, &ais, err);
    if (st != PDPAIR_OK) return st;
    int last_errno = 0;
    const char *last_call = "socket";
    for (struct addrinfo *ai = ais; ai; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
        if (fd < 0) {
            last_errno = errno;
            last_call = "socket";
            continue;
        }
        int one = 1;
        (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0) {
            last_errno = errno;
            last_call = "bind";
            close(fd);
            continue;
        }
        if (listen(fd, 64) < 0) {
            last_errno = errno;
            last_call = "listen";
            close(fd);
            continue;
        }
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        if (getsockname(fd, (struct sockaddr *)&ss, &sl) < 0) {
            last_errno = errno;
            last_call = "getsockname";
            close(fd);
            continue;
        }
        *port_out = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                   : ((struct sockaddr_in *)&ss)->sin_port);
        *fd_out = fd;
        freeaddrinfo(ais);
        return PDPAIR_OK;
    }
    freeaddrinfo(ais);
    pdpi_format_error(err, "%s on %s:%u failed: %s", last_call, host && *host ? host : "*", (unsigned)port,
                      strerror(last_errno));
    return pdpi_net_errno_status(last_errno);
}

static pdpair_status connect_one(const struct addrinfo *ai, uint64_t deadline_ns, int *fd_out, int *errno_out)
{
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
        *errno_out = errno;
        return PDPAIR_SYSTEM;
    }
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
        *fd_out = fd;
        return PDPAIR_OK;
    }
    if (errno != EINPROGRESS) {
        *errno_out = errno;
        close(fd);
        return pdpi_net_errno_status(*errno_out);
    }
    for (;;) {
        struct pollfd pfd = {.fd = fd, .events = POLLOUT};
        int n = poll(&pfd, 1, pdpi_poll_ms_left(deadline_ns));
        if (n < 0 && errno == EINTR) continue;
        if (n == 0) {
            close(fd);
            return PDPAIR_TIMEOUT;
        }
        if (n < 0) {
            *errno_out = errno;
            close(fd);
            return PDPAIR_SYSTEM;
        }
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0) soerr = errno;
        if (soerr != 0) {
            *errno_out = soerr;
            close(fd);
            return pdpi_net_errno_status(soerr);
        }
        *fd_out = fd;
        return PDPAIR_OK;
    }
}

pdpair_status pdpi_net_connect(const char *host, uint16_t port, uint64_t deadline_ns, int *fd_out, char *err)
{
    if (!host || !*host) {
        pdpi_format_error(err, "connect: host is empty");
        return PDPAIR_INVALID_ARGUMENT;
    }
    if (port == 0) {
        pdpi_format_error(err, "connect: port 0 is not a peer address");
        return PDPAIR_INVALID_ARGUMENT;
    }
    struct addrinfo *ais = NULL;
    pdpair_status st = resolve(host, port, false, &ais, err);
    if (st != PDPAIR_OK) return st;
    int last_errno = 0;
    st = PDPAIR_SYSTEM;
    for (struct addrinfo *ai = ais; ai; ai = ai->ai_next) {
        st = connect_one(ai, deadline_ns, fd_out, &last_errno);
        if (st == PDPAIR_OK || st == PDPAIR_TIMEOUT) break;
    }
    freeaddrinfo(ais);
    if (st == PDPAIR_TIMEOUT)
        pdpi_format_error(err, "connect to %s:%u: no answer before the deadline", host, (unsigned)port);
    else if (st != PDPAIR_OK)
        pdpi_format_error(err, "connect to %s:%u: %s", host, (unsigned)port, strerror(last_errno));
    return st;
}

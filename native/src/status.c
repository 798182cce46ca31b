/* Status texts, the version, and the helpers that fill the per-handle last-error texts. No state. */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

#define STR_(x) #x
#define STR(x) STR_(x)

int pdpair_version(void) { return PDPAIR_VERSION; }

const char *pdpair_version_string(void)
{
    return STR(PDPAIR_VERSION_MAJOR) "." STR(PDPAIR_VERSION_MINOR) "." STR(PDPAIR_VERSION_PATCH);
}

const char *pdpair_strerror(int status)
{
    switch (status) {
    case PDPAIR_OK: return "success";
    case PDPAIR_TIMEOUT: return "the deadline passed before the operation completed";
    case PDPAIR_IN_PROGRESS: return "the request is still in progress";
    case PDPAIR_INVALID_ARGUMENT: return "invalid argument (NULL, unknown region or slot, out-of-bounds range, negative timeout)";
    case PDPAIR_PEER_CLOSED: return "the peer closed the connection or died";
    case PDPAIR_CONNECTION_ERROR: return "the TCP connection failed";
    case PDPAIR_CLOSED: return "the handle was closed locally";
    case PDPAIR_REMOTE_REJECTED: return "the peer rejected the request (outside its regions or the transfer it expects, or a checksum mismatch)";
    case PDPAIR_PROTOCOL_ERROR: return "protocol error (not a pdpair peer, version or token mismatch, bad frame)";
    case PDPAIR_CONNECTION_REFUSED: return "connection refused (nobody listens at that address yet)";
    case PDPAIR_ADDRESS_IN_USE: return "the address is already in use";
    case PDPAIR_EXHAUSTED: return "no free signal slot or region entry";
    case PDPAIR_NO_MEMORY: return "out of memory";
    case PDPAIR_SYSTEM: return "an operating system call failed";
    case PDPAIR_DATA_REJECTED: return "a put meant for this signal slot was refused here (checksum, transfer or window check): do not use its data";
    default: return "unknown pdpair status";
    }
}

const char *pdpair_status_name(int status)
{
    switch (status) {
    case PDPAIR_OK: return "PDPAIR_OK";
    case PDPAIR_TIMEOUT: return "PDPAIR_TIMEOUT";
    case PDPAIR_IN_PROGRESS: return "PDPAIR_IN_PROGRESS";
    case PDPAIR_INVALID_ARGUMENT: return "PDPAIR_INVALID_ARGUMENT";
    case PDPAIR_PEER_CLOSED: return "PDPAIR_PEER_CLOSED";
    case PDPAIR_CONNECTION_ERROR: return "PDPAIR_CONNECTION_ERROR";
    case PDPAIR_CLOSED: return "PDPAIR_CLOSED";
    case PDPAIR_REMOTE_REJECTED: return "PDPAIR_REMOTE_REJECTED";
    case PDPAIR_PROTOCOL_ERROR: return "PDPAIR_PROTOCOL_ERROR";
    case PDPAIR_CONNECTION_REFUSED: return "PDPAIR_CONNECTION_REFUSED";
    case PDPAIR_ADDRESS_IN_USE: return "PDPAIR_ADDRESS_IN_USE";
    case PDPAIR_EXHAUSTED: return "PDPAIR_EXHAUSTED";
    case PDPAIR_NO_MEMORY: return "PDPAIR_NO_MEMORY";
    case PDPAIR_SYSTEM: return "PDPAIR_SYSTEM";
    case PDPAIR_DATA_REJECTED: return "PDPAIR_DATA_REJECTED";
    default: return "PDPAIR_UNKNOWN";
    }
}

/* --- last-error texts --------------------------------------------------------------------------------------- */
void pdpi_format_error(char *buf, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, PDPAIR_ERRLEN, fmt, ap);
    va_end(ap);
}

size_t pdpi_copy_error(const char *src, char *buf, size_t len)
{
    size_t n = strlen(src);
    if (buf && len > 0) {
        size_t k = n < len - 1 ? n : len - 1;
        memcpy(buf, src, k);
        buf[k] = '\0';
    }
    return n;
}

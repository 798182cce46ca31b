/* A tiny test harness: CHECK macros that stop the test binary with file:line, and a "marry" helper that joins
 * two endpoints over loopback in-process. */
#ifndef PDPAIR_TEST_HARNESS_H
#define PDPAIR_TEST_HARNESS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "pdpair/transport.h"

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);              \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define CHECK_MSG(cond, ...)                                                                       \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);              \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* Compare a status; on mismatch print both names and the connection's last error (conn may be NULL). */
#define CHECK_STATUS(expr, want, conn) check_status_at(__FILE__, __LINE__, #expr, (expr), (want), (conn))
#define CHECK_OK(expr, conn) CHECK_STATUS(expr, PDPAIR_OK, conn)

void check_status_at(const char *file, int line, const char *text, pdpair_status got, pdpair_status want,
                     pdpair_conn *conn);
uint64_t now_ms(void);
void sleep_ms(unsigned ms);

/* Join ctx_a (listening on 127.0.0.1, ephemeral port unless *port != 0) and ctx_b (connecting). On return
 * *port is the port used. Fails the test unless both sides connect. */
void marry(pdpair_context *ctx_a, pdpair_context *ctx_b, uint16_t *port, pdpair_conn **conn_a,
           pdpair_conn **conn_b);
pdpair_context *new_context(uint32_t request_slots, uint64_t token);

#endif

/* Helpers shared by the native sources that hold no transport state: time (clock.c), last-error texts
 * (status.c), checksums (crc32c.c), sockets (net.c). Not installed, not part of the API. Public functions are pdpair_* and declared in
 * include/pdpair/transport.h; internal ones shared between sources are pdpi_* ("pdpair internal"). */
#ifndef PDPAIR_INTERNAL_H
#define PDPAIR_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pdpair/transport.h"

#define PDPAIR_ERRLEN 256

/* --- time (clock.c): every wait is against a CLOCK_MONOTONIC deadline in nanoseconds ------------------------ */
uint64_t pdpi_now_ns(void);
/* timeout_ms >= 0 (checked by callers); very large timeouts are capped so the sum cannot overflow. */
uint64_t pdpi_deadline_ns(int64_t timeout_ms);
/* Milliseconds left until the deadline, rounded up, for poll(); 0 once passed. */
int pdpi_poll_ms_left(uint64_t deadline_ns);
/* pthread_cond_timedwait on a monotonic-clock condition variable. */
void pdpi_cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, uint64_t deadline_ns);
int pdpi_cond_init_monotonic(pthread_cond_t *cv);

/* --- errors (status.c) -------------------------------------------------------------------------------------- */
void pdpi_format_error(char *buf, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
size_t pdpi_copy_error(const char *src, char *buf, size_t len);

/* --- checksums (crc32c.c) ----------------------------------------------------------------------------------- */
/* CRC32C of buf, continuing from crc (0 to start; pass the previous result to checksum a buffer in pieces). The
 * fastest path this CPU has (SSE4.2 / ARMv8 CRC, chosen at run time), else a slicing-by-8 table. */
uint32_t pdpi_crc32c(uint32_t crc, const void *buf, size_t len);
/* The table path alone (tests compare both paths). */
uint32_t pdpi_crc32c_sw(uint32_t crc, const void *buf, size_t len);
/* True when pdpi_crc32c uses CPU instructions. */
bool pdpi_crc32c_hardware(void);

/* --- sockets (net.c) ---------------------------------------------------------------------------------------- */
pdpair_status pdpi_net_listen(const char *host, uint16_t port, int *fd_out, uint16_t *port_out, char *err);
/* Non-blocking connect to every resolved address in turn until one answers or the deadline passes. */
pdpair_status pdpi_net_connect(const char *host, uint16_t port, uint64_t deadline_ns, int *fd_out, char *err);
/* TCP_NODELAY, keepalive and a user timeout so a silent dead peer is noticed. */
void pdpi_net_tune(int fd);
pdpair_status pdpi_net_set_blocking(int fd, bool blocking, char *err);
/* Classify a failed socket call's errno. */
pdpair_status pdpi_net_errno_status(int err);

#endif

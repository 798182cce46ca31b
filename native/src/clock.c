/* Time: every wait is against a CLOCK_MONOTONIC deadline in nanoseconds. */
#define _GNU_SOURCE
#include <time.h>

#include "internal.h"

#define MAX_TIMEOUT_MS 1000000000000LL   /* ~31 years: keeps deadline arithmetic far from overflow */

uint64_t pdpi_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t pdpi_deadline_ns(int64_t timeout_ms)
{
    if (timeout_ms < 0) timeout_ms = 0;
    if (timeout_ms > MAX_TIMEOUT_MS) timeout_ms = MAX_TIMEOUT_MS;
    return pdpi_now_ns() + (uint64_t)timeout_ms * 1000000ull;
}

int pdpi_poll_ms_left(uint64_t deadline_ns)
{
    uint64_t now = pdpi_now_ns();
    if (now >= deadline_ns) return 0;
    uint64_t ms = (deadline_ns - now + 999999ull) / 1000000ull;
    return ms > 1000000000ull ? 1000000000 : (int)ms;
}

int pdpi_cond_init_monotonic(pthread_cond_t *cv)
{
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(cv, &attr);
    pthread_condattr_destroy(&attr);
    return rc;
}

void pdpi_cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, uint64_t deadline_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(deadline_ns / 1000000000ull),
                          .tv_nsec = (long)(deadline_ns % 1000000000ull)};
    pthread_cond_timedwait(cv, mu, &ts);
}

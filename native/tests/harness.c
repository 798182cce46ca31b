#define _GNU_SOURCE
#include "harness.h"

#include <pthread.h>
#include <time.h>

void check_status_at(const char *file, int line, const char *text, pdpair_status got, pdpair_status want,
                     pdpair_conn *conn)
{
    if (got == want) return;
    char err[256] = "";
    if (conn) pdpair_conn_last_error(conn, err, sizeof err);
    fprintf(stderr, "%s:%d: %s returned %s, want %s (%s)\n", file, line, text, pdpair_status_name(got),
            pdpair_status_name(want), err);
    exit(1);
}

uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void sleep_ms(unsigned ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

pdpair_context *new_context(uint32_t request_slots, uint64_t token)
{
    pdpair_context_options o;
    pdpair_context_options_init(&o);
    o.request_slots = request_slots;
    o.token = token;
    pdpair_context *ctx = NULL;
    CHECK_OK(pdpair_context_create(&o, &ctx), NULL);
    return ctx;
}

struct accept_job {
    pdpair_listener *lis;
    pdpair_conn *conn;
    pdpair_status st;
};

static void *accept_thread(void *arg)
{
    struct accept_job *job = arg;
    job->st = pdpair_accept(job->lis, 5000, &job->conn);
    return NULL;
}

void marry(pdpair_context *ctx_a, pdpair_context *ctx_b, uint16_t *port, pdpair_conn **conn_a,
           pdpair_conn **conn_b)
{
    struct accept_job job = {0};
    CHECK_OK(pdpair_listen(ctx_a, "127.0.0.1", *port, &job.lis), NULL);
    *port = pdpair_listener_port(job.lis);
    CHECK(*port != 0);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, accept_thread, &job) == 0);
    pdpair_status st = pdpair_connect(ctx_b, "127.0.0.1", *port, 5000, conn_b);
    pthread_join(t, NULL);
    if (st != PDPAIR_OK) {
        char err[256];
        pdpair_context_last_error(ctx_b, err, sizeof err);
        fprintf(stderr, "marry: connect: %s (%s)\n", pdpair_status_name(st), err);
        exit(1);
    }
    if (job.st != PDPAIR_OK) {
        char err[256];
        pdpair_listener_last_error(job.lis, err, sizeof err);
        fprintf(stderr, "marry: accept: %s (%s)\n", pdpair_status_name(job.st), err);
        exit(1);
    }
    *conn_a = job.conn;
    CHECK_OK(pdpair_listener_close(job.lis), NULL);
}

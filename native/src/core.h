/* The transport's objects, shared by its sources (context.c, listener.c, connection.c, conn_state.c, sender.c,
 * receiver.c, requests.c, signals.c, expect.c, faults.c). Not installed, not part of the API.
 *
 * Locking: ctx->mu (regions, connection list) may be taken before conn->mu, never after it.
 * Each connection has one mutex for its state; the signal counters are C11 atomics that the receiver
 * increments with release order after the payload bytes are in place, so an acquire read of a counter
 * guarantees the data is visible. The expectation table (expect.c) and the slots' failed marks are under conn->mu;
 * the receiver takes it to check a put's tag before it writes and again to count the put after its checksum. */
#ifndef PDPAIR_CORE_H
#define PDPAIR_CORE_H

#include <stdatomic.h>

#include "internal.h"

/* --- objects ------------------------------------------------------------------------------------------------ */
struct region {
    uint8_t *addr;
    uint64_t size;
};

struct pdpair_context {
    pthread_mutex_t mu;
    int refs; /* the caller's + one per listener + one per connection */
    bool destroyed;
    pdpair_context_options opts;
    struct region *regions;            /* capacity opts.max_regions; entries never change once published */
    _Atomic uint32_t region_count;     /* published with release after the entry is written */
    pdpair_conn **conns;               /* live connections, told about new regions */
    size_t nconns, conns_cap;
    char err[PDPAIR_ERRLEN];
};

/* A thread blocked in wait_signal / wait / flush, on the stack of that thread, linked under conn->mu, so the
 * receiver wakes waiters only when one of them is satisfied (not once per frame). */
struct waiter {
    struct waiter *next;
    uint32_t slot;   /* wait_signal: slot and expected value */
    uint64_t target; /* wait_signal: expected value; wait/flush: request id */
};

static inline void waiter_add(struct waiter **list, struct waiter *w)
{
    w->next = *list;
    *list = w;
}

static inline void waiter_remove(struct waiter **list, struct waiter *w)
{
    for (; *list; list = &(*list)->next) {
        if (*list == w) {
            *list = w->next;
            return;
        }
    }
}

struct reject_out {
    uint64_t seq;
    uint32_t reason; /* enum wire_reject */
};

struct op {
    const uint8_t *src;
    uint64_t seq, remote_offset, length, transfer;
    uint32_t remote_region, slot, crc, generation;
    uint8_t flags;
    bool corrupt; /* TEST ONLY (PDPAIR_FAULT_CORRUPT_PUTS): the sender flips one payload byte on the wire */
};

/* A transfer declared with pdpair_conn_expect: its tag, its signal slot, its windows sorted by (region, offset)
 * (never overlapping), so a put's window is found with one binary search. Each window is written once, front to
 * back: `filled` is where its next put must start, so a put written twice or into another put's place is refused. */
struct window {
    uint32_t region;
    uint64_t start, end; /* [start, end) */
    uint64_t filled;     /* bytes accepted so far, from start */
};

struct expectation {
    uint64_t id; /* 0 = free entry of the hash table */
    uint64_t signals_max, signals_seen; /* complete once seen == max (max 0: no limit) */
    uint64_t bytes_max, bytes_seen;     /* the windows' size; the bytes of its accepted puts (never above max) */
    uint32_t generation, slot;
    struct window *windows;
    uint32_t nwindows;
};

struct pdpair_conn {
    pdpair_context *ctx;
    int fd;
    pthread_t sender, receiver;
    bool threads_started;

    pthread_mutex_t mu;
    pthread_cond_t send_cv;   /* sender: work may be available */
    pthread_cond_t done_cv;   /* completion, remote regions, state changes */
    pthread_cond_t sig_cv;    /* signal counters changed */
    pthread_cond_t idle_cv;   /* close: the last API caller left */
    int users;
    struct waiter *done_waiting, *sig_waiting;
    bool closing;
    pdpair_status state;      /* OK until the connection breaks; sticky afterwards */
    char err[PDPAIR_ERRLEN];

    uint32_t slots;
    /* requests: ids 1..next_seq posted, ..sent_seq handed to the socket, ..acked_seq completed */
    uint64_t next_seq, sent_seq, acked_seq, flushed_seq;
    struct op *queue;         /* ring of posted, unsent requests */
    size_t q_head, q_len, q_cap;
    uint64_t *rejected;       /* ids the peer refused, ascending */
    size_t n_rejected, rejected_cap;

    /* things the sender owes the peer */
    uint64_t ack_to_send, ack_sent;
    struct reject_out *rejects_out;
    size_t n_rejects_out, rejects_out_cap;
    uint32_t regions_announced;

    /* peer's regions */
    uint64_t *remote_sizes;
    uint32_t n_remote, remote_cap;

    /* local signal counters */
    uint32_t signal_slots;
    _Atomic uint64_t *signals;
    uint8_t *signal_used;
    uint8_t *signal_failed;   /* a put meant for the slot was refused (its pdpair_refusal; 0 = not failed) */

    /* declared transfers (expect.c): open addressing, linear probing, capacity a power of two >= 2 x max_transfers */
    struct expectation *expect;
    uint32_t expect_cap, n_expect, max_expect;
    uint64_t expect_windows, max_expect_windows;
    /* the transfer a put is being received into right now (0 = none): retire waits until the receiver lets go */
    uint64_t recv_active_id;
    uint32_t recv_active_gen;
    pthread_cond_t retire_cv;

    /* receiver-thread only */
    uint64_t recv_seq;

    /* fault injection (TEST ONLY): set in faults.c, read by requests.c and sender.c */
    uint64_t fault_drop_every, fault_signal_count, fault_corrupt_puts, fault_misaddress_puts, fault_stale_tag_puts,
        fault_truncate_puts;
    bool fault_skip_bounds, fault_hold_sends;
    /* the tags of the last two transfers posted (for PDPAIR_FAULT_STALE_TAG_PUTS; two words a post, under mu) */
    uint64_t tag_last_id, tag_prev_id;
    uint32_t tag_last_gen, tag_prev_gen;

    pdpair_conn_stats stats;
};

/* --- context (context.c) ------------------------------------------------------------------------------------ */
/* Drops one reference (the caller's, a listener's or a connection's); the last one frees the context. */
void pdpi_context_unref(pdpair_context *ctx);
/* A local range inside a registered region: its address, or false. */
bool pdpi_local_range_ok(pdpair_context *ctx, uint32_t region, uint64_t offset, uint64_t nbytes,
                         const uint8_t **addr_out);

/* --- connection state (conn_state.c) ------------------------------------------------------------------------ */
/* API entry: OK with conn->mu held and the caller counted, or CLOSED (mu not held). */
pdpair_status pdpi_conn_enter(pdpair_conn *c);
/* API exit: uncounts the caller and releases conn->mu. */
void pdpi_conn_leave(pdpair_conn *c);
/* First error wins; wakes everybody and unblocks the thread that may sit in send/recv. conn->mu held. */
void pdpi_conn_break_locked(pdpair_conn *c, pdpair_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* --- connection life (connection.c) and its threads (sender.c, receiver.c) ---------------------------------- */
/* Handshake on a connected socket and start the threads. Takes ownership of fd (closes it on failure). wake_fd
 * (or -1) aborts the handshake when it becomes readable (listener shutdown). `accepting`: this is the listener's
 * side, which reads and checks the peer's whole hello before it sends its own. */
pdpair_status pdpi_conn_establish(pdpair_context *ctx, int fd, int wake_fd, uint64_t deadline_ns, bool accepting,
                                  char *err, pdpair_conn **out);
void *pdpi_sender_main(void *arg);
void *pdpi_receiver_main(void *arg);

/* --- declared transfers (expect.c) -------------------------------------------------------------------------- */
/* Under conn->mu: the declared transfer with this id and generation, or NULL. */
struct expectation *pdpi_expect_find_locked(pdpair_conn *c, uint64_t id, uint32_t generation);
/* Under conn->mu: the index of e's window that [offset, offset + length) of `region` continues (it starts where the
 * window's accepted bytes end and fits in it), or UINT32_MAX. */
uint32_t pdpi_expect_window(const struct expectation *e, uint32_t region, uint64_t offset, uint64_t length);
/* Frees the table (connection teardown, no other thread left). */
void pdpi_expect_free(pdpair_conn *c);

/* --- signal slots (signals.c) ------------------------------------------------------------------------------- */
/* Under conn->mu: mark a slot failed for `reason` (a pdpair_refusal; a slot keeps its first) and wake its waiters
 * (no-op for a slot out of range). */
void pdpi_signal_fail_locked(pdpair_conn *c, uint32_t slot, uint32_t reason);

/* --- fault injection, TEST ONLY (faults.c) ------------------------------------------------------------------ */
/* PDPAIR_TEST_DROP_SIGNAL_EVERY=N sets the drop fault on every new connection. */
void pdpi_fault_init_from_env(pdpair_conn *c);
/* Under conn->mu, for each post that carries a signal: true when the drop fault omits this one (counted). */
bool pdpi_fault_drops_signal_locked(pdpair_conn *c);
/* Under conn->mu, for each post with data: true when the corrupt fault flips a byte of this one. */
bool pdpi_fault_corrupts_put_locked(pdpair_conn *c);
/* Under conn->mu, for each post: records its tag, then applies the misaddress, stale-tag and truncate faults to it
 * (a truncated put's checksum is taken again over what is left). */
void pdpi_fault_apply_locked(pdpair_conn *c, struct op *o, bool has_data);

#endif

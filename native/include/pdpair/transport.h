/*
 * pdpair transport: one-sided put + signal over TCP, with backpressure instead of loss.
 *
 * Model
 *   context    options, the registered local memory regions, the listeners and connections made from it.
 *   listener   a bound TCP port (0 = ephemeral); accept() yields a connection.
 *   connection one TCP stream to one peer context, with two progress threads (sender, receiver).
 *   region     host memory registered on a context; addressed by (region index, offset). A connection
 *              learns the peer's regions in the handshake and whenever the peer registers more.
 *   signal     each connection owns `signal_slots` 64-bit counters. The peer's put_signal/signal adds
 *              exactly 1 to one of them, after the put's data bytes are in place and their checksum matched.
 *   transfer   (optional) a tag on each put: a 64-bit transfer id and a 32-bit generation. A context with
 *              `expect_transfers` accepts a put only when its tag was declared with pdpair_conn_expect and is not
 *              retired yet, and only into that transfer's windows (writes only where the reader asked). The bytes
 *              of a transfer's puts may not exceed its windows' size, and the put that brings its last declared
 *              signal is refused unless every byte of its windows has arrived (a short put fails the transfer).
 *
 * Rules
 *   - Every call returns a pdpair_status. Nothing blocks without a deadline: every waiting call takes
 *     `timeout_ms` (0 = test once and return; negative is INVALID_ARGUMENT).
 *   - Posts (put, put_signal, signal) never block and never fail for lack of capacity: each connection has
 *     `request_slots` slots (default 256); a post that finds them all busy is queued and sent in order as
 *     slots free, and counted in `requeues`.
 *   - A post returns a request id (ids grow by 1 per post on a connection, starting at 1). A request is
 *     complete when the peer has placed its data (and added its signal). Completion is in order.
 *     Test with pdpair_conn_test, wait with pdpair_conn_wait, or wait for everything with pdpair_conn_flush.
 *     Do not change a put's source bytes until it completes.
 *   - Registered memory must stay valid until the context and every connection made from it are closed.
 *   - Every put carries the CRC32C of its payload, computed when it is posted. The receiver checks it as the
 *     bytes arrive; a put that fails the check (or any other check of the receiver) is refused: the sender gets
 *     REMOTE_REJECTED, no signal is added, and the signal slot it named is marked failed, so a waiter on that slot
 *     gets DATA_REJECTED at once instead of waiting for its deadline. A refused put's bytes may already be in the
 *     destination (payloads are received in place), but they are never counted as delivered.
 *   - All functions are thread-safe. Closing a handle wakes every thread blocked on it (they get CLOSED)
 *     and waits for them to leave before freeing it.
 */
#ifndef PDPAIR_TRANSPORT_H
#define PDPAIR_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PDPAIR_VERSION_MAJOR 0
#define PDPAIR_VERSION_MINOR 1
#define PDPAIR_VERSION_PATCH 0
/* MAJOR*10000 + MINOR*100 + PATCH; pdpair_version() returns the value the library was built with. */
#define PDPAIR_VERSION (PDPAIR_VERSION_MAJOR * 10000 + PDPAIR_VERSION_MINOR * 100 + PDPAIR_VERSION_PATCH)
/* Wire protocol version, exchanged in the handshake; peers with a different one are refused.
 * 1: both sides sent their hello at once. 2: the connecting side speaks first; the listener answers only a hello
 * with its token (so the token is never sent to a peer that does not already hold it). 3: every data frame carries
 * the CRC32C of its payload and a transfer tag (56-byte frames instead of 40). */
#define PDPAIR_PROTOCOL_VERSION 3
/* How long accept waits for one connection's hello before closing it and accepting the next (within its own
 * deadline): a peer's hello is sent the moment it connects, so this only bounds what a connection that stays silent
 * (or trickles) costs the real peer queued behind it. */
#define PDPAIR_ACCEPT_HELLO_MS 2000

/* The block between the cffi markers is parsed by src/pdpair/native/_build.py: no macros inside. */
/* cffi-begin */

/* Status codes. "Who": caller = misuse of the API, peer = the other side, system = OS/network. */
typedef enum pdpair_status {
    PDPAIR_OK = 0,                 /* success */
    PDPAIR_TIMEOUT = 1,            /* the deadline passed first; the handle is still usable (nobody at fault) */
    PDPAIR_IN_PROGRESS = 2,        /* pdpair_conn_test: the request is not complete yet */
    PDPAIR_INVALID_ARGUMENT = 3,   /* caller: NULL, unknown region/slot, out-of-bounds range, negative timeout */
    PDPAIR_PEER_CLOSED = 4,        /* peer: the connection ended (EOF/reset: peer closed or died) */
    PDPAIR_CONNECTION_ERROR = 5,   /* system: the TCP connection failed (I/O error, keepalive/user timeout) */
    PDPAIR_CLOSED = 6,             /* caller: the handle was closed locally (also returned to blocked waiters) */
    PDPAIR_REMOTE_REJECTED = 7,    /* peer: the peer refused this put (outside its regions, not a transfer it
                                      expects, outside the transfer's windows, or a checksum mismatch); it added no
                                      signal and counts none of its bytes */
    PDPAIR_PROTOCOL_ERROR = 8,     /* peer: not a pdpair peer, wrong protocol version, token mismatch, bad frame */
    PDPAIR_CONNECTION_REFUSED = 9, /* peer/system: nobody listens at host:port (yet); retrying may succeed */
    PDPAIR_ADDRESS_IN_USE = 10,    /* system: the port to listen on is taken */
    PDPAIR_EXHAUSTED = 11,         /* caller: no free signal slot, or the region table is full */
    PDPAIR_NO_MEMORY = 12,         /* system: allocation failed */
    PDPAIR_SYSTEM = 13,            /* system: another OS call failed; the last-error string has errno's text */
    PDPAIR_DATA_REJECTED = 14      /* peer: pdpair_conn_wait_signal: a put meant for this slot was refused here
                                      (checksum mismatch, unknown or stale transfer, outside its windows, or its
                                      transfer's last signal came before all its bytes): the data
                                      behind this slot must not be used. Sticky until the slot is reset, allocated
                                      again or declared by a new pdpair_conn_expect. */
} pdpair_status;

typedef struct pdpair_context pdpair_context;
typedef struct pdpair_listener pdpair_listener;
typedef struct pdpair_conn pdpair_conn;

typedef struct pdpair_context_options {
    uint32_t request_slots; /* per connection; 0 = default 256 */
    uint32_t signal_slots;  /* 64-bit signal counters per connection; 0 = default 4096 */
    uint32_t max_regions;   /* local region table size; 0 = default 4096 */
    uint32_t reserved;      /* must be 0 */
    uint64_t token;         /* handshake token: both sides must use the same value (e.g. the pair generation) */
    uint32_t expect_transfers;     /* 1: connections accept puts only into transfers declared with
                                      pdpair_conn_expect (0 = accept any put inside the regions) */
    uint32_t max_transfers;        /* outstanding transfers per connection; 0 = default 4096 */
    uint32_t max_transfer_windows; /* windows of all outstanding transfers of a connection; 0 = default 1048576 */
    uint32_t skip_checksums;       /* BENCH ONLY, never in production: 1 = posts carry no CRC32C and receivers check
                                      none (tests/bench/bench_transport.py measures the checksums' cost with it).
                                      Both ends must agree: a checking receiver refuses an unchecksummed put. */
} pdpair_context_options;

/* One destination window of a transfer: [offset, offset + length) of a local region. */
typedef struct pdpair_window {
    uint32_t region;
    uint32_t reserved; /* must be 0 */
    uint64_t offset;
    uint64_t length;
} pdpair_window;

/* Counters of one connection (pdpair_conn_get_stats). */
typedef struct pdpair_conn_stats {
    uint64_t slots;              /* request slot capacity */
    uint64_t inflight;           /* requests sent and not yet acknowledged (<= slots) */
    uint64_t queued;             /* requests posted and waiting for a slot */
    uint64_t requeues;           /* posts that found every slot busy and were queued (never dropped) */
    uint64_t posted;             /* requests posted */
    uint64_t completed;          /* requests acknowledged by the peer (includes rejected ones) */
    uint64_t rejected;           /* requests the peer refused */
    uint64_t bytes_sent;         /* put payload bytes sent */
    uint64_t bytes_received;     /* put payload bytes placed into local regions */
    uint64_t signals_sent;       /* signal increments sent */
    uint64_t signals_received;   /* signal increments applied to local slots */
    uint64_t signals_dropped_by_fault; /* TEST ONLY fault injection: signals deliberately not sent */
    uint64_t remote_regions;     /* regions of the peer known here */
    /* Puts this side refused (each also counted in the peer's `rejected`): */
    uint64_t refused_unknown_transfer; /* expectation mode: tag not declared, retired, complete, or another generation */
    uint64_t refused_out_of_window;    /* expectation mode: outside the transfer's windows or another signal slot */
    uint64_t refused_checksum;         /* the payload's CRC32C did not match */
    uint64_t transfers_outstanding;    /* transfers declared (pdpair_conn_expect) and not retired */
    uint64_t refused_incomplete;       /* expectation mode: the put carrying a transfer's last declared signal
                                          arrived while fewer bytes than its windows hold had been written */
} pdpair_conn_stats;

/* Why a put was refused on arrival: the reason pdpair_conn_slot_refusal reports for a failed slot. */
typedef enum pdpair_refusal {
    PDPAIR_REFUSAL_NONE = 0,       /* the slot is not failed */
    PDPAIR_REFUSAL_BOUNDS = 1,     /* outside the receiver's regions or signal slots */
    PDPAIR_REFUSAL_TRANSFER = 2,   /* expectation mode: not an outstanding transfer (unknown, retired, complete, or
                                      another generation) */
    PDPAIR_REFUSAL_WINDOW = 3,     /* expectation mode: outside the transfer's windows, not where one goes on, or
                                      another signal slot */
    PDPAIR_REFUSAL_CHECKSUM = 4,   /* the payload's CRC32C did not match */
    PDPAIR_REFUSAL_INCOMPLETE = 5  /* expectation mode: the transfer's last signal came before all of its bytes */
} pdpair_refusal;

/* TEST ONLY fault injection kinds (pdpair_conn_set_fault). Never enable in production. */
typedef enum pdpair_fault {
    PDPAIR_FAULT_NONE = 0,
    PDPAIR_FAULT_DROP_EVERY_NTH_SIGNAL = 1, /* the sender omits the signal of every n-th put_signal/signal */
    PDPAIR_FAULT_SKIP_SENDER_BOUNDS_CHECK = 2, /* n != 0: posts skip the local check, so the peer's check runs */
    PDPAIR_FAULT_HOLD_SENDS = 3, /* n != 0: the sender sends no new request (a stalled link); n = 0 resumes */
    PDPAIR_FAULT_CORRUPT_PUTS = 4, /* the next n puts with data each go out with one payload byte flipped, after
                                      their checksum was computed (corruption on the way) */
    PDPAIR_FAULT_MISADDRESS_PUTS = 5, /* the next n puts with data go to offset 0 of their remote region (a block no
                                         transfer asked for: vLLM's block 0 is its null block) */
    PDPAIR_FAULT_STALE_TAG_PUTS = 6,  /* the next n tagged puts carry the tag of the previous transfer posted on this
                                         connection (a stale or reused transfer reference; with none yet, their own
                                         id with the next generation) */
    PDPAIR_FAULT_TRUNCATE_PUTS = 7    /* the next n puts with data send only the first half of their bytes, with
                                         that half's checksum (a put cut short that is otherwise well formed) */
} pdpair_fault;

/* Library version (PDPAIR_VERSION of the build) and a static version string. */
int pdpair_version(void);
const char *pdpair_version_string(void);
/* Never NULL: a fixed text for every code, "unknown pdpair status" for anything else. */
const char *pdpair_strerror(int status);
/* Never NULL: "PDPAIR_OK", "PDPAIR_TIMEOUT", ... or "PDPAIR_UNKNOWN". */
const char *pdpair_status_name(int status);

/* Fill `opts` with the defaults (all zero means defaults too). */
void pdpair_context_options_init(pdpair_context_options *opts);
/* opts may be NULL for defaults. */
pdpair_status pdpair_context_create(const pdpair_context_options *opts, pdpair_context **out);
/* Releases the caller's reference; memory is freed when the last connection made from it is closed too. */
pdpair_status pdpair_context_destroy(pdpair_context *ctx);
/* Register [addr, addr+size) (size > 0). The region index is dense, starting at 0. Announced to every current
 * and future connection of this context. Regions stay registered for the context's life. */
pdpair_status pdpair_context_register(pdpair_context *ctx, void *addr, uint64_t size, uint32_t *region_out);
uint32_t pdpair_context_region_count(pdpair_context *ctx);
/* Replace the handshake token for every later connect and accept of this context (e.g. a secret both sides derive
 * after authenticating each other elsewhere, once a listener is already bound). */
pdpair_status pdpair_context_set_token(pdpair_context *ctx, uint64_t token);
/* Copies the context's last error text (always NUL-terminated, "" if none); returns the full length. */
size_t pdpair_context_last_error(pdpair_context *ctx, char *buf, size_t len);

/* Listen on host:port (host NULL or "" = all interfaces; port 0 = ephemeral). SO_REUSEADDR is set, so a port
 * freed by pdpair_listener_close can be listened on again at once. */
pdpair_status pdpair_listen(pdpair_context *ctx, const char *host, uint16_t port, pdpair_listener **out);
uint16_t pdpair_listener_port(pdpair_listener *lis);
/* Wait up to timeout_ms for one peer and run the handshake (within the same deadline). TIMEOUT if no peer came.
 * The connecting side speaks first: the listener reads the peer's whole hello and checks magic, version and token
 * (constant-time) before it sends anything, so a peer without the token learns nothing, not even the token.
 * Connections that hang up before finishing their hello (TCP probes, port scans), send a wrong hello, or do not
 * finish it within PDPAIR_ACCEPT_HELLO_MS are closed and the wait goes on; at the deadline the TIMEOUT's error text
 * counts them and names the last one's fault. */
pdpair_status pdpair_accept(pdpair_listener *lis, int64_t timeout_ms, pdpair_conn **out);
size_t pdpair_listener_last_error(pdpair_listener *lis, char *buf, size_t len);
/* Make every blocked and future accept() return CLOSED; the handle stays valid until pdpair_listener_close. */
pdpair_status pdpair_listener_shutdown(pdpair_listener *lis);
/* Shut down, wait for callers to leave, close the port (it can be listened on again at once), free. */
pdpair_status pdpair_listener_close(pdpair_listener *lis);

/* Connect to host:port and run the handshake, all within timeout_ms. The listener answers only a hello with its
 * token: with another token the peer closes the connection (PEER_CLOSED, "hung up during the handshake"). */
pdpair_status pdpair_connect(pdpair_context *ctx, const char *host, uint16_t port, int64_t timeout_ms,
                             pdpair_conn **out);

/* Posts. local/remote are region indexes; the ranges are checked against the local table and the peer's
 * announced table (INVALID_ARGUMENT if outside), and checked again by the peer before it writes anything.
 * nbytes may be 0. request_out may be NULL. */
pdpair_status pdpair_put(pdpair_conn *c, uint32_t local_region, uint64_t local_offset, uint32_t remote_region,
                         uint64_t remote_offset, uint64_t nbytes, uint64_t *request_out);
/* put, then add exactly 1 to the peer's signal slot, visible only after the bytes are in place. */
pdpair_status pdpair_put_signal(pdpair_conn *c, uint32_t local_region, uint64_t local_offset,
                                uint32_t remote_region, uint64_t remote_offset, uint64_t nbytes,
                                uint32_t remote_signal_slot, uint64_t *request_out);
/* Add exactly 1 to the peer's signal slot, after every earlier put on this connection is in place. */
pdpair_status pdpair_signal(pdpair_conn *c, uint32_t remote_signal_slot, uint64_t *request_out);
/* The same posts carrying a transfer tag (the untagged ones send transfer id 0, which no transfer may use). A peer in
 * expectation mode accepts them only while (transfer_id, generation) is declared there and only into its windows. */
pdpair_status pdpair_put_tagged(pdpair_conn *c, uint64_t transfer_id, uint32_t generation, uint32_t local_region,
                                uint64_t local_offset, uint32_t remote_region, uint64_t remote_offset, uint64_t nbytes,
                                uint64_t *request_out);
pdpair_status pdpair_put_signal_tagged(pdpair_conn *c, uint64_t transfer_id, uint32_t generation,
                                       uint32_t local_region, uint64_t local_offset, uint32_t remote_region,
                                       uint64_t remote_offset, uint64_t nbytes, uint32_t remote_signal_slot,
                                       uint64_t *request_out);
pdpair_status pdpair_signal_tagged(pdpair_conn *c, uint64_t transfer_id, uint32_t generation,
                                   uint32_t remote_signal_slot, uint64_t *request_out);

/* Expectation mode (context option expect_transfers), on the receiving side. Declare a transfer before asking the
 * peer for it: puts tagged (transfer_id, generation) are then accepted into these windows of local regions and may
 * signal only `signal_slot`. Windows may not overlap; each is written once, front to back: a put must start where
 * the window's accepted bytes end and fit in it (so no byte is written twice, and a put into another's place is
 * refused). With expected_signals > 0 the transfer is complete once that many of its signals were added: any later
 * put of it (a duplicate, a replay) is refused before a byte is written, and the put that brings the last signal is
 * refused unless every byte of the windows has arrived. Clears the slot's failed mark. transfer_id 0 is reserved for untagged puts. INVALID_ARGUMENT: id 0, a window outside
 * the local regions or of length 0, overlapping windows, a slot out of range, the id already declared (retire it first). EXHAUSTED: the
 * connection's max_transfers or max_transfer_windows would be exceeded. Also allowed without expectation mode (the
 * declaration is then unused). */
pdpair_status pdpair_conn_expect(pdpair_conn *c, uint64_t transfer_id, uint32_t generation, uint32_t signal_slot,
                                 uint64_t expected_signals, const pdpair_window *windows, size_t nwindows);
/* Retire a declared transfer (done, failed or timed out): later puts with its tag are refused. On OK, no byte of it
 * is written any more, so its windows can be given to another transfer. If one of its puts is being received at that
 * moment, retire waits up to timeout_ms for it to land; if it is still arriving then, retire breaks the connection
 * (CONNECTION_ERROR, the peer sees PEER_CLOSED) so the write stops, and returns TIMEOUT once the receiver has let
 * go of the windows. INVALID_ARGUMENT if (transfer_id, generation) is not declared. */
pdpair_status pdpair_conn_retire(pdpair_conn *c, uint64_t transfer_id, uint32_t generation, int64_t timeout_ms);

/* OK if request `request` is complete, IN_PROGRESS if not, REMOTE_REJECTED if the peer refused it,
 * otherwise the connection's error. */
pdpair_status pdpair_conn_test(pdpair_conn *c, uint64_t request);
/* Wait until `request` completes: OK, REMOTE_REJECTED, TIMEOUT, or the connection's error. */
pdpair_status pdpair_conn_wait(pdpair_conn *c, uint64_t request, int64_t timeout_ms);
/* Wait until every request posted before this call has completed. REMOTE_REJECTED if any of them was refused
 * since the last flush. */
pdpair_status pdpair_conn_flush(pdpair_conn *c, int64_t timeout_ms);

/* Local signal slots (the ones the peer adds to). */
uint32_t pdpair_conn_signal_slots(pdpair_conn *c);
pdpair_status pdpair_conn_read_signal(pdpair_conn *c, uint32_t slot, uint64_t *value_out);
/* Set the slot to 0 and clear its failed mark (DATA_REJECTED). */
pdpair_status pdpair_conn_reset_signal(pdpair_conn *c, uint32_t slot);
/* Why `slot` is failed: the pdpair_refusal of the first put refused for it since the slot was last cleared (reset,
 * allocated, or declared by pdpair_conn_expect); PDPAIR_REFUSAL_NONE when it is not failed. Per slot, so a load's
 * reason is its own even while refusals of other loads are counted on the same connection. */
pdpair_status pdpair_conn_slot_refusal(pdpair_conn *c, uint32_t slot, int *refusal_out);
/* Hand out a free slot (reset to 0, failed mark cleared) / give it back. EXHAUSTED when none is free. */
pdpair_status pdpair_conn_alloc_signal(pdpair_conn *c, uint32_t *slot_out);
pdpair_status pdpair_conn_free_signal(pdpair_conn *c, uint32_t slot);
/* Wait until slot's value >= expected. OK (value_out set), TIMEOUT at the deadline, DATA_REJECTED at once when a put
 * meant for this slot was refused here (even if the value reached `expected`: the refused put's bytes may be in
 * place), or the connection's error once the connection is broken and the value is still short (value_out set in
 * every case). */
pdpair_status pdpair_conn_wait_signal(pdpair_conn *c, uint32_t slot, uint64_t expected, int64_t timeout_ms,
                                      uint64_t *value_out);

/* The peer's regions known here (count, and the size of one). */
uint32_t pdpair_conn_remote_region_count(pdpair_conn *c);
pdpair_status pdpair_conn_remote_region_size(pdpair_conn *c, uint32_t region, uint64_t *size_out);
/* Wait until at least `count` peer regions are known. */
pdpair_status pdpair_conn_wait_remote_regions(pdpair_conn *c, uint32_t count, int64_t timeout_ms);

/* stats_size = sizeof(pdpair_conn_stats) of the caller (fields beyond it are not written). */
pdpair_status pdpair_conn_get_stats(pdpair_conn *c, pdpair_conn_stats *stats, size_t stats_size);
/* OK while usable, else the sticky error (PEER_CLOSED, CONNECTION_ERROR, PROTOCOL_ERROR, CLOSED). */
pdpair_status pdpair_conn_state(pdpair_conn *c);
/* TEST ONLY: enable a fault (n = 0 disables). The env var PDPAIR_TEST_DROP_SIGNAL_EVERY=N sets
 * DROP_EVERY_NTH_SIGNAL on every new connection. */
pdpair_status pdpair_conn_set_fault(pdpair_conn *c, int fault, uint64_t n);
size_t pdpair_conn_last_error(pdpair_conn *c, char *buf, size_t len);
/* Break the connection now: every blocked and future call returns CLOSED (the peer sees PEER_CLOSED).
 * The handle stays valid until pdpair_conn_close. Bindings use it to wake their threads before freeing. */
pdpair_status pdpair_conn_shutdown(pdpair_conn *c);
/* Shut down (pending requests are abandoned: flush first to finish them), wait for callers to leave, stop the
 * threads, close the socket, free. */
pdpair_status pdpair_conn_close(pdpair_conn *c);

/* cffi-end */

#ifdef __cplusplus
}
#endif

#endif /* PDPAIR_TRANSPORT_H */

"""Every bound the connector derives from the hang timeout (PDPAIR_HANG_TIMEOUT_SECONDS), named for its use.

One knob bounds every wait of a pair, so an operator tunes one number and the hang verdict (`contract.is_hung`)
agrees with the waits it judges. Deadlines are `time.monotonic()` values; `start` is the moment the bound counts from.
"""

from __future__ import annotations

# Prefill keeps a finished request's blocks for decode to claim for several hang timeouts, so a slow decode is never
# served freed blocks; past the lease they are freed (and a late Pull is refused).
SEND_LEASE_FACTOR = 4.0


def handshake_deadline(hang_timeout_seconds: float, start: float) -> float:
    """Both sides, after Accepted: init_pair, registering the regions and exchanging the region tables."""
    return start + hang_timeout_seconds


def signal_wait_deadline(hang_timeout_seconds: float, pulled_at: float) -> float:
    """Decode: a load's wait for all its signals, counted from its Pull."""
    return pulled_at + hang_timeout_seconds


# A parked Pull is answered within this share of the hang timeout: its PullFailed must reach decode BEFORE decode's
# own wait for that load ends (signal_wait_deadline, a full hang timeout from the Pull). A wait that times out stays
# open as a deficit and makes decode's pod hung until the pair restarts, so a Pull for KV prefill does not hold (a
# consumed or expired reference replayed) must end as a clean failure, never as a timeout.
PARKED_PULL_SHARE = 0.5


def parked_pull_deadline(hang_timeout_seconds: float, received_at: float) -> float:
    """Prefill: a Pull that came before its request's blocks (scheduler metadata) waits until then, then PullFailed."""
    return received_at + PARKED_PULL_SHARE * hang_timeout_seconds


def keyed_pull_deadline(hang_timeout_seconds: float, received_at: float) -> float:
    """Prefill: a Pull that names the router's transfer key (both legs at once) comes before its prompt is computed;
    it is parked until the prompt is, at most as long as a computed prompt's blocks are held for decode (the send
    lease), then PullFailed. A longer prefill queue than that fails the request."""
    return received_at + SEND_LEASE_FACTOR * hang_timeout_seconds


def keyed_start_deadline(hang_timeout_seconds: float, pulled_at: float) -> float:
    """Decode: a keyed Pull's wait for prefill to start serving it (PullStarted): prefill's own bound
    (keyed_pull_deadline) plus a hang timeout, so prefill's PullFailed comes first; from PullStarted on, the wait's
    deadline is signal_wait_deadline."""
    return keyed_pull_deadline(hang_timeout_seconds, pulled_at) + hang_timeout_seconds


def flush_deadline(hang_timeout_seconds: float, last_put: float) -> float:
    """Prefill: every put of one Pull has completed locally."""
    return last_put + hang_timeout_seconds


# Decode retires a load's transfer before its blocks go back to the engine. Retiring is immediate unless a put of it is
# arriving at that moment (one block of one layer: microseconds to milliseconds); one still arriving after this long
# comes from a stalled peer, and the transport then breaks the connection rather than let its bytes land later.
RETIRE_SECONDS_MAX = 1.0


def retire_deadline(hang_timeout_seconds: float, start: float) -> float:
    """Decode: retiring a settled load's transfer (waiting for a put of it that is arriving right now)."""
    return start + min(RETIRE_SECONDS_MAX, hang_timeout_seconds)


def send_lease_seconds(hang_timeout_seconds: float) -> float:
    """Prefill: how long a finished request's blocks stay held for decode's Pull."""
    return SEND_LEASE_FACTOR * hang_timeout_seconds


def transport_blocking_seconds(hang_timeout_seconds: float) -> float:
    """A transport's bound on a blocking call without a caller's deadline (flagcx: a put waiting for a slot, a
    collective registration)."""
    return hang_timeout_seconds


# Peer death, counted from the fault (the SIGKILL, the hang-up), not from its detection: a load whose prefill died
# mid-transfer fails within this long. The kernel closes a killed process's sockets at once (FIN or RST), the native
# waiter wakes on the broken connection (the C test measures 0-86 ms under load) and the worker's waiter looks every
# WAIT_SLICE_SECONDS; 2 s is that with a busy 2-core box's margin. A host that goes silent instead (a partition) sends
# nothing: it is noticed by the side channel's heartbeats, within DISCONNECT_GRACE_SECONDS + this. The same bound
# holds the other way: a decode that dies has prefill free the blocks it held for it (PrefillWorker._on_edge_lost)
# within this long, as prefill's side channel sees the hang-up at once.
PEER_DEATH_SECONDS = 2.0

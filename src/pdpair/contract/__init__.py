"""The names every pdpair piece shares: CRD identity, pod environment, metrics, alerts, labels.

This module is the single source of truth. It imports nothing heavy (no vllm, no kopf, no kubernetes),
so the operator, the connector, the router, the chart checks and the tests can all import it.
Rename a name here only together with every user; tests/unit/test_contract_drift.py checks the chart.
"""

from __future__ import annotations

from dataclasses import dataclass

# --- InferencePair custom resource -------------------------------------------------------------
GROUP = "pdpair.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePair"
PLURAL = "inferencepairs"
SINGULAR = "inferencepair"
SHORT_NAME = "ipair"

# The per-role scale objects (docs/xpyd.md section 2): one InferencePairRole `<pair>-<role>` per role, owned by the
# pair, with the /scale subresource (kubectl scale, HPA, KEDA). Same group and version as the pair.
ROLE_OBJECT_KIND = "InferencePairRole"
ROLE_OBJECT_PLURAL = "inferencepairroles"
ROLE_OBJECT_SINGULAR = "inferencepairrole"
ROLE_OBJECT_SHORT_NAME = "ipr"

ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLE_ROUTER = "router"
ROLES = (ROLE_PREFILL, ROLE_DECODE)

TRANSPORT_FLAGCX = "flagcx"
TRANSPORT_TCP = "tcp"
TRANSPORTS = (TRANSPORT_FLAGCX, TRANSPORT_TCP)

# Defaults the operator and the connector share, declared once. The CRD states the same default and bounds for
# spec.connector.hangTimeoutSeconds and spec.connector.slots (tests/unit/test_contract_defaults.py checks); the
# connector applies them when a pod runs without the operator's env.
# kv_transfer_params key, router -> prefill: the base URL of the decode the router chose for the request. Prefill
# frees the request's held blocks as soon as its pair with that decode is lost (connector/prefill_worker.py).
KV_PARAM_REMOTE_DECODE_URL = "remote_decode_url"
# kv_transfer_params key, router -> both engines when it sends both legs at once: the transfer's key, made by the router
# before prefill computed anything (connector/metadata.py PARAM_TRANSFER_KEY).
KV_PARAM_TRANSFER_KEY = "pdpair_transfer_key"

DEFAULT_HANG_TIMEOUT_SECONDS = 60.0  # deadline of one signal wait; a wait older than this is a hang
DEFAULT_TRANSPORT_SLOTS = 256  # request slots per peer connection (puts in flight); a full pool defers posts
MAX_TRANSPORT_SLOTS = 4096
# FlagCX's IB adaptor has 256 request slots per connection and its RMA proxy ring holds 256 descriptors: more
# would drop puts, which is the signal-wait hang pdpair exists to end.
MAX_FLAGCX_TRANSPORT_SLOTS = 256
# Read by libflagcx itself: a same-vendor pair needs a heterogeneous communicator for one-sided ops (without it init
# fails at flagcxReadCounter). The operator puts these in flagcx pods and the connector sets them before loading
# libflagcx; a value the pod sets itself always wins.
FLAGCX_ENV_DEFAULTS = {"FLAGCX_USE_HETERO_COMM": "1"}

PHASE_PENDING = "Pending"
PHASE_DECODE_STARTING = "DecodeStarting"
PHASE_PREFILL_STARTING = "PrefillStarting"
PHASE_READY = "Ready"
PHASE_RESTARTING = "Restarting"
PHASE_FAILED = "Failed"
PHASES = (
    PHASE_PENDING,
    PHASE_DECODE_STARTING,
    PHASE_PREFILL_STARTING,
    PHASE_READY,
    PHASE_RESTARTING,
    PHASE_FAILED,
)

COND_PORTS_LEASED = "PortsLeased"
COND_DECODE_LISTENING = "DecodeListening"
COND_PREFILL_READY = "PrefillReady"
COND_READY = "Ready"
COND_SIGNALS_HEALTHY = "SignalsHealthy"
COND_PROGRESSING = "Progressing"  # a Surge rollout: the new generation comes up beside the serving one
COND_NODE_LOST = "NodeLost"  # True while a pod of the pair sits on a lost node (it names the node and the pods)
# True while a role's InferencePairRole holds a count other than the pair's inline spec.<role>.replicas (the role
# object wins; docs/xpyd.md section 2); the message names the object and both counts.
COND_REPLICAS_FROM_SCALE_TARGET = "ReplicasFromScaleTarget"
# With spec.scaling.ratio (operator/ratio_band.py): True while a count another writer set on the follower role's
# InferencePairRole was outside the band and moved back (until the leader's count next moves); the message names it.
COND_SCALING_CONFLICT = "ScalingConflict"
CONDITIONS = (COND_PORTS_LEASED, COND_DECODE_LISTENING, COND_PREFILL_READY, COND_READY, COND_SIGNALS_HEALTHY,
              COND_PROGRESSING, COND_NODE_LOST, COND_REPLICAS_FROM_SCALE_TARGET, COND_SCALING_CONFLICT)

# spec.rolloutStrategy
ROLLOUT_RECREATE = "Recreate"
ROLLOUT_SURGE = "Surge"
ROLLOUT_STRATEGIES = (ROLLOUT_RECREATE, ROLLOUT_SURGE)

# --- labels and annotations the operator puts on what it owns ----------------------------------
LABEL_PAIR = "pdpair.io/pair"
LABEL_PAIR_NAMESPACE = "pdpair.io/pair-namespace"
LABEL_PAIR_UID = "pdpair.io/pair-uid"
LABEL_ROLE = "pdpair.io/role"
LABEL_GENERATION = "pdpair.io/generation"
# On a pair's engine pods and port Leases: the instance's index within its role and generation (xPyD,
# docs/xpyd.md section 1). Absent means 0: pods and Leases made before instances existed are instance 0.
LABEL_INSTANCE = "pdpair.io/instance"
# spec.<role>.replicas: instances per role. The CRD declares the same default and bounds
# (tests/unit/test_contract_defaults.py holds them equal); a spec read from the API always carries it.
DEFAULT_REPLICAS = 1
# On an engine pod chosen for removal by a scale-down: when the operator began draining it (epoch seconds). From
# then on it is out of the router's set; it is deleted once the router reports no request involving it, at the latest
# after spec.rollout.drainSeconds (operator/instances.py).
ANNOTATION_DRAINING_SINCE = "pdpair.io/draining-since"
# On a prefill or router pod: the digest of the peer set it was created with or last pushed (operator/instances.py).
ANNOTATION_PEERS_DIGEST = "pdpair.io/peers-digest"
MAX_REPLICAS = 16
# spec.router.replicas: router pods per generation, spread across nodes, each fed the same sets (the CRD declares the
# same default and bounds; tests/unit/test_contract_defaults.py holds them equal). Two, so that one lost node never
# takes the pair's only router.
DEFAULT_ROUTER_REPLICAS = 2
MAX_ROUTER_REPLICAS = 8
LABEL_PORT_LEASE = "pdpair.io/port-lease"
LABEL_PURPOSE = "pdpair.io/purpose"
# On a port Lease: which of the pair's two port sets it belongs to ("a", the default when absent, or "b"). A Surge
# rollout leases the new generation's ports in the set the serving generation does not use.
LABEL_PORT_SLOT = "pdpair.io/port-slot"
PORT_SLOTS = ("a", "b")
FINALIZER = "pdpair.io/finalizer"
ANNOTATION_SPEC_HASH = "pdpair.io/spec-hash"  # on pair pods: fingerprint of the spec they were built from
ANNOTATION_RESTART_TIMES = "pdpair.io/restart-times"  # on the pair: JSON list of restart epochs inside the window
# On the pair (xPyD): the per-instance replacements of its serving generation, JSON {"generation": g, "times":
# {"<role>-<index>": [epoch, ...]}} (operator/instances.py: each instance has its own restart budget).
ANNOTATION_INSTANCE_RESTART_TIMES = "pdpair.io/instance-restart-times"

# --- ports the operator leases (status.ports[].purpose, Lease label pdpair.io/purpose) --------------
PURPOSE_SIDECHANNEL = "sidechannel"
PURPOSE_METRICS = "metrics"
PURPOSE_HTTP = "http"
PURPOSES = (PURPOSE_SIDECHANNEL, PURPOSE_METRICS, PURPOSE_HTTP)
LEASE_NAME_PREFIX = "pdpair-port-"  # one coordination.k8s.io Lease per port: pdpair-port-<port>


def parse_probe_wait(query_value: str | None) -> float:
    """The seconds a probe asks to be held (PROBE_WAIT_PARAM's value; None or absent: 0), capped at
    PROBE_WAIT_MAX_SECONDS; a ValueError naming the parameter for anything but a finite number >= 0."""
    if query_value is None or query_value == "":
        return 0.0
    try:
        seconds = float(query_value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{PROBE_WAIT_PARAM} must be a number of seconds >= 0, got {query_value!r}")
    return min(seconds, PROBE_WAIT_MAX_SECONDS)


def probe_hold_pause(passed: bool, left: float, interval: float | None = None) -> float | None:
    """A held probe's next move (PROBE_WAIT_PARAM), given whether this check passed and the seconds left of its
    wait: None to answer now (it passed, or the wait is over: no new check starts after it), else the seconds to
    sleep before checking again (`interval`, default PROBE_WAIT_POLL_SECONDS, or what is left). The connector's
    (sync) and the router's (async) /readyz loops both ask this."""
    if passed or left <= 0:
        return None
    return min(PROBE_WAIT_POLL_SECONDS if interval is None else interval, left)


def status_port_name(role: str, purpose: str, index: int, instance: int = 0) -> str:
    """status.ports[].name: `<role>-<purpose>-<index>` for instance 0 (the CRD's Decode Port column reads
    decode-sidechannel-0, and a pair made before instances existed keeps its names), `<role>-<purpose>-<index>-i<n>`
    for instance n >= 1."""
    return f"{role}-{purpose}-{index}" if not instance else f"{role}-{purpose}-{index}-i{instance}"


# --- a leased port that something else on the node already holds (the pod's termination message) ---------------
# The port preflight in front of every hostNetwork pod's command (pdpair.connector.preflight), and the connector when
# its own bind fails, write one line `pdpair: ports in use on this node: 20003 20004` to /dev/termination-log; the
# operator reads it from the pod's status, quarantines those ports and leases the pair replacements (docs/design.md,
# "A leased port in use").
PORTS_IN_USE_PREFIX = "pdpair: ports in use on this node:"
LABEL_PORT_QUARANTINE = "pdpair.io/port-quarantine"  # on a port Lease held for a port found busy on a node
QUARANTINE_HOLDER_PREFIX = "node-busy/"  # holderIdentity of such a Lease: node-busy/<node>
ANNOTATION_QUARANTINE_NODE = "pdpair.io/busy-on-node"
ANNOTATION_QUARANTINE_REASON = "pdpair.io/busy-reason"

# --- a port fenced to a pod on a lost node (docs/design.md, "Lost nodes") ----------------------------------------
# A pod whose node is lost (unreachable, or NotReady for longer than the operator's nodeLostSeconds) may still be
# running and bound to its ports, however long the partition lasts. Its pair's leases of those ports become fence
# Leases (LABEL_PORT_QUARANTINE too, so no pair leases them), held for exactly as long as that pod object exists: the
# sweep releases one only once the pod named in ANNOTATION_FENCED_POD (namespace/name/uid) is gone. No TTL.
FENCE_HOLDER_PREFIX = "node-lost/"  # holderIdentity of a fence Lease: node-lost/<node>
ANNOTATION_FENCED_POD = "pdpair.io/fenced-pod"  # <namespace>/<name>/<uid> of the pod the port stays fenced to


def ports_in_use_message(ports, detail: str = "") -> str:
    """The termination-message line naming busy ports (sorted, unique), then an optional human-readable detail."""
    line = f"{PORTS_IN_USE_PREFIX} {' '.join(str(p) for p in sorted({int(p) for p in ports}))}"
    return f"{line}\n{detail}\n" if detail else f"{line}\n"


def parse_ports_in_use(message: str | None) -> tuple[int, ...]:
    """The ports a termination message names as busy (sorted, unique); () when it has no such line."""
    found: set[int] = set()
    for line in (message or "").splitlines():
        if not line.startswith(PORTS_IN_USE_PREFIX):
            continue
        for word in line[len(PORTS_IN_USE_PREFIX):].replace(",", " ").split():
            if word.isdigit() and 1 <= int(word) <= 65535:
                found.add(int(word))
    return tuple(sorted(found))


# --- environment the operator sets on pair pods ------------------------------------------------
ENV_ROLE = "PDPAIR_ROLE"
ENV_PAIR = "PDPAIR_PAIR"
ENV_NAMESPACE = "PDPAIR_NAMESPACE"
ENV_GENERATION = "PDPAIR_GENERATION"
ENV_LISTEN_PORT_BASE = "PDPAIR_LISTEN_PORT_BASE"
ENV_PEER_HOST = "PDPAIR_PEER_HOST"
ENV_PEER_PORT_BASE = "PDPAIR_PEER_PORT_BASE"
# Prefill: every decode it pairs with, `host:portBase,host:portBase,...` (IPv6 hosts in brackets, `[fd00::7]:20000`).
# Unset: the one decode of PDPAIR_PEER_HOST / PDPAIR_PEER_PORT_BASE (what the operator sets today, 1P1D).
ENV_PEERS = "PDPAIR_PEERS"
# Prefill: this instance's identity, sent in Hello and in kv_transfer_params, so a decode paired with several
# prefills sends each Pull on the edge of the prefill that computed the request. Unset: `<hostname>:<PDPAIR_HTTP_PORT>`
# (the HTTP port is leased per instance). Characters of a metric label value ([A-Za-z0-9_.:-[]/], at most 128).
ENV_INSTANCE = "PDPAIR_INSTANCE"
# Prefill: the bearer token of `PUT PEERS_PATH` on its metrics port (the operator's push of the peer set; per pair, from
# a Secret). Unset: the endpoint answers 404 and the set stays what PDPAIR_PEERS (or PEER_HOST/_PORT_BASE) said.
ENV_PEERS_TOKEN = "PDPAIR_PEERS_TOKEN"
# Prefill and decode (never the router): the pair's side-channel key, from the pair's Secret (key
# SIDE_CHANNEL_SECRET_KEY). Every Hello is authenticated with it (HMAC challenge-response, docs/security.md) before it
# may change an edge; a router, which holds only the push token, cannot pair as a prefill.
ENV_SIDE_CHANNEL_KEY = "PDPAIR_SIDE_CHANNEL_KEY"
SIDE_CHANNEL_SECRET_KEY = "side-channel-key"
# Prefill, decode and router, only with spec.apiKeySecret: the key of the pair's OpenAI API, from the user's Secret
# (secretKeyRef, never a value or a flag). vLLM's own variable (vllm/envs.py): vLLM answers 401 to a /v1 request
# without `Authorization: Bearer <key>`; the router requires the same of its clients and sends it on to the engines;
# the connector's warm-up sends it to its own engine. Empty or unset: no key. Not PDPAIR_*, so not in POD_ENV.
ENV_API_KEY = "VLLM_API_KEY"
# Decode: most prefill edges per TP rank (one per paired prefill instance); a Hello from a further prefill is refused
# until an edge closes. Unset: DEFAULT_MAX_EDGES. The operator may set the prefill role's replica bound.
ENV_MAX_EDGES = "PDPAIR_MAX_EDGES"
DEFAULT_MAX_EDGES = 64
ENV_METRICS_PORT = "PDPAIR_METRICS_PORT"
ENV_HTTP_PORT = "PDPAIR_HTTP_PORT"
ENV_HANG_TIMEOUT_SECONDS = "PDPAIR_HANG_TIMEOUT_SECONDS"
ENV_TRANSPORT = "PDPAIR_TRANSPORT"
ENV_TRANSPORT_SLOTS = "PDPAIR_TRANSPORT_SLOTS"  # puts in flight per peer (spec.connector.slots)
# Prefill: `true` or `false` (spec.connector.layerwisePuts). true: a request sent with both legs at once (the router's
# transfer key) is put to decode layer by layer while prefill computes it, each layer as soon as the model wrote it;
# false: after the request finished, every layer at once. Unset: DEFAULT_LAYERWISE_PUTS.
ENV_LAYERWISE_PUTS = "PDPAIR_LAYERWISE_PUTS"
DEFAULT_LAYERWISE_PUTS = True
# TEST ONLY, never set by the operator: the path of prefill's signal-drop knob file (kv_connector_extra_config's
# test_drop_signals_file), settable through a pod template's env because the operator owns the extra config. Not
# PDPAIR_*: the CRD reserves that prefix for the operator's variables.
ENV_TEST_DROP_SIGNALS_FILE = "TEST_ONLY_PDPAIR_DROP_SIGNALS_FILE"
# TEST ONLY, never set by the operator, likewise: the path of decode's slow-step knob file (kv_connector_extra_config's
# test_slow_decode_file), so a test can set it on every decode pod of a pair and slow one of them.
ENV_TEST_SLOW_DECODE_FILE = "TEST_ONLY_PDPAIR_SLOW_DECODE_FILE"
# TEST ONLY: decode's side-channel loop stops once this file exists (connector testing_knobs.StopListenerKnob, extra
# config test_stop_listener_file): how a test on real pods stops a listener nothing a peer sends can stop.
ENV_TEST_STOP_LISTENER_FILE = "TEST_ONLY_PDPAIR_STOP_LISTENER_FILE"
# TEST ONLY, never set by the operator: while this file exists, every put of prefill's tcp connections goes out with
# one payload byte flipped after its checksum was taken, or, as the file's content names, misaddressed, stale-tagged
# or cut short (kv_connector_extra_config's test_corrupt_puts_file; the native PDPAIR_FAULT_*_PUTS), so a test can
# show that decode refuses corrupted KV instead of serving it.
ENV_TEST_CORRUPT_PUTS_FILE = "TEST_ONLY_PDPAIR_CORRUPT_PUTS_FILE"
POD_ENV = (
    ENV_ROLE,
    ENV_PAIR,
    ENV_NAMESPACE,
    ENV_GENERATION,
    ENV_LISTEN_PORT_BASE,
    ENV_PEER_HOST,
    ENV_PEER_PORT_BASE,
    ENV_PEERS,
    ENV_INSTANCE,
    ENV_PEERS_TOKEN,
    ENV_SIDE_CHANNEL_KEY,
    ENV_MAX_EDGES,
    ENV_METRICS_PORT,
    ENV_HTTP_PORT,
    ENV_HANG_TIMEOUT_SECONDS,
    ENV_TRANSPORT,
    ENV_TRANSPORT_SLOTS,
    ENV_LAYERWISE_PUTS,
)

METRICS_PATH = "/metrics"
HEALTHZ_PATH = "/healthz"
# Prefill's readiness (the operator's default readinessProbe, on the metrics port): 200 once every rank is paired with
# decode and the engine serves (its own /health); 503 with the reason before. Decode keeps vLLM's /health.
READYZ_PATH = "/readyz"
# An engine pod's startup (the operator's default startupProbe, on the metrics port): 200 once the engine's own /health
# answers 200. Unlike vLLM's /health on the http port it takes PROBE_WAIT_PARAM, as /readyz (connector and router) do.
STARTUPZ_PATH = "/startupz"
# `?wait=SECONDS` on /startupz and /readyz: a probe that would fail is held until it would pass or SECONDS have gone
# (at most PROBE_WAIT_MAX_SECONDS), so the kubelet, whose probe periods are whole seconds, learns within a fraction of a
# second that a pod became ready instead of at its next period (half a period late on average, on every step of the
# pair's path to its first answer). Anything but a number in [0, inf) is answered 400.
PROBE_WAIT_PARAM = "wait"
PROBE_WAIT_MAX_SECONDS = 5.0
# How often a held probe checks again: 0.1 s late on average. Each check is a local HTTP request or a few (the
# engine's /health, the TP ranks' snapshots, the router's asks), made while the engines load on the same cores.
PROBE_WAIT_POLL_SECONDS = 0.2
# The largest body of a peer push (a whole peer set, to prefill or to the router) and of a TP rank channel's peer set:
# a set of MAX_REPLICAS addresses is a few KiB; the bound keeps a stranger from making a pod buffer more.
MAX_PEERS_BODY_BYTES = 1 << 20
# Prefill: PUT the whole desired peer set (docs/xpyd.md section 3), GET its state; bearer ENV_PEERS_TOKEN.
PEERS_PATH = "/pdpair/v1/peers"
# containerPort name of PDPAIR_METRICS_PORT on pair pods; the chart's PodMonitor scrapes the port by this name.
METRICS_PORT_NAME = "metrics"
# containerPort name of PDPAIR_HTTP_PORT on every pair pod; the router's Service targets it by this name.
HTTP_PORT_NAME = "http"


# --- metrics -------------------------------------------------------------------------------------
# `rank` is the TP rank (vLLM worker) a series comes from; TP rank 0 serves every rank's series on the pod's metrics
# port. Pod-level series (hang timeout, generation) carry no rank.
@dataclass(frozen=True)
class Metric:
    """One exported metric. `name` is the family name (no _total suffix is added or removed)."""

    name: str
    kind: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str

    @property
    def base_name(self) -> str:
        """The name prometheus-client wants for a counter (it appends _total itself)."""
        if self.kind == "counter" and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        return self.name

    @property
    def series_names(self) -> tuple[str, ...]:
        """Every series name this metric produces in the exposition format."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        if self.kind == "counter":
            return (self.name, f"{self.base_name}_created")
        return (self.name,)


SIGNALS_EXPECTED = Metric(
    "pdpair_signals_expected_total", "counter", ("role", "rank", "peer"), "Signals the receiver was told to expect."
)
SIGNALS_RECEIVED = Metric("pdpair_signals_received_total", "counter", ("role", "rank", "peer"), "Signals that arrived.")
SIGNAL_DEFICIT = Metric(
    "pdpair_signal_deficit",
    "gauge",
    ("role", "rank", "peer"),
    "Expected minus received signals over the transfers still open.",
)
SIGNAL_WAIT_OLDEST_SECONDS = Metric(
    "pdpair_signal_wait_oldest_seconds", "gauge", ("role", "rank"), "Age of the oldest open signal wait, 0 when none."
)
SIGNAL_WAIT_TIMEOUTS = Metric(
    "pdpair_signal_wait_timeouts_total", "counter", ("role", "rank"), "Signal waits that passed their deadline."
)
HANG_TIMEOUT_SECONDS = Metric(
    "pdpair_hang_timeout_seconds",
    "gauge",
    ("role",),
    "PDPAIR_HANG_TIMEOUT_SECONDS as this pod applies it (alert rules compare the oldest wait against it).",
)
KV_TRANSFERS = Metric(
    "pdpair_kv_transfers_total",
    "counter",
    ("role", "rank", "outcome"),
    "Finished KV transfers by outcome (ok, timeout, error).",
)
# Counted on decode, beside pdpair_kv_transfers_total{outcome="error"} for the same load: its data was refused by the
# receiver's checks, so the load failed instead of handing vLLM the bytes.
KV_TRANSFERS_REJECTED = Metric(
    "pdpair_kv_transfers_rejected_total",
    "counter",
    ("role", "rank", "reason"),
    "KV loads failed because a put of theirs was refused on arrival (reason: checksum, unexpected_transfer, "
    "outside_window, incomplete, other).",
)
KV_TRANSFER_BYTES = Metric("pdpair_kv_transfer_bytes_total", "counter", ("role", "rank"), "KV bytes moved.")
# Prefill: what a decode that never pulls (dead, or its request aborted) costs until the send lease frees it.
KV_BLOCKS_HELD = Metric(
    "pdpair_kv_blocks_held",
    "gauge",
    ("role", "rank"),
    "Prefill: KV blocks of finished requests held for a decode's Pull (freed when pulled or at the send lease; "
    "always 0 on decode).",
)
KV_TRANSFER_SECONDS = Metric(
    "pdpair_kv_transfer_seconds", "histogram", ("role", "rank"), "KV transfer duration in seconds."
)
LISTENER_READY = Metric(
    "pdpair_listener_ready", "gauge", ("role", "rank"), "1 while the side-channel listener accepts connections."
)
# Never reset while the pod lives: the health watch reads it (a served pair whose decode reports a stopped loop is
# Unhealthy, reason listener_lost, and replaced) and so does the alert PdPairListenerLost. pdpair_listener_ready is
# 0 before the listener binds too (the whole model load), so it cannot tell a lost listener from a loading one.
LISTENER_FAILED = Metric(
    "pdpair_listener_failed", "gauge", ("role", "rank"),
    "1 once this decode rank's side-channel loop stopped without being asked (it pairs no prefill until the pod is "
    "replaced; /readyz names why), else 0; decode only.",
)
HANDSHAKES = Metric(
    "pdpair_handshakes_total", "counter", ("role", "rank", "outcome"),
    "Side-channel uid exchanges by outcome (ok, retry, refused, timeout, error; on decode also unauthenticated: a "
    "Hello whose sender did not prove the pair's side-channel key, malformed: an undecodable or out-of-bounds "
    "message, busy: refused at a cap).",
)
PEER_PAIRED = Metric(
    "pdpair_peer_paired", "gauge", ("role", "rank", "peer"),
    "1 while this prefill rank is paired with the decode `peer` (host:portBase; handshake done, side channel up), "
    "0 while it is not yet or no longer; prefill only, one series per decode in its peer set.",
)
TRANSPORT_INFLIGHT = Metric(
    "pdpair_transport_inflight", "gauge", ("rank", "peer"), "Puts posted and not yet completed."
)
TRANSPORT_SLOTS = Metric("pdpair_transport_slots", "gauge", ("rank", "peer"), "Request-slot capacity per connection.")
TRANSPORT_REQUEUES = Metric(
    "pdpair_transport_requeues_total",
    "counter",
    ("rank", "peer"),
    "Posts deferred because every request slot was busy (backpressure, never a drop).",
)
PAIR_GENERATION = Metric("pdpair_pair_generation", "gauge", (), "PDPAIR_GENERATION as this pod sees it.")

POD_METRICS = (
    SIGNALS_EXPECTED,
    SIGNALS_RECEIVED,
    SIGNAL_DEFICIT,
    SIGNAL_WAIT_OLDEST_SECONDS,
    SIGNAL_WAIT_TIMEOUTS,
    HANG_TIMEOUT_SECONDS,
    KV_TRANSFERS,
    KV_TRANSFERS_REJECTED,
    KV_TRANSFER_BYTES,
    KV_TRANSFER_SECONDS,
    KV_BLOCKS_HELD,
    LISTENER_READY,
    LISTENER_FAILED,
    HANDSHAKES,
    PEER_PAIRED,
    TRANSPORT_INFLIGHT,
    TRANSPORT_SLOTS,
    TRANSPORT_REQUEUES,
    PAIR_GENERATION,
)

OUTCOME_OK = "ok"
OUTCOME_TIMEOUT = "timeout"
OUTCOME_ERROR = "error"
# Why a KV load's data was refused (the reason label of pdpair_kv_transfers_rejected_total).
REJECTED_CHECKSUM = "checksum"
REJECTED_UNEXPECTED_TRANSFER = "unexpected_transfer"
REJECTED_OUTSIDE_WINDOW = "outside_window"
REJECTED_INCOMPLETE = "incomplete"  # the transfer's last signal came before all of its bytes (a put cut short)
REJECTED_OTHER = "other"
REJECTED_REASONS = (REJECTED_CHECKSUM, REJECTED_UNEXPECTED_TRANSFER, REJECTED_OUTSIDE_WINDOW, REJECTED_INCOMPLETE,
                    REJECTED_OTHER)

OPERATOR_PAIRS = Metric("pdpair_operator_pairs", "gauge", ("phase",), "InferencePairs by phase.")
OPERATOR_PAIR_PHASE = Metric(
    "pdpair_operator_pair_phase",
    "gauge",
    ("namespace", "pair", "phase"),
    "1 for the pair's current phase, 0 for every other phase (per-pair alerts need it).",
)
OPERATOR_PAIR_RESTARTS = Metric(
    "pdpair_operator_pair_restarts_total", "counter", ("namespace", "pair", "reason"), "Ordered pair restarts."
)
OPERATOR_INSTANCE_REPLACEMENTS = Metric(
    "pdpair_operator_instance_replacements_total", "counter", ("namespace", "pair", "role", "reason"),
    "Engine instances of a serving xPyD pair replaced alone (the pair kept serving; reason as for pair restarts).",
)
OPERATOR_HANG_DETECTIONS = Metric(
    "pdpair_operator_hang_detections_total", "counter", (), "Hung pods the health watch detected."
)
OPERATOR_PORT_POOL_FREE = Metric("pdpair_operator_port_pool_free", "gauge", (), "Free ports in the operator's pool.")
OPERATOR_PORT_POOL_SIZE = Metric("pdpair_operator_port_pool_size", "gauge", (), "Ports in the operator's pool.")
OPERATOR_RECONCILE_SECONDS = Metric(
    "pdpair_operator_reconcile_seconds", "histogram", (), "Duration of one reconcile pass in seconds."
)

OPERATOR_METRICS = (
    OPERATOR_PAIRS,
    OPERATOR_PAIR_PHASE,
    OPERATOR_PAIR_RESTARTS,
    OPERATOR_INSTANCE_REPLACEMENTS,
    OPERATOR_HANG_DETECTIONS,
    OPERATOR_PORT_POOL_FREE,
    OPERATOR_PORT_POOL_SIZE,
    OPERATOR_RECONCILE_SECONDS,
)

# The router's own, on its HTTP port at /metrics (router/metrics.py); `mode` is split (prefill, then decode) or local
# (decode alone: selective disaggregation, router/split.py).
ROUTER_MODES = ("split", "local")
ROUTER_REQUESTS = Metric(
    "pdpair_router_requests_total", "counter", ("mode",),
    "Requests the router sent on, by mode: split (prefill, then decode with the KV) or local (decode alone).",
)
ROUTER_LOCAL_PROMPT_TOKENS = Metric(
    "pdpair_router_local_prompt_tokens", "gauge", (),
    "The current threshold of selective disaggregation: prompts estimated shorter go to decode alone (0: off).",
)
ROUTER_PREFIX_CHUNKS = Metric(
    "pdpair_router_prefix_chunks_total", "counter", ("role", "outcome"),
    "Prompt chunks (128 bytes) of requests routed with prefix affinity, per role: routed, and matched (sent before "
    "to the instance chosen); matched / routed is the router's estimate of that role's prefix hit rate.",
)
ROUTER_PREFIX_BLOCKS = Metric(
    "pdpair_router_prefix_blocks_total", "counter", ("role", "outcome"),
    "Prompt blocks (the engines' KV blocks) of requests routed by the engines' KV events, per role: routed, and "
    "matched (held by the instance chosen, as its events say); matched / routed is that role's prefix hit rate.",
)
ROUTER_KV_EVENT_BATCHES = Metric(
    "pdpair_router_kv_event_batches_total", "counter", ("role", "outcome"),
    "KV event batches the router read from the engines, per role and outcome: applied, replayed (asked again after "
    "a gap), gap (batches missed), resync (the engine's blocks forgotten: a gap the replay could not fill, or a batch "
    "or removal that did not decode), restart (the engine's numbering began again), malformed, dropped_by_test.",
)
ROUTER_METRICS = (ROUTER_REQUESTS, ROUTER_LOCAL_PROMPT_TOKENS, ROUTER_PREFIX_CHUNKS, ROUTER_PREFIX_BLOCKS,
                  ROUTER_KV_EVENT_BATCHES)

ALL_METRICS = POD_METRICS + OPERATOR_METRICS + ROUTER_METRICS


# --- alerts (PrometheusRule in the chart) --------------------------------------------------------
ALERT_SIGNAL_DEFICIT = "PdPairSignalDeficit"
ALERT_RESTART_LOOP = "PdPairRestartLoop"
ALERT_NOT_READY = "PdPairNotReady"
ALERT_RESTART_BUDGET_EXHAUSTED = "PdPairRestartBudgetExhausted"
ALERT_PORT_POOL_LOW = "PdPairPortPoolLow"
ALERT_TRANSFER_ERRORS = "PdPairTransferErrors"
ALERT_NODE_LOST = "PdPairNodeLost"
ALERT_LISTENER_LOST = "PdPairListenerLost"
ALERTS = (
    ALERT_SIGNAL_DEFICIT,
    ALERT_RESTART_LOOP,
    ALERT_NOT_READY,
    ALERT_RESTART_BUDGET_EXHAUSTED,
    ALERT_PORT_POOL_LOW,
    ALERT_TRANSFER_ERRORS,
    ALERT_NODE_LOST,
    ALERT_LISTENER_LOST,
)


def is_hung(signal_deficit: float, oldest_wait_seconds: float, hang_timeout_seconds: float) -> bool:
    """The contract's definition of a hung pod."""
    return signal_deficit > 0 and oldest_wait_seconds > hang_timeout_seconds

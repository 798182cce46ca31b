#!/usr/bin/env python3
"""Autoscaling simulator: a P/D pair's queues under a bursty load, the decode role driven by the
Kubernetes HPA algorithm, the prefill role following a P:D ratio band, so the band and stabilisation defaults are
chosen by measurement. Pure Python, seeded, no cluster and no engine; one full run is a few seconds of CPU.

    python tests/bench/sim_autoscale.py [--seed 1] [--duration 3600] [--out results.json] [--details] [--quick]

THE MODEL (1 s ticks; every symbol below is a parameter of `SimConfig` or `Scenario`)
- A request needs a prefill, then a decode. Each role is one FIFO fluid queue in front of its serving instances: the
  router is load-aware, so the role's instances behave like one pool (join-the-shortest-queue ~ a shared queue). A
  role serves `instances_serving x rate_per_instance` requests per second; what it cannot serve waits. Arrivals are
  Poisson per second from a seeded Markov-modulated (on/off) or ramped rate, the same arrival sequence for every
  policy of a scenario (common random numbers, so policies differ only by what they do).
- A request's queue wait is (second its decode starts) - (second it arrived), prefill wait plus decode wait; its
  first token comes a base TTFT later (81 ms measured, below), which the 1 s resolution cannot see and the model
  leaves out. An arrival second is an **SLO-violation second** when more than 10 % of its requests waited longer
  than `slo_wait_s` (a p90 queue-wait SLO per second). Requests still queued at the end count late if they already
  waited longer than the SLO.
- An instance created at t serves from t + `cold_start_s`; it costs from t (**instance-seconds** count starting
  instances). A scale-down removes the newest instances first (still-starting ones before serving ones, as a
  ReplicaSet prefers unready pods) and their capacity goes at once (the drain is not modelled).
- The HPA drives DECODE (the leader) through its `/scale` (the operator's InferencePairRole, docs/xpyd.md section
  2); PREFILL follows through `follower_replicas` (the operator's ratio band), or stays fixed ("none"), or has an HPA
  of its own ("prefill-hpa").

THE HPA, re-implemented from kubernetes/kubernetes pkg/controller/podautoscaler (replica_calculator.go
`calcPlainMetricReplicas` and `groupPods`, horizontal.go `normalizeDesiredReplicasWithBehaviors`,
`stabilizeRecommendationWithBehaviors`, `convertDesiredReplicasWithBehaviorRate`,
`calculateScaleUpLimitWithScalingRules`, `calculateScaleDownLimitWithBehaviors`, `storeScaleEvent`), read for this,
not copied:
- every `sync_period_s` (15 s, kube-controller-manager's --horizontal-pod-autoscaler-sync-period default);
- Pods metric, AverageValue target: usage ratio = mean over pods with a metric / target; within 1 +- tolerance
  (0.1) keep the count, else ceil(ratio x pods with a metric). Pods without a metric yet (a starting engine: Running,
  its /metrics not scraped) are "missing": on a scale-up they count as 0, on a scale-down as the target, and if that
  flips the direction or lands within the tolerance the count is kept; then ceil(new ratio x all counted pods). No
  pod with a metric at all: the HPA does nothing (ScalingActive False);
- the recommendation is stabilised: scaling up, the min of the recommendations of the last `scale_up_window_s` (0);
  scaling down, the max of those of the last `scale_down_window_s` (300 s);
- then rate-limited by the policies over scale events of the last period: up max(100 %, 4 pods) per 15 s (the
  autoscaling/v2 default, selectPolicy Max), down 100 % per 15 s; and clamped to [minReplicas, maxReplicas] = [1, 16]
  (16 = contract.MAX_REPLICAS, the role object's limit);
- the External-metric AverageValue path (`GetExternalPerPodMetricReplicas`: ratio = total / (target x status
  replicas), within tolerance keep, else ceil(total / target)) for the "pair_waiting" metric below.
The metric reaches the HPA as Prometheus and the adapter give it: each pod's gauge is sampled every
`scrape_interval_s` (15 s: charts/pdpair/values.yaml `monitoring.podMonitor.interval`), the adapter answers
avg_over_time over `adapter_window_s` (0 = the last sample), so the HPA acts on a value up to scrape + window old.
The grid runs three HPA metrics: "decode_waiting" (vllm:num_requests_waiting on each decode pod, averaged: the brief's),
"decode_busy" (num_requests_running + num_requests_waiting per decode pod, running = utilisation x `slots`), and
"pair_waiting" (prefill + decode backlog of the pair as one External metric per decode replica: a router-side gauge).

INPUTS FROM RECORDED REAL-NODE TIMELINES (this repository; the numbers are this 2-core box's, tiny model, CPU vLLM)
- per-instance service rate 36.76 req/s: docs/benchmarks.md, "P/D latency and concurrency with one core per engine"
  (2026-12-04), the concurrency table, row "64 | pdpair | 36.76" (1 prefill + 1 decode, one core
  each, saturated: 64 clients). That is the PAIR's rate, i.e. its slower role's; no run measured the roles apart, so
  the mixes below set one role to it and the other to 1x, 2x or 0.5x (labelled assumptions, not measurements);
- base TTFT 81.3 ms (same section, sequential table, pdpair TTFT p50): below the 1 s tick, left out;
- decode time per request 0.85 s = 32 output tokens x TPOT p50 26.6 ms (same concurrency table, 64 | pdpair), for
  `slots` = rate x decode time ~ 31 running requests per saturated decode instance (decode_busy metric only);
- cold start 61 s (default): tests/e2e_realnode/test_realnode_xpyd.py module docstring, "scale-up 61 s under load"
  (`kubectl scale` of the decode role 1 -> 2 under a steady 3-client load until D 2/2: exactly the event simulated);
  sensitivity: 21 s (docs/benchmarks.md "The router beside the loading engines, 2026-12-04": single engine pod first
  answer 21.46 s, median of 3, quiet box: a lone start with the machine to itself) and 81 s (the xPyD docstring's
  "delete -> re-created decode Ready 81 s"); the pair's own start, "apply -> P 2/2 D 2/2 49-78 s" (same docstring),
  lies inside that range.

WHAT IT IS NOT: a queue model, not a measurement of vLLM. It has no batching effects (an instance's rate does not
depend on its queue), no KV-transfer or HTTP time, no drain on scale-down, no node provisioning (an instance's
cold start assumes a free node), no operator reaction delay (the operator follows a /scale write within a watch event;
seconds at most), one shared queue per role (ideal routing). It ranks policies under those assumptions; its absolute
seconds depend on the synthetic load. docs/benchmarks.md, "Autoscaling simulator", has the run.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import pathlib
import random
import sys
import time
from typing import Callable

# The operator's source tree, so the band rule below is the operator's own once it exists (no install needed).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "src"))

from pdpair.operator.decide.ratio_band import follower_replicas  # noqa: E402  (the operator's own rule

# ---- measured inputs (citations in the module docstring) -------------------------------------------------------------
PAIR_RATE_REQ_S = 36.76          # docs/benchmarks.md, the concurrency table, 64 | pdpair
DECODE_SECONDS_PER_REQUEST = 32 * 0.0266   # same row: 32 output tokens x TPOT p50 26.6 ms
COLD_START_S = 61.0              # tests/e2e_realnode/test_realnode_xpyd.py docstring: "scale-up 61 s under load"
COLD_START_SENSITIVITY_S = (21.0, 61.0, 81.0)   # 21.46 s lone engine pod (benchmarks.md, 2026-12-04); 81 s re-created decode
SCRAPE_INTERVAL_S = 15           # charts/pdpair/values.yaml monitoring.podMonitor.interval

# A second of arrivals violates when more than this share of its requests waited past the SLO (a p90 per second).
LATE_SHARE_FOR_VIOLATION = 0.10


# ---- the Kubernetes HPA ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HpaConfig:
    target: float                       # AverageValue target of the metric
    tolerance: float = 0.1              # --horizontal-pod-autoscaler-tolerance default
    sync_period_s: int = 15             # --horizontal-pod-autoscaler-sync-period default
    scale_up_window_s: int = 0          # behavior.scaleUp.stabilizationWindowSeconds default
    scale_down_window_s: int = 300      # behavior.scaleDown default (--horizontal-pod-autoscaler-downscale-stabilization)
    scale_up_percent: int = 100         # default scaleUp policies: 100 % or 4 pods per 15 s, selectPolicy Max
    scale_up_pods: int = 4
    scale_up_period_s: int = 15
    scale_down_percent: int = 100       # default scaleDown policy: 100 % per 15 s
    scale_down_period_s: int = 15
    min_replicas: int = 1
    max_replicas: int = 16              # contract.MAX_REPLICAS: the role object's spec.replicas limit


def replicas_for_pods_metric(current: int, values: list[float], missing: int, target: float, tolerance: float) -> int | None:
    """The replica calculator for a Pods metric with an AverageValue target (calcPlainMetricReplicas). `values`: one per
    pod with a metric; `missing`: running pods without one. None: no pod has a metric (the HPA cannot compute)."""
    if not values:
        return None
    usage_ratio = sum(values) / len(values) / target
    if missing == 0:
        if abs(1.0 - usage_ratio) <= tolerance:
            return current
        return math.ceil(usage_ratio * len(values))
    # Missing pods: assumed at the target on a scale-down and at 0 on a scale-up (the controller's conservative
    # guess), and no change when that guess lands within the tolerance or reverses the direction.
    filled = values + [target if usage_ratio < 1.0 else 0.0] * missing
    new_ratio = sum(filled) / len(filled) / target
    if (abs(1.0 - new_ratio) <= tolerance or (usage_ratio < 1.0 < new_ratio) or (usage_ratio > 1.0 > new_ratio)):
        return current
    return math.ceil(new_ratio * len(filled))


def replicas_for_external_average(status_replicas: int, total: float, target: float, tolerance: float) -> int:
    """GetExternalPerPodMetricReplicas: an External metric with an AverageValue target, per the role's ready count."""
    replicas = status_replicas
    if status_replicas > 0 and abs(1.0 - total / (target * status_replicas)) > tolerance:
        replicas = math.ceil(total / target)
    elif status_replicas == 0:
        replicas = math.ceil(total / target)
    return replicas


class HorizontalAutoscaler:
    """One HPA object: its recommendation history and scale events, synced by the caller every sync period."""

    def __init__(self, config: HpaConfig, running_at: int | None = None):
        self.config = config
        self.recommendations: list[tuple[float, int]] = []   # (time, raw desired) of every sync
        if running_at is not None:
            # Start in steady state, as an HPA that has recommended the initial count for a whole window: a freshly
            # created HPA has no history and would scale down at its first sync, which is not what is measured here.
            window = max(config.scale_up_window_s, config.scale_down_window_s)
            self.recommendations = [(-float(age), running_at) for age in range(config.sync_period_s, window,
                                                                                config.sync_period_s)]
        self.scale_up_events: list[tuple[float, int]] = []   # (time, pods added)
        self.scale_down_events: list[tuple[float, int]] = []  # (time, pods removed)

    def _stabilised(self, now: float, current: int, desired: int) -> int:
        cfg = self.config
        if desired >= current:
            window, better = cfg.scale_up_window_s, min
        else:
            window, better = cfg.scale_down_window_s, max
        recommendation = desired
        for stamp, past in self.recommendations:
            if stamp > now - window:    # the controller's timestamp.After(cutoff): strictly inside the window
                recommendation = better(past, recommendation)
        # Keep only what either window can still use (the controller overwrites obsolete slots; same effect).
        keep_after = now - max(cfg.scale_up_window_s, cfg.scale_down_window_s)
        self.recommendations = [r for r in self.recommendations if r[0] >= keep_after]
        self.recommendations.append((now, desired))
        return recommendation

    @staticmethod
    def _changed_within(events: list[tuple[float, int]], now: float, period: int) -> int:
        return sum(change for stamp, change in events if stamp > now - period)

    def _rate_limited(self, now: float, current: int, desired: int) -> int:
        cfg = self.config
        if desired > current:
            added = self._changed_within(self.scale_up_events, now, cfg.scale_up_period_s)
            period_start = current - added
            # Both default policies share one period here; selectPolicy Max takes the larger allowance.
            limit = max(math.ceil(period_start * (1 + cfg.scale_up_percent / 100)), period_start + cfg.scale_up_pods)
            limit = max(limit, current)
            return min(desired, min(cfg.max_replicas, limit))
        if desired < current:
            removed = self._changed_within(self.scale_down_events, now, cfg.scale_down_period_s)
            period_start = current + removed
            limit = int(period_start * (1 - cfg.scale_down_percent / 100))
            limit = min(limit, current)
            return max(desired, max(cfg.min_replicas, limit))
        return desired

    def decide(self, now: float, current: int, raw_desired: int | None) -> int:
        """The count the HPA writes to /scale at this sync (current when it does not rescale)."""
        if raw_desired is None:
            return current
        stabilised = self._stabilised(now, current, raw_desired)
        new = self._rate_limited(now, current, stabilised)
        keep_after = now - max(self.config.scale_up_period_s, self.config.scale_down_period_s)
        if new > current:
            self.scale_up_events = [e for e in self.scale_up_events if e[0] > keep_after] + [(now, new - current)]
        elif new < current:
            self.scale_down_events = [e for e in self.scale_down_events if e[0] > keep_after] + [(now, current - new)]
        return new


# ---- what Prometheus and the adapter show the HPA -------------------------------------------------------------------
class PrometheusView:
    """Scrapes of one role's per-pod gauge (the router balances, so every serving pod reads the same value)."""

    def __init__(self, scrape_interval_s: int, adapter_window_s: int):
        self.scrape_interval_s, self.adapter_window_s = scrape_interval_s, adapter_window_s
        self.samples: collections.deque[tuple[float, float, int]] = collections.deque()  # (time, value, pods scraped)

    def scrape(self, now: float, per_pod_value: float, pods_serving: int) -> None:
        self.samples.append((now, per_pod_value, pods_serving))
        while self.samples and self.samples[0][0] < now - max(self.adapter_window_s, self.scrape_interval_s) - 1:
            self.samples.popleft()

    def query(self, now: float) -> tuple[float, int] | None:
        """(value per pod, pods that have a series) as the adapter answers now; None before the first scrape."""
        if not self.samples:
            return None
        latest = self.samples[-1]
        if self.adapter_window_s <= 0:
            return latest[1], latest[2]
        window = [s[1] for s in self.samples if s[0] > now - self.adapter_window_s]
        return (sum(window) / len(window) if window else latest[1]), latest[2]


# ---- the pair ------------------------------------------------------------------------------------------------------
class Role:
    """One role's instances: each serves from its ready time on. Scale-downs remove the newest first."""

    def __init__(self, rate_per_instance: float, initial: int, cold_start_s: float):
        self.rate_per_instance, self.cold_start_s = rate_per_instance, cold_start_s
        self.ready_at: list[float] = [0.0] * initial
        self.scale_events = 0
        self.max_instances = initial

    @property
    def desired(self) -> int:
        return len(self.ready_at)

    def serving(self, now: float) -> int:
        return sum(1 for t in self.ready_at if t <= now)

    def set_desired(self, count: int, now: float) -> None:
        if count == len(self.ready_at):
            return
        self.scale_events += 1
        if count > len(self.ready_at):
            self.ready_at.extend([now + self.cold_start_s] * (count - len(self.ready_at)))
        else:
            # newest first == still-starting first (they were created last)
            del self.ready_at[count:]
        self.max_instances = max(self.max_instances, count)


class FluidFifo:
    """A FIFO of cohorts [arrival second, amount]: service takes from the head, so each cohort keeps its arrival."""

    def __init__(self):
        self.cohorts: collections.deque[list] = collections.deque()
        self.total = 0.0

    def push(self, arrival: int, amount: float) -> None:
        if amount <= 0:
            return
        if self.cohorts and self.cohorts[-1][0] == arrival:
            self.cohorts[-1][1] += amount
        else:
            self.cohorts.append([arrival, amount])
        self.total += amount

    def pop(self, capacity: float) -> list[tuple[int, float]]:
        served: list[tuple[int, float]] = []
        while capacity > 1e-12 and self.cohorts:
            head = self.cohorts[0]
            take = min(capacity, head[1])
            served.append((head[0], take))
            head[1] -= take
            capacity -= take
            if head[1] <= 1e-12:
                self.cohorts.popleft()
        self.total = max(0.0, self.total - sum(a for _, a in served))
        return served


# ---- load ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Scenario:
    """A synthetic load, in units of PAIR_RATE_REQ_S (1.0 = what one saturated instance of the slower role serves)."""
    name: str
    description: str
    base_units: float
    burst_units: float
    mean_burst_s: float = 0.0        # Markov-modulated on/off: exponential burst and gap lengths
    mean_gap_s: float = 0.0
    ramp_peak_units: float = 0.0     # > 0: a half-sine ramp from base to this peak and back over the run (a day, shrunk)


SCENARIOS = (
    Scenario("bursts", "base 1.5, bursts to 4.5 (mean 180 s, every ~10 min)", 1.5, 4.5, mean_burst_s=180,
             mean_gap_s=600),
    Scenario("spikes", "base 1.5, spikes to 6 (mean 30 s, every ~5 min): shorter than a cold start", 1.5, 6.0,
             mean_burst_s=30, mean_gap_s=300),
    Scenario("ramp", "half-sine 1 -> 6 -> 1 over the run, bursts x1.5 (mean 60 s, every ~10 min)", 1.0, 1.5,
             mean_burst_s=60, mean_gap_s=600, ramp_peak_units=6.0),
)


def arrival_trace(scenario: Scenario, duration: int, seed: int) -> list[int]:
    """Poisson arrivals per second; seeded per scenario so every policy replays the same requests."""
    rng = random.Random(f"{seed}:{scenario.name}")
    arrivals: list[int] = []
    in_burst, state_left = False, rng.expovariate(1 / scenario.mean_gap_s) if scenario.mean_gap_s else math.inf
    for t in range(duration):
        if state_left <= 0:
            in_burst = not in_burst
            mean = scenario.mean_burst_s if in_burst else scenario.mean_gap_s
            state_left = rng.expovariate(1 / mean)
        state_left -= 1
        if scenario.ramp_peak_units > 0:
            level = scenario.base_units + (scenario.ramp_peak_units - scenario.base_units) * math.sin(math.pi * t / duration)
            units = level * (scenario.burst_units if in_burst else 1.0)
        else:
            units = scenario.burst_units if in_burst else scenario.base_units
        arrivals.append(poisson(rng, units * PAIR_RATE_REQ_S))
    return arrivals


def poisson(rng: random.Random, mean: float) -> int:
    if mean < 30:   # Knuth's product method: exact, fine for small means
        limit, product, count = math.exp(-mean), rng.random(), 0
        while product > limit:
            product *= rng.random()
            count += 1
        return count
    return max(0, round(rng.gauss(mean, math.sqrt(mean))))   # normal approximation, error < 1 % at these means


# ---- one run -------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Mix:
    """Per-instance service rates of the two roles, in units of PAIR_RATE_REQ_S (assumed: see the docstring)."""
    name: str
    prefill_units: float
    decode_units: float


MIXES = (
    Mix("balanced", 1.0, 1.0),
    Mix("decode-heavy", 2.0, 1.0),    # long outputs: a prefill instance serves twice a decode instance's requests
    Mix("prefill-heavy", 1.0, 2.0),   # long prompts: a decode instance serves twice a prefill instance's requests
)


@dataclasses.dataclass(frozen=True)
class Policy:
    """How prefill is sized: a ratio band following decode, fixed, or an HPA of its own."""
    name: str
    band: tuple[float, float] | None = None
    prefill_hpa: bool = False


POLICIES = (
    Policy("band [0.25,1]", (0.25, 1.0)),
    Policy("band [0.5,1]", (0.5, 1.0)),
    Policy("band [0.5,2]", (0.5, 2.0)),
    Policy("band [1,1]", (1.0, 1.0)),
    Policy("band [1,2]", (1.0, 2.0)),
    Policy("band [2,3]", (2.0, 3.0)),   # what the prefill-heavy mix needs (P = 2 D balances its rates)
    Policy("none (P fixed)"),
    Policy("prefill HPA", prefill_hpa=True),
)


@dataclasses.dataclass(frozen=True)
class SimConfig:
    duration_s: int = 3600
    cold_start_s: float = COLD_START_S
    slo_wait_s: float = 2.0
    scrape_interval_s: int = SCRAPE_INTERVAL_S
    adapter_window_s: int = 30
    metric: str = "decode_waiting"     # decode_waiting | decode_busy | pair_waiting
    target_waiting: float = 10.0       # AverageValue for the waiting metrics: ~0.27 s of work per decode instance
    target_busy_share: float = 0.8     # decode_busy target = this x slots
    scale_down_window_s: int = 300
    hpa_sync_offset_s: int = 7         # the HPA's syncs are not aligned with the scrapes


def initial_counts(scenario: Scenario, mix: Mix) -> tuple[int, int]:
    """The counts the pair was applied with: each role sized for the base load at 80 % (what an operator would pick)."""
    base_rate = scenario.base_units * PAIR_RATE_REQ_S
    prefill = math.ceil(base_rate / (0.8 * mix.prefill_units * PAIR_RATE_REQ_S))
    decode = math.ceil(base_rate / (0.8 * mix.decode_units * PAIR_RATE_REQ_S))
    return prefill, decode


def simulate(scenario: Scenario, mix: Mix, policy: Policy, config: SimConfig, arrivals: list[int]) -> dict:
    duration = len(arrivals)
    prefill_rate = mix.prefill_units * PAIR_RATE_REQ_S
    decode_rate = mix.decode_units * PAIR_RATE_REQ_S
    slots = decode_rate * DECODE_SECONDS_PER_REQUEST
    prefill_slots = prefill_rate * DECODE_SECONDS_PER_REQUEST   # same busy scale for the prefill HPA's view
    p0, d0 = initial_counts(scenario, mix)
    if policy.band is not None:
        p0 = follower_replicas(d0, p0, *policy.band)
    prefill, decode = Role(prefill_rate, p0, config.cold_start_s), Role(decode_rate, d0, config.cold_start_s)
    prefill_queue, decode_queue = FluidFifo(), FluidFifo()

    if config.metric == "decode_busy":
        target = config.target_busy_share * slots
    else:
        target = config.target_waiting
    hpa_config = HpaConfig(target=target, scale_down_window_s=config.scale_down_window_s)
    decode_hpa = HorizontalAutoscaler(hpa_config, running_at=d0)
    prefill_target = config.target_busy_share * prefill_slots if config.metric == "decode_busy" else config.target_waiting
    prefill_hpa = (HorizontalAutoscaler(dataclasses.replace(hpa_config, target=prefill_target), running_at=p0)
                   if policy.prefill_hpa else None)
    decode_view = PrometheusView(config.scrape_interval_s, config.adapter_window_s)
    prefill_view = PrometheusView(config.scrape_interval_s, config.adapter_window_s)
    pair_view = PrometheusView(config.scrape_interval_s, config.adapter_window_s)

    served_by_arrival = [0.0] * duration
    late_by_arrival = [0.0] * duration
    wait_histogram: collections.Counter[int] = collections.Counter()
    instance_seconds = {"prefill": 0.0, "decode": 0.0}
    timeline = []

    for now in range(duration):
        prefill_queue.push(now, arrivals[now])
        prefill_serving, decode_serving = prefill.serving(now), decode.serving(now)

        prefill_capacity = prefill_serving * prefill_rate
        prefilled = prefill_queue.pop(prefill_capacity)
        for arrival, amount in prefilled:
            decode_queue.push(arrival, amount)
        prefill_busy = (sum(a for _, a in prefilled) / prefill_capacity) if prefill_capacity else 0.0

        decode_capacity = decode_serving * decode_rate
        started = decode_queue.pop(decode_capacity)
        decode_busy = (sum(a for _, a in started) / decode_capacity) if decode_capacity else 0.0
        for arrival, amount in started:
            wait = now - arrival
            served_by_arrival[arrival] += amount
            wait_histogram[wait] += amount
            if wait > config.slo_wait_s:
                late_by_arrival[arrival] += amount

        if now % config.scrape_interval_s == 0:
            # Only serving pods have a /metrics series: a starting engine is Running without one ("missing").
            decode_waiting = decode_queue.total / decode_serving if decode_serving else 0.0
            prefill_waiting = prefill_queue.total / prefill_serving if prefill_serving else 0.0
            if config.metric == "decode_busy":
                decode_view.scrape(now, decode_busy * slots + decode_waiting, decode_serving)
                prefill_view.scrape(now, prefill_busy * prefill_slots + prefill_waiting, prefill_serving)
            else:
                decode_view.scrape(now, decode_waiting, decode_serving)
                prefill_view.scrape(now, prefill_waiting, prefill_serving)
            pair_view.scrape(now, prefill_queue.total + decode_queue.total, 1)

        if now % hpa_config.sync_period_s == config.hpa_sync_offset_s % hpa_config.sync_period_s:
            decode.set_desired(decode_hpa.decide(now, decode.desired, _raw_desired(
                config.metric, decode_view, pair_view, now, decode.desired, decode.serving(now), hpa_config)), now)
            if prefill_hpa is not None:
                prefill.set_desired(prefill_hpa.decide(now, prefill.desired, _raw_desired(
                    "pods", prefill_view, None, now, prefill.desired, prefill.serving(now), prefill_hpa.config)), now)
        if policy.band is not None:
            # The operator reconciles the follower whenever the leader's count moves (no delay modelled).
            prefill.set_desired(follower_replicas(decode.desired, prefill.desired, *policy.band), now)

        instance_seconds["prefill"] += prefill.desired
        instance_seconds["decode"] += decode.desired
        if now % 10 == 0:
            timeline.append((now, arrivals[now], prefill.desired, prefill_serving, decode.desired, decode_serving,
                             round(prefill_queue.total, 1), round(decode_queue.total, 1)))

    # Requests still queued at the end: late if they already waited past the SLO.
    for queue in (prefill_queue, decode_queue):
        for arrival, amount in queue.cohorts:
            if duration - arrival > config.slo_wait_s:
                late_by_arrival[arrival] += amount
    total = sum(arrivals)
    violation_seconds = sum(1 for a, late in zip(arrivals, late_by_arrival)
                            if a > 0 and late / a > LATE_SHARE_FOR_VIOLATION)
    return {
        "metric": config.metric, "scenario": scenario.name, "mix": mix.name, "policy": policy.name,
        "slo_violation_s": violation_seconds,
        "late_pct": round(100 * sum(late_by_arrival) / total, 2) if total else 0.0,
        "wait_p99_s": _percentile(wait_histogram, 0.99),
        "instance_s": round(instance_seconds["prefill"] + instance_seconds["decode"]),
        "prefill_instance_s": round(instance_seconds["prefill"]),
        "decode_instance_s": round(instance_seconds["decode"]),
        "scale_events": prefill.scale_events + decode.scale_events,
        "max_prefill": prefill.max_instances, "max_decode": decode.max_instances,
        "initial": {"prefill": p0, "decode": d0},
        "timeline_every_10s": timeline,
    }


def _raw_desired(metric: str, view: PrometheusView, pair_view: PrometheusView | None, now: float, current: int,
                 serving: int, cfg: HpaConfig) -> int | None:
    if metric == "pair_waiting":
        answer = pair_view.query(now)
        if answer is None:
            return None
        # status.replicas of the role object: its ready instances (docs/xpyd.md section 2, statusReplicasPath)
        return replicas_for_external_average(serving, answer[0], cfg.target, cfg.tolerance)
    answer = view.query(now)
    if answer is None:
        return None
    per_pod, pods_scraped = answer
    with_metric = min(pods_scraped, serving)      # a pod removed since the scrape has left the selector
    return replicas_for_pods_metric(current, [per_pod] * with_metric, current - with_metric, cfg.target, cfg.tolerance)


def _percentile(histogram: collections.Counter, q: float) -> int:
    total = sum(histogram.values())
    if not total:
        return 0
    seen = 0.0
    for wait in sorted(histogram):
        seen += histogram[wait]
        if seen >= q * total:
            return wait
    return max(histogram)


# ---- report --------------------------------------------------------------------------------------------------------
def run_grid(scenarios, mixes, policies, config: SimConfig, seed: int) -> list[dict]:
    results = []
    for scenario in scenarios:
        arrivals = arrival_trace(scenario, config.duration_s, seed)
        for mix in mixes:
            for policy in policies:
                results.append(simulate(scenario, mix, policy, config, arrivals))
    return results


def markdown_table(rows: list[dict], columns: list[tuple[str, Callable[[dict], object]]]) -> str:
    lines = ["| " + " | ".join(name for name, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(get(row)) for _, get in columns) + " |")
    return "\n".join(lines)


DETAIL_COLUMNS = [
    ("metric", lambda r: r["metric"]), ("scenario", lambda r: r["scenario"]), ("mix", lambda r: r["mix"]),
    ("policy", lambda r: r["policy"]), ("SLO-violation s", lambda r: r["slo_violation_s"]),
    ("late %", lambda r: r["late_pct"]), ("wait p99 s", lambda r: r["wait_p99_s"]),
    ("instance-s (P+D)", lambda r: r["instance_s"]), ("scale events", lambda r: r["scale_events"]),
    ("max P / D", lambda r: f'{r["max_prefill"]} / {r["max_decode"]}'),
]
SUMMARY_COLUMNS = [
    ("runs", lambda r: r["label"]), ("policy", lambda r: r["policy"]), ("SLO-violation s", lambda r: r["slo_violation_s"]),
    ("late %", lambda r: r["late_pct"]), ("instance-s", lambda r: r["instance_s"]),
    ("scale events", lambda r: r["scale_events"]),
]
METRICS = ("decode_waiting", "decode_busy", "pair_waiting")


def summary_by_policy(results: list[dict], label: str) -> list[dict]:
    """Per policy, summed over the runs given (the scenarios): SLO-violation seconds, instance-seconds, scale events;
    late % is the mean of the runs' (each run has about the same number of requests)."""
    by_policy: dict[str, dict] = {}
    for r in results:
        entry = by_policy.setdefault(r["policy"], {"policy": r["policy"], "label": label, "slo_violation_s": 0,
                                                   "instance_s": 0, "scale_events": 0, "late_pcts": []})
        entry["slo_violation_s"] += r["slo_violation_s"]
        entry["instance_s"] += r["instance_s"]
        entry["scale_events"] += r["scale_events"]
        entry["late_pcts"].append(r["late_pct"])
    for entry in by_policy.values():
        entry["late_pct"] = round(sum(entry.pop("late_pcts")) / len(results) * len(by_policy), 1)
    return list(by_policy.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=int, default=3600, help="seconds of simulated load per run")
    parser.add_argument("--out", help="write every run (with a 10 s timeline) and the parameters as JSON")
    parser.add_argument("--cold-start", type=float, default=COLD_START_S)
    parser.add_argument("--slo-wait", type=float, default=2.0)
    parser.add_argument("--adapter-window", type=int, default=30)
    parser.add_argument("--scale-down-window", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="main grid only, no sensitivity table")
    parser.add_argument("--details", action="store_true", help="also print every run (the JSON has them anyway)")
    args = parser.parse_args(argv)

    started = time.process_time()
    config = SimConfig(duration_s=args.duration, cold_start_s=args.cold_start, slo_wait_s=args.slo_wait,
                       adapter_window_s=args.adapter_window, scale_down_window_s=args.scale_down_window)
    print("## Parameters\n")
    print(f"seed {args.seed}, {config.duration_s} s per run, 1 s ticks; rate unit {PAIR_RATE_REQ_S} req/s per instance;"
          f" cold start {config.cold_start_s:g} s; SLO: p90 queue wait of each arrival second <= {config.slo_wait_s:g} s;"
          f" HPA target {config.target_waiting:g} waiting per pod (waiting metrics) or {config.target_busy_share:g} x"
          f" slots (decode_busy), tolerance 0.1, sync 15 s, scale-down window {config.scale_down_window_s} s,"
          f" scale-up window 0 s, up max(100 %, 4 pods)/15 s, down 100 %/15 s, replicas 1..16; scrape"
          f" {config.scrape_interval_s} s, adapter avg_over_time {config.adapter_window_s} s")
    for s in SCENARIOS:
        print(f"- scenario {s.name}: {s.description} (units of {PAIR_RATE_REQ_S} req/s)")
    for m in MIXES:
        print(f"- mix {m.name}: prefill {m.prefill_units:g}, decode {m.decode_units:g} units per instance")

    results = []
    for metric in METRICS:
        results += run_grid(SCENARIOS, MIXES, POLICIES, dataclasses.replace(config, metric=metric), args.seed)
    if args.details:
        print("\n## Every run\n")
        print(markdown_table(results, DETAIL_COLUMNS))
    summary_rows = []
    for metric in METRICS:
        for mix in MIXES:
            summary_rows += summary_by_policy([r for r in results if r["mix"] == mix.name and r["metric"] == metric],
                                              f"{metric}, {mix.name}")
    print(f"\n## Per HPA metric, mix and policy, summed over the {len(SCENARIOS)} scenarios\n")
    print(markdown_table(summary_rows, SUMMARY_COLUMNS))
    report = {"parameters": dataclasses.asdict(config) | {"seed": args.seed, "pair_rate_req_s": PAIR_RATE_REQ_S},
              "scenarios": [dataclasses.asdict(s) for s in SCENARIOS], "mixes": [dataclasses.asdict(m) for m in MIXES],
              "summary": summary_rows, "runs": results, "sensitivity": []}

    if not args.quick:
        # The cold starts recorded on the real nodes, the stabilisation window, the adapter's lag: each varied alone
        # from the defaults, over every scenario, on the balanced mix, for the two per-pod metrics and the bands
        # that hold up in the main table.
        focus = [p for p in POLICIES if p.name in ("band [1,1]", "band [1,2]", "prefill HPA")]
        balanced = [m for m in MIXES if m.name == "balanced"]
        variants = [("defaults", config)]
        variants += [(f"cold start {c:g} s", dataclasses.replace(config, cold_start_s=c))
                     for c in COLD_START_SENSITIVITY_S if c != config.cold_start_s]
        variants += [(f"scale-down window {w} s", dataclasses.replace(config, scale_down_window_s=w))
                     for w in (60, 150, 600) if w != config.scale_down_window_s]
        variants += [(f"adapter window {w} s", dataclasses.replace(config, adapter_window_s=w))
                     for w in (0, 120) if w != config.adapter_window_s]
        sensitivity = []
        for metric in ("decode_waiting", "decode_busy"):
            for label, variant in variants:
                runs = run_grid(SCENARIOS, balanced, focus, dataclasses.replace(variant, metric=metric), args.seed)
                sensitivity += summary_by_policy(runs, f"{metric}: {label}")
        print("\n## Sensitivity, balanced mix (one parameter changed from the defaults; summed over the scenarios)\n")
        print(markdown_table(sensitivity, SUMMARY_COLUMNS))
        report["sensitivity"] = sensitivity

    cpu = time.process_time() - started
    print(f"\n{len(results)} main runs and {len(report['sensitivity']) and len(report['sensitivity']) * len(SCENARIOS)}"
          f" sensitivity runs in {cpu:.1f} s of CPU")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

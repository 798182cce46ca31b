"""tests/bench/sim_autoscale.py, the autoscaling simulator: its HPA arithmetic against the
controller's documented behaviour, the ratio-band rule, the queue, and that a seeded run repeats. Well under a second."""

import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import sim_autoscale as sim  # noqa: E402


def test_band_rule_clamps_the_follower_into_the_band_and_handles_an_empty_band():
    assert sim.follower_replicas(4, 1, 0.5, 1.0) == 2      # below the band: raised to ceil(0.5 * 4)
    assert sim.follower_replicas(4, 3, 0.5, 1.0) == 3      # inside: unchanged (the follower moves only when forced)
    assert sim.follower_replicas(4, 9, 0.5, 1.0) == 4      # above: lowered to floor(1.0 * 4)
    assert sim.follower_replicas(3, 1, 0.5, 0.5) == 2      # empty band [2, 1]: ceil(band_min * leader)
    assert sim.follower_replicas(16, 1, 2.0, 3.0) == 16    # capped at hi
    assert sim.follower_replicas(2, 5, 1.0, 1.0) == 2      # [1, 1]: 2 * 1.0 is exactly 2, no float drift


def test_pods_metric_tolerance_and_formula():
    # ratio 1.05 is within the 0.1 tolerance: keep 4
    assert sim.replicas_for_pods_metric(4, [10.5] * 4, 0, target=10, tolerance=0.1) == 4
    # ratio 1.5: ceil(1.5 * 4) = 6
    assert sim.replicas_for_pods_metric(4, [15.0] * 4, 0, target=10, tolerance=0.1) == 6
    # ratio 0: the formula asks for 0 (minReplicas is applied later, by the rate limits' clamp)
    assert sim.replicas_for_pods_metric(4, [0.0] * 4, 0, target=10, tolerance=0.1) == 0
    assert sim.replicas_for_pods_metric(4, [], 4, target=10, tolerance=0.1) is None


def test_missing_pods_count_as_zero_on_a_scale_up_and_as_the_target_on_a_scale_down():
    # 2 pods at 30 (ratio 3), 2 starting without a metric: (30 + 30 + 0 + 0) / 4 / 10 = 1.5 -> ceil(1.5 * 4) = 6
    assert sim.replicas_for_pods_metric(4, [30.0, 30.0], 2, target=10, tolerance=0.1) == 6
    # 2 pods at 12 (ratio 1.2), 2 missing as 0: (24 / 4) / 10 = 0.6 reverses the direction: keep 4
    assert sim.replicas_for_pods_metric(4, [12.0, 12.0], 2, target=10, tolerance=0.1) == 4
    # 1 pod at 0, 3 missing as the target: 30 / 4 / 10 = 0.75 -> ceil(0.75 * 4) = 3
    assert sim.replicas_for_pods_metric(4, [0.0], 3, target=10, tolerance=0.1) == 3


def test_scale_down_is_stabilised_over_the_window_and_scale_up_is_rate_limited():
    hpa = sim.HorizontalAutoscaler(sim.HpaConfig(target=10))
    assert hpa.decide(0, 2, 20) == 6          # +4 pods beats +100 % from 2
    assert hpa.decide(15, 6, 20) == 12        # next period: +100 % from 6 beats +4
    assert hpa.decide(30, 12, 40) == 16       # maxReplicas
    # load gone: the max of the last 300 s of recommendations (20 and 40) holds the count
    assert hpa.decide(45, 16, 1) == 16
    assert hpa.decide(300, 16, 1) == 16       # the 40 recommended at 30 s is still inside (300 - 30 < 300)
    assert hpa.decide(345, 16, 1) == 1        # every high recommendation is older than 300 s: down 100 % at once


def test_external_average_value_uses_the_ready_count():
    assert sim.replicas_for_external_average(2, 21.0, target=10, tolerance=0.1) == 2     # 21 / 20: within tolerance
    assert sim.replicas_for_external_average(2, 70.0, target=10, tolerance=0.1) == 7


def test_fifo_keeps_each_cohorts_arrival():
    queue = sim.FluidFifo()
    queue.push(0, 5)
    queue.push(1, 5)
    assert queue.pop(7) == [(0, 5), (1, 2)]
    assert math.isclose(queue.total, 3)


def test_a_seeded_run_repeats_and_a_new_decode_serves_only_after_its_cold_start():
    config = sim.SimConfig(duration_s=600, metric="decode_busy")
    scenario, mix, policy = sim.SCENARIOS[0], sim.MIXES[0], sim.POLICIES[4]
    arrivals = sim.arrival_trace(scenario, 600, seed=3)
    assert arrivals == sim.arrival_trace(scenario, 600, seed=3)
    first = sim.simulate(scenario, mix, policy, config, arrivals)
    second = sim.simulate(scenario, mix, policy, config, arrivals)
    assert first == second
    role = sim.Role(rate_per_instance=1.0, initial=1, cold_start_s=61)
    role.set_desired(2, now=100)
    assert role.serving(160) == 1 and role.serving(161) == 2

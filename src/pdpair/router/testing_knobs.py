"""Test-only knobs of the router, never set by the operator. Kept here, apart from the product's code paths, so a
reader sees at once what exists only for tests."""

from __future__ import annotations

import math
import os

# TEST ONLY: the share (0..1) of the engines' live KV event batches each subscriber throws away as it reads them
# (kv_subscriber.py), to measure gap detection and replay under loss (tests/bench/bench_conversation.py).
ENV_KV_EVENTS_DROP = "TEST_ONLY_PDPAIR_KV_EVENTS_DROP"


def kv_events_drop_fraction() -> float:
    """The knob's value; unset, empty or not a number in 0..1: 0 (nothing dropped)."""
    try:
        value = float(os.environ.get(ENV_KV_EVENTS_DROP) or 0)
    except ValueError:
        return 0.0
    return value if math.isfinite(value) and 0 <= value <= 1 else 0.0

"""The pairs' Events go through a bounded poster (item 4: kopf's per-object posting workers each opened a
connection of their own; at 1000 pairs the operator's RSS grew 354 -> 452 MiB while they posted the queued Events).
Each test runs in well under a second (the blocking post is a fake that sleeps a few milliseconds in a thread)."""

from __future__ import annotations

import asyncio
import threading
import time

from pdpair.operator.act.events import EVENT_SOURCE, EventPoster, event_body


class FakePost:
    """The blocking post: records bodies and the most posts in flight at once; fails the first `fail` calls."""

    def __init__(self, seconds: float = 0.002, fail: int = 0) -> None:
        self.seconds, self.fail = seconds, fail
        self.bodies: list[dict] = []
        self.calls = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.lock = threading.Lock()

    def __call__(self, namespace: str, body: dict) -> None:
        with self.lock:
            self.calls += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            failing = self.calls <= self.fail
        time.sleep(self.seconds)
        with self.lock:
            self.in_flight -= 1
        if failing:
            raise RuntimeError("apiserver said no")
        assert namespace == body["metadata"]["namespace"]
        self.bodies.append(body)


async def _run(poster: EventPoster, emit, timeout: float = 10.0) -> bool:
    task = asyncio.create_task(poster.run())
    try:
        emit()
        return await poster.drain(timeout)
    finally:
        task.cancel()


def test_events_of_many_pairs_are_posted_by_at_most_the_workers_at_once():
    """1000 pairs emitting three Events each at the same moment: kopf's poster had one worker (and one connection)
    per pair in flight; here at most `workers` posts run at once, and every Event is posted once."""
    post = FakePost(seconds=0.0005)
    poster = EventPoster(post, workers=4)

    def emit():
        for step in ("PortsLeased", "PodCreated", "DecodeListening"):
            for i in range(1000):
                poster.emit("scale", f"p{i:04d}", f"uid-{i}", "Normal", step, f"{step} of p{i:04d}")

    assert asyncio.run(_run(poster, emit, timeout=60.0))  # 3000 posts through threads: seconds on a busy box
    assert post.most_in_flight <= 4
    assert len(post.bodies) == 3000 and poster.posted == 3000
    # Four workers post at once, so the bodies may be recorded in another order than emitted (seen in CI).
    first = next(b for b in post.bodies if b["involvedObject"]["name"] == "p0000" and b["reason"] == "PortsLeased")
    assert first["involvedObject"] == {"apiVersion": "pdpair.io/v1alpha1", "kind": "InferencePair", "name": "p0000",
                                       "namespace": "scale", "uid": "uid-0"}
    assert first["source"] == {"component": EVENT_SOURCE} and first["reportingComponent"] == EVENT_SOURCE
    assert first["metadata"] == {"generateName": "p0000.", "namespace": "scale"}
    expected = {(f"p{i:04d}", step) for step in ("PortsLeased", "PodCreated", "DecodeListening") for i in range(1000)}
    assert {(b["involvedObject"]["name"], b["reason"]) for b in post.bodies} == expected


def test_events_are_taken_in_emission_order():
    """The queue is FIFO (posts of several workers may still finish out of order)."""
    poster = EventPoster(FakePost(), workers=2)
    for i in range(5):
        poster.emit("ns", "p", "u", "Normal", "PodCreated", f"m{i}")
    assert [poster._next().message for _ in range(5)] == [f"m{i}" for i in range(5)]
    assert poster._next() is None


def test_the_same_event_queued_twice_is_posted_once_with_its_count():
    """A reconcile error repeating while the first is still queued: one Event, count 3 (kubectl shows x3)."""
    post = FakePost()
    poster = EventPoster(post, workers=1)

    def emit():
        for _ in range(3):
            poster.emit("ns", "p", "u", "Warning", "ReconcileError", "ApiException: 500")
        poster.emit("ns", "p", "u", "Warning", "ReconcileError", "ApiException: 503")

    assert asyncio.run(_run(poster, emit))
    assert [(b["message"], b["count"]) for b in post.bodies] == [("ApiException: 500", 3), ("ApiException: 503", 1)]


def test_the_queue_is_bounded_and_messages_are_cut():
    """Past `limit` queued Events new ones are dropped (counted), so an apiserver that stops answering cannot grow
    the operator without end; messages are cut at 1024 characters as the apiserver requires."""
    poster = EventPoster(FakePost(), workers=1, limit=100)
    for i in range(150):
        poster.emit("ns", f"p{i}", f"u{i}", "Normal", "PodCreated", "x" * 5000)
    assert len(poster) == 100 and poster.dropped == 50
    item = poster._next()
    assert item is not None and len(event_body(item)["message"]) == 1024


def test_a_failed_post_is_retried_then_dropped():
    """Two failures, then the post goes through (retries with the given delays); an Event that keeps failing is
    dropped after the last retry and the poster goes on with the next."""
    post = FakePost(fail=2)
    poster = EventPoster(post, workers=1, retry_delays=(0.01, 0.01))
    assert asyncio.run(_run(poster, lambda: poster.emit("ns", "p", "u", "Normal", "PodCreated", "a")))
    assert poster.posted == 1 and post.calls == 3

    post = FakePost(fail=3)
    poster = EventPoster(post, workers=1, retry_delays=(0.01, 0.01))

    def emit():
        poster.emit("ns", "p", "u", "Normal", "PodCreated", "a")
        poster.emit("ns", "p", "u", "Normal", "PodCreated", "b")

    assert asyncio.run(_run(poster, emit))
    assert poster.failed == 1 and [b["message"] for b in post.bodies] == ["b"]


def test_the_pairs_emitter_posts_through_the_runtimes_poster():
    """handlers._emitter hands Events to the runtime's poster (not kopf.event, which needs kopf's context and would
    post through kopf's unbounded session) and keeps the pair's reference only."""
    from pdpair.operator.glue import handlers
    from pdpair.operator.act.reconciler import Runtime

    poster = EventPoster(FakePost())
    runtime = Runtime(config=None, core=None, custom=None, leaser=None, events=poster)
    body = {"metadata": {"namespace": "ns", "name": "p", "uid": "u", "managedFields": [{"big": "x" * 10000}]},
            "spec": {}}
    emit = handlers._emitter(runtime, body)
    emit("Normal", "PodCreated", "created decode p-decode-g1 (generation 1)")
    assert len(poster) == 1
    kept = [c.cell_contents for c in emit.__closure__ or ()]
    assert body not in kept and body["metadata"] not in kept

"""kopf_internals, the lean watch: kopf's watch events reach kopf's queues and its kept bodies without metadata.managedFields. Runs
kopf's own queueing lookup (the name it calls at each stream's start) against the wrapped stream; no cluster,
milliseconds."""

from __future__ import annotations

import asyncio

import pytest

from pdpair.operator.glue import kopf_internals as lean_watch


def event(kind: str = "MODIFIED") -> dict:
    return {"type": kind, "object": {"metadata": {"name": "p", "managedFields": [{"manager": "x"}], "labels": {}},
                                     "spec": {"a": 1}}}


def test_events_lose_managed_fields_and_keep_the_rest():
    async def watch(**_):
        yield event()
        yield "LISTED"  # kopf's Bookmark markers pass as they are
        yield {"type": "ERROR", "object": {"code": 410}}

    async def read():
        return [e async for e in lean_watch.lean(watch)(settings=None)]

    first, marker, error = asyncio.run(read())
    assert first == {"type": "MODIFIED", "object": {"metadata": {"name": "p", "labels": {}}, "spec": {"a": 1}}}
    assert marker == "LISTED" and error == {"type": "ERROR", "object": {"code": 410}}


def test_install_wraps_the_stream_kopf_queueing_calls_once(monkeypatch):
    from kopf._cogs.clients import watching
    from kopf._core.reactor import queueing

    assert queueing.watching is watching  # queueing looks the stream up on this module at each start
    original = watching.infinite_watch
    monkeypatch.setattr(watching, "infinite_watch", original)
    lean_watch.install()
    lean_watch.install()
    wrapped = watching.infinite_watch
    assert wrapped is not original and wrapped.__wrapped__ is original  # once, not twice


def test_install_refuses_a_kopf_without_the_stream(monkeypatch):
    from kopf._cogs.clients import watching

    monkeypatch.delattr(watching, "infinite_watch")
    with pytest.raises(RuntimeError, match="infinite_watch is gone"):
        lean_watch.install()


def test_closing_the_lean_stream_closes_kopfs():
    closed = []

    async def watch(**_):
        try:
            while True:
                yield event()
        finally:
            closed.append(True)

    async def read_one():
        stream = lean_watch.lean(watch)()
        assert "managedFields" not in (await stream.__anext__())["object"]["metadata"]
        await stream.aclose()

    asyncio.run(read_one())
    assert closed == [True]

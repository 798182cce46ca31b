"""`python -m pdpair.operator`, except that it dies like a SIGKILL (os._exit: no cleanup, no queued work flushed)
right after the status write that records a restart: the worst moment for anything announced about that restart.

kopf's own Event queue is made to lag by EVENT_QUEUE_LAG_SECONDS, as it does on a loaded machine (in CI a leader
SIGKILLed mid-restart lost several queued Restarting Events). What the operator must not lose has to be posted
before the write, not queued.

Test-side only: the operator's code is unchanged; this wraps two functions, then runs the operator's entry point.
"""
import asyncio
import os
import runpy

CRASH_EXIT_CODE = 137  # what a SIGKILLed process reports
EVENT_QUEUE_LAG_SECONDS = 2.0


def main() -> None:
    from kopf._cogs.clients import events as kopf_events  # what kopf's Event poster calls, looked up per call

    from pdpair.operator.act import reconciler

    post_event = kopf_events.post_event

    async def post_event_late(**kwargs):
        await asyncio.sleep(EVENT_QUEUE_LAG_SECONDS)
        await post_event(**kwargs)

    write_status = reconciler.PairReconciler._write_status

    async def write_status_then_die(self, fields, conditions, meta_generation):
        written = await write_status(self, fields, conditions, meta_generation)
        if "lastRestart" in fields:  # only the write that records a new restart carries it
            os._exit(CRASH_EXIT_CODE)
        return written

    kopf_events.post_event = post_event_late
    reconciler.PairReconciler._write_status = write_status_then_die
    runpy.run_module("pdpair.operator", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

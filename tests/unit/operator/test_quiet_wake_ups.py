"""kopf logs "Handler '<name>' succeeded." after every watch-event handler; the operator's wake-up handlers run on every
pod, pair, Service and budget event (17.7k of 24k log lines while 1000 pairs started; 5-7% of the event loop in
py-spy). kopf_internals.QuietWakeUps drops exactly those lines. Cost: under a second (imports kopf, no I/O)."""

from __future__ import annotations

import inspect
import logging

from pdpair.operator.glue import handlers, kopf_internals


def _record(level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord("kopf.objects", level, __file__, 1, msg, None, None)


def test_only_the_wake_up_handlers_success_lines_are_dropped():
    quiet = kopf_internals.QuietWakeUps(handlers.WAKE_UP_HANDLERS)
    for name in handlers.WAKE_UP_HANDLERS:
        assert not quiet.filter(_record(logging.INFO, f"Handler '{name}' succeeded."))
        assert quiet.filter(_record(logging.ERROR, f"Handler '{name}' failed with an exception and will try again"))
    assert quiet.filter(_record(logging.INFO, "Daemon 'reconcile' succeeded."))
    assert quiet.filter(_record(logging.INFO, "Handler 'delete_pair' succeeded."))
    assert quiet.filter(_record(logging.INFO, "pair scale/p0001: Ready (generation 1 is ready)"))


def test_the_names_are_the_watch_event_handlers_and_the_filter_is_installed_once():
    """A renamed handler would silently be logged again: the names must be the functions kopf.on.event registered,
    the ones whose only work is a wake-up."""
    for name in handlers.WAKE_UP_HANDLERS:
        fn = getattr(handlers, name)
        assert inspect.iscoroutinefunction(fn), name
        assert "wake(" in inspect.getsource(fn), name
    objects = logging.getLogger("kopf.objects")
    before = list(objects.filters)
    try:
        kopf_internals.quiet_wake_ups(handlers.WAKE_UP_HANDLERS)
        kopf_internals.quiet_wake_ups(handlers.WAKE_UP_HANDLERS)
        assert sum(isinstance(f, kopf_internals.QuietWakeUps) for f in objects.filters) == 1
        objects.setLevel(logging.INFO)
        seen: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                seen.append(record.getMessage())

        keep = Keep()
        objects.addHandler(keep)
        objects.info("Handler 'pod_changed' succeeded.")
        objects.info("Handler 'something_else' succeeded.")
        objects.removeHandler(keep)
        assert seen == ["Handler 'something_else' succeeded."]
    finally:
        objects.filters[:] = before
        objects.setLevel(logging.NOTSET)

"""Test-only knobs of the connector, never set by the operator: decode's slow-step knob file (`SlowDecodeKnob`,
kv_connector_extra_config's test_slow_decode_file, TEST_ONLY_PDPAIR_SLOW_DECODE_FILE) and the byte a test flips to
corrupt KV (TEST_CORRUPT_KV_BYTE), decode's stop-listener knob file (`StopListenerKnob`,
TEST_ONLY_PDPAIR_STOP_LISTENER_FILE), which ends the side-channel loop as a bug would, and prefill's corrupt-puts knob
file (`put_fault_from_knob`, test_corrupt_puts_file, TEST_ONLY_PDPAIR_CORRUPT_PUTS_FILE), which damages every put on the
way: a byte flipped, misaddressed, stale-tagged or cut short, as its content says. Kept here, apart from the product's code paths, so a reader sees at once what exists only for
tests."""

from __future__ import annotations

import logging
import math
import os
import time

from pdpair import contract

logger = logging.getLogger("pdpair.connector.worker")  # the name the worker's lines had before the split


# TEST ONLY (test_corrupt_kv_file): the byte the corruption knob writes over every received KV block.
TEST_CORRUPT_KV_BYTE = 0x3F

# TEST ONLY (test_slow_decode_file): the knob file is read at most this often, so an engine step costs a file read
# twice a second at most; a change shows within this long.
TEST_SLOW_DECODE_POLL_SECONDS = 0.5

# TEST ONLY (test_slow_decode_file): the largest delay the file may ask for. Seconds per step already make a decode
# useless to the router; a larger number is more likely a unit mistake, and would stall the engine instead.
TEST_SLOW_DECODE_MAX_MS = 10_000


class SlowDecodeKnob:
    """TEST ONLY (test_slow_decode_file): how long each decode model step sleeps, so a test can make one decode of
    several measurably slower (the router should then send it fewer requests).

    While the file exists its content is a number of milliseconds, finite, 0..TEST_SLOW_DECODE_MAX_MS; absent: no
    delay. Read at most every TEST_SLOW_DECODE_POLL_SECONDS (the answer is cached in between). A content that is not
    such a number means no delay and is logged once, never raised: a typo in a test must not take the engine down."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._read_at: float | None = None
        self._text: str | None = None  # the content last read; None: the file was absent
        self._delay_seconds = 0.0

    def delay_seconds(self) -> float:
        now = time.monotonic()
        if self._read_at is not None and now - self._read_at < TEST_SLOW_DECODE_POLL_SECONDS:
            return self._delay_seconds
        self._read_at = now
        try:
            with open(self.path) as knob:
                text: str | None = knob.read().strip()
        except FileNotFoundError:
            text = None
        except OSError as exc:  # e.g. a directory: a bad content like any other (no delay, said once)
            text = f"<unreadable: {exc.strerror or exc}>"
        if text == self._text:
            return self._delay_seconds
        self._text = text  # the log lines below come once per change of content, not once per step
        self._delay_seconds = 0.0
        if text is None:
            logger.warning("TEST KNOB %s removed: decode steps are no longer slowed", self.path)
            return 0.0
        milliseconds = knob_milliseconds(text)
        if milliseconds is None:
            logger.warning("TEST KNOB %s: %r is not a number of milliseconds in 0..%d: ignored (decode steps are "
                           "not slowed)", self.path, text[:60], TEST_SLOW_DECODE_MAX_MS)
            return 0.0
        self._delay_seconds = milliseconds / 1000
        logger.warning("TEST KNOB %s present: every decode model step sleeps %g ms", self.path, milliseconds)
        return self._delay_seconds

    def sleep(self) -> None:
        delay = self.delay_seconds()
        if delay > 0:
            time.sleep(delay)


def knob_milliseconds(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and 0 <= value <= TEST_SLOW_DECODE_MAX_MS else None


# TEST ONLY (test_stop_listener_file): how often decode's side-channel loop looks for the knob file.
TEST_STOP_LISTENER_POLL_SECONDS = 0.5


class ListenerStoppedByTestKnob(RuntimeError):
    """TEST ONLY: raised in decode's side-channel loop when its stop-listener knob file appears."""


class StopListenerKnob:
    """TEST ONLY (test_stop_listener_file): once the file exists, decode's side-channel loop raises
    ListenerStoppedByTestKnob, and so leaves the way an unexpected exception would (the listener closes, /readyz
    answers 503, `pdpair_listener_failed` turns 1). Nothing a peer sends can end the loop any more, so a test on real
    pods needs this to show what the operator does when the loop stops anyway. The file is looked for at most every
    TEST_STOP_LISTENER_POLL_SECONDS (one stat a half second, only while the knob is configured)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._checked_at: float | None = None

    def check(self) -> None:
        now = time.monotonic()
        if self._checked_at is not None and now - self._checked_at < TEST_STOP_LISTENER_POLL_SECONDS:
            return
        self._checked_at = now
        if os.path.lexists(self.path):
            logger.warning("TEST KNOB %s present: stopping decode's side-channel loop", self.path)
            raise ListenerStoppedByTestKnob(f"test knob {self.path} present")


# TEST ONLY (test_corrupt_puts_file): the count given to the native put faults ("the next n puts") while the knob file
# exists: 2**64 - 1, more puts than a connection ever posts, so every put is damaged until the file is gone and the
# next push sets the count back to 0.
TEST_CORRUPT_ALL_PUTS = 2**64 - 1

# TEST ONLY (test_corrupt_puts_file): the knob file's content (stripped) -> the native fault it sets, named by the
# refusal reason decode must count for it (pdpair_kv_transfers_rejected_total{reason}); empty means a flipped byte.
PUT_FAULT_BY_CONTENT = {
    "": "CORRUPT_PUTS",
    contract.REJECTED_CHECKSUM: "CORRUPT_PUTS",                 # a byte flipped after the checksum was taken
    contract.REJECTED_OUTSIDE_WINDOW: "MISADDRESS_PUTS",        # put into block 0, which no Pull asks for
    contract.REJECTED_UNEXPECTED_TRANSFER: "STALE_TAG_PUTS",    # the previous transfer's tag (retired, blocks reused)
    contract.REJECTED_INCOMPLETE: "TRUNCATE_PUTS",              # half of the block, with that half's checksum
}


def put_fault_from_knob(path: str | None) -> str | None:
    """TEST ONLY (test_corrupt_puts_file): the native put fault (a `pdpair.native.Fault` name) every put of the next
    push goes out with, while the file at `path` exists: its content names the refusal reason to cause (see
    PUT_FAULT_BY_CONTENT; empty: a flipped byte). None without a path, with the file absent, or with a content that
    names no fault (logged, never raised: a typo in a test must not take the engine down). Prefill asks before each
    push, so the knob takes effect on the next Pull served and ends likewise."""
    if not path or not os.path.lexists(path):
        return None
    try:
        with open(path) as knob:
            content = knob.read(256).strip()  # a name is a few bytes; a huge file is not read whole
    except OSError as exc:
        logger.warning("TEST KNOB %s unreadable (%s): no put fault", path, exc.strerror or exc)
        return None
    fault = PUT_FAULT_BY_CONTENT.get(content)
    if fault is None:
        logger.warning("TEST KNOB %s: %r names no put fault (one of %s): none set", path, content[:60],
                       sorted(k for k in PUT_FAULT_BY_CONTENT if k))
    return fault

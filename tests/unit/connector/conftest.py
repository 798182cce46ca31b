"""Fixtures shared by the connector's unit tests."""
import contextlib
import logging

import pytest


@contextlib.contextmanager
def _pdpair_logs(caplog, level: int):
    """caplog at `level` for the `pdpair` loggers, also once connector.py (imported by another test) stopped `pdpair`
    propagating to the root logger."""
    pdpair_logger = logging.getLogger("pdpair")
    attach = not pdpair_logger.propagate
    if attach:
        pdpair_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(level, logger="pdpair"):
            yield caplog
    finally:
        if attach:
            pdpair_logger.removeHandler(caplog.handler)


@pytest.fixture
def error_logs(caplog):
    """The workers' errors."""
    with _pdpair_logs(caplog, logging.ERROR) as logs:
        yield logs


@pytest.fixture
def knob_logs(caplog):
    """The workers' warnings (a test knob's warnings among them)."""
    with _pdpair_logs(caplog, logging.WARNING) as logs:
        yield logs

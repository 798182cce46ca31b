"""The shared transfer suite (tests/transport_suite.py) on the tcp transport (the native core via cffi)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transport_suite import TransportSuite  # noqa: E402

from pdpair.connector.transports.tcp import TcpTransport  # noqa: E402


class TestTcpSharedSuite(TransportSuite):
    def new_transport(self, slots: int) -> TcpTransport:
        return TcpTransport(request_slots=slots)

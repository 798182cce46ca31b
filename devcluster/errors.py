"""The two errors of the dev cluster and the log-tail helper every module uses in its messages."""
from __future__ import annotations

COMPONENT_LOG_TAIL_CHARS = 4000


class BuildError(RuntimeError):
    """A Go build step failed; the message names the module, the command and the tail of its output."""


class ClusterError(RuntimeError):
    """The cluster failed to start or to do what was asked; the message carries the relevant log tail."""


def _tail(text: str, limit: int = COMPONENT_LOG_TAIL_CHARS) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]

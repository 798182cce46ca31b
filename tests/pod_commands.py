"""Test helper: reading the commands of operator-made pods."""

from __future__ import annotations

from pdpair.operator.build.pod_defaults import PREFLIGHT_COMMAND, PREFLIGHT_SEPARATOR


def without_preflight(command: list[str]) -> list[str]:
    """A pod container's command without the operator's port preflight in front: what the container runs after it."""
    if command[:len(PREFLIGHT_COMMAND)] == PREFLIGHT_COMMAND and PREFLIGHT_SEPARATOR in command:
        return command[command.index(PREFLIGHT_SEPARATOR) + 1:]
    return command

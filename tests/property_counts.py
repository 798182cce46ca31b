"""How many cases the randomized unit tests try: a CI-sized count by default, the full count with
PDPAIR_FULL_PROPERTY_TESTS=1 (tests/README.md, "Environment knobs").

Hypothesis tests take theirs from the settings profile that tests/unit/conftest.py loads ("ci" or "full", PROFILES
below) and set no max_examples of their own; the tests that loop over random sequences themselves (random.Random)
and the side-channel fuzz call cases(ci, full). Each such test's docstring states both counts."""

from __future__ import annotations

import os

FULL = os.environ.get("PDPAIR_FULL_PROPERTY_TESTS", "") not in ("", "0")

# max_examples per profile; deadline off (a loaded 2-core box is no performance verdict), no example database (no
# .hypothesis/ in the work tree; the derandomized tests try the same cases on every run anyway).
PROFILES = {"ci": 100, "full": 3000}
PROFILE = "full" if FULL else "ci"


def cases(ci: int, full: int) -> int:
    """The count a random-sequence loop runs: `ci` by default, `full` under PDPAIR_FULL_PROPERTY_TESTS=1."""
    return full if FULL else ci

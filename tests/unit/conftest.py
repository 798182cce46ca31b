"""The unit tier's hypothesis profile: a CI-sized example count by default, the full count with
PDPAIR_FULL_PROPERTY_TESTS=1 (tests/property_counts.py). Here, not in tests/conftest.py, so that no other tier's
pytest start pays for importing hypothesis."""

from hypothesis import settings

from tests import property_counts

for _name, _examples in property_counts.PROFILES.items():
    settings.register_profile(_name, max_examples=_examples, deadline=None, database=None)
settings.load_profile(property_counts.PROFILE)

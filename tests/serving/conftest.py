"""Fixtures of the serving tests: the fake servers of ``tests/rollout`` (one definition)."""

from tests.rollout.conftest import fake_servers  # noqa: F401 (a fixture, found by name)

"""Fixtures for the suites under tests/; the helpers themselves live in support.py."""

from tests.support import server  # noqa: F401  (the shared default CPU server)

"""Fixtures for the suites under tests/; the helpers themselves live in support.py."""

from tests.support import front_end_server, server  # noqa: F401  (the shared default CPU servers)

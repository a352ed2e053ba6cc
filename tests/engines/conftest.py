"""The remote engine's tests run against a real ``lmkv server`` process."""

from tests.server.conftest import server  # noqa: F401  (a fixture)

"""The testbed's one error type, apart from the modules that raise it (the runner, the real links)."""
from __future__ import annotations


class TestbedError(RuntimeError):
    """A service died, the run did not finish in time, or the testbed cannot be set up here; the
    message says why (with a service's log tail where one died)."""

    __test__ = False  # not a pytest test class

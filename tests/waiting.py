"""Wait for a condition by polling it: the one helper of the tests and of the benchmarks (bench/,
which runs without pytest), so it imports neither pytest nor Django.

Tests wait for a signal, not a clock: `wait_for` returns as soon as the predicate holds, and a
timeout is a failed expectation (an AssertionError), never a sleep that hopes.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class WaitTimedOut(AssertionError):
    """The predicate never held within the timeout."""


def wait_for(
    predicate: Callable[[], object], timeout: float = 30, *, what: str = "", interval: float = 0.2
) -> object:
    """The predicate's first true value, polled every `interval` s for up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise WaitTimedOut(f"timed out after {timeout:g} s waiting for {what or predicate}")
        time.sleep(interval)

"""Every wait of the check has a deadline: its check's time limit."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
POLL_SECONDS = 0.2


class CheckTimeout(Exception):
    """A check's time limit ran out while it waited; the message says for what."""


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def wait_for(self, probe: Callable[[], T | None], what: str, *, within: float | None = None) -> T:
        """`probe()`'s first truthy answer; CheckTimeout past `within` seconds or the deadline."""
        until = min(self.at, time.monotonic() + within) if within is not None else self.at
        while True:
            answer = probe()
            if answer:
                return answer
            if time.monotonic() >= until:
                limit = (
                    f"{within:g} s"
                    if within is not None and until < self.at
                    else f"the {self.seconds:g} s limit"
                )
                raise CheckTimeout(f"no {what} within {limit}")
            time.sleep(POLL_SECONDS)

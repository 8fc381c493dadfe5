"""Shared set-up for benchmarks: Django on a throw-away copy of the configured database."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")


def setup_django_test_db() -> Callable[[], None]:
    """Create a fresh test database (test_<name>); returns the function that drops it."""
    import django

    django.setup()
    from django.db import connection
    from django.test.utils import setup_test_environment

    setup_test_environment()
    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True)

    def teardown() -> None:
        connection.creation.destroy_test_db(old_name, verbosity=0)

    return teardown


def median_ms(fn: Callable[[], object], *, repeat: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def report(name: str, value: float, unit: str, goal: str, ok: bool) -> None:
    print(f"  {name:<48} {value:10.2f} {unit:<6} goal {goal:<10} {'OK' if ok else 'MISSED'}")

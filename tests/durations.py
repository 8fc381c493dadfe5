"""The slow tests' measured wall times, for the order xdist hands tests out in (tests/conftest.py).

`tests/durations.json` maps a test's node id to its wall time in seconds (set-up, call and
teardown), for the tests that took at least `SLOW_SECONDS` in a parallel run on the 2-core
machine. `make test-durations` runs the suite with tests/cpu_profile.py and writes it anew from
that run's rows (`python -m tests.durations test-output/run-<run>`). A test the file does not
name counts as short unless its markers say it starts real processes (`GUESSED_SECONDS`), so a
new slow test is still started early until the file is written again; a stale file only costs
time, never a result."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

FILE = Path(__file__).with_name("durations.json")
SLOW_SECONDS = 1.0
# A test not in the file that starts Celery workers, Chromium or a throwaway cluster.
GUESSED_SECONDS = 8.0
SLOW_MARKS = frozenset({"faults", "worker", "browser", "deploy"})


def load(path: Path = FILE) -> dict[str, float]:
    try:
        return {str(test): float(seconds) for test, seconds in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def from_profile(run: Path) -> dict[str, float]:
    """The slow tests of one profiled run (every test process's cpu-profile.csv under `run`)."""
    walls: dict[str, float] = {}
    for path in sorted(run.glob("*/cpu-profile.csv")):
        with path.open(newline="") as rows:
            for row in csv.DictReader(rows):
                walls[row["test"]] = max(walls.get(row["test"], 0.0), float(row["wall_s"]))
    return {test: round(wall, 1) for test, wall in sorted(walls.items()) if wall >= SLOW_SECONDS}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python -m tests.durations test-output/run-<run>", file=sys.stderr)
        return 2
    walls = from_profile(Path(argv[0]))
    if not walls:
        print(f"{argv[0]} has no cpu-profile.csv rows: make test-durations writes them", file=sys.stderr)
        return 1
    FILE.write_text(json.dumps(walls, indent=0, sort_keys=True) + "\n")
    print(f"{FILE}: {len(walls)} tests of at least {SLOW_SECONDS:g} s, {sum(walls.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

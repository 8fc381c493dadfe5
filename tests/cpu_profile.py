"""Where the suite's CPU goes, test by test: `make test PYTEST_ARGS="-p tests.cpu_profile"`.

For each test (its set-up, call and teardown together) every test process writes a row to
`test-output/run-<run>/<worker>/cpu-profile.csv`: the wall time, the test process's own CPU
(user and system) and that of the processes it started and reaped meanwhile (RUSAGE_CHILDREN:
the Celery workers, portals, jobs and deployments a test starts and ends through its handle).
At the end the controller prints the tests and the files that cost the most, with the run's sums.

What it cannot see: a process nobody reaped during the test. Chromium's processes are reaped by
Playwright's driver, which runs for the whole test process and is ended with it, so the browser
tests' own rows show little of Chromium; kernel process accounting (`accton`, the `acct` package)
over a whole run shows it, as docs/development.md ("One Chromium per test process") reports.
Session-wide set-up (the kept migrated database, the fault suite's cluster) lands on the test
that first needed it. The session's end (the Celery workers' fork server, reaped with the CPU of
every worker it forked, 10-27 s a process) runs in the last test's teardown: it gets a row of its
own, SESSION_END, not that test's."""

from __future__ import annotations

import csv
import os
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.isolation import OUTPUT

FIELDS = ["test", "wall_s", "self_cpu_s", "children_cpu_s"]
NAME = "cpu-profile.csv"
SHOWN = 25


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


SESSION_END = "(the last test's teardown and the session's end)"
_ENDED = pytest.StashKey[tuple[float, float, float]]()


def _now() -> tuple[float, float, float]:
    return time.perf_counter(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)


def _spent(since: tuple[float, float, float]) -> tuple[float, float, float]:
    return tuple(after - before for after, before in zip(_now(), since, strict=True))  # type: ignore[return-value]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    began = _now()
    yield
    spent = _spent(began)
    if (ended := item.stash.get(_ENDED, None)) is not None:
        spent = tuple(whole - end for whole, end in zip(spent, ended, strict=True))  # type: ignore[assignment]
        _write(SESSION_END, ended)
    _write(item.nodeid, spent)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """The last test's teardown also ends every fixture of the session: measured apart."""
    began = _now()
    yield
    if nextitem is None:
        item.stash[_ENDED] = _spent(began)


def _write(test: str, spent: tuple[float, float, float]) -> None:
    wall, own, children = spent
    row = {
        "test": test,
        "wall_s": f"{wall:.3f}",
        "self_cpu_s": f"{own:.3f}",
        "children_cpu_s": f"{children:.3f}",
    }
    path = OUTPUT / NAME
    new = not path.exists()
    with path.open("a", newline="") as out:  # a row at a time: a crashed worker keeps its rows
        writer = csv.DictWriter(out, FIELDS)
        if new:
            writer.writeheader()
        writer.writerow(row)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """In the controller (or a run without xdist): every test process's rows of this run."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    rows = [row for path in sorted(OUTPUT.parent.glob(f"*/{NAME}")) for row in _read(path)]
    if not rows:
        return
    ends = [row for row in rows if row["test"] == SESSION_END]
    rows = [row for row in rows if row["test"] != SESSION_END]
    cost = {row["test"]: float(row["self_cpu_s"]) + float(row["children_cpu_s"]) for row in rows}
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for row in rows:
        sums = by_file[row["test"].split("::")[0]]
        sums[0] += float(row["self_cpu_s"])
        sums[1] += float(row["children_cpu_s"])
        sums[2] += float(row["wall_s"])
    write = terminalreporter.write_line
    terminalreporter.section("CPU by test (tests/cpu_profile.py)")
    own, reaped, wall = (sum(sums[n] for sums in by_file.values()) for n in range(3))
    write(f"{len(rows)} tests: own CPU {own:.0f} s, their processes' {reaped:.0f} s, wall {wall:.0f} s")
    write(f"rows: {OUTPUT.parent}/*/{NAME}")
    if ends:
        ended = [float(row["self_cpu_s"]) + float(row["children_cpu_s"]) for row in ends]
        where = f"{len(ends)} test process{'' if len(ends) == 1 else 'es'}"
        write(f"the session's end in {where}: {sum(ended):.0f} s of CPU, not counted above")
    for test, seconds in sorted(cost.items(), key=lambda item: -item[1])[:SHOWN]:
        write(f"{seconds:8.1f} s  {test}")
    write("by file: own CPU, processes' CPU, wall")
    for name, (mine, theirs, spent) in sorted(by_file.items(), key=lambda item: -sum(item[1][:2]))[:SHOWN]:
        write(f"{mine:8.1f} {theirs:8.1f} {spent:8.1f}  {name}")


def _read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as rows:
        return list(csv.DictReader(rows))

"""A bench that remembers (issue 40): each `make bench` run's figures are written to
var/bench/<commit>.json and compared with bench/baseline.json, the figures of a run chosen on
purpose (`make bench-baseline`, said in its commit message).

A figure of time depends on the machine and on what else it runs, so each run also measures a
calibration: a fixed CPU-bound piece of work and a fixed database-bound one (SQLite on a file:
the disk, the SQL engine and the Python around them), at its start and its end. A time is
compared as its ratio to that run's calibration; counts and shares are compared as they are. A
figure more than SLIP (25 %) worse than its baseline, in that sense, prints SLIPPED and the run
exits non-zero.

Which way is worse comes from the figure's goal: "<= 25 ms" (lower is better), ">= 50 %"
(higher is better); a time with no goal is better lower; any other figure with no goal is
printed, not judged. So is a *tail* with no goal (a p90 or max of a few samples): the scheduler's
warm pass p90 of 20 ranged 45–115 ms over two runs of one commit on a quiet machine (a pass or
two of twenty met a collection or the database's autovacuum), so a 25 % rule on it cried wolf.
A tail with a goal ("max <= 3 s") is a promise, and stays judged.
"""

from __future__ import annotations

import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "bench" / "baseline.json"
RUNS = ROOT / "var" / "bench"
RECORD_ENV = "BENCH_RECORD"  # the file a run's scripts append their figures to (run_all sets it)
SCRIPT_ENV = "BENCH_SCRIPT"  # the script's name, the first part of each figure's key
SLIP = 1.25
TAILS = (" p90", " p95", " p99", " max")  # in a figure's name: a tail of its samples
TIME_UNITS = {"us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1000.0, "min": 60_000.0}


def record(name: str, value: float, unit: str, goal: str) -> None:
    """One figure of the running script, appended to the run's record (nothing when the script
    runs alone, outside `make bench`)."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    script = os.environ.get(SCRIPT_ENV) or Path(sys.argv[0]).stem
    line = {"key": f"{script}: {name.strip()}", "value": value, "unit": unit.strip(), "goal": goal.strip()}
    with open(path, "a") as out:
        out.write(json.dumps(line) + "\n")


def median_ms(work: Callable[[], object], *, repeat: int = 5, warmup: int = 0) -> float:
    """The median time of `repeat` calls, in ms, after `warmup` untimed ones."""
    for _ in range(warmup):
        work()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def _cpu_work() -> int:
    """Pure Python, as the portal's own code is: dicts, strings, sorting."""
    rows = [{"uuid": f"GPU-{n:08x}", "used": (n * 7919) % 81920, "index": n % 8} for n in range(60_000)]
    rows.sort(key=lambda row: (row["used"], row["uuid"]))
    return sum(len(json.dumps(row)) for row in rows[::10])


def _database_work() -> int:
    """A fixed round of writes and reads on a SQLite file: what the file system and an SQL engine
    take."""
    with tempfile.TemporaryDirectory() as folder:
        db = sqlite3.connect(Path(folder) / "calibration.sqlite3")
        # Without waiting for the disk to confirm (fsync): its latency on a shared machine varied
        # 15-fold from one minute to the next, which would make the calibration the noise.
        db.execute("PRAGMA synchronous = OFF")
        db.execute("CREATE TABLE card (id INTEGER PRIMARY KEY, server TEXT, used INTEGER)")
        for batch in range(300):
            db.executemany(
                "INSERT INTO card (server, used) VALUES (?, ?)",
                [(f"s{(batch * 250 + n) % 64}", n) for n in range(250)],
            )
            db.commit()
        found = db.execute("SELECT server, SUM(used) FROM card GROUP BY server ORDER BY 2").fetchall()
        db.close()
        return len(found)


def calibrate() -> dict[str, float]:
    """The calibration's two pieces, in ms (medians of 5)."""
    return {"cpu_ms": median_ms(_cpu_work), "database_ms": median_ms(_database_work)}


@dataclass(frozen=True)
class Verdict:
    key: str
    line: str
    slipped: bool


def _lower_is_better(unit: str, goal: str) -> bool | None:
    goal = goal.strip()
    if goal.startswith(("<", "≤")) or goal in ("0", "= 0"):  # "= 0": none is the goal, more is worse
        return True
    if goal.startswith((">", "≥")):
        return False
    return True if unit in TIME_UNITS else None


def _scale(figure: dict, calibration: dict[str, float]) -> float:
    """A time as a multiple of its run's calibration; any other figure as it is."""
    if figure["unit"] not in TIME_UNITS:
        return float(figure["value"])
    return figure["value"] * TIME_UNITS[figure["unit"]] / (calibration["cpu_ms"] + calibration["database_ms"])


def compare(run: dict, baseline: dict) -> list[Verdict]:
    """Each figure of `run` against the same figure of `baseline` (both as `run_write` writes)."""
    verdicts = []
    for key, figure in sorted(run["figures"].items()):
        before = baseline.get("figures", {}).get(key)
        shown = f"{figure['value']:.2f} {figure['unit']}"
        if before is None or before["unit"] != figure["unit"]:
            verdicts.append(Verdict(key, f"{key}: {shown} (new: no baseline)", False))
            continue
        lower = _lower_is_better(figure["unit"], figure["goal"])
        now, then = _scale(figure, run["calibration"]), _scale(before, baseline["calibration"])
        ratio = now / then if then else (1.0 if now == then else float("inf"))
        was = f"{before['value']:.2f} {before['unit']}"
        if lower is None:
            verdicts.append(Verdict(key, f"{key}: {shown}, baseline {was} (no goal: not judged)", False))
            continue
        if figure["goal"] in ("", "(none)") and any(tail in key for tail in TAILS):
            verdicts.append(
                Verdict(key, f"{key}: {shown}, baseline {was} (a tail, no goal: not judged)", False)
            )
            continue
        worse = ratio if lower else (1 / ratio if ratio else float("inf"))
        slipped = worse > SLIP
        said = "SLIPPED" if slipped else "ok"
        adjusted = " (against the calibration)" if figure["unit"] in TIME_UNITS else ""
        line = f"{key}: {shown}, baseline {was}, {worse:.2f}x{adjusted} {said}"
        verdicts.append(Verdict(key, line, slipped))
    return verdicts


def commit() -> str:
    """HEAD's short id, "-dirty" when tracked files differ from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        return done.stdout.strip()

    name = git("rev-parse", "--short=12", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"{name}-dirty" if dirty else name


def run_write(record_path: Path, calibration: dict[str, float], database: str) -> Path:
    """The run's figures (the last value of each key) and calibration, in var/bench/<commit>.json."""
    figures: dict[str, dict] = {}
    if record_path.exists():
        for line in record_path.read_text().splitlines():
            figure = json.loads(line)
            figures[figure.pop("key")] = figure
    RUNS.mkdir(parents=True, exist_ok=True)
    path = RUNS / f"{commit()}.json"
    run = {
        "commit": commit(),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "database": database,
        "calibration": calibration,
        "figures": figures,
    }
    path.write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    return path


def baseline_read() -> dict | None:
    return json.loads(BASELINE.read_text()) if BASELINE.exists() else None


def baseline_set() -> int:
    """`make bench-baseline`: the newest run becomes bench/baseline.json (commit it, saying why)."""
    runs = sorted(RUNS.glob("*.json"), key=lambda path: path.stat().st_mtime)
    if not runs:
        print("No run to take as the baseline: run `make bench` first.", file=sys.stderr)
        return 1
    BASELINE.write_text(runs[-1].read_text())
    print(f"bench/baseline.json is now {runs[-1].name}: commit it, saying why in the message.")
    return 0


if __name__ == "__main__":
    sys.exit(baseline_set() if sys.argv[1:] == ["--baseline"] else 2)

"""`make bench`: run every bench/bench_*.py, then bench/faults.py (recovery after outages), each in
its own process, and print their figures; then keep them (var/bench/<commit>.json) and compare
them with bench/baseline.json (bench/memory.py). Exits non-zero when a script fails or a figure
SLIPPED. Names given (`bench/run_all.py bench_inventory bench_queue`) run those alone."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import memory  # noqa: E402 - after the path above


def _scripts(names: list[str]) -> list[Path]:
    every = [*sorted((ROOT / "bench").glob("bench_*.py")), ROOT / "bench" / "faults.py"]
    if not names:
        return every
    unknown = sorted(set(names) - {script.stem for script in every})
    if unknown:
        sys.exit(f"No such bench: {', '.join(unknown)} (the scripts: {', '.join(s.stem for s in every)})")
    return [script for script in every if script.stem in names]


# The hot paths measured on both databases in every run: PostgreSQL (production's) from the local
# server the tests use, SQLite embedded. The other scripts run on the configured database.
BOTH_DATABASES = ("bench_inventory", "bench_queue")
POSTGRES_URL = os.environ.get("BENCH_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test")


def _postgres_answers() -> bool:
    import psycopg

    try:
        psycopg.connect(POSTGRES_URL, connect_timeout=3).close()
    except psycopg.Error:
        return False
    return True


def _runs(scripts: list[Path]) -> list[tuple[Path, str, dict[str, str | None]]]:
    """(script, the name its figures are kept under, its database's environment) of each run."""
    postgres = None
    runs: list[tuple[Path, str, dict[str, str | None]]] = []
    for script in scripts:
        if script.stem not in BOTH_DATABASES:
            runs.append((script, script.stem, {}))
            continue
        runs.append((script, f"{script.stem}[sqlite]", {"DATABASE_URL": None}))
        postgres = _postgres_answers() if postgres is None else postgres
        if postgres:
            runs.append((script, f"{script.stem}[postgresql]", {"DATABASE_URL": POSTGRES_URL}))
        else:
            print(f"== {script.stem}: no PostgreSQL at {POSTGRES_URL} (BENCH_POSTGRES_URL): SQLite only")
    return runs


def main(names: list[str]) -> int:
    scripts = _scripts(names)
    print("== calibration (a fixed CPU-bound and database-bound piece of work)", flush=True)
    before = memory.calibrate()
    failed = 0
    with tempfile.TemporaryDirectory() as folder:
        record = Path(folder) / "figures.jsonl"
        for script, name, database_env in _runs(scripts):
            print(f"== {name}", flush=True)
            env = {**os.environ, **database_env, memory.RECORD_ENV: str(record), memory.SCRIPT_ENV: name}
            env = {key: value for key, value in env.items() if value is not None}
            failed += subprocess.call([sys.executable, "-m", f"bench.{script.stem}"], cwd=ROOT, env=env) != 0
        after = memory.calibrate()
        # The mean of the two: the machine's speed over the whole run, not at one moment.
        calibration = {key: (before[key] + after[key]) / 2 for key in before}
        database = "postgresql" if os.environ.get("DATABASE_URL", "").startswith("postgres") else "sqlite"
        path = memory.run_write(record, calibration, database)
    print(
        f"== kept in {path.relative_to(ROOT)}; calibration {calibration['cpu_ms']:.1f} ms CPU,"
        f" {calibration['database_ms']:.1f} ms database"
    )
    slipped = _compared(path)
    return 1 if failed or slipped else 0


def _compared(path: Path) -> int:
    baseline = memory.baseline_read()
    if baseline is None:
        print("== no bench/baseline.json to compare with: `make bench-baseline` makes one")
        return 0
    verdicts = memory.compare(json.loads(path.read_text()), baseline)
    print(f"== against bench/baseline.json ({baseline['commit']}, {baseline['at']}):")
    for verdict in verdicts:
        print(f"  {verdict.line}")
    slipped = [v for v in verdicts if v.slipped]
    if slipped:
        print(f"== {len(slipped)} figure(s) SLIPPED more than {memory.SLIP - 1:.0%} against the baseline")
    return len(slipped)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

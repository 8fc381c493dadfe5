"""`make bench`: run every bench/bench_*.py, then bench/faults.py (recovery after outages), each in
its own process, and print their figures."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    failed = 0
    for script in [*sorted((ROOT / "bench").glob("bench_*.py")), ROOT / "bench" / "faults.py"]:
        print(f"== {script.name}", flush=True)
        failed += subprocess.call([sys.executable, "-m", f"bench.{script.stem}"], cwd=ROOT) != 0
    sys.exit(1 if failed else 0)

"""The one `celery worker` command line: `make run`, the tests and the benchmarks start workers
with it (the systemd unit in deploy/ spells the same options out)."""

from __future__ import annotations

import sys


def worker_argv(
    queues: str,
    node: str,
    *,
    pool: str = "prefork",
    concurrency: int = 1,
    beat_schedule: str | None = None,
    quiet: bool = False,
) -> list[str]:
    """`node` is Celery's node name (`name@host`); `beat_schedule` also runs the one beat.
    `quiet` (make run): no banner and warnings only, so a terminal shows what needs a look."""
    argv = [sys.executable, "-m", "celery", "-A", "portal", *(["--quiet"] if quiet else []), "worker"]
    argv += ["-Q", queues, "-n", node, "--pool", pool, "--without-gossip", "--without-mingle"]
    argv += ["-l", "WARNING" if quiet else "INFO"]
    if pool == "prefork":
        argv += ["--concurrency", str(concurrency)]
    if beat_schedule:
        argv += ["-B", "-s", beat_schedule]
    return argv

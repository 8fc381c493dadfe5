"""The one `celery worker` command line: `make run`, the tests and the benchmarks start workers
with it (the systemd unit in deploy/ spells the same options out)."""

from __future__ import annotations

import sys


def worker_argv(
    queues: str, node: str, *, pool: str = "prefork", concurrency: int = 1, beat_schedule: str | None = None
) -> list[str]:
    """`node` is Celery's node name (`name@host`); `beat_schedule` also runs the one beat."""
    argv = [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", queues, "-n", node]
    argv += ["--pool", pool, "--without-gossip", "--without-mingle", "-l", "INFO"]
    if pool == "prefork":
        argv += ["--concurrency", str(concurrency)]
    if beat_schedule:
        argv += ["-B", "-s", beat_schedule]
    return argv

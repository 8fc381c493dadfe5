"""The one `celery worker` and the one web server command line: `make run`, the tests and the
benchmarks start them with these (the systemd units in deploy/ spell the same options out)."""

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
    # --skip-checks: Celery's Django fixup runs every system check at a worker's start and throws the
    # result away (celery/fixups/django.py, validate_models), and the checks import the URLconf, DRF
    # and every view: a third of a worker's start-up CPU (1.16 -> 0.82 s), for nothing. The web unit
    # runs `manage.py check --deploy` before it serves; a task that reverses a URL loads it then.
    argv = [sys.executable, "-m", "celery", "-A", "portal", "--skip-checks", *(["--quiet"] if quiet else [])]
    argv += ["worker"]
    argv += ["-Q", queues, "-n", node, "--pool", pool, "--without-gossip", "--without-mingle"]
    argv += ["-l", "WARNING" if quiet else "INFO"]
    if pool == "prefork":
        argv += ["--concurrency", str(concurrency)]
    if beat_schedule:
        argv += ["-B", "-s", beat_schedule]
    return argv


def web_argv(bind: str, *, workers: int = 2, access_log: bool = True) -> list[str]:
    """gunicorn with uvicorn's worker: ASGI, so a live log stream waits on Redis in the event loop
    instead of holding a thread (docs/design.md, "One ASGI server"); sync views run in threads.
    No control socket: nothing here uses it, and the default ~/.gunicorn/gunicorn.ctl would be
    fought over by two portals on one machine (a test's and `make run`)."""
    argv = [sys.executable, "-m", "gunicorn", "portal.asgi", "-k", "portal.asgi_worker.Worker", "-b", bind]
    argv += ["--workers", str(workers)]
    # `make run` shows no access line unless LOG_LEVEL=debug: every page polls or streams, and a
    # line each would drown the terminal.
    argv += ["--access-logfile", "-"] if access_log else ["--log-level", "warning"]
    return [*argv, "--no-control-socket"]

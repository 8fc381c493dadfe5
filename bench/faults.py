"""Recovery times after an outage, on the fault suite's throwaway servers (tests/fault_servers.py).

What is measured
    1. Database back → job end recorded. The real portal (gunicorn, the portal's worker, a GPU
       host's worker) on a PostgreSQL cluster of its own. A job prints 10 lines over ~2 s; once
       its first line is stored, PostgreSQL is stopped (fast) for 6 s, so the job ends while the
       database is away. From the moment the server accepts connections again to the moment
       GET /api/v1/jobs/<id>/ shows the job finished (polled every 50 ms). Median of ROUNDS.
       Goal: ≤ 5 s (the worker tries its final write again every 2 s).
    2. Redis back → stranded job running. A host worker with one slot (solo pool) runs a job that
       holds it; a second job's message waits in Redis. redis-server is SIGKILLed and started
       again, empty (the message is gone), and the slot is freed at once. From Redis answering
       again to the second job shown running or finished. Median of ROUNDS.
       Goal: ≤ 60 s (what tests/test_faults.py allows).
    3. PostgreSQL frozen → request answered 503. Every PostgreSQL process SIGSTOPped (it neither
       answers nor closes; its kernel still acknowledges): from GET /api/v1/jobs/ sent, on a web
       server whose threads hold pooled connections, to its 503. With FROZEN_DEADLINES
       (DATABASE_STATEMENT_TIMEOUT_SECONDS=2, connect_timeout=2): the deadline, 1 s of margin,
       then a new connection's connect_timeout. Median of ROUNDS. Goal: ≤ 6 s.
    4. Ctrl-C with PostgreSQL frozen → everything stopped. A job holds the host worker's slot;
       PostgreSQL is frozen; SIGTERM to the web server and both workers, as Ctrl-C or systemd: until
       every one of them has exited. Median of ROUNDS (a fresh portal each). Goal: ≤ 15 s.

A round that does not recover within TIMEOUT s stops its figure there: printed as MISSED.
Needs what the fault suite needs: PostgreSQL server binaries, redis-server, and as root a
`postgres` account; without them it says why and measures nothing. Only its own servers are
ever stopped, never the configured database or Redis.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import django

from bench.common import report

django.setup()  # tests.fault_servers reads the portal's models

from tests.fault_servers import (  # noqa: E402 - after django.setup()
    FINISHED,
    HOLD,
    QUICK,
    SERVER,
    Api,
    Portal,
    ThrowawayPostgres,
    ThrowawayRedis,
    lines_script,
    unavailable,
)

ROUNDS = 3
TIMEOUT = 90.0
POLL_S = 0.05
OUTAGE_S = 6.0
LINES = lines_script(10, every=0.2)
FROZEN_DEADLINES = {"DATABASE_STATEMENT_TIMEOUT_SECONDS": "2"}
FROZEN_CONNECT_TIMEOUT = "2"


@contextlib.contextmanager
def portal_up(
    *, host_pool: str, deadlines: bool = False
) -> Iterator[tuple[Api, ThrowawayPostgres, ThrowawayRedis, Portal, str]]:
    tag = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as folder:
        scratch = Path(folder)
        postgres, broker = ThrowawayPostgres(tag=tag), ThrowawayRedis(tag=tag)
        portal: Portal | None = None
        try:
            postgres.start()
            broker.start()
            url = postgres.create_database("portal")
            Portal.prepare(url, scratch)
            if deadlines:
                url += f"?connect_timeout={FROZEN_CONNECT_TIMEOUT}"
            portal = Portal(database_url=url, redis_url=broker.url, scratch=scratch, tag=tag)
            if deadlines:
                portal.env.update(FROZEN_DEADLINES)
            api = portal.start(host_pool=host_pool)
            yield api, postgres, broker, portal, tag
            api.close()
        finally:
            if portal is not None:
                portal.stop()
            broker.close()
            postgres.close()


def seconds_until(predicate: Callable[[], bool]) -> float | None:
    """Seconds until `predicate` holds, polled every POLL_S; None past TIMEOUT."""
    began = time.monotonic()
    while time.monotonic() - began < TIMEOUT:
        if predicate():
            return time.monotonic() - began
        time.sleep(POLL_S)
    return None


def database_back() -> list[float | None]:
    samples: list[float | None] = []
    with portal_up(host_pool="solo") as (api, postgres, _, _, tag):
        booking = api.book_now()
        for _ in range(ROUNDS):
            job_id = api.run(LINES, tag=tag, reservation=booking)
            if seconds_until(lambda: "line 01" in api.log(job_id)) is None:  # noqa: B023 - called at once
                raise RuntimeError(f"job {job_id} printed nothing within {TIMEOUT:.0f} s")
            postgres.stop("fast")
            time.sleep(OUTAGE_S)  # the job ends meanwhile
            postgres.start()
            samples.append(seconds_until(lambda: api.finished(job_id)))  # noqa: B023
            if samples[-1] is None:
                break
    return samples


def redis_back() -> list[float | None]:
    samples: list[float | None] = []
    with portal_up(host_pool="solo") as (api, _, broker, portal, tag):
        scratch = portal.scratch
        holding, waiting = api.book_now(), api.book_now()
        for n in range(ROUNDS):
            flag = scratch / f"free-the-slot-{n}"
            held = api.run(HOLD, tag=tag, reservation=holding, args=str(flag))
            if seconds_until(lambda: api.status(held) == "running") is None:  # noqa: B023
                raise RuntimeError(f"job {held} did not start within {TIMEOUT:.0f} s")
            stranded = api.run(QUICK, tag=tag, reservation=waiting)
            if seconds_until(lambda: broker.queued(f"host.{SERVER}") == 1) is None:
                raise RuntimeError(f"job {stranded}'s message never reached Redis")
            broker.kill()
            broker.start()
            flag.touch()
            samples.append(seconds_until(lambda: api.status(stranded) in {"running", *FINISHED}))  # noqa: B023
            if samples[-1] is None or seconds_until(lambda: api.finished(stranded)) is None:  # noqa: B023
                break
    return samples


def frozen_request() -> list[float | None]:
    samples: list[float | None] = []
    with portal_up(host_pool="solo", deadlines=True) as (api, postgres, _, _, _):
        for _ in range(ROUNDS):
            for _ in range(8):  # the web server's threads hold pooled connections
                api.get("/api/v1/jobs/")
            with postgres.frozen():
                began = time.monotonic()
                try:
                    answer = api.call("GET", "/api/v1/jobs/")
                except Exception:  # the client's own 15 s timeout
                    answer = None
                took = time.monotonic() - began
            samples.append(took if answer is not None and answer.status_code == 503 else None)
            if samples[-1] is None:
                break
    return samples


def frozen_ctrl_c() -> list[float | None]:
    samples: list[float | None] = []
    for _ in range(ROUNDS):
        with portal_up(host_pool="solo", deadlines=True) as (api, postgres, _, portal, tag):
            never = portal.scratch / "never"
            job_id = api.run(HOLD, tag=tag, reservation=api.book_now(), args=str(never))
            if seconds_until(lambda: "started" in api.log(job_id)) is None:  # noqa: B023
                raise RuntimeError(f"job {job_id} did not start within {TIMEOUT:.0f} s")
            with postgres.frozen():
                began = time.monotonic()
                for proc in portal.procs.values():
                    proc.terminate()
                deadline = began + TIMEOUT
                while time.monotonic() < deadline and any(p.poll() is None for p in portal.procs.values()):
                    time.sleep(POLL_S)
                stopped = all(p.poll() is not None for p in portal.procs.values())
                samples.append(time.monotonic() - began if stopped else None)
        if samples[-1] is None:
            break
    return samples


def figure(name: str, samples: list[float | None], goal: float) -> None:
    done = [s for s in samples if s is not None]
    if len(done) < len(samples):
        report(name, TIMEOUT, "s", f"≤ {goal:.0f} s", False)
        print(f"    (not within {TIMEOUT:.0f} s in round {len(samples)}; rounds before: {done})")
        return
    value = statistics.median(done)
    report(name, value, "s", f"≤ {goal:.0f} s", value <= goal)
    print(f"    (rounds: {', '.join(f'{s:.2f}' for s in done)})")


def main() -> int:
    if why := unavailable():
        print(f"  skipped: {why}")
        return 0
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per poll otherwise
    figure("database back → job end recorded", database_back(), goal=5)
    figure("Redis back → stranded job running", redis_back(), goal=60)
    figure("PostgreSQL frozen → request answered 503", frozen_request(), goal=6)
    figure("Ctrl-C with PostgreSQL frozen → everything stopped", frozen_ctrl_c(), goal=15)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Nothing lost when the database or the broker goes away: the fault suite.

Each test runs the real portal (a gunicorn web server, the portal's Celery worker and a GPU host's)
on a database and a redis-server of its own (tests/fault_servers.py), with one web worker process
where many requests at once are not what it tests (Portal.start), takes one of them away in
the middle of the work, and checks afterwards: no 500, no lost log line, no job left open without
a reason, no process left. Only those throwaway servers are ever stopped; the shared PostgreSQL
and Redis of the rest of the suite are never touched.

The PostgreSQL cluster is the test session's (one per xdist worker, started by the first test that
needs it, as a copy of one kept across runs): each test's database is a copy of its migrated
template, and after each test the cluster runs, thawed, again, whatever the test did to it
(tests/fault_cluster.py). The redis-server is the test's own (it starts in milliseconds). Each
test's logs are its own folder under OUTPUT.

Where this machine cannot run them (no PostgreSQL server binaries, no redis-server, root without a
`postgres` account) they skip, saying why; on CI (CI=true) they fail instead.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psutil
import pytest
from django.db import DEFAULT_DB_ALIAS, connections

from gpus.booking import Held, blockers
from gpus.models import Allocation, Reservation
from jobs.models import Job
from portal.env import parse_database_url
from tests.fault_cluster import TemplateCluster
from tests.fault_servers import (
    FINISHED,
    HOLD,
    QUICK,
    SERVER,
    TAG_VAR,
    Api,
    Portal,
    ThrowawayPostgres,
    ThrowawayRedis,
    leftovers,
    lines_script,
    small_disk,
    small_disk_unavailable,
    unavailable,
)
from tests.isolation import OUTPUT
from tests.waiting import wait_for

pytestmark = [pytest.mark.faults, pytest.mark.worker]

ALIAS = "faults"  # the test process's own connection to the throwaway database, for the checks

LINES = lines_script(20, every=0.2)  # ~4 s


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def tag() -> str:
    """Marks this test's processes (FAULTS_RUN) and its jobs, for the no-process-left check, and
    names its database and its logs: unique to the test (a rerun included), so that no check
    ever sees another test's or another xdist worker's."""
    return uuid.uuid4().hex


@pytest.fixture
def logs(request, tag) -> Path:
    """This test's own log folder (its servers', web server's and workers'), under OUTPUT."""
    name = re.sub(r"[^\w.-]", "-", request.node.name)
    return OUTPUT / f"faults-{name}-{tag[:8]}"


@pytest.fixture(scope="session")
def _servers_available() -> None:
    if why := unavailable():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the fault suite, but {why}")
        pytest.skip(why)


@pytest.fixture(scope="session")
def cluster(_servers_available) -> Iterator[TemplateCluster]:
    """The session's PostgreSQL cluster with its template database; stopped, reaped and deleted at
    the session's end."""
    session = uuid.uuid4().hex
    shared = TemplateCluster(tag=session, logs=OUTPUT / f"faults-cluster-{session[:8]}")
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture
def postgres(cluster) -> Iterator[ThrowawayPostgres]:
    """The session's cluster, answering; running and thawed again after the test, whatever the
    test did to it (replaced when it cannot be)."""
    cluster.recover()
    yield cluster.server
    cluster.recover()


@pytest.fixture
def database(cluster, postgres, tag) -> Iterator[str]:
    """The URL of this test's own database on the cluster, a copy of the migrated template with the
    demo users; dropped after the test, once its portal is stopped."""
    name = f"portal_{tag}"
    url = cluster.database(name)
    yield url
    cluster.drop(name)


@pytest.fixture
def broker(_servers_available, tag, logs) -> Iterator[ThrowawayRedis]:
    """The test's own redis-server, started; closed (stopped, its folder deleted) after it."""
    server = ThrowawayRedis(tag=tag, logs=logs)
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def portal(database, broker, tmp_path, tag, logs) -> Iterator[Portal]:
    """The portal's processes on the test's database; the test starts the ones it needs. All are
    stopped and reaped after it, whatever happened (before its database is dropped)."""
    processes = Portal(database_url=database, redis_url=broker.url, scratch=tmp_path, tag=tag, logs=logs)
    try:
        yield processes
    finally:
        processes.stop()


@pytest.fixture
def rows(database, django_db_blocker) -> Iterator[str]:
    """The alias of a connection of this process to the test's database, for the checks after
    the faults (the ORM with `.using(rows)`); closed before each use, as the server may have
    restarted since."""
    settings = parse_database_url(database)
    connections.settings[ALIAS] = connections.configure_settings(
        {DEFAULT_DB_ALIAS: dict(settings), ALIAS: settings}
    )[ALIAS]
    try:
        with django_db_blocker.unblock():
            yield ALIAS
    finally:
        connections[ALIAS].close()
        del connections[ALIAS]
        del connections.settings[ALIAS]


def _printed(log: str) -> list[str]:
    """The job's own lines, without their timestamps and without the portal's."""
    lines = (line.split(" ", 1)[1] if " " in line else "" for line in log.splitlines())
    return [line for line in lines if line and not line.startswith("[portal]")]


def _assert_no_500(answers: list[tuple[str, str, int, str | None]]) -> None:
    """Every answer is below 500, or a 503 with Retry-After; none is a 401 (a token that could not
    be checked is an outage, not a wrong token)."""
    bad = [a for a in answers if (a[2] >= 500 and a[2] != 503) or a[2] == 401]
    assert not bad, f"{len(bad)} bad answers, e.g. {bad[:5]}"
    no_retry = [a for a in answers if a[2] == 503 and not a[3]]
    assert not no_retry, f"503 without Retry-After, e.g. {no_retry[:5]}"


def _job_running(tag: str, job_id: int) -> bool:
    for proc in leftovers(tag):
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("PORTAL_JOB_ID") == str(job_id):
                return True
    return False


def _finishes_once(portal: Portal, job_id: int) -> None:
    """Its end was recorded once, by its supervisor or by the spool's replay: each logs "Job N
    finished:" only when its conditional UPDATE recorded the end (jobs.host.runner, jobs.host.replay)."""
    ends = re.findall(rf"Job {job_id} finished: ", portal.output("worker-host"))
    assert len(ends) == 1, f"job {job_id}'s end was recorded {len(ends)} times"


def _assert_nothing_left(portal: Portal, tag: str, *servers: ThrowawayPostgres | ThrowawayRedis) -> None:
    """Stop everything this test started, after its faults, by SIGTERM as systemd or Ctrl-C
    would: all of it within 30 s, and then no process of it may be left, jobs included. The
    session's cluster is stopped too, so that none of its backends is left either (the `postgres`
    fixture starts it again for the next test)."""
    assert portal.stop() == [], "still running 30 s after SIGTERM"
    for server in servers:
        server.stop()
    left = leftovers(tag, portal.scratch, *(server.folder for server in servers))
    assert not left, f"left running: {[(p.pid, p.name()) for p in left]}"


# --- the database stopped while a job ends ------------------------------------------------------


def test_database_stopped_while_a_job_ends(portal, postgres, broker, tag):
    api = portal.start(host_pool="solo", web_workers=1)
    job_id = api.run(LINES, tag=tag, reservation=api.book_now())
    wait_for(lambda: "line 05" in api.log(job_id), timeout=60, what="the job's fifth line")

    postgres.stop("fast")
    down_at = time.monotonic()
    during = api.call("GET", f"/api/v1/jobs/{job_id}/")
    assert during.status_code == 503, during.text
    # The job (it prints for ~4 s) ends while the database is away.
    wait_for(lambda: not _job_running(tag, job_id), timeout=10, what="the job to end during the outage")
    time.sleep(max(0.0, 10 - (time.monotonic() - down_at)))
    postgres.start()

    wait_for(lambda: api.finished(job_id), timeout=60, what="the job's end to be recorded")
    job = api.job(job_id)
    assert (job["status"], job["exit_code"], job["message"]) == ("succeeded", 0, "")
    log = api.log(job_id)
    assert _printed(log) == [f"line {n:02d}" for n in range(1, 21)], log
    assert "[portal] Lost" not in log, log
    _finishes_once(portal, job_id)
    _assert_no_500(api.answers)
    api.close()
    _assert_nothing_left(portal, tag, postgres, broker)


# --- the worker stopped while the database is away ----------------------------------------------


def test_sigterm_during_a_database_outage_ends_everything_in_time(portal, postgres, broker, tag):
    """systemctl stop in the middle of an outage: the worker stops its job by the flag alone, waits
    for no database, and its end waits in the host's spool."""
    api = portal.start(host_pool="solo", web_workers=1)
    never = portal.scratch / "never"  # its flag never comes: it runs until stopped
    job_id = api.run(HOLD, tag=tag, reservation=api.book_now(), args=str(never))
    wait_for(lambda: "started" in api.log(job_id), timeout=60, what="the job to run")
    postgres.stop("fast")
    api.close()
    _assert_nothing_left(portal, tag, postgres, broker)
    ends = list((portal.scratch / "spool").glob(f"job-{job_id}-*.end"))
    assert len(ends) == 1 and '"status": "cancelled"' in ends[0].read_text(), portal.output("worker-host")
    _no_stop_flag_left(portal)


def _no_stop_flag_left(portal: Portal) -> None:
    """Each host worker's shutdown raises its stop flag (jobs.host.spool.stop_flag) and removes
    it at its end."""
    flags = list((portal.scratch / "spool").glob("worker-*.stopping"))
    assert not flags, f"stop flags left: {flags}"


# --- the database away for a minute under a job that prints steadily ------------------------------

LONG_OUTAGE_SECONDS = 60


def test_database_away_for_a_minute_under_a_job_that_prints_steadily(portal, postgres, broker, tag):
    """Every line kept once and in order, through a minute without the database; the end once."""
    # Out of touch for the whole minute, and not lost for it: the settings, not a sleep, say so.
    portal.env["JOB_LOST_AFTER_SECONDS"] = str(LONG_OUTAGE_SECONDS + 30)
    count = 450  # ~90 s at 0.2 s a line: it prints before, during and after the outage
    api = portal.start(host_pool="solo", web_workers=1)
    job_id = api.run(lines_script(count, every=0.2), tag=tag, reservation=api.book_now())
    wait_for(lambda: "line 10\n" in api.log(job_id), timeout=60, what="the job's tenth line")

    postgres.stop("fast")
    time.sleep(LONG_OUTAGE_SECONDS)  # the outage itself
    assert _job_running(tag, job_id), "the job must run on through the outage"
    postgres.start()

    wait_for(lambda: api.finished(job_id), timeout=90, what="the job's end to be recorded")
    job = api.job(job_id)
    assert (job["status"], job["exit_code"], job["message"]) == ("succeeded", 0, "")
    log = api.log(job_id)
    assert _printed(log) == [f"line {n:02d}" for n in range(1, count + 1)], log[-2000:]
    assert "[portal] Lost" not in log and "dropped" not in log
    _finishes_once(portal, job_id)
    _assert_no_500(api.answers)
    api.close()
    _assert_nothing_left(portal, tag, postgres, broker)
    _no_stop_flag_left(portal)


# --- the spool's disk full while the database is away ---------------------------------------------

WIDE_LINES = 600
# ~170 kB in ~7 s: more than the spool's 64 kB disk holds.
WIDE = (
    f"import time\nfor n in range(1, {WIDE_LINES + 1}):\n"
    "    print(f'line {n:03d} ' + 'x' * 250, flush=True)\n    time.sleep(0.01)\n"
).encode()


def test_spool_disk_full_while_the_database_is_away(portal, postgres, broker, tag):
    """The disk refuses the spool's writes (ENOSPC): the output is dropped and said, the job runs
    to its own end, and that end is recorded once, not "Lost"."""
    if why := small_disk_unavailable():
        pytest.skip(why)
    with small_disk(portal.scratch / "spool", size="64k"):
        api = portal.start(host_pool="solo", web_workers=1)
        job_id = api.run(WIDE, tag=tag, reservation=api.book_now())
        wait_for(lambda: "line 010" in api.log(job_id), timeout=60, what="the job's tenth line")
        postgres.stop("fast")
        wait_for(lambda: not _job_running(tag, job_id), timeout=60, what="the job to end during the outage")
        postgres.start()

        wait_for(lambda: api.finished(job_id), timeout=60, what="the job's end to be recorded")
        job = api.job(job_id)
        assert (job["status"], job["exit_code"]) == ("succeeded", 0), job
        assert "bytes of its output were dropped while the database was away" in job["message"], job
        assert "No space left on device" in job["message"], job
        log = api.log(job_id)
        printed = [line[:8] for line in _printed(log)]
        kept = len(printed)
        assert 10 <= kept < WIDE_LINES and printed == [f"line {n:03d}" for n in range(1, kept + 1)]
        marker = log.index("bytes of output were dropped here")
        assert "No space left on device" in log[marker:] and "[portal] Lost" not in log
        _finishes_once(portal, job_id)
        api.close()
        _assert_nothing_left(portal, tag, postgres, broker)
        _no_stop_flag_left(portal)


# --- Redis SIGKILLed with messages waiting ------------------------------------------------------


def test_redis_killed_with_messages_waiting(portal, postgres, broker, tag, tmp_path):
    api = portal.start(host_pool="solo", web_workers=1)  # one job at a time: the other two wait in Redis
    flag = tmp_path / "free-the-slot"
    running = api.run(HOLD, tag=tag, reservation=api.book_now(), args=str(flag))
    wait_for(lambda: "started" in api.log(running), timeout=60, what="the first job to run")
    waiting = [api.run(QUICK, tag=tag, reservation=api.book_now()) for _ in range(2)]
    wait_for(lambda: broker.queued(f"host.{SERVER}") == 2, timeout=10, what="two messages in Redis")
    assert [api.job(j)["status"] for j in waiting] == ["queued", "queued"]

    broker.kill()  # as the OOM killer would
    broker.start()  # empty: the two messages are gone
    assert broker.queued(f"host.{SERVER}") == 0
    flag.touch()
    freed_at = time.monotonic()

    for job_id in [running, *waiting]:
        left = 60 - (time.monotonic() - freed_at)
        wait_for(lambda j=job_id: api.finished(j), timeout=max(left, 1), what=f"job {job_id} to run and end")
    for job_id in [running, *waiting]:
        job = api.job(job_id)
        assert (job["status"], job["exit_code"]) == ("succeeded", 0), job
        assert _printed(api.log(job_id)).count("done") == 1  # it ran once
        _finishes_once(portal, job_id)
    _assert_no_500(api.answers)
    api.close()
    _assert_nothing_left(portal, tag, postgres, broker)


# --- the database restarted under concurrent bookings and submits --------------------------------

CLIENTS = 20
USERS = ("alice", "bob", "leader")
SUBMITS_PER_CLIENT = 2


def _unexplained(jobs: Iterable[Job]) -> list[Job]:
    """Those of `jobs` that have not ended, other than those pending for a reason the queue gives."""
    return [
        job
        for job in jobs
        if job.status in Job.ACTIVE and not (job.status == Job.Status.PENDING and job.pending_reason)
    ]


def _said_of(portal: Portal, jobs: list[tuple]) -> str:
    """What the workers' logs say of these jobs (the storm's one known failure, a queued job never
    claimed nor sent again, left no trace a CI run keeps): their lines, and the outage's."""
    # "Job 7", "job 7", and the pickup's "Job(s) 3, 7 of fault1 ... sent again"; the outage's lines,
    # and a receiver that raised (Celery only logs it).
    ids = "|".join(str(job[0]) for job in jobs) or "0"
    named = re.compile(rf"\b[Jj]ob(?:\(s\))? (?:\d+, )*(?:{ids})\b")
    words = ["database", "Traceback", "sent again", "Signal handler"]
    lines = [
        f"{role}: {line}"
        for role in ("worker-host", "worker-portal")
        for line in portal.output(role).splitlines()
        if named.search(line) or any(word in line for word in words)
    ]
    return "\n".join(lines[-80:])


def _activity(rows: str) -> str:
    """The server's sessions other than idle ones, and who waits on whose lock: a queued job
    neither claimed nor sent again may be a worker's query waiting on a transaction left open."""
    connections[rows].close()
    with connections[rows].cursor() as cursor:
        cursor.execute(
            "SELECT pid, state, wait_event_type, wait_event, pg_blocking_pids(pid),"
            " now() - xact_start, left(query, 160) FROM pg_stat_activity"
            " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() AND state <> 'idle'"
        )
        found = cursor.fetchall()
    connections[rows].close()
    return "\n".join(f"backend: {row}" for row in found) or "backend: none but idle ones"


class Storm:
    """CLIENTS threads, each with its own token, booking cards in the future, submitting jobs to
    the queue and reading lists, until `stop` is set; every answer and transport error is kept."""

    def __init__(self, base: str, tag: str) -> None:
        self.apis = [Api(base, USERS[n % len(USERS)]) for n in range(CLIENTS)]
        self.tag = tag
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.bookings: list[int] = []
        self.jobs: list[int] = []
        self.hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        self.threads = [
            threading.Thread(target=self._client, args=(api, n)) for n, api in enumerate(self.apis)
        ]

    def __enter__(self) -> Storm:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)
        for api in self.apis:
            api.close()

    def wait_for_more(self, *, bookings: int, jobs: int) -> None:
        """Until this many more bookings and jobs were answered 201."""
        more_bookings, more_jobs = len(self.bookings) + bookings, len(self.jobs) + jobs
        wait_for(
            lambda: len(self.bookings) >= more_bookings and len(self.jobs) >= more_jobs,
            timeout=30,
            what=f"{bookings} more bookings and {jobs} more jobs",
        )

    @property
    def answers(self) -> list[tuple[str, str, int, str | None]]:
        return [answer for api in self.apis for answer in api.answers]

    def _client(self, api: Api, n: int) -> None:
        chance = random.Random(n)
        submits = 0
        while not self.stop.is_set():
            try:
                roll = chance.random()
                if roll < 0.05 and submits < SUBMITS_PER_CLIENT:
                    submits += 1
                    response = api.submit(QUICK, env={TAG_VAR: self.tag}, gpu_count=1, time_limit_minutes=5)
                    if response.status_code == 201:
                        self.jobs.append(response.json()["id"])
                elif roll < 0.5:
                    # Hour-long bookings from two hours on, clear of the queued jobs' "now".
                    start = self.hour + timedelta(hours=chance.randrange(2, 50))
                    end = start + timedelta(hours=1)
                    response = api.book(count=1, server=SERVER, start=start.isoformat(), end=end.isoformat())
                    if response.status_code == 201:
                        self.bookings.append(response.json()["id"])
                else:
                    api.call("GET", chance.choice(("/api/v1/jobs/?mine=1", "/api/v1/reservations/?mine=1")))
            except Exception as exc:  # a timeout, a reset connection, an answer that is no JSON
                # Which request, and when: the one reset seen under load (below) is not found yet.
                asked = getattr(exc, "_request", None)  # httpx's, where the error has one
                what = f"{asked.method} {asked.url.path}" if asked is not None else "?"
                self.errors.append(f"client {n} at {datetime.now(UTC):%H:%M:%S.%f}: {what}: {exc!r}")
            self.stop.wait(chance.uniform(0.05, 0.2))


# Known flaky (2 of 4 CI runs on 2026-11-28: one connection reset during the restart, once a queued
# job not taken 60 s after it). The queued job was a claim that failed in the restart, its message
# already acked (fixed 2026-11-29: job_claim is patient, tests/test_job_claim.py); the reset is
# not found yet: run once more before failing.
@pytest.mark.flaky(reruns=1)
def test_database_restarted_under_concurrent_bookings_and_submits(portal, postgres, broker, tag, rows):
    api = portal.start(host_pool="prefork", web_workers=2)  # 20 clients at once: runportal's two
    with Storm(portal.base, tag) as storm:
        storm.wait_for_more(bookings=10, jobs=3)
        postgres.restart("fast")
        storm.wait_for_more(bookings=10, jobs=1)  # the portal is back
        postgres.stop("immediate")  # as in a crash: recovery on the next start
        time.sleep(5)
        postgres.start()
        storm.wait_for_more(bookings=10, jobs=0)
    assert not storm.errors, storm.errors[:5]
    _assert_no_500(storm.answers)
    statuses = Counter(answer[2] for answer in storm.answers)
    assert statuses[503], f"no request met the outage: {statuses}"
    assert storm.bookings and storm.jobs, statuses

    # Every job answered 201 runs to its end; none is left open. The checks below read the one look
    # that found none open: a job pending for a reason may be sent to its host (queued) a moment
    # later, and a second look took it for one open without a reason.
    jobs: dict[int, Job] = {}

    def none_open() -> bool:
        portal.check_alive()
        connections[rows].close()
        jobs.clear()
        jobs.update({job.pk: job for job in Job.objects.using(rows).all()})
        return not _unexplained(jobs.values())

    with contextlib.suppress(AssertionError):
        wait_for(none_open, timeout=60, what="every job to end")
    still = [
        (j.pk, j.status, j.pending_reason, j.dispatched_at, j.worker, j.message)
        for j in _unexplained(jobs.values())
    ]
    assert not still, (
        f"open without a reason, 60 s after the outage: {still}\n{_activity(rows)}\n{_said_of(portal, still)}"
        f"\n{portal.stacks('worker-host')}"
    )
    connections[rows].close()
    assert set(storm.jobs) <= set(jobs), f"lost jobs: {set(storm.jobs) - set(jobs)}"
    for job in jobs.values():
        if job.status in FINISHED:
            assert job.status == Job.Status.SUCCEEDED or job.message, f"job {job.pk} {job.status}, no reason"
        else:
            assert job.status == Job.Status.PENDING and job.pending_reason, f"job {job.pk} open, no reason"
    print("jobs:", Counter((job.status, job.pending_reason) for job in jobs.values()), "answers:", statuses)
    admin = Api(portal.base, "admin")  # sees everyone's jobs
    for job_id in storm.jobs:
        if jobs[job_id].status == Job.Status.SUCCEEDED:
            assert _printed(admin.log(job_id)).count("done") == 1, f"job {job_id}'s log"

    # Every booking answered 201 is there, holding its card; no card is booked twice.
    booked = Reservation.objects.using(rows).filter(pk__in=storm.bookings)
    assert len(set(storm.bookings)) == len(storm.bookings), "one booking id answered twice"
    assert set(booked.values_list("pk", flat=True)) == set(storm.bookings)
    assert not booked.filter(allocations=None).exists()
    live: dict[str, list[Allocation]] = defaultdict(list)
    for allocation in Allocation.objects.using(rows).filter(live=True).select_related("gpu"):
        live[allocation.gpu_id].append(allocation)
    for allocations in live.values():
        for one in allocations:
            others = [Held(o.start, o.end, o.memory_mb) for o in allocations if o.pk != one.pk]
            double = blockers(one.gpu, others, one.start, one.end, one.memory_mb)
            assert not double, f"{one} overlaps {double}"

    _assert_no_500(api.answers + admin.answers)
    api.close()
    admin.close()
    connections[rows].close()
    _assert_nothing_left(portal, tag, postgres, broker)


# --- a frozen server: every process stopped, its kernel still acknowledging ----------------------

# Deadlines short enough for a test (portal/postgresql/base.py, settings' REDIS_SOCKET_TIMEOUT_SECONDS).
DEADLINES = {"DATABASE_STATEMENT_TIMEOUT_SECONDS": "2", "REDIS_SOCKET_TIMEOUT_SECONDS": "1"}


def _with_deadlines(portal: Portal) -> None:
    portal.env.update(DEADLINES)
    portal.env["DATABASE_URL"] += "?connect_timeout=2"


def test_a_request_while_the_database_is_frozen_answers_503_in_seconds(portal, postgres, broker, tag):
    _with_deadlines(portal)
    api = portal.start(host_pool="solo", web_workers=1)
    for _ in range(8):  # the portal answers; under ASGI each request connects (CONN_MAX_AGE=0)
        api.get("/api/v1/jobs/")
    with postgres.frozen():
        began = time.monotonic()
        answer = api.call("GET", "/api/v1/jobs/")
        took = time.monotonic() - began
    assert answer.status_code == 503 and answer.headers.get("Retry-After"), answer.text
    assert took < 10, f"answered after {took:.1f} s"
    _assert_no_500(api.answers)
    api.close()
    _assert_nothing_left(portal, tag, postgres, broker)


def test_sigterm_with_the_database_frozen_ends_the_host_worker_in_time(portal, postgres, broker, tag):
    """Ctrl-C of a host worker waits for no frozen database: its job is stopped by the flag, its
    end goes to the spool after the query deadline, and the worker is gone within a bound."""
    _with_deadlines(portal)
    api = portal.start(host_pool="solo", web_workers=1)
    never = portal.scratch / "never"
    job_id = api.run(HOLD, tag=tag, reservation=api.book_now(), args=str(never))
    wait_for(lambda: "started" in api.log(job_id), timeout=60, what="the job to run")
    api.close()
    host = portal.procs["worker-host"]
    with postgres.frozen():
        began = time.monotonic()
        host.terminate()
        try:
            host.wait(timeout=30)
        finally:
            took = time.monotonic() - began
    assert took < 15, f"the host worker took {took:.1f} s to stop; see {portal.log_path('worker-host')}"
    assert not _job_running(tag, job_id)
    ends = list((portal.scratch / "spool").glob(f"job-{job_id}-*.end"))
    assert len(ends) == 1 and '"status": "cancelled"' in ends[0].read_text(), portal.output("worker-host")
    _assert_nothing_left(portal, tag, postgres, broker)


def test_a_submit_and_a_booking_while_redis_is_frozen_answer_at_once(portal, postgres, broker, tag):
    """The row is the record: a job whose message cannot be sent is answered 201 at once, and
    runs once Redis is back (pickup sends it again)."""
    _with_deadlines(portal)
    api = portal.start(host_pool="solo", web_workers=1)
    booking = api.book_now()
    later = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) + timedelta(hours=3)
    with broker.frozen():
        began = time.monotonic()
        submitted = api.submit(QUICK, env={TAG_VAR: tag}, reservation=booking)
        submit_took = time.monotonic() - began
        began = time.monotonic()
        booked = api.book(
            count=1, server=SERVER, start=later.isoformat(), end=(later + timedelta(hours=1)).isoformat()
        )
        book_took = time.monotonic() - began
    assert submitted.status_code == 201, submitted.text
    assert submit_took < 8, f"the submit took {submit_took:.1f} s"
    assert booked.status_code == 201, booked.text
    assert book_took < 8, f"the booking took {book_took:.1f} s"
    job_id = submitted.json()["id"]
    wait_for(lambda: api.finished(job_id), timeout=60, what="the job to run once Redis answers")
    assert api.job(job_id)["status"] == "succeeded"
    _assert_no_500(api.answers)
    api.close()
    _assert_nothing_left(portal, tag, postgres, broker)

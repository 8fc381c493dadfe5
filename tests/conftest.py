from __future__ import annotations

import itertools
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from portal.env import database_url
from portal.models import Membership
from tests import durations, kept_database
from tests.browser import chromium_missing_header, left_out_without_chromium
from tests.celery_workers import StartWorker, fork_server_close
from tests.factories import MembershipFactory, TeamFactory, UserFactory, make_snapshot
from tests.flushing import registry_restored_after_flush
from tests.isolation import OUTPUT, ROOT, RUN, VAR_BASE  # noqa: F401 - this process's own, for the tests


@pytest.fixture(scope="session", autouse=True)
def _fork_server_ended() -> Iterator[None]:
    """The fork server of the session's Celery workers (tests/forkserver.py), if one started,
    ended through its handle."""
    yield
    fork_server_close()


@pytest.fixture(scope="session", autouse=True)
def _job_folders() -> Iterator[Path]:
    """This test session's own JOB_FOLDERS and JOB_SPOOL_DIR, for the tests and the workers they
    start: job ids start again with each test database, and no run should find another's."""
    from django.conf import settings

    path = Path(settings.VAR_DIR) / f"test-job-folders-{os.getpid()}"
    spool = Path(settings.VAR_DIR) / f"test-spool-{os.getpid()}"
    os.environ["JOB_FOLDERS"], os.environ["JOB_SPOOL_DIR"] = str(path), str(spool)
    settings.JOB_FOLDERS, settings.JOB_SPOOL_DIR = path, spool
    yield path
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(spool, ignore_errors=True)


@pytest.fixture(scope="session")
def django_db_keepdb(request, django_db_modify_db_settings) -> bool:
    """Each test process's database starts as a copy of the migrated one, made by the first
    process to need it and kept across runs (tests/kept_database.py): a full migrate is 6 s of
    CPU a process. After django_db_modify_db_settings: the name is xdist's worker's own by then."""
    if request.config.getvalue("reuse_db"):
        return True
    from django.conf import settings

    return kept_database.copy_or_make(settings.DATABASES["default"])


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker, django_db_keepdb) -> Iterator[None]:
    """The migrated test database kept for the others (tests/kept_database.py), when this
    process had to make it.

    At the end, PostgreSQL's sessions on this run's test database closed, so pytest-django
    can drop it: the live servers' and uvicorn's threads keep theirs open (Django's persistent
    connections, one per thread), and a database with sessions cannot be dropped. The name is
    this run's own (django_db_modify_db_settings below): every session on it is the run's.

    Meanwhile a transactional test's flush puts the content types and permissions back from a
    copy instead of making them again (tests/flushing.py)."""
    from django.conf import settings

    with django_db_blocker.unblock():
        kept_database.keep(settings.DATABASES["default"])
    with registry_restored_after_flush(django_db_blocker):
        yield
    from django.db import connection

    if connection.vendor != "postgresql":
        return
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


_spools = itertools.count(1)


@pytest.fixture(autouse=True)
def _own_spool(_job_folders, settings, monkeypatch) -> None:
    """Each test its own JOB_SPOOL_DIR, and the workers it starts too: a spool an earlier test
    left behind (a job whose worker was stopped mid-write) is never this test's to find."""
    spool = Path(settings.VAR_DIR) / f"test-spool-{os.getpid()}" / str(next(_spools))
    monkeypatch.setenv("JOB_SPOOL_DIR", str(spool))
    settings.JOB_SPOOL_DIR = spool


def _one_default_tls_context() -> None:
    """httpx makes a new SSL context, loading certifi's CA bundle (45 ms of CPU), for each
    httpx.get/post and each Client; the tests' polls of their web servers made thousands. The
    default one (verify=True, no client certificate) is made once here; any other (a test's own
    CA) as httpx always does. Only this test process's: the portals it starts are untouched."""
    import functools

    import httpx._transports.default as transport

    made = transport.create_ssl_context
    default = functools.cache(made)

    def create_ssl_context(verify=True, cert=None, trust_env=True):  # type: ignore[no-untyped-def]
        if verify is True and cert is None:
            return default(verify, cert, trust_env)
        return made(verify=verify, cert=cert, trust_env=trust_env)

    transport.create_ssl_context = create_ssl_context


_one_default_tls_context()


@pytest.fixture(scope="session", autouse=True)
def _static_files_looked_up_per_request() -> None:
    """WhiteNoise finds static files as they are asked for (its `autorefresh`, as under DEBUG),
    instead of scanning every one when its middleware is made: Django's test client makes the
    middleware anew for each client, and the scan (about 220 files through the finders) was
    50 ms of each, some 150 s of CPU over the suite. A test of static serving sets it back."""
    from django.conf import settings

    settings.WHITENOISE_AUTOREFRESH = True


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix) -> None:
    """A PostgreSQL test database of this run's own (`test_<name>_gw0_r<run>`): two runs on one
    server never drop each other's. SQLite's lives in the run's own folder (tests/isolation.py)."""
    from django.conf import settings

    for database in settings.DATABASES.values():
        if not database["ENGINE"].endswith("sqlite3"):
            kept_database.remember(database)
            test = database.setdefault("TEST", {})
            test["NAME"] = f"{test.get('NAME') or 'test_' + database['NAME']}_r{RUN}"


@pytest.fixture(autouse=True)
def _fast_password_hasher(settings) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def _empty_cache() -> None:
    """Django's cache is per process (the pages' fair-share usage, jobs.queue.scheduler): each test
    starts with it empty, so no test sees another's usage under a reused team id."""
    from django.core.cache import cache

    cache.clear()


@pytest.fixture
def team(db):
    return TeamFactory(name="Vision Lab", slug="vision-lab")


@pytest.fixture
def alice(team):
    """Owner in most tests: a member of `team`."""
    return MembershipFactory(team=team, user=UserFactory(username="alice")).user


@pytest.fixture
def bob(team):
    """alice's teammate."""
    return MembershipFactory(team=team, user=UserFactory(username="bob")).user


@pytest.fixture
def leader(team):
    return MembershipFactory(team=team, user=UserFactory(username="leader"), role=Membership.Role.LEADER).user


@pytest.fixture
def charlie(db):
    """An outsider: in no team of alice's."""
    return MembershipFactory(user=UserFactory(username="charlie")).user


@pytest.fixture
def box(db, settings) -> list:
    """A reporting server `box1` with four 24 GB cards, by index; this process is its host (a job
    run here in-process is claimed as box1's worker claims it, jobs.host.launch.job_claim)."""
    from gpus.models import GPU
    from gpus.services import server_report_ingest
    from jobs.host.pickup import slots_report

    server_report_ingest(snapshot=make_snapshot("box1", gpus=4))
    # Its worker said how many jobs it runs at once, as a running host worker does each round:
    # the queue plans nothing on a host that never did.
    slots_report("box1", slots=64, now=timezone.now())
    settings.WORKER_SERVER = "box1"
    return list(GPU.objects.filter(server__name="box1").order_by("index"))


@pytest.fixture
def booking(alice, box):
    """alice's active 8 GiB booking of box1 GPU 0 (a module may define its own instead)."""
    from gpus.booking import reservation_create

    return reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)


@pytest.fixture
def t0():
    """The start of the next hour-long slot: a minute-aligned time an hour from now."""
    return timezone.now().replace(second=0, microsecond=0) + timedelta(hours=1)


@pytest.fixture
def admin_user(db):
    return UserFactory(username="admin", is_staff=True, is_superuser=True)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    """Processes a test starts: every one is killed and reaped after it."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


class Clock:
    """A stand-in for time.monotonic that moves only when a test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def database_url_for_subprocess() -> str:
    """The URL of the database this test runs on (the test database, not the configured one)."""
    return database_url(connection.settings_dict)


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on (for a server to start on, or to find closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def sent(monkeypatch) -> list[tuple[int, str]]:
    """(job id, queue) of each job dispatched to a GPU host: none reach a broker, no worker runs them.
    For tests of the services that decide what is dispatched; tests/test_jobs_worker.py runs them."""
    calls: list[tuple[int, str]] = []
    monkeypatch.setattr("jobs.tasks.run_job.apply_async", lambda args, queue: calls.append((args[0], queue)))
    return calls


@pytest.fixture
def start_worker(transactional_db) -> Iterator[StartWorker]:
    """Real `celery -A portal worker` processes on the test database, the test's own
    (tests/celery_workers.py): `start_worker("name")`, `start_worker(None)`."""
    start = StartWorker()
    yield start
    start.stop()


def pytest_report_header(config: pytest.Config) -> str | None:
    """A missing Chromium said once, at the top (under xdist, by the controller)."""
    return chromium_missing_header()


@pytest.hookimpl(trylast=True)  # after -k, -m and --deselect: the slices are of what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if left_out := left_out_without_chromium(items):  # the header said why, once
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers and workers > 1:
        items[:] = _slow_ones_spread(items, _walls(items), workers)


def _walls(items: list[pytest.Item]) -> dict[str, float]:
    """The slow tests' wall times: measured (tests/durations.py), else guessed from the markers."""
    measured = durations.load()
    walls: dict[str, float] = {}
    for item in items:
        if item.nodeid in measured:
            walls[item.nodeid] = measured[item.nodeid]
        elif durations.SLOW_MARKS & {mark.name for mark in item.iter_markers()}:
            walls[item.nodeid] = durations.GUESSED_SECONDS
    return walls


def _slow_ones_spread(items: list[pytest.Item], walls: dict[str, float], workers: int) -> list[pytest.Item]:
    """The order that gives each xdist worker an equal share of the slow tests, longest first and
    spread through the front of its slice, and leaves the short ones for the end.

    worksteal hands each worker one contiguous slice of the collection at the start (its sizes
    below, as xdist's `check_schedule` works them out) and later moves tests from the end of a
    busy worker's slice to an idle one; it cannot split a test. So a slow test must never be near
    the end of a slice: one started last ran alone while the others had nothing left (with every
    slow test at the front of the collection, all fell in the first worker's slice). The slow
    tests are 240 of 3,950 but most of the run's wall time, mostly waiting on real processes;
    the short ones are the CPU's work. Dealt longest first to the worker with the least so far
    (LPT), each worker's shares interleaved with its short tests over the first three quarters
    of its slice, the CPU has short tests to run while slow ones wait, and the run ends on short
    tests that any idle worker can take. Every worker computes the same order (xdist checks it)."""
    slow = sorted((item for item in items if item.nodeid in walls), key=lambda item: -walls[item.nodeid])
    rest = [item for item in items if item.nodeid not in walls]
    loads, shares = [0.0] * workers, [[] for _ in range(workers)]
    for item in slow:
        least = loads.index(min(loads))
        shares[least].append(item)
        loads[least] += walls[item.nodeid]
    ordered: list[pytest.Item] = []
    remaining = len(items)
    for w in range(workers):
        size = remaining // (workers - w)
        remaining -= size
        fill = max(size - len(shares[w]), 0)
        ordered += _interleaved(shares[w], rest[:fill])
        del rest[:fill]
    return ordered + rest


def _interleaved(slow: list[pytest.Item], short: list[pytest.Item]) -> list[pytest.Item]:
    """`slow` in its order, spread evenly over the first three quarters of `short`."""
    gap = 0.75 * len(short) / max(len(slow), 1)
    out: list[pytest.Item] = []
    taken = 0
    for n, item in enumerate(slow):
        upto = int(n * gap)
        out += short[taken:upto]
        taken = max(taken, upto)
        out.append(item)
    return out + short[taken:]

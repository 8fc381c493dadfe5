from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from portal.env import database_url
from portal.models import Membership
from portal.workers import worker_argv
from tests.factories import MembershipFactory, TeamFactory, UserFactory, make_snapshot
from tests.isolation import OUTPUT, ROOT


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
def box(db) -> list:
    """A reporting server `box1` with four 24 GB cards, by index."""
    from gpus.models import GPU
    from gpus.services import server_report_ingest
    from jobs.host.pickup import slots_report

    server_report_ingest(snapshot=make_snapshot("box1", gpus=4))
    # Its worker said how many jobs it runs at once, as a running host worker does each round:
    # the queue plans nothing on a host that never did.
    slots_report("box1", slots=64, now=timezone.now())
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
def start_worker(transactional_db, tmp_path) -> Iterator[Callable[..., subprocess.Popen]]:
    """Start real `celery -A portal worker` processes on the test database.

    `start("name")` is a GPU host's worker for a simulated server (queue host.name);
    `start(None)` is the portal's own worker (queue `portal`), which runs the collector.
    """
    procs: list[subprocess.Popen] = []

    def start(server: str | None, *, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        queue, node = (f"host.{server}", server) if server else ("portal", "portal")
        env = {
            **os.environ,
            "DATABASE_URL": database_url_for_subprocess(),
            "GPU_BACKEND": "simulated",
            "WORKER_SERVER": server or "portal-host",
            "TELEMETRY_INTERVAL_SECONDS": "1",
            # The test's own: a developer's live declarations (var/) never reach a test's workers.
            "SIMULATED_PROCESSES_FILE": str(tmp_path / "simulated-gpu-processes.json"),
            **(extra_env or {}),
        }
        log = open(OUTPUT / f"worker-{node}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            worker_argv(queue, f"{node}@test", pool="solo"),
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

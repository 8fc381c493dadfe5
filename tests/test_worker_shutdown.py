"""A GPU host's worker that shuts down stops its jobs, whether or not the database answers: its
supervisors learn it from a flag on the host's disk (jobs.host.spool.stop_flag), and the shutdown
handler takes a fresh connection for the row (the old one may have died with a restart)."""

from __future__ import annotations

import os
import threading

import pytest
from django.conf import settings
from django.db import OperationalError

from gpus.booking import reservation_create
from jobs import signals
from jobs.host import worker as host_worker
from jobs.host.runner import job_run
from jobs.host.spool import stop_flag
from jobs.logs.store import log_stream
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from tests.waiting import wait_for

SLEEPER = b"import time\nprint('sleeping', flush=True)\ntime.sleep(120)\n"


@pytest.fixture
def flag():
    path = stop_flag(os.getpid())
    yield path
    path.unlink(missing_ok=True)


@pytest.mark.django_db(transaction=True)
def test_a_shutdown_stops_a_running_job_without_the_database(alice, box, flag, settings):
    settings.JOB_KILL_GRACE_SECONDS = 1
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=4096)
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="s.py", content=SLEEPER))
    outcome: list[str | None] = []
    runner = threading.Thread(target=lambda: outcome.append(job_run(job.pk)))
    runner.start()
    wait_for(lambda: b"sleeping" in b"".join(log_stream(job.pk)), timeout=30, what="the job to run")
    flag.touch()  # what the shutdown handler writes; no row changes
    runner.join(timeout=30)
    assert outcome == [Job.Status.CANCELLED]
    job.refresh_from_db()
    assert job.message == f"The worker on {os.uname().nodename} shut down."
    assert "shut down. Sending SIGTERM" in b"".join(log_stream(job.pk)).decode()


@pytest.mark.django_db
def test_the_shutdown_handler_writes_its_flag_and_survives_a_database_outage(monkeypatch, flag, caplog):
    closed = []
    monkeypatch.setattr(host_worker.connection, "close", lambda: closed.append(True))

    def refused(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OperationalError("could not connect to server: Connection refused")

    monkeypatch.setattr(Job.objects, "filter", refused)
    signals.HostWorker(settings.WORKER_SERVER).stop_running_jobs()
    assert flag.exists() and closed == [True]
    assert "its jobs stop by the flag alone" in caplog.text
    assert settings.WORKER_SERVER  # the handler ran as a host's worker would

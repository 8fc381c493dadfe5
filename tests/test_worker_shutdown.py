"""A GPU host's worker that shuts down stops its jobs, whether or not the database answers: its
supervisors learn it from a flag on the host's disk (jobs.host.spool.stop_flag), and the shutdown
handler takes a fresh connection for the row (the old one may have died with a restart)."""

from __future__ import annotations

import os
import socket
import threading
from types import SimpleNamespace

import pytest
from django.conf import settings
from django.db import InterfaceError, OperationalError, ProgrammingError

from gpus.booking import reservation_create
from jobs import signals
from jobs.host import worker as host_worker
from jobs.host.runner import job_run
from jobs.host.spool import stop_flag
from jobs.host.worker import running_jobs_stop
from jobs.logs.store import log_stream
from jobs.models import Job
from jobs.preemption import preempted_words
from jobs.queue.scheduler import schedule_pass
from jobs.submit import ScriptUpload, job_submit
from tests.factories import queue_job
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


@pytest.mark.django_db(transaction=True)
def test_a_shutdown_sends_a_preemptible_job_back_to_the_queue(alice, box, flag, settings):
    """Nobody cancelled it: it goes back to the queue at its old place, as a preempted job does,
    its log saying why, and resumes from its checkpoint on its next run."""
    settings.JOB_KILL_GRACE_SECONDS = 1
    job = queue_job(alice, preemptible=True, script=ScriptUpload(name="s.py", content=SLEEPER))
    schedule_pass()
    outcome: list[str | None] = []
    runner = threading.Thread(target=lambda: outcome.append(job_run(job.pk)))
    runner.start()
    wait_for(lambda: b"sleeping" in b"".join(log_stream(job.pk)), timeout=30, what="the job to run")
    flag.touch()
    runner.join(timeout=30)
    assert outcome == [Job.Status.PENDING]
    job.refresh_from_db()
    why = preempted_words(f"the worker on {os.uname().nodename} shut down")
    assert why.endswith("shut down. It goes back to the queue at its old place.")
    assert (job.status, job.preemptions, job.message, job.cancel_requested_at) == ("pending", 1, why, None)
    assert f"{why} Sending SIGTERM" in b"".join(log_stream(job.pk)).decode()


@pytest.mark.django_db
def test_the_shutdown_handler_asks_preemptible_jobs_to_leave_and_cancels_the_rest(
    alice, box, flag, settings, monkeypatch
):
    settings.WORKER_SERVER = "box1"
    monkeypatch.setattr(host_worker.connection, "close", lambda: None)  # the test's transaction stays
    here = {"status": Job.Status.RUNNING, "worker": socket.gethostname(), "pid": 4242}
    preemptible = queue_job(alice, preemptible=True)
    ordinary = queue_job(alice)
    schedule_pass()
    Job.objects.filter(pk__in=[preemptible.pk, ordinary.pk]).update(**here)
    assert running_jobs_stop() == 2
    preemptible.refresh_from_db()
    ordinary.refresh_from_db()
    assert preemptible.cancel_requested_at is None and preemptible.preempt_requested_at is not None
    assert preemptible.preempt_reason == f"the worker on {socket.gethostname()} shut down"
    assert ordinary.cancel_requested_at is not None and ordinary.preempt_requested_at is None


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


# --- a start with the database away ----------------------------------------------------------------


def _away_twice(tries: list[int], answer: object):  # type: ignore[no-untyped-def]
    """A step whose first two tries meet the database away (a closed connection), then `answer`."""

    def step(server: str) -> object:
        tries.append(1)
        if len(tries) <= 2:
            raise InterfaceError("connection already closed")
        return answer

    return step


@pytest.mark.django_db(transaction=True)  # it closes its connection after each failure, as a worker does
def test_a_host_worker_that_starts_with_the_database_away_waits_for_it_then_sweeps(box, monkeypatch, caplog):
    """A raising worker_ready receiver is only logged by Celery: the worker would take work with no
    pickup, spool replay or watchdog. It waits for the database instead, then sweeps once."""
    from celery.worker import state

    tries: list[int] = []
    away_twice = _away_twice(tries, 0)
    monkeypatch.setattr(signals, "kill_orphans", away_twice)
    slept: list[float] = []
    # jobs.signals' own name for the module, not time.sleep itself: the steps' subprocesses (podman)
    # and the suite's other threads keep sleeping as they do.
    monkeypatch.setattr(signals, "time", SimpleNamespace(sleep=slept.append))
    host = signals.HostWorker("box1")
    assert host.patiently(host.sweep, "ends what its last worker left")
    assert len(tries) == 3 and slept == [settings.JOB_RECONCILE_SECONDS] * 2
    said = [r.getMessage() for r in caplog.records if r.name == "jobs.signals"]
    assert len([m for m in said if m.startswith("The database is away")]) == 1  # said once
    assert "It answers again: box1's worker takes work now" in said

    # Another error is no outage: said with its traceback, and the next steps still run.
    def broken(server: str) -> int:
        raise ProgrammingError('relation "jobs_job" does not exist')

    labs: list[str] = []
    monkeypatch.setattr(signals, "kill_orphans", broken)
    monkeypatch.setattr(signals, "lab_orphans_end", labs.append)
    assert host.patiently(host.sweep, "ends what its last worker left")
    assert len(slept) == 2 and labs == ["box1"]
    said = [r.getMessage() for r in caplog.records if r.name == "jobs.signals"]
    assert "Could not end its jobs' processes (what the last worker of box1 left); going on" in said

    # Asked to stop while it waits: it stops waiting, and starts nothing.
    monkeypatch.setattr(signals, "kill_orphans", away_twice)
    tries.clear()
    monkeypatch.setattr(state, "should_stop", 0)
    assert not host.patiently(host.sweep, "ends what its last worker left") and tries == []


@pytest.mark.django_db(transaction=True)
def test_a_slurm_worker_that_starts_with_the_database_away_follows_its_jobs_again_later(monkeypatch, caplog):
    """Before, the lookup's DatabaseError was logged and the jobs its last worker followed were
    never followed again: the reconciler called them lost while Slurm ran them on."""
    tries: list[int] = []

    monkeypatch.setattr(signals, "slurm_jobs_resume", _away_twice(tries, [7]))
    slept: list[float] = []
    monkeypatch.setattr(signals, "time", SimpleNamespace(sleep=slept.append))
    host = signals.HostWorker("cluster-a")
    assert host.patiently(host.resume_slurm_jobs, "follows again the Slurm jobs its last worker followed")
    assert len(tries) == 3 and slept == [settings.JOB_RECONCILE_SECONDS] * 2
    said = [r.getMessage() for r in caplog.records if r.name == "jobs.signals"]
    assert [m for m in said if m.startswith("The database is away")] == [
        "The database is away (connection already closed): cluster-a's worker follows"
        f" again the Slurm jobs its last worker followed before it takes work, and waits for it, trying"
        f" every {settings.JOB_RECONCILE_SECONDS} s"
    ]
    assert "Following job(s) 7 again: their Slurm jobs run on" in said

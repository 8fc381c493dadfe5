"""What a dead worker's jobs left running is ended at the next start, and only that: a job's session
is named by its leader's pid and start (Job.pid, Job.pid_started), never by a pid alone. And the
reconciler gives workers their grace after the portal (re)starts, as after an outage."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import psutil
import pytest
from django.utils import timezone

from gpus.booking import reservation_create
from jobs import runs
from jobs.host.worker import kill_orphans
from jobs.logs.store import log_stream
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from jobs.threads import JobReconciler
from portal.models import AuditEntry, Notification
from tests.job_helpers import alive, kill_quietly, session_member

pytestmark = pytest.mark.django_db


CHILD = "import subprocess as s; print(s.Popen(['sleep', '60'], stdout=s.DEVNULL).pid, flush=True)"


class LeaderlessSession:
    """A session whose leader exited (reaped here) and left a `sleep` in it: what a job's killed
    launcher leaves, or an unrelated program whose session id a recycled job pid may equal."""

    def __init__(self) -> None:
        leader = subprocess.Popen(
            [sys.executable, "-c", CHILD],
            start_new_session=True,
            stdout=subprocess.PIPE,
        )
        self.sid = leader.pid
        self.started = psutil.Process(leader.pid).create_time()  # not reaped yet: still its own
        self.process = session_member(leader, int(leader.stdout.readline()))
        self.member = self.process.pid
        leader.stdout.close()
        leader.wait()

    def alive(self) -> bool:
        return alive(self.process)

    def close(self) -> None:
        kill_quietly([self.process])


@pytest.fixture
def session() -> Iterator[LeaderlessSession]:
    left = LeaderlessSession()
    yield left
    left.close()


@pytest.fixture
def running_job(alice, box, settings):
    """A job this host was running, as the row says, in the session given."""
    settings.JOB_USER = ""  # the worker's own account: the test's
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)

    def make(sid: int, pid_started: float | None) -> Job:
        job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="j.py", content=b"1"))
        start = pid_started if pid_started is not None else psutil.boot_time() - 3600
        Job.objects.filter(pk=job.pk).update(
            status=Job.Status.RUNNING,
            worker=socket.gethostname()[:200],
            pid=sid,
            pid_started=pid_started,
            started_at=datetime.fromtimestamp(start, UTC),
            # Its supervisor beat until the worker died, after the test made the session's
            # processes: a second on, the margin the sweep may take between reading this host's
            # clock and the database's (it never proves a process too many).
            heartbeat_at=timezone.now() + timedelta(seconds=1),
        )
        return job

    return make


def test_it_ends_what_a_dead_workers_job_left_in_its_session_and_says_so(running_job, session):
    job = running_job(session.sid, session.started)
    assert kill_orphans("box1") == 1
    assert not session.alive()
    log = b"".join(log_stream(job.pk)).decode()
    assert f"[portal] Killed process(es) {session.member} that job {job.pk} left running" in log
    assert AuditEntry.objects.filter(target=f"job {job.pk}", action=AuditEntry.Action.JOB_CANCEL).exists()
    assert Notification.objects.filter(user=job.owner, kind=Notification.Kind.JOB_STOPPED).exists()


def test_a_session_recorded_before_this_boot_is_never_taken_for_a_later_one(running_job, session):
    """After a reboot a job's recorded pid may be any process's session id again."""
    running_job(session.sid, psutil.boot_time() - 3600)
    assert kill_orphans("box1") == 0
    assert session.alive()


def test_a_later_leaderless_session_on_a_jobs_old_id_is_left_alone(running_job, session, caplog):
    """The job's session ended whole, its id came round to a later session whose leader is gone
    too: nothing in it was there while the job's worker still watched, so nothing is proved."""
    job = running_job(session.sid, session.started - 120)  # an earlier leader with this pid
    Job.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=60))
    with caplog.at_level(logging.WARNING, logger="jobs.host.worker"):
        assert kill_orphans("box1") == 0
    assert session.alive()
    assert "cannot be proved to be its" in caplog.text


def test_a_job_without_its_sessions_start_has_nothing_killed_and_the_log_says_so(
    running_job, session, caplog
):
    job = running_job(session.sid, None)
    with caplog.at_level(logging.WARNING, logger="jobs.host.worker"):
        assert kill_orphans("box1") == 0
    assert session.alive()
    assert f"Job {job.pk}: process(es) [{session.member}]" in caplog.text
    assert "it has no recorded session start" in caplog.text
    assert str(session.member) in caplog.text


def test_the_reconciler_gives_workers_their_grace_after_it_starts():
    reconciler = JobReconciler()
    assert reconciler.heard_for() < 1  # a portal restarted mid-outage cannot tell
    reconciler.back_at -= 10
    assert reconciler.heard_for() >= 10


def test_each_kind_of_run_is_judged_lost_only_past_its_own_grace(settings, monkeypatch):
    """A session beats through the web API, less often than a job: after an outage it gets its
    own cut-off before it may be called lost, not the jobs' shorter one."""
    settings.JOB_LOST_AFTER_SECONDS, settings.SESSION_LOST_AFTER_SECONDS = 30, 120
    judged: list[str] = []
    monkeypatch.setattr(runs, "_jobs_lost_mark", lambda now: judged.append("jobs") or 0)
    monkeypatch.setattr(runs, "_sessions_lost_mark", lambda now: judged.append("sessions") or 0)
    runs.runs_lost_mark(heard_for=29)
    assert judged == []
    runs.runs_lost_mark(heard_for=30)
    assert judged == ["jobs"]
    runs.runs_lost_mark(heard_for=120)
    assert judged == ["jobs", "jobs", "sessions"]
    runs.runs_lost_mark()  # no outage known: every kind is judged
    assert judged[-2:] == ["jobs", "sessions"]

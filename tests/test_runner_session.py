"""The supervisor ends a job's whole session, by identity, and keeps its job bounded while the
database is away. The real Supervisor runs in this process (job_run) on real subprocesses."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from datetime import timedelta

import psutil
import psycopg
import pytest
from django.db import OperationalError
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.models import Allocation, Reservation
from jobs.host import end as host_end
from jobs.host import runner
from jobs.host.executors import local
from jobs.host.runner import Supervisor, job_run
from jobs.host.spool import EndRecord, spool_name, stop_flag
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from tests.job_helpers import Leftovers, alive, job_log
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)  # the runner closes connections after errors

# A child in a process group of its own (setpgid), still in the job's session, writes its pid
# to a file and sleeps; the main process then waits to be stopped, or ends at once.
GROUPED_CHILD = """
import subprocess, sys, time
child = subprocess.Popen(["sleep", "120"], process_group=0)
open({pidfile!r}, "w").write(str(child.pid))
print("ready", flush=True)
if {wait}:
    time.sleep(120)
"""

# A child that left the session (setsid) and keeps printing on the job's pipe; the main process ends.
# A line a millisecond, not a tight loop: a flood on two cores starves the rest of the suite and
# measures the machine, not whether the pipe holds the supervisor.
CHATTY_ESCAPEE = """
import subprocess, sys
child = subprocess.Popen(
    [sys.executable, "-c", "import sys, time\\nwhile True: print('x' * 100, flush=True); time.sleep(0.001)"],
    start_new_session=True,
)
open({pidfile!r}, "w").write(str(child.pid))
print("ready", flush=True)
"""

SLEEPER = "import time\nprint('ready', flush=True)\ntime.sleep(120)\n"


@pytest.fixture
def job_in(alice, box, settings):
    settings.JOB_KILL_GRACE_SECONDS = 1
    settings.JOB_HEARTBEAT_SECONDS = 1
    settings.JOB_DRAIN_SECONDS = 1
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)

    def submit(source: str, **fields: object) -> Job:
        upload = ScriptUpload(name="job.py", content=source.encode())
        return job_submit(user=alice, reservation=booking, script=upload, **fields)

    return submit


def _away() -> OperationalError:
    """What Django raises when the server is gone: an outage (portal.unreachable.outage_of)."""
    error = OperationalError("server closed the connection unexpectedly")
    error.__cause__ = psycopg.OperationalError("server closed the connection unexpectedly")
    return error


def _run_in_thread(job_id: int) -> tuple[threading.Thread, list[str | None]]:
    outcome: list[str | None] = []
    thread = threading.Thread(target=lambda: outcome.append(job_run(job_id)), daemon=True)
    thread.start()
    return thread, outcome


@pytest.fixture
def leftover() -> Iterator[Leftovers]:
    """What the test's jobs left that it saw; killed after it, by handle, whatever happened (the
    old code would leave them)."""
    seen = Leftovers()
    yield seen
    seen.kill()


def test_it_ends_a_child_in_its_own_process_group_when_the_job_ends(job_in, tmp_path, leftover):
    pidfile = tmp_path / "child"
    job = job_in(GROUPED_CHILD.format(pidfile=str(pidfile), wait=False))
    assert job_run(job.pk) == Job.Status.SUCCEEDED
    child = leftover.child(pidfile, job.pk)
    assert not alive(child)


# Says at once that SIGTERM came, then takes its time to end.
ANSWERS_SIGTERM = """
import signal, sys, time
def answer(signum, frame):
    print("SIGTERM came", flush=True)
    time.sleep(0.5)
    sys.exit(143)
signal.signal(signal.SIGTERM, answer)
print("ready", flush=True)
time.sleep(120)
"""


def test_the_portals_why_comes_before_the_jobs_answer_to_its_signal(job_in, alice, monkeypatch):
    # The supervisor's loop writes the portal's lines on its tick: a long one, as on a loaded
    # machine, where the job's answer came first (the preemption test, under the whole suite).
    monkeypatch.setattr(runner, "TICK_SECONDS", 2.0)
    job = job_in(ANSWERS_SIGTERM)
    thread, outcome = _run_in_thread(job.pk)
    wait_for(lambda: "ready" in job_log(job.pk), timeout=30, what="the job to run")
    Job.objects.filter(pk=job.pk).update(cancel_requested_at=timezone.now(), cancelled_by=alice)
    thread.join(timeout=30)
    assert outcome == [Job.Status.CANCELLED]
    log = job_log(job.pk)
    assert log.index("Sending SIGTERM") < log.index("SIGTERM came"), log


def test_it_ends_a_child_in_its_own_process_group_on_cancel_by_identity(
    job_in, alice, tmp_path, leftover, monkeypatch
):
    groups: list[int] = []
    real_killpg = os.killpg

    def proved(pgid: int, sig: int) -> None:  # the sweep's: the unreaped leader's group, or a member's
        groups.append(pgid)
        real_killpg(pgid, sig)

    monkeypatch.setattr(os, "killpg", proved)
    pidfile = tmp_path / "child"
    job = job_in(GROUPED_CHILD.format(pidfile=str(pidfile), wait=True))
    thread, outcome = _run_in_thread(job.pk)
    child = leftover.child(pidfile, job.pk)
    assert child is not None, "the job's child is gone before the cancel"
    wait_for(lambda: "ready" in job_log(job.pk), timeout=30, what="the job to run")
    Job.objects.filter(pk=job.pk).update(cancel_requested_at=timezone.now(), cancelled_by=alice)
    thread.join(timeout=30)
    assert outcome == [Job.Status.CANCELLED]
    assert not alive(child)
    job.refresh_from_db()
    # SIGTERM went to each process by identity; only the end sweep signals groups: the job's own
    # (its leader unreaped) and the child's (seen through the live child).
    assert groups and set(groups) <= {job.pid, child.pid}


def test_it_records_the_sessions_start_with_its_pid(job_in, monkeypatch):
    job = job_in("print('hello')\n")
    real_session, seen = local.JobSession, []

    def remember(proc):  # type: ignore[no-untyped-def]
        seen.append((proc.pid, psutil.Process(proc.pid).create_time()))
        return real_session(proc)

    monkeypatch.setattr(local, "JobSession", remember)
    assert job_run(job.pk) == Job.Status.SUCCEEDED
    job.refresh_from_db()
    assert [(job.pid, job.pid_started)] == seen


def test_a_chatty_process_that_left_the_session_does_not_hold_the_supervisor(job_in, tmp_path, leftover):
    pidfile = tmp_path / "child"
    job = job_in(CHATTY_ESCAPEE.format(pidfile=str(pidfile)))
    thread, outcome = _run_in_thread(job.pk)
    leftover.child(pidfile, job.pk)
    thread.join(timeout=30)
    assert outcome == [Job.Status.SUCCEEDED], "the supervisor is still draining the escapee's output"
    assert "from a process that left its session: no longer read" in job_log(job.pk)


def test_it_enforces_the_booking_end_while_the_database_is_away(job_in, monkeypatch):
    job = job_in(SLEEPER)
    end = timezone.now() + timedelta(seconds=4)
    Reservation.objects.filter(pk=job.reservation_id).update(end=end, booked_end=end)
    Allocation.objects.filter(reservation_id=job.reservation_id).update(end=end)

    def away(self, beat):  # type: ignore[no-untyped-def]
        raise _away()

    monkeypatch.setattr(Supervisor, "_check_row", away)  # the row cannot be read, ever
    thread, outcome = _run_in_thread(job.pk)
    thread.join(timeout=30)
    assert outcome == [Job.Status.TIMED_OUT]
    job.refresh_from_db()
    assert job.finished_at >= end and "booking ended" in job.message
    log = job_log(job.pk)
    assert "the database is away: the job is stopped by the last deadline it gave" in log
    assert log.index("the database is away") < log.index("Sending SIGTERM")


def test_a_database_outage_is_one_line_in_the_workers_log_not_a_traceback_a_tick(job_in, caplog):
    supervisor = Supervisor(job_in(SLEEPER))

    def away() -> None:
        raise _away()

    with caplog.at_level(logging.WARNING, logger="jobs.host.runner"):
        assert [supervisor._guarded(away, reads=True) for _ in range(5)] == [False] * 5
        assert supervisor._guarded(lambda: None)  # reaches no database (a flush with nothing pending)
        assert supervisor._guarded(lambda: None, reads=True)  # the row was read: it is back
        assert not supervisor._guarded(away)
    supervisor.spool.close()
    lines = [(r.getMessage(), r.exc_info) for r in caplog.records]
    assert [text.split(": ", 1)[1] for text, _ in lines] == [
        "the database is away (server closed the connection unexpectedly); its steps wait for it",
        "the database answers again",
        "the database is away (server closed the connection unexpectedly); its steps wait for it",
    ]
    assert all(exc_info is None for _, exc_info in lines)


@pytest.fixture
def end_refused(monkeypatch) -> list[int]:
    """The job's end cannot be stored: the database is away for good. Counts the tries."""
    tries: list[int] = []

    def refused(job_id, writer, record):  # type: ignore[no-untyped-def]
        tries.append(job_id)
        raise _away()

    monkeypatch.setattr(host_end, "job_end_record", refused)
    return tries


def test_a_shutdown_during_the_end_retries_stops_them(job_in, settings, end_refused, monkeypatch):
    settings.JOB_END_WAIT_SECONDS = 3600
    flag = stop_flag(os.getpid())
    real = host_end.job_end_record

    def refused_then_shutdown(job_id, writer, record):  # type: ignore[no-untyped-def]
        flag.touch()  # the worker's shutdown arrives while the end is retried
        return real(job_id, writer, record)

    monkeypatch.setattr(host_end, "job_end_record", refused_then_shutdown)
    job = job_in("print('hello')\n")
    try:
        thread, _ = _run_in_thread(job.pk)
        thread.join(timeout=20)
        assert not thread.is_alive(), "the end is still retried after the shutdown"
    finally:
        flag.unlink(missing_ok=True)
    assert len(end_refused) == 1
    # The spool has it, for the replay.
    assert EndRecord.read(spool_name(job.pk, job.created_at)).status == Job.Status.SUCCEEDED


def test_without_a_spool_the_end_is_given_up_after_its_wait(
    job_in, settings, end_refused, monkeypatch, caplog
):
    settings.JOB_END_WAIT_SECONDS = 1
    monkeypatch.setattr(runner, "job_spool", lambda job_id, created_at: None)
    job = job_in("print('hello')\n")
    with caplog.at_level(logging.ERROR, logger="jobs.host.end"):
        thread, _ = _run_in_thread(job.pk)
        thread.join(timeout=20)
    assert not thread.is_alive(), "the end is retried for ever"
    assert 1 <= len(end_refused) <= 3
    assert f"Job {job.pk} ended succeeded" in caplog.text and "no spool" in caplog.text


def test_a_job_on_a_booking_its_owner_released_ends_cancelled_saying_who(job_in, alice):
    """Released early is no time-out: the job ends cancelled, naming who released it (issue 23)."""
    from gpus.booking import reservation_release

    job = job_in(SLEEPER)
    thread, outcome = _run_in_thread(job.pk)
    wait_for(lambda: "ready" in job_log(job.pk), timeout=30, what="the job to run")
    reservation_release(user=alice, reservation=job.reservation_id)
    thread.join(timeout=30)
    assert outcome == [Job.Status.CANCELLED]
    job.refresh_from_db()
    assert job.message.startswith("Cancelled: alice released the booking at")


def test_a_job_on_a_booking_a_leader_cancelled_ends_cancelled_saying_who_and_why(job_in, leader):
    """A leader's cancel is a cancel, not a time-out: the same rule as a release (issue 41)."""
    from gpus.booking import reservation_cancel

    job = job_in(SLEEPER)
    thread, outcome = _run_in_thread(job.pk)
    wait_for(lambda: "ready" in job_log(job.pk), timeout=30, what="the job to run")
    reservation_cancel(user=leader, reservation=job.reservation_id, reason="paper deadline")
    thread.join(timeout=30)
    assert outcome == [Job.Status.CANCELLED]
    job.refresh_from_db()
    assert job.message.startswith("Cancelled: leader cancelled the booking at"), job.message
    assert job.message.endswith("(paper deadline).") and job.exit_code == -15
    assert "leader cancelled the booking" in job_log(job.pk)


def test_a_running_job_a_leader_cancels_ends_saying_who_and_why(job_in, leader):
    """Someone else's job cancel: its end, its message and its log name the leader and the reason
    the owner is told (issue 41, bug 2)."""
    from jobs.services import job_cancel

    job = job_in(SLEEPER)
    thread, outcome = _run_in_thread(job.pk)
    wait_for(lambda: "ready" in job_log(job.pk), timeout=30, what="the job to run")
    job_cancel(user=leader, job=job.pk, reason="blocking the demo")
    thread.join(timeout=30)
    assert outcome == [Job.Status.CANCELLED]
    job.refresh_from_db()
    assert job.message == "Cancelled by leader: blocking the demo.", job.message
    assert "Cancelled by leader: blocking the demo." in job_log(job.pk)

"""A review's repros against the runner (jobs/host/runner.py, jobs/host/executors/local.py,
portal/pids.py): a job
that escapes its end sweep, a leader whose start cannot be read, a database that hangs, pidfds that
run out, a drain that waits for nothing, a job that floods its pipe. The real Supervisor runs in
this process (job_run) on real subprocesses."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.models import Allocation, Reservation
from jobs.host.executors import local, output
from jobs.host.runner import Supervisor, job_run
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from tests.job_helpers import Leftovers, alive, job_log
from tests.test_runner_session import CHATTY_ESCAPEE
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

# The main process starts a "pid hopper" in the job's own session (no setsid): it forks and exits
# at once, for ever, so no pid of it lives longer than a fork. It stops itself after 25 s (the
# test's safety), touching a marker file while it lives. {group}: in a process group of its own.
HOPPER = """
import os, sys, time
marker = {marker!r}
if os.fork() == 0:
    os.closerange(0, 3)  # the job's pipe closes: the supervisor sees EOF at once
    if {group}:
        os.setpgid(0, 0)
    stop_at = time.time() + 25
    n = 0
    while time.time() < stop_at:
        if os.fork():
            os._exit(0)
        n += 1
        if n % 200 == 0:
            with open(marker, "w") as f:
                f.write(str(time.time()))
    os._exit(0)
print("ready", flush=True)
time.sleep(0.5)
"""

SLEEPER_CHILD = (
    "import subprocess, time\n"
    "child = subprocess.Popen(['sleep', '60'])\n"
    "open({pidfile!r}, 'w').write(str(child.pid))\n"
    "print('ready', flush=True)\ntime.sleep(60)\n"
)

# Ignores SIGTERM: only the SIGKILL at the end of the grace period ends it.
DEAF = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""

IGNORES_TERM = """
import signal, subprocess, sys, time
deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
child = subprocess.Popen([sys.executable, "-c", deaf], process_group=0)
open({pidfile!r}, "w").write(str(child.pid))
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""

DOUBLE_FORK = """
import os, time
if os.fork() == 0:
    if os.fork() == 0:
        os.closerange(0, 3)
        open({pidfile!r}, "w").write(str(os.getpid()))
        time.sleep(60)
    os._exit(0)
time.sleep(1)
print("ready", flush=True)
"""

# Past the heartbeat, drain and kill grace (1 s each in job_in). The worker reads it flat out,
# so its CPU is the flood's length; an unbounded reader queue held 7,168 chunks (448 MiB) in
# 1.5 s when tried, against the 64 allowed.
FLOOD = """
import sys, time
w = sys.stdout.buffer.write
block = b"x\\n" * 32768
t = time.time()
while time.time() - t < 1.5:
    w(block)
"""


@pytest.fixture
def job_in(alice, box, settings):
    settings.JOB_KILL_GRACE_SECONDS = 1
    settings.JOB_HEARTBEAT_SECONDS = 1
    settings.JOB_DRAIN_SECONDS = 1
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)

    def submit(source: str) -> Job:
        upload = ScriptUpload(name="job.py", content=source.encode())
        return job_submit(user=alice, reservation=booking, script=upload)

    return submit


@pytest.fixture
def leftover() -> Iterator[Leftovers]:
    """What the test's jobs left that it saw; killed after it, by handle, whatever happened."""
    seen = Leftovers()
    yield seen
    seen.kill()


def _run_in_thread(job_id: int) -> tuple[threading.Thread, list[str | None]]:
    outcome: list[str | None] = []

    def run() -> None:
        try:
            outcome.append(job_run(job_id))
        except Exception as exc:  # what the Celery task would see
            outcome.append(repr(exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _still_hopping(marker: Path, since: float) -> bool:
    """Whether the hopper touched its marker more than a second after `since`, 2 s later."""
    time.sleep(2)
    return marker.exists() and float(marker.read_text() or 0) > since + 1


@pytest.mark.parametrize("group", [False, True], ids=["in-the-leaders-group", "in-a-group-of-its-own"])
def test_a_pid_hopper_in_the_jobs_session_does_not_survive_the_end_sweep(job_in, tmp_path, group):
    marker = tmp_path / "alive"
    job = job_in(HOPPER.format(marker=str(marker), group=group))
    assert job_run(job.pk) == Job.Status.SUCCEEDED
    assert not _still_hopping(marker, time.time()), "a process of the job's session runs on after its end"


def test_the_end_sweep_says_what_it_could_not_end(job_in, tmp_path, monkeypatch, leftover, caplog):
    monkeypatch.setattr(local, "SWEEP_SECONDS", 0.3)
    monkeypatch.setattr(local, "send_group", lambda pgid, sig: local.Sent.GONE)
    monkeypatch.setattr(local.pids, "send", lambda target, sig: local.Sent.GONE)
    pidfile = tmp_path / "child"
    job = job_in(
        "import subprocess\n"
        "child = subprocess.Popen(['sleep', '60'], stdout=subprocess.DEVNULL)\n"
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
    )
    assert job_run(job.pk) == Job.Status.SUCCEEDED
    leftover.child(pidfile, job.pk)
    job.refresh_from_db()
    assert "1 process(es) of the job's session were still there after the end sweep" in job_log(job.pk)
    assert job.message == "Some of what it left running could not be stopped."
    assert "survived the end sweep" in caplog.text


def test_a_pidfd_open_error_other_than_enosys_still_stops_the_job(
    job_in, alice, monkeypatch, tmp_path, leftover
):
    """pidfd_open fails with EMFILE/ENFILE/ENOMEM on a host under pressure: the job is still
    stopped, its child ended and its end recorded."""

    def no_fds(pid: int) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    pidfile = tmp_path / "child"
    job = job_in(SLEEPER_CHILD.format(pidfile=str(pidfile)))
    thread, outcome = _run_in_thread(job.pk)
    wait_for(lambda: Job.objects.filter(pk=job.pk, status=Job.Status.RUNNING).exists(), timeout=30)
    child = leftover.child(pidfile, job.pk)
    assert child is not None, "the job's child is gone before the cancel"
    monkeypatch.setattr(os, "pidfd_open", no_fds)
    Job.objects.filter(pk=job.pk).update(cancel_requested_at=timezone.now(), cancelled_by=alice)
    thread.join(timeout=30)
    monkeypatch.undo()
    assert outcome == [Job.Status.CANCELLED]
    assert not alive(child)


def test_a_leader_whose_start_cannot_be_read_is_still_cancelled_and_it_is_said(
    job_in, alice, monkeypatch, caplog
):
    """/proc mounted hidepid=2 with JOB_USER: the worker cannot read its job's start. The leader
    is signalled through its pidfd, and the log says the rest could not be seen."""
    monkeypatch.setattr(local, "started_at", lambda pid: None)
    job = job_in("import time\nprint('ready', flush=True)\ntime.sleep(20)\n")
    thread, outcome = _run_in_thread(job.pk)
    wait_for(lambda: Job.objects.filter(pk=job.pk, status=Job.Status.RUNNING).exists(), timeout=30)
    asked = time.monotonic()
    Job.objects.filter(pk=job.pk).update(cancel_requested_at=timezone.now(), cancelled_by=alice)
    thread.join(timeout=40)
    took = time.monotonic() - asked
    assert outcome == [Job.Status.CANCELLED]
    assert took < 8, f"cancelled, with a 1 s kill grace, yet it ran {took:.0f} s more"
    assert job_log(job.pk).count("this worker cannot see the job's processes") == 1
    assert "cannot list its processes" in caplog.text


def test_the_booking_end_holds_while_the_database_hangs(job_in, monkeypatch):
    """A query that never comes back (a frozen VM, a storage stall, a blackholed network): the
    deadline and the SIGKILL escalation do not wait for it."""
    job = job_in(DEAF)
    end = timezone.now() + timedelta(seconds=3)
    Reservation.objects.filter(pk=job.reservation_id).update(end=end, booked_end=end)
    Allocation.objects.filter(reservation_id=job.reservation_id).update(end=end)
    release = threading.Event()

    def hangs(self: Supervisor, beat: bool) -> None:
        release.wait(40)  # the query never comes back (for 40 s here)
        raise RuntimeError("unreachable in the test")

    monkeypatch.setattr(Supervisor, "_check_row", hangs)
    thread, outcome = _run_in_thread(job.pk)
    thread.join(timeout=15)
    stuck = thread.is_alive()
    release.set()
    thread.join(timeout=60)
    assert not stuck, (
        "15 s after a booking end 3 s away, the job still runs: the deadline waits for the database"
    )
    assert outcome == [Job.Status.TIMED_OUT]
    log = job_log(job.pk)
    assert "the database is away: the job is stopped by the last deadline it gave" in log
    assert "still running after the grace period: SIGKILL" in log  # it ignored SIGTERM


def test_the_heartbeat_is_never_written_after_the_leader_is_reaped(
    job_in, tmp_path, settings, monkeypatch, leftover
):
    """kill_orphans takes heartbeat_at as a moment the supervisor still held the leader unreaped."""
    settings.JOB_DRAIN_SECONDS = 3
    reaped: list[datetime] = []
    real = local.JobSession.reap

    def reap(self: local.JobSession) -> int:
        code = real(self)
        reaped.append(datetime.now(UTC))
        return code

    monkeypatch.setattr(local.JobSession, "reap", reap)
    pidfile = tmp_path / "child"
    job = job_in(CHATTY_ESCAPEE.format(pidfile=str(pidfile)))
    thread, _ = _run_in_thread(job.pk)
    leftover.child(pidfile, job.pk)
    thread.join(timeout=30)
    job.refresh_from_db()
    assert job.heartbeat_at <= reaped[0], (job.heartbeat_at, reaped[0])


def test_a_plain_job_ends_without_waiting_for_the_drain_nor_a_false_line(job_in, settings):
    settings.JOB_DRAIN_SECONDS = 5
    job = job_in("print('hi')\n")
    began = time.monotonic()
    assert job_run(job.pk) == Job.Status.SUCCEEDED
    took = time.monotonic() - began
    assert "left its session" not in job_log(job.pk)
    assert took < 4, f"a job printing one line took {took:.1f} s to end"


def test_a_job_that_prints_fast_is_held_back_not_queued_in_the_workers_memory(job_in, settings, monkeypatch):
    settings.JOB_LOG_MAX_MB = 1
    job = job_in(FLOOD)
    outputs: list[output.PipeOutput] = []
    real = output.PipeOutput.__init__

    def remember(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        real(self, *args, **kwargs)
        outputs.append(self)

    monkeypatch.setattr(output.PipeOutput, "__init__", remember)
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            if outputs:
                peak[0] = max(peak[0], outputs[0].chunks.qsize())
            time.sleep(0.05)

    threading.Thread(target=sample, daemon=True).start()
    assert job_run(job.pk) == Job.Status.SUCCEEDED
    done.set()
    assert peak[0] * 65536 <= 4 * 1024 * 1024, f"{peak[0]} chunks queued in the worker"


def test_a_sigterm_ignoring_leader_and_child_are_killed_on_cancel(job_in, alice, tmp_path, leftover):
    pidfile = tmp_path / "child"
    job = job_in(IGNORES_TERM.format(pidfile=str(pidfile)))
    thread, outcome = _run_in_thread(job.pk)
    child = leftover.child(pidfile, job.pk)
    assert child is not None, "the job's child is gone before the cancel"
    wait_for(lambda: "ready" in job_log(job.pk), timeout=30, what="the job to run")
    Job.objects.filter(pk=job.pk).update(cancel_requested_at=timezone.now(), cancelled_by=alice)
    thread.join(timeout=30)
    assert outcome == [Job.Status.CANCELLED] and not alive(child)


def test_a_double_forked_daemon_without_setsid_is_ended(job_in, tmp_path, leftover):
    pidfile = tmp_path / "child"
    job = job_in(DOUBLE_FORK.format(pidfile=str(pidfile)))
    assert job_run(job.pk) == Job.Status.SUCCEEDED
    assert not alive(leftover.child(pidfile, job.pk))


def test_a_log_flush_that_fails_backs_off_and_recovers_at_once(job_in, monkeypatch):
    from django.db import OperationalError

    from jobs.logs.store import LogWriter

    writer = LogWriter(job_in("print('hi')\n").pk)
    tries: list[float] = []
    real = LogWriter._flush

    def away(self: LogWriter) -> None:
        tries.append(time.monotonic())
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(LogWriter, "_flush", away)
    writer.write_line("a line")
    writer.last_flush -= 1  # a flush is due
    backoffs = []
    for _ in range(6):
        with contextlib.suppress(OperationalError):
            writer.maybe_flush()
        backoffs.append(writer.backoff)
        writer.last_flush -= writer.backoff - 0.1
        writer.maybe_flush()  # 0.1 s short of the backoff: not tried
        writer.last_flush -= 0.1  # the backoff is over
    assert backoffs == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert len(tries) == 6
    monkeypatch.setattr(LogWriter, "_flush", real)
    writer.flush()
    assert writer.backoff == 0.0

"""A job the worker may not signal (JOB_USER without CAP_KILL): the supervisor says so and keeps
watching it. The real Supervisor runs in this process on a real subprocess; only
`portal.pids.send` answers "denied", as the kernel's EPERM does for another user's process."""

from __future__ import annotations

import logging
import signal

import pytest
from django.utils import timezone

from gpus.booking import reservation_create
from jobs.host.executors import local
from jobs.host.runner import job_run
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from portal import pids
from tests.job_helpers import job_log, job_process, kill_quietly

pytestmark = pytest.mark.django_db

# Waits for the test's go-ahead (a file), then ends by itself; a minute at most, in case the
# test broke: nothing else could stop it.
WAITER = """
import pathlib, time
release = pathlib.Path({release!r})
print("ready", flush=True)
deadline = time.monotonic() + 60
while not release.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
print("ending by myself", flush=True)
"""

# Leaves a process behind in its group and ends at once.
LEAVER = """
import subprocess
child = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("left", child.pid, flush=True)
"""


@pytest.fixture
def job_in(alice, box, settings, tmp_path):
    """Submit `source` on a booking of alice's, ready for job_run in this process."""
    settings.JOB_ROOTS = [tmp_path]
    settings.JOB_KILL_GRACE_SECONDS = 2
    settings.JOB_HEARTBEAT_SECONDS = 1
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)

    def submit(source: str) -> Job:
        upload = ScriptUpload(name="job.py", content=source.encode())
        return job_submit(user=alice, reservation=booking, script=upload)

    return submit


@pytest.fixture
def denied(monkeypatch) -> list[tuple[int, int]]:
    """Every signal to a live process is refused, as for a worker without CAP_KILL (and one to a
    process that is gone says so). Returns the (pid, signal) asked for."""
    calls: list[tuple[int, int]] = []

    def send(target: pids.ProcessId, sig: signal.Signals) -> pids.Sent:
        calls.append((target.pid, sig))
        return pids.Sent.DENIED if target.is_alive() else pids.Sent.GONE

    monkeypatch.setattr(pids, "send", send)
    return calls


def test_it_keeps_watching_a_job_it_may_not_stop_and_records_its_own_end(
    job_in, alice, denied, monkeypatch, tmp_path, caplog
):
    release = tmp_path / "release"
    job = job_in(WAITER.format(release=str(release)))
    # Asked right after the start (one asked before is never started): the first poll finds it.
    real_start = local.start_job_process

    def start_then_cancel(*args, **kwargs):  # type: ignore[no-untyped-def]
        proc = real_start(*args, **kwargs)
        Job.objects.filter(pk=job.pk).update(cancel_requested_at=timezone.now(), cancelled_by=alice)
        return proc

    monkeypatch.setattr(local, "start_job_process", start_then_cancel)
    refuse, seen = pids.send, {}

    def send(target: pids.ProcessId, sig: signal.Signals) -> pids.Sent:
        if sig == signal.SIGTERM:
            seen["term_at"] = timezone.now()
        elif sig == signal.SIGKILL and "row" not in seen:
            # The grace period is over and SIGKILL is about to be refused: how the job looks
            # now, and then it may end by itself.
            seen["row"] = Job.objects.values("status", "message", "heartbeat_at").get(pk=job.pk)
            release.touch()
        return refuse(target, sig)

    monkeypatch.setattr(pids, "send", send)
    with caplog.at_level(logging.WARNING, logger="jobs.host.runner"):
        assert job_run(job.pk) == Job.Status.CANCELLED

    job.refresh_from_db()
    running = seen["row"]
    assert running["status"] == Job.Status.RUNNING  # refused: not ended, still running
    assert running["message"] == (
        "Cancelled by alice. Could not stop: permission denied; the job is still running."
    )
    assert running["heartbeat_at"] > seen["term_at"]  # still supervised: heartbeats went on
    # Its one process, by identity; the final sweep finds nothing left (the leader exited).
    assert [sig for _, sig in denied] == [signal.SIGTERM, signal.SIGKILL]
    assert {pid for pid, _ in denied} == {job.pid}
    assert job.exit_code == 0  # it ended by itself
    assert (
        job.message
        == "Cancelled by alice. Could not stop: permission denied; it ran until it ended by itself."
    )
    log = job_log(job.pk)
    assert log.count("could not send SIGTERM: permission denied") == 1
    assert log.count("could not send SIGKILL: permission denied") == 1  # once, not on every tick
    # No order against the job's own last line: the job is released inside the refused send, so
    # it may print before the supervisor's loop writes the refusal (queued by its enforcer).
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w.split(" to ")[0] for w in warnings] == [
        f"Job {job.pk}: may not send SIGTERM",
        f"Job {job.pk}: may not send SIGKILL",
    ]


def test_it_says_what_a_finished_job_left_running_that_it_may_not_kill(job_in, denied):
    job = job_in(LEAVER)
    left = None
    try:
        assert job_run(job.pk) == Job.Status.SUCCEEDED  # the supervisor did not crash
        log = job_log(job.pk)
        left = job_process(int(log.split("left ", 1)[1].split()[0]), job.pk)
        assert left is not None, "what the job left is gone, yet nothing could stop it"
        job.refresh_from_db()
        assert job.exit_code == 0
        assert job.message == "Could not stop what it left running: permission denied."
        assert "the job left processes running that the worker may not kill: permission denied" in log
        assert [sig for _, sig in denied] == [signal.SIGKILL]
    finally:
        kill_quietly([left])

"""A preemptible job of the queue whose booking ends before its time limit (a loan, cut to the
end of the booking it borrows, jobs/lending.py) goes back to the queue when its supervisor meets
that end, never timed out: the scheduler's `loans_expire`, which asks it to leave a little before,
may be late (its pass held up, or this host's clock ahead of the portal's)."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from gpus.models import Allocation, Reservation
from jobs.host.checkpoints import checkpoint_name
from jobs.host.runner import job_run
from jobs.logs.store import log_stream
from jobs.models import Job
from jobs.queue.scheduler import schedule_pass
from jobs.submit import ScriptUpload
from tests.factories import queue_job
from tests.waiting import wait_for

SLEEPER = b"import time\nprint('sleeping', flush=True)\ntime.sleep(120)\n"


def _booking_ends_soon(job: Job, seconds: float) -> None:
    end = timezone.now() + timedelta(seconds=seconds)
    Reservation.objects.filter(pk=job.reservation_id).update(end=end, booked_end=end)
    Allocation.objects.filter(reservation_id=job.reservation_id).update(end=end)


@pytest.mark.django_db(transaction=True)
def test_a_preemptible_job_meeting_its_bookings_end_goes_back_to_the_queue(alice, box, settings):
    settings.JOB_KILL_GRACE_SECONDS = 1
    job = queue_job(alice, minutes=60, preemptible=True, script=ScriptUpload(name="s.py", content=SLEEPER))
    schedule_pass()
    job.refresh_from_db()
    _booking_ends_soon(job, 3)  # long before its 60 minutes: as a loan of a booking ending then
    outcome: list[str | None] = []
    runner = threading.Thread(target=lambda: outcome.append(job_run(job.pk)))
    runner.start()
    wait_for(lambda: b"sleeping" in b"".join(log_stream(job.pk)), timeout=30, what="the job to run")
    runner.join(timeout=30)

    assert outcome == [Job.Status.PENDING]
    job.refresh_from_db()
    assert (job.status, job.preemptions, job.exit_code) == (Job.Status.PENDING, 1, None)
    assert job.message.startswith("Preempted: its booking ended before its time limit.")
    assert (Path(settings.JOB_FOLDERS) / checkpoint_name(job)).is_dir()  # kept, to resume from


@pytest.mark.django_db(transaction=True)
def test_an_ordinary_job_meeting_its_bookings_end_still_times_out(alice, box, settings):
    settings.JOB_KILL_GRACE_SECONDS = 1
    job = queue_job(alice, minutes=60, script=ScriptUpload(name="s.py", content=SLEEPER))
    schedule_pass()
    job.refresh_from_db()
    _booking_ends_soon(job, 3)
    assert job_run(job.pk) == Job.Status.TIMED_OUT

"""Preemptible jobs (issue 36): submitted so, asked to leave, back in the queue at their old place.

The services and the end's record, called directly; tests/test_preemption_worker.py runs a real
preemptible Keras job through real workers."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.models import Reservation
from jobs.forms import JobForm
from jobs.host.checkpoints import (
    CHECKPOINT_LOST_KEEP,
    CHECKPOINT_VAR,
    PREEMPTIBLE_VAR,
    checkpoint_after,
    checkpoint_name,
    checkpoint_ready,
    checkpoint_remove,
    checkpoints_sweep,
)
from jobs.host.launch import Launch
from jobs.host.spool import EndRecord
from jobs.logs.store import LogWriter, log_stream
from jobs.models import Job
from jobs.preemption import PREEMPTED, job_preempt
from jobs.queue.scheduler import queue_plan, schedule_pass
from jobs.runs import job_end_record
from jobs.services import job_cancel
from portal.errors import Invalid
from tests.factories import queue_job

pytestmark = pytest.mark.django_db


def _log(job_id: int) -> str:
    return b"".join(log_stream(job_id)).decode()


def _started(job: Job) -> Job:
    schedule_pass()
    job.refresh_from_db()
    assert job.status == Job.Status.QUEUED, job.pending_reason
    return job


def _running(job: Job) -> Job:
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, started_at=timezone.now(), pid=4242)
    job.refresh_from_db()
    return job


# --- submitting -----------------------------------------------------------------------------------


def test_it_submits_a_preemptible_queued_job_through_the_api(alice, box):
    api = APIClient()
    api.force_authenticate(alice)
    response = api.post(
        "/api/v1/jobs/",
        {"script": SimpleUploadedFile("t.py", b"print(1)\n"), "gpu_count": 1, "preemptible": "true"},
        format="multipart",
    )
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["preemptible"], body["preemptions"], body["requeued_at"]) == (True, 0, None)
    assert Job.objects.get(pk=body["id"]).preemptible


def test_a_preemptible_job_on_a_booking_is_refused_beside_the_field_and_nothing_is_written(alice, box):
    """The API's multipart and the form as a browser posts it (the checkbox's "on" with the booking
    chosen): the form used to drop the box on a booking and run an ordinary job unasked."""
    booking = reservation_create(user=alice, gpus=[box[0].uuid])
    refused = "Only a queued job can be preemptible"
    api = APIClient()
    api.force_authenticate(alice)
    script = SimpleUploadedFile("t.py", b"1\n")
    asked = {"reservation": booking.pk, "script": script, "preemptible": "true"}
    answer = api.post("/api/v1/jobs/", asked, format="multipart")
    assert answer.status_code == 400 and refused in answer.json()["errors"]["preemptible"][0]
    browser = Client()
    browser.force_login(alice)
    script = SimpleUploadedFile("t.py", b"print(1)\n")
    form = {"reservation": booking.pk, "interpreter": "default", "preemptible": "on", "script": script}
    page = browser.post("/jobs/new/", form)
    assert page.status_code == 200 and refused in page.context["form"].errors["preemptible"][0]
    assert not Job.objects.exists()


def test_the_form_queues_a_preemptible_job(alice, box):
    form = JobForm(
        data={"gpu_count": "1", "interpreter": "default", "preemptible": "on", "script_path": ""},
        files={"script": SimpleUploadedFile("t.py", b"print(1)\n")},
        user=alice,
    )
    assert form.is_valid(), form.errors
    assert form.service_kwargs()["preemptible"] is True


def test_an_ordinary_job_is_not_preempted(alice, box, sent):
    job = _started(queue_job(alice))
    assert not job_preempt(job=job, reason="wanted back")
    job.refresh_from_db()
    assert job.status == Job.Status.QUEUED and job.preempt_requested_at is None


# --- leaving -------------------------------------------------------------------------------------


def test_a_booked_job_not_yet_sent_goes_back_at_once_keeping_its_place(alice, box, monkeypatch):
    monkeypatch.setattr("jobs.queue.scheduler.dispatch", lambda job, now: False)  # the broker is away
    job = _started(queue_job(alice, preemptible=True))
    booking = job.reservation_id
    submitted = job.created_at

    assert job_preempt(job=job, reason="the owner of booking 7 came back")

    job.refresh_from_db()
    assert (job.status, job.reservation, job.server, job.gpu_uuids) == (Job.Status.PENDING, None, None, [])
    assert job.preemptions == 1 and job.created_at == submitted  # its old place: its age is kept
    assert job.requeued_at is None  # it never ran: it waited all along
    assert job.message.startswith(f"{PREEMPTED} the owner of booking 7 came back.")
    assert Reservation.objects.get(pk=booking).released_at is not None
    assert "[portal] Preempted: the owner of booking 7 came back." in _log(job.pk)


def test_a_running_job_is_asked_to_leave_and_its_end_puts_it_back(alice, box, sent):
    job = _running(_started(queue_job(alice, preemptible=True)))
    booking = job.reservation_id

    assert job_preempt(job=job, reason="its cards are wanted back", grace_seconds=7)
    assert not job_preempt(job=job, reason="again")  # the first request stands
    job.refresh_from_db()
    assert job.status == Job.Status.RUNNING and job.preempt_grace_seconds == 7
    assert job.preempt_reason == "its cards are wanted back"

    # What the supervisor records once the process is gone (jobs/host/runner.py, `_record`).
    record = EndRecord(
        status=Job.Status.PENDING,
        exit_code=-15,
        message="Preempted: x.",
        finished_at=timezone.now().isoformat(),
    )
    assert job_end_record(job.pk, LogWriter(job.pk), record)
    job.refresh_from_db()
    assert (job.status, job.preemptions, job.pid, job.started_at, job.exit_code) == (
        "pending",
        1,
        None,
        None,
        None,
    )
    assert job.preempt_requested_at is None and job.finished_at is None and job.requeued_at is not None
    assert Reservation.objects.get(pk=booking).released_at is not None
    assert not job_end_record(job.pk, LogWriter(job.pk), record)  # once: a replay finds it done


def _left(job: Job, message: str = "Preempted: x.") -> bool:
    """What its supervisor records once the process is gone, having decided to requeue it."""
    record = EndRecord(
        status=Job.Status.PENDING, exit_code=-15, message=message, finished_at=timezone.now().isoformat()
    )
    return job_end_record(job.pk, LogWriter(job.pk), record)


def test_a_cancel_that_came_while_it_was_leaving_is_never_undone_by_its_requeue(alice, box, sent):
    """Its supervisor had decided to requeue it (preempted, or its worker shutting down) when its
    owner cancelled it: the cancel stands, it never goes back to the queue."""
    job = _running(_started(queue_job(alice, preemptible=True)))
    assert job_preempt(job=job, reason="its cards are wanted back")
    job_cancel(user=alice, job=job)  # during its grace: the supervisor no longer reads the row

    assert _left(job)
    job.refresh_from_db()
    assert (job.status, job.preemptions, job.message) == (Job.Status.CANCELLED, 0, "Cancelled by alice.")
    assert job.finished_at is not None and job.cancelled_by == alice
    assert not _left(job)  # once: a replay finds it done


def test_a_watchdog_stop_that_came_while_it_was_leaving_ends_it_as_failed(alice, box, sent):
    job = _running(_started(queue_job(alice, preemptible=True)))
    assert job_preempt(job=job, reason="its cards are wanted back")
    Job.objects.filter(pk=job.pk).update(watchdog_stop="Stopped by the watchdog: over its memory.")

    assert _left(job)
    job.refresh_from_db()
    assert (job.status, job.message) == (Job.Status.FAILED, "Stopped by the watchdog: over its memory.")


def test_an_earlier_runs_end_recorded_again_never_ends_the_run_after_it(alice, box, sent):
    """Its first run's end (back to the queue) stored twice, as after a retry whose answer was
    lost or a replay after a crash, while the job already runs again: the second run goes on."""
    job = _running(_started(queue_job(alice, preemptible=True)))
    assert job_preempt(job=job, reason="its cards are wanted back")
    record = EndRecord(
        status=Job.Status.PENDING,
        exit_code=-15,
        message="Preempted: x.",
        finished_at=timezone.now().isoformat(),
        run=job.dispatched_at.isoformat(),  # as its supervisor writes it (jobs/host/runner.py)
    )
    assert job_end_record(job.pk, LogWriter(job.pk), record)
    again = _running(_started(Job.objects.get(pk=job.pk)))
    assert again.dispatched_at != job.dispatched_at
    assert not job_end_record(job.pk, LogWriter(job.pk), record)
    again.refresh_from_db()
    assert (again.status, again.preemptions) == (Job.Status.RUNNING, 1) and again.reservation is not None


def test_a_requeued_job_keeps_its_place_ahead_of_later_submissions(alice, box, sent):
    """Its submit time, and so its age and its place among equal priorities, are kept (its owner's
    fair share counts the time it ran, as for any booking)."""
    first = _running(_started(queue_job(alice, gpus=4, preemptible=True)))
    later = queue_job(alice, gpus=4)
    job_preempt(job=first, reason="wanted back")
    record = EndRecord(
        status="pending", exit_code=None, message="Preempted.", finished_at=timezone.now().isoformat()
    )
    job_end_record(first.pk, LogWriter(first.pk), record)
    entries = queue_plan(now=timezone.now() + timedelta(seconds=1))
    assert [e.request.job_id for e in entries] == [first.pk, later.pk]
    schedule_pass()
    first.refresh_from_db()
    later.refresh_from_db()
    assert (first.status, later.status) == (Job.Status.QUEUED, Job.Status.PENDING)
    assert first.message == ""  # the preemption's words go once it runs again


# --- its checkpoint folder -------------------------------------------------------------------------


def _launch() -> Launch:
    return Launch(argv=["python"], env={"PATH": "/bin"}, cwd=Path("/tmp"), env_applied={}, account=None)


def test_a_preemptible_job_keeps_one_checkpoint_folder_across_its_runs(alice, box):
    job = queue_job(alice, preemptible=True)
    first = checkpoint_ready(_launch(), job)
    folder = Path(first.env[CHECKPOINT_VAR])
    assert first.env[PREEMPTIBLE_VAR] == "1" and first.env_applied[CHECKPOINT_VAR] == str(folder)
    assert folder.name == checkpoint_name(job) and folder.is_dir()
    (folder / "state").write_text("epoch 3")

    again = checkpoint_ready(_launch(), job)
    assert again.env[CHECKPOINT_VAR] == str(folder) and (folder / "state").read_text() == "epoch 3"


def test_an_ordinary_job_gets_no_checkpoint_folder(alice, box):
    launch = checkpoint_ready(_launch(), queue_job(alice))
    assert PREEMPTIBLE_VAR not in launch.env and CHECKPOINT_VAR not in launch.env


def test_a_checkpoint_folder_that_is_a_link_is_never_followed(alice, box, tmp_path, settings):
    job = queue_job(alice, preemptible=True)
    Path(settings.JOB_FOLDERS).mkdir(parents=True, exist_ok=True)  # made by the first job folder
    (Path(settings.JOB_FOLDERS) / checkpoint_name(job)).symlink_to(tmp_path)
    with pytest.raises(Exception, match="checkpoint folder"):
        checkpoint_ready(_launch(), job)


def test_a_checkpoint_folder_stays_while_its_job_is_requeued_and_goes_when_it_ends(alice, box, settings):
    job = queue_job(alice, preemptible=True)
    folder = Path(checkpoint_ready(_launch(), job).env[CHECKPOINT_VAR])
    (folder / "state").write_text("epoch 3")
    (folder / "elsewhere").symlink_to(settings.JOB_FOLDERS)  # never followed by the removal
    other_database = Path(settings.JOB_FOLDERS) / f"checkpoint-{job.pk}-20200101000000000000"
    other_database.mkdir()

    Job.objects.filter(pk=job.pk).update(status=Job.Status.PENDING, preemptions=1)  # requeued
    assert checkpoints_sweep() == 0 and (folder / "state").exists()
    Job.objects.filter(pk=job.pk).update(status=Job.Status.CANCELLED)  # cancelled while it waited
    assert checkpoints_sweep() == 1
    assert not folder.exists() and other_database.is_dir() and Path(settings.JOB_FOLDERS).is_dir()
    assert checkpoints_sweep() == 0


def test_a_lost_jobs_checkpoint_folder_stays_while_its_worker_may_still_requeue_it(alice, box, sent):
    """Marked lost while its worker was out of touch, a preempted job may still come back to the
    queue when that worker's spool records its end: its folder stays for CHECKPOINT_LOST_KEEP."""
    job = _running(_started(queue_job(alice, preemptible=True)))
    folder = Path(checkpoint_ready(_launch(), job).env[CHECKPOINT_VAR])
    (folder / "state").write_text("epoch 3")
    job_preempt(job=job, reason="its cards are wanted back")
    Job.objects.filter(pk=job.pk).update(status=Job.Status.LOST, finished_at=timezone.now())

    assert checkpoints_sweep() == 0 and (folder / "state").exists()
    assert _left(job)  # the spool's replay: back to the queue, its checkpoint there to resume from
    job.refresh_from_db()
    assert job.status == Job.Status.PENDING and (folder / "state").exists()

    long_ago = timezone.now() - CHECKPOINT_LOST_KEEP - timedelta(minutes=1)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.LOST, finished_at=long_ago)
    assert checkpoints_sweep() == 1 and not folder.exists()


def test_the_supervisor_removes_the_folder_of_a_job_that_ended_for_good(alice, box):
    job = queue_job(alice, preemptible=True)
    folder = Path(checkpoint_ready(_launch(), job).env[CHECKPOINT_VAR])
    assert checkpoint_remove(job) and not folder.exists()
    assert not checkpoint_remove(job)  # nothing left: said, never raised


def test_a_job_cancelled_while_it_was_leaving_loses_its_folder_at_once(alice, box, sent):
    """Its supervisor sent it back to the queue, but its owner's cancel in the grace made the
    stored end a cancel: its folder goes with the end, not at the next sweep."""
    job = _running(_started(queue_job(alice, preemptible=True)))
    folder = Path(checkpoint_ready(_launch(), job).env[CHECKPOINT_VAR])
    assert job_preempt(job=job, reason="its cards are wanted back")
    job_cancel(user=alice, job=job)
    assert _left(job)
    checkpoint_after(job, Job.Status.PENDING)  # what the supervisor decided
    assert Job.objects.get(pk=job.pk).status == Job.Status.CANCELLED and not folder.exists()


def test_a_requeued_jobs_folder_stays(alice, box, sent):
    job = _running(_started(queue_job(alice, preemptible=True)))
    folder = Path(checkpoint_ready(_launch(), job).env[CHECKPOINT_VAR])
    assert job_preempt(job=job, reason="its cards are wanted back") and _left(job)
    checkpoint_after(job, Job.Status.PENDING)
    assert folder.is_dir()


def test_the_service_refuses_preemptible_on_a_booking(alice, box):
    from jobs.submit import ScriptUpload, job_submit

    booking = reservation_create(user=alice, gpus=[box[1].uuid])
    with pytest.raises(Invalid) as refused:
        job_submit(user=alice, reservation=booking, script=ScriptUpload("t.py", b"1\n"), preemptible=True)
    assert refused.value.field == "preemptible"

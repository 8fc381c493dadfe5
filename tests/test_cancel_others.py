"""Someone else's booking or job ended by a leader or an admin (issue 41): the reason asked for
on the confirm page before anything stops, the owner told who, why and what stopped, the audit
log too. The job's own end (cancelled, naming who and why) is tests/test_runner_session.py's and,
in a browser with a real worker, tests/test_cancel_others_browser.py's."""

from __future__ import annotations

import html
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_cancel
from gpus.models import Reservation
from jobs.host.runner import job_run
from jobs.models import Job
from jobs.runs import CANCELLED_FIELDS, cancelled_words
from jobs.services import job_cancel
from jobs.submit import ScriptUpload, job_submit
from portal.errors import Conflict
from portal.models import AuditEntry, Notification
from tests.job_helpers import job_log

pytestmark = pytest.mark.django_db
Kind = Notification.Kind
JOB_CANCEL = AuditEntry.Action.JOB_CANCEL


def _job(alice, booking, name: str = "train.py") -> Job:
    return job_submit(user=alice, reservation=booking, script=ScriptUpload(name=name, content=b"print(1)\n"))


def _nothing_written(booking: Reservation) -> None:
    booking.refresh_from_db()
    assert booking.cancelled_at is None and booking.released_at is None
    assert not Notification.objects.exists()
    assert not AuditEntry.objects.filter(action=AuditEntry.Action.RESERVATION_CANCEL).exists()


# --- the owner is told -----------------------------------------------------------------------------


def test_a_leaders_cancel_tells_the_owner_who_why_and_what_it_stops(alice, leader, booking, sent):
    job = _job(alice, booking)
    reservation_cancel(user=leader, reservation=booking, reason="paper deadline")
    told = Notification.objects.get(user=alice)
    assert told.kind == Kind.BOOKING_RELEASED and told.url == f"/reservations/{booking.pk}/"
    assert told.subject == f"leader cancelled your booking {booking.pk}: paper deadline"
    assert "Why: paper deadline" in told.body and f"job {job.pk} (train.py), queued" in told.body
    assert told.mail_status == Notification.Mail.QUEUED  # booking_released is mailed by default
    audit = AuditEntry.objects.get(action=AuditEntry.Action.RESERVATION_CANCEL)
    assert audit.actor == leader and "paper deadline" in audit.message
    assert f"job {job.pk} (train.py), queued" in audit.message


def test_an_admins_cancel_of_an_upcoming_booking_tells_the_owner_too(alice, admin_user, box, t0):
    from gpus.booking import reservation_create

    upcoming = reservation_create(user=alice, gpus=[box[1].uuid], start=t0, end=t0 + timedelta(hours=1))
    reservation_cancel(user=admin_user, reservation=upcoming, reason="maintenance")
    told = Notification.objects.get(user=alice)
    assert "admin cancelled your upcoming booking" in told.body and "Nothing ran on it." in told.body


def test_the_owners_own_cancel_tells_nobody(alice, booking, sent):
    _job(alice, booking)
    reservation_cancel(user=alice, reservation=booking)
    assert not Notification.objects.exists()


def test_a_leaders_job_cancel_tells_the_owner_and_the_audit_log(alice, leader, booking, sent):
    job = _job(alice, booking)
    job_cancel(user=leader, job=job, reason="blocking the demo")
    told = Notification.objects.get(user=alice)
    assert told.kind == Kind.JOB_STOPPED and told.url == f"/jobs/{job.pk}/"
    assert told.subject == f"leader cancelled your job {job.pk} (train.py): blocking the demo"
    assert "Why: blocking the demo" in told.body
    assert "It never started" in told.body and "SIGTERM" not in told.body  # it was queued
    audit = AuditEntry.objects.get(action=AuditEntry.Action.JOB_CANCEL)
    assert (audit.actor, audit.target) == (leader, f"job {job.pk}")
    assert audit.message == f"leader cancelled job {job.pk} (train.py) of alice: blocking the demo"
    job.refresh_from_db()
    assert job.message == "Cancelled by leader before it started: blocking the demo."
    assert job.message in job_log(job.pk)
    Notification.objects.all().delete()
    job_cancel(user=alice, job=_job(alice, booking, "mine.py"))
    assert not Notification.objects.exists()


def test_a_running_job_a_leader_cancels_ends_saying_who_and_why(alice, leader, booking, sent):
    job = _job(alice, booking)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, started_at=timezone.now())
    job_cancel(user=leader, job=job, reason="blocking the demo")
    told = Notification.objects.get(user=alice)
    assert "gets SIGTERM, then SIGKILL" in told.body and "saying leader cancelled it and why" in told.body
    # What its supervisor reads and records as it stops it (jobs.host.runner).
    row = Job.objects.filter(pk=job.pk).values(*CANCELLED_FIELDS).get()
    assert cancelled_words(row) == "Cancelled by leader: blocking the demo."


@pytest.mark.parametrize("first", ["alice", "leader"])
def test_a_second_cancel_of_a_running_job_says_who_asked_first(
    request, first, alice, leader, admin_user, booking, sent
):
    job = _job(alice, booking)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, started_at=timezone.now())
    job_cancel(user=request.getfixturevalue(first), job=job, reason="first")
    told = list(Notification.objects.values_list("pk", flat=True))
    audited = AuditEntry.objects.count()
    second = leader if first == "alice" else admin_user
    api = APIClient()
    api.force_authenticate(second)
    answer = api.post(f"/api/v1/jobs/{job.pk}/cancel/", {"reason": "second"}, format="json")
    assert answer.status_code == 409 and f"already being cancelled by {first}" in answer.json()["detail"]
    with pytest.raises(Conflict, match=f"already being cancelled by {first}"):
        job_cancel(user=second, job=job, reason="second")
    assert list(Notification.objects.values_list("pk", flat=True)) == told
    assert AuditEntry.objects.count() == audited
    job.refresh_from_db()
    assert (job.cancelled_by.username, job.cancel_reason) == (first, "first")  # what its end says


def test_a_queued_jobs_booking_cancel_says_it_never_starts(alice, leader, booking, sent):
    _job(alice, booking)
    reservation_cancel(user=leader, reservation=booking, reason="paper deadline")
    body = Notification.objects.get(user=alice).body
    assert "A queued job never starts: it ends cancelled, saying who cancelled the booking and why." in body
    assert "SIGTERM" not in body


def test_a_job_a_worker_claims_after_its_booking_was_cancelled_says_who_and_why(
    alice, leader, booking, sent, settings
):
    settings.GPU_BACKEND = "simulated"
    job = _job(alice, booking)
    reservation_cancel(user=leader, reservation=booking, reason="paper deadline")
    assert job_run(job.pk) == Job.Status.CANCELLED  # sent to its host before the cancel, claimed after
    job.refresh_from_db()
    assert job.message.startswith("Cancelled: leader cancelled the booking at"), job.message
    assert job.message.endswith("(paper deadline).")


# --- a job's cancel: the reason asked before anything stops ----------------------------------------


def test_the_job_page_asks_a_leader_for_the_reason_and_refuses_an_empty_one(
    client, alice, leader, booking, sent
):
    job = _job(alice, booking)
    client.force_login(leader)
    url = f"/jobs/{job.pk}/cancel/"
    assert "Cancel alice's job…" in client.get(f"/jobs/{job.pk}/").content.decode()

    # From the job's page: the confirm step names the job and asks for the reason, refusing nothing yet.
    asked = client.post(url)
    page = html.unescape(asked.content.decode())
    assert asked.status_code == 200 and f"Cancel alice's job {job.pk}?" in page
    assert f"job {job.pk} (train.py), queued" in page and 'name="reason"' in page
    assert "It has not started: it never will" in page and "Give a reason" not in page

    # Confirmed with no reason: refused beside the field, nothing stopped, nobody told.
    for empty in ("", "  "):
        refused = client.post(url, {"reason": empty, "confirm": "1"})
        assert refused.status_code == 400 and "Give a reason: alice will see it." in refused.content.decode()
        assert 'id="id_reason_error"' in refused.content.decode() or "errorlist" in refused.content.decode()
    assert Job.objects.get(pk=job.pk).status == Job.Status.QUEUED
    assert not Notification.objects.exists() and not AuditEntry.objects.filter(action=JOB_CANCEL).exists()

    done = client.post(url, {"reason": "blocking the demo", "confirm": "1"})
    assert done.status_code == 302
    job.refresh_from_db()
    assert (job.status, job.cancelled_by, job.cancel_reason) == (
        Job.Status.CANCELLED,
        leader,
        "blocking the demo",
    )
    assert "blocking the demo" in Notification.objects.get(user=alice).body


def test_the_job_page_says_who_asked_first_and_offers_no_second_cancel(client, alice, leader, booking, sent):
    job = _job(alice, booking)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, started_at=timezone.now())
    job_cancel(user=alice, job=job)
    client.force_login(leader)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "cancel requested" in page and "Cancel alice's job" not in page
    again = client.post(f"/jobs/{job.pk}/cancel/", {"reason": "x", "confirm": "1"}, follow=True)
    assert f"Job {job.pk} is already being cancelled by alice" in again.content.decode()
    assert not Notification.objects.exists() and not AuditEntry.objects.filter(action=JOB_CANCEL).exists()


def test_a_double_click_on_cancel_is_news_not_a_failure(client, alice, booking, sent):
    job = _job(alice, booking)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, started_at=timezone.now())
    client.force_login(alice)
    first = client.post(f"/jobs/{job.pk}/cancel/", follow=True).content.decode()
    asked_at = Job.objects.get(pk=job.pk).cancel_requested_at
    second = client.post(f"/jobs/{job.pk}/cancel/", follow=True).content.decode()
    assert 'class="message success"' in first
    assert f'class="message info" role="status">Job {job.pk} is already being cancelled by alice' in second
    assert 'class="message error"' not in second
    assert asked_at is not None and Job.objects.get(pk=job.pk).cancel_requested_at == asked_at  # asked once


def test_the_api_refuses_a_job_cancel_without_a_reason_naming_the_field(alice, leader, booking, sent):
    job = _job(alice, booking)
    api = APIClient()
    api.force_authenticate(leader)
    for body in ({}, {"reason": " "}):
        answer = api.post(f"/api/v1/jobs/{job.pk}/cancel/", body, format="json")
        assert answer.status_code == 400, answer.json()
        assert answer.json()["errors"]["reason"] == ["Give a reason: alice will see it."]
    assert Job.objects.get(pk=job.pk).status == Job.Status.QUEUED
    assert not Notification.objects.exists() and not AuditEntry.objects.filter(action=JOB_CANCEL).exists()


# --- the reason, asked before anything stops ----------------------------------------------------


def test_the_confirm_page_asks_a_leader_for_the_reason_and_refuses_an_empty_one(
    client, alice, leader, booking, sent
):
    job = _job(alice, booking)
    client.force_login(leader)
    url = f"/reservations/{booking.pk}/cancel/"

    # No reason on the booking's page: the confirm page asks for it, beside its field.
    asked = client.post(url, {"reason": ""})
    page = html.unescape(asked.content.decode())
    assert asked.status_code == 400 and f"job {job.pk} (train.py), queued" in page
    assert 'name="reason"' in page and "Give a reason: alice will see it." in page
    assert 'type="hidden" name="reason"' not in page
    _nothing_written(booking)

    # Confirmed with the reason still empty: refused again, nothing stopped.
    refused = client.post(url, {"reason": "  ", "confirm": "1"})
    assert refused.status_code == 400 and "Give a reason: alice will see it." in refused.content.decode()
    _nothing_written(booking)

    # A reason given on the booking's page is shown on the confirm page, to change or confirm.
    asked = client.post(url, {"reason": "paper deadline"})
    assert asked.status_code == 200 and 'value="paper deadline"' in asked.content.decode()
    _nothing_written(booking)

    done = client.post(url, {"reason": "paper deadline", "confirm": "1"})
    assert done.status_code == 302
    booking.refresh_from_db()
    assert booking.cancelled_by == leader and booking.cancel_reason == "paper deadline"


def test_with_nothing_running_an_empty_reason_is_refused_beside_the_field(client, alice, leader, booking):
    client.force_login(leader)
    refused = client.post(f"/reservations/{booking.pk}/cancel/", {"reason": ""})
    page = refused.content.decode()
    assert refused.status_code == 400 and "Give a reason: alice will see it." in page
    assert 'id="id_reason_error"' in page or "errorlist" in page
    _nothing_written(booking)


def test_the_api_refuses_an_empty_reason_naming_the_field(alice, leader, booking, sent):
    _job(alice, booking)
    api = APIClient()
    api.force_authenticate(leader)
    for response in (
        api.delete(f"/api/v1/reservations/{booking.pk}/"),
        api.post(f"/api/v1/reservations/{booking.pk}/cancel/", {"reason": " "}, format="json"),
    ):
        assert response.status_code == 400, response.json()
        assert response.json()["errors"]["reason"] == ["Give a reason: alice will see it."]
    _nothing_written(booking)


# --- a whole array from its page ---------------------------------------------------------------------


def test_the_owner_cancels_a_whole_array_from_a_tasks_page(client, alice, box):
    from tests.factories import queue_job

    first = queue_job(alice, array="0-2")
    client.force_login(alice)
    page = client.get(f"/jobs/{first.pk}/").content.decode()
    assert f"Cancel all 3 unfinished tasks of array {first.array_id}" in page
    done = client.post(f"/jobs/{first.pk}/cancel/", {"whole_array": "1"}, follow=True).content.decode()
    assert f"Cancel requested for 3 tasks of job array {first.array_id}" in done
    assert set(Job.objects.filter(array_id=first.array_id).values_list("status", flat=True)) == {"cancelled"}


def test_a_leader_cancels_someones_array_only_with_a_reason_the_owner_reads(client, alice, leader, box):
    from tests.factories import queue_job

    first = queue_job(alice, array="0-2")
    client.force_login(leader)
    page = client.get(f"/jobs/{first.pk}/").content.decode()
    assert f"Cancel alice's 3 unfinished tasks of array {first.array_id}…" in page
    asked = client.post(f"/jobs/{first.pk}/cancel/", {"whole_array": "1"})
    assert asked.status_code == 200
    assert f"Cancel alice's job array {first.array_id}?" in asked.content.decode()
    refused = client.post(f"/jobs/{first.pk}/cancel/", {"whole_array": "1", "confirm": "1", "reason": ""})
    assert refused.status_code == 400 and 'name="whole_array"' in refused.content.decode()
    assert not Job.objects.filter(status="cancelled").exists()  # nothing stopped before the reason
    why = "the cluster is needed for the demo"
    client.post(f"/jobs/{first.pk}/cancel/", {"whole_array": "1", "confirm": "1", "reason": why})
    tasks = Job.objects.filter(array_id=first.array_id)
    assert {(t.status, t.cancel_reason) for t in tasks} == {("cancelled", why)}
    assert why in Notification.objects.get(user=alice).body


def test_a_double_click_on_a_waiting_jobs_cancel_is_news_not_a_failure(client, alice, booking, sent):
    # The first click ends a job no worker has started at once; the second finds it cancelled.
    job = _job(alice, booking)
    client.force_login(alice)
    first = client.post(f"/jobs/{job.pk}/cancel/", follow=True).content.decode()
    second = client.post(f"/jobs/{job.pk}/cancel/", follow=True).content.decode()
    assert 'class="message success"' in first and Job.objects.get(pk=job.pk).status == Job.Status.CANCELLED
    assert f'class="message info" role="status">Job {job.pk} is already cancelled' in second
    assert 'class="message error"' not in second


def test_a_tasks_page_offers_the_arrays_other_task_while_its_own_cancel_is_under_way(client, alice, box):
    from tests.factories import queue_job

    first = queue_job(alice, array="0-1")
    now = timezone.now()
    Job.objects.filter(pk=first.pk).update(status=Job.Status.RUNNING, started_at=now, cancel_requested_at=now)
    client.force_login(alice)
    page = client.get(f"/jobs/{first.pk}/").content.decode()
    assert f"Cancel all 1 unfinished task of array {first.array_id}" in page

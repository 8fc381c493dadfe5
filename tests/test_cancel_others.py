"""Someone else's booking or job ended by a leader or an admin (issue 41): the reason asked for
on the confirm page before anything stops, the owner told who, why and what stopped, the audit
log too. The job's own end (cancelled, naming who and why) is tests/test_runner_session.py's and,
in a browser with a real worker, tests/test_cancel_others_browser.py's."""

from __future__ import annotations

import html
from datetime import timedelta

import pytest
from rest_framework.test import APIClient

from gpus.booking import reservation_cancel
from gpus.models import Reservation
from jobs.models import Job
from jobs.services import job_cancel
from jobs.submit import ScriptUpload, job_submit
from portal.models import AuditEntry, Notification

pytestmark = pytest.mark.django_db
Kind = Notification.Kind


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
    job_cancel(user=leader, job=job)
    told = Notification.objects.get(user=alice)
    assert told.kind == Kind.JOB_STOPPED and told.url == f"/jobs/{job.pk}/"
    assert told.subject == f"leader cancelled your job {job.pk} (train.py)"
    audit = AuditEntry.objects.get(action=AuditEntry.Action.JOB_CANCEL)
    assert (audit.actor, audit.target) == (leader, f"job {job.pk}")
    assert audit.message == f"leader cancelled job {job.pk} (train.py) of alice"
    Notification.objects.all().delete()
    job_cancel(user=alice, job=_job(alice, booking, "mine.py"))
    assert not Notification.objects.exists()


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

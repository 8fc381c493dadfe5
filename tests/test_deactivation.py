"""A deactivated user's work: nothing of theirs starts, and what they had is stopped, saying why.

Deactivating through save() (the admin's form, the shell, a directory sync) stops the work at once
(jobs/signals.py); a deactivation written with QuerySet.update(), which sends no signal, is how these
tests reach the checks at each start (scheduler, dispatch, reconciler, claim) and the reconciler's
sweep on their own."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from html.parser import HTMLParser

import pytest
import redis
from django.contrib.auth import get_user_model
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.models import Reservation
from jobs.host.launch import job_claim
from jobs.host.runner import Supervisor, job_run
from jobs.leavers import user_work_stop
from jobs.logs import live as log_live
from jobs.logs.store import log_stream
from jobs.models import Job
from jobs.queue.scheduler import queue_plan, schedule_pass
from jobs.services import dispatch, jobs_reconcile
from jobs.submit import ScriptUpload, job_submit
from portal import changes
from portal.models import AuditEntry, Membership, Notification

User = get_user_model()
H = timedelta(hours=1)
REASON = "alice's account was deactivated"


def _upload(source: bytes = b"print('hi')\n") -> ScriptUpload:
    return ScriptUpload(name="train.py", content=source)


def _queue(user, gpus: int = 1) -> Job:
    return job_submit(user=user, reservation=None, gpu_count=gpus, time_limit_minutes=60, script=_upload())


def _on(user, booking, source: bytes = b"print('hi')\n") -> Job:
    return job_submit(user=user, reservation=booking, script=_upload(source))


def _log(job: Job) -> str:
    return b"".join(log_stream(job.pk)).decode()


def _deactivate_quietly(user) -> None:
    """As a bulk update or SQL would: no save(), so no signal."""
    User.objects.filter(pk=user.pk).update(is_active=False)


# --- nothing of a deactivated user's starts -----------------------------------------------------------


def test_the_scheduler_does_not_start_a_pending_job_of_a_deactivated_owner(
    alice, bob, box, sent, django_capture_on_commit_callbacks
):
    theirs, other = _queue(alice), _queue(bob)
    _deactivate_quietly(alice)

    assert [e.request.job_id for e in queue_plan()] == [other.pk]
    with django_capture_on_commit_callbacks(execute=True):
        schedule_pass()

    theirs.refresh_from_db()
    assert theirs.status == Job.Status.PENDING and theirs.reservation is None
    assert sent == [(other.pk, "host.box1")]


def test_dispatch_and_the_reconciler_do_not_start_a_queued_job_of_a_deactivated_owner(
    alice, leader, box, sent, t0, django_capture_on_commit_callbacks
):
    upcoming = reservation_create(user=alice, gpus=[box[0].uuid], start=t0, end=t0 + H)
    job = _on(alice, upcoming)
    assert job.status == Job.Status.QUEUED and job.dispatched_at is None
    _deactivate_quietly(alice)

    assert dispatch(job, t0) is False
    with django_capture_on_commit_callbacks(execute=True):
        done = jobs_reconcile(now=t0)

    assert sent == []
    assert done["dispatched"] == 0 and done["leavers"] == 1  # the sweep found the quiet deactivation
    job.refresh_from_db()
    assert job.status == Job.Status.CANCELLED and job.message == f"Cancelled: {REASON}."
    assert f"[portal] Cancelled: {REASON}." in _log(job)
    assert Reservation.objects.get(pk=upcoming.pk).released_at == t0  # it began at t0: released
    assert Notification.objects.filter(user=leader).count() == 1
    assert jobs_reconcile(now=t0)["leavers"] == 0  # nothing left: nothing done, nobody told twice
    assert Notification.objects.filter(user=leader).count() == 1


def test_the_worker_refuses_to_claim_a_job_of_a_deactivated_owner(alice, leader, box, sent):
    booking = reservation_create(user=alice, gpus=[box[0].uuid])
    job = _on(alice, booking)
    _deactivate_quietly(alice)

    assert job_claim(job.pk) is None
    assert job_run(job.pk) is None  # a second delivery: nothing to do

    job.refresh_from_db()
    assert (job.status, job.worker, job.started_at) == (Job.Status.CANCELLED, "", None)
    assert job.message == f"Cancelled: {REASON}."
    assert f"Cancelled: {REASON}. The job never started." in _log(job)
    # With the rest of their work: the booking ended, the audit log and the leader told.
    assert Reservation.objects.get(pk=booking.pk).released_at is not None
    assert AuditEntry.objects.filter(target="user alice", data__cancelled=[job.pk]).exists()
    assert Notification.objects.get(user=leader).kind == Notification.Kind.JOB_STOPPED


# --- deactivating stops what they had -----------------------------------------------------------------


def test_deactivating_a_user_cancels_their_jobs_and_bookings_and_tells_their_leaders(
    alice, bob, leader, box, sent, t0, django_capture_on_commit_callbacks
):
    active = reservation_create(user=alice, gpus=[box[0].uuid])
    running = _on(alice, active)
    Job.objects.filter(pk=running.pk).update(status=Job.Status.RUNNING, worker="gpu1")
    upcoming = reservation_create(user=alice, gpus=[box[1].uuid], start=t0, end=t0 + H)
    queued = _on(alice, upcoming)
    pending = _queue(alice)
    bobs = _queue(bob)
    sent.clear()

    alice.is_active = False
    with django_capture_on_commit_callbacks(execute=True):
        alice.save()

    pending.refresh_from_db(), queued.refresh_from_db(), running.refresh_from_db(), bobs.refresh_from_db()
    for job in (pending, queued):
        assert job.status == Job.Status.CANCELLED and job.message == f"Cancelled: {REASON}."
        assert f"[portal] Cancelled: {REASON}. The job never started." in _log(job)
    # Running: asked to stop through the cancel path; its worker stops it and records it cancelled.
    assert running.status == Job.Status.RUNNING and running.cancel_requested_at is not None
    assert running.cancelled_by is None and running.message == f"Cancelled: {REASON}."
    assert bobs.status == Job.Status.PENDING  # nobody else's

    upcoming.refresh_from_db(), active.refresh_from_db()
    assert upcoming.cancelled_at is not None and upcoming.cancel_reason == REASON
    assert upcoming.cancelled_by is None
    assert active.released_at is not None and active.end <= timezone.now()

    audit = {e.target: e for e in AuditEntry.objects.filter(actor=None, data__by="portal")}
    assert audit[f"reservation {upcoming.pk}"].action == AuditEntry.Action.RESERVATION_CANCEL
    assert audit[f"reservation {active.pk}"].action == AuditEntry.Action.RESERVATION_RELEASE
    assert all(REASON in audit[f"reservation {b.pk}"].message for b in (upcoming, active))
    jobs_entry = audit["user alice"]
    assert sorted(jobs_entry.data["cancelled"]) == sorted([pending.pk, queued.pk])
    assert jobs_entry.data["stopping"] == [running.pk] and jobs_entry.team_id == alice.teams.get().pk
    assert REASON in jobs_entry.message

    told = Notification.objects.get()
    assert told.user == leader and told.kind == Notification.Kind.JOB_STOPPED
    assert REASON in told.subject and told.url == "/jobs/history/?user=alice"
    for pk in (pending.pk, queued.pk, running.pk, upcoming.pk, active.pk):
        assert str(pk) in told.body
    assert told.mail_status == Notification.Mail.QUEUED

    # Saved again while inactive, or its work stopped again: nothing more happens, nobody is told twice.
    alice.save()
    assert not user_work_stop(user=alice, reason=REASON)
    assert Notification.objects.count() == 1 and sent == []
    with django_capture_on_commit_callbacks(execute=True):
        schedule_pass()
    assert sent == [(bobs.pk, "host.box1")]  # alice's bookings freed the cards; bob's job starts


def test_a_running_job_of_a_deactivated_user_is_stopped_by_its_worker_saying_why(
    alice, box, settings, tmp_path, monkeypatch
):
    settings.JOB_ROOTS = [tmp_path]
    settings.JOB_KILL_GRACE_SECONDS = 2
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    job = _on(alice, booking, b"import time\nprint('training', flush=True)\ntime.sleep(60)\n")
    real_check = Supervisor._check_row

    def deactivate_then_check(self, beat):  # the first look at the row, with the job running
        user = User.objects.get(pk=alice.pk)
        if user.is_active:
            user.is_active = False
            user.save()
        return real_check(self, beat)

    monkeypatch.setattr(Supervisor, "_check_row", deactivate_then_check)
    assert job_run(job.pk) == Job.Status.CANCELLED

    job.refresh_from_db()
    assert job.message == f"Cancelled: {REASON}." and job.started_at is not None
    assert f"[portal] Cancelled: {REASON}. Sending SIGTERM" in _log(job)
    assert Reservation.objects.get(pk=booking.pk).released_at is not None


class _FormFields(HTMLParser):
    """The fields a browser would post from a page's forms, as rendered."""

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, list[str]] = {}
        self._select: str | None = None
        self._textarea: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        name = a.get("name")
        if tag == "input" and name and a.get("type") not in ("submit", "button", "file"):
            if a.get("type") in ("checkbox", "radio") and "checked" not in a:
                return
            self.data.setdefault(name, []).append(
                a.get("value") or ("on" if a.get("type") == "checkbox" else "")
            )
        elif tag == "select" and name:
            self._select = name
            self.data.setdefault(name, [])
        elif tag == "option" and self._select and "selected" in a:
            self.data[self._select].append(a.get("value") or "")
        elif tag == "textarea" and name:
            self._textarea = name
            self.data[name] = [""]

    def handle_data(self, data: str) -> None:
        if self._textarea:
            self.data[self._textarea][0] += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "select":
            self._select = None
        elif tag == "textarea":
            self._textarea = None


def test_unticking_active_in_the_admin_form_stops_their_work(client, admin_user, alice, leader, box, sent):
    pending = _queue(alice)
    client.force_login(admin_user)
    url = reverse("admin:auth_user_change", args=[alice.pk])
    fields = _FormFields()
    fields.feed(client.get(url).content.decode())
    assert fields.data.pop("is_active") == ["on"]

    response = client.post(url, fields.data)

    assert response.status_code == 302, response.content.decode()[:2000]
    alice.refresh_from_db(), pending.refresh_from_db()
    assert not alice.is_active
    assert pending.status == Job.Status.CANCELLED and pending.message == f"Cancelled: {REASON}."
    assert Notification.objects.filter(user=leader, kind=Notification.Kind.JOB_STOPPED).count() == 1


# --- sign-in -----------------------------------------------------------------------------------------


def test_a_deactivated_users_session_and_api_token_stop_working(client, alice):
    """Already so before this fix (ModelBackend, portal.tokens): kept so that it stays so."""
    from portal.services import api_token_create

    client.force_login(alice)
    session_api = APIClient()
    session_api.force_login(alice)
    _, key = api_token_create(user=alice, name="ci", expires_at=None)
    token_api = APIClient()
    token_api.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    assert client.get(reverse("my_jobs")).status_code == 200
    assert session_api.get("/api/v1/jobs/").status_code == 200
    assert token_api.get("/api/v1/jobs/").status_code == 200

    alice.is_active = False
    alice.save()

    page = client.get(reverse("my_jobs"))
    assert page.status_code == 302 and page.url.startswith(reverse("login"))
    assert session_api.get("/api/v1/jobs/").status_code in (401, 403)
    assert token_api.get("/api/v1/jobs/").status_code == 401


def test_the_stopped_jobs_are_named_once_each_however_many(alice, leader, box, sent):
    """An array's thousand tasks make one short line, not a thousand."""
    job_submit(
        user=alice, reservation=None, gpu_count=1, time_limit_minutes=60, script=_upload(), array="0-49"
    )
    stopped = user_work_stop(user=alice, reason=REASON)
    assert len(stopped.cancelled) == 50
    body = Notification.objects.get(user=leader).body
    assert "50 jobs (" in body and "and 40 more" in body and len(body) < 1000


# --- the pages showing them update ----------------------------------------------------------------


class Published:
    """What jobs.logs.live.job_changed publishes, read back from real Redis: each job's own channel
    (its page) and the change feed (the lists of jobs), on a portal id of this test's own."""

    def __init__(self, settings, jobs: list[Job]) -> None:  # type: ignore[no-untyped-def]
        settings.PORTAL_INSTANCE_ID = f"test-{os.getpid()}-{time.monotonic_ns()}"
        self.pages = {log_live.channel(job.pk).encode(): job.pk for job in jobs}
        self.listener = redis.Redis.from_url(settings.REDIS_URL).pubsub(ignore_subscribe_messages=True)
        self.listener.subscribe(changes.channel(), *self.pages)
        for _ in range(len(jobs) + 1):
            self.listener.get_message(timeout=1)  # the subscriptions' answers

    def read(self) -> tuple[set[int], list[dict]]:
        """(the jobs whose page was told, the change feed's messages)"""
        pages, feed = set(), []
        while (message := self.listener.get_message(timeout=1)) is not None:
            if message["channel"] in self.pages:
                pages.add(self.pages[message["channel"]])
            else:
                feed.append(json.loads(message["data"]))
        self.listener.close()
        return pages, feed


@pytest.mark.parametrize("how", ["left the team", "left the team, found by the reconciler", "deactivated"])
def test_a_leavers_cancelled_queued_jobs_are_published_like_any_status_change(
    alice, team, box, sent, settings, how, django_capture_on_commit_callbacks
):
    queued = [_queue(alice), _queue(alice)]
    published = Published(settings, queued)
    with django_capture_on_commit_callbacks(execute=True):
        if how == "left the team":
            Membership.objects.get(user=alice, team=team).delete()  # a directory sync, a leader
        elif how == "deactivated":
            alice.is_active = False
            alice.save()
        else:
            Membership.objects.filter(user=alice, team=team)._raw_delete("default")  # no signal
            jobs_reconcile()
    assert {job.status for job in Job.objects.filter(pk__in=[j.pk for j in queued])} == {Job.Status.CANCELLED}
    pages, feed = published.read()
    assert pages == {job.pk for job in queued}  # each job's page reads its row again
    assert {"topic": "jobs", "server": None} in feed  # and the lists of jobs theirs

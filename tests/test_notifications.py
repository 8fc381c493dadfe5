"""Notifications: the service and its mail (a real SMTP server), the inbox and the bell, the API,
mail preferences, and who may see what."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta

import pytest
from aiosmtpd.controller import Controller
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from portal.mail import MAIL_RETRIES, mail_notification, mail_stranded_requeue
from portal.models import Notification
from portal.notifications import (
    mail_kinds_wanted,
    mail_preference_set,
    notification_send,
    notifications_mark_read,
)
from tests.conftest import free_port
from tests.factories import UserFactory
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db

Kind = Notification.Kind
Mail = Notification.Mail
SMTP_BACKEND = "django.core.mail.backends.smtp.EmailBackend"


@pytest.fixture
def queued(monkeypatch) -> list[int]:
    """Notification ids handed to the mail task (no broker needed here)."""
    ids: list[int] = []
    monkeypatch.setattr("portal.mail.mail_notification.apply_async", lambda args: ids.append(args[0]))
    return ids


def _send(user, kind: str = Kind.INTRUDER, key: str = "violation:1", **kwargs) -> Notification:  # type: ignore[no-untyped-def]
    fields = {
        "subject": "Someone else is on your card",
        "body": "bob's python on box1 GPU 0.",
        "url": "/jobs/",
    }
    return notification_send(user=user, kind=kind, key=key, **{**fields, **kwargs})


def _status(notification: Notification) -> str:
    notification.refresh_from_db()
    return notification.mail_status


# --- the service -----------------------------------------------------------------------------


def test_it_puts_the_notification_in_the_inbox_and_queues_its_mail_after_commit(
    alice, queued, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        notification = _send(alice)
        assert queued == []  # not before the commit: the worker must find the row
    assert len(callbacks) == 2  # the mail, and the nudge to the user's bell (portal/changes.py)
    assert queued == [notification.pk]
    assert notification.user == alice and notification.read_at is None
    assert notification.mail_status == Mail.QUEUED


def test_it_mails_through_the_task_with_links_into_the_portal(alice, settings, mailoutbox):
    settings.PORTAL_URL = "https://gpus.lab.example"
    notification = _send(alice, url="/reservations/12/")
    assert mail_notification.apply(args=[notification.pk]).get() == Mail.SENT
    (message,) = mailoutbox
    assert message.to == ["alice@example.org"]
    assert message.subject == "[GPU lab] Someone else is on your card"
    assert "bob's python on box1 GPU 0." in message.body
    assert "https://gpus.lab.example/reservations/12/" in message.body
    assert "https://gpus.lab.example/notifications/" in message.body
    notification.refresh_from_db()
    assert notification.mail_status == Mail.SENT and notification.mailed_at is not None


def test_it_sends_nothing_when_the_task_runs_again(alice, mailoutbox):
    notification = _send(alice)
    mail_notification.apply(args=[notification.pk])
    assert mail_notification.apply(args=[notification.pk]).get() == ""
    assert len(mailoutbox) == 1


def test_it_mails_only_the_kinds_the_user_wants(alice, queued, django_capture_on_commit_callbacks):
    mail_preference_set(user=alice, kinds=[Kind.INTRUDER])
    with django_capture_on_commit_callbacks(execute=True):
        unwanted = _send(alice, kind=Kind.OVER_MEMORY, key="violation:2")
        wanted = _send(alice, kind=Kind.INTRUDER, key="violation:3")
    assert unwanted.mail_status == Mail.NOT_WANTED
    assert queued == [wanted.pk]
    assert Notification.objects.filter(user=alice).count() == 2  # both in the inbox


def test_it_mails_every_kind_but_unbooked_by_default(alice):
    assert mail_kinds_wanted(alice) == [kind for kind in Kind.values if kind != Kind.UNBOOKED]
    assert _send(alice, kind=Kind.UNBOOKED).mail_status == Mail.NOT_WANTED


def test_it_keeps_a_choice_when_a_default_would_differ(alice):
    mail_preference_set(user=alice, kinds=[Kind.UNBOOKED])
    assert mail_kinds_wanted(alice) == [Kind.UNBOOKED]
    assert alice.mail_preference.mail[Kind.INTRUDER] is False


def test_it_mails_no_one_without_an_address(db, queued):
    nobody = UserFactory(username="nomail", email="")
    assert _send(nobody).mail_status == Mail.NO_ADDRESS
    assert queued == []


def test_it_mails_one_key_once_per_interval_and_again_after_it(alice, bob, settings, mailoutbox):
    settings.NOTIFY_MAIL_EVERY_MINUTES = 10
    first = _send(alice, key="violation:42")
    assert _send(alice, key="violation:42").mail_status == Mail.REPEAT  # queued counts: it is on its way
    mail_notification.apply(args=[first.pk])
    assert _send(alice, key="violation:42").mail_status == Mail.REPEAT  # sent a moment ago
    assert _send(alice, key="violation:43").mail_status == Mail.QUEUED  # another violation
    assert _send(bob, key="violation:42").mail_status == Mail.QUEUED  # another person
    assert _send(alice, key="").mail_status == Mail.QUEUED  # no key: never held back
    assert _send(alice, key="").mail_status == Mail.QUEUED

    # The first mail went 11 minutes ago: the interval has passed.
    Notification.objects.filter(pk=first.pk).update(mailed_at=timezone.now() - timedelta(minutes=11))
    assert _send(alice, key="violation:42").mail_status == Mail.QUEUED
    assert Notification.objects.filter(user=alice, key="violation:42").count() == 4  # the inbox has all


def test_it_mails_every_notification_when_the_interval_is_zero(alice, settings):
    settings.NOTIFY_MAIL_EVERY_MINUTES = 0
    assert [_send(alice).mail_status for _ in range(3)] == [Mail.QUEUED] * 3


def test_it_never_raises_when_the_broker_is_away(alice, monkeypatch, django_capture_on_commit_callbacks):
    def broker_away(args: list) -> None:
        raise ConnectionRefusedError("redis is down")

    monkeypatch.setattr("portal.mail.mail_notification.apply_async", broker_away)
    with django_capture_on_commit_callbacks(execute=True):
        notification = _send(alice)
    assert _status(notification) == Mail.QUEUED  # kept for mail_stranded_requeue
    assert Notification.objects.filter(user=alice).count() == 1


def test_a_mail_whose_message_was_lost_is_sent_again_once(
    alice, monkeypatch, django_capture_on_commit_callbacks
):
    from datetime import timedelta

    from django.utils import timezone

    sent: list[int] = []
    monkeypatch.setattr("portal.mail.mail_notification.apply_async", lambda args: sent.append(args[0]))
    with django_capture_on_commit_callbacks(execute=True):
        notification = _send(alice)
    assert sent == [notification.pk]  # then Redis restarted empty: the message is gone
    assert mail_stranded_requeue() == 0  # it has had a message out for less than MAIL_REQUEUE_MINUTES
    later = timezone.now() + timedelta(minutes=11)
    assert mail_stranded_requeue(now=later) == 1 and sent == [notification.pk] * 2
    assert mail_stranded_requeue(now=later) == 0  # one message out at a time
    Notification.objects.filter(pk=notification.pk).update(mail_status=Mail.SENDING)
    assert mail_stranded_requeue(now=later + timedelta(hours=1)) == 0  # maybe sent: never twice


def test_it_refuses_unknown_kinds_and_links_out_of_the_portal(alice):
    with pytest.raises(ValueError, match="unknown notification kind"):
        _send(alice, kind="meteor")
    for url in ("https://evil.example/", "//evil.example/", "javascript:alert(1)"):
        with pytest.raises(ValueError, match="path into the portal"):
            _send(alice, url=url)
    assert not Notification.objects.exists()


def test_it_keeps_the_subject_on_one_line_and_bounded(alice):
    notification = _send(alice, subject="Over memory\non box1\r\n" + "x" * 300)
    assert "\n" not in notification.subject and len(notification.subject) == 200
    assert notification.subject.startswith("Over memory on box1 x") and notification.subject.endswith("…")


def test_it_marks_read_only_the_users_own(alice, bob):
    mine = [_send(alice), _send(alice), _send(alice)]
    theirs = _send(bob)
    assert notifications_mark_read(user=alice, ids=[mine[0].pk, theirs.pk]) == 1
    assert notifications_mark_read(user=alice, ids=[mine[0].pk]) == 0  # already read
    assert Notification.objects.get(pk=theirs.pk).read_at is None
    assert notifications_mark_read(user=alice) == 2
    assert not Notification.objects.filter(user=alice, read_at=None).exists()


# --- mail through a real SMTP server ----------------------------------------------------------


class Collector:
    """An aiosmtpd handler: gives `refusals` in turn to the first DATA commands, then keeps what
    it accepts."""

    def __init__(self) -> None:
        self.refusals: list[str] = []
        self.attempts = 0
        self.envelopes: list = []

    async def handle_DATA(self, server, session, envelope) -> str:  # type: ignore[no-untyped-def]
        self.attempts += 1
        if self.refusals:
            return self.refusals.pop(0)
        self.envelopes.append(envelope)
        return "250 Message accepted for delivery"


@pytest.fixture
def smtp_server() -> Iterator[tuple[Collector, int]]:
    handler = Collector()
    controller = Controller(handler, hostname="127.0.0.1", port=free_port())
    controller.start()
    yield handler, controller.port
    controller.stop()


@pytest.fixture
def smtp(settings, smtp_server) -> Collector:
    """The SMTP backend, configured through settings, pointed at the test's server."""
    handler, port = smtp_server
    settings.EMAIL_BACKEND = SMTP_BACKEND
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", port
    settings.EMAIL_USE_TLS = settings.EMAIL_USE_SSL = False
    settings.EMAIL_HOST_USER = settings.EMAIL_HOST_PASSWORD = ""
    settings.EMAIL_TIMEOUT = 5
    settings.DEFAULT_FROM_EMAIL = "GPU lab portal <gpu-portal@lab.example>"
    return handler


def test_it_delivers_the_mail_to_an_smtp_server(alice, smtp, queued, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        notification = _send(alice, kind=Kind.OVER_MEMORY, subject="Over memory on box1 GPU 0")
    assert mail_notification.apply(args=queued).get() == Mail.SENT
    (envelope,) = smtp.envelopes
    assert envelope.mail_from == "gpu-portal@lab.example"
    assert envelope.rcpt_tos == ["alice@example.org"]
    text = envelope.content.decode()
    assert "Subject: [GPU lab] Over memory on box1 GPU 0" in text
    assert "bob's python on box1 GPU 0." in text
    assert _status(notification) == Mail.SENT


def test_it_retries_a_temporary_refusal_and_then_delivers(alice, smtp):
    smtp.refusals = ["451 4.3.0 Try again later", "421 4.4.2 Busy"]
    notification = _send(alice)
    mail_notification.apply(args=[notification.pk])  # eager: its retries run at once
    assert smtp.attempts == 3
    assert len(smtp.envelopes) == 1
    assert _status(notification) == Mail.SENT


def test_it_gives_up_after_the_last_retry_without_raising(alice, smtp):
    smtp.refusals = ["451 4.3.0 Try again later"] * (MAIL_RETRIES + 5)
    notification = _send(alice)
    assert mail_notification.apply(args=[notification.pk]).get() == Mail.FAILED
    assert smtp.attempts == MAIL_RETRIES + 1
    assert _status(notification) == Mail.FAILED


def test_it_does_not_retry_a_permanent_refusal(alice, smtp):
    smtp.refusals = ["550 5.1.1 No such user"]
    notification = _send(alice)
    assert mail_notification.apply(args=[notification.pk]).get() == Mail.FAILED
    assert smtp.attempts == 1 and smtp.envelopes == []
    assert _status(notification) == Mail.FAILED


def test_it_retries_when_no_smtp_server_answers(alice, settings):
    settings.EMAIL_BACKEND = SMTP_BACKEND
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_TIMEOUT = "127.0.0.1", free_port(), 2
    notification = _send(alice)
    assert mail_notification.apply(args=[notification.pk]).get() == Mail.FAILED
    assert _status(notification) == Mail.FAILED


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_a_real_worker_mails_a_notification(start_worker, smtp_server, alice):
    handler, port = smtp_server
    start_worker(None, extra_env={"EMAIL_HOST": "127.0.0.1", "EMAIL_PORT": str(port)})
    notification = _send(alice)
    wait_for(lambda: handler.envelopes, timeout=60, what="the portal's worker to mail the notification")
    assert handler.envelopes[0].rcpt_tos == ["alice@example.org"]
    wait_for(lambda: _status(notification) == Mail.SENT, timeout=10, what="the mail to be recorded")


# --- the inbox, the bell, the profile ---------------------------------------------------------


def test_it_lists_the_inbox_newest_first_with_filters(client, alice, bob):
    older = _send(alice, subject="Older one", kind=Kind.IDLE_BOOKING)
    _send(alice, subject="Newer one", kind=Kind.INTRUDER)
    _send(bob, subject="Bob own")
    notifications_mark_read(user=alice, ids=[older.pk])
    client.force_login(alice)
    html = client.get(reverse("notifications")).content.decode()
    assert html.index("Newer one") < html.index("Older one")
    assert "Bob own" not in html
    assert 'href="/jobs/"' in html
    assert "Mark all 1 read" in html
    assert '<option value="true">unread only</option>' in html
    unread = client.get(reverse("notifications"), {"unread": "true"}).content.decode()
    assert "Newer one" in unread and "Older one" not in unread
    idle = client.get(reverse("notifications"), {"kind": "idle_booking"}).content.decode()
    assert "Older one" in idle and "Newer one" not in idle


def test_it_shows_a_bad_filter_beside_its_field_and_no_list(client, alice):
    _send(alice, subject="Hidden")
    client.force_login(alice)
    html = client.get(reverse("notifications"), {"kind": "meteor"}).content.decode()
    assert "Unknown kind; use one of intruder" in html
    assert "Hidden" not in html


def test_it_pages_the_inbox(client, alice, settings):
    settings.NOTIFY_MAIL_EVERY_MINUTES = 0
    for n in range(30):
        _send(alice, subject=f"Number {n:02d}")
    client.force_login(alice)
    first = client.get(reverse("notifications")).content.decode()
    assert "Number 29" in first and "Number 04" not in first
    assert "Page 1 of 2 · 30 notifications" in first
    assert "Number 04" in client.get(reverse("notifications"), {"page": 2}).content.decode()


def test_it_marks_one_and_all_read_from_the_inbox(client, alice):
    one, _ = _send(alice), _send(alice)
    client.force_login(alice)
    response = client.post(reverse("notification_read", args=[one.pk]), {"next": "/notifications/?kind="})
    assert response.status_code == 302 and response.url == "/notifications/?kind="
    assert Notification.objects.get(pk=one.pk).read_at is not None
    response = client.post(reverse("notifications_read_all"), follow=True)
    assert "Marked 1 notification read." in response.content.decode()
    assert not Notification.objects.filter(read_at=None).exists()
    assert client.get(reverse("notifications_read_all")).status_code == 405


def test_it_shows_the_unread_count_on_the_bell(client, alice):
    client.force_login(alice)
    page = client.get(reverse("dashboard")).content.decode()
    assert (
        'id="bell"' in page
        and 'hx-trigger="every 10s" data-poll-fallback' in page
        and "data-unread" not in page
    )
    _send(alice)
    _send(alice)
    bell = client.get(reverse("notification_bell")).content.decode()
    assert 'data-unread="2"' in bell and 'hx-get="/notifications/bell/"' in bell
    assert 'data-unread="2"' in client.get(reverse("teams")).content.decode()
    notifications_mark_read(user=alice)
    assert "data-unread" not in client.get(reverse("notification_bell")).content.decode()


def test_it_saves_mail_preferences_on_the_profile(client, alice):
    client.force_login(alice)
    html = client.get(reverse("profile")).content.decode()
    ticked = re.findall(r'name="kinds" value="(\w+)" id="\w+" checked', html)
    assert ticked == [kind for kind in Kind.values if kind != Kind.UNBOOKED]
    response = client.post(reverse("profile"), {"kinds": ["job_stopped", "unbooked"]})
    assert response.status_code == 302 and response.url == "/profile/#mail"
    assert mail_kinds_wanted(alice) == [Kind.UNBOOKED, Kind.JOB_STOPPED]
    bad = client.post(reverse("profile"), {"kinds": ["meteor"]})
    assert bad.status_code == 200
    assert "Select a valid choice" in bad.content.decode()
    assert mail_kinds_wanted(alice) == [Kind.UNBOOKED, Kind.JOB_STOPPED]


def test_it_tells_a_user_without_an_address_that_nothing_is_mailed(client, db):
    client.force_login(UserFactory(username="nomail", email=""))
    assert "You have no email address" in client.get(reverse("profile")).content.decode()


# --- the API ---------------------------------------------------------------------------------


@pytest.fixture
def api() -> APIClient:
    return APIClient()


def test_the_api_lists_only_your_own_paginated_and_filtered(api, alice, bob):
    older = _send(alice, kind=Kind.IDLE_BOOKING, subject="Idle")
    newer = _send(alice, kind=Kind.INTRUDER, subject="Intruder")
    _send(bob)
    notifications_mark_read(user=alice, ids=[older.pk])
    api.force_authenticate(alice)
    body = api.get("/api/v1/notifications/").json()
    assert body["count"] == 2
    assert [n["id"] for n in body["results"]] == [newer.pk, older.pk]
    assert set(body["results"][0]) == {"id", "kind", "subject", "body", "url", "created_at", "read_at"}
    unread = api.get("/api/v1/notifications/?unread=1").json()["results"]
    assert [n["id"] for n in unread] == [newer.pk]
    read = api.get("/api/v1/notifications/?unread=false").json()["results"]
    assert [n["id"] for n in read] == [older.pk]
    assert [n["id"] for n in api.get("/api/v1/notifications/?kind=idle_booking").json()["results"]] == [
        older.pk
    ]
    bad = api.get("/api/v1/notifications/?kind=meteor")
    assert bad.status_code == 400 and "Unknown kind" in bad.content.decode()


def test_the_api_marks_one_and_all_read(api, alice):
    one, _ = _send(alice), _send(alice)
    api.force_authenticate(alice)
    response = api.post(f"/api/v1/notifications/{one.pk}/read/")
    assert response.status_code == 200 and response.json()["read_at"] is not None
    assert api.post("/api/v1/notifications/read-all/").json() == {"marked": 1}
    assert api.post("/api/v1/notifications/read-all/").json() == {"marked": 0}


def test_the_schema_documents_the_inbox_filters(api, alice):
    api.force_authenticate(alice)
    schema = api.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    params = {p["name"]: p for p in schema["paths"]["/api/v1/notifications/"]["get"]["parameters"]}
    assert params["unread"]["schema"]["type"] == "boolean"
    assert "over_memory" in params["kind"]["schema"]["enum"]
    assert "/api/v1/notifications/read-all/" in schema["paths"]


# --- who may see what ------------------------------------------------------------------------


def test_anonymous_users_are_sent_to_log_in(client, alice):
    notification = _send(alice)
    for response in (
        client.get(reverse("notifications")),
        client.post(reverse("notifications_read_all")),
        client.post(reverse("notification_read", args=[notification.pk])),
    ):
        assert response.status_code == 302 and response.url.startswith(reverse("login"))
    assert client.get(reverse("notification_bell")).status_code == 286  # htmx: stop polling
    assert "bell" not in client.get(reverse("login")).content.decode()
    for response in (
        APIClient().get("/api/v1/notifications/"),
        APIClient().post(f"/api/v1/notifications/{notification.pk}/read/"),
    ):
        assert response.status_code in (401, 403)
    assert _status(notification) == Mail.QUEUED and Notification.objects.get().read_at is None


@pytest.mark.parametrize("who", ["bob", "leader", "charlie", "admin_user"])
def test_no_one_else_sees_or_marks_a_notification(who, request, client, api, alice):
    """Teammate, team leader, outsider and admin alike: a notification is its person's alone."""
    other = request.getfixturevalue(who)
    notification = _send(alice, subject="Alice secret")
    client.force_login(other)
    assert "Alice secret" not in client.get(reverse("notifications")).content.decode()
    assert client.post(reverse("notification_read", args=[notification.pk])).status_code == 404
    api.force_authenticate(other)
    assert api.get("/api/v1/notifications/").json()["count"] == 0
    assert api.get(f"/api/v1/notifications/{notification.pk}/").status_code == 404
    assert api.post(f"/api/v1/notifications/{notification.pk}/read/").status_code == 404
    assert api.post("/api/v1/notifications/read-all/").json() == {"marked": 0}
    assert Notification.objects.get(pk=notification.pk).read_at is None


def test_the_owner_sees_and_marks_their_own(client, api, alice):
    notification = _send(alice, subject="Alice own")
    client.force_login(alice)
    assert "Alice own" in client.get(reverse("notifications")).content.decode()
    api.force_authenticate(alice)
    assert api.get(f"/api/v1/notifications/{notification.pk}/").json()["subject"] == "Alice own"
    assert client.post(reverse("notification_read", args=[notification.pk])).status_code == 302
    assert Notification.objects.get(pk=notification.pk).read_at is not None


# --- settings --------------------------------------------------------------------------------


def _load_settings(**env: str) -> subprocess.CompletedProcess:
    code = "from django.conf import settings as s; print(s.EMAIL_BACKEND, s.EMAIL_PORT, s.EMAIL_FILE_PATH)"
    return subprocess.run(
        [sys.executable, "-c", f"import django, os; django.setup(); {code}"],
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("EMAIL_")},
            "DJANGO_SETTINGS_MODULE": "portal.settings",
            **env,
        },
        capture_output=True,
        text=True,
        check=False,
    )


def test_it_writes_mails_to_files_unless_an_smtp_server_is_configured(settings):
    default = _load_settings()
    assert default.returncode == 0, default.stderr
    backend, port, path = default.stdout.split()
    assert (backend, port) == ("django.core.mail.backends.filebased.EmailBackend", "25")
    assert path == str(settings.VAR_DIR / "mail")
    relay = _load_settings(EMAIL_HOST="mail.lab.example", EMAIL_USE_TLS="1")
    assert relay.stdout.split()[:2] == [SMTP_BACKEND, "587"]


def test_it_refuses_contradictory_mail_settings():
    both = _load_settings(EMAIL_HOST="mail.lab.example", EMAIL_USE_TLS="1", EMAIL_USE_SSL="1")
    assert both.returncode != 0 and "EMAIL_USE_TLS and EMAIL_USE_SSL are both on" in both.stderr
    no_host = _load_settings(EMAIL_DELIVERY="smtp")
    assert no_host.returncode != 0 and "EMAIL_DELIVERY=smtp needs EMAIL_HOST" in no_host.stderr

"""Chat and webhook channels (portal.channels): a real local HTTP server takes apprise's json://
posts. Encryption at rest, masking in pages and the API, validation, the team's events (violations,
idle bookings, quota refusals), retries, the test button, the requeue, who may do what."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cryptography.fernet import Fernet
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.idle import idle_check
from gpus.models import GPU, Violation
from gpus.services import server_report_ingest
from jobs.watchdog.notify import tell_about
from portal.channels import (
    UNREADABLE,
    channel_create,
    channel_deliver,
    channel_deliveries_prune,
    channel_keys_rotate,
    channel_stranded_requeue,
    channel_test,
    team_channels_notify,
    url_decrypt,
)
from portal.errors import Forbidden, Invalid, QuotaExceeded, TooSoon
from portal.models import ChannelDelivery, Notification, NotificationChannel
from portal.notifications import notification_send
from tests.conftest import free_port
from tests.factories import make_snapshot
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db

Kind = Notification.Kind
Status = ChannelDelivery.Status
SECRET = "s3cretHookKey0123456789"


class Receiver(ThreadingHTTPServer):
    """A webhook: keeps each POST, answers the next of `answers` (then 200)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.posts: list[dict] = []
        self.answers: list[int] = []

    @property
    def url(self) -> str:
        return f"json://127.0.0.1:{self.server_address[1]}/hooks/{SECRET}"


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.posts.append({"path": self.path, "json": json.loads(body or b"{}")})
        status = self.server.answers.pop(0) if self.server.answers else 200
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:  # quiet
        pass


@pytest.fixture
def hook() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def _fast(settings) -> None:
    settings.CHANNEL_TIMEOUT_SECONDS = 2
    settings.CHANNEL_RETRIES = 2
    settings.PORTAL_URL = "https://gpus.lab.example"
    # The receiver listens on loopback: inside the portal's network, allowed only by name here.
    settings.CHANNEL_ALLOWED_HOSTS = ["127.0.0.1"]
    settings.CHANNEL_TEST_EVERY_SECONDS = 0


@pytest.fixture
def queued(monkeypatch) -> list[int]:
    """Delivery ids handed to the task (no broker here); run them with `deliver`."""
    ids: list[int] = []
    monkeypatch.setattr("portal.channels.channel_deliver.apply_async", lambda args: ids.append(args[0]))
    return ids


def deliver(ids: list[int]) -> list[str]:
    """The Celery task, eagerly, as a worker would run each (its retries at once)."""
    statuses = [channel_deliver.apply(args=[pk]).get() for pk in ids]
    ids.clear()
    return statuses


def _api(user) -> APIClient:  # type: ignore[no-untyped-def]
    client = APIClient()
    client.force_authenticate(user)
    return client


# --- a person's channels ----------------------------------------------------------------------


def test_it_posts_a_notification_to_the_persons_webhook_after_commit(
    alice, hook, queued, django_capture_on_commit_callbacks
):
    channel = channel_create(by=alice, url=hook.url, label="my hook")
    with django_capture_on_commit_callbacks(execute=True):
        notification_send(
            user=alice, kind=Kind.INTRUDER, subject="Someone on your card", body="bob's python.", url="/jobs/"
        )
        assert queued == []  # not before the commit
    assert deliver(queued) == [Status.SENT]
    (post,) = hook.posts
    assert post["path"] == f"/hooks/{SECRET}"
    assert post["json"]["title"] == "Someone on your card"
    assert "bob's python." in post["json"]["message"]
    assert "https://gpus.lab.example/jobs/" in post["json"]["message"]  # an absolute link back
    channel.refresh_from_db()
    assert channel.last_sent_at is not None and channel.last_error == ""
    assert deliver([ChannelDelivery.objects.get().pk]) == [""]  # a second run sends nothing
    assert len(hook.posts) == 1


def test_it_sends_only_the_kinds_a_channel_wants(alice, hook, queued, django_capture_on_commit_callbacks):
    channel_create(by=alice, url=hook.url, events=[Kind.OVER_MEMORY])
    with django_capture_on_commit_callbacks(execute=True):
        notification_send(user=alice, kind=Kind.INTRUDER, subject="a", body="b")
        notification_send(user=alice, kind=Kind.OVER_MEMORY, subject="over", body="b", key="violation:7")
        notification_send(user=alice, kind=Kind.OVER_MEMORY, subject="again", body="b", key="violation:7")
    assert ChannelDelivery.objects.get().kind == Kind.OVER_MEMORY  # the same key: held back
    deliver(queued)
    assert [p["json"]["title"] for p in hook.posts] == ["over"]


def test_it_keeps_the_url_encrypted_and_shows_it_masked(alice, hook, client):
    channel = channel_create(by=alice, url=hook.url)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT * FROM {NotificationChannel._meta.db_table} WHERE id = %s",
            [channel.pk],
        )
        row = " ".join(str(value) for value in cursor.fetchone())
    assert SECRET not in row and "/hooks/" not in row.replace(channel.url_masked, "")
    assert url_decrypt(channel.url_encrypted) == hook.url
    assert SECRET not in channel.url_masked and "127.0.0.1" in channel.url_masked

    client.force_login(alice)
    page = client.get(reverse("profile")).content.decode()
    assert "Chat and webhooks" in page and channel.url_masked in page and SECRET not in page
    api = _api(alice).get("/api/v1/notification-channels/").content.decode()
    assert SECRET not in api and json.loads(api)[0]["url"] == channel.url_masked


def test_it_reads_a_url_after_a_key_rotation(alice, hook, settings):
    old = Fernet.generate_key().decode()
    settings.CHANNEL_ENCRYPTION_KEYS = [old]
    channel = channel_create(by=alice, url=hook.url)
    new = Fernet.generate_key().decode()
    settings.CHANNEL_ENCRYPTION_KEYS = [new, old]
    assert url_decrypt(channel.url_encrypted) == hook.url
    assert channel_keys_rotate() == (1, 0)
    settings.CHANNEL_ENCRYPTION_KEYS = [new]  # the old key can go now
    channel.refresh_from_db()
    assert url_decrypt(channel.url_encrypted) == hook.url


def test_it_says_a_channel_cannot_be_decrypted_when_the_secret_key_changed(
    alice, hook, settings, client, queued, django_capture_on_commit_callbacks
):
    channel = channel_create(by=alice, url=hook.url, label="old one")
    settings.SECRET_KEY = "another-secret-key-" + "x" * 40
    client.force_login(alice)
    page = client.get(reverse("profile"))
    assert page.status_code == 200 and "Cannot be decrypted" in page.content.decode()
    assert _api(alice).get(f"/api/v1/notification-channels/{channel.pk}/").json()["readable"] is False
    with django_capture_on_commit_callbacks(execute=True):
        notification_send(user=alice, kind=Kind.INTRUDER, subject="a", body="b")
    assert deliver(queued) == [Status.FAILED]  # at once: no retry can help
    assert ChannelDelivery.objects.get().last_error == UNREADABLE
    assert hook.posts == []


# --- validation ---------------------------------------------------------------------------------


def test_it_refuses_bad_input_with_every_field_and_writes_nothing(alice):
    api = _api(alice)
    answer = api.post(
        "/api/v1/notification-channels/", {"url": "nonsense://x", "events": ["nope"]}, format="json"
    )
    assert answer.status_code == 400
    errors = answer.json()["errors"]
    assert "CHANNEL_SCHEMES" in errors["url"][0] and "nope" in errors["events"][0]
    assert "intruder" in errors["events"][0]  # says which are allowed

    answer = api.post("/api/v1/notification-channels/", {"url": "json://"}, format="json")
    assert answer.status_code == 400 and "slack://" in answer.json()["errors"]["url"][0]  # examples
    answer = api.post(
        "/api/v1/notification-channels/", {"url": "slack://x", "events": [Kind.INTRUDER]}, format="json"
    )
    assert answer.status_code == 400 and "apprise" in answer.json()["errors"]["url"][0]
    assert not NotificationChannel.objects.exists()


def test_it_refuses_a_scheme_the_admin_left_out(alice, settings, hook):
    settings.CHANNEL_SCHEMES = ["slack"]
    with pytest.raises(Invalid, match="CHANNEL_SCHEMES"):
        channel_create(by=alice, url=hook.url)
    assert not NotificationChannel.objects.exists()


def test_it_takes_a_services_own_webhook_url_by_its_apprise_scheme(alice, settings):
    native = "https://hooks.slack.com/services/T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7FQ"
    channel = channel_create(by=alice, url=native)
    assert channel.url_masked.startswith("slack://") and "TIiajkdnlazkcOXrIdevi7FQ" not in channel.url_masked
    settings.CHANNEL_SCHEMES = ["json"]
    with pytest.raises(Invalid, match="slack:// is not allowed"):
        channel_create(by=alice, url=native)


def test_the_form_shows_every_error_beside_its_field(alice, client):
    client.force_login(alice)
    page = client.post(reverse("profile_channels"), {"url": "nonsense://x", "label": "x" * 101})
    html = page.content.decode()
    assert page.status_code == 200 and "CHANNEL_SCHEMES" in html and "keep it to 100" in html
    assert not NotificationChannel.objects.exists()


def test_a_team_channel_takes_only_team_events(leader, team, hook):
    with pytest.raises(Invalid, match="session_ending"):
        channel_create(by=leader, url=hook.url, team=team, events=[Kind.SESSION_ENDING])
    channel = channel_create(by=leader, url=hook.url, team=team, events=["quota_refused"])
    assert channel.events == ["quota_refused"]


# --- the team's channels --------------------------------------------------------------------------


def test_a_member_cannot_add_a_team_channel_but_a_leader_can(alice, leader, team, hook, client):
    answer = _api(alice).post(
        "/api/v1/notification-channels/", {"url": hook.url, "team": team.slug}, format="json"
    )
    assert answer.status_code == 403 and "team" in answer.json()["errors"]
    with pytest.raises(Forbidden):
        channel_create(by=alice, url=hook.url, team=team)
    answer = _api(leader).post(
        "/api/v1/notification-channels/", {"url": hook.url, "team": team.slug}, format="json"
    )
    assert answer.status_code == 201 and answer.json()["team"] == team.slug
    assert SECRET not in answer.content.decode()
    # The members never see it; the leader's page lists it.
    assert _api(alice).get("/api/v1/notification-channels/").json() == []
    client.force_login(leader)
    assert answer.json()["url"] in client.get(reverse("team_channels", args=[team.slug])).content.decode()


def test_the_team_channel_hears_of_a_violation_without_its_arguments(
    alice, leader, team, booking, hook, queued, django_capture_on_commit_callbacks
):
    channel_create(by=leader, url=hook.url, team=team)
    now = timezone.now()
    gpu = booking.allocations.get().gpu
    violation = Violation.objects.create(
        kind=Violation.Kind.INTRUDER, gpu=gpu, server=gpu.server, pid=4242, user=alice, reservation=booking,
        command="python train.py --token=hunter2", memory_mb=900, first_seen=now, last_seen=now,
    )  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        tell_about(violation, event="seen")
        tell_about(violation, event="seen")  # the next round: held back by its key
    deliver(queued)
    (post,) = hook.posts
    assert "Intruder" in post["json"]["title"]
    assert "python" in post["json"]["message"] and "hunter2" not in post["json"]["message"]


def test_the_team_channel_hears_of_an_idle_booking(
    alice, team, leader, hook, queued, settings, django_capture_on_commit_callbacks
):
    settings.IDLE_WARN_MINUTES = 1
    channel_create(by=leader, url=hook.url, team=team, events=[Kind.IDLE_BOOKING])
    t0 = timezone.now().replace(second=0, microsecond=0)
    server_report_ingest(snapshot=make_snapshot("box1", gpus=2, util=0, processes=0), now=t0)
    card = GPU.objects.get(server__name="box1", index=0)
    booking = reservation_create(user=alice, gpus=[card.uuid], start=t0, end=t0 + timedelta(hours=4), now=t0)
    with django_capture_on_commit_callbacks(execute=True):
        for minute in (1, 2, 3):
            at = t0 + timedelta(minutes=minute)
            server_report_ingest(snapshot=make_snapshot("box1", gpus=2, util=0, processes=0), now=at)
            idle_check(now=at)
    deliver(queued)
    (post,) = hook.posts
    assert f"Booking {booking.pk} of alice is idle" == post["json"]["title"]


def test_the_team_channel_hears_of_a_quota_refusal_once_per_person(
    alice, team, leader, box, hook, queued, django_capture_on_commit_callbacks
):
    team.max_cards = 0
    team.save()
    channel_create(by=leader, url=hook.url, team=team)
    with django_capture_on_commit_callbacks(execute=True):
        for _ in range(3):  # alice tries again and again
            with pytest.raises(QuotaExceeded):
                reservation_create(user=alice, gpus=[box[0].uuid])
    assert deliver(queued) == [Status.SENT]
    (post,) = hook.posts
    assert post["json"]["title"] == "A booking of alice was refused by a quota of Vision Lab"
    assert "allows 0 whole card(s)" in post["json"]["message"]


def test_a_team_event_kind_must_be_a_team_event(team):
    with pytest.raises(ValueError, match="not a team event"):
        team_channels_notify(team=team, kind=Kind.SESSION_ENDING, subject="a", body="b")


# --- retries, failures, logs --------------------------------------------------------------------


def test_it_retries_a_refused_post_and_then_delivers(alice, hook, queued, django_capture_on_commit_callbacks):
    hook.answers = [500]
    channel_create(by=alice, url=hook.url)
    with django_capture_on_commit_callbacks(execute=True):
        notification_send(user=alice, kind=Kind.INTRUDER, subject="a", body="b")
    assert deliver(queued) == [Status.SENT]
    delivery = ChannelDelivery.objects.get()
    assert (delivery.status, delivery.attempts) == (Status.SENT, 2)
    assert len(hook.posts) == 2


def test_it_gives_up_after_the_retries_and_never_logs_the_secret(
    alice, hook, queued, caplog, django_capture_on_commit_callbacks
):
    caplog.set_level(logging.DEBUG)
    hook.answers = [500] * 10
    channel = channel_create(by=alice, url=hook.url)
    with django_capture_on_commit_callbacks(execute=True):
        notification_send(user=alice, kind=Kind.INTRUDER, subject="a", body="b")
    deliver(queued)
    delivery = ChannelDelivery.objects.get()
    assert (delivery.status, delivery.attempts) == (Status.FAILED, 3)  # CHANNEL_RETRIES=2, then gave up
    assert "500" in delivery.last_error and SECRET not in delivery.last_error
    channel.refresh_from_db()
    assert channel.last_error == delivery.last_error
    assert "failed" in caplog.text and SECRET not in caplog.text


def test_an_unreachable_service_is_a_failure_with_a_reason(alice, queued, django_capture_on_commit_callbacks):
    channel_create(by=alice, url=f"json://127.0.0.1:{free_port()}/hooks/{SECRET}")
    with django_capture_on_commit_callbacks(execute=True):
        notification_send(user=alice, kind=Kind.INTRUDER, subject="a", body="b")
    deliver(queued)
    delivery = ChannelDelivery.objects.get()
    assert delivery.status == Status.FAILED and "127.0.0.1" in delivery.last_error
    assert SECRET not in delivery.last_error


def test_it_requeues_a_delivery_whose_message_was_lost(alice, hook, queued, settings):
    channel = channel_create(by=alice, url=hook.url)
    old = timezone.now() - timedelta(minutes=settings.MAIL_REQUEUE_MINUTES + 1)
    lost = ChannelDelivery.objects.create(channel=channel, kind=Kind.INTRUDER, subject="a", body="b")
    sending = ChannelDelivery.objects.create(
        channel=channel, kind=Kind.INTRUDER, subject="a", body="b", status=Status.SENDING
    )
    ChannelDelivery.objects.filter(pk__in=[lost.pk, sending.pk]).update(created_at=old, queued_at=old)
    assert channel_stranded_requeue() == 1
    assert queued == [lost.pk]
    assert channel_stranded_requeue() == 0  # it has a message out now


def test_it_drops_finished_deliveries_after_a_month(alice, hook):
    channel = channel_create(by=alice, url=hook.url)
    old = ChannelDelivery.objects.create(
        channel=channel, kind=Kind.INTRUDER, subject="a", body="b", status=Status.SENT
    )
    ChannelDelivery.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=31))
    recent = ChannelDelivery.objects.create(
        channel=channel, kind=Kind.INTRUDER, subject="a", body="b", status=Status.SENT
    )
    assert channel_deliveries_prune() == 1
    assert list(ChannelDelivery.objects.all()) == [recent]


# --- the test button, the API -------------------------------------------------------------------


def test_the_test_button_says_what_the_service_answered(alice, hook, client):
    channel = channel_create(by=alice, url=hook.url, label="my hook")
    client.force_login(alice)
    page = client.post(reverse("channel_test", args=[channel.pk]), follow=True).content.decode()
    assert "Test sent to my hook" in page and hook.posts[0]["json"]["title"] == "Test from the GPU lab portal"
    hook.answers = [503]
    page = client.post(reverse("channel_test", args=[channel.pk]), follow=True).content.decode()
    assert "Test to my hook failed" in page and SECRET not in page
    answer = _api(alice).post(f"/api/v1/notification-channels/{channel.pk}/test/").json()
    assert answer == {"ok": True, "detail": "sent"}


def test_the_api_changes_events_and_deletes(alice, bob, hook):
    channel = channel_create(by=alice, url=hook.url)
    api = _api(alice)
    answer = api.patch(
        f"/api/v1/notification-channels/{channel.pk}/", {"events": [Kind.ZOMBIE], "label": "z"}, format="json"
    )
    assert answer.status_code == 200 and answer.json()["events"] == [Kind.ZOMBIE]
    answer = api.patch(f"/api/v1/notification-channels/{channel.pk}/", {"url": hook.url}, format="json")
    assert answer.status_code == 400 and "url" in answer.json()["errors"]
    assert _api(bob).get(f"/api/v1/notification-channels/{channel.pk}/").status_code == 404
    assert _api(bob).delete(f"/api/v1/notification-channels/{channel.pk}/").status_code == 404
    assert api.delete(f"/api/v1/notification-channels/{channel.pk}/").status_code == 204
    assert not NotificationChannel.objects.exists()


def test_the_profile_page_adds_and_deletes_a_channel(alice, hook, client):
    client.force_login(alice)
    answer = client.post(
        reverse("profile_channels"), {"url": hook.url, "label": "mine", "events": [Kind.ZOMBIE]}
    )
    assert answer.status_code == 302 and answer["Location"].endswith("#channels")
    channel = NotificationChannel.objects.get()
    assert (channel.user, channel.events, channel.label) == (alice, [Kind.ZOMBIE], "mine")
    client.post(reverse("channel_delete", args=[channel.pk]))
    assert not NotificationChannel.objects.exists()


def test_the_profile_section_posts_with_its_csrf_token(alice, hook):
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    html = client.get(reverse("profile")).content.decode()
    section = html[html.index('id="channels"') :]
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', section).group(1)
    answer = client.post(reverse("profile_channels"), {"url": hook.url, "csrfmiddlewaretoken": token})
    assert answer.status_code == 302 and NotificationChannel.objects.filter(user=alice).exists()


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_a_real_worker_posts_to_the_webhook_and_logs_no_secret(start_worker, hook, alice):
    channel_create(by=alice, url=hook.url)
    start_worker(None, extra_env={"LOG_LEVEL": "DEBUG", "CHANNEL_ALLOWED_HOSTS": "127.0.0.1"})
    notification_send(user=alice, kind=Kind.INTRUDER, subject="From the worker", body="b", url="/jobs/")
    wait_for(lambda: hook.posts, timeout=60, what="the portal's worker to post to the webhook")
    assert hook.posts[0]["json"]["title"] == "From the worker"
    wait_for(
        lambda: ChannelDelivery.objects.filter(status=Status.SENT).exists(), timeout=10, what="it recorded"
    )
    log = start_worker.log(None)
    assert "channel_deliver" in log and SECRET not in log  # the message carries only the row's id


# --- where a channel may send (portal/channel_hosts.py) ----------------------------------------


class _Redirecting(BaseHTTPRequestHandler):
    """Answers every request with a redirect to the `hook` receiver (a public host sending inward)."""

    target = ""

    def do_POST(self) -> None:
        self.send_response(307)
        self.send_header("Location", self.target)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    "url",
    [
        "json://127.0.0.1:9/hook",
        "jsons://localhost/admin",
        "form://10.1.2.3/x",
        "json://169.254.169.254/latest/meta-data",
        "json://[::1]:8080/x",
        "mmosts://192.168.1.5/hookkey",
        "ntfy://172.16.0.9/topic",
    ],
)
def test_a_member_cannot_aim_a_channel_inside_the_portals_network(alice, settings, url):
    settings.CHANNEL_ALLOWED_HOSTS = []
    with pytest.raises(Invalid) as refused:
        channel_create(by=alice, url=url)
    assert refused.value.field == "url" and "CHANNEL_ALLOWED_HOSTS" in refused.value.message
    assert not NotificationChannel.objects.exists()


def test_the_admin_may_allow_an_in_house_network(alice, settings):
    settings.CHANNEL_ALLOWED_HOSTS = ["10.1.0.0/16"]
    assert channel_create(by=alice, url="mmosts://10.1.2.3/hookkey").pk
    with pytest.raises(Invalid):
        channel_create(by=alice, url="mmosts://10.2.0.1/hookkey")


def test_a_webhook_is_posted_never_another_method(alice):
    with pytest.raises(Invalid, match="POST") as refused:
        channel_create(by=alice, url="json://127.0.0.1:9/admin?method=DELETE")
    assert refused.value.field == "url"


def test_a_destination_refused_later_fails_at_once_without_a_retry(
    alice, hook, settings, queued, django_capture_on_commit_callbacks
):
    channel_create(by=alice, url=hook.url)
    settings.CHANNEL_ALLOWED_HOSTS = []  # the admin narrowed it since
    with django_capture_on_commit_callbacks(execute=True):
        notification_send(user=alice, kind=Kind.JOB_STOPPED, subject="Job 1 stopped", body="b")
    assert deliver(queued) == [Status.FAILED]
    assert hook.posts == []
    assert "inside the portal's own network" in ChannelDelivery.objects.get().last_error


def test_it_does_not_follow_a_redirect(alice, hook, settings):
    _Redirecting.target = f"http://127.0.0.1:{hook.server_address[1]}/hooks/{SECRET}"
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Redirecting)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        channel = channel_create(by=alice, url=f"json://127.0.0.1:{server.server_address[1]}/in")
        ok, _ = channel_test(channel=channel, by=alice)
    finally:
        server.shutdown()
        server.server_close()
    assert not ok and hook.posts == []


def test_a_channel_is_tested_at_most_once_in_a_while(alice, hook, settings):
    settings.CHANNEL_TEST_EVERY_SECONDS = 30
    channel = channel_create(by=alice, url=hook.url)
    assert channel_test(channel=channel, by=alice)[0]
    with pytest.raises(TooSoon, match="less than 30 s ago"):
        channel_test(channel=channel, by=alice)
    assert len(hook.posts) == 1
    answer = APIClient()
    answer.force_authenticate(alice)
    assert answer.post(f"/api/v1/notification-channels/{channel.pk}/test/").status_code == 429


def test_a_delivery_left_sending_by_a_lost_worker_ends_failed_and_is_pruned(alice, hook):
    channel = channel_create(by=alice, url=hook.url)
    long_ago = timezone.now() - timedelta(hours=1)
    stuck = ChannelDelivery.objects.create(
        channel=channel,
        kind=Kind.JOB_STOPPED,
        subject="s",
        body="b",
        status=Status.SENDING,
        queued_at=long_ago,
    )
    channel_stranded_requeue()
    stuck.refresh_from_db()
    assert stuck.status == Status.FAILED and "may or may not have arrived" in stuck.last_error
    assert hook.posts == []  # never sent twice


def test_a_long_url_is_refused_by_name(alice):
    with pytest.raises(Invalid, match="1000") as refused:
        channel_create(by=alice, url="json://hooks.example.org/" + "a/" * 600)
    assert refused.value.field == "url"


def test_an_ntfy_topic_and_short_webhook_keys_are_masked(alice, settings):
    settings.CHANNEL_ALLOWED_HOSTS = ["hooks.example.org", "ntfy.example.org"]
    topic = channel_create(by=alice, url="ntfys://ntfy.example.org/my-private-topic-x9")
    short = channel_create(by=alice, url="json://hooks.example.org/s3cr3t12")
    assert "my-private-topic-x9" not in topic.url_masked and "s3cr3t12" not in short.url_masked

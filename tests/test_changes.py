"""The change feed (portal/changes.py) and GET /events/ (portal/event_views.py), docs/live.md."""

from __future__ import annotations

import json
import logging
import os
import time

import httpx
import pytest
import redis
from django.test import Client
from django.urls import reverse

from gpu_cli.live import iter_events
from gpus.models import Server
from gpus.services import server_report_ingest
from portal import changes
from portal.notifications import notification_send
from tests.asgi_server import asgi_server
from tests.conftest import free_port
from tests.factories import make_snapshot


@pytest.fixture(autouse=True)
def _setup(settings, monkeypatch) -> None:
    settings.PORTAL_INSTANCE_ID = f"test-{os.getpid()}-{time.monotonic_ns()}"  # a channel of its own
    monkeypatch.setattr("portal.notifications.mail_queue", lambda pk: None)


def _send(user) -> None:  # type: ignore[no-untyped-def]
    notification_send(user=user, kind="intruder", subject="Someone else is on your card", body="x")


@pytest.mark.django_db(transaction=True)
def test_it_relays_changes_and_only_the_viewers_own_notifications(alice, bob):
    browser = Client()
    browser.force_login(alice)
    cookie = {"Cookie": f"sessionid={browser.cookies['sessionid'].value}", "Accept": "text/event-stream"}
    with (
        asgi_server() as url,
        httpx.Client(base_url=url, timeout=httpx.Timeout(10.0)) as http,
        http.stream("GET", "/events/", headers=cookie) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        received = iter_events(response.iter_lines())
        assert next(received).event == "ready"
        _send(bob)  # not alice's: never on her stream
        server_report_ingest(snapshot=make_snapshot("box1", gpus=1))
        _send(alice)
        got = [next(received) for _ in range(2)]
    assert [e.event for e in got] == ["telemetry", "notifications"]
    box1 = Server.objects.get(name="box1").pk  # a round says whose: pages of other servers skip it
    assert json.loads(got[0].data[0]) == {"topic": "telemetry", "server": box1}


@pytest.mark.django_db
def test_it_answers_404_over_wsgi_and_sends_strangers_to_log_in(client, alice):
    assert client.get(reverse("events")).url.startswith(reverse("login"))
    client.force_login(alice)
    assert client.get(reverse("events")).status_code == 404  # the test client is WSGI: pages poll


@pytest.mark.django_db
def test_it_publishes_once_the_transaction_commits(django_capture_on_commit_callbacks, settings):
    listener = redis.Redis.from_url(settings.REDIS_URL).pubsub(ignore_subscribe_messages=True)
    listener.subscribe(changes.channel())
    listener.get_message(timeout=1)  # the subscription's answer
    with django_capture_on_commit_callbacks(execute=True):
        changes.change_publish(changes.BOOKINGS)
        assert listener.get_message(timeout=0.2) is None  # not before the commit
    message = listener.get_message(timeout=2)
    assert json.loads(message["data"]) == {"topic": "bookings", "server": None}
    listener.close()


def test_publishing_never_fails_the_caller_and_logs_an_outage_once(settings, caplog):
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    publisher = changes.Publisher()
    with caplog.at_level(logging.WARNING, logger="portal.changes"):
        publisher.publish(changes.channel(), json.dumps({"topic": "telemetry"}))
        publisher.publish(changes.channel(), json.dumps({"topic": "telemetry"}))  # quiet: not even tried
    assert [r.getMessage().startswith("Changes unpublished") for r in caplog.records] == [True]


@pytest.mark.django_db(transaction=True)
def test_ready_says_the_change_count_that_a_page_notes_as_its_request_begins(alice):
    browser = Client()
    browser.force_login(alice)
    changes.publisher.publish(changes.channel(), "{}")  # counted: the feed's count is not 0
    seen = changes.changes_count()
    assert seen and seen >= 1
    page = browser.get(reverse("dashboard"))
    assert f'data-changes-seen="{seen}"' in page.content.decode()
    assert "changes_seen" not in Client().get(reverse("login")).wsgi_request.__dict__  # no stream, no read
    assert (
        browser.get(reverse("dashboard"), headers={"HX-Request": "true"}).wsgi_request.__dict__.get(
            "changes_seen"
        )
        is None
    )  # a partial's request does without
    cookie = {"Cookie": f"sessionid={browser.cookies['sessionid'].value}", "Accept": "text/event-stream"}
    with (
        asgi_server() as url,
        httpx.Client(base_url=url, timeout=httpx.Timeout(10.0)) as http,
        http.stream("GET", "/events/", headers=cookie) as response,
    ):
        ready = next(iter_events(response.iter_lines()))
    assert ready.event == "ready" and int(ready.data[0]) == seen  # this test's instance: nothing since

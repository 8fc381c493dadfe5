"""The job page's one stream (GET /jobs/<id>/events/, jobs/page_events.py) and the process's one
Redis subscription behind every stream (portal/subscriptions.py), against a real ASGI server and
a real Redis."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import redis
from django.test import Client

from gpu_cli.live import Event, iter_events
from gpus.services import server_report_ingest
from jobs.logs import live as log_live
from jobs.logs.live import job_changed
from jobs.logs.store import LogWriter, log_end, log_stream
from jobs.models import Job
from portal import subscriptions
from portal.notifications import notification_send
from tests.asgi_server import asgi_server
from tests.factories import make_snapshot
from tests.test_log_stream import collect, finish, job  # noqa: F401 - `job`: a running job of alice's

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _setup(settings, monkeypatch) -> None:
    monkeypatch.setattr("jobs.tasks.run_job.apply_async", lambda *args, **kwargs: None)
    monkeypatch.setattr("portal.notifications.mail_queue", lambda pk: None)
    settings.LOG_STREAM_KEEPALIVE_SECONDS = 0.3
    settings.PORTAL_INSTANCE_ID = f"test-{uuid.uuid4().hex[:12]}"  # channels of its own


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with asgi_server() as url:
        yield url


def session_of(user) -> dict[str, str]:
    browser = Client()
    browser.force_login(user)
    return {"Cookie": f"sessionid={browser.cookies['sessionid'].value}"}


@contextmanager
def page_stream(server: str, of: Job, headers: dict[str, str], **params) -> Iterator[httpx.Response]:
    with httpx.Client(base_url=server, timeout=httpx.Timeout(10.0)) as http:
        headers = {"Accept": "text/event-stream", **headers}
        with http.stream("GET", f"/jobs/{of.pk}/events/", headers=headers, params=params) as response:
            yield response


def until_end(received: Iterator[Event]) -> Iterator[Event]:
    """The events up to the log's `end`: the page's stream itself stays open for the feed."""
    for ev in received:
        yield ev
        if ev.event == "end":
            return
    raise AssertionError("the stream ended before `end`")


def next_named(received: Iterator[Event], name: str) -> Event:
    for ev in received:
        if ev.event == name:
            return ev
    raise AssertionError(f"the stream ended before `{name}`")


def test_one_stream_carries_the_feed_the_log_and_the_jobs_changes(server, job, alice):  # noqa: F811 - the fixture
    writer = LogWriter(job.pk)
    writer.feed(b"epoch 1\n")
    writer.flush()
    with page_stream(server, job, session_of(alice)) as response:
        assert response.status_code == 200 and response.headers["x-accel-buffering"] == "no"
        received = iter_events(response.iter_lines())
        logged = next(ev for ev in received if ev.id is not None)  # the log: unnamed, its offset the id
        assert logged.event in (None, "", "message") and logged.data[0].endswith("Z epoch 1")
        assert int(logged.id) == log_end(job.pk)
        job_changed([job.pk], server=job.server_id)  # a status change, as every one is published
        assert next_named(received, "job").data == [""]
        log_live.publish(job.pk, log_live.METRICS, 7)
        assert next_named(received, "metrics").data == ['{"seq": 7}']
        notification_send(user=alice, kind="intruder", subject="Process outside your booking", body="x")
        next_named(received, "notifications")  # the bell's, on the same stream
        finish(job, writer)
        next_named(received, "end")
        server_report_ingest(snapshot=make_snapshot("box1", gpus=4, util=50, simulated=True))
        assert next_named(received, "telemetry")  # after the log's end the feed goes on


def test_it_resumes_the_log_exactly_after_the_last_event_id(server, job, alice):  # noqa: F811 - the fixture
    writer = LogWriter(job.pk)
    writer.feed(b"one\ntwo\n")
    writer.flush()
    middle = log_end(job.pk) // 2  # any offset, not just a line's end
    finish(job, writer)
    with page_stream(server, job, {**session_of(alice), "Last-Event-ID": str(middle)}) as response:
        data, ids, ended = collect(until_end(iter_events(response.iter_lines())), middle)
    with page_stream(server, job, session_of(alice), offset=0) as response:
        whole, _, _ = collect(until_end(iter_events(response.iter_lines())), 0)
    assert ended and ids[-1] == log_end(job.pk) and whole[middle:] == data


@pytest.mark.parametrize(("who", "status"), [("leader", 200), ("bob", 404), ("charlie", 404)])
def test_only_who_may_read_the_log_gets_the_stream(server, job, who, status, request):  # noqa: F811 - the fixture
    finish(job)
    with page_stream(server, job, session_of(request.getfixturevalue(who))) as response:
        assert response.status_code == status
        if status == 200:
            next_named(iter_events(response.iter_lines()), "end")


def test_strangers_are_sent_to_sign_in_and_a_bad_offset_is_refused(server, job, alice):  # noqa: F811 - the fixture
    with page_stream(server, job, {}) as response:
        assert response.status_code == 302 and "/login/" in response.headers["location"]
    with page_stream(server, job, {**session_of(alice), "Last-Event-ID": "12x"}) as response:
        response.read()
        assert response.status_code == 400 and b"offset" in response.content


def _stream_clients() -> list[dict]:
    """The Redis connections of the hub of the running ASGI server (a thread of this process;
    earlier modules' servers, stopped, had hubs of their own)."""
    names = {hub.name for loop, hub in list(subscriptions._hubs.items()) if loop.is_running()}
    assert len(names) == 1
    return [c for c in redis.Redis.from_url(os.environ["REDIS_URL"]).client_list() if c.get("name") in names]


def test_every_stream_of_a_process_shares_one_redis_connection(server, job, alice, settings):  # noqa: F811 - the fixture
    settings.REDIS_URL = os.environ["REDIS_URL"]
    headers = session_of(alice)
    writer = LogWriter(job.pk)
    writer.feed(b"stored\n")
    writer.flush()
    end = log_end(job.pk)
    with httpx.Client(base_url=server, timeout=httpx.Timeout(10.0)) as http:
        opened = []
        try:
            for _ in range(12):  # six job pages and six log streams of the API's
                for url in (f"/jobs/{job.pk}/events/", f"/api/v1/jobs/{job.pk}/log/stream/"):
                    response = http.send(http.build_request("GET", url, headers=headers), stream=True)
                    opened.append(response)
                    assert response.status_code == 200
            received = [iter_events(r.iter_lines()) for r in opened]
            for events in received:  # each listens: it subscribed before it read what is stored
                next(ev for ev in events if ev.id is not None)
            assert len(_stream_clients()) == 1
            log_live.publish(job.pk, log_live.LIVE, end, b"x\n")  # one message, for every stream
            for events in received:
                assert next(ev for ev in events if ev.id is not None).id == str(end + 2)
        finally:
            for response in opened:
                response.close()


def test_a_lost_redis_connection_ends_every_stream_and_the_next_one_reconnects(server, job, alice, settings):  # noqa: F811
    settings.REDIS_URL = os.environ["REDIS_URL"]
    with page_stream(server, job, session_of(alice)) as response:
        received = iter_events(response.iter_lines())
        next_named(received, "ready")
        for client in _stream_clients():
            redis.Redis.from_url(os.environ["REDIS_URL"]).client_kill_filter(_id=client["id"])
        assert "end" not in [ev.event for ev in received]  # closed without `end`: the page reconnects
    with page_stream(server, job, session_of(alice)) as response:
        received = iter_events(response.iter_lines())
        next_named(received, "ready")
        job_changed([job.pk])
        next_named(received, "job")


def test_a_stream_that_falls_behind_is_told_it_lost_messages(monkeypatch):
    monkeypatch.setattr(subscriptions, "QUEUE_MAX", 3)

    async def run() -> list[object]:
        sub = subscriptions.Subscription(subscriptions.Hub(), ["c"])
        for n in range(5):
            sub.deliver(subscriptions.Message(b"c", b"%d" % n, float(n)))
        got: list[object] = []
        try:
            while True:
                got.append(await sub.get(timeout=0.1))
        except subscriptions.Lost as exc:
            got.append(str(exc))
        return got

    lost = "more than 3 messages waited for this stream"
    assert asyncio.run(run()) == [(b"c", b"0", 0.0), (b"c", b"1", 1.0), (b"c", b"2", 2.0), lost]


def test_a_listen_cancelled_while_it_subscribes_leaves_the_channel_working(settings):
    """A client that goes while its stream subscribes (the first after a start or a reconnect)."""
    settings.REDIS_URL = os.environ["REDIS_URL"]
    channel = f"test-{uuid.uuid4().hex}"

    async def run(yields: int) -> bytes:
        hub = subscriptions.Hub()
        first = asyncio.ensure_future(hub.listen([channel]))
        for _ in range(yields):
            await asyncio.sleep(0)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        async with await hub.listen([channel]) as sub:
            redis.Redis.from_url(settings.REDIS_URL).publish(channel, b"still here")
            message = await sub.get(timeout=5)
        assert message is not None
        return message.data

    for yields in (1, 2, 3, 5, 8):
        assert asyncio.run(run(yields)) == b"still here"


def test_a_new_stream_reads_what_was_stored_just_before_it_subscribed(server, job, alice, settings):  # noqa: F811
    """One status read serves the streams that need one from its start on, never one from before
    a stream subscribed: that read could miss a line stored just before."""
    settings.LOG_STREAM_KEEPALIVE_SECONDS = 30  # no keep-alive read to make up for a stale one
    writer = LogWriter(job.pk)
    with page_stream(server, job, session_of(alice)) as first:
        next_named(iter_events(first.iter_lines()), "ready")
        writer.feed(b"stored just now\n")
        writer.flush()
        with page_stream(server, job, session_of(alice)) as second:
            logged = next(ev for ev in iter_events(second.iter_lines()) if ev.id is not None)
    assert logged.data[0].endswith("Z stored just now")


def test_the_page_reads_the_final_status_with_the_logs_end(server, job, alice):  # noqa: F811
    """The end's own word may have come before the stream's status read saw it."""
    finish(job)
    with page_stream(server, job, session_of(alice)) as response:
        names = [ev.event for ev in until_end(iter_events(response.iter_lines()))]
    assert names[-2:] == ["job", "end"]


def test_the_pages_stream_carries_the_log_exactly_when_asked_and_refuses_an_unknown_encoding(
    server,
    job,  # noqa: F811 - the fixture
    alice,
):
    import json

    from tests.test_log_stream import PRINTED

    writer = LogWriter(job.pk)
    writer.feed(PRINTED)
    finish(job, writer)
    with page_stream(server, job, session_of(alice), encoding="json") as response:
        logged = [ev for ev in until_end(iter_events(response.iter_lines())) if ev.id is not None]
    exact = b"".join(json.loads(ev.data[0]).encode("utf-8", "surrogateescape") for ev in logged)
    assert exact == b"".join(log_stream(job.pk)) and int(logged[-1].id) == len(exact)
    with page_stream(server, job, session_of(alice), encoding="utf-7") as response:
        response.read()
    assert response.status_code == 400 and "encoding must be text" in response.text

"""GET /api/v1/jobs/<id>/log/stream/: the live log as server-sent events (jobs/logs/stream.py).

A real ASGI server (uvicorn, in a thread of this process, so it sees the test database) serves
portal.asgi, and a real Redis carries what LogWriter publishes.
"""

from __future__ import annotations

import io
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from django.test import Client
from django.utils import timezone

from gpu_cli.api import API_ROOT, Portal
from gpu_cli.live import Event, event_bytes, follow_log, iter_events
from jobs.logs import live as log_live
from jobs.logs.store import LogWriter, log_append, log_end, log_stream
from jobs.logs.stream import Cursor, event
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from portal.changes import Publisher
from portal.services import api_token_create
from tests.asgi_server import asgi_server
from tests.conftest import free_port
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _setup(settings, monkeypatch) -> None:
    monkeypatch.setattr("jobs.tasks.run_job.apply_async", lambda *args, **kwargs: None)
    settings.LOG_STREAM_KEEPALIVE_SECONDS = 0.3
    # Pub/sub channels are not per Redis database: keep off other test runs' job ids.
    settings.PORTAL_INSTANCE_ID = f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with asgi_server() as url:
        yield url


@pytest.fixture
def job(alice, booking) -> Job:
    script = ScriptUpload(name="train.py", content=b"print(1)\n")
    job = job_submit(user=alice, reservation=booking, script=script)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING)
    return job


def token_for(user) -> dict[str, str]:
    _, key = api_token_create(user=user, name="test", expires_at=None)
    return {"Authorization": f"Token {key}"}


@contextmanager
def stream(server: str, job: Job, headers: dict[str, str], **params) -> Iterator[httpx.Response]:
    with httpx.Client(base_url=server, timeout=httpx.Timeout(10.0)) as http:
        url, headers = f"/api/v1/jobs/{job.pk}/log/stream/", {"Accept": "text/event-stream", **headers}
        with http.stream("GET", url, headers=headers, params=params) as response:
            yield response


def events(response: httpx.Response) -> Iterator[Event]:
    return iter_events(response.iter_lines())


def read_all(response: httpx.Response, start: int = 0) -> tuple[bytes, list[int], bool]:
    """(the bytes, the ids, whether `end` came) of a stream that ends."""
    return collect(events(response), start)


def collect(received: Iterator[Event], start: int) -> tuple[bytes, list[int], bool]:
    data, ids, ended = b"", [start], False
    for ev in received:
        if ev.event == "end":
            ended = True
        elif ev.id is not None:
            data += event_bytes(ev, ids[-1])
            ids.append(int(ev.id))
    return data, ids[1:], ended


def finish(job: Job, writer: LogWriter | None = None) -> None:
    if writer is not None:
        writer.close()
    Job.objects.filter(pk=job.pk).update(status=Job.Status.SUCCEEDED)


def test_it_sends_stored_lines_then_live_ones_and_ends(server, job, alice):
    writer = LogWriter(job.pk)
    writer.feed(b"epoch 1\n")
    writer.flush()
    with stream(server, job, token_for(alice)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-accel-buffering"] == "no"
        received = events(response)
        first = next(received)
        assert first.data[0].endswith("Z epoch 1") and int(first.id) == log_end(job.pk)
        sent_at = time.monotonic()
        writer.feed(b"epoch 2\n")  # published now; stored at the writer's next flush
        second = next(ev for ev in received if ev.id is not None)
        latency = time.monotonic() - sent_at
        assert second.data[0].endswith("Z epoch 2") and log_end(job.pk) < int(second.id)
        assert latency < 0.5, f"a printed line took {latency:.3f} s"
        finish(job, writer)
        rest = list(received)
    assert [ev.event for ev in rest if ev.event == "end"] == ["end"]
    assert int(second.id) == log_end(job.pk)


def test_it_resumes_exactly_after_last_event_id_and_offset(server, job, alice):
    writer = LogWriter(job.pk)
    for n in range(3):
        writer.feed(f"line {n} é\n".encode())
        writer.flush()
    finish(job, writer)
    whole = b"".join(log_stream(job.pk))
    with stream(server, job, token_for(alice)) as response:
        data, ids, ended = read_all(response)
    assert data == whole and ended and ids[-1] == len(whole)
    first_line = whole.index(b"\n") + 1
    with stream(server, job, {**token_for(alice), "Last-Event-ID": str(first_line)}, offset="0") as response:
        data, ids, ended = read_all(response, first_line)
    assert data == whole[first_line:] and ended
    with stream(server, job, token_for(alice), offset=str(first_line)) as response:
        assert read_all(response, first_line)[0] == whole[first_line:]


def test_it_fills_a_gap_from_the_database_without_repeats(server, job, alice):
    """Output published before the stream subscribed, and stored only later, still comes once."""
    writer = LogWriter(job.pk)
    writer.feed(b"stored\n")
    writer.flush()
    writer.feed(b"published before anyone listened\n")  # live only, and nobody heard it
    with stream(server, job, token_for(alice)) as response:
        received = events(response)
        first = next(received)
        assert first.data[0].endswith("Z stored")
        writer.feed(b"after\n")  # live, past a gap: held until the gap is stored
        writer.flush()
        finish(job, writer)
        data, _, ended = collect(received, int(first.id))
    assert data == b"".join(log_stream(job.pk, int(first.id))) and ended
    assert data.count(b"published before anyone listened") == 1 and data.endswith(b"Z after\n")


def test_it_keeps_quiet_streams_open_and_ends_a_job_that_ended_without_a_word(server, job, alice):
    with stream(server, job, token_for(alice)) as response:
        lines = response.iter_lines()
        assert ": keep-alive" in [next(lines) for _ in range(4)]
        Job.objects.filter(pk=job.pk).update(status=Job.Status.CANCELLED)  # publishes nothing
        assert "event: end" in list(lines)


def test_it_ends_after_a_line_appended_from_outside_the_worker(server, job, alice):
    with stream(server, job, token_for(alice)) as response:
        # The reconciler's order: the status first, then the line that says why.
        Job.objects.filter(pk=job.pk).update(status=Job.Status.LOST, finished_at=timezone.now())
        log_append(job.pk, "[portal] Lost: no heartbeat")
        data, _, ended = read_all(response)
    assert data.endswith(b"[portal] Lost: no heartbeat\n") and ended


def test_it_lets_session_users_in_and_leaders_see_their_teams_jobs(server, job, leader):
    finish(job)
    browser = Client()
    browser.force_login(leader)
    cookie = {"Cookie": f"sessionid={browser.cookies['sessionid'].value}"}
    with stream(server, job, cookie) as response:
        assert response.status_code == 200 and read_all(response)[2]


def test_it_answers_404_to_others_and_401_to_strangers(server, job, bob, charlie):
    for user in (bob, charlie):  # a teammate who does not lead the team, an outsider
        with stream(server, job, {**token_for(user), "Accept": "application/json"}) as response:
            assert response.status_code == 404
    with stream(server, job, {"Authorization": "Token " + "0" * 40}) as response:
        assert response.status_code == 401
    with stream(server, job, {}) as response:
        assert response.status_code in (401, 403)


def test_it_refuses_a_bad_offset(server, job, alice):
    with stream(server, job, {**token_for(alice), "Last-Event-ID": "12x"}) as response:
        response.read()
        assert response.status_code == 400 and b"offset" in response.content


def test_it_sends_whole_lines_one_data_line_each_and_markers_for_dropped_bytes():
    cursor = Cursor(0)
    assert cursor.take(b"a\nb", 0, 3) == event(b"a\n", 2) == b"data: a\nid: 2\n\n"
    assert cursor.take(b"c\n", 3, 5) == b"data: bc\nid: 5\n\n"
    assert cursor.take(b"c\n", 3, 5) == b""  # a repeat
    assert cursor.take(b"[dropped 95]\n", 5, 100) == b"data: [dropped 95]\nid: 100\n\n"
    assert cursor.live(110, b"x\n") == b""  # past a gap: held
    assert cursor.take(b"0123456789", 100, 110) == b""
    assert cursor.drain_ahead() == b"data: 0123456789x\nid: 112\n\n"


class DropOnce(httpx.BaseTransport):
    """The network between `gpu` and the portal: the first answer breaks off after `after` bytes,
    in the middle of an event."""

    def __init__(self, after: int) -> None:
        self.real = httpx.HTTPTransport()
        self.after = after
        self.offsets: list[str | None] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.offsets.append(request.url.params.get("offset"))
        response = self.real.handle_request(request)
        if len(self.offsets) > 1:
            return response
        cut = Cut(response.stream, self.after)
        return httpx.Response(response.status_code, headers=response.headers, stream=cut)


class Cut(httpx.SyncByteStream):
    def __init__(self, stream: httpx.SyncByteStream, after: int) -> None:
        self.stream, self.after = stream, after

    def __iter__(self) -> Iterator[bytes]:
        for part in self.stream:
            if len(part) >= self.after:
                yield part[: self.after]
                raise httpx.ReadError("connection reset by peer")
            self.after -= len(part)
            yield part

    def close(self) -> None:
        self.stream.close()


def test_gpu_logs_follow_takes_up_a_dropped_stream_without_repeating_or_losing_a_byte(server, job, alice):
    writer = LogWriter(job.pk)
    for n in range(3):
        writer.feed(f"stored {n}\n".encode())
    writer.flush()
    _, key = api_token_create(user=alice, name="cli", expires_at=None)
    portal = Portal(server, key, retry_seconds=5)
    # Cut inside what follows the first event (a keep-alive, here): "retry: 2000\n\n" and the
    # first event come whole.
    first = len(b"retry: 2000\n\n") + len(event(b"".join(log_stream(job.pk)), log_end(job.pk)))
    stored = log_end(job.pk)
    network = DropOnce(after=first + 10)
    portal.http = httpx.Client(base_url=server + API_ROOT, headers=portal.http.headers, transport=network)
    out = io.BytesIO()
    follower = threading.Thread(target=follow_log, args=(portal, job.pk, out))
    writer.feed(b"live 1\n")  # published before `gpu` listens: read from the database after the drop
    follower.start()
    wait_for(lambda: len(network.offsets) == 2, timeout=10, what="the reconnection", interval=0.02)
    writer.feed(b"live 2\n")
    finish(job, writer)
    follower.join(10)
    assert not follower.is_alive()
    assert out.getvalue() == b"".join(log_stream(job.pk))
    assert network.offsets == ["0", str(stored)]  # taken up after the last whole event


def test_it_says_where_to_read_when_served_over_wsgi(job, alice):
    """WSGI would hold the answer until the job ends: 404, naming the polling endpoint (`gpu logs -f`
    and the job page fall back to it)."""
    url = f"/api/v1/jobs/{job.pk}/log/stream/"
    response = Client().get(url, headers={**token_for(alice), "Accept": "application/json"})
    assert response.status_code == 404 and "ASGI" in response.json()["detail"]
    response = Client().get(url, headers={**token_for(alice), "Accept": "text/event-stream"})
    assert response.status_code == 404 and b"log/?offset=" in response.content


def test_the_log_download_streams_piece_by_piece_under_asgi(server, job, alice, recwarn):
    """Django would read a sync iterator whole into memory under ASGI (and warn); portal.streaming
    hands it on one piece at a time."""
    writer = LogWriter(job.pk, cap_bytes=64 * 1024 * 1024)
    writer.chunk_bytes = 1024  # many chunks: many pieces
    for n in range(200):
        writer.feed(f"line {n:04d} {'x' * 40}\n".encode())
    writer.flush()
    with httpx.Client(base_url=server, headers=token_for(alice)) as http:
        response = http.get(f"/api/v1/jobs/{job.pk}/log/", params={"offset": 5})
    assert response.status_code == 200 and response.content == b"".join(log_stream(job.pk))[5:]
    assert not [w for w in recwarn if "must consume synchronous iterators" in str(w.message)]


def test_without_redis_the_writer_goes_on_and_the_stream_sends_what_is_stored(
    server, job, alice, settings, monkeypatch
):
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens there
    monkeypatch.setattr(log_live, "publisher", Publisher("Live log", "watchers read it from the database"))
    writer = LogWriter(job.pk)
    writer.feed(b"epoch 1\n")  # the publish fails: logged once, then not tried for a while
    asked = []
    connect = log_live.publisher._redis
    monkeypatch.setattr(log_live.publisher, "_redis", lambda: asked.append(1) or connect())
    writer.feed(b"epoch 2\n")
    writer.flush()
    # Not tried again meanwhile (a clock bound here failed on a loaded machine, and a refused
    # connection is as quick as no try: only the attempts tell).
    assert asked == [] and log_live.publisher._quiet_until
    with stream(server, job, token_for(alice)) as response:
        data, _, ended = read_all(response)
    assert data == b"".join(log_stream(job.pk)) and not ended  # closed: the client comes back later


PRINTED = (
    b"Epoch 1/1\n"
    + b"\r1/2 \x1b[32m\xe2\x94\x81\x1b[0m\x08\x08\x08\x08\x08\r2/2 \x1b[32m\xe2\x94\x81\xe2\x94\x81\x1b[0m\n"
    + b"read data.csv\r\n"
    + "caf\u00e9".encode("latin-1")
    + b"\n"
)


def test_with_encoding_json_curl_gets_every_byte_of_the_log_exactly(server, job, alice):
    # A progress bar's carriage returns and backspaces, a CRLF line and a byte that is no UTF-8:
    # the text form ends a line at each \r and shows the byte as U+FFFD; the JSON form carries
    # them all, each event one `data:` line (curl, as docs/live.md shows it).
    import json
    import subprocess

    writer = LogWriter(job.pk)
    writer.feed(PRINTED)
    writer.close()
    finish(job)
    (key,) = token_for(alice).values()
    done = subprocess.run(
        [
            "curl",
            "-sS",
            "-N",
            "-D",
            "-",
            "-H",
            f"Authorization: {key}",
            "-H",
            "Accept: text/event-stream",
            f"{server}/api/v1/jobs/{job.pk}/log/stream/?encoding=json",
        ],
        capture_output=True,
        timeout=30,
        check=True,
    )
    head, _, body = done.stdout.partition(b"\r\n\r\n")
    assert b"x-log-encoding: json" in head.lower()
    received = list(iter_events(body.decode().split("\n")))
    data = [ev for ev in received if ev.id is not None]
    assert data and all(len(ev.data) == 1 for ev in data)
    exact = b"".join(json.loads(ev.data[0]).encode("utf-8", "surrogateescape") for ev in data)
    assert exact == b"".join(log_stream(job.pk)) and PRINTED.split(b"\n")[1] in exact
    assert int(data[-1].id) == len(exact) and received[-1].event == "end"


def test_a_stream_in_an_unknown_encoding_is_refused_naming_the_field(server, job, alice):
    with stream(server, job, token_for(alice), encoding="base64") as response:
        response.read()
    assert response.status_code == 400
    assert "encoding must be text" in response.text and "?encoding=json" in response.text

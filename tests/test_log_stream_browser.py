"""The job page's live log: one event stream under ASGI, polling (and saying so) without it."""

from __future__ import annotations

import os
import re
import statistics
import time

import pytest

from jobs.logs.store import LogWriter
from jobs.models import Job
from tests.browser import asgi_page, log_in, page  # noqa: F401 - the fixtures
from tests.job_helpers import job_page_open
from tests.test_log_edges import keras_bar
from tests.test_log_stream import job  # noqa: F401 - the fixture: a running job of alice's

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def _setup(settings, monkeypatch) -> None:
    monkeypatch.setattr("jobs.tasks.run_job.apply_async", lambda *args, **kwargs: None)
    settings.PORTAL_INSTANCE_ID = f"test-{os.getpid()}-{time.monotonic_ns()}"


def test_the_job_page_shows_each_line_as_printed_over_one_stream(asgi_page, job, alice):  # noqa: F811
    from playwright.sync_api import expect

    writer = LogWriter(job.pk)
    writer.feed(b"epoch 0\n")
    writer.flush()
    log_in(asgi_page, "alice")
    polls: list[str] = []
    asgi_page.on("request", lambda request: polls.append(request.url) if "/log/?" in request.url else None)
    asgi_page.goto(f"/jobs/{job.pk}/")
    log = asgi_page.locator("#job-log")
    expect(log).to_contain_text("epoch 0")
    expect(asgi_page.locator("#job-log-status")).to_have_text("live")
    delays = []
    for n in range(1, 21):
        printed = time.perf_counter()
        writer.feed(f"epoch {n}\n".encode())
        asgi_page.wait_for_function(  # every frame (not POLL_MS): the delay is what is measured
            f"() => document.getElementById('job-log').textContent.includes('epoch {n}\\n')"
        )
        delays.append(time.perf_counter() - printed)
    median, worst = statistics.median(delays) * 1000, max(delays) * 1000
    print(f"print -> on screen: median {median:.1f} ms, max {worst:.1f} ms")
    assert max(delays) < 1.0
    assert polls == []  # nothing but the stream while the job runs
    writer.close()
    Job.objects.filter(pk=job.pk).update(status=Job.Status.SUCCEEDED)
    expect(log).to_have_attribute("data-done", "1")
    expect(asgi_page.locator("#job-log-status")).to_contain_text("finished: succeeded")
    text = log.text_content()
    assert all(text.count(f"Z epoch {n}\n") == 1 for n in range(21))  # every line once


def test_a_log_viewer_that_arrives_after_the_first_events_still_shows_them(asgi_page, job, alice):  # noqa: F811
    """The page's scripts are deferred, and each runs once it has arrived: live.js used to open the
    stream as it ran, and a job_log.js still on its way (a fresh server's first page) missed the
    stream's first events for good (`ready` and the opening lines). It now opens at DOMContentLoaded,
    after every deferred script ran. Here job_log.js comes half a second late; the events come in
    milliseconds."""
    from playwright.sync_api import expect

    writer = LogWriter(job.pk)
    writer.feed(b"epoch 0\n")
    writer.flush()
    log_in(asgi_page, "alice")

    def late(route) -> None:
        time.sleep(0.5)
        route.continue_()

    asgi_page.route("**/js/job_log.js*", late)
    asgi_page.goto(f"/jobs/{job.pk}/")
    expect(asgi_page.locator("#job-log")).to_contain_text("epoch 0")
    expect(asgi_page.locator("#job-log-status")).to_have_text("live")
    writer.feed(b"epoch 1\n")
    expect(asgi_page.locator("#job-log")).to_contain_text("epoch 1")
    writer.close()


def test_without_the_stream_the_page_polls_and_says_so(page, job, alice):  # noqa: F811 - the fixtures
    """Django's live server is WSGI: the stream answers 404, and the page polls as before."""
    from playwright.sync_api import expect

    writer = job_page_open(page, job.pk)
    expect(page.locator("#job-log-status")).to_contain_text("polling once a second")
    writer.feed(b"epoch 1\n")
    writer.flush()
    expect(page.locator("#job-log")).to_contain_text("epoch 1")


STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ")


def _bar_printed(writer: LogWriter) -> None:
    """A Keras 3 evaluate() bar of six redraws (escape codes, backspaces, carriage returns) after
    a line, stored as the worker stores it: the bar's line taken after its first redraw, as the
    half-second flush takes a line still being drawn (stored without a newline), and the rest,
    which goes on drawing that line, once its newline came; then a CRLF line, and a line written
    over and erased to its end (ESC [ K)."""
    writer.feed(b"Epoch 1/1\n")
    bar = keras_bar(6)
    redrawn = bar.index(b"\x08")  # the second redraw begins by backspacing over the first
    writer.feed(bar[:redrawn])
    writer.partial_since -= 1.0  # it has waited
    writer.maybe_flush()
    writer.feed(bar[redrawn:] + b"Test accuracy: 0.98\r\n")
    writer.feed(b"Downloading 100 MB/s\rDone\x1b[K\n")  # erased to the line's end


def _as_shown(log) -> list[str]:  # type: ignore[no-untyped-def]
    text = log.text_content()
    assert not set(text) & {"\x1b", "\x08", "\r"}, repr(text)
    return [STAMP.sub("", line) for line in text.split("\n")]


SHOWN = [
    "epoch 0",
    "Epoch 1/1",
    # One bar: the piece taken while the line was being drawn was a line of its own before (a bar
    # every half second of a long epoch).
    "6/6 ━━━━━━━━━━━━━━━━━━━━ 0s 2ms/step - accuracy: 0.9006",
    "Test accuracy: 0.98",
    "Done",
    "",
]


def test_a_progress_bar_shows_as_a_terminal_shows_it_over_the_stream(asgi_page, job, alice):  # noqa: F811
    """Each redraw used to be a line of its own, with its escape codes: thousands an epoch."""
    from playwright.sync_api import expect

    writer = job_page_open(asgi_page, job.pk)
    expect(asgi_page.locator("#job-log-status")).to_have_text("live")
    _bar_printed(writer)
    log = asgi_page.locator("#job-log")
    expect(log).to_contain_text("Done\n")
    assert _as_shown(log) == SHOWN


def test_a_progress_bar_shows_as_a_terminal_shows_it_when_polled(page, job, alice):  # noqa: F811 - the fixtures
    from playwright.sync_api import expect

    writer = job_page_open(page, job.pk)
    expect(page.locator("#job-log-status")).to_contain_text("polling once a second")
    _bar_printed(writer)
    writer.flush()
    log = page.locator("#job-log")
    expect(log).to_contain_text("Done\n")
    assert _as_shown(log) == SHOWN

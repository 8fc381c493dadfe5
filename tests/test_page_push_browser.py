"""The job page, the queue and the GPU page, pushed (docs/live.md): in Chromium, over ASGI, each
changes in place as the portal publishes, with no polling while the page's stream is open."""

from __future__ import annotations

import os
import time

import pytest
from django.utils import timezone

from gpus.services import server_report_ingest
from jobs.logs import live as log_live
from jobs.logs.live import job_changed
from jobs.models import Job, JobMetric
from jobs.submit import ScriptUpload, job_submit
from tests.browser import POLL_MS, asgi_page, log_in  # noqa: F401 - the fixtures
from tests.factories import make_snapshot, queue_job
from tests.job_helpers import job_page_open

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def _setup(settings, monkeypatch) -> None:
    monkeypatch.setattr("jobs.tasks.run_job.apply_async", lambda *args, **kwargs: None)
    settings.PORTAL_INSTANCE_ID = f"test-{os.getpid()}-{time.monotonic_ns()}"  # channels of its own


@pytest.fixture
def running(alice, booking) -> Job:
    """alice's job on her booking, running since a minute: its page shows the log and both charts."""
    job = job_submit(
        user=alice, reservation=booking, script=ScriptUpload(name="train.py", content=b"print(1)\n")
    )
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, started_at=timezone.now())
    return job


def _stream_up(page) -> None:  # type: ignore[no-untyped-def]
    """The page's stream said `ready` (static/js/live.js): a change published from now on reaches
    it. One published before, between the page's render and its subscription, is not pushed; the
    page shows it with the next change."""
    page.wait_for_function("() => window.portalLive && window.portalLive.up === true", polling=POLL_MS)


def _not_the_stream(requests: list[str]) -> list[str]:
    return [url for url in requests if "/events/" not in url]


def test_an_idle_job_page_asks_nothing_and_gets_its_status_and_curves_pushed(asgi_page, running, alice):  # noqa: F811
    from playwright.sync_api import expect

    writer = job_page_open(asgi_page, running.pk)
    expect(asgi_page.locator("#job-log-status")).to_have_text("live")
    expect(asgi_page.locator("#job-usage-status")).not_to_have_text("loading…")
    requests: list[str] = []
    asgi_page.on("request", lambda request: requests.append(request.url))
    asgi_page.wait_for_timeout(6_000)  # before the push: 3 status reads, 3 curve reads, the usage's
    assert _not_the_stream(requests) == []
    print(f"idle job page: {len(_not_the_stream(requests)) * 10} requests/min")

    Job.objects.filter(pk=running.pk).update(message="checkpoint saved at epoch 3")
    job_changed([running.pk], server=running.server_id)
    expect(asgi_page.locator("#job-status")).to_contain_text("checkpoint saved at epoch 3")
    JobMetric.objects.create(
        job=running, seq=1, kind="epoch", epoch=1, step=10, at=timezone.now(), values={"loss": 0.5}
    )
    log_live.publish(running.pk, log_live.METRICS, 1)
    expect(asgi_page.locator("#job-curves")).to_be_visible()
    expect(asgi_page.locator("#job-curves-status")).to_contain_text("1 records")
    assert [url for url in _not_the_stream(requests) if "status" not in url and "metrics" not in url] == []

    writer.close()
    Job.objects.filter(pk=running.pk).update(status=Job.Status.SUCCEEDED, finished_at=timezone.now())
    job_changed([running.pk], server=running.server_id)
    expect(asgi_page.locator("#job-status-badge")).to_have_text("Succeeded")
    expect(asgi_page.locator("#job-log")).to_have_attribute("data-done", "1")


def test_the_queue_shows_a_new_job_in_place(asgi_page, alice, box):  # noqa: F811
    from playwright.sync_api import expect

    log_in(asgi_page, "alice")
    asgi_page.goto("/queue/")
    expect(asgi_page.locator("#queue-table")).to_contain_text("Nothing waits")
    asgi_page.evaluate("window.__notReloaded = true")
    _stream_up(asgi_page)
    job = queue_job(alice)  # pending until the scheduler's next pass (none runs here)
    expect(asgi_page.locator(f'#queue-table tr[data-job="{job.pk}"]')).to_be_visible()
    assert asgi_page.evaluate("window.__notReloaded") is True


def test_the_gpu_page_shows_each_round_in_place(asgi_page, alice):  # noqa: F811
    from playwright.sync_api import expect

    server_report_ingest(snapshot=make_snapshot("box1", gpus=2, util=10, simulated=True))
    log_in(asgi_page, "alice")
    asgi_page.goto("/gpus/GPU-box1-01/")
    expect(asgi_page.locator("#gpu-facts .gpu-util")).to_have_text("10")
    asgi_page.evaluate("window.__facts = document.getElementById('gpu-facts')")
    _stream_up(asgi_page)
    server_report_ingest(snapshot=make_snapshot("box1", gpus=2, util=77, simulated=True))
    expect(asgi_page.locator("#gpu-facts .gpu-util")).to_have_text("77")
    assert asgi_page.evaluate(
        "window.__facts === document.getElementById('gpu-facts')"
    )  # patched, not replaced

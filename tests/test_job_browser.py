"""The job page in a real browser, with a real Celery worker running the Keras example."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpus.booking import reservation_create
from gpus.models import GPU
from gpus.simulated.inventory import server_names
from jobs.models import Job
from tests.browser import log_in, page  # noqa: F401 - the fixture
from tests.isolation import OUTPUT
from tests.waiting import wait_for

pytestmark = [pytest.mark.browser, pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def test_it_runs_the_example_and_shows_its_log_live(page, alice, start_worker):  # noqa: F811
    from playwright.sync_api import expect

    name = server_names()[0]
    start_worker(None)
    start_worker(name)
    gpus = wait_for(
        lambda: list(GPU.objects.filter(server__name=name).order_by("index")),
        timeout=60,
        what=f"{name} to report its GPUs",
    )
    booking = reservation_create(user=alice, gpus=[gpus[0].uuid])

    log_in(page, "alice")
    page.goto(f"/reservations/{booking.pk}/")
    page.click("form.run-example button")
    page.wait_for_url("**/jobs/*/")
    job = Job.objects.get()
    assert job.name == "keras_example.py" and job.owner == alice
    assert "Submitted job" in page.locator(".message").inner_text()
    page.evaluate("window.__notReloaded = true")

    log = page.locator("#job-log")
    expect(log).to_contain_text("[portal] launcher:", timeout=90_000)
    expect(log).to_contain_text("Epoch 1/", timeout=90_000)
    expect(page.locator("#job-status .badge.succeeded")).to_be_visible(timeout=120_000)
    expect(log).to_have_attribute("data-done", "1", timeout=15_000)
    expect(page.locator("#job-log-status")).to_contain_text("finished: succeeded")
    assert page.evaluate("window.__notReloaded") is True  # all of it arrived without a reload
    text = log.inner_text()
    assert "done: accuracy=" in text and text.count("[portal] launcher:") == 1  # no line twice
    assert "Exit code" in page.locator("#job-status").inner_text()
    assert Job.objects.get().status == Job.Status.SUCCEEDED

    page.screenshot(path=str(OUTPUT / "job.png"), full_page=True)
    with page.expect_download() as download:
        page.click("#job-log-download")
    assert download.value.suggested_filename == f"job-{job.pk}-keras_example.log"
    saved = Path(download.value.path()).read_text()
    assert "Epoch" in saved and "[portal] launcher:" in saved

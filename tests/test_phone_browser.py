"""Every main page at a phone's width (390 px, issue 23): nothing scrolls the page sideways; wide
tables and logs scroll inside their own box."""

from __future__ import annotations

import os
import shutil

import pytest

from gpus.booking import reservation_create
from gpus.services import server_report_ingest
from jobs.submit import ScriptUpload, job_submit
from tests.browser import CHROMIUM, CHROMIUM_ARGS, log_in
from tests.factories import make_snapshot

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PHONE = {"width": 390, "height": 844}
# What sticks out, for the message: the elements past the right edge (none inside a table,
# which scrolls in its own box).
WIDEST = """[...document.querySelectorAll('*')]
  .filter(e => e.getBoundingClientRect().right > 391 || e.scrollWidth > Math.max(e.clientWidth, 390) + 1)
  .filter(e => !e.closest('table') || e.tagName === 'TABLE')
  .slice(0, 10)
  .map(e => `${e.tagName}.${e.className}#${e.id} ${Math.round(e.getBoundingClientRect().right)}`)"""
PAGES = [
    "/",
    "/reservations/",
    "/reservations/new/",
    "/jobs/",
    "/jobs/new/",
    "/jobs/history/",
    "/queue/",
    "/violations/",
    "/reports/",
    "/teams/",
    "/notifications/",
    "/profile/",
]


@pytest.fixture
def phone(live_server):  # type: ignore[no-untyped-def]
    if not shutil.which(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium")
        pytest.skip(f"{CHROMIUM} not installed")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(base_url=live_server.url, viewport=PHONE, is_mobile=True)
        tab = context.new_page()
        tab.set_default_timeout(15_000)
        yield tab
        context.close()
        browser.close()


def test_no_main_page_scrolls_sideways_on_a_phone(phone, alice, monkeypatch):
    monkeypatch.setattr("jobs.tasks.run_job.apply_async", lambda *args, **kwargs: None)
    server_report_ingest(snapshot=make_snapshot("box1", gpus=4, simulated=True))
    booking = reservation_create(user=alice, gpus=["GPU-box1-00"], memory_mb=8192)
    job = job_submit(
        user=alice, reservation=booking, script=ScriptUpload(name="train.py", content=b"print(1)\n")
    )
    log_in(phone, "alice")
    wide = {}
    for path in [*PAGES, f"/jobs/{job.pk}/", f"/reservations/{booking.pk}/"]:
        phone.goto(path)
        width = phone.evaluate("document.documentElement.scrollWidth")
        if width > PHONE["width"]:
            wide[path] = (width, phone.evaluate(WIDEST))
    assert not wide, f"pages wider than {PHONE['width']} px: {wide}"

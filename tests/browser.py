"""Playwright driving Debian's chromium (Playwright cannot download its own browsers here)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gpus.booking import reservation_create
from gpus.services import server_report_ingest
from jobs.submit import ScriptUpload, job_submit
from tests.factories import make_snapshot

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


@pytest.fixture
def page(live_server) -> Iterator[object]:
    """A Chromium tab on the portal as Django's live server (WSGI) serves it."""
    with chromium_tab(live_server.url) as tab:
        yield tab


@pytest.fixture
def asgi_page() -> Iterator[object]:
    """A Chromium tab on the portal served over ASGI (tests/asgi_server.py), as `make run` serves
    it: the live streams work there."""
    from tests.asgi_server import asgi_server

    with asgi_server() as url, chromium_tab(url) as tab:
        yield tab


@contextmanager
def chromium_tab(base_url: str, **context: object) -> Iterator[object]:
    """A tab of Debian's chromium on `base_url`; `context`: Playwright's context options (a
    phone's viewport, is_mobile), a desktop window by default."""
    if not shutil.which(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium")
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium) — browser tests skipped")
    # Playwright's sync API runs an event loop in this thread; Django's ORM calls made
    # by the test around it are still synchronous.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        options = {"viewport": {"width": 1400, "height": 900}, **context}
        opened = browser.new_context(base_url=base_url, **options)
        tab = opened.new_page()
        tab.set_default_timeout(15_000)
        yield tab
        opened.close()
        browser.close()


def log_in(page, username: str, password: str = "password") -> None:
    page.goto("/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_url("**/")


# The main pages every person sees: the phone-width and accessibility tests read each.
MAIN_PAGES = [
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


def main_pages_of(user) -> list[str]:  # type: ignore[no-untyped-def]
    """MAIN_PAGES, and a job's and a booking's page of `user`'s on a simulated box1 (the caller
    keeps the job from being dispatched)."""
    server_report_ingest(snapshot=make_snapshot("box1", gpus=4, simulated=True))
    booking = reservation_create(user=user, gpus=["GPU-box1-00"], memory_mb=8192)
    job = job_submit(
        user=user, reservation=booking, script=ScriptUpload(name="train.py", content=b"print(1)\n")
    )
    return [*MAIN_PAGES, f"/jobs/{job.pk}/", f"/reservations/{booking.pk}/"]

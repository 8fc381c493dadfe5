"""Playwright driving Debian's chromium (Playwright cannot download its own browsers here).

One Playwright and one Chromium per test process (a pytest session, or one xdist worker), started
at the first tab a test opens: a process that runs no browser test starts none. Each test gets a
fresh browser context (its own cookies, storage and cache), closed when the test ends; a Chromium
that died since the last tab (a crash) is launched again for the next. The `chromium` fixture
hands out tabs with context options of their own (a phone's viewport); `page` and `asgi_page`
are desktop tabs on the WSGI and the ASGI server, `page_in(zone)` one whose browser's clock is in
a time zone of the test's."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import TYPE_CHECKING, Any

import pytest

from gpus.booking import reservation_create
from gpus.services import server_report_ingest
from jobs.submit import ScriptUpload, job_submit
from tests.factories import make_snapshot

if TYPE_CHECKING:
    from playwright.sync_api import Browser, BrowserContext, Page, Playwright

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
# Site isolation (a renderer process for each site, kept apart) guards a person's browser against
# the pages of other sites; the tests open the portal's own pages, and the per-site processes were
# a quarter of the renderers Chromium started (147 → 105 over the browser tests). Not through
# --disable-features: Playwright passes its own list in that switch, and Chromium keeps the last.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-site-isolation-trials",
]
# wait_for_function's default polls on every animation frame, which keeps Chromium drawing 60
# frames a second for as long as a test waits: most of its CPU in the waits. A test measuring how
# soon something shows (tests/test_log_stream_browser.py) keeps the default.
POLL_MS = 100
DESKTOP = {"width": 1400, "height": 900}
ASYNC_UNSAFE = "DJANGO_ALLOW_ASYNC_UNSAFE"


class Chromium:
    """This test process's Playwright and Chromium, started by the first tab and ended by
    close() (the pytest config's cleanup) through their own handles.

    Playwright's sync API runs its event loop in a greenlet of this thread; once started, the
    loop counts as running here (asyncio's mark, and the async generator hooks that come with
    it). A tab holds that state for as long as it is open (Django's ORM, called by the test
    meanwhile, is allowed then: DJANGO_ALLOW_ASYNC_UNSAFE) and puts the thread's own back when
    it closes, so the tests after it that run a loop of their own (asyncio.run, async_to_sync,
    Channels) find none running, as in a process that never opened a browser."""

    def __init__(self) -> None:
        self._playwright: Playwright | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_hooks: Any = None
        self._browser: Browser | None = None
        self._turns = 0  # tabs open now, and close() while it runs
        self._outside: tuple[str | None, Any] = (None, None)  # the thread's own state meanwhile

    @contextmanager
    def tab(self, base_url: str, **context: Any) -> Iterator[Page]:
        """A tab in a fresh context on `base_url`; `context`: Playwright's context options (a
        phone's viewport, is_mobile, bypass_csp), a desktop window by default."""
        _require_chromium()
        with self._turn():
            opened = self._new_context(base_url=base_url, **{"viewport": DESKTOP, **context})
            try:
                tab = opened.new_page()
                tab.set_default_timeout(15_000)
                yield tab
            finally:
                self._context_close(opened)

    def close(self) -> None:
        """Chromium closed, then Playwright's driver stopped; either may have died already."""
        with self._turn():
            self._stop()

    def _browser_now(self) -> Browser:
        """The Chromium the next tab opens in: launched now if there is none, or if the last one
        died (a crash Playwright has heard of)."""
        if self._browser is None or not self._browser.is_connected():
            if self._playwright is None:
                self._start()
            assert self._playwright is not None
            self._browser = self._playwright.chromium.launch(
                executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
            )
        return self._browser

    def _start(self) -> None:
        from playwright.sync_api import sync_playwright

        self._playwright = sync_playwright().start()
        self._loop = asyncio.get_running_loop()  # marked by start(): the one its greenlet runs

    def _stop(self) -> None:
        from playwright.sync_api import Error

        if self._browser is not None:
            with suppress(Error):  # a crashed Chromium: its process is gone already
                self._browser.close()
        if self._playwright is not None:
            self._playwright.stop()
        self._playwright = self._loop = self._loop_hooks = self._browser = None

    def _new_context(self, **options: Any) -> BrowserContext:
        """A fresh context; when the browser (or Playwright's driver) died since the last tab and
        Playwright had not heard yet, both are started again, once."""
        from playwright.sync_api import Error

        try:
            return self._browser_now().new_context(**options)
        except Error:
            self._stop()
            return self._browser_now().new_context(**options)

    def _context_close(self, opened: BrowserContext) -> None:
        """The test's context closed; a browser that crashed during the test took it along (the
        test says so itself), and the next tab launches a new one."""
        from playwright.sync_api import Error

        try:
            opened.close()
        except Error:
            if self._browser is not None and self._browser.is_connected():
                raise

    @contextmanager
    def _turn(self) -> Iterator[None]:
        """Playwright's loop running in this thread, and the ORM allowed beside it, while a tab is
        open (or two at once); the thread's own state (no loop) again once the last one closes."""
        if self._turns == 0:
            self._loop_enter()
        self._turns += 1
        try:
            yield
        finally:
            self._turns -= 1
            if self._turns == 0:
                self._loop_leave()

    def _loop_enter(self) -> None:
        if asyncio._get_running_loop() is not None:
            raise RuntimeError("a browser tab inside a running event loop: the sync API cannot run there")
        self._outside = (os.environ.get(ASYNC_UNSAFE), sys.get_asyncgen_hooks())
        os.environ[ASYNC_UNSAFE] = "true"
        # The loop runs (suspended in its greenlet) from start() until the driver is gone.
        if self._loop is not None and self._loop.is_running():
            asyncio._set_running_loop(self._loop)
            sys.set_asyncgen_hooks(*self._loop_hooks)

    def _loop_leave(self) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop_hooks = sys.get_asyncgen_hooks()
        unsafe, hooks = self._outside
        # What asyncio exposes for event loops to call (uvloop does); Playwright calls it too.
        asyncio._set_running_loop(None)
        sys.set_asyncgen_hooks(*hooks)
        if unsafe is None:
            os.environ.pop(ASYNC_UNSAFE, None)
        else:
            os.environ[ASYNC_UNSAFE] = unsafe


_CHROMIUM = pytest.StashKey[Chromium]()


def shared_chromium(config: pytest.Config) -> Chromium:
    """The test process's one Chromium, kept in pytest's config and closed with it (under xdist,
    each worker's own)."""
    if _CHROMIUM not in config.stash:
        config.stash[_CHROMIUM] = Chromium()
        config.add_cleanup(config.stash[_CHROMIUM].close)
    return config.stash[_CHROMIUM]


INSTALL = "sudo apt-get install chromium"


def chromium_missing_header() -> str | None:
    """The test run's one line about a missing Chromium (tests/conftest.py's report header), or
    None when it is there: said once at the top, with the command, not in a skip line a test."""
    if shutil.which(CHROMIUM):
        return None
    if os.environ.get("CI"):
        return f"no Chromium at {CHROMIUM}: the browser tests fail (.ci/run installs it)"
    return f"no Chromium at {CHROMIUM}: the browser tests are left out; install it with `{INSTALL}`"


def left_out_without_chromium(items: list[pytest.Item]) -> list[pytest.Item]:
    """The browser tests to deselect at collection: every one where Chromium is missing, outside
    CI (on CI they run, and fail saying so); none where it is there."""
    if shutil.which(CHROMIUM) or os.environ.get("CI"):
        return []
    return [item for item in items if item.get_closest_marker("browser")]


def _require_chromium() -> None:
    if not shutil.which(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium")
        pytest.skip("no Chromium (the header says how to install it)")


@pytest.fixture
def chromium(pytestconfig: pytest.Config) -> Chromium:
    """The test process's Chromium, for tabs with options of their own: `chromium.tab(url, ...)`."""
    return shared_chromium(pytestconfig)


@pytest.fixture
def page(live_server, pytestconfig: pytest.Config) -> Iterator[Page]:  # type: ignore[no-untyped-def]
    """A Chromium tab on the portal as Django's live server (WSGI) serves it."""
    with shared_chromium(pytestconfig).tab(live_server.url) as tab:
        yield tab


@pytest.fixture
def page_in(live_server, pytestconfig: pytest.Config) -> Callable[[str], AbstractContextManager[Page]]:  # type: ignore[no-untyped-def]
    """Tabs on the live server whose browser's clock is in `zone` (Playwright's timezone_id: the
    page's Intl and Date follow it, as on a laptop set to that zone): `with page_in("Asia/Tokyo")
    as tab:`. Each is a fresh context, so two in one test are two browsers."""

    def opened(zone: str) -> AbstractContextManager[Page]:
        return shared_chromium(pytestconfig).tab(live_server.url, timezone_id=zone)

    return opened


@pytest.fixture
def asgi_page(pytestconfig: pytest.Config) -> Iterator[Page]:
    """A Chromium tab on the portal served over ASGI (tests/asgi_server.py), as `make run` serves
    it: the live streams work there."""
    from tests.asgi_server import asgi_server

    with asgi_server() as url, shared_chromium(pytestconfig).tab(url) as tab:
        yield tab


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

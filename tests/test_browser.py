import asyncio
import os
import re
from contextlib import suppress
from datetime import timedelta

import psutil
import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import User
from django.utils import timezone

from gpus.models import Reservation
from gpus.services import server_report_ingest
from tests.browser import ASYNC_UNSAFE, POLL_MS, chromium, log_in, page  # noqa: F401 - the fixtures
from tests.factories import make_snapshot
from tests.isolation import OUTPUT

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_it_shows_gpus_and_updates_them_without_reload(page, alice):  # noqa: F811
    server_report_ingest(snapshot=make_snapshot("box1", gpus=4, util=10, simulated=True))
    log_in(page, "alice")
    rows = page.locator("[data-gpu-uuid]")
    assert rows.count() == 4
    cell = page.locator('[data-gpu-uuid="GPU-box1-02"] [data-field="utilization"]')
    assert cell.inner_text() == "10%"
    assert page.locator(".badge.simulated").first.is_visible()
    page.evaluate("window.__notReloaded = true")

    server_report_ingest(snapshot=make_snapshot("box1", gpus=4, util=87, simulated=True))
    page.wait_for_function(
        """() => document.querySelector('[data-gpu-uuid="GPU-box1-02"] [data-field="utilization"]')
                 .innerText === '87%'""",
        timeout=10_000,
        polling=POLL_MS,
    )
    assert page.evaluate("window.__notReloaded") is True  # swapped in place, no page load
    page.screenshot(path=str(OUTPUT / "dashboard.png"), full_page=True)


def test_it_rejects_a_wrong_password_in_the_browser(page, alice):  # noqa: F811
    from playwright.sync_api import expect

    page.goto("/login/")
    page.fill("input[name=username]", "alice")
    page.fill("input[name=password]", "wrong")
    page.click("button[type=submit]")
    # The answer's page, once it has come: the click returns before the navigation it starts.
    expect(page.locator("form")).to_contain_text("correct username and password")
    assert "/login/" in page.url


def test_it_reserves_a_card_from_the_dashboard_shows_it_on_the_timeline_and_cancels_it(page, alice):  # noqa: F811
    server_report_ingest(snapshot=make_snapshot("box1", gpus=4, simulated=True))
    log_in(page, "alice")
    page.click('[data-reserve="GPU-box1-01"]')
    page.wait_for_url("**/reservations/new/**")
    assert page.locator('input[name=gpus][value="GPU-box1-01"]').is_checked()
    page.fill("input[name=memory]", "8G")
    in_an_hour = timezone.localtime(timezone.now() + timedelta(hours=1))
    page.fill("input[name=start]", in_an_hour.strftime("%Y-%m-%dT%H:%M"))
    page.fill("textarea[name=note]", "browser test")
    page.click("form.booking-form button[type=submit]")
    page.wait_for_url("**/reservations/*/")
    assert "Booked box1 GPU 1 · 8 GiB" in page.locator(".message").inner_text()
    reservation = Reservation.objects.get()

    page.click("main table a[href*='/timeline/']")  # the card's server links to its timeline
    page.wait_for_url("**/servers/box1/timeline/**")
    bar = page.locator(f'[data-gpu-uuid="GPU-box1-01"] [data-reservation="{reservation.pk}"]')
    assert bar.is_visible()
    assert "8 GiB" in bar.get_attribute("title")
    page.screenshot(path=str(OUTPUT / "timeline.png"), full_page=True)

    bar.click()  # the bar links back to the booking
    page.wait_for_url(f"**/reservations/{reservation.pk}/")
    page.click("main button:has-text('Cancel')")
    page.wait_for_selector("h1 .badge.cancelled")
    page.goto("/servers/box1/timeline/")
    assert page.locator(f'[data-reservation="{reservation.pk}"]').count() == 0
    page.goto("/")
    assert "free" in page.locator('[data-gpu-uuid="GPU-box1-01"] td.booked').inner_text()
    assert Reservation.objects.get().status == Reservation.Status.CANCELLED


def test_a_second_click_on_book_while_it_is_sent_sends_nothing(page, alice):  # noqa: F811
    """A second submit while the first is on its way (portal.js) is not sent: before, a person who
    clicked Book again while the portal answered booked a second card (by count), and a second
    click on Submit queued the job twice. The portal's answer to the first is held meanwhile."""
    server_report_ingest(snapshot=make_snapshot("box1", gpus=4, simulated=True))
    log_in(page, "alice")
    page.goto("/reservations/new/")
    posts, held = [], []

    def hold_the_first(route) -> None:  # type: ignore[no-untyped-def]
        if route.request.method != "POST":
            route.continue_()
            return
        posts.append(route.request.url)
        if len(posts) == 1:
            held.append(route)
        else:
            route.continue_()

    page.route(re.compile(r"/reservations/new/$"), hold_the_first)
    # Two submits 0.1 s apart, as a second click while the first is on its way (in the page: the
    # test's own calls wait for the navigation the first began).
    page.evaluate(
        """() => new Promise((done) => {
            const form = document.querySelector("form.booking-form");
            form.requestSubmit();
            setTimeout(() => { form.requestSubmit(); done(form.getAttribute("aria-busy")); }, 100);
        })"""
    )
    for route in held:
        with suppress(Exception):  # a first request its browser gave up for the second
            route.continue_()
    booked = re.compile(r"/reservations/\d+/$")
    page.wait_for_url(booked)
    assert len(posts) == 1, posts
    assert Reservation.objects.count() == 1
    first = page.url
    # Back to the form (the browser may keep the page, its script's state with it): it books again.
    page.unroute_all()
    page.go_back()
    page.wait_for_url("**/reservations/new/")
    page.click("form.booking-form button[type=submit]")
    page.wait_for_url(lambda url: booked.search(url) is not None and url != first)
    assert Reservation.objects.count() == 2


def test_each_tab_is_a_fresh_context_of_the_one_chromium(chromium, live_server, alice):  # noqa: F811
    with chromium.tab(live_server.url) as first:
        log_in(first, "alice")
        with chromium.tab(live_server.url, viewport={"width": 390, "height": 844}) as second:
            assert second.context.browser is first.context.browser  # no second launch
            assert second.context.cookies() == []  # not signed in: alice's session stays in hers
            assert second.evaluate("window.innerWidth") == 390
            second.goto("/")
            assert "/login/" in second.url
        first.goto("/")
        assert "/login/" not in first.url
    with chromium.tab(live_server.url) as third:
        assert third.context.cookies() == []


def test_a_closed_tab_leaves_this_thread_to_tests_that_run_an_event_loop(chromium, live_server, alice):  # noqa: F811
    """Playwright's sync API marks its loop as running in this thread; after a tab, the next
    test (Channels, the log streams: asyncio.run, async_to_sync) and the ORM find none."""
    unsafe = os.environ.get(ASYNC_UNSAFE)
    with chromium.tab(live_server.url) as tab:
        tab.goto("/login/")
        assert User.objects.get().username == "alice"  # the ORM beside the tab's loop
    assert os.environ.get(ASYNC_UNSAFE) == unsafe
    assert asyncio.run(asyncio.sleep(0, "ran")) == "ran"
    assert async_to_sync(asyncio.sleep)(0, "ran") == "ran"
    with chromium.tab(live_server.url) as tab:  # and the browser's loop goes on afterwards
        log_in(tab, "alice")


def test_a_chromium_that_crashed_in_a_test_is_launched_again_for_the_next(chromium, live_server, alice):  # noqa: F811
    from playwright.sync_api import Error

    with chromium.tab(live_server.url) as tab:
        crashed = tab.context.browser
        with pytest.raises(Error):  # Chromium's own crash: no answer comes
            crashed.new_browser_cdp_session().send("Browser.crash")
    assert not crashed.is_connected()
    with chromium.tab(live_server.url) as tab:
        assert tab.context.browser is not crashed
        log_in(tab, "alice")


def test_a_chromium_killed_between_tests_is_launched_again_for_the_next(chromium, live_server, alice):  # noqa: F811
    """Killed while no tab was open, so Playwright has not heard yet when the next one opens."""
    with chromium.tab(live_server.url) as tab:
        killed = tab.context.browser
    browser = _browser_process()
    browser.kill()
    browser.wait(10)
    with chromium.tab(live_server.url) as tab:
        assert tab.context.browser is not killed
        log_in(tab, "alice")


def _browser_process() -> psutil.Process:
    """Among this process's own descendants, the chromium that Playwright's driver started (the
    others are its children; a crashed one's may be on their way out)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        with suppress(psutil.NoSuchProcess):
            if process.name() == "chromium" and process.parent().name() != "chromium":
                found.append((process, process.status()))
    (browser,) = [process for process, status in found if status != psutil.STATUS_ZOMBIE]
    return browser

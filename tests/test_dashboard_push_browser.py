"""The dashboard and the bell, pushed (docs/live.md): values change in place while focus stays,
with no polling while the change feed is open."""

from __future__ import annotations

import os
import time

import pytest

from gpus.models import Reservation
from gpus.services import server_report_ingest
from portal.notifications import notification_send
from tests.browser import POLL_MS, asgi_page, log_in, page  # noqa: F401 - the fixtures
from tests.factories import make_snapshot

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

UTIL = '[data-gpu-uuid="GPU-box1-02"] [data-field="utilization"]'
STILL_FOCUSED = "document.activeElement === window.__focused && window.__focused.isConnected"


@pytest.fixture(autouse=True)
def _setup(settings) -> None:
    settings.PORTAL_INSTANCE_ID = f"test-{os.getpid()}-{time.monotonic_ns()}"  # a channel of its own


def _ingest(util: int) -> None:
    server_report_ingest(snapshot=make_snapshot("box1", gpus=4, util=util, simulated=True))


def _open_dashboard(tab) -> None:  # type: ignore[no-untyped-def]
    from playwright.sync_api import expect

    log_in(tab, "alice")  # lands on the dashboard
    expect(tab.locator("[data-live-status]")).to_contain_text("updated in place")  # the stream is up


def _wait_for_util(tab, util: int, timeout: int = 5_000) -> None:  # type: ignore[no-untyped-def]
    tab.wait_for_function(
        f"() => document.querySelector('{UTIL}').innerText === '{util}%'", timeout=timeout, polling=POLL_MS
    )


def _tab_to(tab, selector: str, presses: int = 80) -> None:  # type: ignore[no-untyped-def]
    for _ in range(presses):
        tab.keyboard.press("Tab")
        if tab.evaluate("(s) => document.activeElement.matches(s)", selector):
            return
    raise AssertionError(f"Tab never reached {selector}")


def test_it_shows_a_new_telemetry_round_without_a_reload(asgi_page, alice):  # noqa: F811
    _ingest(10)
    _open_dashboard(asgi_page)
    assert asgi_page.inner_text(UTIL) == "10%"
    asgi_page.evaluate("window.__notReloaded = true")
    _ingest(87)
    _wait_for_util(asgi_page, 87)
    assert asgi_page.evaluate("window.__notReloaded") is True


def test_it_keeps_focus_on_reserve_while_updates_arrive_and_books_by_keyboard(asgi_page, alice):  # noqa: F811
    _ingest(10)
    _open_dashboard(asgi_page)
    link = '[data-reserve="GPU-box1-01"]'
    _tab_to(asgi_page, link)
    asgi_page.evaluate("window.__focused = document.activeElement")
    for util in (21, 32, 43, 54):
        _ingest(util)
        _wait_for_util(asgi_page, util)
        assert asgi_page.evaluate(STILL_FOCUSED)  # the same link, never replaced
    asgi_page.keyboard.press("Enter")
    asgi_page.wait_for_url("**/reservations/new/**")
    assert asgi_page.locator('input[name=gpus][value="GPU-box1-01"]').is_checked()
    _tab_to(asgi_page, "input[name=memory]")
    asgi_page.keyboard.type("8G")
    _tab_to(asgi_page, "textarea[name=note]")
    asgi_page.keyboard.type("booked by keyboard")
    _tab_to(asgi_page, "form.booking-form button[type=submit]")
    asgi_page.keyboard.press("Enter")
    asgi_page.wait_for_url("**/reservations/*/")
    reservation = Reservation.objects.get()
    assert reservation.owner == alice and reservation.note == "booked by keyboard"
    assert list(reservation.allocations.values_list("gpu_id", "memory_mb")) == [("GPU-box1-01", 8192)]


def test_an_idle_dashboard_asks_nothing_while_its_stream_is_open(asgi_page, alice, monkeypatch):  # noqa: F811
    from playwright.sync_api import expect

    _ingest(10)
    _open_dashboard(asgi_page)
    requests: list[str] = []
    asgi_page.on("request", lambda request: requests.append(request.url))
    asgi_page.wait_for_timeout(10_000)  # three dashboard polls and a bell's, before the push
    assert requests == []
    print(f"idle dashboard: {len(requests) * 6} requests/min")
    monkeypatch.setattr("portal.notifications.mail_queue", lambda pk: None)
    notification_send(user=alice, kind="intruder", subject="Process outside your booking", body="x")
    expect(asgi_page.locator("#bell [data-unread]")).to_have_text("1")  # the bell, pushed
    assert [url for url in requests if not url.endswith("/notifications/bell/")] == []


def test_without_the_stream_it_polls_says_so_and_still_keeps_focus(page, alice):  # noqa: F811
    """Django's live server is WSGI: /events/ answers 404, and the page polls as before."""
    from playwright.sync_api import expect

    _ingest(10)
    log_in(page, "alice")
    expect(page.locator("[data-live-status]")).to_contain_text("push stream is unavailable")
    _tab_to(page, '[data-reserve="GPU-box1-01"]')
    page.evaluate("window.__focused = document.activeElement")
    _ingest(66)
    _wait_for_util(page, 66, timeout=10_000)  # the next poll, patched in place
    assert page.evaluate(STILL_FOCUSED)


def test_a_new_server_waits_until_focus_leaves_the_list(asgi_page, alice):  # noqa: F811
    from playwright.sync_api import expect

    _ingest(10)
    _open_dashboard(asgi_page)
    _tab_to(asgi_page, '[data-reserve="GPU-box1-01"]')
    asgi_page.evaluate("window.__focused = document.activeElement")
    server_report_ingest(snapshot=make_snapshot("box2", gpus=1, simulated=True))
    asgi_page.wait_for_function(
        "() => document.getElementById('servers').liveWaiting === true", polling=POLL_MS
    )  # read, held back
    assert asgi_page.evaluate(STILL_FOCUSED)
    assert asgi_page.locator('[data-server="box2"]').count() == 0
    asgi_page.evaluate("document.activeElement.blur()")
    expect(asgi_page.locator('[data-server="box2"]')).to_be_visible()


def test_a_change_between_the_render_and_the_streams_start_is_shown(asgi_page, alice):  # noqa: F811
    """The page was drawn before a telemetry round, its stream started after it: no event brings
    that round, the change count does (portal/changes.py)."""
    from playwright.sync_api import Route

    _ingest(10)

    def late_stream(route: Route) -> None:
        if "util_done" not in late_stream.__dict__:  # only the first stream: the round comes before it
            late_stream.util_done = True  # type: ignore[attr-defined]
            _ingest(66)
        route.continue_()

    asgi_page.route("**/events/", late_stream)
    _open_dashboard(asgi_page)
    _wait_for_util(asgi_page, 66)  # read once at `ready`: the page's count was behind

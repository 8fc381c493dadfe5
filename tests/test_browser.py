from datetime import timedelta

import pytest
from django.utils import timezone

from gpus.models import Reservation
from gpus.services import server_report_ingest
from tests.browser import log_in, page  # noqa: F401 - the fixture
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
    )
    assert page.evaluate("window.__notReloaded") is True  # swapped in place, no page load
    page.screenshot(path=str(OUTPUT / "dashboard.png"), full_page=True)


def test_it_rejects_a_wrong_password_in_the_browser(page, alice):  # noqa: F811
    page.goto("/login/")
    page.fill("input[name=username]", "alice")
    page.fill("input[name=password]", "wrong")
    page.click("button[type=submit]")
    assert "correct username and password" in page.content()


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

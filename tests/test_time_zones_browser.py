"""The browser's time zone as Chromium sends it (issue 38): portal.js stores it encoded
(`Europe%2FBerlin`), and the portal must decode it, or every page stays in the portal's zone while
the test client's raw `Asia/Tokyo` passes. Zones whose names hold `/` and `_`, each with one of the
offer's answers; tests/test_time_zones.py covers the rules with the test client."""

from __future__ import annotations

import zoneinfo
from urllib.parse import quote

import pytest
from django.utils import timezone

from portal.models import Profile
from tests.browser import log_in, page_in  # noqa: F401 - the fixture

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

OFFER = "#time-zone-offer"


def _footer(tab) -> str:  # type: ignore[no-untyped-def]
    return tab.locator("footer").inner_text()


def _sign_in_again(tab, username: str) -> None:  # type: ignore[no-untyped-def]
    """Log out with the page's own button and sign in again in the same browser (its cookies)."""
    tab.get_by_role("button", name="Log out").click()
    tab.wait_for_url("**/login/**")
    log_in(tab, username)


@pytest.mark.parametrize(
    ("zone", "answer"),
    [
        ("Europe/Berlin", "Not now"),
        ("Asia/Tokyo", "Use the portal's (UTC)"),
        ("America/New_York", "Use America/New_York"),
    ],
)
def test_the_browsers_zone_arrives_is_offered_and_the_answer_is_kept(
    page_in,  # noqa: F811
    alice,
    leader,
    booking,
    settings,
    zone,
    answer,
):
    settings.TIME_ZONE = "UTC"  # live_server reads it per request: the offer's other choice
    Profile.objects.update_or_create(user=leader, defaults={"time_zone": "Australia/Sydney"})
    local = timezone.localtime(booking.start, timezone=zoneinfo.ZoneInfo(zone))
    with page_in(zone) as tab:
        log_in(tab, "alice")
        tab.goto(f"/reservations/{booking.pk}/")
        assert _footer(tab).startswith(f"All times in {zone} (your browser's).")
        assert local.strftime("%Y-%m-%d %H:%M") in tab.content() and local.strftime("%Z") in tab.content()
        # What Chromium keeps is portal.js's encoded form; the server decoded it above.
        cookies = {c["name"]: c["value"] for c in tab.context.cookies()}
        assert cookies["browser_tz"] == quote(zone, safe="")
        assert tab.locator(OFFER).is_visible() and f"Use {zone}" in tab.locator(OFFER).inner_text()

        tab.locator(OFFER).get_by_role("button", name=answer, exact=True).click()
        tab.wait_for_url(f"**/reservations/{booking.pk}/")
        expected = {
            "Not now": f"All times in {zone} (your browser's).",
            "Use the portal's (UTC)": "All times in UTC (yours).",
        }.get(answer, f"All times in {zone} (yours).")
        assert _footer(tab).startswith(expected) and tab.locator(OFFER).count() == 0
        _sign_in_again(tab, "alice")  # remembered: in the profile, or ("Not now") in this browser
        assert tab.locator(OFFER).count() == 0 and _footer(tab).startswith(expected)

        _sign_in_again(tab, "leader")  # a chosen zone: never asked, whatever the browser says
        assert tab.locator(OFFER).count() == 0
        assert _footer(tab).startswith("All times in Australia/Sydney (yours).")
    saved = Profile.objects.filter(user=alice).values_list("time_zone", flat=True).first() or ""
    assert saved == {"Not now": "", "Use the portal's (UTC)": "UTC"}.get(answer, zone)

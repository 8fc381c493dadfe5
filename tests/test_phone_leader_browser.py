"""A leader's pages at a phone's width (390 px, issue 41, item 13): the team page's "Edit bob's
quota" within the screen, not in a table that scrolls sideways; the Reports summary whole."""

from __future__ import annotations

import pytest

from tests.browser import chromium, log_in  # noqa: F401 - the fixture
from tests.isolation import OUTPUT

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PHONE = {"width": 390, "height": 844}
# Each element's box against the screen: [left, right] in CSS pixels.
BOXES = """els => els.map(e => {
  const r = e.getBoundingClientRect();
  return [e.textContent.trim(), r.left, r.right];
})"""


@pytest.fixture
def phone(live_server, chromium):  # type: ignore[no-untyped-def]  # noqa: F811
    with chromium.tab(live_server.url, viewport=PHONE, is_mobile=True) as tab:
        yield tab


def off_screen(boxes: list) -> list:
    return [(text[:40], round(left), round(right)) for text, left, right in boxes if left < 0 or right > 390]


def test_a_leaders_team_page_and_reports_fit_a_phone(phone, alice, bob, leader, team):
    log_in(phone, "leader")
    phone.goto(f"/teams/{team.slug}/")
    edit = phone.locator("tr[data-member=bob] td.member-quota summary")
    assert edit.inner_text() == "Edit bob's quota"
    assert off_screen(edit.evaluate_all(BOXES)) == []
    assert phone.evaluate("document.querySelector('table.members').scrollWidth") <= 390
    edit.click()  # it opens in place, its fields within the screen too
    fields = phone.locator("tr[data-member=bob] .quota-form input, tr[data-member=bob] .quota-form button")
    assert off_screen(fields.evaluate_all(BOXES)) == []
    cards = phone.locator("tr[data-member=bob] td[data-label]")
    assert off_screen(cards.evaluate_all(BOXES)) == []

    phone.screenshot(path=str(OUTPUT / "phone-team-page.png"), full_page=True)

    phone.goto(f"/reports/?team={team.slug}")
    summary = phone.locator("#report-totals th, #report-totals td")
    boxes = summary.evaluate_all(BOXES)
    assert [text for text, _, _ in boxes][:9][-1] == "Sessions"  # every label, the last too
    assert off_screen(boxes) == []
    assert phone.evaluate("document.querySelector('#report-totals').scrollWidth") <= 390
    phone.screenshot(path=str(OUTPUT / "phone-reports.png"), full_page=True)

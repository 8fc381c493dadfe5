"""Every main page at a phone's width (390 px, issue 23): nothing scrolls the page sideways; wide
tables and logs scroll inside their own box."""

from __future__ import annotations

import pytest

from tests.browser import chromium, log_in, main_pages_of  # noqa: F401 - the fixture

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PHONE = {"width": 390, "height": 844}
# What sticks out, for the message: the elements past the right edge (none inside a table,
# which scrolls in its own box).
WIDEST = """[...document.querySelectorAll('*')]
  .filter(e => e.getBoundingClientRect().right > 391 || e.scrollWidth > Math.max(e.clientWidth, 390) + 1)
  .filter(e => !e.closest('table') || e.tagName === 'TABLE')
  .slice(0, 10)
  .map(e => `${e.tagName}.${e.className}#${e.id} ${Math.round(e.getBoundingClientRect().right)}`)"""


@pytest.fixture
def phone(live_server, chromium):  # type: ignore[no-untyped-def]  # noqa: F811
    with chromium.tab(live_server.url, viewport=PHONE, is_mobile=True) as tab:
        yield tab


def test_no_main_page_scrolls_sideways_on_a_phone(phone, alice, monkeypatch):
    monkeypatch.setattr("jobs.tasks.run_job.apply_async", lambda *args, **kwargs: None)
    paths = main_pages_of(alice)
    log_in(phone, "alice")
    wide = {}
    for path in paths:
        phone.goto(path)
        width = phone.evaluate("document.documentElement.scrollWidth")
        if width > PHONE["width"]:
            wide[path] = (width, phone.evaluate(WIDEST))
    assert not wide, f"pages wider than {PHONE['width']} px: {wide}"

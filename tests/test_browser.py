from pathlib import Path

import pytest

from gpus.services import server_report_ingest
from tests.browser import log_in, page  # noqa: F401 - the fixture
from tests.factories import make_snapshot

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]
OUTPUT = Path(__file__).resolve().parent.parent / "test-output"


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
    OUTPUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUTPUT / "dashboard.png"), full_page=True)


def test_it_rejects_a_wrong_password_in_the_browser(page, alice):  # noqa: F811
    page.goto("/login/")
    page.fill("input[name=username]", "alice")
    page.fill("input[name=password]", "wrong")
    page.click("button[type=submit]")
    assert "correct username and password" in page.content()

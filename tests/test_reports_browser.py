"""The Reports page in a real browser: a leader sees their team's month at a glance."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from gpus import usage
from gpus.inventory import GPUInfo
from gpus.reports import user_colours
from gpus.usage import UsageRollup, hour_of
from jobs.models import Job
from tests.browser import POLL_MS, log_in, page  # noqa: F401 - the fixture
from tests.isolation import OUTPUT
from tests.test_usage import book, card

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

STEP = timedelta(minutes=10)
CHARTS = ("chart-users", "chart-booked-used", "chart-heatmap", "chart-jobs")


def _seed(alice, bob, team, box, monkeypatch, settings) -> None:
    """The last week through the rollup, a round every 10 minutes: alice holds card 0, busy in
    working hours; bob shares card 1 by day and leaves it idle."""
    settings.SERVER_OFFLINE_AFTER_SECONDS = 600  # rounds 10 minutes apart still count
    monkeypatch.setattr(usage, "FLUSH_EVERY", timedelta(hours=6))
    now = timezone.now()
    start = hour_of(now - timedelta(days=7))
    book(alice, team, box[0], start, now)
    for day in range((now - start).days + 1):
        morning = start + timedelta(days=day, hours=8)
        if morning + timedelta(hours=10) < now:
            idle = book(bob, team, box[1], morning, morning + timedelta(hours=10), memory_mb=8192)
            idle.idle_minutes = 240 + 30 * day
            idle.save(update_fields=["idle_minutes"])
    for n, status in enumerate([Job.Status.SUCCEEDED] * 5 + [Job.Status.FAILED] * 2 + [Job.Status.CANCELLED]):
        Job.objects.create(
            owner=alice,
            team=team,
            gpu_uuids=[box[0].uuid],
            name="train.py",
            status=status,
            finished_at=now - timedelta(hours=n + 1),
        )

    def reports(t: datetime) -> list[GPUInfo]:
        busy = 9 <= timezone.localtime(t).hour < 19
        return [
            card(0, util=85 if busy else 15, memory_mb=20_000 if busy else 2_000),
            card(1, util=0, processes=0),
        ]

    rollup = UsageRollup()
    rollup.flush(start)
    t = start
    while t <= now:
        if rollup.observe([(box[0].server_id, c) for c in reports(t)], t):
            rollup.flush(t)
        t += STEP
    rollup.flush(now)


def test_a_leader_sees_the_teams_month_at_a_glance(
    page,  # noqa: F811
    leader,
    alice,
    bob,
    team,
    box,
    monkeypatch,
    settings,
):
    from playwright.sync_api import expect

    _seed(alice, bob, team, box, monkeypatch, settings)
    log_in(page, "leader")
    page.click("nav >> text=Reports")
    page.wait_for_url("**/reports/")
    # The default period is this month; the presets that name the same days today are marked too
    # (on the 30th of November, "Last 30 days"; all January, "This year").
    today = usage.portal_today()
    month = today.replace(day=1)
    same = {"This week": today - timedelta(days=today.weekday()), "Last 30 days": today - timedelta(days=29)}
    same["This year"] = today.replace(month=1, day=1)
    marked = ["This month", *(label for label, since in same.items() if since == month)]
    current = page.locator("nav.report-periods strong")
    expect(current).to_have_count(len(marked))
    assert sorted(current.all_inner_texts()) == sorted(marked)
    # The seeded week, whatever today is: this month holds only hours of it on the 1st (CI ran
    # there at 00:20 once, and found no chart to read).
    page.click("nav.report-periods >> text=Last 30 days")
    page.wait_for_url(lambda url: "since=" in url)
    expect(page.locator("nav.report-periods strong", has_text="Last 30 days")).to_have_count(1)
    expect(page.locator("#report-totals")).to_be_visible()
    for canvas in CHARTS:
        expect(page.locator(f"#{canvas}")).to_be_visible()
    # Chart.js drew each one (the vendored file, served by the portal itself).
    page.wait_for_function(
        f"() => {list(CHARTS)}.every((id) => Chart.getChart(document.getElementById(id)))", polling=POLL_MS
    )
    assert (
        page.evaluate("Chart.getChart(document.getElementById('chart-heatmap')).data.datasets[0].data.length")
        == 168
    )
    # Every axis says its unit, as the server named it; each person is drawn in their own colour.
    titles = page.evaluate(
        """() => ["chart-users", "chart-booked-used", "chart-heatmap", "chart-idle"].map((id) => {
            const scales = Chart.getChart(document.getElementById(id)).options.scales;
            const title = (axis) => axis.title.display && axis.title.text;
            return [title(scales.x), title(scales.y)];
        })"""
    )
    zone = settings.TIME_ZONE
    assert titles == [
        [f"Day ({zone})", "GPU-hours booked"],
        [f"Day ({zone})", "GPU-hours"],
        [f"Hour of the day ({zone})", "Day of the week"],
        ["Idle hours (h)", "Booking"],
    ]
    drawn = page.evaluate(
        "Chart.getChart(document.getElementById('chart-users'))"
        ".data.datasets.map((d) => [d.label, d.backgroundColor])"
    )
    assert dict(drawn) == user_colours(["alice", "bob"])
    rows = page.locator("table.usage-rows tbody tr")
    assert sorted(rows.nth(i).get_attribute("data-key") for i in range(rows.count())) == ["alice", "bob"]
    assert page.locator("table.idle-bookings tbody tr").count() >= 1

    shot = OUTPUT / "reports.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000  # a page with charts, not a blank one

    with page.expect_download() as download:
        page.click("#report-csv")
    assert download.value.suggested_filename.endswith("-by-user.csv")

"""Reports that can be trusted (issue 41, item 12): figures printed with the precision they need,
a peak memory that says whose it is, every chart axis with its unit, a person's one colour, and
"GPU-hours booked this week" the same on the team page and on the Reports page.

The usage is made as test_usage.py makes it: bookings as rows, rounds of card reports through the
rollup at simulated times.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import replace
from datetime import timedelta

import pytest
from django.utils import timezone

from gpus import usage
from gpus.inventory import ProcessInfo
from gpus.models import Allocation
from gpus.quota_usage import gpu_hours_booked_this_week
from gpus.quotas import this_week
from gpus.reports import PALETTE, user_colours
from gpus.usage import UsageRollup, hour_of
from jobs.models import Job
from jobs.services import jobs_usage_record
from portal.figures import figure
from tests.test_usage import GB, MIN, H, book, card, play

pytestmark = pytest.mark.django_db

FAR_EAST = "Pacific/Kiritimati"  # UTC+14: its Monday starts 14 h before the portal's (UTC)


@pytest.fixture
def base():
    """An hour of this month, a day back where the month allows: the default period shows it."""
    now = timezone.localtime()
    return hour_of(
        max(now.replace(day=1, hour=0, minute=0, second=0, microsecond=0), now - timedelta(days=1))
    )


@pytest.fixture
def rollup(monkeypatch) -> UsageRollup:
    monkeypatch.setattr(usage, "FLUSH_EVERY", timedelta(minutes=30))
    return UsageRollup()


def cells(page: str, table_id: str) -> list[str]:
    """The texts of a table's body cells, tags dropped."""
    body = page.split(f'id="{table_id}"', 1)[1].split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    return [re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<td[^>]*>(.*?)</td>", body, re.S)]


def member_cell(page: str, username: str, label: str) -> str:
    row = page.split(f'data-member="{username}"', 1)[1].split("</tr>", 1)[0]
    cell = row.split(f'data-label="{label}">', 1)[1]
    return cell.split("/", 1)[0].strip()


def chart_data(page: str) -> dict:
    return json.loads(page.split('id="report-data" type="application/json">', 1)[1].split("</script>", 1)[0])


# --- precision ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "printed"),
    [
        (None, "–"),
        (0, "0"),
        (0.0004, "< 0.001"),
        (0.001, "0.001"),
        (0.0333, "0.033"),
        (0.022, "0.022"),
        (0.5, "0.5"),
        (2.0, "2"),
        (46.83, "46.8"),
        (99.96, "100"),
        (14999, "14,999"),
    ],
)
def test_it_never_prints_a_figure_that_is_not_zero_as_zero(value, printed):
    assert figure(value) == printed


def test_the_page_shows_two_minutes_of_a_card_as_the_csv_does(client, alice, team, box, base, rollup):
    """The issue's case: 0.033 booked and 0.022 used read "0.0 / 0.0" beside the CSV's figures."""
    book(alice, team, box[0], base, base + 2 * MIN)
    play(rollup, lambda t: [card(0, util=66)], base - MIN, base + 5 * MIN, server_id=box[0].server_id)
    client.force_login(alice)
    totals = cells(client.get("/reports/").content.decode(), "report-totals")
    assert totals[:3] == ["0.033", "0.022", "66 %"]
    rows = list(csv.DictReader(io.StringIO(client.get("/reports/usage.csv").content.decode())))
    assert (rows[0]["gpu_hours_booked"], rows[0]["gpu_hours_used"]) == ("0.033", "0.022")


def test_the_team_page_shows_a_few_minutes_booked_this_week(client, leader, alice, team, box):
    week, _ = this_week(timezone.now())
    book(alice, team, box[0], week + H, week + H + 2 * MIN)
    client.force_login(leader)
    page = client.get(f"/teams/{team.slug}/").content.decode()
    assert member_cell(page, "alice", "GPU-hours booked this week") == "0.033"
    assert cells(page, "team-quota")[2].startswith("0.033 /")


# --- peak memory ---------------------------------------------------------------------------------


def test_peak_memory_says_whose_it_is(client, alice, team, box, base, rollup):
    """alice's card showed 14,999 MiB in use (others' processes, the driver) while her job's own
    processes held 584 MiB: the page shows both, each named for what it measures."""
    book(alice, team, box[0], base, base + H)
    job = Job.objects.create(
        owner=alice,
        team=team,
        server=box[0].server,
        gpu_uuids=[box[0].uuid],
        name="train.py",
        status=Job.Status.RUNNING,
        started_at=base + MIN,
    )
    own = ProcessInfo(
        pid=4242, username="portal-jobs", command="python train.py", used_memory_mb=584, job_id=job.pk
    )
    other = ProcessInfo(pid=4343, username="someone", command="python other.py", used_memory_mb=14_000)
    reported = replace(card(0, util=80, memory_mb=14_999), processes=(own, other))
    assert jobs_usage_record(cards=[reported]) == 1
    play(rollup, lambda t: [reported], base, base + 20 * MIN, server_id=box[0].server_id)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.SUCCEEDED, finished_at=base + 15 * MIN)

    client.force_login(alice)
    page = client.get("/reports/").content.decode()
    assert "Peak memory on the booked cards" in page and "Jobs' own peak memory" in page
    assert re.search(r'id="report-card-peak">14,999 MiB<', page)
    assert re.search(r'id="report-jobs-peak">584 MiB<', page)
    row = page.split('data-key="alice"', 1)[1].split("</tr>", 1)[0]
    assert 'data-figure="card-peak">14,999 MiB' in row and 'data-figure="jobs-peak">584 MiB' in row


def test_the_jobs_peak_follows_who_may_see_and_the_period(client, alice, bob, leader, team, box, base):
    for owner, peak in ((alice, 584), (bob, 9000)):
        Job.objects.create(
            owner=owner,
            team=team,
            server=box[0].server,
            gpu_uuids=[box[0].uuid],
            name="train.py",
            status=Job.Status.SUCCEEDED,
            started_at=base,
            finished_at=base + MIN,
            peak_memory_mb=peak,
        )

    def peak(viewer, **params) -> int | None:
        client.force_login(viewer)
        return client.get("/reports/", params).context["report"]["totals"]["booked"]["jobs_peak_memory_mb"]

    assert peak(alice) == 584  # her own: never bob's
    assert peak(leader) == 9000 and peak(leader, user="alice") == 584  # the team's
    before = (timezone.localdate(base) - timedelta(days=2)).isoformat()  # the jobs ran after it
    assert peak(leader, since=before, until=before) is None


# --- charts: units and colours -----------------------------------------------------------------


def test_every_chart_axis_names_its_unit(client, alice, team, box, base, rollup, settings):
    book(alice, team, box[0], base, base + H)
    play(rollup, lambda t: [card(0)], base, base + 10 * MIN, server_id=box[0].server_id)
    client.force_login(alice)
    axes = chart_data(client.get("/reports/").content.decode())["axes"]
    assert axes["users"]["y"] == "GPU-hours booked" and axes["booked_used"]["y"] == "GPU-hours"
    for chart in ("users", "booked_used"):
        assert axes[chart]["x"] == f"Day ({settings.TIME_ZONE})"
    assert axes["heatmap"] == {
        "x": f"Hour of the day ({settings.TIME_ZONE})",
        "y": "Day of the week",
        "v": "Utilization (%)",
    }
    assert axes["idle"]["x"] == "Idle hours (h)"
    year = (timezone.localdate(base) - timedelta(days=200)).isoformat()
    assert chart_data(client.get("/reports/", {"since": year}).content.decode())["axes"]["users"][
        "x"
    ].startswith("Week (Monday to Sunday)")


def test_a_person_keeps_one_colour_across_loads_and_periods(
    client, leader, alice, bob, team, box, base, rollup
):
    book(alice, team, box[0], base, base + H)
    book(bob, team, box[1], base + 30 * MIN, base + H)
    play(rollup, lambda t: [card(0), card(1)], base, base + H, server_id=box[0].server_id)
    client.force_login(leader)

    def colours(**params) -> dict[str, str]:
        users = chart_data(client.get("/reports/", params).content.decode())["users"]
        return {series["label"]: series["colour"] for series in users}

    both = colours()
    assert both == colours() and set(both) == {"alice", "bob"}
    assert both["alice"] != both["bob"]
    # Her name's colour (sha256, never Python's per-process hash()), alone or beside bob.
    assert both["alice"] == colours(user="alice")["alice"] == "#0d9488"
    assert colours(user="bob")["bob"] == both["bob"]


def test_people_on_one_chart_never_share_a_colour():
    names = [f"user{n}" for n in range(8)]
    colours = user_colours(names)
    assert len(set(colours.values())) == 8 and set(colours.values()) <= set(PALETTE)
    assert user_colours(reversed(names)) == colours


# --- this week, one figure -----------------------------------------------------------------------


def test_booked_this_week_is_the_same_on_the_team_page_and_in_reports(client, leader, alice, bob, team, box):
    """A booking across the portal's Monday 00:00 counts its hours after it on both pages, whatever
    the viewer's zone: the team page once counted the viewer's week (Kiritimati's starts 14 h
    earlier, so 3 h here), Reports only up to now."""
    now = timezone.now()
    week, following = this_week(now)
    book(alice, team, box[0], week - 2 * H, week + H)  # 1 GPU-hour in the portal's week
    book(bob, team, box[1], following - 3 * H, following - H, memory_mb=12 * GB)  # later this week
    expected = gpu_hours_booked_this_week(Allocation.objects.filter(reservation__team=team), now)
    assert expected == pytest.approx(1 + 2 * 12 * GB / box[1].memory_total_mb, abs=1e-3)

    client.cookies["browser_tz"] = FAR_EAST
    client.force_login(leader)
    team_page = client.get(f"/teams/{team.slug}/").content.decode()
    assert member_cell(team_page, "alice", "GPU-hours booked this week") == "1"
    team_total = cells(team_page, "team-quota")[2].split("/", 1)[0].strip()
    # A period of its own, so that "This week" is a link even on a month's first Monday.
    since = (timezone.localdate(week) - timedelta(days=14)).isoformat()
    reports = client.get("/reports/", {"team": team.slug, "since": since}).content.decode()
    week_line = reports.split('id="report-week"', 1)[1].split("</p>", 1)[0]
    shown = re.search(r"<strong data-week-booked>([^<]+)</strong>", week_line)[1]
    assert shown == team_total == figure(expected)
    assert "as the team page and the weekly quota count them" in week_line
    # The period picker's week is the portal's week too.
    monday = timezone.localdate(week, timezone.get_default_timezone()).isoformat()
    assert re.search(rf'href="\?[^"]*since={monday}[^"]*">This week<', reports)

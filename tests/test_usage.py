"""Usage accounting (gpus/usage.py) and its reports (gpus/reports.py, the Reports page, its CSV and
/api/v1/usage/): the rollup's arithmetic, its writes and reloads, pruning, the jobs' outcomes, and
who sees what.

The rollup is driven as the collector drives it: rounds of card reports at simulated times, a flush
whenever it asks for one. Bookings are seeded as rows, so their windows can lie in the past.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta

import pytest
from django.db.models import Sum
from django.utils import timezone
from rest_framework.test import APIClient

from gpus import usage
from gpus.inventory import GPUInfo
from gpus.models import GPU, Allocation, Reservation, UsageDay, UsageHour, UsageTeamHour
from gpus.reports import COLUMNS
from gpus.services import servers_report_ingest
from gpus.usage import UsageRollup, hour_of, usage_prune
from jobs.models import InteractiveSession, Job
from portal.models import Team
from tests.factories import MembershipFactory, UserFactory, make_snapshot

pytestmark = pytest.mark.django_db

H = timedelta(hours=1)
MIN = timedelta(minutes=1)
EVERY = timedelta(seconds=20)  # a report interval inside SERVER_OFFLINE_AFTER_SECONDS (20)
GB = 1024


@pytest.fixture
def base() -> datetime:
    """An hour of this month at least two hours back where the month allows (its first hour on the
    1st): the default period (this month) shows what is seeded from here."""
    now = timezone.localtime()
    month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return hour_of(max(month, now - timedelta(days=1)))


@pytest.fixture
def rollup(monkeypatch) -> UsageRollup:
    """A rollup that flushes every 30 simulated minutes (and at each hour's turn): the arithmetic is
    the same at any cadence, and the tests stay fast."""
    monkeypatch.setattr(usage, "FLUSH_EVERY", timedelta(minutes=30))
    return UsageRollup()


def book(
    user, team: Team, gpu: GPU, start: datetime, end: datetime, memory_mb: int | None = None
) -> Reservation:
    """A booking as the booking service leaves it, at any time (the service refuses the past)."""
    reservation = Reservation.objects.create(owner=user, team=team, start=start, end=end, booked_end=end)
    Allocation.objects.create(reservation=reservation, gpu=gpu, memory_mb=memory_mb, start=start, end=end)
    return reservation


def card(index: int, *, util: int | None = 50, memory_mb: int = 1000, processes: int = 1) -> GPUInfo:
    """box1's card `index` (24 GiB), as its report says."""
    reported = make_snapshot("box1", gpus=4, util=util or 0, processes=processes).gpus[index]
    return replace(reported, utilization_pct=util, memory_used_mb=memory_mb)


def play(
    rollup: UsageRollup,
    reports: Callable[[datetime], list[GPUInfo]],
    since: datetime,
    until: datetime,
    *,
    server_id: int,
) -> None:
    """A round every EVERY over [since, until] with reports(t), flushed whenever the rollup asks (as
    usage_observe does after the round commits), and once at the end. The first flush loads, as
    start_rollup's does when the collector starts."""
    rollup.flush(since)
    t = since
    while t <= until:
        if rollup.observe([(server_id, c) for c in reports(t)], t):
            rollup.flush(t)
        t += EVERY
    rollup.flush(until)


def total(rows, field: str) -> float:
    return rows.aggregate(total=Sum(field))["total"] or 0


# --- the arithmetic --------------------------------------------------------------------------------


def test_it_counts_a_booked_card_used_half_the_time(alice, team, box, base, rollup):
    book(alice, team, box[0], base, base + 2 * H)
    play(rollup, lambda t: [card(0, util=50)], base - MIN, base + 2 * H + MIN, server_id=box[0].server_id)

    mine = UsageHour.objects.filter(gpu=box[0], user=alice)
    assert list(mine.values_list("start", "gpu_hours_booked")) == [(base, 1.0), (base + H, 1.0)]
    assert total(mine, "gpu_hours_booked") == pytest.approx(2.0)
    assert total(mine, "gpu_hours_used") == pytest.approx(1.0)
    assert total(mine, "idle_hours") == 0  # a process runs on it
    assert total(mine, "memory_gb_hours_booked") == pytest.approx(2 * 24)  # a whole card: all its memory
    assert set(mine.values_list("team", flat=True)) == {team.pk}
    # The minute before and after the booking is the card's, attributed to nobody.
    unbooked = UsageHour.objects.filter(gpu=box[0], user=None)
    assert total(unbooked, "gpu_hours_unbooked") == pytest.approx(2 / 60, abs=1e-6)
    assert total(unbooked, "gpu_hours_used") == pytest.approx(1 / 60, abs=1e-6)


def test_a_memory_share_counts_its_fraction_of_the_card(alice, team, box, base, rollup):
    book(alice, team, box[0], base, base + 2 * H, memory_mb=8 * GB)  # 8 of 24 GiB: a third
    play(rollup, lambda t: [card(0, util=60)], base, base + 2 * H, server_id=box[0].server_id)

    mine = UsageHour.objects.filter(user=alice)
    assert total(mine, "gpu_hours_booked") == pytest.approx(2 / 3)
    assert total(mine, "memory_gb_hours_booked") == pytest.approx(16)
    assert total(mine, "gpu_hours_used") == pytest.approx(0.6 * 2 / 3, rel=0.02)
    # The rest of the card nobody booked; the card's whole use adds up over both rows.
    free = UsageHour.objects.filter(user=None)
    assert total(free, "gpu_hours_unbooked") == pytest.approx(4 / 3, rel=0.02)
    assert total(UsageHour.objects.all(), "gpu_hours_used") == pytest.approx(0.6 * 2, rel=0.02)


def test_idle_hours_are_the_booked_ones_without_a_process_nor_utilization(alice, team, box, base, rollup):
    book(alice, team, box[0], base, base + 2 * H)

    def reports(t: datetime) -> list[GPUInfo]:
        if t <= base + H:  # the first hour: nothing runs
            return [card(0, util=0, processes=0)]
        return [card(0, util=80, processes=1)]

    play(rollup, reports, base - MIN, base + 2 * H, server_id=box[0].server_id)
    first, second = UsageHour.objects.filter(user=alice).order_by("start")
    assert (first.idle_hours, first.gpu_hours_used) == (pytest.approx(1.0), 0)
    assert (second.idle_hours, second.gpu_hours_used) == (0, pytest.approx(0.8))


def test_an_unknown_utilization_or_process_list_is_never_idle(alice, team, box, base, rollup):
    book(alice, team, box[0], base, base + H)
    unknown = replace(card(0, util=0, processes=0), processes=None)
    play(rollup, lambda t: [unknown], base, base + H, server_id=box[0].server_id)
    row = UsageHour.objects.get(user=alice)
    assert (row.gpu_hours_booked, row.idle_hours) == (pytest.approx(1.0), 0)


def test_it_keeps_the_peak_memory_of_each_hour(alice, team, box, base, rollup):
    book(alice, team, box[0], base, base + 2 * H)

    def reports(t: datetime) -> list[GPUInfo]:
        return [card(0, memory_mb=20_000 if t == base + 30 * MIN else 3_000 if t < base + H else 5_000)]

    play(rollup, reports, base, base + 2 * H, server_id=box[0].server_id)
    assert list(UsageHour.objects.filter(user=alice).values_list("peak_memory_mb", flat=True)) == [
        20_000,
        5_000,
    ]


def test_a_gap_in_the_reports_is_not_counted(alice, team, box, base, rollup):
    book(alice, team, box[0], base, base + H)
    seen = {base + 10 * MIN, base + 10 * MIN + EVERY, base + 11 * MIN + EVERY, base + 11 * MIN + 2 * EVERY}
    play(
        rollup, lambda t: [card(0, util=100)] if t in seen else [], base, base + H, server_id=box[0].server_id
    )
    row = UsageHour.objects.get(user=alice)
    # Booked is the window's; used only the two intervals between reports that came in time.
    assert (row.gpu_hours_booked, row.gpu_hours_used) == (pytest.approx(1.0), pytest.approx(2 * 20 / 3600))


def test_it_splits_a_report_interval_at_the_turn_of_the_hour(alice, team, box, base, rollup):
    book(alice, team, box[0], base, base + 2 * H)
    ten = timedelta(seconds=10)
    rollup.flush(base)
    for t in (base + H - ten, base + H + ten):
        rollup.observe([(box[0].server_id, card(0, util=100))], t)
    rollup.flush(base + H + ten)
    used = dict(UsageHour.objects.filter(user=alice).values_list("start", "gpu_hours_used"))
    assert used == {base: pytest.approx(10 / 3600), base + H: pytest.approx(10 / 3600)}


# --- writes, restarts, sums, pruning -------------------------------------------------------------


def _rows() -> list[tuple]:
    fields = [
        "start",
        "gpu",
        "user",
        "gpu_hours_booked",
        "gpu_hours_used",
        "gpu_hours_unbooked",
        "idle_hours",
    ]
    return [
        tuple(round(v, 9) if isinstance(v, float) else v for v in row)
        for row in UsageHour.objects.order_by("start", "gpu", "user").values_list(*fields)
    ]


def test_a_flush_writes_absolute_values_and_a_restart_goes_on(alice, team, box, base, rollup):
    book(alice, team, box[0], base, base + 2 * H)
    server = box[0].server_id
    play(rollup, lambda t: [card(0, util=50)], base, base + H + 30 * MIN, server_id=server)
    written = _rows()
    rollup.flush(base + H + 30 * MIN)  # the same moment again: the same rows, nothing added
    assert _rows() == written

    restarted = UsageRollup()  # a new collector process: it reloads the hours it holds
    restarted.flush(base + H + 30 * MIN)
    assert _rows() == written
    play(restarted, lambda t: [card(0, util=50)], base + H + 30 * MIN + EVERY, base + 2 * H, server_id=server)
    mine = UsageHour.objects.filter(user=alice)
    assert total(mine, "gpu_hours_booked") == pytest.approx(2.0)
    # Everything but the restart's first interval, which no report opened.
    assert total(mine, "gpu_hours_used") == pytest.approx(1.0 - 0.5 * (EVERY / H), abs=1e-6)


def test_a_restart_fills_the_bookings_of_the_hours_it_missed(alice, team, box, base, rollup):
    book(alice, team, box[0], base, base + 3 * H)
    play(rollup, lambda t: [card(0, util=50)], base, base + 30 * MIN, server_id=box[0].server_id)
    UsageRollup().flush(base + 3 * H)  # down for hours: booked counts, use is unknown (none counted)
    booked = dict(UsageHour.objects.filter(user=alice).values_list("start", "gpu_hours_booked"))
    assert booked == {base: 1.0, base + H: 1.0, base + 2 * H: 1.0}
    assert total(UsageHour.objects.filter(start__gt=base), "gpu_hours_used") == 0


def test_the_day_and_team_tables_are_the_sums_of_the_hours(alice, bob, charlie, team, box, base, rollup):
    other = charlie.memberships.get().team
    book(alice, team, box[0], base, base + 2 * H)
    book(bob, team, box[1], base + H, base + 2 * H, memory_mb=12 * GB)
    book(charlie, other, box[2], base, base + H)
    play(
        rollup, lambda t: [card(i, util=40) for i in range(4)], base, base + 2 * H, server_id=box[0].server_id
    )
    for field in ("gpu_hours_booked", "gpu_hours_used", "gpu_hours_unbooked", "idle_hours"):
        hours = total(UsageHour.objects.all(), field)
        assert total(UsageDay.objects.all(), field) == pytest.approx(hours)
        assert total(UsageTeamHour.objects.all(), field) == pytest.approx(hours)
    assert total(UsageTeamHour.objects.filter(team=team), "gpu_hours_booked") == pytest.approx(2.5)
    assert UsageTeamHour.objects.filter(team=None).exists()  # the unbooked time, as a team of its own


def test_it_prunes_past_the_retention(settings, box, base):
    settings.USAGE_RETENTION_DAYS = 30
    now = timezone.now()
    for days in (31, 29):
        start = hour_of(now - timedelta(days=days))
        at = {"start": start, "gpu_hours_unbooked": 1}
        UsageHour.objects.create(**at, hour_of_week=0, gpu=box[0], server=box[0].server)
        UsageDay.objects.create(**at, day=timezone.localdate(start), server=box[0].server)
        UsageTeamHour.objects.create(**at, hour_of_week=0)
    assert usage_prune(now=now) == 3
    assert usage_prune(now=now) == 0  # nothing more
    for model in (UsageHour, UsageDay, UsageTeamHour):
        assert model.objects.get().start == hour_of(now - timedelta(days=29))


# --- jobs by outcome -----------------------------------------------------------------------------


def _job(user, team: Team, gpus: list[str], status: str, finished_at: datetime) -> Job:
    return Job.objects.create(
        owner=user, team=team, gpu_uuids=gpus, name="train.py", status=status, finished_at=finished_at
    )


def test_it_counts_finished_jobs_by_outcome_once_on_their_first_card(alice, team, box, base, rollup):
    book(alice, team, box[0], base, base + H)
    two_cards = [box[1].uuid, box[0].uuid]
    _job(alice, team, [box[0].uuid], Job.Status.SUCCEEDED, base + 10 * MIN)
    _job(alice, team, two_cards, Job.Status.FAILED, base + 20 * MIN)
    _job(alice, team, [box[0].uuid], Job.Status.TIMED_OUT, base + 30 * MIN)
    _job(alice, team, [], Job.Status.CANCELLED, base + 30 * MIN)  # cancelled while pending: no card
    lost = _job(alice, team, [box[0].uuid], Job.Status.LOST, base + 40 * MIN)
    rollup.flush(base + 50 * MIN)

    def counts(gpu: GPU) -> tuple[int, int, int]:
        row = UsageHour.objects.get(gpu=gpu, user=alice)
        return row.jobs_succeeded, row.jobs_failed, row.jobs_other

    assert counts(box[0]) == (1, 0, 2)
    assert counts(box[1]) == (0, 1, 0)  # its first card, however many it ran on
    # The worker came back and recorded its end after all: the job counts once, as it ended.
    Job.objects.filter(pk=lost.pk).update(status=Job.Status.SUCCEEDED, finished_at=base + 45 * MIN)
    rollup.flush(base + 50 * MIN)
    assert counts(box[0]) == (2, 0, 1)


def test_ended_interactive_sessions_count_in_a_column_of_their_own(alice, team, box, base, rollup):
    booking = book(alice, team, box[0], base, base + H)
    common = {"owner": alice, "reservation": booking, "server": box[0].server, "gpu_uuids": [box[0].uuid]}
    InteractiveSession.objects.create(
        **common, kind="jupyterlab", status="ended", finished_at=base + 10 * MIN
    )
    InteractiveSession.objects.create(**common, kind="exec", status="ended", finished_at=base + 20 * MIN)
    InteractiveSession.objects.create(**common, kind="exec", status="failed", finished_at=base + 20 * MIN)
    rollup.flush(base + 50 * MIN)
    row = UsageHour.objects.get(gpu=box[0], user=alice)
    assert (row.sessions, row.jobs_succeeded + row.jobs_failed + row.jobs_other) == (2, 0)


# --- the collector's hook ------------------------------------------------------------------------


def test_the_ingest_feeds_a_started_rollup_and_it_writes_after_the_commit(
    alice, team, box, base, monkeypatch, django_capture_on_commit_callbacks
):
    rollup = UsageRollup()
    book(alice, team, box[0], base, base + H)
    snapshot = make_snapshot("box1", gpus=4, util=25)
    for seconds in range(0, 301, 10):
        with django_capture_on_commit_callbacks(execute=True):
            servers_report_ingest(snapshots=[snapshot], now=base + timedelta(seconds=seconds), rollup=rollup)
    row = UsageHour.objects.get(gpu=box[0], user=alice)
    assert row.gpu_hours_booked == pytest.approx(5 / 60)
    assert 0 < row.gpu_hours_used <= 0.25 * 5 / 60


def test_without_a_rollup_the_ingest_writes_no_usage(
    alice, team, box, base, monkeypatch, django_capture_on_commit_callbacks
):
    """Only the portal's worker rolls usage up: the same rounds as above, with no rollup started."""
    book(alice, team, box[0], base, base + H)
    snapshot = make_snapshot("box1", gpus=4, util=25)
    for seconds in range(0, 301, 10):
        with django_capture_on_commit_callbacks(execute=True):
            servers_report_ingest(snapshots=[snapshot], now=base + timedelta(seconds=seconds))
    assert not UsageHour.objects.exists()


# --- the API, the CSV and the pages --------------------------------------------------------------


@pytest.fixture
def seeded(alice, bob, leader, charlie, team, box, base, rollup) -> dict:
    """Two hours of box1: alice's whole card 0, bob's 12 GiB share of card 1 in the second hour,
    charlie's (another team) card 2 in the first; card 3 unbooked. alice ran two jobs."""
    other = charlie.memberships.get().team
    book(alice, team, box[0], base, base + 2 * H)
    book(bob, team, box[1], base + H, base + 2 * H, memory_mb=12 * GB)
    idle = book(charlie, other, box[2], base, base + H)
    Reservation.objects.filter(pk=idle.pk).update(idle_minutes=45)
    _job(alice, team, [box[0].uuid], Job.Status.SUCCEEDED, base + 10 * MIN)
    _job(alice, team, [box[0].uuid], Job.Status.FAILED, base + 70 * MIN)
    play(
        rollup, lambda t: [card(i, util=40) for i in range(4)], base, base + 2 * H, server_id=box[0].server_id
    )
    return {"other": other, "day": timezone.localdate(base)}


def api(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def api_rows(viewer, **params) -> dict:
    response = api(viewer).get("/api/v1/usage/", params)
    assert response.status_code == 200, response.json()
    return {row["key"]: row for row in response.json()["results"]}


@pytest.mark.parametrize("group_by", ["user", "team", "server", "gpu", "day", "week", "month"])
def test_the_api_groups_by_each_value_and_each_row_carries_every_figure(admin_user, seeded, group_by):
    rows = api_rows(admin_user, group_by=group_by)
    assert rows
    for row in rows.values():
        assert set(COLUMNS) <= set(row)
    booked = sum(row["gpu_hours_booked"] for row in rows.values())
    assert booked == pytest.approx(2 + 0.5 + 1)  # alice 2, bob half a card for an hour, charlie 1
    assert sum(row["jobs"] for row in rows.values()) == 2


def test_the_api_rows_by_user_and_card(admin_user, seeded, box):
    by_user = api_rows(admin_user)
    assert set(by_user) == {"alice", "bob", "charlie", None}
    alice = by_user["alice"]
    assert (alice["gpu_hours_booked"], alice["jobs_succeeded"], alice["jobs_failed"]) == (2.0, 1, 1)
    assert alice["gpu_hours_used"] == pytest.approx(0.8, abs=1e-3) and alice["utilization_pct"] == 40.0
    assert alice["memory_gb_hours_booked"] == 48 and alice["peak_memory_mb"] == 1000
    assert by_user["bob"]["memory_gb_hours_booked"] == 12 and by_user[None]["label"] == "(unbooked)"
    by_card = api_rows(admin_user, group_by="gpu")
    assert by_card[box[3].uuid]["gpu_hours_unbooked"] == pytest.approx(2.0)
    assert by_card[box[3].uuid]["label"] == "box1 GPU 3"


def test_the_api_filters_like_the_page(leader, seeded, box):
    day = seeded["day"]
    # Two hours may straddle midnight: the day and the next hold them all.
    assert set(api_rows(leader, since=day.isoformat(), until=(day + timedelta(days=1)).isoformat())) == {
        "alice",
        "bob",
    }
    assert api_rows(leader, since=(day + timedelta(days=2)).isoformat()) == {}
    assert set(api_rows(leader, user="bob")) == {"bob"}
    assert set(api_rows(leader, team="vision-lab")) == {"alice", "bob"}
    assert api_rows(leader, team="nope") == {} and api_rows(leader, server="nope") == {}
    assert set(api_rows(leader, server="box1", group_by="server")) == {"box1"}


@pytest.mark.parametrize(
    ("params", "field", "says"),
    [
        ({"since": "yesterday"}, "since", "write it as YYYY-MM-DD"),
        ({"group_by": "hour"}, "group_by", "use one of user, team, server, gpu, day, week, month"),
        ({"since": "2026-02-01", "until": "2026-01-01"}, "until", "swap them"),
    ],
)
def test_a_bad_filter_is_a_400_that_says_what_to_write(alice, params, field, says):
    response = api(alice).get("/api/v1/usage/", params)
    assert response.status_code == 400
    assert says in " ".join(response.json()["errors"][field])


@pytest.mark.parametrize(
    ("who", "sees"),
    [
        ("alice", {"alice"}),  # the owner: her own
        ("bob", {"bob"}),  # a teammate: not alice's
        ("charlie", {"charlie"}),  # an outsider
        ("leader", {"alice", "bob"}),  # the team's, not the other team's nor the unbooked time
        ("admin", {"alice", "bob", "charlie", None}),
    ],
)
def test_everyone_sees_their_own_leaders_their_teams_admins_all(seeded, admin_user, who, sees):
    user = admin_user if who == "admin" else UserFactory(username=who)
    assert set(api_rows(user)) == sees
    assert set(api_rows(user, user="alice")) == sees & {"alice"}


def test_a_leader_who_is_a_plain_member_elsewhere_also_sees_their_own_rows_there(seeded, leader, box, base):
    MembershipFactory(team=seeded["other"], user=leader)
    UsageDay.objects.create(
        start=base,
        day=seeded["day"],
        server=box[3].server,
        user=leader,
        team=seeded["other"],
        gpu_hours_booked=1,
    )
    assert set(api_rows(leader)) == {"alice", "bob", "leader"}


def test_the_api_wants_a_login(seeded):
    assert APIClient().get("/api/v1/usage/").status_code in (401, 403)


def test_the_csv_has_the_table_with_the_same_filters(client, leader, seeded):
    client.force_login(leader)
    response = client.get("/reports/usage.csv", {"group_by": "user"})
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    assert "by-user.csv" in response["Content-Disposition"]
    lines = list(csv.reader(io.StringIO(response.content.decode())))
    assert lines[0] == list(COLUMNS)
    assert [line[0] for line in lines[1:]] == ["alice", "bob"]
    assert client.get("/reports/usage.csv", {"user": "bob"}).content.decode().count("\n") == 2
    bad = client.get("/reports/usage.csv", {"until": "soon"})
    assert bad.status_code == 400 and "YYYY-MM-DD" in bad.content.decode()


def test_the_page_shows_a_leader_the_teams_month(client, leader, seeded):
    client.force_login(leader)
    response = client.get("/reports/")
    assert response.status_code == 200
    page = response.content.decode()
    for canvas in ("chart-users", "chart-booked-used", "chart-heatmap", "chart-jobs"):
        assert f'id="{canvas}"' in page
    assert 'id="chart-idle"' not in page  # no booking of the team sat idle
    report = response.context["report"]
    assert {row["key"] for row in report["table"]} == {"alice", "bob"}
    assert report["totals"]["booked"]["gpu_hours_booked"] == pytest.approx(2.5)
    assert report["charts"]["jobs"] == {"succeeded": 1, "failed": 1, "other": 0}
    assert "report-data" in page and 'id="report-csv"' in page
    assert "/reports/usage.csv?since=" in page  # the export keeps the page's period


def test_the_page_lists_the_most_idle_bookings_to_who_may_see_them(client, admin_user, alice, seeded):
    client.force_login(admin_user)
    report = client.get("/reports/").context["report"]
    assert [r.owner.username for r in report["idle_bookings"]] == ["charlie"]
    assert report["charts"]["idle"][0]["hours"] == 0.75  # 45 minutes, not rounded to 0.8
    assert any(cell["v"] is not None for cell in report["charts"]["heatmap"])
    client.force_login(alice)
    assert client.get("/reports/").context["report"]["idle_bookings"] == []


def test_a_bad_filter_on_the_page_is_shown_beside_its_field(client, alice, seeded):
    client.force_login(alice)
    response = client.get("/reports/", {"since": "nope"})
    assert response.status_code == 200 and "report" not in response.context
    assert "write it as YYYY-MM-DD" in response.content.decode()


def test_the_team_page_shows_each_members_use_against_their_quota(client, leader, alice, team, box):
    team.gpu_hours_per_week = 40
    team.save()
    alice.memberships.filter(team=team).update(gpu_hours_per_week=10, max_cards=2)
    monday = timezone.localdate() - timedelta(days=timezone.localdate().weekday())
    week = datetime.combine(monday, datetime.min.time(), timezone.get_current_timezone())
    book(alice, team, box[0], week, week + 5 * H)  # 5 GPU-hours this week
    client.force_login(leader)
    page = client.get(f"/teams/{team.slug}/").content.decode()
    row = page[page.index('data-member="alice"') :].split("</tr>")[0]
    assert 'data-quota-bar="gpu-hours"' in row and "width: 50%" in row
    assert 'data-quota-bar="cards"' in row
    leader_row = page[page.index('data-member="leader"') :].split("</tr>")[0]
    assert "(the team's limit)" in leader_row  # no quota of their own: the team's


def test_a_person_deleted_while_their_hour_is_held_costs_only_their_rows(alice, bob, team, box, base, rollup):
    book(alice, team, box[0], base, base + H)
    book(bob, team, box[1], base, base + H)
    server = box[0].server_id
    play(rollup, lambda t: [card(0), card(1)], base, base + 20 * MIN, server_id=server)
    bob.delete()  # his bookings go with him; the rollup still holds his figures
    play(rollup, lambda t: [card(0), card(1)], base + 20 * MIN + EVERY, base + 40 * MIN, server_id=server)
    assert UsageHour.objects.get(user=alice).gpu_hours_booked == pytest.approx(40 / 60)
    assert UsageHour.objects.get(gpu=box[1], user=None).gpu_hours_unbooked > 0  # his card, free now

"""The per-server 7-day timeline: rows, bar positions, stacking, privacy, and its query budget."""

from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from gpus.booking import reservation_cancel, reservation_create
from gpus.models import Server
from gpus.timeline import server_timeline_rows, timeline_axis
from portal.timefmt import format_time
from tests.factories import MembershipFactory, UserFactory

H = timedelta(hours=1)
D = timedelta(days=1)
BOOKABLE = 24 * 1024 - 300 - 512  # make_snapshot's card: total - driver reserved - headroom
DAY_PCT = 100 / 7


@pytest.fixture
def server(box):
    return Server.objects.get(name="box1")


@pytest.fixture
def w0():
    """The window's start: a whole hour, a day ahead, so bookings in it are never in the past."""
    return timezone.now().replace(minute=0, second=0, microsecond=0) + D


def book(user, gpus, start, hours=2, memory_mb=None, **kw):
    return reservation_create(
        user=user, gpus=[g.uuid for g in gpus], start=start, end=start + hours * H, memory_mb=memory_mb, **kw
    )


def page_url(name="box1"):
    return reverse("server_timeline", args=[name])


def test_it_lists_every_card_with_reserve_links(client, alice, box):
    client.force_login(alice)
    response = client.get(page_url())
    html = response.content.decode()
    assert response.status_code == 200
    assert html.count('class="tl-row" data-gpu-uuid=') == 4
    assert html.index('data-gpu-uuid="GPU-box1-00"') < html.index('data-gpu-uuid="GPU-box1-03"')
    assert f"{reverse('reservation_new')}?server=box1&amp;gpu=GPU-box1-02" in html
    assert f"{reverse('reservation_new')}?server=box1" in html
    assert "23.2 GiB bookable" in html
    assert '<span class="badge online">Online</span>' in html
    assert html.count("free all 7 days") == 4


def test_it_returns_one_plain_row_per_card_in_index_order(alice, server, w0):
    rows = server_timeline_rows(server, alice, start=w0)
    assert [(r["index"], r["uuid"], r["bookable_mb"]) for r in rows] == [
        (i, f"GPU-box1-{i:02d}", BOOKABLE) for i in range(4)
    ]
    assert all(r["bars"] == [] for r in rows)


def test_it_places_a_whole_card_bar_by_time(alice, box, server, w0):
    r = book(alice, box[1:2], w0 + D, hours=24, note="resnet sweep")
    rows = server_timeline_rows(server, alice, start=w0)
    assert rows[0]["bars"] == [] and rows[2]["bars"] == []
    (bar,) = rows[1]["bars"]
    assert bar["left"] == pytest.approx(DAY_PCT, abs=0.001)
    assert bar["width"] == pytest.approx(DAY_PCT, abs=0.001)
    assert (bar["top"], bar["height"]) == (0, 100)
    assert bar["who"] == "you" and bar["kind"] == "own" and bar["memory"] == "whole card"
    assert bar["note"] == "resnet sweep" and "resnet sweep" in bar["title"]
    assert bar["url"] == reverse("reservation_detail", args=[r.pk])
    assert not bar["clipped_start"] and not bar["clipped_end"]


def test_it_stacks_overlapping_shared_bookings_without_overlap_on_screen(alice, bob, box, server, w0):
    book(bob, box[:1], w0, hours=10, memory_mb=8192)
    book(alice, box[:1], w0 + 5 * H, hours=10, memory_mb=8192)
    # Overlaps only alice's: first fit puts it back at the top, beside bob's, which has ended.
    book(alice, box[:1], w0 + 12 * H, hours=8, memory_mb=4096)
    bars = server_timeline_rows(server, alice, start=w0)[0]["bars"]
    share = round(100 * 8192 / BOOKABLE, 3)
    assert [(b["who"], b["kind"], b["top"], b["height"]) for b in bars] == [
        ("bob", "team", 0, share),
        ("you", "own", share, share),
        ("you", "own", 0, round(100 * 4096 / BOOKABLE, 3)),
    ]
    assert all(b["memory"] in ("8 GiB", "4 GiB") for b in bars)
    for i, a in enumerate(bars):
        for b in bars[i + 1 :]:
            in_time = a["left"] < b["left"] + b["width"] and b["left"] < a["left"] + a["width"]
            on_screen = a["top"] < b["top"] + b["height"] and b["top"] < a["top"] + a["height"]
            assert not (in_time and on_screen), (a, b)
            assert a["top"] + a["height"] <= 100


def test_it_clips_bookings_to_the_window(alice, box, server, w0):
    book(alice, box[:1], w0 + 6 * D, hours=48)
    book(alice, box[1:2], w0, hours=48)
    (late,) = server_timeline_rows(server, alice, start=w0)[0]["bars"]
    assert late["left"] == pytest.approx(6 * DAY_PCT, abs=0.001)
    assert late["width"] == pytest.approx(DAY_PCT, abs=0.001)
    assert late["clipped_end"] and not late["clipped_start"]
    assert late["end"] == format_time(w0 + 8 * D)  # the label keeps the real end

    rows = server_timeline_rows(server, alice, start=w0 + D)
    (early,) = rows[1]["bars"]
    assert (early["left"], early["clipped_start"], early["clipped_end"]) == (0, True, False)
    assert early["width"] == pytest.approx(DAY_PCT, abs=0.001)
    assert rows[0]["bars"][0]["width"] == pytest.approx(2 * DAY_PCT, abs=0.001)


def test_it_leaves_out_bookings_outside_the_window(alice, box, server, w0):
    book(alice, box[:1], w0 + 8 * D, hours=2)
    assert server_timeline_rows(server, alice, start=w0)[0]["bars"] == []


def test_it_leaves_out_cancelled_bookings(alice, box, server, w0):
    r = book(alice, box[:1], w0 + H)
    reservation_cancel(user=alice, reservation=r)
    assert all(row["bars"] == [] for row in server_timeline_rows(server, alice, start=w0))


def test_it_hides_the_owner_from_outsiders(client, alice, charlie, box, server, w0):
    r = book(alice, box[:1], w0 + H)
    (bar,) = server_timeline_rows(server, charlie, start=w0)[0]["bars"]
    assert (bar["who"], bar["kind"], bar["url"]) == ("another user", "other", None)
    client.force_login(charlie)
    html = client.get(page_url()).content.decode()
    assert "another user" in html
    assert "alice" not in html
    assert reverse("reservation_detail", args=[r.pk]) not in html


def test_it_names_and_links_the_owner_for_teammates_and_admins(client, alice, bob, admin_user, box, w0):
    r = book(alice, box[:1], w0 + H)
    detail = reverse("reservation_detail", args=[r.pk])
    for viewer, kind in ((bob, "team"), (admin_user, "other")):
        client.force_login(viewer)
        html = client.get(page_url()).content.decode()
        assert f'<a href="{detail}" class="tl-bar {kind}' in html
        assert '<span class="tl-who">alice</span>' in html


def test_it_names_the_booking_team_not_any_shared_team(alice, box, server, w0):
    """Someone in alice's other team only does not see her bookings for Vision Lab by name."""
    other_team = MembershipFactory(user=alice).team
    dave = MembershipFactory(team=other_team, user=UserFactory(username="dave")).user
    book(alice, box[:1], w0 + H, team="vision-lab")
    (bar,) = server_timeline_rows(server, dave, start=w0)[0]["bars"]
    assert bar["who"] == "another user" and bar["url"] is None


def test_it_reads_a_fixed_number_of_queries(client, alice, bob, charlie, box, server, w0):
    book(alice, box[:1], w0 + H)
    with CaptureQueriesContext(connection) as one:
        server_timeline_rows(server, alice, start=w0)
    client.force_login(alice)
    with CaptureQueriesContext(connection) as page_one:
        assert client.get(page_url()).status_code == 200

    for i, user in enumerate((alice, bob, charlie)):
        book(user, box[1:], w0 + (10 + 30 * i) * H, hours=4, memory_mb=2048)
        book(user, box[1:], w0 + (14 + 30 * i) * H, hours=4)
    with CaptureQueriesContext(connection) as many:
        rows = server_timeline_rows(server, alice, start=w0)
    with CaptureQueriesContext(connection) as page_many:
        assert client.get(page_url()).status_code == 200

    assert sum(len(r["bars"]) for r in rows) == 1 + 3 * 2 * 3
    assert len(one) == len(many) == 3
    assert len(page_one) == len(page_many)


def test_it_pages_by_week(client, alice, box):
    client.force_login(alice)
    day = timezone.localdate() + timedelta(days=3)
    response = client.get(page_url(), {"start": f"{day:%Y-%m-%d}"})
    html = response.content.decode()
    assert response.status_code == 200
    columns = response.context["axis"]["columns"]
    assert [c["date"] for c in columns] == [day + timedelta(days=i) for i in range(7)]
    assert columns[0]["from"] == ""  # a paged week starts at midnight
    assert f'href="{page_url()}?start={day - timedelta(days=7):%Y-%m-%d}"' in html
    assert f'href="{page_url()}?start={day + timedelta(days=7):%Y-%m-%d}"' in html
    assert response.context["axis"]["now_left"] is None


def test_it_starts_at_the_current_hour_and_marks_now(client, alice, box):
    client.force_login(alice)
    response = client.get(page_url())
    axis = response.context["axis"]
    assert axis["start"] == timezone.localtime().replace(minute=0, second=0, microsecond=0)
    assert 0 <= axis["now_left"] < 100 / (7 * 24) + 0.001
    assert 'class="tl-now"' in response.content.decode()


def test_it_explains_an_unreadable_start_and_shows_from_now(client, alice, box):
    client.force_login(alice)
    response = client.get(page_url(), {"start": "next tuesday"})
    assert response.status_code == 200
    assert "use YYYY-MM-DD" in response.content.decode()
    assert response.context["axis"]["now_left"] is not None


def test_it_keeps_day_columns_on_local_dates_across_a_dst_change(settings):
    settings.TIME_ZONE = "Europe/Berlin"
    with timezone.override(ZoneInfo("Europe/Berlin")):
        start = timezone.make_aware(datetime(2025, 3, 27))  # clocks go forward on Sunday 30 March
        axis = timeline_axis(start, start - D)
    assert axis["end"].timestamp() - start.timestamp() == (7 * 24 - 1) * 3600
    assert [c["label"] for c in axis["columns"]][3] == "Sun 30 Mar"
    assert axis["columns"][3]["width"] == pytest.approx(100 * 23 / 167, abs=0.001)
    assert sum(c["width"] for c in axis["columns"]) == pytest.approx(100, abs=0.01)


def test_it_links_each_server_card_on_the_dashboard_to_its_timeline(client, alice, box):
    client.force_login(alice)
    html = client.get(reverse("dashboard_servers")).content.decode()
    assert f'href="{page_url()}">Timeline</a>' in html


def test_it_404s_for_an_unknown_server(client, alice, box):
    client.force_login(alice)
    assert client.get(page_url("nope")).status_code == 404


def test_it_requires_login(client, box):
    response = client.get(page_url())
    assert response.status_code == 302
    assert response.url.startswith(reverse("login"))

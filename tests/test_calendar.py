"""Calendar feeds (gpus/calendars.py): the secret iCalendar address of one's own bookings, a
team's (its leaders) and a server's (admins), read by icalendar's own parser and over real HTTP
as calendar apps do; new secrets; the API's /me/; the pages that show the addresses."""

from __future__ import annotations

import urllib.error
import urllib.request
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from icalendar import Calendar
from rest_framework.test import APIClient

from gpus.booking import reservation_cancel, reservation_create, reservation_extend, reservation_release
from gpus.calendars import calendar_feed_get, calendar_feed_renew
from gpus.models import CalendarFeed, Reservation
from portal.errors import Forbidden
from portal.models import Membership, Profile
from tests.browser import POLL_MS, log_in, page  # noqa: F401 - the fixture
from tests.factories import MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db

H = timedelta(hours=1)
NOTE = "training the detector"


@pytest.fixture
def bookings(alice, bob, charlie, box, t0) -> dict[str, Reservation]:
    """alice: 8 GiB of GPU 0 now, and GPU 1 and 2 whole, later; bob (her teammate): GPU 3 later;
    charlie (another team): GPU 3 after bob."""
    return {
        "alice_now": reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192, note=NOTE),
        "alice_later": reservation_create(user=alice, gpus=[box[1].uuid, box[2].uuid], start=t0, end=t0 + H),
        "bob": reservation_create(user=bob, gpus=[box[3].uuid], start=t0, end=t0 + H),
        "charlie": reservation_create(user=charlie, gpus=[box[3].uuid], start=t0 + H, end=t0 + 2 * H),
    }


def feed_path(feed: CalendarFeed) -> str:
    return reverse("calendar_feed", kwargs={"secret": feed.secret})


def fetch(feed_or_path: CalendarFeed | str, **headers: str):  # type: ignore[no-untyped-def]
    """As a calendar app: no session, no cookies."""
    path = feed_or_path if isinstance(feed_or_path, str) else feed_path(feed_or_path)
    return Client().get(path, headers=headers)


def parse(response) -> Calendar:  # type: ignore[no-untyped-def]
    assert response.status_code == 200, response.status_code
    return Calendar.from_ical(response.content)


def uids(calendar: Calendar) -> set[str]:
    return {str(e["UID"]) for e in calendar.walk("VEVENT")}


def uid(booking: Reservation) -> str:
    return f"reservation-{booking.pk}@localhost"


def events_by_uid(calendar: Calendar) -> dict:
    return {str(e["UID"]): e for e in calendar.walk("VEVENT")}


# --- the feed as RFC 5545 says ------------------------------------------------------------------


def test_it_serves_the_owners_bookings_as_rfc5545(alice, bookings, settings):
    response = fetch(calendar_feed_get(user=alice))
    assert response["Content-Type"] == "text/calendar; charset=utf-8"
    assert response["Content-Disposition"].startswith("inline; filename=")
    assert not response.cookies, "a feed starts no session"
    raw = response.content
    # Every line ends in CRLF, and is folded to at most 75 octets (RFC 5545 3.1).
    assert raw.endswith(b"\r\n") and b"\n" not in raw.replace(b"\r\n", b"")
    assert all(len(line) <= 75 for line in raw.split(b"\r\n")), "an unfolded line"
    calendar = parse(response)
    assert str(calendar["VERSION"]) == "2.0" and str(calendar["PRODID"])
    assert str(calendar["CALSCALE"]) == "GREGORIAN"
    assert str(calendar["X-WR-CALNAME"]) == "GPU bookings · alice"
    assert "X-PUBLISHED-TTL:PT15M" in raw.decode() and "REFRESH-INTERVAL;VALUE=DURATION:PT15M" in raw.decode()
    # Her bookings, not her teammate's nor an outsider's.
    assert uids(calendar) == {uid(bookings["alice_now"]), uid(bookings["alice_later"])}
    now = events_by_uid(calendar)[uid(bookings["alice_now"])]
    for name in ("UID", "DTSTAMP", "DTSTART", "DTEND", "SUMMARY", "URL", "STATUS"):
        assert name in now, name
    assert now.decoded("DTSTART") == bookings["alice_now"].start.replace(microsecond=0)
    assert now.decoded("DTSTART").utcoffset() == timedelta(0) and now.decoded("DTEND").tzinfo is not None
    assert "DTSTART:" in raw.decode() and all(
        line.endswith("Z") for line in raw.decode().split("\r\n") if line.startswith(("DTSTART", "DTEND"))
    ), "times in UTC"
    assert str(now["SUMMARY"]) == "alice · 8 GiB of box1 GPU 0"
    assert str(now["STATUS"]) == "CONFIRMED"
    assert NOTE in str(now["DESCRIPTION"]) and "Vision Lab" in str(now["DESCRIPTION"])
    assert str(now["URL"]) == settings.PORTAL_URL + reverse(
        "reservation_detail", args=[bookings["alice_now"].pk]
    )
    later = events_by_uid(calendar)[uid(bookings["alice_later"])]
    assert str(later["SUMMARY"]) == "alice · 2 cards on box1"
    assert str(later["LOCATION"]) == "box1 GPU 1, 2"


def test_a_booking_cancelled_before_it_began_is_cancelled_and_one_ended_early_ends_then(
    alice, leader, bookings
):
    release_at = bookings["alice_now"].start + 10 * timedelta(minutes=1)
    reservation_release(user=alice, reservation=bookings["alice_now"], now=release_at)
    reservation_cancel(user=alice, reservation=bookings["alice_later"])
    events = events_by_uid(parse(fetch(calendar_feed_get(user=alice))))
    # Kept in the feed, so apps drop it rather than keep a stale copy.
    cancelled = events[uid(bookings["alice_later"])]
    assert str(cancelled["STATUS"]) == "CANCELLED" and "Cancelled by alice" in str(cancelled["DESCRIPTION"])
    # It held its card until it was released: that is what the calendar shows.
    released = events[uid(bookings["alice_now"])]
    assert str(released["STATUS"]) == "CONFIRMED"
    assert released.decoded("DTEND") == release_at.replace(microsecond=0)
    assert str(released["SUMMARY"]).endswith("(released early)")


def test_a_booking_cancelled_while_it_ran_shows_the_part_it_held(alice, bob, leader, bookings):
    held = bookings["alice_now"]
    stop = held.start + timedelta(minutes=20)
    reservation_cancel(user=leader, reservation=held, reason="the deadline moved", now=stop)
    brief = bookings["bob"]  # released seconds after it began: it never really held its card
    reservation_release(user=bob, reservation=brief, now=brief.start + timedelta(seconds=5))
    events = events_by_uid(parse(fetch(calendar_feed_get(user=leader, team=held.team))))
    cancelled = events[uid(held)]
    assert str(cancelled["STATUS"]) == "CONFIRMED" and str(cancelled["SUMMARY"]).endswith("(cancelled)")
    assert cancelled.decoded("DTEND") == stop.replace(microsecond=0)
    assert "Cancelled by leader" in str(cancelled["DESCRIPTION"]) and "the deadline moved" in str(
        cancelled["DESCRIPTION"]
    )
    dropped = events[uid(brief)]
    assert str(dropped["STATUS"]) == "CANCELLED"
    assert dropped.decoded("DTEND") > dropped.decoded("DTSTART"), "RFC 5545: DTEND after DTSTART"


def test_the_descriptions_name_times_in_the_owners_time_zone(alice, bookings):
    Profile.objects.update_or_create(user=alice, defaults={"time_zone": "Asia/Tokyo"})
    reservation_cancel(user=alice, reservation=bookings["alice_later"])
    events = events_by_uid(parse(fetch(calendar_feed_get(user=alice))))
    assert " JST" in str(events[uid(bookings["alice_later"])]["DESCRIPTION"])
    assert str(events[uid(bookings["alice_later"])]["DTSTART"].to_ical().decode()).endswith("Z"), "UTC"


def test_it_shows_bookings_of_the_last_days_and_everything_ahead(alice, box, bookings, settings):
    later = bookings["alice_later"].end
    old = reservation_create(user=alice, gpus=[box[1].uuid], start=later + H, end=later + 2 * H)
    long_ago = timezone.now() - timedelta(days=settings.CALENDAR_PAST_DAYS + 1)
    Reservation.objects.filter(pk=old.pk).update(start=long_ago - H, end=long_ago, booked_end=long_ago)
    calendar = parse(fetch(calendar_feed_get(user=alice)))
    assert uid(old) not in uids(calendar) and uid(bookings["alice_later"]) in uids(calendar)
    settings.CALENDAR_MAX_EVENTS = 1  # the newest first: the later booking stays
    assert uids(parse(fetch(calendar_feed_get(user=alice)))) == {uid(bookings["alice_later"])}


def test_a_share_of_several_cards_says_how_much_of_each(alice, box, t0):
    shared = reservation_create(
        user=alice, gpus=[box[2].uuid, box[3].uuid], memory_mb=8192, start=t0 + 3 * H, end=t0 + 4 * H
    )
    event = events_by_uid(parse(fetch(calendar_feed_get(user=alice))))[uid(shared)]
    assert str(event["SUMMARY"]) == "alice · 8 GiB on each of 2 cards of box1"
    assert "box1 GPU 2, 3 · 8 GiB each" in str(event["DESCRIPTION"])


def test_the_feeds_queries_do_not_grow_with_its_bookings(alice, box, bookings, t0):
    feed = calendar_feed_get(user=alice)
    with CaptureQueriesContext(connection) as few:
        fetch(feed)
    for i in range(2, 12):  # ten more, on another card each hour
        reservation_create(user=alice, gpus=[box[3].uuid], start=t0 + i * H, end=t0 + (i + 1) * H)
    with CaptureQueriesContext(connection) as many:
        assert len(uids(parse(fetch(feed)))) == 12
    assert len(many) == len(few) <= 6, [q["sql"] for q in many.captured_queries]


# --- conditional GETs ---------------------------------------------------------------------------


def test_it_answers_304_while_nothing_changed(alice, box, bookings, t0):
    feed = calendar_feed_get(user=alice)
    first = fetch(feed)
    etag, modified = first["ETag"], first["Last-Modified"]
    assert etag.startswith('"') and first["Cache-Control"] == "private, no-cache"
    again = fetch(feed, if_none_match=etag)
    assert again.status_code == 304 and not again.content and again["ETag"] == etag
    assert fetch(feed, if_modified_since=modified).status_code == 304
    # A new booking of hers is a new feed, with a new tag.
    reservation_create(user=alice, gpus=[box[3].uuid], start=t0 + 5 * H, end=t0 + 6 * H)
    changed = fetch(feed, if_none_match=etag)
    assert changed.status_code == 200 and changed["ETag"] != etag
    # Changed within the same second: Last-Modified still moves on, so If-Modified-Since sees it.
    assert changed["Last-Modified"] != modified
    assert fetch(feed, if_modified_since=modified).status_code == 200
    feed.refresh_from_db()
    assert feed.last_fetched_at is not None and feed.etag == changed["ETag"]


def test_an_extension_changes_the_tag_though_the_booking_records_no_time_for_it(alice, bookings):
    feed = calendar_feed_get(user=alice)
    etag = fetch(feed)["ETag"]
    later = bookings["alice_later"]
    reservation_extend(user=alice, reservation=later, end=later.end + H)
    assert fetch(feed, if_none_match=etag).status_code == 200


# --- who may have which feed ---------------------------------------------------------------------


def test_a_team_feed_is_its_leaders_and_ends_when_they_stop_leading(alice, leader, team, bookings):
    feed = calendar_feed_get(user=leader, team=team)
    calendar = parse(fetch(feed))
    assert str(calendar["X-WR-CALNAME"]) == "Team Vision Lab bookings"
    # The team's bookings, naming who; not the outsider's on the same card.
    assert uids(calendar) == {uid(bookings[k]) for k in ("alice_now", "alice_later", "bob")}
    assert str(events_by_uid(calendar)[uid(bookings["bob"])]["SUMMARY"]).startswith("bob · ")
    with pytest.raises(Forbidden) as refused:
        calendar_feed_get(user=alice, team=team)
    assert refused.value.field == "team"
    Membership.objects.filter(user=leader, team=team).update(role=Membership.Role.MEMBER)
    assert fetch(feed).status_code == 404, "404, not 403: the address does not say it was ever good"


def test_a_server_feed_is_for_admins_and_ends_when_they_stop_being_one(alice, admin_user, box, bookings):
    server = box[0].server
    feed = calendar_feed_get(user=admin_user, server=server)
    calendar = parse(fetch(feed))
    assert str(calendar["X-WR-CALNAME"]) == "Server box1 bookings"
    assert uids(calendar) == {uid(b) for b in bookings.values()}
    with pytest.raises(Forbidden):
        calendar_feed_get(user=alice, server=server)
    admin_user.is_staff = False
    admin_user.save()
    assert fetch(feed).status_code == 404


def test_an_inactive_owners_feed_is_gone(alice, bookings):
    feed = calendar_feed_get(user=alice)
    alice.is_active = False
    alice.save()
    assert fetch(feed).status_code == 404


def test_a_new_secret_ends_the_old_address_at_once(alice, bookings):
    feed = calendar_feed_get(user=alice)
    old = feed_path(feed)
    assert len(feed.secret) >= 43, "at least 32 random bytes"
    assert calendar_feed_get(user=alice).secret == feed.secret, "one feed per owner and scope"
    renewed = calendar_feed_renew(user=alice)
    assert renewed.pk == feed.pk and renewed.secret != feed.secret
    assert fetch(old).status_code == 404
    assert fetch(renewed).status_code == 200
    assert fetch("/calendar/" + "x" * 43 + ".ics").status_code == 404


def test_the_feed_takes_only_get_and_never_logs_a_whole_secret(alice, caplog):
    feed = calendar_feed_get(user=alice)
    response = Client(enforce_csrf_checks=True).post(feed_path(feed))
    assert response.status_code == 405 and response["Allow"] == "GET, HEAD"
    assert Client().head(feed_path(feed)).status_code == 200
    alice.is_active = False  # a refused secret may work again: it must not be in the log either
    alice.save()
    assert fetch(feed).status_code == 404
    assert caplog.records and feed.secret not in caplog.text and feed.secret[:4] in caplog.text


def test_a_calendar_app_reads_it_over_http(live_server, alice, bookings):
    url = live_server.url + feed_path(calendar_feed_get(user=alice))
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.headers["Content-Type"] == "text/calendar; charset=utf-8"
        etag = answer.headers["ETag"]
        calendar = Calendar.from_ical(answer.read())
    assert uids(calendar) == {uid(bookings["alice_now"]), uid(bookings["alice_later"])}
    again = urllib.request.Request(url, headers={"If-None-Match": etag})
    with pytest.raises(urllib.error.HTTPError) as not_modified:
        urllib.request.urlopen(again, timeout=10)
    assert not_modified.value.code == 304


# --- the API ------------------------------------------------------------------------------------


@pytest.fixture
def api() -> APIClient:
    return APIClient()


def test_me_says_who_and_gives_the_calendar_addresses(api, alice, leader, admin_user, team, box, settings):
    api.force_authenticate(alice)
    me = api.get("/api/v1/me/").json()
    assert me["username"] == "alice" and me["email"] == "alice@example.org" and me["is_admin"] is False
    assert me["time_zone"] == settings.TIME_ZONE
    assert me["teams"] == [{"slug": "vision-lab", "name": "Vision Lab", "role": "member"}]
    assert me["calendar_url"] == settings.PORTAL_URL + feed_path(CalendarFeed.objects.get(owner=alice))
    assert me["team_calendar_urls"] == {} and me["server_calendar_urls"] == {}
    assert api.get("/api/v1/me/").json()["calendar_url"] == me["calendar_url"], "made once"
    path = me["calendar_url"].removeprefix(settings.PORTAL_URL)
    assert fetch(path).status_code == 200
    api.force_authenticate(leader)
    assert list(api.get("/api/v1/me/").json()["team_calendar_urls"]) == ["vision-lab"]
    api.force_authenticate(admin_user)
    me = api.get("/api/v1/me/").json()
    assert me["is_admin"] is True and list(me["server_calendar_urls"]) == ["box1"]
    assert fetch(me["server_calendar_urls"]["box1"].removeprefix(settings.PORTAL_URL)).status_code == 200


def test_me_needs_a_sign_in(api):
    assert api.get("/api/v1/me/").status_code == 401


def test_a_new_secret_through_the_api(api, alice, leader, admin_user, team, box, settings):
    api.force_authenticate(alice)
    old = api.get("/api/v1/me/").json()["calendar_url"]
    answer = api.post("/api/v1/me/calendar/", {}, format="json")
    assert answer.status_code == 200, answer.json()
    assert answer.json()["scope"] == "user" and answer.json()["calendar_url"] != old
    assert fetch(old.removeprefix(settings.PORTAL_URL)).status_code == 404
    api.force_authenticate(leader)
    assert api.post("/api/v1/me/calendar/", {"team": "vision-lab"}, format="json").json()["scope"] == "team"
    api.force_authenticate(admin_user)
    assert api.post("/api/v1/me/calendar/", {"server": "box1"}, format="json").json()["server"] == "box1"


@pytest.mark.parametrize(
    ("who", "body", "status", "field"),
    [
        ("alice", {"team": "vision-lab"}, 403, "team"),  # a member, not a leader
        ("charlie", {"team": "vision-lab"}, 400, "team"),  # an outsider: no such team of theirs
        ("alice", {"team": "no-such-team"}, 400, "team"),
        ("alice", {"server": "box1"}, 403, "server"),
        ("admin", {"server": "no-such-box"}, 400, "server"),
        ("leader", {"team": "vision-lab", "server": "box1"}, 400, "server"),
        ("alice", {"teams": "vision-lab"}, 400, "teams"),
        ("alice", {"team": 7}, 400, "team"),
    ],
)
def test_a_refused_new_secret_names_the_field_and_changes_nothing(
    api, alice, leader, charlie, admin_user, box, who, body, status, field
):
    user = {"alice": alice, "leader": leader, "charlie": charlie, "admin": admin_user}[who]
    before = {f.pk: f.secret for f in CalendarFeed.objects.all()}
    api.force_authenticate(user)
    answer = api.post("/api/v1/me/calendar/", body, format="json")
    assert answer.status_code == status, answer.json()
    assert field in answer.json()["errors"], answer.json()
    assert {f.pk: f.secret for f in CalendarFeed.objects.all()} == before


# --- the pages ----------------------------------------------------------------------------------


def test_the_profile_shows_the_address_and_makes_a_new_one(client, alice, bookings):
    client.force_login(alice)
    html = client.get(reverse("profile")).content.decode()
    feed = CalendarFeed.objects.get(owner=alice, scope="user")
    assert 'id="calendar"' in html and feed_path(feed) in html and "webcal://" in html
    assert "From URL" in html and "Subscribe from web" in html and "New Calendar Subscription" in html
    answer = client.post(reverse("calendar_renew"), {"next": reverse("profile")}, follow=True)
    assert answer.redirect_chain[-1][0] == reverse("profile") + "#calendar"
    assert "old one no longer works" in answer.content.decode()
    assert fetch(feed_path(feed)).status_code == 404


def test_the_team_page_shows_leaders_the_team_feed(client, leader, team, admin_user):
    client.force_login(leader)
    html = client.get(reverse("team_detail", args=[team.slug])).content.decode()
    feed = CalendarFeed.objects.get(owner=leader, scope="team", team=team)
    assert feed_path(feed) in html and 'name="team" value="vision-lab"' in html
    client.force_login(admin_user)  # admins who do not lead it have the servers' feeds instead
    assert 'id="calendar"' not in client.get(reverse("team_detail", args=[team.slug])).content.decode()


def test_a_gpu_page_shows_admins_its_servers_feed(client, alice, admin_user, box):
    client.force_login(admin_user)
    html = client.get(reverse("gpu_detail", args=[box[0].uuid])).content.decode()
    feed = CalendarFeed.objects.get(owner=admin_user, scope="server", server=box[0].server)
    assert feed_path(feed) in html and 'name="server" value="box1"' in html
    client.force_login(alice)
    assert 'id="calendar"' not in client.get(reverse("gpu_detail", args=[box[0].uuid])).content.decode()


def test_a_refused_new_link_says_why_and_changes_nothing(client, alice, team):
    client.force_login(alice)
    answer = client.post(reverse("calendar_renew"), {"team": team.slug}, follow=True)
    assert "Only leaders of" in answer.content.decode()
    assert not CalendarFeed.objects.filter(owner=alice, scope="team").exists()


def test_a_new_link_goes_back_only_to_this_site(client, alice):
    client.force_login(alice)
    answer = client.post(reverse("calendar_renew"), {"next": "https://evil.example/"})
    assert answer["Location"] == reverse("profile") + "#calendar"


def test_a_leader_of_two_teams_has_a_feed_for_each(leader, team):
    other = MembershipFactory(user=leader, role=Membership.Role.LEADER).team
    first, second = calendar_feed_get(user=leader, team=team), calendar_feed_get(user=leader, team=other)
    assert first.pk != second.pk and first.secret != second.secret
    assert UserFactory(username="zed").calendar_feeds.count() == 0


# --- in a browser -------------------------------------------------------------------------------


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_the_copy_button_copies_the_address_and_a_new_link_asks_first(page, alice):  # noqa: F811
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    log_in(page, "alice")
    page.goto("/profile/#calendar")
    address = page.input_value("#calendar input[readonly]")
    page.click("#calendar button[data-copy]")
    page.wait_for_function(
        "() => document.querySelector('#calendar button[data-copy]').textContent === 'Copied'",
        polling=POLL_MS,
    )
    assert page.evaluate("navigator.clipboard.readText()") == address
    page.once("dialog", lambda dialog: dialog.dismiss())  # "Make a new link?" — no
    page.click("#calendar .calendar-renew button")
    assert page.input_value("#calendar input[readonly]") == address
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#calendar .calendar-renew button")
    page.wait_for_selector(".message")
    assert page.input_value("#calendar input[readonly]") != address


# --- the secret stays out of logs and the admin -------------------------------------------------


def test_a_feed_that_fails_logs_no_secret(alice, bookings, monkeypatch, caplog):
    """Django's "Internal Server Error: <path>" is cut where it is made (portal/log_filters.py, set
    up at start-up), so every handler gets it cut: here the test's own capture; and so is the web
    server's access log."""
    import logging

    from portal.log_filters import redact_request_logs

    feed = calendar_feed_get(user=alice)

    def broken(**kwargs):
        raise RuntimeError("database away")

    monkeypatch.setattr("gpus.calendar_views.calendar_feed_serve", broken)
    client = Client(raise_request_exception=False)
    with caplog.at_level(logging.ERROR, logger="django.request"):
        assert client.get(feed_path(feed)).status_code == 500
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "/calendar/" in logged and feed.secret not in logged and feed.secret[:4] in logged
    redact_request_logs()  # as the web server's worker does once it has set up its loggers
    access = logging.LogRecord(
        "uvicorn.access", logging.INFO, "", 0, '%s - "%s %s"', ("1.2.3.4", "GET", feed_path(feed)), None
    )
    assert all(f.filter(access) for f in logging.getLogger("uvicorn.access").filters)
    assert feed.secret not in access.getMessage()


def test_the_admin_cannot_spell_a_secret_out_by_filtering(alice, admin_user, bookings):
    feed = calendar_feed_get(user=alice)
    client = Client()
    client.force_login(admin_user)
    listing = client.get("/admin/gpus/calendarfeed/", {"secret__startswith": feed.secret[:1]})
    assert listing.status_code in (302, 400) or "alice" not in listing.content.decode()
    assert feed.secret not in client.get(f"/admin/gpus/calendarfeed/{feed.pk}/change/").content.decode()

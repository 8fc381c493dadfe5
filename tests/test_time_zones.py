"""Each person's time zone (portal/time_zones.py, issue 23): their profile's, else their
browser's, else the portal's; every time shown and typed is in it, and the page names it."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from django import forms
from django.utils import timezone
from django.utils.safestring import mark_safe

from gpus.models import Reservation
from portal.forms import ManyOptionsSelect, TimeZoneForm
from portal.models import Profile

pytestmark = pytest.mark.django_db


def test_times_are_in_the_browsers_zone_and_the_footer_names_it(client, alice, booking):
    client.cookies["browser_tz"] = "Asia/Tokyo"
    client.force_login(alice)
    page = client.get(f"/reservations/{booking.pk}/").content.decode()
    local = timezone.localtime(booking.start, timezone=__import__("zoneinfo").ZoneInfo("Asia/Tokyo"))
    assert local.strftime("%Y-%m-%d %H:%M") in page and "JST" in page
    assert "All times in Asia/Tokyo (your browser's)." in page


def test_the_profiles_zone_wins_and_a_bad_one_is_refused_by_name(client, alice):
    client.cookies["browser_tz"] = "Asia/Tokyo"
    client.force_login(alice)
    answer = client.post("/profile/time-zone/", {"time_zone": "America/New_York"})
    assert answer.status_code == 302 and Profile.objects.get(user=alice).time_zone == "America/New_York"
    assert "All times in America/New_York (yours)." in client.get("/jobs/").content.decode()
    refused = client.post("/profile/time-zone/", {"time_zone": "Mars/Olympus_Mons"})
    assert refused.status_code == 200 and "time_zone" in refused.context["zone_form"].errors
    assert Profile.objects.get(user=alice).time_zone == "America/New_York"


def test_a_bad_browser_cookie_falls_back_to_the_portals_zone(client, alice, settings):
    client.cookies["browser_tz"] = "../../etc/passwd"
    client.force_login(alice)
    assert f"All times in {settings.TIME_ZONE}." in client.get("/jobs/").content.decode()


@pytest.mark.parametrize("sent", ["America%2FNew_York", "America/New_York"])
def test_the_cookie_is_read_as_portal_js_encodes_it_or_raw(client, alice, sent):
    """portal.js writes encodeURIComponent's form (what Chromium sends: test_time_zones_browser.py);
    curl's `-b browser_tz=America/New_York` sends it raw. Both name the zone."""
    client.cookies["browser_tz"] = sent
    client.force_login(alice)
    assert "All times in America/New_York (your browser's)." in client.get("/jobs/").content.decode()


def test_an_encoded_path_is_refused_once_decoded(client, alice, settings):
    client.cookies["browser_tz"] = "..%2F..%2Fetc%2Fpasswd"
    client.force_login(alice)
    assert f"All times in {settings.TIME_ZONE}." in client.get("/jobs/").content.decode()


def test_a_time_typed_in_the_booking_form_is_read_in_the_persons_zone(client, alice, box):
    client.cookies["browser_tz"] = "Asia/Tokyo"
    client.force_login(alice)
    tomorrow = timezone.now().astimezone(__import__("zoneinfo").ZoneInfo("Asia/Tokyo")).date().toordinal() + 1
    day = datetime.fromordinal(tomorrow).strftime("%Y-%m-%d")
    data = {
        "server": "box1",
        "gpus": [box[0].uuid],
        "start": f"{day}T10:00",
        "end": f"{day}T11:00",
        "memory": "",
    }
    client.post("/reservations/new/", data)
    booking = Reservation.objects.get()
    assert booking.start == datetime.fromisoformat(f"{day}T01:00").replace(tzinfo=UTC)


def test_a_sign_in_brings_the_profiles_zone_along(client, alice):
    Profile.objects.update_or_create(user=alice, defaults={"time_zone": "Europe/Berlin"})
    client.force_login(alice)
    assert "All times in Europe/Berlin (yours)." in client.get("/jobs/").content.decode()


# --- the offer after a sign-in (base.html, portal/_time_zone_offer.html) -----------------------


def _offer(page: str) -> bool:
    return 'id="time-zone-offer"' in page


def test_a_first_sign_in_offers_the_browsers_zone_and_using_it_saves_it(client, alice):
    client.cookies["browser_tz"] = "Asia/Tokyo"
    client.force_login(alice)
    page = client.get("/jobs/").content.decode()
    assert _offer(page) and "Use Asia/Tokyo" in page and "Use the portal's (UTC)" in page
    answer = client.post("/profile/time-zone/", {"time_zone": "Asia/Tokyo", "next": "/jobs/"})
    assert answer.status_code == 302 and answer["Location"] == "/jobs/"
    assert Profile.objects.get(user=alice).time_zone == "Asia/Tokyo"
    page = client.get("/jobs/").content.decode()
    assert not _offer(page) and "All times in Asia/Tokyo (yours)." in page


def test_keeping_the_portals_zone_is_an_answer_too(client, alice, settings):
    client.cookies["browser_tz"] = "Asia/Tokyo"
    client.force_login(alice)
    client.post("/profile/time-zone/", {"time_zone": settings.TIME_ZONE, "next": "/jobs/"})
    assert Profile.objects.get(user=alice).time_zone == settings.TIME_ZONE
    client.logout()
    client.force_login(alice)  # a later sign-in: they chose, nothing is offered
    page = client.get("/jobs/").content.decode()
    assert not _offer(page) and f"All times in {settings.TIME_ZONE} (yours)." in page


def test_not_now_saves_nothing_and_is_not_asked_again_in_this_browser(client, alice):
    client.cookies["browser_tz"] = "Asia/Tokyo"
    client.force_login(alice)
    answer = client.post("/profile/time-zone/", {"later": "1", "next": "/reservations/"})
    assert answer.status_code == 302 and answer["Location"] == "/reservations/"
    assert not Profile.objects.filter(user=alice).exclude(time_zone="").exists()
    page = client.get("/jobs/").content.decode()
    assert not _offer(page) and "All times in Asia/Tokyo (your browser's)." in page
    _sign_in_again(client, alice)
    assert not _offer(client.get("/jobs/").content.decode())  # the answer is kept in this browser


def test_nothing_is_offered_where_there_is_nothing_to_decide(client, alice, settings):
    client.force_login(alice)  # no browser zone known: the portal's, named in the footer
    assert not _offer(client.get("/jobs/").content.decode())
    client.cookies["browser_tz"] = settings.TIME_ZONE  # the browser's is the portal's
    assert not _offer(client.get("/jobs/").content.decode())


def test_an_offer_names_no_outside_address_in_its_next(client, alice):
    client.cookies["browser_tz"] = "Asia/Tokyo"
    client.force_login(alice)
    answer = client.post("/profile/time-zone/", {"later": "1", "next": "https://evil.example/"})
    assert answer["Location"] == "/"


def test_an_answer_in_a_shared_browser_is_that_persons_only(client, alice, bob):
    client.cookies["browser_tz"] = "Asia/Tokyo"
    client.force_login(alice)
    client.post("/profile/time-zone/", {"later": "1"})
    _sign_in_again(client, bob)  # the lab's shared computer: bob has not answered
    assert _offer(client.get("/jobs/").content.decode())
    _sign_in_again(client, alice)
    assert not _offer(client.get("/jobs/").content.decode())


def _sign_in_again(client, user) -> None:  # type: ignore[no-untyped-def]
    """Sign out and in as `user` in the same browser: its cookies stay (the test client's logout
    would drop them all)."""
    kept = {name: morsel.value for name, morsel in client.cookies.items() if name != "sessionid"}
    client.logout()
    client.force_login(user)
    for name, value in kept.items():
        client.cookies[name] = value


def test_a_name_of_the_portals_own_zone_or_one_the_form_lacks_is_not_offered(client, alice, settings):
    settings.TIME_ZONE = "UTC"
    client.force_login(alice)
    client.cookies["browser_tz"] = "Etc/UTC"  # UTC by another name: nothing to decide
    assert not _offer(client.get("/jobs/").content.decode())
    client.cookies["browser_tz"] = "posix/Asia/Tokyo"  # a real file, but no choice of the form
    assert not _offer(client.get("/jobs/").content.decode())


def test_an_offer_on_a_page_answering_a_post_sends_no_next(client, alice):
    """A refused profile form is the answer to a POST: going "back" there would be a 405."""
    client.cookies["browser_tz"] = "Asia/Tokyo"
    client.force_login(alice)
    page = client.post("/profile/time-zone/", {"time_zone": "Mars/Olympus_Mons"}).content.decode()
    assert _offer(page) and 'name="next"' not in page.split('id="time-zone-offer"')[1].split("</section>")[0]


def _same_html(html: str) -> str:
    return re.sub(r">\s+<", "><", html).strip()


@pytest.mark.parametrize("value", ["", "Europe/Berlin", "Mars/Olympus_Mons"])
def test_the_zone_field_is_the_html_djangos_select_writes(value):
    """The profile's zone field writes its ~600 options itself (portal.forms.ManyOptionsSelect:
    Django's template took 250 ms a page for them): the field's HTML is Django's Select's, its
    attributes, the chosen zone (or none) and the escaping all the same."""
    ours = TimeZoneForm(initial={"time_zone": value})
    django_s = TimeZoneForm(initial={"time_zone": value})
    django_s.fields["time_zone"].widget = forms.Select(choices=django_s.fields["time_zone"].choices)
    assert _same_html(str(ours["time_zone"])) == _same_html(str(django_s["time_zone"]))
    assert ("selected>Europe/Berlin<" in str(ours["time_zone"])) == (value == "Europe/Berlin")


def test_the_many_options_select_escapes_as_django_does():
    safe = mark_safe("<b>s</b>")  # a label safe already: not escaped again
    choices = [("a&b", "<x> \"q\" 'y'"), ("", "none"), ("2", "two"), ("2", "two again"), ("s", safe)]
    for value in ("a&b", "2", None):
        ours = ManyOptionsSelect(choices=choices).render("f", value, attrs={"id": "f", "data-x": "<'>"})
        django_s = forms.Select(choices=choices).render("f", value, attrs={"id": "f", "data-x": "<'>"})
        assert _same_html(ours) == _same_html(django_s)

"""The booking form within a person's limits (issue 41, bug 5): defaults that fit them, the limits
shown before a submit, and every quota problem at once, in the form as in the API."""

from __future__ import annotations

from datetime import datetime, time, timedelta
from html.parser import HTMLParser

import pytest
from django.urls import reverse
from django.utils import timezone
from django.utils.datastructures import MultiValueDict
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.booking_defaults import length_within
from gpus.forms import LOCAL_INPUT, ReservationForm, local_input
from gpus.models import Reservation
from gpus.quotas import this_week
from portal.errors import QuotaExceeded
from portal.models import AuditEntry

H = timedelta(hours=1)


@pytest.fixture
def student(bob):
    """bob as in the issue: at most 4 h a booking and 1 card at once."""
    bob.memberships.update(max_booking_hours=4, max_cards=1)
    return bob


class _FormValues(HTMLParser):
    """What a browser would send for the page's booking form as rendered: each input's value,
    ticked boxes only, the selected option, the textarea's text."""

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, list[str]] = {}
        self._select: str | None = None
        self._textarea: str | None = None
        self._in_form = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "form" and "booking-form" in (a.get("class") or ""):
            self._in_form = True
        if not self._in_form or (not a.get("name") and tag != "option"):
            return
        name = a.get("name") or ""
        if tag == "input":
            ticked = a.get("type") not in ("checkbox", "radio", "submit") or "checked" in a
            if ticked:
                self.data.setdefault(name, []).append(a.get("value") or "")
        elif tag == "select":
            self._select = name
        elif tag == "option" and self._select and "selected" in a:
            self.data.setdefault(self._select, []).append(a.get("value") or "")
        elif tag == "textarea":
            self._textarea = name
            self.data.setdefault(name, []).append("")

    def handle_data(self, data: str) -> None:
        if self._textarea:
            self.data[self._textarea][-1] += data.strip()

    def handle_endtag(self, tag: str) -> None:
        if tag == "select":
            self._select = None
        elif tag == "textarea":
            self._textarea = None
        elif tag == "form":
            self._in_form = False


def rendered_defaults(client, url: str) -> dict[str, list[str]]:
    page = _FormValues()
    page.feed(client.get(url).content.decode())
    page.data.pop("csrfmiddlewaretoken", None)
    page.data.pop("script", None)  # the size hint's own input, not the booking's
    return page.data


def test_the_rendered_defaults_pass_the_forms_own_validation_and_book(client, student, box):
    client.force_login(student)
    data = rendered_defaults(client, reverse("reservation_new"))
    form = ReservationForm(MultiValueDict(data), user=student)  # what the view reads from the POST
    assert form.is_valid(), form.errors

    response = client.post(reverse("reservation_new"), data)  # form-encoded, as a browser sends
    assert response.status_code == 302, response.context["form"].errors
    reservation = Reservation.objects.get()
    assert reservation.end - reservation.start == 4 * H
    assert reservation.allocations.count() == 1


def test_the_dashboards_reserve_button_books_within_the_limits(client, student, box):
    """A card's Reserve button (?gpu=): the card ticked, the end within 4 h, one plain submit."""
    client.force_login(student)
    url = reverse("reservation_new") + f"?server=box1&gpu={box[2].uuid}&gpu={box[3].uuid}"
    data = rendered_defaults(client, url)
    assert data["gpus"] == [box[2].uuid]  # at most the 1 card bob may hold at once
    response = client.post(reverse("reservation_new"), data)
    assert response.status_code == 302, response.context["form"].errors
    assert [a.gpu_id for a in Reservation.objects.get().allocations.all()] == [box[2].uuid]


def test_the_form_shows_the_limits_before_anything_is_submitted(client, student, box):
    client.force_login(student)
    html = client.get(reverse("reservation_new")).content.decode()
    assert "Your limits: 4 h a booking, 1 card at once." in html
    assert "Empty: 4 h after the start." in html


def test_the_teams_limits_show_where_the_member_has_none(client, alice, team, box):
    team.max_gb = 256
    team.gpu_hours_per_week = 400
    team.save()
    client.force_login(alice)
    html = client.get(reverse("reservation_new")).content.decode()
    assert (
        "Your limits: 336 h a booking, 256 GiB at once for the whole team, "
        "400 GPU-hours per week for the whole team." in html
    )


def test_ticked_cards_win_over_the_counts_default_but_not_over_a_count_typed(client, alice, box, t0):
    client.force_login(alice)
    data = {"gpus": [box[1].uuid], "count": "1", "start": local_input(t0), "end": local_input(t0 + H)}
    assert client.post(reverse("reservation_new"), data).status_code == 302
    data = {"gpus": [box[2].uuid], "count": "2", "start": local_input(t0), "end": local_input(t0 + H)}
    response = client.post(reverse("reservation_new"), data)
    assert "not both" in " ".join(response.context["form"].errors["gpus"])


def test_every_quota_problem_shows_at_once_in_the_form(client, student, box, t0):
    """2 cards for 8 h: the 4 h limit and the 1-card limit on the first submit, each beside its
    field; nothing is written."""
    client.force_login(student)
    data = {
        "gpus": [box[0].uuid, box[1].uuid],
        "start": local_input(t0),
        "end": local_input(t0 + 8 * H),
        "memory": "",
        "note": "",
        "team": "vision-lab",
    }
    response = client.post(reverse("reservation_new"), data)
    assert response.status_code == 200
    errors = response.context["form"].errors
    assert "allows bookings of at most 4 h" in " ".join(errors["end"]), errors
    assert "allows 1 whole card(s) at once" in " ".join(errors["gpus"]), errors
    assert not Reservation.objects.exists() and not AuditEntry.objects.exists()


def test_every_quota_problem_shows_at_once_in_the_api(student, box, t0):
    client = APIClient()
    client.force_authenticate(student)
    body = {"gpus": [box[0].uuid, box[1].uuid], "start": t0.isoformat(), "end": (t0 + 8 * H).isoformat()}
    response = client.post("/api/v1/reservations/", body, format="json")
    assert response.status_code == 400
    answer = response.json()
    assert answer["code"] == "quota_exceeded"
    assert "at most 4 h" in " ".join(answer["errors"]["end"]), answer
    assert "1 whole card(s)" in " ".join(answer["errors"]["gpus"]), answer
    assert not Reservation.objects.exists()


def test_the_member_and_team_limits_are_named_together(student, team, box, t0):
    team.max_gb = 30
    team.save()
    with pytest.raises(QuotaExceeded) as refused:
        reservation_create(user=student, gpus=[box[0].uuid, box[1].uuid], start=t0, end=t0 + 8 * H)
    messages = [m for ms in refused.value.errors.values() for m in ms]
    assert len(messages) == 3, messages  # length, bob's cards, the team's memory
    assert refused.value.message == messages[0]


def test_an_empty_end_is_the_members_longest_booking_when_shorter(student, box, t0):
    reservation = reservation_create(user=student, gpus=[box[0].uuid], start=t0)
    assert reservation.end - reservation.start == 4 * H


def test_a_gib_limit_below_a_card_defaults_to_a_share_of_one(client, bob, box):
    """16 GiB at once and 24 GiB cards: the form offers a 16G share of one card, which books."""
    bob.memberships.update(max_gb=16)
    client.force_login(bob)
    data = rendered_defaults(client, reverse("reservation_new"))
    assert data["memory"] == ["16G"] and data["count"] == ["1"]
    assert client.post(reverse("reservation_new"), data).status_code == 302
    assert [a.memory_mb for a in Reservation.objects.get().allocations.all()] == [16 * 1024]


def test_the_teams_gib_limit_splits_among_the_ticked_cards(client, bob, team, box):
    team.max_gb = 30
    team.save()
    client.force_login(bob)
    url = reverse("reservation_new") + f"?server=box1&gpu={box[0].uuid}&gpu={box[1].uuid}"
    data = rendered_defaults(client, url)
    assert data["memory"] == ["15G"], data  # two whole 24 GiB cards would be 48
    assert client.post(reverse("reservation_new"), data).status_code == 302


def test_whole_cards_stay_the_default_within_the_gib_limit(client, bob, box):
    bob.memberships.update(max_gb=24)
    client.force_login(bob)
    assert rendered_defaults(client, reverse("reservation_new"))["memory"] == [""]


def test_the_default_end_fits_the_gpu_hours_left_this_week(client, alice, bob, team, box, t0, settings):
    """The team's 10 GPU-hours, 7.5 of them booked by alice: bob's default end is the latest that
    fits every week the two bookings reach (2 h 30 within one week; on a Sunday evening next
    week's hours count too), so it is taken as it stands, and a minute more is not."""
    settings.BOOKING_DEFAULT_HOURS = 8
    team.gpu_hours_per_week = 10
    team.save()
    reservation_create(user=alice, gpus=[box[0].uuid], start=t0, end=t0 + 7.5 * H)
    client.force_login(bob)
    data = rendered_defaults(client, reverse("reservation_new"))
    start, end = (datetime.strptime(data[field][0], LOCAL_INPUT) for field in ("start", "end"))
    # Bob's default starts now, alice's booking an hour on: they count against one week's hours
    # only where both, and bob's 2 h 30, end within the week that bob's starts in.
    week_end = this_week(timezone.make_aware(start))[1]
    if t0 + 7.5 * H <= week_end and timezone.make_aware(start) + 2.5 * H <= week_end:
        assert end - start == 2.5 * H
    if end - start < 8 * H:
        longer = dict(data, end=[(end + timedelta(minutes=1)).strftime(LOCAL_INPUT)])
        assert client.post(reverse("reservation_new"), longer).status_code == 200  # refused
    assert client.post(reverse("reservation_new"), data).status_code == 302


@pytest.mark.parametrize("evening", ["20:00", "23:00"])
def test_a_default_booking_on_sunday_evening_fits_next_weeks_hours_too(
    alice, bob, team, box, evening, settings
):
    """Alice holds 6 of the team's 10 GPU-hours of next week from Monday 00:00; bob's default
    (8 h, from Sunday evening) may spend only 4 of next week's: it ends at Monday 04:00."""
    settings.BOOKING_DEFAULT_HOURS = 8
    team.gpu_hours_per_week = 10
    team.save()
    # The coming Monday, and the Sunday evening before it: in the future whenever the test runs.
    today = timezone.localdate()
    monday_date = today + timedelta(days=7 - today.weekday() + 7)
    zone = timezone.get_default_timezone()
    monday = datetime.combine(monday_date, datetime.min.time(), tzinfo=zone)
    now = datetime.combine(monday_date - timedelta(days=1), time.fromisoformat(evening), tzinfo=zone)
    reservation_create(user=alice, gpus=[box[0].uuid], start=monday, end=monday + 6 * H, now=now)
    assert length_within(list(bob.memberships.all()), 1.0, now) == monday + 4 * H - now


def test_with_no_gpu_hours_left_the_default_stays_and_the_refusal_says_why(client, bob, box):
    bob.memberships.update(gpu_hours_per_week=0)
    client.force_login(bob)
    data = rendered_defaults(client, reverse("reservation_new"))
    response = client.post(reverse("reservation_new"), data)
    said = " ".join(m for ms in response.context["form"].errors.values() for m in ms)
    assert "allows 0 GPU-hours" in said and '"GPU-hours per week" limit' in said, said


def test_a_reserve_button_ticks_no_card_for_someone_who_may_hold_no_whole_card(client, bob, box):
    bob.memberships.update(max_cards=0)
    client.force_login(bob)
    data = rendered_defaults(client, reverse("reservation_new") + f"?server=box1&gpu={box[2].uuid}")
    assert "gpus" not in data and data.get("count", [""]) == [""], data

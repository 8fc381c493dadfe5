"""Booking pages and /api/v1/reservations/: every error, and who may see or do what."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.forms import local_input, parse_memory_mb
from gpus.models import Reservation, Server
from gpus.quota_usage import NO_USE, member_quotas
from portal.models import AuditEntry
from tests.factories import MembershipFactory, TeamFactory

H = timedelta(hours=1)


@pytest.fixture
def booking(alice, box, t0):
    """alice's upcoming whole-card booking of box1 GPU 0."""
    return reservation_create(user=alice, gpus=[box[0].uuid], start=t0, end=t0 + 2 * H, note="sweep")


def api(user=None) -> APIClient:
    client = APIClient()
    if user:
        client.force_authenticate(user)
    return client


# --- the form ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "mb"),
    [
        ("16G", 16384),
        ("16 GB", 16384),
        ("16 GiB", 16384),
        ("16GiB", 16384),
        ("16384M", 16384),
        ("1.5g", 1536),
        ("", None),
    ],
)
def test_it_parses_memory_sizes(text, mb):
    assert parse_memory_mb(text) == mb


def test_it_prefills_the_form_from_the_dashboard_button(client, alice, box):
    client.force_login(alice)
    response = client.get(reverse("reservation_new") + f"?server=box1&gpu={box[2].uuid}")
    assert response.status_code == 200
    html = response.content.decode()
    assert f'value="{box[2].uuid}"' in html and "checked" in html
    assert "Times are in UTC" in html
    assert response.context["form"].initial["start"]  # defaults to now


def form_data(t0, **overrides):
    data = {
        "start": local_input(t0),
        "end": local_input(t0 + 2 * H),
        "memory": "",
        "note": "",
        "team": "vision-lab",
    }
    data.update(overrides)
    return data


def test_it_books_from_the_form_and_redirects_to_the_booking(client, alice, box, t0):
    client.force_login(alice)
    response = client.post(reverse("reservation_new"), form_data(t0, gpus=[box[1].uuid], memory="8G"))
    reservation = Reservation.objects.get()
    assert response.status_code == 302 and response.url == reverse(
        "reservation_detail", args=[reservation.pk]
    )
    assert reservation.allocations.get().memory_mb == 8192
    page = client.get(response.url).content.decode()
    assert "Booked box1 GPU 1 · 8 GiB" in page


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        ({"memory": "16"}, "memory", "Add a unit"),
        ({"memory": "lots"}, "memory", "is not a memory size"),
        ({"memory": "0G"}, "memory", "more than 0"),
        ({"memory": "900G", "gpus": ["GPU-box1-00"]}, "memory", "is more than the"),
        ({"end": "yesterday"}, "end", "Enter a valid date/time"),
        ({"end_before_start": True, "gpus": ["GPU-box1-00"]}, "end", "must be after the start"),
        ({}, "gpus", "Pick at least one GPU"),
        ({"gpus": ["GPU-box1-00"], "count": "2"}, "gpus", "not both"),
        ({"count": "0"}, "count", "Ask for 1 card or more."),
        ({"count": "9", "server": "box1"}, "count", "does not have 9 whole card(s)"),
        ({"gpus": ["GPU-box1-00"], "note": "x" * 501}, "note", "at most 500 characters"),
    ],
)
def test_it_shows_each_form_error_beside_its_field_and_writes_nothing(
    client, alice, box, t0, overrides, field, words
):
    client.force_login(alice)
    if overrides.pop("end_before_start", False):
        overrides["end"] = local_input(t0 - H)
    response = client.post(reverse("reservation_new"), form_data(t0, **overrides))
    assert response.status_code == 200
    errors = response.context["form"].errors
    assert field in errors, errors
    assert words in " ".join(errors[field])
    assert words in response.content.decode().replace("&#x27;", "'")
    assert not Reservation.objects.exists() and not AuditEntry.objects.exists()


def test_one_submit_names_every_problem_each_beside_its_field(client, alice, box, t0):
    """Five bad fields, five messages, on the first submit: the form's parsing and the booking
    service's own checks together (gpus.booking.request_problems); nothing is written."""
    client.force_login(alice)
    data = form_data(
        t0,
        gpus=[box[0].uuid],
        count="2",
        memory="12",
        start=local_input(t0 - 5 * H),
        end=local_input(t0 - 6 * H),
        note="x" * 501,
    )
    response = client.post(reverse("reservation_new"), data)
    errors = response.context["form"].errors
    assert "Add a unit" in " ".join(errors["memory"])
    assert "not both" in " ".join(errors["gpus"])
    assert "in the past" in " ".join(errors["start"])
    assert "must be after the start" in " ".join(errors["end"])
    assert "at most 500 characters" in " ".join(errors["note"])
    assert not Reservation.objects.exists() and not AuditEntry.objects.exists()


def test_a_window_that_did_not_parse_is_not_judged_by_halves(client, alice, box, t0):
    client.force_login(alice)
    response = client.post(reverse("reservation_new"), form_data(t0, start="soon", gpus=[box[0].uuid]))
    errors = response.context["form"].errors
    assert list(errors) == ["start"], errors  # not also "the end must be after the start (now)"


def test_the_api_names_every_problem_at_once(alice, box, t0):
    response = api(alice).post(
        "/api/v1/reservations/",
        {
            "gpus": [box[0].uuid],
            "count": 2,
            "start": (t0 - 5 * H).isoformat(),
            "end": (t0 - 6 * H).isoformat(),
        },
        format="json",
    )
    assert response.status_code == 400, response.json()
    body = response.json()
    assert not Reservation.objects.exists()
    assert {"gpus", "start", "end"} <= set(body["errors"]), body


def test_it_shows_a_conflict_on_the_form(client, bob, booking, box, t0):
    client.force_login(bob)
    response = client.post(reverse("reservation_new"), form_data(t0, gpus=[box[0].uuid]))
    assert "alice holds the whole card" in " ".join(response.context["form"].errors["gpus"])


def test_my_reservations_lists_open_and_past_with_quota(client, alice, booking):
    alice.memberships.update(max_cards=3)
    client.force_login(alice)
    html = client.get(reverse("my_reservations")).content.decode()
    assert f'data-reservation="{booking.pk}"' in html and "box1 GPU 0 · whole card" in html
    assert "0 / 3" in html  # cards now / limit


def test_my_quotas_count_only_the_users_own_bookings_in_two_queries(
    alice, bob, leader, box, django_assert_num_queries
):
    now = timezone.now()
    speech = TeamFactory(name="Speech", slug="speech")
    MembershipFactory(team=speech, user=alice)
    reservation_create(user=alice, gpus=[box[0].uuid], start=now, end=now + H, team="vision-lab")
    reservation_create(user=alice, gpus=[box[1].uuid], start=now, end=now + H, memory_mb=6144, team="speech")
    reservation_create(user=bob, gpus=[box[2].uuid, box[3].uuid], start=now, end=now + H)
    with django_assert_num_queries(2):  # the memberships, and alice's allocations: not her teammates'
        rows = member_quotas(alice, now)
    assert [(m.team.slug, use.cards_now, use.gb_now, may_manage) for m, use, may_manage in rows] == [
        ("speech", 0, 6.0, False),
        ("vision-lab", 1, 24.0, False),
    ]
    assert [(row.membership.team.slug, row.use, row.may_manage) for row in member_quotas(leader, now)] == [
        ("vision-lab", NO_USE, True)
    ]


def test_the_owner_cancels_and_a_leader_cancels_with_a_reason_the_owner_sees(
    client, alice, leader, booking, box, t0
):
    client.force_login(leader)
    response = client.post(reverse("reservation_cancel", args=[booking.pk]), {"reason": ""}, follow=True)
    assert "Give a reason: alice will see it." in response.content.decode()
    client.post(reverse("reservation_cancel", args=[booking.pk]), {"reason": "Paper deadline"})
    client.force_login(alice)
    html = client.get(reverse("my_reservations")).content.decode()
    assert "by leader: Paper deadline" in html


def test_the_owner_releases_and_extends(client, alice, box):
    now = timezone.now()
    active = reservation_create(user=alice, gpus=[box[1].uuid], start=now, end=now + H)
    client.force_login(alice)
    new_end = timezone.localtime(now + 3 * H).replace(second=0, microsecond=0)
    client.post(reverse("reservation_extend", args=[active.pk]), {"end": local_input(new_end)})
    active.refresh_from_db()
    assert active.end == new_end
    response = client.post(reverse("reservation_extend", args=[active.pk]), {"end": "soon"}, follow=True)
    assert "New end: Enter a valid date/time." in response.content.decode()
    client.post(reverse("reservation_release", args=[active.pk]))
    active.refresh_from_db()
    assert active.status == Reservation.Status.RELEASED


def test_the_dashboard_shows_who_holds_each_card_now(client, alice, bob, charlie, box):
    now = timezone.now()
    reservation_create(user=alice, gpus=[box[3].uuid], start=now, end=now + H, memory_mb=4096)
    client.force_login(bob)
    html = client.get(reverse("dashboard")).content.decode()
    assert "alice · 4 GiB · until" in html
    assert f'data-reserve="{box[0].uuid}"' in html
    client.force_login(charlie)
    assert "another user · 4 GiB" in client.get(reverse("dashboard_servers")).content.decode()


# --- access: owner / teammate / outsider / leader / admin on every reservation URL ------

WHO = ["alice", "bob", "charlie", "leader", "admin_user"]


@pytest.mark.parametrize(
    ("who", "status"),
    [("alice", 200), ("bob", 200), ("charlie", 404), ("leader", 200), ("admin_user", 200)],
)
def test_access_to_the_booking_page(client, request, booking, who, status):
    client.force_login(request.getfixturevalue(who))
    assert client.get(reverse("reservation_detail", args=[booking.pk])).status_code == status
    assert api(request.getfixturevalue(who)).get(f"/api/v1/reservations/{booking.pk}/").status_code == status


@pytest.mark.parametrize(
    ("who", "status", "cancelled"),
    [
        ("alice", 302, True),
        ("bob", 403, False),
        ("charlie", 404, False),
        ("leader", 302, True),
        ("admin_user", 302, True),
    ],
)
def test_access_to_cancel_in_the_page(client, request, booking, who, status, cancelled):
    client.force_login(request.getfixturevalue(who))
    response = client.post(reverse("reservation_cancel", args=[booking.pk]), {"reason": "needed"})
    assert response.status_code == status
    booking.refresh_from_db()
    assert (booking.cancelled_at is not None) is cancelled


@pytest.mark.parametrize(
    ("who", "status"),
    [("alice", 200), ("bob", 403), ("charlie", 404), ("leader", 200), ("admin_user", 200)],
)
def test_access_to_cancel_in_the_api(request, booking, who, status):
    response = api(request.getfixturevalue(who)).delete(f"/api/v1/reservations/{booking.pk}/?reason=needed")
    assert response.status_code == status, response.json()
    if status == 200:
        assert response.json()["status"] == "cancelled"
    else:
        assert set(response.json()) >= {"detail", "code"}


@pytest.mark.parametrize(
    ("who", "status"),
    [("alice", 200), ("bob", 403), ("charlie", 404), ("leader", 403), ("admin_user", 403)],
)
def test_access_to_extend_and_release(client, request, box, who, status):
    now = timezone.now()
    alice = request.getfixturevalue("alice")
    active = reservation_create(user=alice, gpus=[box[2].uuid], start=now, end=now + H)
    user = request.getfixturevalue(who)
    extend = api(user).post(f"/api/v1/reservations/{active.pk}/extend/", {"end": (now + 2 * H).isoformat()})
    assert extend.status_code == status
    assert api(user).post(f"/api/v1/reservations/{active.pk}/release/").status_code == status
    client.force_login(user)
    page = client.post(reverse("reservation_release", args=[active.pk]))
    assert page.status_code == {200: 302, 403: 403, 404: 404}[status]


@pytest.mark.parametrize(
    ("who", "action", "words"),
    [
        ("bob", "cancel", "Only the owner, leaders of the booking's team and admins can cancel it."),
        ("leader", "release", "Only the owner can release a booking; leaders and admins cancel it"),
        ("admin_user", "extend", "Only the owner can extend a booking."),
    ],
)
def test_the_api_says_why_it_refuses_with_a_403(request, box, t0, who, action, words):
    now = timezone.now()
    alice = request.getfixturevalue("alice")
    pk = reservation_create(user=alice, gpus=[box[2].uuid], start=now, end=now + H).pk
    data = {"end": (t0 + 3 * H).isoformat(), "reason": "needed"}
    response = api(request.getfixturevalue(who)).post(f"/api/v1/reservations/{pk}/{action}/", data)
    assert response.status_code == 403
    assert response.json()["code"] == "permission_denied" and words in response.json()["detail"]


def test_anonymous_users_are_sent_to_log_in(client, booking):
    for name in ("my_reservations", "reservation_new"):
        assert client.get(reverse(name)).status_code == 302
    assert client.get(reverse("reservation_detail", args=[booking.pk])).status_code == 302
    assert api().get("/api/v1/reservations/").status_code in (401, 403)


def test_the_api_lists_own_and_team_bookings_only(alice, bob, charlie, booking, box, t0):
    reservation_create(user=charlie, gpus=[box[3].uuid], start=t0, end=t0 + H)
    ids = {r["id"] for r in api(bob).get("/api/v1/reservations/").json()["results"]}
    assert ids == {booking.pk}
    assert api(charlie).get("/api/v1/reservations/").json()["count"] == 1
    upcoming = api(alice).get("/api/v1/reservations/?status=upcoming&mine=1").json()
    assert upcoming["count"] == 1 and upcoming["results"][0]["allocations"][0]["whole_card"] is True
    bad = api(alice).get("/api/v1/reservations/?status=soon")
    assert bad.status_code == 400 and "status" in bad.json()["errors"]


# --- the API's status codes and bodies ----------------------------------------------------


def test_the_api_creates_with_201(alice, box, t0):
    response = api(alice).post(
        "/api/v1/reservations/",
        {
            "gpus": [box[0].uuid, box[1].uuid],
            "start": t0.isoformat(),
            "end": (t0 + H).isoformat(),
            "note": "x",
        },
        format="json",
    )
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["owner"] == "alice" and body["status"] == "upcoming" and len(body["allocations"]) == 2


def test_the_api_picks_cards_from_a_count(alice, box, t0):
    response = api(alice).post(
        "/api/v1/reservations/",
        {"count": 2, "server": "box1", "memory_mb": 2048, "start": t0.isoformat()},
        format="json",
    )
    assert response.status_code == 201
    assert [a["memory_mb"] for a in response.json()["allocations"]] == [2048, 2048]


@pytest.mark.parametrize(
    ("payload", "status", "code", "field"),
    [
        ({"gpus": ["GPU-nope"]}, 400, "invalid", "gpus"),
        ({"gpus": "GPU-box1-00"}, 400, "invalid", "gpus"),
        ({"gpus": ["GPU-box1-00"], "memory_mb": "lots"}, 400, "invalid", "memory_mb"),
        ({"gpus": ["GPU-box1-00"], "memory_mb": 0}, 400, "invalid", "memory_mb"),
        ({"gpus": ["GPU-box1-00"], "start": "tomorrow"}, 400, "invalid", "start"),
        ({"gpus": ["GPU-box1-00"], "start_h": -3}, 400, "invalid", "start"),
        ({"gpus": ["GPU-box1-00"], "end_h": -1}, 400, "invalid", "end"),
        ({}, 400, "invalid", "gpus"),
        ({"count": 1, "server": "nope"}, 400, "invalid", "server"),
        ({"gpus": ["GPU-box1-00"], "team": "nlp"}, 403, "permission_denied", "team"),
        ({"gpus": ["GPU-box1-00"]}, 409, "conflict", "gpus"),
        ({"gpus": ["GPU-box1-01"], "quota": True}, 400, "quota_exceeded", "gpus"),
    ],
)
def test_the_api_answers_every_error_with_detail_and_code(
    alice, bob, booking, box, t0, payload, status, code, field
):
    if payload.pop("quota", False):
        bob.memberships.update(max_gb=8)
    payload = {"start": t0.isoformat(), "end": (t0 + H).isoformat(), **payload}
    if "start_h" in payload:
        payload["start"] = (timezone.now() + payload.pop("start_h") * H).isoformat()
    if "end_h" in payload:
        payload["end"] = (t0 + payload.pop("end_h") * H).isoformat()
    before = (Reservation.objects.count(), AuditEntry.objects.count())
    response = api(bob).post("/api/v1/reservations/", payload, format="json")
    assert response.status_code == status, response.json()
    body = response.json()
    assert body["code"] == code and body["detail"]
    if field:
        assert field in body["errors"]
    assert (Reservation.objects.count(), AuditEntry.objects.count()) == before


def test_the_api_extend_refuses_bad_input_and_conflicts(alice, bob, booking, box, t0):
    reservation_create(user=bob, gpus=[box[0].uuid], start=t0 + 3 * H, end=t0 + 4 * H)
    assert api(alice).post(f"/api/v1/reservations/{booking.pk}/extend/", {"end": "later"}).status_code == 400
    conflict = api(alice).post(
        f"/api/v1/reservations/{booking.pk}/extend/", {"end": (t0 + 5 * H).isoformat()}
    )
    assert conflict.status_code == 409 and "bob holds" in conflict.json()["detail"]


def test_the_api_schema_still_builds(alice):
    assert api(alice).get("/api/v1/schema/").status_code == 200


def test_draining_servers_offer_no_reserve_button(client, alice, box):
    Server.objects.filter(name="box1").update(draining=True)
    client.force_login(alice)
    assert "data-reserve=" not in client.get(reverse("dashboard_servers")).content.decode()


@pytest.mark.parametrize(
    ("who", "page_status", "api_status", "extended"),
    [
        ("alice", 302, 200, True),
        ("bob", 403, 403, False),
        ("charlie", 404, 404, False),
        ("leader", 403, 200, False),
        ("admin_user", 403, 200, False),
    ],
)
def test_access_to_extend_in_the_page_and_cancel_in_the_api(
    client, request, booking, t0, who, page_status, api_status, extended
):
    user = request.getfixturevalue(who)
    client.force_login(user)
    page = client.post(reverse("reservation_extend", args=[booking.pk]), {"end": local_input(t0 + 3 * H)})
    assert page.status_code == page_status
    booking.refresh_from_db()
    assert (booking.end == t0 + 3 * H) is extended
    cancel = api(user).post(f"/api/v1/reservations/{booking.pk}/cancel/", {"reason": "maintenance"})
    assert cancel.status_code == api_status


def test_a_count_that_did_not_parse_is_not_called_missing(client, alice, box, t0):
    client.force_login(alice)
    errors = client.post(reverse("reservation_new"), form_data(t0, count="0")).context["form"].errors
    assert list(errors) == ["count"], errors  # not also "pick a GPU or give a count" beside the cards


def test_an_end_that_did_not_parse_hides_no_start_in_the_past(client, alice, box, t0):
    client.force_login(alice)
    data = form_data(t0, gpus=[box[0].uuid], start=local_input(t0 - 5 * H), end="garbage")
    errors = client.post(reverse("reservation_new"), data).context["form"].errors
    assert "in the past" in " ".join(errors["start"]) and "valid date/time" in " ".join(errors["end"])


def test_the_api_names_rule_problems_beside_a_field_that_did_not_parse(alice, box, t0):
    response = api(alice).post(
        "/api/v1/reservations/",
        {
            "gpus": [box[0].uuid],
            "count": 2,
            "memory_mb": -1,
            "start": (t0 - 5 * H).isoformat(),
            "end": "garbage",
        },
        format="json",
    )
    assert response.status_code == 400
    errors = response.json()["errors"]
    assert {"gpus", "start", "end", "memory_mb"} <= set(errors), errors
    assert "not both" in " ".join(errors["gpus"]) and "in the past" in " ".join(errors["start"])
    assert not Reservation.objects.exists()

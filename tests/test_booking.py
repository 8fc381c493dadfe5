"""Booking rules and quotas, through the services the form and the API both call."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from gpus import booking
from gpus.booking import (
    reservation_cancel,
    reservation_create,
    reservation_extend,
    reservation_release,
)
from gpus.models import GPU, Allocation, Reservation, Server
from gpus.quota_usage import team_use
from gpus.quotas import peak
from gpus.services import server_report_ingest
from portal.errors import Conflict, Forbidden, Invalid, QuotaExceeded
from portal.models import AuditEntry
from tests.factories import UserFactory, make_snapshot

H = timedelta(hours=1)
BOOKABLE = 24 * 1024 - 300 - 512  # make_snapshot's card: total - driver reserved - headroom


def book(user, gpus, start, hours=2, memory_mb=None, **kw):
    return reservation_create(
        user=user, gpus=[g.uuid for g in gpus], start=start, end=start + hours * H, memory_mb=memory_mb, **kw
    )


def test_it_books_a_whole_card_and_records_it(alice, box, t0):
    r = book(alice, box[:2], t0, note="resnet sweep")
    assert r.status == Reservation.Status.UPCOMING
    assert r.team.slug == "vision-lab"
    assert sorted(a.gpu_id for a in r.allocations.all()) == [box[0].uuid, box[1].uuid]
    entry = AuditEntry.objects.get()
    assert entry.actor == alice and entry.action == "reservation.create"
    assert "2 whole card(s) on box1" in entry.message
    assert entry.data["gpus"] == [box[0].uuid, box[1].uuid] and entry.data["memory_mb"] is None
    assert r.created_at and Reservation.objects.get(pk=r.pk).note == "resnet sweep"


def test_it_refuses_a_whole_card_that_overlaps_and_names_the_teammate_and_the_next_slot(alice, bob, box, t0):
    book(alice, box[:1], t0, hours=2)
    with pytest.raises(Conflict) as err:
        book(bob, box[:1], t0 + H, hours=1)
    message = err.value.message
    assert "box1 GPU 0 (GPU-box1-00)" in message
    assert "alice holds the whole card" in message
    assert f"{(t0 + 2 * H):%H:%M}" in message.split("earliest")[1]
    assert err.value.status == 409 and err.value.field == "gpus"
    assert Reservation.objects.count() == 1


def test_it_calls_an_outsider_another_user(alice, charlie, box, t0):
    book(alice, box[:1], t0)
    with pytest.raises(Conflict) as err:
        book(charlie, box[:1], t0)
    assert "another user holds" in err.value.message and "alice" not in err.value.message


def test_it_lets_touching_windows_follow_each_other(alice, bob, box, t0):
    book(alice, box[:1], t0, hours=2)
    book(bob, box[:1], t0 + 2 * H, hours=2)
    assert Allocation.objects.filter(gpu=box[0]).count() == 2


def test_it_refuses_shared_memory_under_a_whole_card_and_the_reverse(alice, bob, box, t0):
    book(alice, box[:1], t0)
    with pytest.raises(Conflict):
        book(bob, box[:1], t0, memory_mb=1024)
    book(alice, box[1:2], t0, memory_mb=1024)
    with pytest.raises(Conflict):
        book(bob, box[1:2], t0 + H)


def test_it_sums_memory_at_every_instant_not_pairwise(alice, bob, box, t0):
    gb10 = 10 * 1024
    book(alice, box[:1], t0, hours=4, memory_mb=gb10)  # [0, 4)
    book(bob, box[:1], t0 + 2 * H, hours=4, memory_mb=gb10)  # [2, 6): 20 GB at 2..4
    with pytest.raises(Conflict) as err:
        book(bob, box[:1], t0 + 3 * H, hours=2, memory_mb=gb10)  # would be 30 GB at 3..4
    assert "10 GiB of its" in err.value.message
    # Pairwise-fitting but never all three at once: 0..2 and 4..6 hold only one 10 GB booking.
    book(bob, box[:1], t0 - H + timedelta(minutes=59), hours=1, memory_mb=BOOKABLE - gb10)
    book(alice, box[:1], t0 + 6 * H, hours=1, memory_mb=BOOKABLE)


def test_it_fills_a_card_exactly_to_its_bookable_memory(alice, bob, box, t0):
    book(alice, box[:1], t0, memory_mb=BOOKABLE - 1000)
    book(bob, box[:1], t0, memory_mb=1000)
    with pytest.raises(Conflict):
        book(bob, box[:1], t0, memory_mb=1)


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({"start_h": 2, "end_h": 1}, "end", "must be after the start"),
        ({"start_h": -2, "end_h": 1}, "start", "in the past"),
        ({"start_h": 1, "end_h": 1 + 15 * 24}, "end", "at most 336 h"),
        ({"start_h": 1, "end_h": 2, "memory_mb": 0}, "memory_mb", "more than 0"),
        ({"start_h": 1, "end_h": 2, "memory_mb": 999_999}, "memory_mb", "ask for at most 23764M"),
        ({"start_h": 1, "end_h": 2, "gpus": ["GPU-nope"]}, "gpus", "There is no GPU GPU-nope"),
        ({"start_h": 1, "end_h": 2, "gpus": ["GPU-box1-00", "GPU-box1-00"]}, "gpus", "listed twice"),
        ({"start_h": 1, "end_h": 2, "gpus": []}, "gpus", "Pick at least one GPU"),
        ({"start_h": 1, "end_h": 2, "count": 1}, "gpus", "not both"),
        ({"start_h": 1, "end_h": 2, "gpus": [], "count": 0}, "count", "at least 1"),
        ({"start_h": 1, "end_h": 2, "note": "x" * 501}, "note", "keep it to 500"),
    ],
)
def test_it_refuses_bad_input_naming_the_field(alice, box, kwargs, field, words):
    now = timezone.now()
    start, end = now + kwargs.pop("start_h") * H, now + kwargs.pop("end_h") * H
    kwargs.setdefault("gpus", ["GPU-box1-00"])
    with pytest.raises(Invalid) as err:
        reservation_create(user=alice, start=start, end=end, **kwargs)
    assert err.value.field == field
    assert words in err.value.message
    assert err.value.status == 400
    assert not Reservation.objects.exists() and not AuditEntry.objects.exists()


def test_it_accepts_a_start_a_minute_ago(alice, box):
    now = timezone.now()
    r = reservation_create(user=alice, gpus=[box[0].uuid], start=now - timedelta(minutes=1), end=now + H)
    assert r.status == Reservation.Status.ACTIVE


def test_it_defaults_to_now_and_the_default_length(alice, box, settings):
    settings.BOOKING_DEFAULT_HOURS = 3
    r = reservation_create(user=alice, gpus=[box[0].uuid])
    assert r.status == Reservation.Status.ACTIVE
    assert r.end - r.start == 3 * H


def test_it_refuses_a_draining_server_and_cards_on_two_servers(alice, box, t0):
    server_report_ingest(snapshot=make_snapshot("box2", gpus=2))
    with pytest.raises(Invalid, match="share one server"):
        reservation_create(user=alice, gpus=["GPU-box1-00", "GPU-box2-00"], start=t0, end=t0 + H)
    Server.objects.filter(name="box2").update(draining=True)
    with pytest.raises(Invalid, match="draining"):
        reservation_create(user=alice, gpus=["GPU-box2-00"], start=t0, end=t0 + H)


def test_it_refuses_users_without_a_team(box, t0):
    loner = UserFactory(username="loner")
    with pytest.raises(Forbidden, match="no team"):
        book(loner, box[:1], t0)


def test_it_picks_the_least_loaded_free_cards_on_one_server(alice, bob, box, t0):
    server_report_ingest(snapshot=make_snapshot("box2", gpus=2, util=90))
    book(bob, box[:1], t0)  # box1 GPU 0 is taken
    GPU.objects.filter(uuid=box[1].uuid).update(utilization_pct=80)
    r = reservation_create(user=alice, count=2, start=t0, end=t0 + H)
    assert sorted(a.gpu.index for a in r.allocations.all()) == [2, 3]
    # Three cards fit only on box1 (box2 has two): kept on one server.
    r3 = reservation_create(user=alice, count=3, start=t0 + 2 * H, end=t0 + 3 * H)
    assert {a.gpu.server.name for a in r3.allocations.all()} == {"box1"}


def test_it_picks_shared_memory_and_says_when_nothing_fits(alice, bob, box, t0):
    r = reservation_create(user=alice, count=1, server="box1", memory_mb=8192, start=t0, end=t0 + H)
    assert r.allocations.get().memory_mb == 8192
    with pytest.raises(Conflict) as err:
        reservation_create(user=bob, count=5, server="box1", start=t0, end=t0 + H)
    assert "Server box1 does not have 5 whole card(s)" in err.value.message
    assert "the most on one server is 3, on box1" in err.value.message
    with pytest.raises(Invalid) as err:
        reservation_create(user=bob, count=1, server="nope", start=t0, end=t0 + H)
    assert err.value.field == "server"


def test_it_cancels_upcoming_and_releases_active_bookings(alice, bob, box, t0):
    upcoming = book(alice, box[:1], t0)
    reservation_cancel(user=alice, reservation=upcoming)
    upcoming.refresh_from_db()
    assert upcoming.status == Reservation.Status.CANCELLED
    book(bob, box[:1], t0)  # the card is free again

    now = timezone.now()
    active = reservation_create(user=alice, gpus=[box[1].uuid], start=now, end=now + 2 * H)
    with pytest.raises(Invalid, match="has not started"):
        reservation_release(user=bob, reservation=book(bob, box[2:3], t0))
    reservation_release(user=alice, reservation=active)
    active.refresh_from_db()
    assert active.status == Reservation.Status.RELEASED
    assert active.end < now + H and active.booked_end == now + 2 * H
    assert list(AuditEntry.objects.values_list("action", flat=True)[:2]) == [
        "reservation.release",
        "reservation.create",
    ]


def test_it_treats_an_owner_cancelling_an_active_booking_as_a_release(alice, box):
    now = timezone.now()
    r = reservation_create(user=alice, gpus=[box[0].uuid], start=now, end=now + H)
    assert reservation_cancel(user=alice, reservation=r).status == Reservation.Status.RELEASED


def test_only_owner_leader_or_admin_may_cancel_and_others_need_a_reason(
    alice, bob, leader, charlie, admin_user, box, t0
):
    r = book(alice, box[:1], t0)
    for outsider in (bob, charlie):
        with pytest.raises(Forbidden):
            reservation_cancel(user=outsider, reservation=r, reason="mine now")
    with pytest.raises(Invalid) as err:
        reservation_cancel(user=leader, reservation=r)
    assert err.value.field == "reason" and "alice will see it" in err.value.message
    reservation_cancel(user=leader, reservation=r, reason="paper deadline for bob")
    r.refresh_from_db()
    assert r.cancelled_by == leader and r.cancel_reason == "paper deadline for bob"
    with pytest.raises(Invalid, match="already cancelled"):
        reservation_cancel(user=admin_user, reservation=r, reason="again")
    r2 = book(alice, box[1:2], t0)
    reservation_cancel(user=admin_user, reservation=r2, reason="maintenance")
    assert "maintenance" in AuditEntry.objects.first().message


def test_it_extends_only_when_free(alice, bob, box, t0):
    r = book(alice, box[:1], t0, hours=1)
    reservation_extend(user=alice, reservation=r, end=t0 + 2 * H)
    assert Allocation.objects.get(reservation=r).end == t0 + 2 * H
    book(bob, box[:1], t0 + 3 * H)
    with pytest.raises(Conflict, match="bob holds"):
        reservation_extend(user=alice, reservation=r, end=t0 + 4 * H)
    with pytest.raises(Forbidden):
        reservation_extend(user=bob, reservation=r, end=t0 + 3 * H)
    with pytest.raises(Invalid, match="after the current end"):
        reservation_extend(user=alice, reservation=r, end=t0 + H)


# --- quotas ---------------------------------------------------------------------------


def test_member_card_quota_names_limit_use_and_room(alice, box, t0):
    alice.memberships.update(max_cards=2)
    book(alice, box[:1], t0)
    with pytest.raises(QuotaExceeded) as err:
        book(alice, box[1:3], t0 + H)
    assert err.value.message == (
        "Your quota in Vision Lab allows 2 whole card(s) at once; you already have 1 in that window, "
        "so 1 more would fit and this booking asks for 2. Ask for fewer cards or a share of each card, "
        'or ask a leader of Vision Lab to raise your "cards at once" limit.'
    )
    assert err.value.status == 400 and err.value.field == "gpus"
    book(alice, box[1:3], t0 + 2 * H)  # after the first booking ends: fits


def test_team_memory_quota_counts_whole_cards_at_full_memory(alice, bob, team, box, t0):
    team.max_gb = 40
    team.save()
    book(alice, box[:1], t0)  # 24 GB
    book(bob, box[1:2], t0, memory_mb=16 * 1024)  # 40 GB
    with pytest.raises(QuotaExceeded) as err:
        book(bob, box[2:3], t0, memory_mb=1024)
    assert "The team quota of Vision Lab allows 40 GiB" in err.value.message
    assert "the team already has 40 GiB in that window, so 0 GiB more would fit" in err.value.message


def test_weekly_gpu_hours_count_a_fraction_for_shared_bookings(alice, box):
    alice.memberships.update(gpu_hours_per_week=10)
    monday = timezone.localtime(timezone.now()).replace(hour=0, minute=0, second=0, microsecond=0)
    monday += timedelta(days=7 - monday.weekday())  # next Monday 00:00, a whole week ahead
    book(alice, box[:1], monday + H, hours=6)  # 6 GPU-hours
    half = 12 * 1024  # half a 24 GB card
    book(alice, box[1:2], monday + 10 * H, hours=8, memory_mb=half)  # 4 GPU-hours: 10 in all
    with pytest.raises(QuotaExceeded) as err:
        book(alice, box[2:3], monday + 20 * H, hours=1)
    assert "allows 10 GPU-hours in the week of" in err.value.message
    assert "you already have 10 booked, so 0 more would fit" in err.value.message
    book(alice, box[2:3], monday + 7 * 24 * H + H, hours=1)  # the next week is fresh
    assert team_use(alice.memberships.get().team, now=monday + 2 * H)[alice.pk].cards_now == 1


def test_member_max_booking_length(alice, box, t0):
    alice.memberships.update(max_booking_hours=4)
    with pytest.raises(QuotaExceeded) as err:
        book(alice, box[:1], t0, hours=5)
    assert "at most 4 h" in err.value.message and err.value.field == "end"


def test_peak_is_a_sweep_over_half_open_windows(t0):
    a, b, c = (t0, t0 + 2 * H, 1), (t0 + 2 * H, t0 + 3 * H, 1), (t0 + H, t0 + 3 * H, 5)
    assert peak([a, b], t0, t0 + 5 * H) == 1
    assert peak([a, b, c], t0, t0 + 5 * H) == 6
    assert peak([a, c], t0 + 2 * H, t0 + 5 * H) == 5


def test_weekly_gpu_hours_clip_bookings_that_cross_the_week_boundary(alice, box):
    alice.memberships.update(gpu_hours_per_week=5)
    monday = timezone.localtime(timezone.now()).replace(hour=0, minute=0, second=0, microsecond=0)
    monday += timedelta(days=7 - monday.weekday())
    if monday - 2 * H <= timezone.now():  # run on a Sunday evening: the Sunday a week on
        monday += timedelta(days=7)
    # Sunday 22:00 → Monday 04:00: 4 of its 6 h fall in that Sunday's week.
    book(alice, box[:1], monday - 2 * H, hours=6)
    with pytest.raises(QuotaExceeded, match=r"you already have 4 booked, so 1 more would fit"):
        book(alice, box[1:2], monday + 10 * H, hours=2)
    book(alice, box[1:2], monday + 10 * H, hours=1)


def test_the_status_filter_in_sql_agrees_with_the_derived_status(alice, box, t0):
    now = timezone.now()
    long_ago = now - 30 * H
    ended = reservation_create(user=alice, gpus=[box[0].uuid], start=long_ago, end=long_ago + H, now=long_ago)
    active = reservation_create(user=alice, gpus=[box[1].uuid], start=now, end=now + H)
    released = reservation_create(user=alice, gpus=[box[2].uuid], start=now, end=now + H)
    reservation_release(user=alice, reservation=released)
    upcoming = book(alice, box[3:4], t0)
    cancelled = book(alice, box[3:4], t0 + 3 * H)
    reservation_cancel(user=alice, reservation=cancelled)
    everything = Reservation.objects.all()
    for r in (ended, active, released, upcoming, cancelled):
        r.refresh_from_db()
        matching = everything.with_status(r.status_at(timezone.now()), timezone.now())
        assert list(matching.values_list("pk", flat=True)) == [r.pk], r.status
    split = everything.split_open(timezone.now())
    assert [r.pk for r in split["open"]] == [active.pk, upcoming.pk]


@pytest.mark.parametrize(
    ("setup", "payload", "status", "field", "says"),
    [
        ("drain", {"count": 1, "server": "box1"}, 400, "server", "Server box1 is draining"),
        ("offline", {"count": 1}, 409, "server", "No GPU server is online now"),
        ("drain", {"count": 2, "memory_mb": 1024}, 409, "server", "Every online GPU server is draining"),
    ],
)
def test_the_api_answers_a_count_with_no_card_to_pick_from_with_a_4xx(
    alice, box, t0, setup, payload, status, field, says
):
    """With no candidate card the pick used to send `... IN ()` to PostgreSQL (a 500 there;
    CI runs this on PostgreSQL). Now: a refusal naming the field, and nothing written."""
    if setup == "drain":
        Server.objects.update(draining=True)
    else:
        Server.objects.update(last_seen=timezone.now() - timedelta(hours=1))
    client = APIClient()
    client.force_authenticate(alice)
    response = client.post("/api/v1/reservations/", {**payload, "start": t0.isoformat()}, format="json")
    assert response.status_code == status, response.content
    body = response.json()
    assert says in body["detail"] and list(body["errors"]) == [field]
    assert not Reservation.objects.exists() and not AuditEntry.objects.exists()


def test_it_picks_again_when_a_picked_card_was_taken_before_the_lock(alice, bob, box, t0, monkeypatch):
    """The pick reads without locks; a card booked between the pick and the lock is re-picked,
    and the failed attempt's savepoint gives its row locks back."""
    book(bob, box[:1], t0)
    real_pick = booking._pick
    picks = []

    def stale_then_real(*args, **kwargs):
        picks.append(1)
        return [box[0].uuid] if len(picks) == 1 else real_pick(*args, **kwargs)

    monkeypatch.setattr(booking, "_pick", stale_then_real)
    r = reservation_create(user=alice, count=1, server="box1", start=t0, end=t0 + H)
    assert len(picks) == 2 and r.allocations.get().gpu_id != box[0].uuid

"""One rule, one home (issue 20): the window test of allocations, who leads, sees and manages
teams and their bookings, and a booking's share of a card."""

from __future__ import annotations

from datetime import timedelta

import pytest

from gpus.booking import reservation_cancel, reservation_create
from gpus.models import GPU, Allocation
from portal.access import can_manage, teams_led_by
from portal.models import Team
from tests.factories import MembershipFactory, TeamFactory

pytestmark = pytest.mark.django_db

H = timedelta(hours=1)


def _book(user, gpu, start, hours=2, memory_mb=None):  # type: ignore[no-untyped-def]
    end = start + hours * H
    return reservation_create(user=user, gpus=[gpu.uuid], start=start, end=end, memory_mb=memory_mb)


# --- Allocation.objects.live_between / live_at ---------------------------------------------------


def test_it_finds_live_allocations_overlapping_a_half_open_window(alice, box, t0):
    ten_to_twelve = _book(alice, box[0], t0)
    assert Allocation.objects.live_between(t0 + H, t0 + 3 * H).get().reservation == ten_to_twelve
    assert Allocation.objects.live_between(t0 - H, t0 + H / 60).exists()
    # Ending at the window's start, or starting at its end, is not overlapping.
    assert not Allocation.objects.live_between(t0 + 2 * H, t0 + 3 * H).exists()
    assert not Allocation.objects.live_between(t0 - H, t0).exists()


def test_it_leaves_out_cancelled_allocations(alice, box, t0):
    reservation_cancel(user=alice, reservation=_book(alice, box[0], t0))
    assert not Allocation.objects.live_between(t0, t0 + 2 * H).exists()
    assert not Allocation.objects.live_at(t0 + H).exists()


def test_it_finds_what_holds_a_card_at_a_moment(alice, box, t0):
    _book(alice, box[0], t0)
    assert Allocation.objects.live_at(t0).exists()  # from its first instant
    assert Allocation.objects.live_at(t0 + 2 * H - H / 3600).exists()
    assert not Allocation.objects.live_at(t0 + 2 * H).exists()  # not at its end


def test_the_window_test_chains_after_other_filters(alice, bob, box, t0):
    _book(alice, box[0], t0, memory_mb=1024)
    _book(bob, box[1], t0, memory_mb=1024)
    mine = Allocation.objects.filter(reservation__owner=alice).live_between(t0, t0 + H)
    assert [a.gpu_id for a in mine] == [box[0].uuid]


# --- teams_led_by, Team.objects.restrict, can_manage -----------------------------------------------


def test_it_lists_the_teams_a_user_leads(alice, leader, charlie, admin_user, team):
    assert list(teams_led_by(leader)) == [team]
    assert not teams_led_by(alice).exists()  # a member leads nothing
    assert not teams_led_by(admin_user).exists()  # admins manage all, but lead none
    assert not teams_led_by(None).exists()
    other = TeamFactory(slug="other")
    MembershipFactory(team=other, user=charlie, role="leader")
    assert list(teams_led_by(charlie)) == [other]


def test_it_shows_members_their_teams_and_admins_every_team(alice, bob, charlie, admin_user, team):
    assert list(Team.objects.restrict(alice)) == [team]
    assert list(Team.objects.restrict(bob)) == [team]
    assert team not in Team.objects.restrict(charlie)  # an outsider never learns it exists
    assert set(Team.objects.restrict(admin_user)) == set(Team.objects.all())
    assert len(Team.objects.all()) == 2  # alice's and charlie's


def test_teams_restrict_shows_members_their_teams_and_lets_leaders_change_them(
    alice, leader, charlie, admin_user, team
):
    assert list(Team.objects.restrict(alice, "view")) == [team]
    assert list(Team.objects.restrict(leader, "view")) == [team]
    assert not Team.objects.restrict(charlie, "view").filter(pk=team.pk).exists()
    assert not Team.objects.restrict(alice, "change").exists()  # a member sees it, changes nothing
    assert list(Team.objects.restrict(leader, "change")) == [team]
    assert set(Team.objects.restrict(admin_user, "change")) == set(Team.objects.all())
    with pytest.raises(ValueError, match="Unknown action"):
        Team.objects.restrict(alice, "delete")


def test_the_owner_leaders_and_admins_manage_a_booking(alice, bob, charlie, leader, admin_user, box):
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=1024)
    assert can_manage(alice, booking)  # the owner
    assert can_manage(leader, booking)  # leads its team
    assert can_manage(admin_user, booking)
    assert not can_manage(bob, booking)  # a teammate sees it, but it is not theirs
    assert not can_manage(charlie, booking)


# --- GPU.card_share ----------------------------------------------------------------------------


def test_a_share_of_a_card_is_over_its_bookable_memory():
    assert GPU.card_share(None, 20_000) == 1.0  # a whole card
    assert GPU.card_share(5_000, 20_000) == 0.25
    assert GPU.card_share(30_000, 20_000) == 1.0  # never more than the card
    assert GPU.card_share(1_000, 0) == 1.0  # nothing bookable: it holds all there is
    assert GPU.card_share(0, 20_000) == 0.0  # nothing booked (the picker's load of an empty card)

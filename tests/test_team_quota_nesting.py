"""A team quota never below a member's (issue 41, bug 6): refused on the team page, in the API and in
Django's admin, naming the members, their figures and what to do; nothing is written."""

from __future__ import annotations

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from gpus.quotas import quota_team_set
from portal.errors import Invalid
from portal.models import AuditEntry, Membership, Team
from tests.factories import MembershipFactory, UserFactory


@pytest.fixture
def bob_at_30(bob, team):
    bob.memberships.update(max_gb=30)
    return bob


def unchanged(team: Team) -> bool:
    team.refresh_from_db()
    return team.max_gb is None and not AuditEntry.objects.exists()


def test_the_service_refuses_a_team_quota_below_a_members_naming_them(team, bob_at_30, admin_user):
    carol = MembershipFactory(team=team, user=UserFactory(username="carol"), max_gb=25).user
    with pytest.raises(Invalid) as refused:
        quota_team_set(actor=admin_user, team=team, max_gb=20)
    assert refused.value.field == "max_gb"
    message = refused.value.message
    assert "bob's 30 and carol's 25 GiB at once are above the team's 20" in message
    assert "Lower their quotas to at most 20 first" in message and "at least 30" in message
    assert unchanged(team)
    assert carol.memberships.get().max_gb == 25


def test_a_team_quota_at_the_members_figure_or_on_another_limit_is_saved(team, bob_at_30, admin_user):
    quota_team_set(actor=admin_user, team=team, max_gb=30, max_cards=2)
    team.refresh_from_db()
    assert (team.max_gb, team.max_cards) == (30, 2)


def test_the_team_page_refuses_it_beside_the_field(client, team, bob_at_30, admin_user):
    client.force_login(admin_user)
    response = client.post(reverse("team_quota", args=[team.slug]), {"max_gb": "20"})  # form-encoded
    assert response.status_code == 200
    errors = response.context["team_form"].errors
    assert "bob's 30 GiB at once is above the team's 20" in " ".join(errors["max_gb"]), errors
    assert "Lower bob's quota to at most 20 first" in " ".join(errors["max_gb"])
    assert unchanged(team)


def test_the_api_refuses_it_naming_the_field(team, bob_at_30, admin_user):
    api = APIClient()
    api.force_authenticate(admin_user)
    response = api.patch(f"/api/v1/teams/{team.slug}/", {"max_gb": 20}, format="json")
    assert response.status_code == 400
    assert "bob's 30 GiB at once" in " ".join(response.json()["errors"]["max_gb"])
    assert unchanged(team)


def _admin_team_post(team: Team, memberships: list[Membership], **team_fields: str) -> dict[str, str]:
    """What Django admin's team change form posts: the team's fields and its members' inline."""
    data = {
        "name": team.name,
        "slug": team.slug,
        "max_cards": "",
        "max_gb": "",
        "gpu_hours_per_week": "",
        "shares": "1",
        "lend_idle": "on",
        "memberships-TOTAL_FORMS": str(len(memberships)),
        "memberships-INITIAL_FORMS": str(len(memberships)),
        "memberships-MIN_NUM_FORMS": "0",
        "memberships-MAX_NUM_FORMS": "1000",
        **team_fields,
    }
    for i, m in enumerate(memberships):
        for name in ("max_cards", "max_gb", "max_booking_hours", "gpu_hours_per_week"):
            value = getattr(m, name)
            data[f"memberships-{i}-{name}"] = "" if value is None else str(value)
        data |= {
            f"memberships-{i}-id": str(m.pk),
            f"memberships-{i}-team": str(team.pk),
            f"memberships-{i}-user": str(m.user_id),
            f"memberships-{i}-role": m.role,
            f"memberships-{i}-shares": str(m.shares),
        }
    return data


def test_django_admin_refuses_a_team_quota_below_a_members(client, team, bob_at_30, admin_user):
    client.force_login(admin_user)
    url = reverse("admin:portal_team_change", args=[team.pk])
    response = client.post(url, _admin_team_post(team, list(team.memberships.all()), max_gb="20"))
    assert response.status_code == 200  # the form again, with the refusal
    assert "bob&#x27;s 30 GiB at once is above the team&#x27;s 20" in response.content.decode()
    assert unchanged(team)


def test_django_admin_refuses_a_member_above_the_team_and_saves_what_fits(client, team, bob, admin_user):
    client.force_login(admin_user)
    url = reverse("admin:portal_team_change", args=[team.pk])
    members = list(team.memberships.all())
    data = _admin_team_post(team, members, max_gb="20")
    data["memberships-0-max_gb"] = "30"
    assert client.post(url, data).status_code == 200
    assert unchanged(team) and Membership.objects.get(user=bob).max_gb is None

    data["memberships-0-max_gb"] = "20"
    assert client.post(url, data).status_code == 302
    team.refresh_from_db()
    assert team.max_gb == 20 and Membership.objects.get(user=bob).max_gb == 20


def test_django_admin_locks_the_teams_row_before_it_checks_the_members(
    client, team, bob, admin_user, monkeypatch
):
    """As quota_team_set and quota_member_set do: the admin's save and a leader's member quota on
    the team page take the same row lock, so neither slips past the other's check. (SQLite takes
    no row locks: the call inside the form's transaction is what is checked here.)"""
    from django.db import connection

    locked = []
    real = Team.objects.select_for_update

    def select_for_update(*args, **kwargs):  # type: ignore[no-untyped-def]
        locked.append(connection.in_atomic_block)
        return real(*args, **kwargs)

    monkeypatch.setattr(Team.objects, "select_for_update", select_for_update)
    client.force_login(admin_user)
    url = reverse("admin:portal_team_change", args=[team.pk])
    client.get(url)
    assert locked == []  # showing the form locks nothing
    assert (
        client.post(url, _admin_team_post(team, list(team.memberships.all()), max_gb="20")).status_code == 302
    )
    assert locked == [True]

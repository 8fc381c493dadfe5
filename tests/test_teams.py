"""Team and member quotas: the services, the team pages and forms, the API, and who may do what."""

from __future__ import annotations

import html
import re
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.models import GPU
from gpus.quota_usage import team_use
from gpus.quotas import quota_member_set, quota_team_set
from gpus.services import server_report_ingest
from portal.errors import Forbidden, Invalid
from portal.figures import figure
from portal.models import AuditEntry, Membership, Team
from tests.factories import MembershipFactory, TeamFactory, make_snapshot

H = timedelta(hours=1)
QUOTA_NAMES = ("max_cards", "max_gb", "gpu_hours_per_week", "max_booking_hours")


@pytest.fixture
def people(alice, bob, leader, charlie, admin_user):
    """Everyone in the access tables: alice owns the quota, bob is her teammate, charlie an outsider."""
    return {"alice": alice, "bob": bob, "leader": leader, "charlie": charlie, "admin": admin_user}


@pytest.fixture
def api():
    return APIClient()


def membership_of(user, team) -> Membership:
    return Membership.objects.get(user=user, team=team)


def quota_of(user, team) -> dict[str, int | None]:
    m = membership_of(user, team)
    return {name: getattr(m, name) for name in QUOTA_NAMES}


def field_error(response, field_id: str, message: str) -> bool:
    """Is `message` in the error list Django renders beside the field with this id?"""
    body = response.content.decode()
    marker = f'<ul class="errorlist" id="{field_id}_error">'
    if marker not in body:
        return False
    errors = body.split(marker, 1)[1].split("</ul>", 1)[0]
    return html.escape(message, quote=True) in errors or message in errors


# --- services --------------------------------------------------------------------------


def test_it_lets_an_admin_set_a_team_quota_and_logs_who_and_what(team, admin_user):
    quota_team_set(actor=admin_user, team=team, max_cards=4, max_gb=96, gpu_hours_per_week=200)
    team.refresh_from_db()
    assert (team.max_cards, team.max_gb, team.gpu_hours_per_week) == (4, 96, 200)
    entry = AuditEntry.objects.get()
    assert entry.actor == admin_user and entry.team == team
    assert entry.action == AuditEntry.Action.QUOTA_TEAM
    assert "cards at once no limit → 4" in entry.message
    assert entry.data["max_gb"] == [None, 96]


def test_it_refuses_a_team_quota_from_a_leader_and_writes_nothing(team, leader):
    with pytest.raises(Forbidden) as err:
        quota_team_set(actor=leader, team=team, max_cards=4)
    assert "admins" in err.value.message
    team.refresh_from_db()
    assert team.max_cards is None
    assert not AuditEntry.objects.exists()


def test_it_lets_a_leader_set_a_member_quota_within_the_team_and_logs_it(team, alice, leader):
    team.max_gb = 80
    team.save()
    quota_member_set(actor=leader, membership=membership_of(alice, team), max_gb=40, max_booking_hours=24)
    assert quota_of(alice, team)["max_gb"] == 40
    assert quota_of(alice, team)["max_booking_hours"] == 24
    entry = AuditEntry.objects.get()
    assert entry.actor == leader and entry.team == team
    assert entry.action == AuditEntry.Action.QUOTA_MEMBER
    assert "alice's quota" in entry.message and "GiB at once no limit → 40" in entry.message


def test_it_refuses_a_member_quota_above_the_teams_and_names_the_field(team, alice, leader):
    team.max_gb = 80
    team.save()
    with pytest.raises(Invalid) as err:
        quota_member_set(actor=leader, membership=membership_of(alice, team), max_cards=1, max_gb=81)
    assert err.value.field == "max_gb"
    assert "allows 80 GiB at once; set at most 80" in err.value.message
    assert quota_of(alice, team)["max_cards"] is None  # nothing written, not even the valid field
    assert not AuditEntry.objects.exists()


@pytest.mark.parametrize("who", ["alice", "bob", "charlie"])
def test_it_refuses_a_member_quota_from_anyone_but_leaders_and_admins(people, team, who):
    with pytest.raises(Forbidden):
        quota_member_set(actor=people[who], membership=membership_of(people["alice"], team), max_cards=1)
    assert quota_of(people["alice"], team)["max_cards"] is None
    assert not AuditEntry.objects.exists()


def test_it_refuses_a_member_quota_from_a_leader_of_another_team(team, alice):
    other = MembershipFactory(role=Membership.Role.LEADER).user
    with pytest.raises(Forbidden):
        quota_member_set(actor=other, membership=membership_of(alice, team), max_cards=1)


def test_it_lets_an_admin_outside_the_team_set_a_member_quota(team, alice, admin_user):
    quota_member_set(actor=admin_user, membership=membership_of(alice, team), max_cards=2)
    assert quota_of(alice, team)["max_cards"] == 2


def test_it_writes_no_audit_entry_when_nothing_changes(team, alice, leader, admin_user):
    quota_member_set(actor=leader, membership=membership_of(alice, team), max_cards=None)
    quota_team_set(actor=admin_user, team=team, max_gb=None)
    assert not AuditEntry.objects.exists()


@pytest.mark.parametrize(
    ("limits", "field"),
    [({"max_cards": -1}, "max_cards"), ({"max_gb": "8"}, "max_gb"), ({"max_card": 1}, "max_card")],
)
def test_it_refuses_bad_values_naming_the_field(team, alice, leader, limits, field):
    with pytest.raises(Invalid) as err:
        quota_member_set(actor=leader, membership=membership_of(alice, team), **limits)
    assert err.value.field == field
    assert not AuditEntry.objects.exists()


# --- pages ------------------------------------------------------------------------------


@pytest.fixture
def box(db):
    server_report_ingest(snapshot=make_snapshot("box1", gpus=2))
    return list(GPU.objects.filter(server__name="box1").order_by("index"))


def test_it_shows_members_use_bookings_and_the_audit_log_to_a_leader(client, team, alice, bob, leader, box):
    quota_member_set(actor=leader, membership=membership_of(alice, team), max_cards=2, max_gb=48)
    now = timezone.now()
    active = reservation_create(user=alice, gpus=[box[0].uuid], start=now, end=now + H, note="sweep")
    later = reservation_create(user=bob, gpus=[box[1].uuid], start=now + 2 * H, end=now + 3 * H)
    client.force_login(leader)
    response = client.get(reverse("team_detail", args=[team.slug]))
    body = response.content.decode()
    assert response.status_code == 200
    row = body.split('data-member="alice"', 1)[1].split("</tr>", 1)[0]
    hours = figure(team_use(team)[alice.pk].gpu_hours_week)  # 1 unless the week ends within the hour
    assert "1 / 2" in row and "24 / 48" in row and f"{hours} / no limit" in row
    assert f'action="{reverse("member_quota", args=[team.slug, "alice"])}"' in row
    open_table = body.split('id="team-open-bookings"', 1)[1].split("</table>", 1)[0]
    assert reverse("reservation_detail", args=[active.pk]) in open_table
    assert reverse("reservation_detail", args=[later.pk]) in open_table
    assert open_table.index(f">{active.pk}<") < open_table.index(f">{later.pk}<")  # soonest first
    audit = body.split("audit-log", 1)[1]
    assert html.escape("leader set alice's quota") in audit and "Booked" in audit
    assert 'name="max_cards"' in body.split("Members", 1)[1]
    assert reverse("team_quota", args=[team.slug]) not in body  # leaders read the team quota only


def test_it_gives_an_admin_the_team_quota_form(client, team, admin_user):
    client.force_login(admin_user)
    body = client.get(reverse("team_detail", args=[team.slug])).content.decode()
    assert f'action="{reverse("team_quota", args=[team.slug])}"' in body
    assert 'id="id_gpu_hours_per_week"' in body


def test_it_saves_a_member_quota_and_redirects_with_a_message(client, team, alice, leader):
    client.force_login(leader)
    url = reverse("member_quota", args=[team.slug, "alice"])
    response = client.post(url, {"max_cards": "2", "max_gb": "", "gpu_hours_per_week": "100"})
    pk = membership_of(alice, team).pk
    assert response.status_code == 302
    assert response.url == f"{reverse('team_detail', args=[team.slug])}#member-{pk}"
    assert quota_of(alice, team) == {
        "max_cards": 2,
        "max_gb": None,
        "gpu_hours_per_week": 100,
        "max_booking_hours": None,
    }
    page = client.get(response.url).content.decode()
    assert html.escape("alice's quota in Vision Lab saved") in page
    assert AuditEntry.objects.get().actor == leader


def test_it_says_so_when_a_saved_quota_did_not_change(client, team, alice, leader):
    client.force_login(leader)
    response = client.post(reverse("member_quota", args=[team.slug, "alice"]), {}, follow=True)
    assert "nothing changed" in response.content.decode()
    assert not AuditEntry.objects.exists()


MEMBER_FORM_ERRORS = [
    ({"max_cards": "two"}, "max_cards", "Enter a whole number of cards, e.g. 4, or leave it empty"),
    ({"max_gb": "-1"}, "max_gb", "Enter 0 or more (0 allows none), or leave it empty for no limit."),
    ({"gpu_hours_per_week": "4.5"}, "gpu_hours_per_week", "Enter a whole number of GPU-hours"),
    ({"max_booking_hours": "99999999999"}, "max_booking_hours", "Enter at most 1,000,000"),
    ({"max_gb": "81"}, "max_gb", "Vision Lab's own quota allows 80 GiB at once; set at most 80"),
]


@pytest.mark.parametrize(("data", "field", "message"), MEMBER_FORM_ERRORS)
def test_it_shows_each_member_form_error_beside_its_field_and_writes_nothing(
    client, team, alice, leader, data, field, message
):
    team.max_gb = 80
    team.save()
    client.force_login(leader)
    before = quota_of(alice, team)
    response = client.post(reverse("member_quota", args=[team.slug, "alice"]), {"max_cards": "1", **data})
    assert response.status_code == 200
    pk = membership_of(alice, team).pk
    assert field_error(response, f"id_m{pk}_{field}", message), response.content.decode()
    body = response.content.decode()
    assert "was not saved: correct the fields marked below" in body
    assert "<details open>" in body.split('data-member="alice"', 1)[1]
    assert quota_of(alice, team) == before
    assert not AuditEntry.objects.exists()


TEAM_FORM_ERRORS = [
    ({"max_cards": "x"}, "max_cards", "Enter a whole number of cards, e.g. 4, or leave it empty"),
    ({"max_gb": "-5"}, "max_gb", "Enter 0 or more"),
    ({"gpu_hours_per_week": "2000000"}, "gpu_hours_per_week", "Enter at most 1,000,000"),
]


@pytest.mark.parametrize(("data", "field", "message"), TEAM_FORM_ERRORS)
def test_it_shows_each_team_form_error_beside_its_field_and_writes_nothing(
    client, team, admin_user, data, field, message
):
    client.force_login(admin_user)
    response = client.post(reverse("team_quota", args=[team.slug]), {"max_cards": "3", **data})
    assert response.status_code == 200
    assert field_error(response, f"id_{field}", message), response.content.decode()
    team.refresh_from_db()
    assert (team.max_cards, team.max_gb, team.gpu_hours_per_week) == (None, None, None)
    assert not AuditEntry.objects.exists()


def test_it_saves_a_team_quota_and_redirects_with_a_message(client, team, admin_user):
    client.force_login(admin_user)
    response = client.post(reverse("team_quota", args=[team.slug]), {"max_cards": "8", "max_gb": "192"})
    assert response.status_code == 302 and response.url == reverse("team_detail", args=[team.slug])
    team.refresh_from_db()
    assert (team.max_cards, team.max_gb, team.gpu_hours_per_week) == (8, 192, None)
    assert "The quota of Vision Lab saved" in client.get(response.url).content.decode()


def test_it_shows_a_member_their_own_quota_and_use_on_the_profile(client, team, alice, leader, box):
    quota_member_set(actor=leader, membership=membership_of(alice, team), max_cards=3, max_booking_hours=12)
    now = timezone.now()
    reservation_create(user=alice, gpus=[box[0].uuid], start=now, end=now + H)
    client.force_login(alice)
    body = client.get(reverse("profile")).content.decode()
    row = body.split('id="quota-vision-lab"', 1)[1].split("</tr>", 1)[0]
    assert "1 / 3" in row and "12 h" in row and "Member" in row
    assert reverse("team_detail", args=[team.slug]) not in body  # members get no team page link


def test_it_links_a_leader_to_the_team_page_from_the_profile_and_the_nav(client, team, leader):
    client.force_login(leader)
    body = client.get(reverse("profile")).content.decode()
    assert f'href="{reverse("team_detail", args=[team.slug])}"' in body
    assert f'<a href="{reverse("teams")}">Teams</a>' in body


def test_it_lists_the_users_own_teams_and_every_team_for_admins(client, people, team):
    TeamFactory(name="Speech Lab", slug="speech")
    elsewhere = people["charlie"].memberships.get().team.slug
    expected = {"alice": {"vision-lab"}, "charlie": {elsewhere}, "admin": {"vision-lab", "speech", elsewhere}}
    for who, slugs in expected.items():
        client.force_login(people[who])
        body = client.get(reverse("teams")).content.decode()
        assert set(re.findall(r'data-team="([^"]+)"', body)) == slugs, who


def test_it_links_only_teams_the_user_manages_to_their_page(client, team, alice, leader):
    url = reverse("team_detail", args=[team.slug])
    client.force_login(alice)
    assert f'href="{url}"' not in client.get(reverse("teams")).content.decode()
    client.force_login(leader)
    assert f'href="{url}"' in client.get(reverse("teams")).content.decode()


# --- access: pages -----------------------------------------------------------------------

WHO = ("alice", "bob", "charlie", "leader", "admin")


def access_cases(table: dict[tuple[str, str], tuple[int, ...]]) -> list[tuple]:
    """{(method, url): (status for each of WHO)} → one parametrized case per person."""
    return [(*key, who, code) for key, codes in table.items() for who, code in zip(WHO, codes, strict=True)]


PAGE_ACCESS = {
    # (method, url name): expected status for alice (owner of the quota), bob (teammate),
    # charlie (outsider), the team's leader, an admin.
    ("get", "teams"): (200, 200, 200, 200, 200),
    ("get", "profile"): (200, 200, 200, 200, 200),
    ("get", "team_detail"): (403, 403, 404, 200, 200),
    ("post", "team_quota"): (403, 403, 404, 403, 302),
    ("post", "member_quota"): (403, 403, 404, 302, 302),
}
PAGE_CASES = access_cases(PAGE_ACCESS)


def page_url(name: str, slug: str = "vision-lab") -> str:
    args = {"teams": [], "profile": [], "member_quota": [slug, "alice"]}.get(name, [slug])
    return reverse(name, args=args)


@pytest.mark.parametrize(("method", "name", "who", "expected"), PAGE_CASES)
def test_it_guards_every_team_page(client, people, team, method, name, who, expected):
    client.force_login(people[who])
    response = getattr(client, method)(page_url(name), {"max_cards": "1"} if method == "post" else None)
    assert response.status_code == expected
    written = AuditEntry.objects.exists()
    assert written == (expected == 302)


@pytest.mark.parametrize(("method", "name"), list(PAGE_ACCESS))
def test_it_sends_anonymous_users_to_login_from_team_pages(client, team, alice, method, name):
    response = getattr(client, method)(page_url(name))
    assert response.status_code == 302 and response.url.startswith(reverse("login"))
    assert not AuditEntry.objects.exists()


@pytest.mark.parametrize("name", ["team_quota", "member_quota"])
def test_it_only_accepts_post_on_quota_urls(client, people, name):
    client.force_login(people["admin"])
    assert client.get(page_url(name)).status_code == 405


@pytest.mark.parametrize("who", ["leader", "admin"])
def test_it_answers_404_for_an_unknown_team_or_member(client, people, who):
    client.force_login(people[who])
    assert client.get(reverse("team_detail", args=["no-such-team"])).status_code == 404
    assert client.post(reverse("member_quota", args=["vision-lab", "nobody"]), {}).status_code == 404
    assert client.post(reverse("member_quota", args=["vision-lab", "charlie"]), {}).status_code == 404


def test_it_hides_a_team_from_a_leader_of_another_team(client, api, team, alice):
    other_leader = MembershipFactory(role=Membership.Role.LEADER).user
    client.force_login(other_leader)
    assert client.get(page_url("team_detail")).status_code == 404
    assert client.post(page_url("member_quota"), {"max_cards": "1"}).status_code == 404
    api.force_authenticate(other_leader)
    assert api.get("/api/v1/teams/vision-lab/members/").status_code == 404
    assert (
        api.patch("/api/v1/teams/vision-lab/members/alice/", {"max_cards": 1}, format="json").status_code
        == 404
    )
    assert quota_of(alice, Team.objects.get(slug="vision-lab"))["max_cards"] is None


# --- access: API ------------------------------------------------------------------------

API_TEAM = "/api/v1/teams/vision-lab/"
API_ACCESS = {
    # (method, url): expected status for alice (owner of the quota), bob (teammate),
    # charlie (outsider), the team's leader, an admin. Outsiders never learn the team exists.
    ("get", "/api/v1/teams/"): (200, 200, 200, 200, 200),
    ("get", API_TEAM): (200, 200, 404, 200, 200),
    ("patch", API_TEAM): (403, 403, 404, 403, 200),
    ("get", f"{API_TEAM}members/"): (403, 403, 404, 200, 200),
    ("patch", f"{API_TEAM}members/"): (405, 405, 405, 405, 405),
    ("get", f"{API_TEAM}members/alice/"): (200, 403, 404, 200, 200),
    ("patch", f"{API_TEAM}members/alice/"): (403, 403, 404, 200, 200),
    ("get", f"{API_TEAM}members/leader/"): (403, 403, 404, 200, 200),
    ("patch", f"{API_TEAM}members/leader/"): (403, 403, 404, 200, 200),
    ("get", f"{API_TEAM}audit/"): (403, 403, 404, 200, 200),
    ("patch", f"{API_TEAM}audit/"): (405, 405, 405, 405, 405),
}
API_CASES = access_cases(API_ACCESS)
# A 403 says who may do it, so the reader knows whom to ask.
API_REFUSALS = {(API_TEAM, "patch"): "Only admins set team quotas; ask one."}
MANAGERS_ONLY = "Only leaders of Vision Lab and admins manage it."
API_ERROR_CODES = {403: "permission_denied", 404: "not_found", 405: "method_not_allowed"}


@pytest.mark.parametrize(("method", "url", "who", "expected"), API_CASES)
def test_it_guards_every_team_api_url(api, people, team, method, url, who, expected):
    api.force_authenticate(people[who])
    response = getattr(api, method)(url, {"max_cards": 1} if method == "patch" else None, format="json")
    assert response.status_code == expected, response.content
    if expected >= 400:
        body = response.json()
        assert body["code"] == API_ERROR_CODES[expected]
        assert body["detail"]
    if expected == 403:
        assert body["detail"] == API_REFUSALS.get((url, method), MANAGERS_ONLY)
    assert AuditEntry.objects.exists() == (method == "patch" and expected == 200)


# Every (method, url) of one team that someone may use (not the 405s).
TEAM_API_URLS = [key for key, codes in API_ACCESS.items() if key[1].startswith(API_TEAM) and 405 not in codes]


@pytest.mark.parametrize(("method", "url"), TEAM_API_URLS)
def test_it_hides_a_team_in_the_api_from_a_leader_of_another_team(api, people, team, method, url):
    api.force_authenticate(MembershipFactory(role=Membership.Role.LEADER).user)
    response = getattr(api, method)(url, {"max_cards": 1} if method == "patch" else None, format="json")
    assert response.status_code == 404 and response.json()["code"] == "not_found"
    assert not AuditEntry.objects.exists()


@pytest.mark.parametrize(("method", "url"), TEAM_API_URLS)
@pytest.mark.parametrize("who", WHO)
def test_it_answers_404_in_the_api_for_an_unknown_team(api, people, team, method, url, who):
    api.force_authenticate(people[who])
    url = url.replace("/vision-lab/", "/no-such-team/")
    response = getattr(api, method)(url, {"max_cards": 1} if method == "patch" else None, format="json")
    assert response.status_code == 404 and response.json() == {"detail": "Not found.", "code": "not_found"}


@pytest.mark.parametrize("method", ["get", "patch"])
@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("username", ["nobody", "charlie"])
def test_it_answers_404_in_the_api_for_someone_outside_the_team(api, people, team, method, who, username):
    """Outsiders do not see the team; members, leaders and admins see no such member in it."""
    api.force_authenticate(people[who])
    url = f"{API_TEAM}members/{username}/"
    response = getattr(api, method)(url, {"max_cards": 1} if method == "patch" else None, format="json")
    assert response.status_code == 404 and response.json()["code"] == "not_found"
    assert not AuditEntry.objects.exists()


@pytest.mark.parametrize(("method", "url"), [*API_ACCESS, ("get", "/api/v1/teams/")])
def test_it_refuses_anonymous_api_requests_on_teams(api, team, alice, method, url):
    response = getattr(api, method)(url, {"max_cards": 1} if method == "patch" else None, format="json")
    assert response.status_code in (401, 403)
    assert not AuditEntry.objects.exists()


def test_it_lists_a_users_teams_in_the_api_and_all_for_admins(api, people, team):
    TeamFactory(name="Speech Lab", slug="speech")
    elsewhere = people["charlie"].memberships.get().team.slug
    expected = {
        "alice": [("vision-lab", "member")],
        "leader": [("vision-lab", "leader")],
        "charlie": [(elsewhere, "member")],
    }
    for who, teams in expected.items():
        api.force_authenticate(people[who])
        assert [(t["slug"], t["your_role"]) for t in api.get("/api/v1/teams/").json()] == teams, who
    api.force_authenticate(people["admin"])
    assert {t["slug"] for t in api.get("/api/v1/teams/").json()} == {"vision-lab", "speech", elsewhere}


def test_it_shows_members_with_quota_and_use_in_the_api(api, team, alice, bob, leader, box):
    quota_member_set(actor=leader, membership=membership_of(alice, team), max_cards=2)
    now = timezone.now()
    reservation_create(user=alice, gpus=[box[0].uuid], start=now, end=now + H)
    api.force_authenticate(leader)
    members = {m["username"]: m for m in api.get(f"{API_TEAM}members/").json()}
    assert set(members) == {"alice", "bob", "leader"}
    assert members["alice"]["max_cards"] == 2 and members["alice"]["role"] == "member"
    assert members["alice"]["use"]["cards_now"] == 1 and members["alice"]["use"]["gb_now"] == 24.0
    # One meaning per number (docs/reports.md): booked, named so, as Reports and /api/v1/usage/ do.
    alice_use = members["alice"]["use"]
    assert alice_use["gpu_hours_booked_week"] == alice_use["gpu_hours_week"] >= 0
    assert members["bob"]["use"] == {
        "cards_now": 0,
        "gb_now": 0.0,
        "gpu_hours_booked_week": 0.0,
        "gpu_hours_week": 0.0,
    }
    api.force_authenticate(alice)
    assert api.get(f"{API_TEAM}members/alice/").json()["use"]["cards_now"] == 1
    assert api.get(API_TEAM).json()["use"]["cards_now"] == 1


def test_it_sets_a_member_quota_through_the_api_and_clears_it_with_null(api, team, alice, leader):
    api.force_authenticate(leader)
    url = f"{API_TEAM}members/alice/"
    response = api.patch(url, {"max_cards": 2, "max_booking_hours": 48}, format="json")
    assert response.status_code == 200 and response.json()["max_cards"] == 2
    assert api.patch(url, {"max_cards": None}, format="json").json()["max_cards"] is None
    assert quota_of(alice, team) == {
        "max_cards": None,
        "max_gb": None,
        "gpu_hours_per_week": None,
        "max_booking_hours": 48,
    }
    audit = api.get(f"{API_TEAM}audit/").json()
    assert audit["count"] == 2
    assert audit["results"][0]["actor"] == "leader" and "2 → no limit" in audit["results"][0]["message"]


def test_it_sets_a_team_quota_through_the_api(api, team, admin_user):
    api.force_authenticate(admin_user)
    response = api.patch(API_TEAM, {"max_gb": 160, "gpu_hours_per_week": 500}, format="json")
    assert response.status_code == 200
    assert response.json()["max_gb"] == 160 and response.json()["your_role"] is None
    team.refresh_from_db()
    assert (team.max_gb, team.gpu_hours_per_week) == (160, 500)


API_ERRORS = [
    (f"{API_TEAM}members/alice/", {"max_cards": "two"}, "max_cards", "Give a whole number"),
    (f"{API_TEAM}members/alice/", {"max_gb": -1}, "max_gb", "Give 0 or more"),
    (f"{API_TEAM}members/alice/", {"max_booking_hours": 1.5}, "max_booking_hours", "Give a whole number"),
    (f"{API_TEAM}members/alice/", {"max_gb": 81}, "max_gb", "allows 80 GiB at once; set at most 80"),
    (f"{API_TEAM}members/alice/", {"max_card": 1}, "max_card", "use one of max_cards"),
    (f"{API_TEAM}members/alice/", {"role": "leader"}, "role", "Not a quota setting"),
    (API_TEAM, {"gpu_hours_per_week": 10**12}, "gpu_hours_per_week", "at most 1000000"),
    (API_TEAM, {"name": "Renamed"}, "name", "Not a quota setting"),
]


@pytest.mark.parametrize(("url", "data", "field", "message"), API_ERRORS)
def test_it_answers_bad_api_input_with_400_naming_the_field_and_writes_nothing(
    api, team, alice, admin_user, url, data, field, message
):
    Team.objects.filter(pk=team.pk).update(max_gb=80)
    api.force_authenticate(admin_user)
    response = api.patch(url, {"max_cards": 1, **data}, format="json")
    assert response.status_code == 400
    body = response.json()
    assert body["code"] == "invalid"
    assert field in body["detail"] or message in body["detail"]
    assert message in body["errors"][field][0]
    team.refresh_from_db()
    assert (team.name, team.max_cards, team.gpu_hours_per_week) == ("Vision Lab", None, None)
    assert quota_of(alice, team)["max_cards"] is None and membership_of(alice, team).role == "member"
    assert not AuditEntry.objects.exists()


def test_it_still_builds_the_api_schema(api, alice):
    api.force_authenticate(alice)
    response = api.get("/api/v1/schema/")
    assert response.status_code == 200
    schema = response.content.decode()
    for path in ("/api/v1/teams/{slug}/members/{username}/", "/api/v1/teams/{slug}/audit/"):
        assert path in schema


def test_it_names_users_by_their_username_in_the_audit_api(api, team, alice, leader):
    quota_member_set(actor=leader, membership=membership_of(alice, team), max_cards=1)
    api.force_authenticate(leader)
    entry = api.get(f"{API_TEAM}audit/").json()["results"][0]
    assert entry["actor"] == "leader" and entry["action"] == "quota.member"
    assert entry["data"] == {"max_cards": [None, 1]}


def test_the_service_itself_refuses_limits_beyond_the_column(team, admin_user):
    with pytest.raises(Invalid, match="from 0 to 1,000,000") as err:
        quota_team_set(actor=admin_user, team=team, max_gb=10**12)
    assert err.value.field == "max_gb"
    team.refresh_from_db()
    assert team.max_gb is None


def test_a_quota_saved_below_what_is_in_use_says_so(client, team, alice, leader, box):
    """Nothing is taken away, but the leader learns it at once (issue 23)."""
    from gpus.booking import reservation_create

    reservation_create(user=alice, gpus=[box[0].uuid, box[1].uuid])
    client.force_login(leader)
    answer = client.post(
        f"/teams/{team.slug}/members/alice/quota/",
        {"max_cards": "1", "max_gb": "", "gpu_hours_per_week": "", "max_booking_hours": ""},
        follow=True,
    )
    page = answer.content.decode()
    assert "alice already uses 2 cards at once (limit 1)" in page and "new bookings are refused" in page


def test_a_leader_refused_the_team_quota_reads_why_and_the_log_has_no_traceback(client, team, leader, caplog):
    """The 403 page said only "Not yours to see ... needs a leader or an admin" to a leader, and
    Django logged the PermissionDenied with its whole traceback, as if the code had failed."""
    client.force_login(leader)
    answer = client.post(f"/teams/{team.slug}/quota/", {"max_cards": "4"})
    assert answer.status_code == 403
    assert "Only admins set team quotas; ask one." in answer.content.decode()
    (record,) = [r for r in caplog.records if r.name == "django.request"]
    assert record.getMessage().startswith("Forbidden (Permission denied)")
    assert record.exc_info is None and "Traceback" not in caplog.text

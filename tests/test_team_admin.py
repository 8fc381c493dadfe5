"""Admins run the lab's teams in the portal (portal/teams.py, portal/team_views.py): create a team,
add and take out members and leaders, set fair-share shares; and `manage.py team_create` for an
install's first hour (docs/deploy.md). Form-encoded posts, as the pages send them."""

from __future__ import annotations

import re
import shlex
from io import StringIO
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse

from portal.errors import Invalid
from portal.models import AuditEntry, Membership, Team
from portal.teams import team_create, team_member_add
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_user(db):
    return UserFactory(username="admin", is_staff=True, is_superuser=True)


@pytest.fixture
def people(db):
    return {name: UserFactory(username=name) for name in ("alice", "bob", "carol")}


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def roles(slug: str) -> dict[str, str]:
    return dict(Membership.objects.filter(team__slug=slug).values_list("user__username", "role"))


# --- the command ---------------------------------------------------------------------------------


def run(*args: str) -> str:
    out = StringIO()
    call_command("team_create", *args, stdout=out)
    return out.getvalue()


def test_the_command_creates_the_first_team(people):
    said = run("vision-lab", "--leader", "alice", "--members", "bob,carol")
    team = Team.objects.get(slug="vision-lab")
    assert team.name == "Vision Lab" and team.max_cards is None and team.shares == 1
    assert roles("vision-lab") == {"alice": "leader", "bob": "member", "carol": "member"}
    assert "Created team Vision Lab (vision-lab): 1 leader(s), 2 member(s)" in said
    entry = AuditEntry.objects.get(action="team.create")
    assert entry.actor is None and entry.team == team
    assert (
        entry.message
        == "manage.py team_create created team Vision Lab (vision-lab); leaders: alice; members: bob, carol"
    )


def test_docs_deploy_first_team_step_runs_as_written(people):
    """docs/deploy.md's first hour: its `manage.py team_create …` line, as a shell would split it."""
    deploy = (Path(settings.BASE_DIR) / "docs" / "deploy.md").read_text()
    line = re.search(r"manage\.py (team_create [^\n`]*)", deploy).group(1)
    run(*shlex.split(line)[1:])
    assert roles("vision-lab") == {"alice": "leader", "bob": "member", "carol": "member"}


def test_the_command_names_every_unknown_user_and_writes_nothing(people):
    with pytest.raises(CommandError) as refused:
        run("vision-lab", "--leader", "Alice", "--members", "bob,zed,yan")
    said = str(refused.value)
    assert said.startswith("Nothing was written")
    assert "'Alice' (did you mean alice?)" in said
    assert "'zed'" in said and "'yan'" in said
    assert not Team.objects.exists() and not Membership.objects.exists() and not AuditEntry.objects.exists()


def test_the_command_again_with_the_same_people_changes_nothing(people):
    run("vision-lab", "--leader", "alice", "--members", "bob,carol")
    said = run("vision-lab", "--leader", "alice", "--members", "carol", "--members", "bob")
    assert "exists already with these leaders and members: nothing changed" in said
    assert AuditEntry.objects.count() == 1


def test_the_command_refuses_a_team_that_exists_with_others(people):
    run("vision-lab", "--leader", "alice")
    with pytest.raises(CommandError, match=r"exists already, with alice \(leader\). Nothing was written"):
        run("vision-lab", "--leader", "bob")
    assert roles("vision-lab") == {"alice": "leader"}


def test_the_command_refuses_a_deactivated_account_and_someone_listed_twice(people):
    people["carol"].is_active = False
    people["carol"].save()
    with pytest.raises(CommandError) as refused:
        run("nlp", "--leader", "alice", "--members", "alice,carol")
    said = str(refused.value)
    assert "The account of carol is deactivated" in said and "alice listed as leader and as member" in said
    assert not Team.objects.exists()


# --- the services ----------------------------------------------------------------------------------


def test_every_problem_of_a_new_team_at_once(people, admin_user):
    Team.objects.create(name="Vision Lab", slug="vision-lab")
    with pytest.raises(Invalid) as refused:
        team_create(actor=admin_user, name="vision lab", slug="Bad Slug!", members=["nobody"])
    assert set(refused.value.errors) == {"name", "slug", "members"}
    assert Team.objects.count() == 1


def test_adding_someone_twice_says_to_change_their_role(people, admin_user):
    team = team_create(actor=admin_user, name="Vision Lab", leaders=["alice"])
    with pytest.raises(Invalid, match="alice is in Vision Lab already, as leader: change their role instead"):
        team_member_add(actor=admin_user, team=team, username="alice", role="member")


# --- the pages ---------------------------------------------------------------------------------------


def test_an_admin_creates_a_team_on_the_teams_page(people, admin_user):
    client = client_for(admin_user)
    page = client.get(reverse("teams")).content.decode()
    assert "Create a team" in page and "No team yet: create the first one below." in page
    answer = client.post(
        reverse("teams"), {"name": "Vision Lab", "slug": "", "leaders": "alice", "members": "bob, carol"}
    )
    assert answer.status_code == 302 and answer["Location"] == reverse("team_detail", args=["vision-lab"])
    assert roles("vision-lab") == {"alice": "leader", "bob": "member", "carol": "member"}
    assert AuditEntry.objects.get(action="team.create").actor == admin_user


def test_a_refused_new_team_shows_each_problem_beside_its_field(people, admin_user):
    answer = client_for(admin_user).post(
        reverse("teams"), {"name": "", "slug": "", "leaders": "zed", "members": ""}
    )
    page = answer.content.decode()
    assert answer.status_code == 200
    assert "Give the team a name, e.g. Vision Lab." in page
    assert not Team.objects.exists()
    answer = client_for(admin_user).post(reverse("teams"), {"name": "Robotics", "leaders": "zed"})
    assert "No portal user is named &#x27;zed&#x27;" in answer.content.decode()
    assert not Team.objects.exists()


def test_members_see_no_create_form_and_may_not_post(people):
    client = client_for(people["alice"])
    assert "Create a team" not in client.get(reverse("teams")).content.decode()
    assert client.post(reverse("teams"), {"name": "Mine"}).status_code == 403
    assert not Team.objects.exists()


def test_an_admin_adds_makes_leader_and_takes_out_members(people, admin_user):
    team = team_create(actor=admin_user, name="Vision Lab", leaders=["alice"])
    client = client_for(admin_user)
    members = reverse("team_members", args=[team.slug])
    assert client.post(members, {"username": "bob", "role": "member"}).status_code == 302
    assert (
        client.post(reverse("team_member_role", args=[team.slug, "bob"]), {"role": "leader"}).status_code
        == 302
    )
    assert roles(team.slug) == {"alice": "leader", "bob": "leader"}
    answer = client.post(reverse("team_member_remove", args=[team.slug, "alice"]), follow=True)
    assert (
        "alice is no longer in Vision Lab: their queued jobs of Vision Lab that had not started are cancelled"
        in (answer.content.decode())
    )
    assert roles(team.slug) == {"bob": "leader"}
    said = list(
        AuditEntry.objects.filter(action="team.members").order_by("id").values_list("message", flat=True)
    )
    assert said == [
        "admin added bob to Vision Lab as member",
        "admin made bob leader of Vision Lab, was member",
        "admin removed alice (leader) from Vision Lab",
    ]
    assert AuditEntry.objects.filter(team=team).count() == 4  # with its creation: the team page's log


def test_a_refused_add_says_why_beside_the_field(people, admin_user):
    team = team_create(actor=admin_user, name="Vision Lab")
    answer = client_for(admin_user).post(
        reverse("team_members", args=[team.slug]), {"username": "zed", "role": "leader"}
    )
    assert answer.status_code == 200 and "No portal user is named &#x27;zed&#x27;" in answer.content.decode()
    assert not Membership.objects.exists()


def test_a_directory_teams_members_page_says_changes_last_until_the_next_sign_in(
    people, admin_user, settings
):
    from portal.identity_env import parse_group_teams

    settings.IDENTITY_GROUP_TEAMS = parse_group_teams("vision=vision-lab:member")
    team = team_create(actor=admin_user, name="Vision Lab")
    page = client_for(admin_user).get(reverse("team_members", args=[team.slug])).content.decode()
    assert "lasts until the person&#x27;s next sign-in" in page


def test_the_team_page_sets_the_fair_share_shares(people, admin_user):
    team = team_create(actor=admin_user, name="Vision Lab", leaders=["alice"], members=["bob"])
    client = client_for(admin_user)
    page = client.get(reverse("team_detail", args=[team.slug])).content.decode()
    assert page.count("Fair-share shares") == 3  # the team's and each member's forms
    assert client.post(reverse("team_quota", args=[team.slug]), {"shares": "3"}).status_code == 302
    leader = client_for(people["alice"])
    answer = leader.post(reverse("member_quota", args=[team.slug, "bob"]), {"shares": "2"})
    assert answer.status_code == 302
    team.refresh_from_db()
    assert team.shares == 3 and Membership.objects.get(user__username="bob").shares == 2
    assert AuditEntry.objects.filter(action__in=("quota.team", "quota.member"), team=team).count() == 2

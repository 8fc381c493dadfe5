"""A leader finds the team's jobs from Jobs and from the team page (issue 41, item 11)."""

from __future__ import annotations

from django.urls import reverse

from tests.factories import queue_job


def tabs(response) -> list[tuple[str, str, bool]]:
    return response.context["tabs"]


def test_a_leaders_jobs_page_offers_the_teams_jobs(client, alice, leader, box):
    job = queue_job(alice)
    client.force_login(leader)
    mine = client.get(reverse("my_jobs"))
    team_url = f"{reverse('job_history')}?team=vision-lab"
    assert tabs(mine) == [("Mine", reverse("my_jobs"), True), ("Vision Lab's jobs", team_url, False)]
    html = mine.content.decode()
    assert f'href="{team_url}"' in html and "Your teams' jobs are under the tabs above" in html

    team = client.get(team_url)
    assert job in team.context["jobs"]
    assert ("Vision Lab's jobs", team_url, True) in tabs(team)


def test_an_admin_gets_every_job_as_a_tab(client, alice, admin_user, box):
    job = queue_job(alice)
    client.force_login(admin_user)
    assert ("All jobs", reverse("job_history"), False) in tabs(client.get(reverse("my_jobs")))
    every = client.get(reverse("job_history"))
    assert ("All jobs", reverse("job_history"), True) in tabs(every)
    assert job in every.context["jobs"]


def test_a_member_has_no_tabs(client, alice):
    client.force_login(alice)
    response = client.get(reverse("my_jobs"))
    assert tabs(response) == [] and 'class="tabs"' not in response.content.decode()


def test_the_team_page_links_to_the_teams_jobs(client, leader):
    client.force_login(leader)
    html = client.get(reverse("team_detail", args=["vision-lab"])).content.decode()
    assert f'href="{reverse("job_history")}?team=vision-lab" class="team-jobs"' in html

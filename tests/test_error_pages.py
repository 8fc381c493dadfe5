"""403, 404 and 500 say what happened and where to go next, with the portal's look (issue 23)."""

from __future__ import annotations

import pytest
from django.template.loader import render_to_string

pytestmark = pytest.mark.django_db


def test_a_missing_page_says_so_and_offers_the_way_back(client, alice):
    client.force_login(alice)
    answer = client.get("/jobs/999999/")
    page = answer.content.decode()
    assert answer.status_code == 404
    assert "Nothing here" in page and 'href="/jobs/"' in page and "portal.css" in page


def test_a_page_that_is_not_yours_says_whom_to_ask(client, bob, team):
    client.force_login(bob)
    answer = client.get(f"/teams/{team.slug}/")  # a member: the team's page is its leaders'
    assert answer.status_code == 403 and "Not yours to see" in answer.content.decode()


def test_the_500_page_needs_no_database_or_request():
    page = render_to_string("500.html")
    assert "Something went wrong" in page and 'href="/"' in page


def test_reports_on_a_fresh_install_say_what_will_appear(client, alice):
    client.force_login(alice)
    page = client.get("/reports/").content.decode()
    assert 'id="report-empty"' in page and 'class="job-charts report-charts" hidden' in page

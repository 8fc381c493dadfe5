"""The lists' FilterSets through the API and the pages: what each filter keeps, and how a bad
value is answered (a 400 naming the parameter and the fix; beside the field on the pages).
Also the API's object lookup (DRF's get_object) with a job id that is no number."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_cancel, reservation_create
from gpus.models import Reservation
from gpus.quotas import quota_member_set
from gpus.services import server_report_ingest
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from portal.filters import DayFilter
from portal.models import AuditEntry, Membership
from tests.factories import MembershipFactory, TeamFactory, make_snapshot

H = timedelta(hours=1)


@pytest.fixture(autouse=True)
def _no_broker(sent) -> None:
    """A submitted job is never sent to a worker here."""


def api(user=None) -> APIClient:
    client = APIClient()
    if user:
        client.force_authenticate(user)
    return client


def ids(response) -> set[int]:
    assert response.status_code == 200, response.json()
    return {row["id"] for row in response.json()["results"]}


@pytest.fixture
def jobs(alice, bob, leader, box):
    """alice: a queued job on box1 and a failed one on box2 last week; bob: a succeeded one."""
    server_report_ingest(snapshot=make_snapshot("box2", gpus=2))
    upload = ScriptUpload(name="a.py", content=b"print(1)\n")

    def submit(user, gpu: str, status: str | None = None, days_ago: int = 0) -> Job:
        job = job_submit(
            user=user, reservation=reservation_create(user=user, gpus=[gpu], memory_mb=4096), script=upload
        )
        created = timezone.now() - timedelta(days=days_ago)
        Job.objects.filter(pk=job.pk).update(status=status or job.status, created_at=created)
        return job

    return {
        "queued": submit(alice, box[0].uuid).pk,
        "failed": submit(alice, "GPU-box2-00", Job.Status.FAILED, days_ago=7).pk,
        "bob": submit(bob, box[1].uuid, Job.Status.SUCCEEDED).pk,
    }


# --- /api/v1/jobs/ ------------------------------------------------------------------------


def test_the_jobs_api_filters_like_the_history_page(alice, leader, jobs):
    client = api(leader)
    url = "/api/v1/jobs/"
    assert ids(client.get(url)) == set(jobs.values())
    assert ids(client.get(url, {"user": "bob"})) == {jobs["bob"]}
    assert ids(client.get(url, {"team": "vision-lab", "status": "failed"})) == {jobs["failed"]}
    assert ids(client.get(url, {"team": "nope"})) == set()
    assert ids(client.get(url, {"server": "box2"})) == {jobs["failed"]}
    week_ago = (timezone.localdate() - timedelta(days=7)).isoformat()
    yesterday = (timezone.localdate() - timedelta(days=1)).isoformat()
    assert ids(client.get(url, {"since": week_ago, "until": yesterday})) == {jobs["failed"]}
    assert ids(client.get(url, {"since": timezone.localdate().isoformat()})) == {jobs["queued"], jobs["bob"]}
    assert ids(client.get(url, {"until": "9000-12-31", "since": "1900-01-01"})) == set(jobs.values())
    assert ids(client.get(url, {"mine": "1"})) == set()  # the leader runs none
    assert ids(api(alice).get(url, {"mine": "true"})) == {jobs["queued"], jobs["failed"]}
    assert ids(api(alice).get(url, {"mine": "false"})) == {jobs["queued"], jobs["failed"]}


@pytest.mark.parametrize(
    ("params", "param", "message"),
    [
        ({"status": "exploded"}, "status", "Unknown status; use one of pending, queued, starting, running"),
        ({"since": "2024-13-01"}, "since", "'2024-13-01' is not a date; write it as YYYY-MM-DD."),
        ({"until": "last week"}, "until", "'last week' is not a date; write it as YYYY-MM-DD."),
        ({"since": "50%"}, "since", "'50%' is not a date"),
        ({"user": "x" * 151}, "user", "at most 150 characters"),
        (
            {"since": "0001-01-01"},
            "since",
            "'0001-01-01' is out of range; give a date between 1900-01-01 and 9000-12-31.",
        ),
        ({"until": "9999-12-31"}, "until", "'9999-12-31' is out of range"),
    ],
)
def test_the_jobs_api_answers_a_bad_filter_with_a_400_naming_it(alice, jobs, params, param, message):
    response = api(alice).get("/api/v1/jobs/", params)
    assert response.status_code == 400
    body = response.json()
    assert body["code"] == "invalid" and list(body["errors"]) == [param]
    assert message in body["errors"][param][0]
    assert body["detail"].startswith(f"{param}: ") and message in body["detail"]


@pytest.mark.parametrize("pk", ["abc", "99999999999999999999999", "-1", "0x1"])
def test_the_jobs_api_answers_a_job_id_that_is_no_job_with_a_404(alice, jobs, pk):
    for method, url in (
        ("get", f"/api/v1/jobs/{pk}/"),
        ("get", f"/api/v1/jobs/{pk}/log/"),
        ("post", f"/api/v1/jobs/{pk}/cancel/"),
    ):
        response = getattr(api(alice), method)(url, HTTP_ACCEPT="application/json")
        assert response.status_code == 404, url
        assert response.json()["code"] == "not_found", url


# --- /api/v1/reservations/ and /api/v1/gpus/ ------------------------------------------------


@pytest.fixture
def bookings(alice, bob, charlie, box, t0):
    server_report_ingest(snapshot=make_snapshot("box2", gpus=1))
    now = timezone.now()
    other = TeamFactory(slug="speech")
    MembershipFactory(team=other, user=alice)
    cancelled = reservation_create(user=bob, gpus=[box[2].uuid], start=t0 + 5 * H, end=t0 + 6 * H)
    reservation_cancel(user=bob, reservation=cancelled)
    return {
        "active": reservation_create(
            user=alice, gpus=[box[0].uuid], start=now, end=now + H, team="vision-lab"
        ).pk,
        "upcoming": reservation_create(
            user=alice, gpus=["GPU-box2-00"], start=t0, end=t0 + H, team="speech"
        ).pk,
        "bob_upcoming": reservation_create(user=bob, gpus=[box[1].uuid], start=t0, end=t0 + H).pk,
        "cancelled": cancelled.pk,
        "charlie": reservation_create(user=charlie, gpus=[box[3].uuid], start=t0, end=t0 + H).pk,
    }


def test_the_reservations_api_filters_by_status_server_team_and_mine(alice, bob, admin_user, bookings):
    url = "/api/v1/reservations/"
    b = bookings
    assert ids(api(bob).get(url)) == {b["active"], b["bob_upcoming"], b["cancelled"]}
    assert ids(api(bob).get(url, {"status": "active"})) == {b["active"]}
    assert ids(api(bob).get(url, {"status": "upcoming"})) == {b["bob_upcoming"]}
    assert ids(api(bob).get(url, {"status": "open"})) == {b["active"], b["bob_upcoming"]}
    assert ids(api(bob).get(url, {"status": "cancelled"})) == {b["cancelled"]}
    assert ids(api(bob).get(url, {"mine": "1"})) == {b["bob_upcoming"], b["cancelled"]}
    assert ids(api(alice).get(url, {"team": "speech"})) == {b["upcoming"]}
    assert ids(api(alice).get(url, {"server": "box2"})) == {b["upcoming"]}
    assert ids(api(admin_user).get(url, {"server": "box1", "status": "upcoming"})) == {
        b["bob_upcoming"],
        b["charlie"],
    }
    bad = api(bob).get(url, {"status": "soon"})
    assert bad.status_code == 400
    message = bad.json()["errors"]["status"][0]
    assert message == "Unknown status; use one of upcoming, active, ended, cancelled, released, open."


def test_the_gpus_api_filters_by_server(alice, bookings):
    gpus = api(alice).get("/api/v1/gpus/", {"server": "box2"}).json()
    assert [g["uuid"] for g in gpus] == ["GPU-box2-00"]
    assert len(api(alice).get("/api/v1/gpus/").json()) == 5


# --- /api/v1/teams/{slug}/audit/ ------------------------------------------------------------


def test_the_audit_api_filters_by_action_actor_target_and_day(alice, leader, team, bookings):
    quota_member_set(actor=leader, membership=Membership.objects.get(user=alice, team=team), max_cards=2)
    AuditEntry.objects.filter(action=AuditEntry.Action.RESERVATION_CANCEL).update(
        at=timezone.now() - timedelta(days=3)
    )
    url = "/api/v1/teams/vision-lab/audit/"
    client = api(leader)
    everything = ids(client.get(url))
    assert len(everything) == AuditEntry.objects.filter(team=team).count() > 3
    quota = ids(client.get(url, {"action": "quota.member"}))
    assert quota == set(AuditEntry.objects.filter(action="quota.member").values_list("pk", flat=True))
    assert ids(client.get(url, {"actor": "leader"})) == quota
    cancel = AuditEntry.objects.get(action="reservation.cancel")
    assert ids(client.get(url, {"target": cancel.target, "action": "reservation.cancel"})) == {cancel.pk}
    day = (timezone.localdate() - timedelta(days=3)).isoformat()
    assert ids(client.get(url, {"since": day, "until": day})) == {cancel.pk}
    assert cancel.pk not in ids(client.get(url, {"since": timezone.localdate().isoformat()}))
    bad = client.get(url, {"action": "deleted", "until": "tomorrow"})
    assert bad.status_code == 400
    errors = bad.json()["errors"]
    assert errors["action"][0].startswith("Unknown action; use one of reservation.create, ")
    assert errors["until"] == ["'tomorrow' is not a date; write it as YYYY-MM-DD."]


# --- the pages --------------------------------------------------------------------------------


def test_history_offers_the_teams_the_user_leads_and_every_server(client, alice, leader, admin_user, jobs):
    TeamFactory(name="Speech Lab", slug="speech")
    client.force_login(leader)
    form = client.get(reverse("job_history")).context["filter_form"]
    assert list(form.fields) == ["user", "team", "server", "status", "since", "until", "array"]
    assert list(form.fields["team"].widget.choices) == [("", "any team"), ("vision-lab", "Vision Lab")]
    assert list(form.fields["server"].widget.choices) == [
        ("", "any server"),
        ("box1", "box1"),
        ("box2", "box2"),
    ]
    assert form.fields["status"].choices[0] == ("", "any status")
    client.force_login(admin_user)
    form = client.get(reverse("job_history")).context["filter_form"]
    assert [slug for slug, _ in form.fields["team"].widget.choices] == ["", "speech", "vision-lab"]
    client.force_login(alice)
    html = client.get(reverse("job_history")).content.decode()
    assert '<option value="vision-lab"' not in html and '<option value="" selected>any team</option>' in html
    form = client.get(reverse("my_jobs")).context["filter_form"]
    assert list(form.fields) == ["server", "status", "since", "until", "array"]


def test_the_pages_keep_the_filter_values_and_render_dates_as_date_inputs(client, leader, jobs):
    client.force_login(leader)
    html = client.get(reverse("job_history"), {"server": "box2", "since": "2024-01-02"}).content.decode()
    assert '<option value="box2" selected>box2</option>' in html
    assert 'type="date" name="since" value="2024-01-02"' in html
    assert "YYYY-MM-DD, inclusive." in html


# --- the ends of the calendar ---------------------------------------------------------------


@pytest.fixture
def berlin(settings):
    """A time zone east of UTC: 0001-01-01 00:00 there is before the first moment UTC can hold."""
    settings.TIME_ZONE = "Europe/Berlin"


@pytest.mark.parametrize("url", ["/api/v1/jobs/", "/api/v1/teams/vision-lab/audit/"])
@pytest.mark.parametrize(("param", "day"), [("since", "0001-01-01"), ("until", "9999-12-31")])
def test_the_api_answers_a_day_off_the_calendar_with_a_400_east_of_utc(berlin, leader, jobs, url, param, day):
    response = api(leader).get(url, {param: day})
    assert response.status_code == 400, response.content
    message = f"'{day}' is out of range; give a date between 1900-01-01 and 9000-12-31."
    assert response.json() == {
        "detail": f"{param}: {message}",
        "code": "invalid",
        "errors": {param: [message]},
    }


def test_the_history_page_shows_a_day_off_the_calendar_beside_the_field_east_of_utc(
    berlin, client, leader, jobs
):
    client.force_login(leader)
    response = client.get(reverse("job_history"), {"since": "0001-01-01"})
    assert response.status_code == 200
    assert response.context["filter_form"].errors == {
        "since": ["'0001-01-01' is out of range; give a date between 1900-01-01 and 9000-12-31."]
    }
    assert response.context["jobs"] == []
    assert "No jobs match these filters." in response.content.decode()
    wide = client.get(reverse("job_history"), {"since": "1900-01-01", "until": "9000-12-31"})
    assert {job.pk for job in wide.context["jobs"]} == set(jobs.values())


def test_a_day_filter_refuses_a_lookup_it_cannot_bound_when_declared():
    with pytest.raises(ImproperlyConfigured, match="lookup_expr must be 'gte' or 'lte', not 'exact'"):
        DayFilter(field_name="at")
    DayFilter(field_name="at", lookup_expr="gte")


# --- the team page's audit log ---------------------------------------------------------------


def test_the_team_page_filters_its_audit_log_with_the_apis_filterset(client, alice, leader, team, bookings):
    quota_member_set(actor=leader, membership=Membership.objects.get(user=alice, team=team), max_cards=2)
    AuditEntry.objects.filter(action=AuditEntry.Action.RESERVATION_CANCEL).update(
        at=timezone.now() - timedelta(days=3)
    )
    client.force_login(leader)
    url = reverse("team_detail", args=[team.slug])

    def shown(params: dict) -> set[int]:
        response = client.get(url, params)
        assert response.status_code == 200
        return {entry.pk for entry in response.context["audit_page"]}

    team_log = AuditEntry.objects.filter(team=team)
    assert shown({}) == set(team_log.values_list("pk", flat=True))
    quota = set(team_log.filter(action="quota.member").values_list("pk", flat=True))
    assert shown({"action": "quota.member"}) == quota
    assert shown({"actor": "leader"}) == quota
    cancel = team_log.get(action="reservation.cancel")
    assert shown({"target": cancel.target, "action": "reservation.cancel"}) == {cancel.pk}
    day = (timezone.localdate() - timedelta(days=3)).isoformat()
    assert shown({"since": day, "until": day}) == {cancel.pk}
    form = client.get(url).context["audit_form"]
    assert list(form.fields) == ["action", "actor", "target", "since", "until"]
    # The menu offers whoever acted in this team's log, nobody else's.
    assert list(form.fields["actor"].widget.choices) == [
        ("", "anyone"),
        ("alice", "alice"),
        ("bob", "bob"),
        ("leader", "leader"),
    ]


def test_the_team_page_shows_a_bad_audit_filter_beside_its_field_and_keeps_the_rest(
    client, leader, team, bookings
):
    client.force_login(leader)
    response = client.get(
        reverse("team_detail", args=[team.slug]), {"action": "deleted", "until": "tomorrow"}
    )
    assert response.status_code == 200
    errors = response.context["audit_form"].errors
    assert errors["action"][0].startswith("Unknown action; use one of reservation.create, ")
    assert errors["until"] == ["'tomorrow' is not a date; write it as YYYY-MM-DD."]
    body = response.content.decode()
    assert list(response.context["audit_page"]) == []
    assert "No entries match these filters." in body
    assert "{#" not in body and "{% comment" not in body
    assert 'id="team-open-bookings"' in body and 'data-member="alice"' in body  # the rest of the page


def test_the_team_page_pages_through_its_audit_log_keeping_the_filters(client, leader, team):
    AuditEntry.objects.bulk_create(
        AuditEntry(
            team=team,
            actor=leader,
            action=AuditEntry.Action.QUOTA_TEAM,
            target=f"n {i}",
            message=f"entry {i}",
        )
        for i in range(60)
    )
    client.force_login(leader)
    url = reverse("team_detail", args=[team.slug])
    first = client.get(url, {"action": "quota.team"})
    page = first.context["audit_page"]
    assert len(page) == 50 and page.paginator.count == 60
    body = first.content.decode()
    assert '<a href="?action=quota.team&amp;page=2#audit">Older →</a>' in body
    older = client.get(url, {"action": "quota.team", "page": "2"}).context["audit_page"]
    assert len(older) == 10
    assert {e.pk for e in page}.isdisjoint({e.pk for e in older})


# --- My reservations -------------------------------------------------------------------------


def test_my_reservations_filters_both_lists_with_the_reservation_filterset(client, alice, bookings):
    ended = reservation_create(
        user=alice,
        gpus=["GPU-box2-00"],
        start=timezone.now() + 3 * H,
        end=timezone.now() + 4 * H,
        team="speech",
    )
    Reservation.objects.filter(pk=ended.pk).update(start=timezone.now() - 3 * H, end=timezone.now() - 2 * H)
    client.force_login(alice)
    url = reverse("my_reservations")

    def lists(params: dict) -> tuple[set[int], set[int]]:
        response = client.get(url, params)
        assert response.status_code == 200
        return {r.pk for r in response.context["open"]}, {r.pk for r in response.context["page"]}

    b = bookings
    assert lists({}) == ({b["active"], b["upcoming"]}, {ended.pk})
    assert lists({"status": "upcoming"}) == ({b["upcoming"]}, set())
    assert lists({"status": "ended"}) == (set(), {ended.pk})
    assert lists({"server": "box2"}) == ({b["upcoming"]}, {ended.pk})
    assert lists({"team": "speech", "status": "open"}) == ({b["upcoming"]}, set())
    form = client.get(url).context["filter_form"]
    assert list(form.fields) == ["status", "server", "team"]  # ?mine= is moot here
    # Menus: every server, and only the teams alice belongs to.
    assert [v for v, _ in form.fields["server"].widget.choices] == ["", "box1", "box2"]
    assert [v for v, _ in form.fields["team"].widget.choices] == ["", "speech", "vision-lab"]


def test_my_reservations_shows_a_bad_filter_beside_its_field_and_lists_nothing(client, alice, bookings):
    client.force_login(alice)
    response = client.get(reverse("my_reservations"), {"status": "soon"})
    assert response.status_code == 200
    assert response.context["filter_form"].errors["status"] == [
        "Unknown status; use one of upcoming, active, ended, cancelled, released, open."
    ]
    assert response.context["open"] == [] and list(response.context["page"]) == []
    body = response.content.decode()
    assert "No open booking matches these filters." in body
    assert "{#" not in body and "{% comment" not in body  # the partials' comments stay out of the page
    assert '<tr data-team="vision-lab">' in body  # the quota section is still there


def test_my_reservations_pages_through_past_bookings(client, alice, box):
    now = timezone.now()
    for i in range(30):
        booked = reservation_create(
            user=alice, gpus=[box[i % 4].uuid], start=now + (i + 1) * H, end=now + (i + 2) * H
        )
        reservation_cancel(user=alice, reservation=booked)
    client.force_login(alice)
    first = client.get(reverse("my_reservations"), {"status": "cancelled"})
    assert len(first.context["page"]) == 25 and first.context["page"].paginator.count == 30
    assert '<a href="?status=cancelled&amp;page=2#bookings">Older →</a>' in first.content.decode()
    assert (
        len(client.get(reverse("my_reservations"), {"status": "cancelled", "page": 2}).context["page"]) == 5
    )

"""The lists' FilterSets through the API and the pages: what each filter keeps, and how a bad
value is answered (a 400 naming the parameter and the fix; beside the field on the pages).
Also the API's object lookup (DRF's get_object) with a job id that is no number."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_cancel, reservation_create
from gpus.quotas import quota_member_set
from gpus.services import server_report_ingest
from jobs.models import Job
from jobs.services import ScriptUpload, job_submit
from portal.models import AuditEntry, Membership
from tests.factories import MembershipFactory, TeamFactory, make_snapshot

H = timedelta(hours=1)


@pytest.fixture(autouse=True)
def _no_broker(monkeypatch) -> None:
    monkeypatch.setattr("jobs.tasks.run_job.apply_async", lambda *args, **kwargs: None)


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
    assert ids(client.get(url, {"until": "9999-12-31", "since": "0001-01-01"})) == set(jobs.values())
    assert ids(client.get(url, {"mine": "1"})) == set()  # the leader runs none
    assert ids(api(alice).get(url, {"mine": "true"})) == {jobs["queued"], jobs["failed"]}
    assert ids(api(alice).get(url, {"mine": "false"})) == {jobs["queued"], jobs["failed"]}


@pytest.mark.parametrize(
    ("params", "param", "message"),
    [
        ({"status": "exploded"}, "status", "Unknown status; use one of queued, starting, running"),
        ({"since": "2024-13-01"}, "since", "'2024-13-01' is not a date; write it as YYYY-MM-DD."),
        ({"until": "last week"}, "until", "'last week' is not a date; write it as YYYY-MM-DD."),
        ({"since": "50%"}, "since", "'50%' is not a date"),
        ({"user": "x" * 151}, "user", "at most 150 characters"),
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
    assert list(form.fields) == ["user", "team", "server", "status", "since", "until"]
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
    assert list(form.fields) == ["server", "status", "since", "until"]


def test_the_pages_keep_the_filter_values_and_render_dates_as_date_inputs(client, leader, jobs):
    client.force_login(leader)
    html = client.get(reverse("job_history"), {"server": "box2", "since": "2024-01-02"}).content.decode()
    assert '<option value="box2" selected>box2</option>' in html
    assert 'type="date" name="since" value="2024-01-02"' in html
    assert "YYYY-MM-DD, inclusive." in html

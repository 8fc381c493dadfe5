"""One clock for every heartbeat and its cut-off: the database's (portal.clock).

The host that writes a beat (a GPU host's worker, the web server answering `gpu`, the collector)
is given a clock 5 minutes behind or ahead of the truth; the database's clock (and the readers':
the reconciler, the dashboard, /metrics) is the truth. A healthy job, session or server must not
be judged lost or offline, and one whose beats stopped must still be, after its cut-off.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from types import ModuleType, SimpleNamespace

import pytest
from django.utils import timezone
from prometheus_client.core import Metric
from rest_framework.test import APIClient

from gpus import services as gpu_services
from gpus.models import Allocation, Reservation, Server
from gpus.selectors import dashboard_servers
from gpus.services import server_report_ingest
from jobs import runs
from jobs.host import launch, runner
from jobs.host.launch import job_claim
from jobs.host.runner import job_run
from jobs.models import InteractiveSession, Job
from jobs.prometheus.metrics import PortalCollector
from jobs.services import jobs_reconcile
from jobs.sessions import services as interactive
from jobs.submit import ScriptUpload, job_submit
from tests.factories import make_snapshot
from tests.test_sessions import start
from tests.waiting import wait_for

SKEWS = [
    pytest.param(timedelta(minutes=-5), id="host-5-min-behind"),
    pytest.param(timedelta(minutes=5), id="host-5-min-ahead"),
]
# Prints, then outlives JOB_LOST_AFTER_SECONDS (3 s below) by a margin, beating all along.
OUTLIVES_THE_CUT_OFF = "import time\nprint('ready', flush=True)\ntime.sleep(6)\nprint('done', flush=True)\n"


def skew(monkeypatch: pytest.MonkeyPatch, offset: timedelta, *modules: ModuleType) -> None:
    """What these modules believe the time is: the true time plus `offset` (a host's clock off)."""

    def now() -> datetime:
        return timezone.now() + offset

    for module in modules:
        monkeypatch.setattr(module, "timezone", SimpleNamespace(now=now))


@pytest.fixture
def short_cut_offs(settings) -> None:  # type: ignore[no-untyped-def]
    settings.JOB_HEARTBEAT_SECONDS = 1
    settings.JOB_LOST_AFTER_SECONDS = 3
    settings.JOB_KILL_GRACE_SECONDS = 1
    settings.JOB_DRAIN_SECONDS = 1
    settings.SESSION_LOST_AFTER_SECONDS = 3
    settings.SERVER_OFFLINE_AFTER_SECONDS = 5


def _submit(alice, booking, source: str) -> Job:  # type: ignore[no-untyped-def]
    # Begun 10 minutes ago: a host 5 minutes behind still finds it active (its start is a check
    # of the booking's window by the host's clock, which this change leaves alone).
    begun = timezone.now() - timedelta(minutes=10)
    Reservation.objects.filter(pk=booking.pk).update(start=begun)
    Allocation.objects.filter(reservation=booking).update(start=begun)
    upload = ScriptUpload(name="job.py", content=source.encode())
    return job_submit(user=alice, reservation=booking, script=upload)


@pytest.mark.django_db(transaction=True)  # the supervisor's threads have connections of their own
@pytest.mark.parametrize("offset", SKEWS)
def test_it_never_judges_a_beating_job_lost_whatever_its_hosts_clock(
    alice, booking, sent, short_cut_offs, monkeypatch, offset
):
    skew(monkeypatch, offset, runner, launch)  # the GPU host's worker: claim, supervisor, beats
    job = _submit(alice, booking, OUTLIVES_THE_CUT_OFF)
    outcome: list[str | None] = []
    worker = threading.Thread(target=lambda: outcome.append(job_run(job.pk)), daemon=True)
    worker.start()
    lost = 0
    while worker.is_alive():  # the portal's reconciler, on the true clock, all the job long
        lost += jobs_reconcile()["lost"]
        worker.join(timeout=0.5)
    job.refresh_from_db()
    assert (lost, outcome, job.status) == (0, [Job.Status.SUCCEEDED], Job.Status.SUCCEEDED), job.message


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("offset", SKEWS)
def test_a_job_whose_beats_stopped_is_lost_after_the_cut_off_whatever_its_hosts_clock(
    alice, booking, sent, short_cut_offs, monkeypatch, offset
):
    skew(monkeypatch, offset, launch)
    job = _submit(alice, booking, OUTLIVES_THE_CUT_OFF)
    assert job_claim(job.pk) is not None  # its one beat; then its worker dies
    assert jobs_reconcile()["lost"] == 0  # not before JOB_LOST_AFTER_SECONDS
    wait_for(lambda: jobs_reconcile()["lost"], timeout=10, what="the job found lost")
    job.refresh_from_db()
    assert job.status == Job.Status.LOST and job.message.startswith("Lost: no heartbeat")


def api(user) -> APIClient:  # type: ignore[no-untyped-def]
    client = APIClient()
    client.force_authenticate(user)
    return client


def _running_session(alice, booking, monkeypatch, offset: timedelta) -> int:  # type: ignore[no-untyped-def]
    """A `gpu exec` session, started on the true clock (a clock behind would find the booking not
    begun yet), then told running and beating by a web server whose clock is `offset` off. The
    reconciler (the portal's worker, another host) keeps the true clock."""
    body = {"kind": "exec", "host": "box1", "command": ["python", "train.py"], "reservation": booking.pk}
    started = api(alice).post("/api/v1/sessions/", body, format="json")
    assert started.status_code == 201, started.json()
    pk = started.json()["id"]
    with monkeypatch.context() as web_server:
        skew(web_server, offset, interactive)
        running = api(alice).patch(
            f"/api/v1/sessions/{pk}/", {"pid": 4242, "pid_started": 1.5e9}, format="json"
        )
        assert running.json()["status"] == "running"
        assert api(alice).post(f"/api/v1/sessions/{pk}/beat/").status_code == 200
    return pk


@pytest.mark.django_db
@pytest.mark.parametrize("offset", SKEWS)
def test_a_beating_session_is_not_ended_whatever_the_web_servers_clock(
    alice, booking, short_cut_offs, monkeypatch, offset
):
    pk = _running_session(alice, booking, monkeypatch, offset)
    assert jobs_reconcile()["sessions_lost"] == 0
    assert InteractiveSession.objects.get(pk=pk).status == InteractiveSession.Status.RUNNING


@pytest.mark.django_db
@pytest.mark.parametrize("offset", SKEWS)
def test_a_session_whose_beats_stopped_is_ended_after_the_cut_off_whatever_the_clock(
    alice, booking, short_cut_offs, monkeypatch, offset
):
    pk = _running_session(alice, booking, monkeypatch, offset)
    assert jobs_reconcile()["sessions_lost"] == 0
    wait_for(lambda: jobs_reconcile()["sessions_lost"], timeout=10, what="the session ended as lost")
    assert InteractiveSession.objects.get(pk=pk).message.startswith(runs.LOST)


def _server_views(viewer) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """What the dashboard, the booking form (online()) and /metrics say of box9, read just now."""
    metrics: dict[str, Metric] = {m.name: m for m in PortalCollector().collect()}

    def sample(name: str) -> float | None:
        found = [s.value for s in metrics[name].samples if s.labels.get("server") == "box9"]
        return found[0] if found else None

    return {
        "dashboard": next(s["status"] for s in dashboard_servers(viewer) if s["name"] == "box9"),
        "online": Server.objects.online().filter(name="box9").exists(),
        "up": sample("gpu_portal_server_up"),
        "age": sample("gpu_portal_server_last_seen_age_seconds"),
    }


@pytest.mark.django_db
@pytest.mark.parametrize("offset", SKEWS)
def test_a_reporting_server_is_online_whatever_the_collectors_clock(
    alice, short_cut_offs, monkeypatch, offset
):
    skew(monkeypatch, offset, gpu_services)  # the collector's host writes last_seen
    server_report_ingest(snapshot=make_snapshot("box9", gpus=1))
    seen = _server_views(alice)
    assert seen["dashboard"] == Server.Status.ONLINE and seen["online"] and seen["up"] == 1, seen
    assert 0 <= seen["age"] < 5, seen  # type: ignore[operator]


@pytest.mark.django_db
@pytest.mark.parametrize("offset", SKEWS)
def test_a_server_that_stopped_reporting_goes_offline_whatever_the_clock(
    alice, short_cut_offs, monkeypatch, offset
):
    skew(monkeypatch, offset, gpu_services)
    server_report_ingest(snapshot=make_snapshot("box9", gpus=1))
    wait_for(lambda: _server_views(alice)["up"] == 0, timeout=15, what="box9 shown offline")
    seen = _server_views(alice)
    assert seen["dashboard"] == Server.Status.OFFLINE and not seen["online"] and seen["age"] >= 5, seen


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("offset", "over", "asked"),
    [
        pytest.param(timedelta(minutes=5), timedelta(minutes=-2), False, id="web-5-min-ahead-2-min-left"),
        pytest.param(timedelta(minutes=-5), timedelta(seconds=1), True, id="web-5-min-behind-ended"),
    ],
)
def test_a_beat_asks_the_end_by_the_databases_clock(alice, booking, monkeypatch, offset, over, asked):
    """The overrun is judged by the database's clock ("a web server's clock may be off"), the end
    itself was by the web server's: one 5 minutes ahead told `gpu` to stop 5 minutes early, and
    `gpu` keeps to an end once asked (gpu_cli/interactive.py Watch.update), extended or not."""
    pk = start(alice, reservation=booking.pk).json()["id"]
    api(alice).patch(f"/api/v1/sessions/{pk}/", {"pid": 4242}, format="json")
    end = timezone.now() + (-over)
    Reservation.objects.filter(pk=booking.pk).update(start=end - timedelta(hours=1), end=end, booked_end=end)
    skew(monkeypatch, offset, interactive)
    answer = api(alice).post(f"/api/v1/sessions/{pk}/beat/").json()
    assert (answer["end_requested"], answer["status"]) == (asked, "running"), answer


@pytest.mark.django_db
def test_an_end_asked_on_a_web_server_behind_is_not_taken_for_a_past_one(alice, leader, booking, monkeypatch):
    """The end asked on the portal was stamped by the web server's clock and judged by the
    database's: a web server 5 minutes behind made a fresh *End session* look 5 minutes old, so
    the next beat ended the row while `gpu` was still within its grace."""
    pk = start(alice, reservation=booking.pk).json()["id"]
    api(alice).patch(f"/api/v1/sessions/{pk}/", {"pid": 4242}, format="json")
    skew(monkeypatch, timedelta(minutes=-5), interactive)
    assert api(leader).delete(f"/api/v1/sessions/{pk}/").status_code == 200
    answer = api(alice).post(f"/api/v1/sessions/{pk}/beat/").json()
    assert (answer["end_requested"], answer["status"]) == (True, "running"), answer

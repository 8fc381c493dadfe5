"""GET /metrics (jobs/prometheus/metrics.py, jobs/prometheus/views.py): who may read it, what it says, read
back with prometheus_client's own parser, and what a scrape costs in queries.

(tests/test_metrics.py is the training curves' file: jobs.metrics.)"""

from __future__ import annotations

import json
import re
import runpy
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from gpus.booking import reservation_create, reservation_release
from gpus.models import GPU, Server, Violation
from gpus.services import server_report_ingest
from gpus.telemetry import collect_once, publish_snapshot, redis_client, reports_key
from jobs.host.watchdog import HostWatchdog
from jobs.models import InteractiveSession, Job
from jobs.submit import ScriptUpload, job_submit
from portal.env import ImproperlyConfiguredEnv
from tests.factories import make_snapshot, queue_job

pytestmark = pytest.mark.django_db

TOKEN = "s3cret-metrics-token"
GIB = 1024**3
DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana-dashboard.json"
SETTINGS = Path(__file__).resolve().parent.parent / "portal" / "settings.py"


@pytest.fixture(autouse=True)
def _token(settings) -> None:
    settings.METRICS_TOKEN = TOKEN


@pytest.fixture(autouse=True)
def _no_broker(sent) -> None:
    """A submitted job is never sent to a worker here."""


def scrape(client: Client | None = None, token: str = TOKEN) -> dict[str, list]:
    """The samples of each metric family, by name, as Prometheus would read them."""
    response = (client or Client()).get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200, response.content
    families = text_string_to_metric_families(response.content.decode())
    return {family.name: family.samples for family in families}


def value(samples: list, name: str | None = None, **labels: str) -> float:
    found = [s for s in samples if all(s.labels.get(k) == v for k, v in labels.items())]
    if name is not None:
        found = [s for s in found if s.name == name]
    assert len(found) == 1, f"{len(found)} samples with {labels}: {samples}"
    return found[0].value


def card(gpu: GPU) -> dict[str, str]:
    return {"Hostname": "box1.lab", "gpu": str(gpu.index), "UUID": gpu.uuid}


def run(job: Job, server: Server) -> Job:
    Job.objects.filter(pk=job.pk).update(
        status=Job.Status.RUNNING, server=server, heartbeat_at=timezone.now()
    )
    return job


# --- who may read it -------------------------------------------------------------------------


def test_it_does_not_exist_without_a_token(settings, client):
    settings.METRICS_TOKEN = ""
    assert client.get("/metrics").status_code == 404
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer anything").status_code == 404


def test_it_asks_for_the_bearer_token(client, alice):
    response = client.get("/metrics")
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert TOKEN not in response.content.decode()
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Basic {TOKEN}").status_code == 401
    client.force_login(alice)  # a session opens nothing here
    assert client.get("/metrics").status_code == 401


def test_it_answers_prometheus_with_the_token(client):
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    assert "gpu_portal_jobs" in response.content.decode()


# A scrape as Prometheus 2.x/3.x sends it: its Accept (OpenMetrics first), gzip, its timeout
# header, and the bearer token from `credentials_file`, which it trims as the portal trims
# METRICS_TOKEN_FILE.
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "Accept-Encoding": "gzip",
    "User-Agent": "Prometheus/2.53.0",
    "X-Prometheus-Scrape-Timeout-Seconds": "10",
}


@pytest.mark.django_db(transaction=True)
def test_a_scrape_over_http_as_prometheus_sends_it(live_server, tmp_path):
    """Issue 38: over real HTTP, not the test client. Prometheus reads any text/plain answer with
    its text parser (OpenMetrics only when the answer says so), so the answer must say text/plain."""
    credentials = tmp_path / "metrics-token"
    credentials.write_text(TOKEN + "\n")
    token = credentials.read_text().strip()  # prometheus/common's readCredentialsFile: TrimSpace
    headers = {**PROMETHEUS_HEADERS, "Authorization": f"Bearer {token}"}
    response = httpx.get(f"{live_server.url}/metrics", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].split(";")[0] == "text/plain"
    families = {family.name for family in text_string_to_metric_families(response.text)}
    assert "gpu_portal_jobs" in families


def test_it_only_reads(client):
    enforcing = Client(enforce_csrf_checks=True)
    assert enforcing.post("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 405
    assert client.delete("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 405


# --- what it says ----------------------------------------------------------------------------


def test_cards_carry_dcgm_exporters_labels_and_their_bookings(alice, bob, box):
    shared_a = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    shared_b = reservation_create(user=bob, gpus=[box[0].uuid], memory_mb=4096)
    whole = reservation_create(user=bob, gpus=[box[1].uuid])
    m = scrape()
    assert value(m["gpu_portal_gpu_memory_total_bytes"], **card(box[0])) == 24 * GIB
    assert value(m["gpu_portal_gpu_memory_booked_bytes"], **card(box[0])) == 12 * GIB
    assert value(m["gpu_portal_gpu_memory_booked_bytes"], **card(box[1])) == 24 * GIB
    assert value(m["gpu_portal_gpu_memory_booked_bytes"], **card(box[2])) == 0
    bookings = m["gpu_portal_gpu_booking_bytes"]
    held = {
        (
            s.labels["gpu"],
            s.labels["user"],
            s.labels["team"],
            s.labels["reservation"],
            s.labels["mode"],
        ): s.value
        for s in bookings
    }
    assert held == {
        ("0", "alice", "vision-lab", str(shared_a.pk), "shared"): 8 * GIB,
        ("0", "bob", "vision-lab", str(shared_b.pk), "shared"): 4 * GIB,
        ("1", "bob", "vision-lab", str(whole.pk), "whole"): 24 * GIB,
    }
    assert all(s.labels["server"] == "box1" for s in bookings)
    states = m["gpu_portal_gpu_state"]
    assert value(states, state="shared", **card(box[0])) == 1
    assert value(states, state="free", **card(box[0])) == 0
    assert value(states, state="whole", **card(box[1])) == 1
    assert value(states, state="free", **card(box[2])) == 1
    # The latest telemetry, where DCGM is absent (make_snapshot: 1000 + index MiB, 10 %).
    assert value(m["gpu_portal_gpu_memory_used_bytes"], **card(box[0])) == 1000 * 1024**2
    assert value(m["gpu_portal_gpu_utilization_percent"], **card(box[3])) == 10


def test_a_released_booking_no_longer_holds_its_card(alice, box):
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    reservation_release(user=alice, reservation=booking)
    m = scrape()
    assert m["gpu_portal_gpu_booking_bytes"] == []
    assert value(m["gpu_portal_gpu_state"], state="free", **card(box[0])) == 1


def test_a_silent_server_shows_its_cards_offline(box, settings):
    Server.objects.filter(name="box1").update(
        last_seen=timezone.now() - timedelta(seconds=settings.SERVER_OFFLINE_AFTER_SECONDS + 5)
    )
    m = scrape()
    assert value(m["gpu_portal_gpu_state"], state="offline", **card(box[0])) == 1
    assert value(m["gpu_portal_server_up"], server="box1") == 0
    assert (
        value(m["gpu_portal_server_last_seen_age_seconds"], server="box1")
        > settings.SERVER_OFFLINE_AFTER_SECONDS
    )


def test_jobs_by_state_and_the_queue(alice, box):
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    running = run(
        job_submit(user=alice, reservation=booking, script=ScriptUpload("a.py", b"1\n")), box[0].server
    )
    for _ in range(2):
        queue_job(alice, gpus=4)
    Job.objects.filter(status=Job.Status.PENDING).update(created_at=timezone.now() - timedelta(minutes=10))
    m = scrape()
    assert value(m["gpu_portal_jobs"], state="running") == 1
    assert value(m["gpu_portal_jobs"], state="pending") == 2
    assert value(m["gpu_portal_jobs"], state="succeeded") == 0
    assert value(m["gpu_portal_queue_length"]) == 2
    assert 600 <= value(m["gpu_portal_queue_oldest_wait_seconds"]) < 660
    work = m["gpu_portal_work_info"]
    assert [(s.labels["hpc_job"], s.labels["user"], s.labels["Hostname"]) for s in work] == [
        (f"job-{running.pk}", "alice", "box1.lab")
    ]


def test_an_empty_queue_has_waited_nothing(db):
    m = scrape()
    assert value(m["gpu_portal_queue_length"]) == 0
    assert value(m["gpu_portal_queue_oldest_wait_seconds"]) == 0


def test_the_metrics_oldest_wait_of_a_requeued_job_counts_from_its_return(alice, box):
    """Ran four hours, preempted three minutes ago: the notices say it waited 3 min, /metrics 5 h."""
    job = queue_job(alice, preemptible=True)
    now = timezone.now()
    Job.objects.filter(pk=job.pk).update(
        created_at=now - timedelta(hours=5), requeued_at=now - timedelta(minutes=3), preemptions=1
    )
    assert value(scrape()["gpu_portal_queue_oldest_wait_seconds"]) < 600


def test_sessions_and_violations_by_kind(alice, box):
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    InteractiveSession.objects.create(
        owner=alice,
        reservation=booking,
        server=box[0].server,
        kind="exec",
        status="running",
        gpu_uuids=[box[0].uuid],
    )
    now = timezone.now()
    for ended in (None, now):
        Violation.objects.create(
            kind="intruder",
            gpu=box[0],
            server=box[0].server,
            pid=7,
            first_seen=now,
            last_seen=now,
            ended_at=ended,
        )
    m = scrape()
    assert value(m["gpu_portal_sessions"], kind="exec", state="running") == 1
    assert value(m["gpu_portal_sessions"], kind="jupyterlab", state="running") == 0
    assert value(m["gpu_portal_violations_open"], kind="intruder") == 1
    assert value(m["gpu_portal_violations"], "gpu_portal_violations_total", kind="intruder") == 2
    assert value(m["gpu_portal_violations_open"], kind="zombie") == 0
    assert [s.labels["kind"] for s in m["gpu_portal_work_info"]] == ["exec"]


def test_a_real_watchdog_round_and_collector_round_record_their_times(box):
    assert scrape()["gpu_portal_watchdog_round_seconds"] == []  # none yet: no series
    HostWatchdog("box1", simulated=False).round(make_snapshot("box1", gpus=4))
    client = redis_client()
    client.delete(reports_key())
    publish_snapshot(client, make_snapshot("box1", gpus=4))
    assert collect_once(client) == 1
    server = Server.objects.get(name="box1")
    assert server.watchdog_round_seconds is not None and 0 <= server.watchdog_round_seconds < 10
    assert server.telemetry_round_seconds is not None and 0 < server.telemetry_round_seconds < 10
    m = scrape()
    assert value(m["gpu_portal_watchdog_round_seconds"], server="box1") == server.watchdog_round_seconds
    assert value(m["gpu_portal_telemetry_round_seconds"], server="box1") == server.telemetry_round_seconds


def test_a_scrape_costs_the_same_queries_for_one_card_or_many(alice, box):
    reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")  # sessions, content types: warm
    with CaptureQueriesContext(connection) as few:
        scrape()
    for s in range(2, 10):
        server_report_ingest(snapshot=make_snapshot(f"box{s}", gpus=8))
        reservation_create(user=alice, count=8, server=f"box{s}", memory_mb=4096)
    with CaptureQueriesContext(connection) as many:
        m = scrape()
    assert len(m["gpu_portal_gpu_booking_bytes"]) == 1 + 8 * 8
    # 10, the settled lending totals, and the loans since (jobs/lending_report.py): one read with
    # none, four with some.
    assert len(many) == len(few) <= 12, [q["sql"] for q in many.captured_queries]


# --- the Grafana dashboard -------------------------------------------------------------------


def test_the_grafana_dashboard_names_only_metrics_that_exist(box):
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["schemaVersion"] >= 36
    assert any(i["name"] == "DS_PROMETHEUS" for i in dashboard["__inputs"])
    families = scrape()
    exposed = set(families) | {s.name for samples in families.values() for s in samples}
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    assert len(panels) >= 7
    for panel in panels:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\b(gpu_portal_[a-z_]+|DCGM_FI_[A-Z_]+)\b", target["expr"]))
            assert names, f"{panel['title']}: {target['expr']}"
            for name in names:
                assert name.startswith("DCGM_FI_") or name in exposed, f"{panel['title']} names {name}"


def test_the_settings_refuse_a_guessable_token(monkeypatch):
    monkeypatch.setenv("METRICS_TOKEN", "short")
    with pytest.raises(ImproperlyConfiguredEnv, match="METRICS_TOKEN has 5 characters: use at least 16"):
        runpy.run_path(str(SETTINGS))

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from gpus.services import server_report_ingest
from tests.factories import make_snapshot

pytestmark = pytest.mark.django_db


def _seed(servers: int, gpus: int) -> None:
    for s in range(servers):
        server_report_ingest(snapshot=make_snapshot(f"box{s:02d}", gpus=gpus, processes=2))


def test_it_sends_anonymous_users_to_login(client):
    for name in ("dashboard", "dashboard_servers", "profile"):
        response = client.get(reverse(name))
        assert response.status_code == 302
        assert response.url.startswith(reverse("login"))


def test_it_shows_every_gpu_with_its_uuid(client, alice):
    _seed(2, 4)
    client.force_login(alice)
    response = client.get(reverse("dashboard"))
    html = response.content.decode()
    assert response.status_code == 200
    assert html.count("data-gpu-uuid=") == 8
    assert 'data-gpu-uuid="GPU-box01-03"' in html
    assert "alice · pid 1000" in html
    assert 'hx-trigger="every 3s" data-poll-fallback' in html  # polls without the push


def test_it_labels_simulated_servers(client, alice):
    server_report_ingest(snapshot=make_snapshot("sim1", gpus=1, simulated=True))
    client.force_login(alice)
    assert "simulated" in client.get(reverse("dashboard_servers")).content.decode()


def test_it_shows_na_for_unsupported_metrics(client, alice):
    from dataclasses import replace

    snap = make_snapshot("box1", gpus=1)
    server_report_ingest(snapshot=replace(snap, gpus=(replace(snap.gpus[0], power_w=None),)))
    client.force_login(alice)
    html = client.get(reverse("dashboard_servers")).content.decode()
    assert '<td data-field="power">n/a</td>' in html


def test_it_renders_the_dashboard_in_a_constant_number_of_queries(client, alice):
    _seed(1, 1)
    client.force_login(alice)
    with CaptureQueriesContext(connection) as small:
        assert client.get(reverse("dashboard")).status_code == 200
    _seed(64, 8)
    with CaptureQueriesContext(connection) as large:
        response = client.get(reverse("dashboard"))
    assert response.content.decode().count("data-gpu-uuid=") == 512
    assert len(large) == len(small), [q["sql"] for q in large.captured_queries]


def test_the_dashboards_links_are_the_paths_reverse_gives():
    """url_maker (one reverse, then the value put in its place) for the dashboard's hundreds of
    links says what reverse says."""
    from gpus.selectors import URL_PK, url_maker

    for name, sample, values in (
        ("gpu_detail", "UUID", ["GPU-8f6c-00", "MIG-1"]),
        ("server_timeline", "SERVER", ["box1", "rtx-4x24_b"]),
        ("job_detail", URL_PK, [1, 812, URL_PK - 1]),
        ("session_detail", URL_PK, [3, 2024]),
    ):
        assert [url_maker(name, sample)(v) for v in values] == [reverse(name, args=[v]) for v in values]


def test_it_shows_a_gpu_page_and_its_history(client, alice):
    _seed(1, 2)
    client.force_login(alice)
    response = client.get(reverse("gpu_detail", args=["GPU-box00-01"]))
    assert response.status_code == 200
    assert "chart-4.6.1.umd.min.js" in response.content.decode()
    body = client.get(reverse("gpu_history", args=["GPU-box00-01"])).json()
    assert body["memory_total_mb"] == 24 * 1024
    assert len(body["points"]) == 1
    assert client.get(reverse("gpu_detail", args=["GPU-nope"])).status_code == 404


def test_it_logs_in_and_out(client, alice):
    response = client.post(reverse("login"), {"username": "alice", "password": "password"})
    assert response.status_code == 302
    assert client.get(reverse("dashboard")).status_code == 200
    client.post(reverse("logout"))
    assert client.get(reverse("dashboard")).status_code == 302


def test_it_refuses_a_wrong_password_with_a_message(client, alice):
    response = client.post(reverse("login"), {"username": "alice", "password": "nope"})
    assert response.status_code == 200
    assert "Please enter a correct username and password" in response.content.decode()


def test_it_serves_vendored_static_files_locally():
    html_assets = ["vendor/htmx-2.0.11.min.js", "vendor/chart-4.6.1.umd.min.js", "css/portal.css"]
    from django.contrib.staticfiles import finders

    for asset in html_assets:
        assert finders.find(asset), asset

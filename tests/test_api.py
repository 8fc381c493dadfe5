import re

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from gpus.services import server_report_ingest
from tests.factories import make_snapshot

pytestmark = pytest.mark.django_db


@pytest.fixture
def api():
    return APIClient()


def test_it_refuses_anonymous_requests(api):
    server_report_ingest(snapshot=make_snapshot("box1", gpus=1))
    for url in ("/api/v1/servers/", "/api/v1/gpus/", "/api/v1/gpus/GPU-box1-00/"):
        response = api.get(url)
        assert response.status_code in (401, 403)
        assert "uuid" not in response.content.decode()


def test_it_issues_a_token_for_username_and_password(api, alice):
    response = api.post("/api/v1/token/", {"username": "alice", "password": "password"}, format="json")
    assert response.status_code == 200
    token = response.json()["token"]
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert api.get("/api/v1/gpus/").status_code == 200
    bad = APIClient().post("/api/v1/token/", {"username": "alice", "password": "x"}, format="json")
    assert bad.status_code == 400


def test_it_lists_gpus_with_the_documented_fields(api, alice):
    server_report_ingest(snapshot=make_snapshot("box1", gpus=2, processes=1, simulated=True))
    api.force_authenticate(alice)
    gpus = api.get("/api/v1/gpus/").json()
    assert len(gpus) == 2
    gpu = gpus[0]
    for field in (
        "uuid",
        "server",
        "index",
        "name",
        "memory_total_mb",
        "memory_bookable_mb",
        "memory_used_mb",
        "utilization_pct",
        "temperature_c",
        "power_w",
        "processes",
        "simulated",
        "updated_at",
    ):
        assert field in gpu, field
    assert gpu["server"] == "box1"
    assert gpu["simulated"] is True
    assert gpu["processes"][0] == {
        "pid": 1000,
        "username": "alice",
        "command": "python train.py",
        "used_memory_mb": 500,
        "session_id": None,
        "job": "unmanaged",
        "image": None,
        "interactive_session": None,
    }
    assert api.get("/api/v1/gpus/?server=nope").json() == []


def test_it_lists_servers_with_status(api, alice):
    server_report_ingest(snapshot=make_snapshot("box1", gpus=3))
    api.force_authenticate(alice)
    (server,) = api.get("/api/v1/servers/").json()
    assert server["name"] == "box1"
    assert server["status"] == "online"
    assert server["gpu_count"] == 3
    assert server["queue"] == "host.box1"
    assert api.get("/api/v1/servers/box1/").json()["hostname"] == "box1.lab"


def test_it_lists_gpus_in_a_constant_number_of_queries(api, alice):
    server_report_ingest(snapshot=make_snapshot("box00", gpus=1))
    # A fresh user per request, as a real request has: nothing (her profile) cached on it.
    api.force_authenticate(get_user_model().objects.get(pk=alice.pk))
    with CaptureQueriesContext(connection) as small:
        api.get("/api/v1/gpus/")
    for s in range(1, 64):
        server_report_ingest(snapshot=make_snapshot(f"box{s:02d}", gpus=8, processes=2))
    api.force_authenticate(get_user_model().objects.get(pk=alice.pk))
    with CaptureQueriesContext(connection) as large:
        assert len(api.get("/api/v1/gpus/").json()) == 1 + 63 * 8
    assert len(large) == len(small)


def test_it_publishes_an_openapi_schema_and_docs(api, alice):
    api.force_authenticate(alice)
    schema = api.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    assert schema["openapi"].startswith("3.")
    assert "/api/v1/gpus/" in schema["paths"]
    docs = api.get("/api/v1/docs/")
    assert docs.status_code == 200
    # Every script and style is served here: no URL to another host (a CSRF token may hold "cdn").
    page = docs.content.decode().lower()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page) and "cdn." not in page


def test_the_gpu_list_says_who_holds_each_card_now(api, alice, box):
    from gpus.booking import reservation_create

    reservation_create(user=alice, gpus=[box[1].uuid], memory_mb=4096)
    api.force_authenticate(alice)
    rows = {g["uuid"]: g for g in api.get("/api/v1/gpus/").json()}
    (held,) = rows[box[1].uuid]["booked"]
    assert held["who"] == "you" and held["memory"] == "4 GiB"
    assert rows[box[0].uuid]["booked"] == []

"""Bad input found by fuzzing every endpoint (a hostile review, 2026-12-01): whatever curl, a
script or a browser sends gets a 4xx naming the field and the fix, nothing is written, never a 500.
One test per finding."""

from __future__ import annotations

import pytest

from gpus.models import Reservation, Violation
from jobs.models import Job, JobArray
from portal.channels import channel_create
from portal.models import NotificationChannel
from tests.factories import fresh
from tests.test_bad_input import api, py, web  # noqa: F401 - the helpers and fixture

pytestmark = pytest.mark.django_db


@pytest.fixture
def channel(alice, settings) -> NotificationChannel:
    settings.CHANNEL_ALLOWED_HOSTS = ["localhost"]
    return channel_create(by=alice, url="json://localhost/hook", label="mine")


# --- 500s -------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", ["[]", "[{}]", "null", "123", '"x"'])
def test_a_booking_body_that_is_no_json_object_is_a_400_not_a_500(alice, box, body):
    response = api(alice).post("/api/v1/reservations/", body, content_type="application/json")
    assert response.status_code == 400, (response.status_code, response.content[:200])
    assert response.json()["errors"]
    assert Reservation.objects.count() == 0


@pytest.mark.parametrize("body", ["null", "123"])
def test_a_channel_patch_body_that_is_no_json_object_is_a_400_not_a_500(alice, channel, body):
    response = api(alice).patch(
        f"/api/v1/notification-channels/{channel.pk}/", body, content_type="application/json"
    )
    assert response.status_code == 400, (response.status_code, response.content[:200])
    assert response.json()["errors"]


@pytest.mark.parametrize(
    "field, value",
    [("kind", '"\\ud800"'), ("\\ud800", "1")],
)
def test_a_lone_surrogate_in_a_session_request_is_a_400_naming_the_field(alice, booking, field, value):
    start = f'"reservation": {booking.pk}, "host": "box1", "command": ["x"], "kind": "exec"'
    body = f'{{{start}, "{field}": {value}}}'
    response = api(alice).post("/api/v1/sessions/", body, content_type="application/json")
    assert response.status_code == 400, (response.status_code, response.content[:200])
    assert list(response.json()["errors"]) == [field]  # a key named as JSON escapes it


@pytest.mark.parametrize(
    "extra", ['"args": ["\\ud800"]', '"env": {"A": "\\ud800"}', '"memory_mode": "\\ud800"']
)
def test_a_lone_surrogate_in_a_job_is_a_400_and_no_job_is_written(alice, booking, py, extra):  # noqa: F811
    """The job was written and sent, then its answer could not be rendered: a 500 that a client
    retries, running the job twice."""
    body = f'{{"reservation": {booking.pk}, "script_path": "{py}", {extra}}}'
    response = api(alice).post("/api/v1/jobs/", body, content_type="application/json")
    assert response.status_code == 400, (response.status_code, response.content[:200])
    assert extra.split('"')[1] in response.json()["errors"]
    assert Job.objects.count() == 0


@pytest.mark.parametrize("array", ["9223372036854775808", "2147483647-2147483648", "0-1%99999999999"])
def test_a_job_array_index_past_what_the_database_holds_is_a_400(alice, box, py, array):  # noqa: F811
    """SQLite overflows at 2**63; PostgreSQL's integer columns (array_index, max_running) at 2**31."""
    body = {"gpu_count": 1, "script_path": py, "time_limit_minutes": 10, "array": array}
    response = api(alice).post("/api/v1/jobs/", body, format="json")
    assert response.status_code == 400, (response.status_code, response.content[:200])
    assert "array" in response.json()["errors"]
    assert Job.objects.count() == JobArray.objects.count() == 0


@pytest.mark.parametrize("server", ["1.5", "a,b", "x y"])
def test_the_booking_form_for_a_server_name_that_cannot_be_one_is_no_500(alice, box, server):
    response = web(alice).get("/reservations/new/", {"server": server})
    assert response.status_code == 200, response.status_code


@pytest.mark.parametrize("next_url", ["abc", "0", "2026-01-01T10:00"])
def test_a_next_that_is_no_path_goes_back_to_the_default_page_not_a_500(alice, booking, next_url):
    response = web(alice).post(f"/reservations/{booking.pk}/release/", {"next": next_url})
    assert response.status_code == 302, response.status_code
    assert response["Location"] == f"/reservations/{booking.pk}/"


def test_a_calendar_renewal_with_a_next_that_is_no_path_is_no_500(alice):
    response = web(alice).post("/calendar/new-link/", {"next": "abc"})
    assert response.status_code == 302, response.status_code
    assert response["Location"] == "/profile/#calendar"


# --- values silently dropped --------------------------------------------------------------------


def test_an_unknown_open_value_for_violations_is_a_400_not_every_violation(alice, box):
    Violation.objects.create(
        kind=Violation.Kind.INTRUDER,
        gpu=box[0],
        server=box[0].server,
        pid=1,
        user=alice,
        first_seen="2026-01-01T00:00Z",
        last_seen="2026-01-01T00:00Z",
        ended_at="2026-01-01T00:00Z",
    )
    response = api(alice).get("/api/v1/violations/?open=maybe")
    assert response.status_code == 400, (response.status_code, response.content[:200])
    assert "open" in response.json()["errors"]


def test_an_unknown_unread_value_for_notifications_is_a_400(alice):
    response = api(alice).get("/api/v1/notifications/?unread=maybe")
    assert response.status_code == 400, (response.status_code, response.content[:200])
    assert "unread" in response.json()["errors"]


def test_a_booking_with_a_misspelt_field_is_refused_not_booked_without_it(alice, box):
    """{"memory": "8G"} booked a whole card: the field was dropped, not named."""
    response = api(alice).post("/api/v1/reservations/", {"count": 1, "memory": "8G"}, format="json")
    assert response.status_code == 400, (response.status_code, response.content[:200])
    assert "memory" in response.json()["errors"]
    assert Reservation.objects.count() == 0


def test_a_channel_patch_with_a_misspelt_field_is_refused_not_a_200_that_changes_nothing(alice, channel):
    response = api(alice).patch(
        f"/api/v1/notification-channels/{channel.pk}/", {"lable": "new"}, format="json"
    )
    assert response.status_code == 400, (response.status_code, response.content[:200])
    assert "lable" in response.json()["errors"]
    assert fresh(channel).label == "mine"


def test_a_session_with_a_misspelt_field_is_refused(alice, booking):
    body = {"reservation": booking.pk, "kind": "exec", "host": "box1", "command": ["x"], "imgae": "tf"}
    response = api(alice).post("/api/v1/sessions/", body, format="json")
    assert response.status_code == 400, (response.status_code, response.content[:200])
    assert "imgae" in response.json()["errors"]


def test_a_cancel_with_a_misspelt_reason_is_refused_and_cancels_nothing(alice, leader, booking):
    response = api(leader).post(f"/api/v1/reservations/{booking.pk}/cancel/", {"reasn": "x"}, format="json")
    assert response.status_code == 400, (response.status_code, response.content[:200])
    assert "reasn" in response.json()["errors"]
    assert fresh(booking).cancelled_at is None and fresh(booking).released_at is None


@pytest.mark.parametrize("body", ["[]", '["x"]', '{"reasn": "x"}'])
def test_a_booking_delete_with_a_body_that_is_no_cancel_request_is_a_400(alice, booking, body):
    """A list was a 500 (AttributeError on .get); a misspelt key released the booking all the same."""
    response = api(alice).delete(f"/api/v1/reservations/{booking.pk}/", body, content_type="application/json")
    assert response.status_code == 400, (response.status_code, response.content[:200])
    assert response.json()["errors"]
    assert fresh(booking).cancelled_at is None and fresh(booking).released_at is None

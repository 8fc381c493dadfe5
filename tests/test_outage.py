"""Nothing lost when the database or the broker goes away, and no NUL reaches PostgreSQL.

While the database or Redis is away, pages and the API answer 503 with Retry-After and say what is
down: never a 500, never a traceback, one WARNING line in the log (portal/outage.py). A NUL in the
path, a query parameter, a cookie or a header is a 400 naming it (portal/middleware.py); the body's
text fields refuse it beside the field. Run these on SQLite and on PostgreSQL (DATABASE_URL=...):
the outages are real failed connections on both, a closed port or a file that cannot be opened.
"""

from __future__ import annotations

import logging
import sqlite3
from datetime import timedelta
from pathlib import Path

import kombu.exceptions
import psycopg
import pytest
import redis
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import DatabaseError, InterfaceError, OperationalError, connection
from django.test import Client
from django.urls import include, path, reverse
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.forms import local_input
from gpus.models import Reservation
from jobs.models import Job
from jobs.paths import roots
from portal.celery import app as celery_app
from portal.env import database_url
from portal.models import ApiToken
from portal.tasks import prune_signin_failures
from portal.unreachable import DATABASE, REDIS, outage_of
from tests.conftest import free_port

# --- helpers ----------------------------------------------------------------------------------


class DatabaseDown:
    """From here until `end()`, every new connection to the default database fails as in an outage:
    refused on PostgreSQL (a closed port), a file that cannot be opened on SQLite. All threads'
    connections share this settings dict, so the live server's request threads see it too."""

    def __init__(self, folder: Path) -> None:
        if connection.vendor == "postgresql":
            self.changes = {"HOST": "127.0.0.1", "PORT": str(free_port())}
        else:
            self.changes = {"NAME": str(folder / "no-such-folder" / "portal.sqlite3")}
        self.saved = {key: connection.settings_dict[key] for key in self.changes}
        connection.close()
        connection.settings_dict.update(self.changes)
        self.ended = False

    def end(self) -> None:
        if not self.ended:
            connection.close()
            connection.settings_dict.update(self.saved)
            self.ended = True


@pytest.fixture
def database_down(transactional_db, tmp_path):
    """Call it to take the database away; it comes back at `.end()` or after the test."""
    outages: list[DatabaseDown] = []

    def down() -> DatabaseDown:
        outages.append(DatabaseDown(tmp_path))
        return outages[-1]

    yield down
    for outage in outages:
        outage.end()


@pytest.fixture
def broker_down(monkeypatch, settings) -> None:
    """Celery's broker and the wake-ups' Redis on a closed port: a real refused connection."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    settings.REDIS_URL = url
    monkeypatch.setitem(celery_app.conf, "broker_url", url)
    # Connections already made to the real broker are pooled: start from none.
    monkeypatch.setattr(celery_app, "_pool", None)
    monkeypatch.setattr(celery_app.amqp, "_producer_pool", None)


def outage_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "portal.outage"]


def assert_one_warning_and_no_traceback(caplog, response) -> None:
    assert b"Traceback" not in response.content
    assert [r.levelname for r in outage_records(caplog)] == ["WARNING"]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


class ReadsTheUser:
    """Stands for the middleware that reads the database before any view: the session, the user,
    django-axes."""

    def __init__(self, get_response) -> None:  # type: ignore[no-untyped-def]
        self.get_response = get_response

    def __call__(self, request):  # type: ignore[no-untyped-def]
        request.signed_in = request.user.is_authenticated  # loads the session and the user
        return self.get_response(request)


# Views that need Redis, for the `urls` mark: the portal's own calls to it all catch its errors
# today (wake-ups, dispatch on commit), so these stand for the next one that does not.
def _redis_ping(request):  # type: ignore[no-untyped-def]
    redis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=2).ping()


def _send_task(request):  # type: ignore[no-untyped-def]
    prune_signin_failures.delay()


urlpatterns = [
    path("test/redis-ping/", _redis_ping),
    path("test/send-task/", _send_task),
    path("", include("portal.urls")),
]
handler500 = "portal.outage.server_error"


# --- the database away ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "url", "body"),
    [
        ("get", "/api/v1/jobs/", None),
        ("get", "/api/v1/jobs/size-hint/?script=train.py", None),
        ("post", "/api/v1/reservations/", {"count": 1, "memory_mb": 1024}),
    ],
)
def test_the_api_answers_503_with_retry_after_while_the_database_is_away(
    alice, database_down, caplog, method, url, body
):
    api = APIClient()
    api.force_authenticate(alice)
    outage = database_down()

    response = getattr(api, method)(url, body, format="json")

    assert response.status_code == 503
    assert response["Retry-After"] == "10"
    assert response.json() == {
        "detail": "The portal cannot reach the database just now; try again in 10 s.",
        "code": "service_unavailable",
        "service": "database",
    }
    assert_one_warning_and_no_traceback(caplog, response)
    assert "503 for" in outage_records(caplog)[0].getMessage()
    outage.end()
    assert getattr(api, method)(url, body, format="json").status_code < 500  # and back at once


def test_a_page_answers_a_small_page_while_the_database_is_away(
    client, alice, database_down, caplog, settings
):
    settings.OUTAGE_RETRY_AFTER_SECONDS = 30
    client.force_login(alice)
    database_down()

    response = client.get(reverse("my_jobs"))

    assert response.status_code == 503 and response["Retry-After"] == "30"
    assert response["Content-Type"].startswith("text/html")
    page = response.content.decode()
    assert "cannot reach the database" in page and 'content="30"' in page  # reloads by itself
    assert_one_warning_and_no_traceback(caplog, response)
    # A form sent while it was away is not sent again by a reload: the page says to check first.
    response = client.post(reverse("token_create"), {"name": "laptop"})
    assert response.status_code == 503 and "may not have been saved" in response.content.decode()
    # Asked for JSON, the pages answer as the API does.
    response = client.get(reverse("my_jobs"), HTTP_ACCEPT="application/json")
    assert response.status_code == 503 and response.json()["service"] == "database"


def test_an_outage_inside_a_middleware_answers_503_too(alice, database_down, caplog, settings):
    """Django turns a middleware's exception into a 500 before any outer middleware sees it:
    handler500 (portal.outage.server_error) is what answers these."""
    after = settings.MIDDLEWARE.index("django.contrib.auth.middleware.AuthenticationMiddleware") + 1
    middleware = list(settings.MIDDLEWARE)
    middleware.insert(after, "tests.test_outage.ReadsTheUser")
    settings.MIDDLEWARE = middleware
    # A real server has nothing to re-raise the exception into; the test client would.
    client = Client(raise_request_exception=False)
    client.force_login(alice)
    database_down()

    page = client.get(reverse("dashboard"))
    api = client.get("/api/v1/servers/")

    assert page.status_code == 503 and "cannot reach the database" in page.content.decode()
    assert api.status_code == 503 and api.json()["service"] == "database" and api["Retry-After"] == "10"
    assert b"Traceback" not in page.content + api.content
    assert [r.levelname for r in outage_records(caplog)] == ["WARNING", "WARNING"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.django_db(transaction=True)
def test_a_connection_the_server_ends_answers_503(alice, caplog):
    """PostgreSQL ends the session under a request (a restart, an admin's pg_terminate_backend)."""
    if connection.vendor != "postgresql":
        pytest.skip("a PostgreSQL server's doing")
    api = APIClient()
    api.force_authenticate(alice)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])

    response = api.get("/api/v1/jobs/")

    connection.close()  # the test client keeps the ended one; the next request gets a new one
    assert response.status_code == 503 and response.json()["service"] == "database"
    assert_one_warning_and_no_traceback(caplog, response)
    assert api.get("/api/v1/jobs/").status_code == 200


@pytest.mark.django_db
def test_an_error_in_a_query_is_no_outage():
    """Only a service that cannot be reached is an outage: a wrong query stays a 500, which
    a client must not retry."""
    # OperationalError on SQLite, ProgrammingError on PostgreSQL.
    with pytest.raises(DatabaseError) as wrong, connection.cursor() as cursor:
        cursor.execute("SELECT * FROM no_such_table")
    assert outage_of(wrong.value) is None
    assert outage_of(ValueError("no")) is None


def _as_django(driver_error: Exception) -> OperationalError:
    """What Django raises for a driver's error (django.db.utils.DatabaseErrorWrapper)."""
    wrapped = OperationalError(str(driver_error))
    wrapped.__cause__ = driver_error
    return wrapped


@pytest.mark.parametrize(
    ("driver_error", "service"),
    [
        (psycopg.OperationalError("connection failed: Connection refused"), DATABASE),
        (psycopg.OperationalError("server closed the connection unexpectedly"), DATABASE),
        (psycopg.errors.CannotConnectNow("the database system is starting up"), DATABASE),
        (psycopg.errors.AdminShutdown("terminating connection due to administrator command"), DATABASE),
        (psycopg.errors.TooManyConnections("sorry, too many clients already"), DATABASE),
        (psycopg.errors.ConnectionFailure("connection failure"), DATABASE),
        (psycopg.errors.DeadlockDetected("deadlock detected"), None),
        # DATABASE_STATEMENT_TIMEOUT_SECONDS ran out: a frozen or overloaded server, a 503.
        (psycopg.errors.QueryCanceled("canceling statement due to statement timeout"), DATABASE),
        (sqlite3.OperationalError("no such table: nope"), None),
    ],
    ids=str,
)
def test_it_tells_an_outage_from_a_failed_query(driver_error, service):
    assert outage_of(_as_django(driver_error)) == service


def test_it_names_each_service():
    assert outage_of(InterfaceError("connection already closed")) == DATABASE
    assert outage_of(redis.exceptions.TimeoutError("Timeout reading from socket")) == REDIS
    assert outage_of(kombu.exceptions.OperationalError("Error 111 connecting")) == REDIS
    wrapped = RuntimeError("could not send")
    wrapped.__cause__ = redis.exceptions.ConnectionError("refused")
    assert outage_of(wrapped) == REDIS


# --- Redis away -------------------------------------------------------------------------------


@pytest.mark.urls("tests.test_outage")
@pytest.mark.parametrize("url", ["/test/redis-ping/", "/test/send-task/"])
@pytest.mark.django_db
def test_a_request_that_needs_redis_answers_503_while_it_is_away(client, broker_down, caplog, url):
    response = client.get(url)

    assert response.status_code == 503 and response["Retry-After"] == "10"
    assert "cannot reach Redis (the task queue)" in response.content.decode()
    assert_one_warning_and_no_traceback(caplog, response)
    response = client.get(url, HTTP_ACCEPT="application/json")
    assert response.json()["service"] == REDIS


@pytest.mark.django_db(transaction=True)
def test_a_job_is_submitted_while_redis_is_away_and_left_for_the_reconciler(alice, box, broker_down):
    """The row is the record: the dispatch after commit fails quietly, the submit does not."""
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    api = APIClient()
    api.force_authenticate(alice)

    response = api.post(
        "/api/v1/jobs/",
        {"reservation": booking.pk, "script": SimpleUploadedFile("train.py", b"print(1)\n")},
        format="multipart",
    )

    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert (job.status, job.dispatched_at) == (Job.Status.QUEUED, None)  # the reconciler sends it


# --- NUL --------------------------------------------------------------------------------------


@pytest.fixture
def api(alice) -> APIClient:
    client = APIClient(raise_request_exception=False)
    client.force_authenticate(alice)
    return client


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("url", "name"),
    [
        ("/api/v1/jobs/size-hint/?script=%00", "script"),  # was a 500 on PostgreSQL
        ("/api/v1/jobs/?mine=1&user=al%00ice", "user"),
        ("/api/v1/gpus/?a%00b=1", "a\\x00b"),
        ("/api/v1/gpus/GPU-%00/", "path"),  # a lookup by text: was a 500 on PostgreSQL
    ],
)
def test_a_nul_in_the_address_is_a_400_naming_where(api, url, name):
    response = api.get(url)

    assert response.status_code == 400
    body = response.json()
    assert body["code"] == "invalid" and list(body["errors"]) == [name]
    assert body["detail"].startswith(f"{name}: Null characters are not allowed")


@pytest.mark.django_db
def test_a_page_answers_a_nul_with_a_plain_400(client, alice):
    client.force_login(alice)
    for url in (reverse("job_size_hint") + "?script=%00", "/gpus/GPU-%00/"):
        response = client.get(url)
        assert response.status_code == 400 and response["Content-Type"].startswith("text/plain")
    assert client.get(reverse("job_size_hint") + "?script=%00").content.decode().startswith("script: Null")


@pytest.mark.django_db
def test_a_nul_in_a_header_or_a_cookie_is_a_400_naming_it(alice):
    # django-axes records a failed sign-in's User-Agent: was a 500 on PostgreSQL.
    response = APIClient(raise_request_exception=False).post(
        "/api/v1/token/",
        {"username": "alice", "password": "wrong"},
        format="json",
        HTTP_USER_AGENT="curl\x00",
    )
    assert response.status_code == 400 and list(response.json()["errors"]) == ["User-Agent"]
    # A quoted cookie may spell NUL as \000; the session is looked up by it: was a 500 on PostgreSQL.
    client = Client(raise_request_exception=False)
    client.cookies["sessionid"] = "\x00" + "a" * 31
    response = client.get(reverse("my_jobs"))
    assert response.status_code == 400 and response.content.decode().startswith("sessionid: Null")


@pytest.fixture
def script_path() -> str:
    path = roots()[0] / "train.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("print(1)\n")
    return str(path)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("args", ["--lr", "0.1\x00"]),
        ("args", "--lr 0.1\x00"),
        ("env", {"WANDB_MODE": "off\x00line"}),
        ("workdir", "/tmp/run\x00"),
        ("interpreter", "default\x00"),
        ("server", "box1\x00"),
        ("array", "0-3\x00"),
    ],
)
def test_the_job_api_refuses_a_nul_in_any_text_field_naming_it(
    api, alice, box, script_path, sent, field, value
):
    data = {"script_path": script_path, field: value}
    if field not in ("server", "array"):
        data["reservation"] = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192).pk

    response = api.post("/api/v1/jobs/", data, format="json")

    assert response.status_code == 400, response.content
    assert list(response.json()["errors"]) == [field]
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_a_nul_in_a_multipart_submit_is_refused_naming_the_field(api, alice, box, sent):
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    for field, value in (("args", "--lr 0.1\x00"), ("env", "A=b\x00"), ("workdir", "/tmp/x\x00")):
        script = SimpleUploadedFile("train.py", b"print(1)\n")
        data = {"reservation": booking.pk, "script": script, field: value}
        response = api.post("/api/v1/jobs/", data, format="multipart")
        assert response.status_code == 400 and list(response.json()["errors"]) == [field], response.content
    script = SimpleUploadedFile("train.py", b"print(1)\x00\n")
    response = api.post("/api/v1/jobs/", {"reservation": booking.pk, "script": script}, format="multipart")
    assert response.status_code == 400 and list(response.json()["errors"]) == ["script"]
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_bookings_and_tokens_refuse_a_nul_naming_the_field(api, client, alice, box, t0):
    for data, field in (
        ({"gpus": [box[0].uuid], "note": "ablation\x00"}, "note"),
        ({"gpus": [box[0].uuid + "\x00"]}, "gpus"),
        ({"count": 1, "server": "box1\x00"}, "server"),
        ({"count": 1, "team": "vision-lab\x00"}, "team"),
    ):
        response = api.post("/api/v1/reservations/", data, format="json")
        assert response.status_code == 400 and list(response.json()["errors"]) == [field], response.content
    token = {"username": "alice", "password": "password", "name": "lap\x00top"}
    response = APIClient().post("/api/v1/token/", token, format="json")
    assert response.status_code == 400 and list(response.json()["errors"]) == ["name"]
    # The pages' forms put it beside the field.
    client.force_login(alice)
    form = {"gpus": [box[0].uuid], "note": "ablation\x00", "team": "vision-lab", "memory": ""}
    form |= {"start": local_input(t0), "end": local_input(t0 + timedelta(hours=1))}
    response = client.post(reverse("reservation_new"), form)
    assert response.status_code == 200 and "note" in response.context["form"].errors
    response = client.post(reverse("token_create"), {"name": "lap\x00top"})
    assert response.status_code == 200 and "name" in response.context["token_form"].errors
    assert not Reservation.objects.exists() and not ApiToken.objects.exists()


@pytest.fixture
def upcoming(alice, box, t0) -> Reservation:
    return reservation_create(user=alice, gpus=[box[0].uuid], start=t0, end=t0 + timedelta(hours=1))


@pytest.mark.django_db
def test_the_cancel_page_refuses_a_reason_with_a_nul(alice, upcoming):
    client = Client(raise_request_exception=False)
    client.force_login(alice)
    response = client.post(reverse("reservation_cancel", args=[upcoming.pk]), {"reason": "done\x00"})
    assert response.status_code != 500
    assert "\x00" not in Reservation.objects.get().cancel_reason


@pytest.mark.django_db
def test_the_api_refuses_a_cancel_reason_with_a_nul_naming_it(api, upcoming):
    response = api.delete(f"/api/v1/reservations/{upcoming.pk}/", {"reason": "done\x00"}, format="json")
    assert response.status_code == 400 and list(response.json()["errors"]) == ["reason"]
    assert Reservation.objects.get().cancelled_at is None

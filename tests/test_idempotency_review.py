"""A hostile review of the Idempotency-Key's first version (df1963f, which held each keyed change
in one outer transaction, ahead of the other middleware): each test failed on it."""

import sqlite3
import uuid

import httpx
import pytest
from click.testing import CliRunner
from django.db import InterfaceError, connection
from django.utils import timezone

from gpu_cli import api, config
from gpu_cli.main import cli
from gpus.api import ReservationViewSet
from gpus.models import Reservation
from jobs import submit
from portal import idempotency
from portal.errors import Unavailable
from portal.models import IdempotentRequest
from portal.services import api_token_create

pytestmark = pytest.mark.django_db(transaction=True)
KEY = {"Idempotency-Key": "k-1"}


@pytest.fixture
def token(alice):
    return api_token_create(user=alice, name="t", expires_at=None)[1]


@pytest.fixture
def http(live_server, token):
    with httpx.Client(
        base_url=f"{live_server.url}/api/v1/", headers={"Authorization": f"Token {token}"}
    ) as c:
        yield c


@pytest.fixture
def gpu(live_server, token, monkeypatch, tmp_path):
    clock = [0.0]
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv(config.URL_ENV, live_server.url)
    monkeypatch.setenv(config.TOKEN_ENV, token)
    monkeypatch.setattr("gpu_cli.api.sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr("gpu_cli.api.monotonic", lambda: clock[0])
    monkeypatch.delenv(api.RETRY_ENV, raising=False)
    return lambda *args: CliRunner().invoke(cli, list(args), prog_name="gpu")


def test_slurm_is_asked_outside_any_transaction(http, booking, monkeypatch):
    real, seen = submit._asked_of_slurm, []

    def spy(*a, **kw):
        blocked = None
        if connection.vendor == "sqlite":  # could another process write meanwhile?
            raw = sqlite3.connect(connection.settings_dict["NAME"], timeout=0.5)
            try:
                raw.execute("BEGIN IMMEDIATE"), raw.execute("ROLLBACK")
                blocked = False
            except sqlite3.OperationalError:
                blocked = True
            raw.close()
        seen.append((connection.in_atomic_block, blocked))
        return real(*a, **kw)

    monkeypatch.setattr(submit, "_asked_of_slurm", spy)
    for headers in ({}, KEY):
        files = {"script": ("t.py", b"print(1)\n")}
        assert (
            http.post("jobs/", data={"reservation": booking.pk}, files=files, headers=headers).status_code
            < 500
        )
    assert seen[1] == seen[0]  # df1963f: [(False, False), (True, True)]


def test_a_503_at_the_claim_says_kept_and_gpu_retries(gpu, http, booking, monkeypatch):
    real, calls = idempotency._claim, []

    def away_once(*a, **kw):
        calls.append(1)
        if len(calls) in (1, 2):
            raise InterfaceError("connection already closed")  # the database gone at BEGIN
        return real(*a, **kw)

    monkeypatch.setattr(idempotency, "_claim", away_once)
    answer = http.post(f"reservations/{booking.pk}/release/", headers=KEY)
    assert answer.status_code == 503 and answer.headers.get("Idempotency-Keys") == "kept"  # fails here
    result = gpu("release", str(booking.pk))
    assert result.exit_code == 0, result.output  # docs/cli.md: 503 "tried again"


def test_gpu_shows_an_unavailable_503_at_once(gpu, box, monkeypatch):
    calls = []

    def unavailable(**kw):
        calls.append(kw)
        raise Unavailable("Slurm cluster c1 does not answer.", field="server")

    monkeypatch.setattr("gpus.api.reservation_create", unavailable)
    result = gpu("book", "--gpu", box[0].uuid, "--time", "1h")
    assert result.exit_code == 3 and len(calls) == 1  # df1963f: 7 tries


def test_a_replay_has_the_security_headers(http, box):
    first, again = (http.post("reservations/", json={"gpus": [box[0].uuid]}, headers=KEY) for _ in "12")
    names = ("X-Content-Type-Options", "X-Frame-Options", "Content-Security-Policy", "Referrer-Policy")
    assert [h for h in names if h in first.headers and h not in again.headers] == []


def test_made_up_credentials_write_no_rows(live_server):
    for _ in range(5):
        auth = {"Authorization": f"Token {uuid.uuid4().hex}", "Idempotency-Key": uuid.uuid4().hex}
        assert httpx.post(f"{live_server.url}/api/v1/reservations/", json={}, headers=auth).status_code == 401
    assert IdempotentRequest.objects.count() == 0  # df1963f: 5


def test_a_new_tokens_secret_is_not_kept_in_clear(live_server, alice):
    alice.set_password("pw-0123456789"), alice.save()
    answer = httpx.post(
        f"{live_server.url}/api/v1/token/",
        json={"username": "alice", "password": "pw-0123456789"},
        headers={"Authorization": "Token stale", **KEY},
    )
    secret = answer.json()["token"].encode()
    assert not any(secret in bytes(r.content) for r in IdempotentRequest.objects.all())


def test_a_csrf_refusal_is_not_replayed_once_the_token_is_sent(live_server, alice):
    alice.set_password("pw-0123456789"), alice.save()
    with httpx.Client(base_url=live_server.url) as b:
        b.get("/login/")
        login = {
            "username": "alice",
            "password": "pw-0123456789",
            "csrfmiddlewaretoken": b.cookies["csrftoken"],
        }
        b.post("/login/", data=login, headers={"Referer": f"{live_server.url}/login/"})
        body = {"gpus": ["GPU-none"]}
        assert b.post("/api/v1/reservations/", json=body, headers=KEY).status_code == 403  # no CSRF header
        fixed = {**KEY, "X-CSRFToken": b.cookies["csrftoken"], "Referer": f"{live_server.url}/"}
        assert b.post("/api/v1/reservations/", json=body, headers=fixed).status_code != 403


def test_a_new_token_takes_no_key_so_nothing_of_it_is_kept(http, alice):
    """POST token/ takes no key: its answer is a secret kept only hashed, its body a password."""
    alice.set_password("pw-0123456789")
    alice.save()
    answer = http.post("token/", json={"username": "alice", "password": "pw-0123456789"}, headers=KEY)
    assert answer.status_code in (200, 201), answer.text
    assert not IdempotentRequest.objects.exists()


# A second review, of the rework (44a0a44): each test failed on it.


def test_a_503_after_the_change_was_committed_never_has_gpu_do_it_twice(gpu, box, monkeypatch):
    """The booking is committed, then the database drops while its answer is read back (_show):
    the key is left "unknown", and gpu's try after the 503 is told so: one booking, exit 3."""
    real, calls = ReservationViewSet._show, []

    def drops_once(self, pk):  # type: ignore[no-untyped-def]
        calls.append(pk)
        if len(calls) == 1:
            raise InterfaceError("connection already closed")
        return real(self, pk)

    monkeypatch.setattr(ReservationViewSet, "_show", drops_once)
    result = gpu("book", "--gpus", "1", "--time", "1h")
    assert Reservation.objects.count() == 1, (Reservation.objects.count(), result.output)
    assert result.exit_code == 3 and "may or may not be done" in result.output, result.output


def test_gpu_told_in_progress_past_its_budget_says_maybe_done_not_refused(gpu, box, monkeypatch):
    def in_progress(request, user_id, key, fingerprint):  # type: ignore[no-untyped-def]
        row = IdempotentRequest(key=key, fingerprint=fingerprint, answer_status=0, created_at=timezone.now())
        row.running = True  # as _with_age reads it: claimed a moment ago, by a try still running
        return idempotency._replay(row, fingerprint)

    monkeypatch.setattr(idempotency, "_claim", in_progress)
    result = gpu("book", "--gpu", box[0].uuid, "--time", "1h")
    assert result.exit_code == 3 and "may or may not" in result.output, (result.exit_code, result.output)


def test_a_gpu_exec_sessions_answer_is_replayed(live_server, token, booking):
    headers = {"Authorization": f"Token {token}", "Idempotency-Key": "s-1"}
    body = {"reservation": booking.pk, "kind": "exec", "host": "box1", "command": ["true"]}
    url = f"{live_server.url}/api/v1/sessions/"
    first = httpx.post(url, json=body, headers=headers)
    assert first.status_code == 201, first.text
    again = httpx.post(url, json=body, headers=headers)
    assert again.status_code == 201 and again.json() == first.json(), again.text


def test_a_beat_never_sent_again_sends_no_key(live_server, token, booking):
    """gpu exec's beats (retry_seconds=0) are never sent again: a key would only cost a row each."""
    with api.Portal(live_server.url, token) as setup:
        body = {"reservation": booking.pk, "kind": "exec", "host": "box1", "command": ["x"]}
        sid = setup.post("sessions/", json=body)["id"]
    before = IdempotentRequest.objects.count()
    with api.Portal(live_server.url, token, retry_seconds=0) as beats:
        for _ in range(3):
            beats.post(f"sessions/{sid}/beat/")
    assert IdempotentRequest.objects.count() == before

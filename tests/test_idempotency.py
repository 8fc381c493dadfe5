"""`Idempotency-Key` (portal/idempotency.py): a change sent again after its answer was lost is done
once. Against the running portal (pytest-django's live server), with the clients that send it:
curl, httpx, and `gpu` behind a proxy that loses the first answer."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta

import httpx
import pytest
from click.testing import CliRunner
from django.utils import timezone

from gpu_cli import api, config
from gpu_cli.main import cli
from gpus import booking as booking_service
from gpus.models import Reservation
from jobs.models import Job
from portal.errors import Unavailable
from portal.idempotency import idempotency_keys_prune
from portal.models import IdempotentRequest
from portal.services import api_token_create
from portal.tasks import prune_idempotency_keys
from tests.test_outage import DatabaseDown
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def token(alice) -> str:
    return api_token_create(user=alice, name="tests", expires_at=None)[1]


@pytest.fixture
def http(live_server, token) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Token {token}", "Accept": "application/json"}
    with httpx.Client(base_url=f"{live_server.url}/api/v1/", headers=headers, timeout=30) as client:
        yield client


@pytest.fixture
def gpu_book(token, monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """book(url, card, sleep=None): `gpu book --gpu CARD --time 1h --json` signed in to `url` as
    alice, its waits between tries through `sleep` (none: at once)."""

    def book(url: str, card: str, sleep=None):  # type: ignore[no-untyped-def]
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
        monkeypatch.setenv(config.URL_ENV, url)
        monkeypatch.setenv(config.TOKEN_ENV, token)
        monkeypatch.setattr("gpu_cli.api.sleep", sleep or (lambda seconds: None))
        monkeypatch.delenv(api.RETRY_ENV, raising=False)
        return CliRunner().invoke(cli, ["book", "--gpu", card, "--time", "1h", "--json"], prog_name="gpu")

    return book


def _book(http: httpx.Client, card: str, key: str | bytes | None, **more: object) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key is not None else {}
    return http.post("reservations/", json={"gpus": [card], **more}, headers=headers)


def test_curl_sends_a_booking_twice_under_one_key_and_it_is_made_once(live_server, token, box):
    def curl() -> tuple[str, dict]:
        done = subprocess.run(
            [
                "curl", "-sS", "-D", "-", "-X", "POST",
                "-H", f"Authorization: Token {token}",
                "-H", "Content-Type: application/json",
                "-H", "Idempotency-Key: 4f0c2a8e-booking-1",
                "--data", json.dumps({"gpus": [box[0].uuid], "note": "ablation"}),
                f"{live_server.url}/api/v1/reservations/",
            ],
            capture_output=True, timeout=30, check=True, text=True,
        )  # fmt: skip
        head, _, body = done.stdout.partition("\n\n")  # text: curl's CRLFs read as newlines
        return head.lower(), json.loads(body)

    first_head, first = curl()
    again_head, again = curl()
    assert first_head.startswith("http/1.1 201") and again_head.startswith("http/1.1 201"), again_head
    assert again == first and Reservation.objects.count() == 1
    assert "idempotent-replayed: true" in again_head and "idempotent-replayed" not in first_head
    assert "idempotency-keys: kept" in first_head and "idempotency-keys: kept" in again_head


def test_without_a_key_a_change_is_done_each_time_as_before(http, box):
    assert _book(http, box[0].uuid, None).status_code == 201
    assert _book(http, box[1].uuid, None).status_code == 201
    assert Reservation.objects.count() == 2 and not IdempotentRequest.objects.exists()


def test_the_same_key_with_another_request_is_a_422_naming_the_header(http, box):
    assert _book(http, box[0].uuid, "k-1").status_code == 201
    other = _book(http, box[1].uuid, "k-1")
    assert other.status_code == 422, other.text
    message = other.json()["errors"]["Idempotency-Key"][0]
    assert "'k-1' was sent with another request (POST /api/v1/reservations/" in message
    assert "send a new key for a new change" in message
    assert Reservation.objects.count() == 1


@pytest.mark.parametrize(
    "key", ["", "a key", "k" * 256, "clé".encode()], ids=["empty", "space", "long", "non-ascii"]
)
def test_a_bad_key_is_a_400_naming_the_header_and_nothing_is_written(http, box, key):
    answer = _book(http, box[0].uuid, key)
    assert answer.status_code == 400
    assert "visible ASCII characters" in answer.json()["errors"]["Idempotency-Key"][0]
    assert not Reservation.objects.exists() and not IdempotentRequest.objects.exists()


def test_a_refusal_is_remembered_and_answered_again(http, box):
    first = _book(http, "GPU-no-such-card", "k-refused")
    again = _book(http, "GPU-no-such-card", "k-refused")
    assert first.status_code == again.status_code == 400
    assert again.json() == first.json() and again.headers["Idempotent-Replayed"] == "true"


def test_a_5xx_is_not_remembered_so_its_try_is_done_anew(http, box, monkeypatch):
    real, calls = booking_service.reservation_create, []

    def away_once(**kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs)
        if len(calls) == 1:  # what a Slurm cluster that does not answer gives: 503, nothing done
            raise Unavailable("The cluster did not answer; try again in a minute.")
        return real(**kwargs)

    monkeypatch.setattr("gpus.api.reservation_create", away_once)
    away = _book(http, box[0].uuid, "k-outage")
    assert away.status_code == 503 and away.headers["Idempotency-Keys"] == "kept"
    assert not IdempotentRequest.objects.exists()
    done = _book(http, box[0].uuid, "k-outage")
    assert done.status_code == 201 and "Idempotent-Replayed" not in done.headers
    assert Reservation.objects.count() == 1 and len(calls) == 2


def test_a_try_while_the_first_is_still_being_done_is_told_to_come_back(http, box, monkeypatch):
    """The key is claimed before the change: a second try meanwhile gets 409 with Retry-After, and
    once the first is answered, its answer."""
    real, entered, release = booking_service.reservation_create, threading.Event(), threading.Event()

    def slow(**kwargs):  # type: ignore[no-untyped-def]
        entered.set()
        release.wait(10)
        return real(**kwargs)

    monkeypatch.setattr("gpus.api.reservation_create", slow)
    answers: list[httpx.Response] = []
    first = threading.Thread(target=lambda: answers.append(_book(http, box[0].uuid, "k-race")))
    first.start()
    try:
        assert entered.wait(10)
        meanwhile = _book(http, box[0].uuid, "k-race")
    finally:
        release.set()
        first.join(20)
    assert meanwhile.status_code == 409 and meanwhile.headers["Retry-After"] == "1"
    assert meanwhile.json()["code"] == "idempotency_key_in_progress"
    later = _book(http, box[0].uuid, "k-race")
    assert answers[0].status_code == later.status_code == 201 and later.json() == answers[0].json()
    assert Reservation.objects.count() == 1


def test_a_try_whose_first_was_never_answered_is_told_the_outcome_is_unknown(http, box, settings):
    assert _book(http, box[0].uuid, "k-lost").status_code == 201
    # As if the portal had stopped between the booking's commit and keeping its answer.
    IdempotentRequest.objects.update(
        answer_status=0,
        created_at=timezone.now() - timedelta(seconds=settings.IDEMPOTENCY_IN_PROGRESS_SECONDS),
    )
    again = _book(http, box[0].uuid, "k-lost")
    assert again.status_code == 409 and again.json()["code"] == "idempotency_key_unknown"
    assert "look before doing it again" in again.json()["errors"]["Idempotency-Key"][0]
    assert Reservation.objects.count() == 1


def test_a_script_uploaded_twice_under_one_key_is_one_job(live_server, token, booking, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")

    def curl(content: str) -> tuple[int, dict]:
        script.write_text(content)
        done = subprocess.run(
            [
                "curl", "-sS", "-w", "\n%{http_code}", "-H", f"Authorization: Token {token}",
                "-H", "Idempotency-Key: job-1",
                "-F", f"reservation={booking.pk}", "-F", f"script=@{script}",
                f"{live_server.url}/api/v1/jobs/",
            ],
            capture_output=True, timeout=30, check=True, text=True,
        )  # fmt: skip
        body, _, code = done.stdout.rpartition("\n")
        return int(code), json.loads(body)

    first_code, first = curl("print('training')\n")
    again_code, again = curl("print('training')\n")
    assert (first_code, again_code) == (201, 201) and again == first
    other_code, other = curl("print('another script')\n")  # the same key, another file
    assert other_code == 422 and "Idempotency-Key" in other["errors"]
    assert Job.objects.count() == 1


def test_a_key_is_forgotten_after_idempotency_key_hours(http, box, settings):
    assert _book(http, box[0].uuid, "k-old").status_code == 201
    IdempotentRequest.objects.update(
        created_at=timezone.now() - timedelta(hours=settings.IDEMPOTENCY_KEY_HOURS, seconds=1)
    )
    # Used again after that, the key is a new change's (the card is taken now: a 409, not a replay).
    again = _book(http, box[0].uuid, "k-old")
    assert again.status_code == 409 and "Idempotent-Replayed" not in again.headers
    IdempotentRequest.objects.update(
        created_at=timezone.now() - timedelta(hours=settings.IDEMPOTENCY_KEY_HOURS, seconds=1)
    )
    assert prune_idempotency_keys() == 1 and idempotency_keys_prune() == 0


def test_two_people_may_send_the_same_key(http, live_server, bob, box):
    assert _book(http, box[0].uuid, "k-shared").status_code == 201
    bobs = api_token_create(user=bob, name="tests", expires_at=None)[1]
    answer = httpx.post(
        f"{live_server.url}/api/v1/reservations/",
        json={"gpus": [box[1].uuid]},
        headers={"Authorization": f"Token {bobs}", "Idempotency-Key": "k-shared"},
    )
    assert answer.status_code == 201 and "Idempotent-Replayed" not in answer.headers
    assert Reservation.objects.count() == 2


class LosesFirstAnswer:
    """A TCP proxy in front of the portal that passes each connection on, but closes the first
    one carrying a POST as soon as the portal has answered it, without passing the answer on:
    the change is made, its answer lost, as behind a proxy that timed out."""

    def __init__(self, upstream: str, *, at_once: bool = False) -> None:
        self.at_once = at_once  # close the client's connection as soon as the POST is passed on
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.lost: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._pass, args=(client,), daemon=True).start()

    def _pass(self, client: socket.socket) -> None:
        with client, socket.create_connection(self.upstream) as portal:
            request = _one_request(client)
            portal.sendall(request)
            first_post = request.startswith(b"POST") and not self.lost
            if first_post and self.at_once:
                self.lost.append(b"")
                client.close()  # while the portal is still doing it
            answer = _read_all(portal)
            if first_post:
                self.lost[:] = [answer]
                return  # closed without a word: the client sees the connection dropped
            client.sendall(_closing(answer))

    def close(self) -> None:
        self.listener.close()


def _one_request(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        body += sock.recv(65536)
    # One request a connection: the portal closes it after its answer.
    head = b"\r\n".join(line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:"))
    return head + b"\r\nConnection: close\r\n\r\n" + body


def _closing(answer: bytes) -> bytes:
    """The answer saying `Connection: close`: this proxy passes one request a connection, so the
    client must not send its next one on it."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n" + body


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_gpu_book_whose_answer_was_lost_sends_it_again_and_books_once(live_server, box, gpu_book):
    proxy = LosesFirstAnswer(live_server.url)
    try:
        result = gpu_book(proxy.url, box[0].uuid)
    finally:
        proxy.close()
    assert result.exit_code == 0, result.output
    assert proxy.lost and b" 201 " in proxy.lost[0].split(b"\r\n")[0]  # made, its answer lost
    assert "retrying in" in result.stderr and "may or may not" not in result.stderr
    assert json.loads(result.stdout)["id"] == Reservation.objects.get().pk  # one booking


def test_the_key_the_cli_sends_is_new_for_each_change(live_server, token, box, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv(config.URL_ENV, live_server.url)
    monkeypatch.setenv(config.TOKEN_ENV, token)
    for card in box[:2]:
        result = CliRunner().invoke(cli, ["book", "--gpu", card.uuid, "--time", "1h"], prog_name="gpu")
        assert result.exit_code == 0, result.output
    keys = list(IdempotentRequest.objects.values_list("key", flat=True))
    assert len(set(keys)) == 2 and all(uuid.UUID(k) for k in keys)


def test_gpu_book_waits_out_a_database_outage_and_books_once(live_server, box, gpu_book, tmp_path):
    """The database away when the booking comes: the portal's 503 says it keeps keys (the outage
    met while claiming the key), so `gpu` sends the booking again once it is back."""
    outage = DatabaseDown(tmp_path)
    try:
        result = gpu_book(live_server.url, box[0].uuid, sleep=lambda seconds: outage.end())
    finally:
        outage.end()
    assert result.exit_code == 0, result.output
    assert "gpu: the portal answered 503 (database unavailable); retrying in 1 s…" in result.stderr
    assert json.loads(result.stdout)["id"] == Reservation.objects.get().pk


def test_gpu_book_lost_while_the_portal_still_books_waits_for_it_and_books_once(
    live_server, box, monkeypatch, gpu_book
):
    """The connection drops while the first try is still being done: the try sent again is told
    to come back (409 in progress), and `gpu` does, and gets the first try's answer."""
    real, release = booking_service.reservation_create, threading.Event()

    def slow(**kwargs):  # type: ignore[no-untyped-def]
        release.wait(20)
        return real(**kwargs)

    waits: list[float] = []

    def sleep(seconds: float) -> None:  # gpu's waits: the first try ends during the second
        waits.append(seconds)
        if len(waits) == 1:  # the first try has claimed its key before the second comes
            wait_for(IdempotentRequest.objects.exists, timeout=20, what="the first try's claim")
        if len(waits) == 2:
            release.set()
            kept = IdempotentRequest.objects.filter(answer_status=201)
            wait_for(kept.exists, timeout=20, what="the first try's answer kept")

    monkeypatch.setattr("gpus.api.reservation_create", slow)
    proxy = LosesFirstAnswer(live_server.url, at_once=True)
    try:
        result = gpu_book(proxy.url, box[0].uuid, sleep=sleep)
    finally:
        release.set()
        proxy.close()
    assert result.exit_code == 0, result.output
    assert "gpu: the portal is still doing this request; retrying in" in result.stderr
    assert json.loads(result.stdout)["id"] == Reservation.objects.get().pk

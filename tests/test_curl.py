"""The API's documented curl commands (docs/api.md), run with curl itself against a live portal
(issue 38): what curl puts on the wire is what the portal is tested with, not the test client's
rendering of it — a form-encoded login, a JSON body, a multipart upload with its file name and
`application/octet-stream`, and a cookie sent raw (the test client quotes `Asia/Tokyo`)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from django.conf import settings
from django.test import Client

from jobs.models import Job

CURL = shutil.which("curl")
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(CURL is None, reason="no curl (apt-get install curl)"),
]


def curl(*args: str) -> tuple[int, str]:
    """(status, body) of one curl call; `-w` puts the status on a last line of its own."""
    assert CURL is not None
    done = subprocess.run(
        [CURL, "-s", "-w", "\n%{http_code}", *args], capture_output=True, text=True, timeout=30, check=True
    )
    body, _, status = done.stdout.rpartition("\n")
    return int(status), body


def test_the_documented_curl_commands_work_as_written(live_server, alice, box, sent, tmp_path: Path):
    url = live_server.url
    status, body = curl(
        "-d", "username=alice", "-d", "password=password", "-d", "name=scripts", f"{url}/api/v1/token/"
    )
    assert status == 200, body
    auth = f"Authorization: Token {json.loads(body)['token']}"

    status, body = curl("-H", auth, f"{url}/api/v1/gpus/?server=box1")
    assert status == 200 and len(json.loads(body)) == 4, body

    booking = '{"count": 1, "server": "box1", "memory_mb": 8192, "note": "fine-tune"}'
    status, body = curl(
        "-H", auth, "-H", "Content-Type: application/json", "-d", booking, f"{url}/api/v1/reservations/"
    )
    assert status == 201, body
    reservation = json.loads(body)["id"]

    (tmp_path / "train.py").write_text("print('hello')\n")
    status, body = curl(
        "-H",
        auth,
        "-F",
        f"reservation={reservation}",
        "-F",
        f"script=@{tmp_path / 'train.py'}",
        "-F",
        "args=--epochs 3",
        f"{url}/api/v1/jobs/",
    )
    assert status == 201, body
    job = Job.objects.get(pk=json.loads(body)["id"])
    assert job.args == ["--epochs", "3"] and job.reservation_id == reservation
    assert job.name == "train.py"  # the file name from curl's multipart part


@pytest.mark.parametrize("sent_as", ["America/New_York", "America%2FNew_York"])
def test_a_browser_zone_cookie_sent_raw_by_curl_is_read(live_server, alice, sent_as):
    """`curl -b` sends the cookie as typed: the raw name, and portal.js's encoded form."""
    session = Client()
    session.force_login(alice)
    cookie = f"{settings.SESSION_COOKIE_NAME}={session.cookies[settings.SESSION_COOKIE_NAME].value}"
    status, body = curl("-b", f"{cookie}; browser_tz={sent_as}", f"{live_server.url}/jobs/")
    assert status == 200 and "All times in America/New_York (your browser's)." in body

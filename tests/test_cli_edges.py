"""A hostile review of the `gpu` command line (gpu_cli/): each test shows one way a user met a
traceback, a wrong exit code or a lost answer, against a scripted stand-in for the portal (no
database) or a closed port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gpu_cli import api, config
from gpu_cli.main import cli
from tests.conftest import Clock
from tests.http_stub import serving

ROOT = Path(__file__).resolve().parents[1]
# Each answer: (status, content type, body bytes), or a callable given the handler (a stream).
Answer = tuple[int, str, bytes] | Callable[[BaseHTTPRequestHandler], None]


@pytest.fixture(autouse=True)
def _own_config(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv(config.URL_ENV, raising=False)
    monkeypatch.delenv(config.TOKEN_ENV, raising=False)
    monkeypatch.setenv(api.RETRY_ENV, "0")


def gpu(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), input=input, prog_name="gpu")


def no_traceback(result: Result) -> bool:
    return result.exception is None or isinstance(result.exception, SystemExit)


class Stand:
    """A tiny HTTP server answering each path (without its query) from `answers`, in order: the
    last answer of a path again once its others are used. Records (method, path)."""

    def __init__(self, answers: dict[str, list[Answer]]) -> None:
        self.answers, self.requests = answers, []
        stand = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?")[0]
                stand.requests.append((self.command, path))
                queue = stand.answers.get(path) or [(404, "application/json", b'{"detail": "Not found."}')]
                answer = queue.pop(0) if len(queue) > 1 else queue[0]
                if callable(answer):
                    answer(self)
                    return
                status, kind, body = answer
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_DELETE = answer

            def log_message(self, *args: object) -> None:
                pass

        self.server, self.url = serving(Handler)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand(monkeypatch) -> Iterator[Callable[[dict[str, list[Answer]]], Stand]]:
    started: list[Stand] = []

    def start(answers: dict[str, list[Answer]]) -> Stand:
        started.append(Stand(answers))
        monkeypatch.setenv(config.URL_ENV, started[-1].url)
        monkeypatch.setenv(config.TOKEN_ENV, "a-token")
        return started[-1]

    yield start
    for each in started:
        each.close()


def js(status: int, body: object) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(body).encode()


QUEUE_ROW = {
    "job": 7, "name": "träin—ß.py", "owner": "jürgen", "team": "vision", "gpu_count": 1,
    "memory_mb": None, "server": "", "time_limit_minutes": 60, "preemptible": False, "priority": 1.0,
    "factors": {}, "reason": "resources", "estimated_start": None, "estimate_basis": "",
    "submitted_at": "2026-11-30T10:00:00Z", "array_id": None, "array_index": None,
}  # fmt: skip
JOB = {
    "id": 5, "name": "train.py", "status": "cancelled", "server": "", "reason": "", "array_id": None,
    "array_index": None, "message": "",
}  # fmt: skip


# --- option values ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("book", "--time", "99999999h"),
        ("book", "--time", "9999999999999d"),
        ("book", "--start", "now+99999999h"),
        ("book", "--start", "9999-12-31 23:00", "--time", "2h"),
        ("history", "--since", "99999999d"),
        ("history", "--since", "9999999999d"),
    ],
)
def test_a_time_out_of_range_is_a_usage_error_not_a_traceback(args):
    """OverflowError from datetime/timedelta escaped the option types: a traceback and exit 1
    (the code of "the portal refused") for a mistyped number."""
    result = gpu(*args)
    assert no_traceback(result), repr(result.exception)
    assert result.exit_code == 2, result.output


# --- a terminal that cannot show every character ----------------------------------------------------


@pytest.mark.parametrize(
    ("encoding", "as_json"),
    [("ascii", False), ("latin-1", False), ("latin-1", True)],
    ids=["ascii", "latin-1", "latin-1-json"],
)
def test_names_the_terminal_cannot_encode_do_not_crash_the_output(stand, encoding, as_json):
    """A user named jürgen, a script with an em dash: on a latin-1 (or ascii) terminal `gpu queue`
    died with UnicodeEncodeError. The installed command, as a real process."""
    fake = stand(
        {"/api/v1/queue/": [js(200, {"count": 1, "next": None, "previous": None, "results": [QUEUE_ROW]})]}
    )
    env = {**os.environ, "PYTHONIOENCODING": encoding, config.URL_ENV: fake.url, config.TOKEN_ENV: "t"}
    command = [sys.executable, "-c", "from gpu_cli.main import cli; cli()", "queue", *(["--json"] * as_json)]
    done = subprocess.run(command, capture_output=True, env=env, cwd=ROOT, timeout=60)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr.decode(errors="replace")
    if as_json:  # still JSON, and the names whole: escaped where the terminal cannot show them
        assert json.loads(done.stdout.decode(encoding))[0]["owner"] == "jürgen"
    else:
        assert b"JOB" in done.stdout and b".py" in done.stdout


# --- odd answers ------------------------------------------------------------------------------------


def test_run_against_an_address_answering_html_says_so_without_a_traceback(stand, tmp_path):
    """The size hint, `gpu run`'s first request, read the answer as JSON unchecked: a login page
    of a proxy (200, HTML) gave a JSONDecodeError traceback, where every other command says
    "did not answer with the portal's JSON"."""
    stand({"/api/v1/jobs/size-hint/": [(200, "text/html", b"<html>Sign in</html>")]})
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    result = gpu("run", str(script))
    assert no_traceback(result), repr(result.exception)
    assert result.exit_code == 3 and "did not answer with the portal's JSON" in result.stderr


def test_a_tls_failure_is_not_retried_for_a_minute(stand, monkeypatch):
    """https:// to a plain HTTP port (or an untrusted certificate) cannot mend itself: it was
    retried as a refused connection, 1+2+4+8+16+29 s, before the same error."""
    fake = stand({"/api/v1/servers/": [js(200, [])]})
    monkeypatch.setenv(config.URL_ENV, fake.url.replace("http://", "https://"))
    monkeypatch.delenv(api.RETRY_ENV)
    waited: list[float] = []
    clock = Clock()
    monkeypatch.setattr("gpu_cli.api.monotonic", clock)
    monkeypatch.setattr(
        "gpu_cli.api.sleep", lambda s: (waited.append(s), setattr(clock, "now", clock.now + s))
    )
    result = gpu("status")
    assert result.exit_code == 3 and "SSL" in result.stderr
    assert waited == [], result.stderr


# --- gpu cancel -------------------------------------------------------------------------------------


def test_cancel_json_still_reports_the_jobs_it_cancelled_when_a_later_one_fails(stand):
    """Job 5 was cancelled, then the portal failed (500) on job 6: stdout was empty, so a script
    reading --json never learnt that 5 was cancelled; and job 7 was never tried."""
    fake = stand(
        {
            "/api/v1/jobs/5/cancel/": [js(200, JOB)],
            "/api/v1/jobs/6/cancel/": [(500, "text/html", b"<h1>Server Error (500)</h1>")],
            "/api/v1/jobs/7/cancel/": [js(200, {**JOB, "id": 7})],
        }
    )
    result = gpu("cancel", "--json", "5", "6", "7")
    assert result.exit_code == 3
    assert result.stdout.strip(), "nothing on stdout"
    assert [job["id"] for job in json.loads(result.stdout)] == [5, 7]
    assert ("POST", "/api/v1/jobs/7/cancel/") in fake.requests
    assert "job 6" in result.stderr


# --- the stored login -------------------------------------------------------------------------------


def test_logout_forgets_a_corrupt_login(tmp_path):
    """A config.json cut short (a full disk): `gpu logout` refused to run (exit 3, "run gpu login
    again") and left the file; logging out is how one gets rid of it."""
    path = config.config_path()
    path.parent.mkdir(parents=True)
    path.write_text('{"url": "http://x", "tok')
    result = gpu("logout")
    assert result.exit_code == 0, result.output
    assert not path.exists()


def test_login_where_the_config_file_cannot_be_written_says_so(stand):
    """config.json a folder (or the folder read-only): a traceback, after the portal had made a
    token that nothing now holds."""
    fake = stand({"/api/v1/token/": [js(201, {"token": "secret-token-value"})]})
    config.config_path().mkdir(parents=True)
    result = gpu("login", fake.url, "--username", "alice", "--password-stdin", input="pw\n")
    assert no_traceback(result), repr(result.exception)
    assert result.exit_code != 0 and str(config.config_path()) in result.stderr
    assert "secret-token-value" not in result.output


# --- gpu logs -f ------------------------------------------------------------------------------------


def _stream(before: list[str], then: Callable[[], None], after: list[str]) -> Answer:
    """An event stream: the lines `before`, then `then()`, then the lines `after`; then it closes."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        for lines in (before, after):
            handler.wfile.write("".join(f"{line}\n" for line in lines).encode())
            handler.wfile.flush()
            if lines is before:
                then()
        handler.close_connection = True

    return answer


def test_follow_survives_a_portal_restart_while_the_job_is_quiet(stand, monkeypatch):
    """A job that printed nothing for two minutes (the stream alive, keep-alives every 15 s); then
    the portal restarted, closing the stream, and came back at once. `gpu logs -f` gave up: "keeps
    breaking off: nothing new for 60 s", exit 3, though nothing had broken off for long."""
    clock = Clock()
    monkeypatch.setattr("gpu_cli.live.monotonic", clock)
    monkeypatch.setattr("gpu_cli.live.sleep", lambda seconds: None)
    monkeypatch.delenv(api.RETRY_ENV)

    def quiet_for_two_minutes() -> None:
        clock.now += 120

    stand(
        {
            "/api/v1/jobs/9/log/stream/": [
                # The clock moves before the last keep-alive is sent: it is read after it moved.
                _stream(["retry: 2000", ""], quiet_for_two_minutes, [": keep-alive", ""]),
                _stream(
                    ["data: 2026-11-25T09:29:30Z done", "id: 32", ""],
                    lambda: None,
                    ["event: end", "data: ", ""],
                ),
            ]
        }
    )
    result = gpu("logs", "-f", "9")
    assert result.exit_code == 0, result.output
    assert result.stdout == "2026-11-25T09:29:30Z done\n"


def test_a_login_file_with_a_url_that_is_no_text_is_reported_not_a_traceback():
    """config.json edited by hand ({"url": 8000}): every command died with AttributeError."""
    path = config.config_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"url": 8000, "token": "t"}))
    result = gpu("jobs")
    assert no_traceback(result), repr(result.exception)
    assert result.exit_code == 3 and str(path) in result.stderr

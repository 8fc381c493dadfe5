"""The `gpu` command line (gpu_cli/) against a live test server: real HTTP through httpx to the
portal's API on the test database. Commands run in-process through click's CliRunner, and
through the installed .venv/bin/gpu as a real process. No worker: jobs are dispatched nowhere
(`sent`), and a test plays the worker's part by writing the job's row and log itself. The tests of
retries while the portal is away talk to a scripted stand-in (FakePortal) or a closed port, on a
clock that only the waits move; GPU_RETRY_SECONDS=0 everywhere else."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner, Result
from django.db import connection
from django.utils import timezone

from gpu_cli import api, config
from gpu_cli.jobs import job_exit_code
from gpu_cli.main import cli
from gpu_cli.params import DURATION, MEMORY
from gpus.booking import reservation_create
from gpus.models import ContainerImage, Reservation, Server, Violation
from gpus.services import server_report_ingest
from gpus.simulated.inventory import server_names
from jobs.logs.store import log_append
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from portal.models import ApiToken, Notification
from portal.services import api_token_create
from tests.conftest import Clock, free_port
from tests.factories import make_snapshot
from tests.http_stub import serving
from tests.test_outage import DatabaseDown
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

GPU_BIN = Path(sys.executable).parent / "gpu"  # the venv's console script, as `pip install` made it


@pytest.fixture(autouse=True)
def _own_config(monkeypatch, tmp_path) -> None:
    """Every test has its own config folder and no login from the developer's environment."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv(config.URL_ENV, raising=False)
    monkeypatch.delenv(config.TOKEN_ENV, raising=False)
    monkeypatch.setattr("gpu_cli.jobs.POLL_SECONDS", 0.05)
    monkeypatch.setenv(api.RETRY_ENV, "0")  # no retries but in the tests of them


@pytest.fixture
def portal(live_server, alice, monkeypatch) -> str:
    """The CLI logged in as alice through the environment, against the live server."""
    monkeypatch.setenv(config.URL_ENV, live_server.url)
    monkeypatch.setenv(config.TOKEN_ENV, api_token_create(user=alice, name="tests", expires_at=None)[1])
    return live_server.url


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('training')\n")
    return path


def gpu(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), input=input, prog_name="gpu", catch_exceptions=False)


def _job(user, booking, name: str = "train.py") -> Job:
    return job_submit(user=user, reservation=booking, script=ScriptUpload(name=name, content=b"print(1)\n"))


def _finish(job_id: int, status: str, exit_code: int | None = None) -> None:
    Job.objects.filter(pk=job_id).update(status=status, exit_code=exit_code, finished_at=timezone.now())


# --- login ----------------------------------------------------------------------------------------


def test_it_logs_in_and_stores_the_token_for_its_owner_only(live_server, alice):
    result = gpu(
        "login", live_server.url + "/", "--username", "alice", "--password-stdin", input="password\n"
    )
    assert result.exit_code == 0, result.output
    path = config.config_path()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    stored = json.loads(path.read_text())
    assert stored == {"url": live_server.url, "token": stored["token"], "username": "alice"}
    # The portal keeps only the hash of the token it handed out, named after this machine.
    token = ApiToken.objects.get(user=alice)
    assert token.key_hash == ApiToken.hash_key(stored["token"]) and token.name.startswith("gpu CLI on ")
    # The stored login is used from now on,
    assert gpu("jobs").exit_code == 0
    # until `gpu logout` revokes it at the portal and forgets it.
    assert gpu("logout").exit_code == 0
    assert not path.exists()
    token.refresh_from_db()
    assert token.revoked_at is not None
    result = gpu("jobs")
    assert result.exit_code == 3 and "Not logged in" in result.stderr


def test_logout_forgets_the_login_even_where_the_portal_cannot_be_reached(live_server, alice):
    assert (
        gpu("login", live_server.url, "--username", "alice", "--password-stdin", input="password\n").exit_code
        == 0
    )
    stored = json.loads(config.config_path().read_text())
    config.config_path().write_text(json.dumps({**stored, "url": f"http://127.0.0.1:{free_port()}"}))

    result = gpu("logout")

    assert result.exit_code == 0 and "revoke it on your profile page" in result.stderr
    assert not config.config_path().exists()


def test_it_asks_for_the_password_without_echoing_it(live_server, alice):
    alice.set_password("s3cret-word")
    alice.save()
    result = gpu("login", live_server.url, input="alice\ns3cret-word\n")
    assert result.exit_code == 0, result.output
    assert "Username: alice" in result.output and "s3cret-word" not in result.output
    stored = json.loads(config.config_path().read_text())["token"]
    assert ApiToken.objects.get(user=alice).key_hash == ApiToken.hash_key(stored)


def test_a_wrong_password_exits_1_with_the_portals_message(live_server, alice):
    result = gpu("login", live_server.url, "--username", "alice", "--password-stdin", input="wrong\n")
    assert result.exit_code == 1
    assert "Unable to log in with provided credentials." in result.stderr
    assert not config.config_path().exists()


# --- cards and bookings ---------------------------------------------------------------------------


def test_status_shows_each_servers_cards_and_open_violations(portal, alice, box):
    Violation.objects.create(
        kind="intruder", gpu=box[2], server=box[2].server, pid=4242, user=alice, memory_mb=2048,
        first_seen=timezone.now(), last_seen=timezone.now(),
    )  # fmt: skip
    result = gpu("status")
    assert result.exit_code == 0, result.output
    assert "box1" in result.output and "NVIDIA Test Card" in result.output
    assert "1000 MiB / 24.0 GiB" in result.output  # card 0: memory used / total
    assert "Open violations" in result.output and "box1:2" in result.output and "4242" in result.output

    data = json.loads(gpu("status", "--json").output)
    assert [s["name"] for s in data["servers"]] == ["box1"]
    assert sorted(g["index"] for g in data["gpus"]) == [0, 1, 2, 3]
    assert [v["pid"] for v in data["violations"]] == [4242]


def test_status_of_a_server_that_does_not_exist_fails_and_names_those_that_do(portal, alice, box):
    """A typo in --server printed "No server ..." and exited 0 (and empty lists with --json)."""
    for args in (("status", "--server", "box7"), ("status", "--server", "box7", "--json")):
        result = CliRunner().invoke(cli, list(args), prog_name="gpu")
        assert result.exit_code == 4, result.output
        assert "No server 'box7'; the servers are: box1." in result.output


def test_a_cancelled_jobs_exit_code_names_its_signal_in_the_history_and_on_its_page(
    portal, alice, booking, client
):
    """A bare -15 read as a fault; docs/cli.md speaks of 143 for a cancel. The code stays Popen's."""
    job = _job(alice, booking)
    _finish(job.pk, Job.Status.CANCELLED, -15)
    assert "-15 (SIGTERM)" in gpu("history").output
    client.force_login(alice)
    assert "-15 (SIGTERM)" in client.get(f"/jobs/{job.pk}/").content.decode()
    assert "-15 (SIGTERM)" in client.get("/jobs/").content.decode()


def test_book_says_which_teams_quota_the_booking_counts_against(portal, alice, box):
    result = gpu("book", "--gpus", "1", "--time", "1h")
    assert result.exit_code == 0, result.output
    assert f"Booked reservation {Reservation.objects.get().pk} for team vision-lab." in result.output


def test_it_books_and_releases_cards(portal, alice, box):
    result = gpu(
        "book", "--gpus", "2", "--server", "box1", "--mem", "8G", "--time", "2h", "--note", "ablation"
    )
    assert result.exit_code == 0, result.output
    reservation = Reservation.objects.get()
    assert f"Booked reservation {reservation.pk}" in result.output
    assert reservation.owner == alice and reservation.note == "ablation"
    assert sorted(a.memory_mb for a in reservation.allocations.all()) == [8192, 8192]
    assert abs((reservation.end - reservation.start) - timedelta(hours=2)) < timedelta(minutes=1)

    result = gpu("release", str(reservation.pk), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["status"] == "released"


def test_a_refusal_exits_1_with_the_portals_detail_and_writes_nothing(portal, box):
    result = gpu("book", "--gpus", "1", "--start", "2020-01-01 09:00", "--end", "2020-01-01 10:00")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: The start (") and "is in the past" in result.stderr
    assert not Reservation.objects.exists()


# --- jobs -----------------------------------------------------------------------------------------


def test_run_uploads_the_script_into_a_booking(portal, alice, booking, script, sent):
    result = gpu(
        "run", str(script), "--reservation", str(booking.pk), "--env", "WANDB_MODE=offline",
        "--", "--epochs", "3", "a b", "$HOME",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    job = Job.objects.get()
    assert f"Submitted job {job.pk} (train.py): queued on box1." in result.output
    assert job.owner == alice and job.reservation == booking and job.status == Job.Status.QUEUED
    assert job.script_source == "print('training')\n"
    assert job.args == ["--epochs", "3", "a b", "$HOME"]  # quoted past the portal's shell-like split
    assert job.env == {"WANDB_MODE": "offline"}
    assert sent == [(job.pk, "host.box1")]


def test_run_notify_says_what_its_owner_is_told_and_a_bad_value_is_named(
    portal, alice, booking, script, sent
):
    result = gpu("run", str(script), "--reservation", str(booking.pk), "--notify", "end,fail,start")
    assert result.exit_code == 0, result.output
    assert Job.objects.get().notify == ["start", "end", "fail"]
    refused = gpu("run", str(script), "--reservation", str(booking.pk), "--notify", "sometimes")
    assert refused.exit_code != 0 and "notify" in refused.output and "start, end, fail" in refused.output
    assert Job.objects.count() == 1  # nothing written


def test_run_prints_the_size_hint_of_the_scripts_recent_runs(portal, alice, booking, box, script, sent):
    for _ in range(3):  # three finished runs of train.py on alice's 8 GiB booking, peaking at 2 GiB
        job = _job(alice, booking)
        _finish(job.pk, "succeeded", 0)
        Job.objects.filter(pk=job.pk).update(peak_memory_mb=2048)
    hint = (
        "Hint: Your last 3 runs of train.py peaked at 2 GiB of 8 GiB booked per card; 3 GiB would do. "
        "Use --mem 3G."
    )
    result = gpu("run", str(script), "--gpus", "1", "--time", "10m")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == hint  # before the job is submitted
    assert "Submitted job" in result.stdout
    for quiet in (["--no-hint"], ["--mem", "3G"]):  # asked not to, or already asking that size
        result = gpu("run", str(script), "--gpus", "1", "--time", "10m", *quiet)
        assert result.exit_code == 0 and "Hint" not in result.output
    result = gpu("run", str(script), "--gpus", "1", "--time", "10m", "--json")
    assert result.exit_code == 0 and "Hint" not in result.output
    assert json.loads(result.stdout)["name"] == "train.py"


def test_run_without_a_booking_queues_the_job_pending(portal, alice, box, script, sent):
    result = gpu(
        "run", str(script), "--gpus", "2", "--mem", "8G", "--time", "30m", "--server", "box1", "--nice", "5",
        "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    submitted = json.loads(result.output)
    job = Job.objects.get(pk=submitted["id"])
    assert submitted["status"] == "pending" and job.queued
    assert (job.gpu_count, job.memory_mb, job.time_limit_minutes, job.nice) == (2, 8192, 30, 5)
    assert job.request_server.name == "box1"

    queue = json.loads(gpu("queue", "--json").output)
    listed = [(e["job"], e["gpu_count"], e["memory_mb"], e["preemptible"]) for e in queue]
    assert listed == [(job.pk, 2, 8192, False)]
    result = gpu("queue")
    assert result.exit_code == 0 and "train.py" in result.output and "you" in result.output


def test_run_preemptible_queues_a_job_that_may_be_preempted(portal, alice, box, booking, script, sent):
    result = gpu("run", str(script), "--gpus", "1", "--time", "10m", "--preemptible", "--json")
    assert result.exit_code == 0, result.output
    submitted = json.loads(result.output)
    assert submitted["preemptible"] is True and Job.objects.get(pk=submitted["id"]).preemptible
    queue = json.loads(gpu("queue", "--json").output)
    assert [(e["job"], e["preemptible"]) for e in queue] == [(submitted["id"], True)]
    assert "1 (preemptible)" in gpu("queue").output
    result = gpu("run", str(script), "--reservation", str(booking.pk), "--preemptible")
    assert result.exit_code != 0 and "drop --preemptible" in result.output  # a booking's cards are its own


def test_an_array_is_listed_and_cancelled_whole(portal, alice, box, booking, script, sent):
    other = _job(alice, booking)
    result = gpu("run", str(script), "--gpus", "1", "--time", "10m", "--array", "0-3%2")
    assert result.exit_code == 0, result.output
    array_id = Job.objects.exclude(pk=other.pk).values_list("array_id", flat=True).first()
    assert f"Submitted array {array_id} (train.py)" in result.output
    tasks = json.loads(gpu("history", "--array", str(array_id), "--json").output)
    assert sorted(t["array_index"] for t in tasks) == [0, 1, 2, 3]

    result = gpu("cancel", "--whole-array", str(tasks[0]["id"]))
    assert result.exit_code == 0, result.output
    assert set(Job.objects.filter(array_id=array_id).values_list("status", flat=True)) == {"cancelled"}
    assert Job.objects.get(pk=other.pk).status == Job.Status.QUEUED


def test_jobs_lists_active_jobs_and_history_all(portal, alice, bob, box, booking, sent):
    done = _job(alice, booking, "old.py")
    _finish(done.pk, Job.Status.SUCCEEDED, 0)
    active = _job(alice, booking, "new.py")
    theirs = _job(bob, reservation_create(user=bob, gpus=[box[1].uuid]), "bobs.py")

    assert [j["id"] for j in json.loads(gpu("jobs", "--json").output)] == [active.pk]
    result = gpu("jobs")
    assert "new.py" in result.output and "old.py" not in result.output and "bobs.py" not in result.output

    history = json.loads(gpu("history", "--json").output)
    assert [j["id"] for j in history] == [active.pk, done.pk]  # alice's, newest first
    succeeded = json.loads(gpu("history", "--status", "succeeded", "--since", "today", "--json").output)
    assert [j["id"] for j in succeeded] == [done.pk]
    assert theirs.pk not in [j["id"] for j in json.loads(gpu("history", "--all", "--json").output)]
    result = gpu("history", "--limit", "1")
    assert "new.py" in result.output and "1 of 2 jobs; --limit N shows more." in result.output
    result = gpu("history", "--status", "nonsense")
    assert result.exit_code == 1 and "status" in result.stderr


def test_run_image_sends_it_and_jobs_and_images_show_it(portal, alice, booking, script, sent):
    server = Server.objects.get(name="box1")
    Server.objects.filter(pk=server.pk).update(containers_ok=True, containers_detail="podman 4.3.1 (runc)")
    image = ContainerImage.objects.create(name="tf-2.17", reference="registry.lab.example/tf:2.17")
    image.servers.set([server])

    result = gpu("run", str(script), "--reservation", str(booking.pk), "--image", "tf-2.17")
    assert result.exit_code == 0, result.output
    job = Job.objects.get()
    assert job.image == image
    listed = gpu("jobs")
    assert listed.exit_code == 0 and "IMAGE" in listed.output and "tf-2.17" in listed.output
    assert json.loads(gpu("jobs", "--json").output)[0]["image"] == "tf-2.17"

    result = gpu("run", str(script), "--gpus", "1", "--time", "10m", "--image", "nope")
    assert (
        result.exit_code == 1
        and "There is no image 'nope'; choose one of tf-2.17 (on box1)." in result.stderr
    )
    assert Job.objects.count() == 1

    listed = gpu("images")
    assert listed.exit_code == 0 and re.search(r"tf-2\.17\s+box1\s+no\s+no", listed.output), (
        listed.output
    )  # no JupyterLab
    assert [i["name"] for i in json.loads(gpu("images", "--server", "box1", "--json").output)] == ["tf-2.17"]


def test_logs_prints_the_log(portal, alice, booking, sent):
    job = _job(alice, booking)
    log_append(job.pk, "epoch 1 loss 0.50")
    log_append(job.pk, "epoch 2 loss 0.25")
    result = gpu("logs", str(job.pk))
    assert result.exit_code == 0, result.output
    assert result.output.count("\n") == 2 and result.output.index("epoch 1") < result.output.index("epoch 2")


def _play_worker(job_id_of, lines: list[str], status: str, exit_code: int | None) -> threading.Thread:
    """In a thread, as the job's worker would: write its log, then record its end."""

    def work() -> None:
        try:
            job_id = wait_for(job_id_of, timeout=10, what="the job")
            for line in lines:
                log_append(job_id, line)
            _finish(job_id, status, exit_code)
        finally:
            connection.close()

    thread = threading.Thread(target=work)
    thread.start()
    return thread


def test_logs_follow_goes_on_until_the_job_ends(portal, alice, booking, sent):
    job = _job(alice, booking)
    log_append(job.pk, "starting")
    worker = _play_worker(lambda: job.pk, ["epoch 1", "done"], Job.Status.SUCCEEDED, 0)
    result = gpu("logs", "-f", str(job.pk))
    worker.join()
    assert result.exit_code == 0, result.output
    assert [line.split(" ", 1)[1] for line in result.output.splitlines()] == ["starting", "epoch 1", "done"]


def test_run_wait_follows_the_log_and_exits_with_the_jobs_exit_code(portal, alice, booking, script, sent):
    worker = _play_worker(lambda: Job.objects.values_list("pk", flat=True).first(), ["boom"], "failed", 7)
    result = gpu("run", str(script), "--reservation", str(booking.pk), "--wait")
    worker.join()
    assert result.exit_code == 7
    assert result.stdout.endswith(" boom\n")  # stdout is the log alone
    assert "Submitted job" in result.stderr and "failed" in result.stderr


@pytest.mark.parametrize(
    ("status", "exit_code", "expected"),
    [
        ("succeeded", 0, 0),
        ("failed", 7, 7),
        ("failed", -9, 137),  # killed by SIGKILL, as a shell says it
        ("failed", None, 1),  # it could not start
        ("timed_out", -15, 124),
        ("cancelled", -15, 143),
        ("lost", None, 125),
    ],
)
def test_run_wait_exit_codes(status, exit_code, expected):
    assert job_exit_code({"status": status, "exit_code": exit_code}) == expected


def test_cancel_cancels_each_job_and_reports_the_ones_it_cannot(portal, alice, booking, sent):
    job = _job(alice, booking)
    result = gpu("cancel", str(job.pk), "999999")
    assert result.exit_code == 4
    assert f"Job {job.pk} is cancelled." in result.stdout
    assert "job 999999: Not found." in result.stderr
    assert Job.objects.get(pk=job.pk).status == Job.Status.CANCELLED
    result = gpu("cancel", str(job.pk))
    assert result.exit_code == 1 and "already cancelled" in result.stderr


def test_cancel_of_someone_elses_job_takes_a_reason_and_the_owner_reads_it(
    portal, alice, leader, booking, sent, monkeypatch
):
    job = _job(alice, booking)
    monkeypatch.setenv(config.TOKEN_ENV, api_token_create(user=leader, name="tests", expires_at=None)[1])
    refused = gpu("cancel", str(job.pk))
    assert refused.exit_code == 1 and "Give a reason: alice will see it." in refused.stderr
    assert Job.objects.get(pk=job.pk).status == Job.Status.QUEUED  # nothing stopped
    result = gpu("cancel", "--reason", "blocking the demo", str(job.pk))
    assert result.exit_code == 0 and f"Job {job.pk} is cancelled." in result.stdout
    job.refresh_from_db()
    assert job.message == "Cancelled by leader before it started: blocking the demo."
    assert "Why: blocking the demo" in Notification.objects.get(user=alice).body


# --- usage, reachability --------------------------------------------------------------------------


def test_usage_errors_exit_2_before_any_request(script):
    assert gpu("book", "--mem", "16").exit_code == 2  # no unit
    assert gpu("book", "--time", "soon").exit_code == 2
    result = gpu("run", str(script), "--reservation", "3", "--mem", "16G")  # --gpus: a Slurm booking's
    assert result.exit_code == 2 and "drop --mem" in result.stderr


def test_it_exits_3_when_the_portal_cannot_be_reached_or_refuses_the_token(portal, monkeypatch):
    monkeypatch.setenv(config.TOKEN_ENV, "not-a-token")
    result = gpu("jobs")
    assert result.exit_code == 3 and "refused the token" in result.stderr
    monkeypatch.setenv(config.URL_ENV, f"http://127.0.0.1:{free_port()}")
    result = gpu("status")
    assert result.exit_code == 3 and "Cannot reach the portal" in result.stderr


def test_it_reads_sizes_and_durations_as_people_write_them():
    assert [MEMORY.convert(v, None, None) for v in ("16G", "16 GiB", "1.5GB", "512M")] == [
        16384,
        16384,
        1536,
        512,
    ]
    assert [DURATION.convert(v, None, None) for v in ("10m", "2h", "1h30m", "1d", "45")] == [
        10,
        120,
        90,
        1440,
        45,
    ]


# --- while the portal is away ---------------------------------------------------------------------

PORTAL_503 = {
    "detail": "The portal cannot reach the database just now; try again in 10 s.",
    "code": "service_unavailable",
    "service": "database",
}
EMPTY_PAGE = {"count": 0, "next": None, "previous": None, "results": []}


class FakePortal:
    """A tiny HTTP server on 127.0.0.1 answering each request with the next of `answers` (the last
    one again once they run out): (status, JSON body), "drop" (close the connection without an
    answer) or "hang" (no answer until the test ends). It records (method, path) of each request."""

    def __init__(self, answers: list, port: int = 0) -> None:
        self.answers, self.requests, self.released = list(answers), [], threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fake.requests.append((self.command, self.path.split("?")[0]))
                answer = fake.answers.pop(0) if len(fake.answers) > 1 else fake.answers[0]
                if answer == "hang":
                    fake.released.wait(30)
                if answer in ("hang", "drop"):
                    self.close_connection = True
                    return
                status, body = answer
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status == 503:
                    self.send_header("Retry-After", "10")
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = answer

            def log_message(self, *args: object) -> None:
                pass

        self.server, self.url = serving(Handler, port)

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_portal(monkeypatch) -> Iterator[Callable[..., FakePortal]]:
    """`fake_portal(answers)`: a FakePortal the CLI is logged in to."""
    started: list[FakePortal] = []

    def start(answers: list, port: int = 0) -> FakePortal:
        started.append(FakePortal(answers, port))
        monkeypatch.setenv(config.URL_ENV, started[-1].url)
        monkeypatch.setenv(config.TOKEN_ENV, "a-token")
        return started[-1]

    yield start
    for fake in started:
        fake.close()


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """The CLI's waits between tries, taken at once on a clock that only they move; a minute's
    budget (GPU_RETRY_SECONDS' default)."""
    clock, waited = Clock(), []

    def sleep(seconds: float) -> None:
        waited.append(seconds)
        clock.now += seconds

    monkeypatch.setattr("gpu_cli.api.monotonic", clock)
    monkeypatch.setattr("gpu_cli.api.sleep", sleep)
    monkeypatch.delenv(api.RETRY_ENV)
    return waited


def retries(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if "retrying in" in line]


def test_it_asks_again_while_the_portal_answers_503(fake_portal, waits):
    fake = fake_portal([(503, PORTAL_503), "drop", (200, EMPTY_PAGE)])

    result = gpu("queue", "--json")

    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == []
    assert fake.requests == [("GET", "/api/v1/queue/")] * 3
    assert waits == [1, 2]
    assert retries(result)[0] == "gpu: the portal answered 503 (database unavailable); retrying in 1 s…"
    assert retries(result)[1].startswith(f"gpu: cannot reach the portal at {fake.url} (")
    assert retries(result)[1].endswith("); retrying in 2 s…")


def test_a_list_that_shrinks_while_it_is_paged_gives_what_was_read(fake_portal, waits):
    """Jobs left the queue between two pages: the portal says the next page is gone (400, naming
    `page`); the rows read stand."""
    row = {
        "job": 7, "name": "train.py", "owner": "alice", "team": "vision", "gpu_count": 1, "memory_mb": None,
        "server": "", "time_limit_minutes": 60, "preemptible": False, "priority": 1.0, "factors": {},
        "reason": "resources", "estimated_start": None, "estimate_basis": "",
        "submitted_at": "2026-11-30T10:00:00Z", "array_id": None, "array_index": None,
    }  # fmt: skip
    gone = {
        "detail": "Invalid input.",
        "errors": {"page": ["There is no page '2'; give a whole number from 1 to 1."]},
    }
    fake = fake_portal(
        [(200, {"count": 2, "next": "x?page=2", "previous": None, "results": [row]}), (400, gone)]
    )
    result = gpu("queue", "--json", "--limit", "1000")
    assert result.exit_code == 0, result.output
    assert [e["job"] for e in json.loads(result.stdout)] == [7]
    assert fake.requests == [("GET", "/api/v1/queue/")] * 2


def test_it_keeps_trying_for_at_most_a_minute(fake_portal, waits):
    fake = fake_portal([(503, PORTAL_503)])

    result = gpu("queue")

    assert result.exit_code == 3
    assert waits == [1, 2, 4, 8, 16, 29] and sum(waits) == 60
    assert len(retries(result)) == 6 and len(fake.requests) == 7
    assert "The portal is unavailable (GET /api/v1/queue/: database unavailable)." in result.stderr


def test_it_keeps_trying_a_refused_connection_for_at_most_a_minute(monkeypatch, waits):
    monkeypatch.setenv(config.URL_ENV, f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv(config.TOKEN_ENV, "a-token")

    result = gpu("status")

    assert result.exit_code == 3 and "Cannot reach the portal" in result.stderr
    assert waits == [1, 2, 4, 8, 16, 29]
    assert all("Connection refused" in line for line in retries(result)), result.stderr


def test_it_sends_a_post_again_only_when_its_connection_was_refused(fake_portal, monkeypatch):
    """Refused: nothing was sent, so nothing can happen twice. The portal comes up during the wait."""
    port = free_port()
    monkeypatch.setenv(config.URL_ENV, f"http://127.0.0.1:{port}")
    monkeypatch.setenv(config.TOKEN_ENV, "a-token")
    monkeypatch.delenv(api.RETRY_ENV)
    started: list[FakePortal] = []
    monkeypatch.setattr(
        "gpu_cli.api.sleep", lambda seconds: started.append(fake_portal([(200, {"id": 7})], port=port))
    )

    result = gpu("release", "7", "--json")

    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"id": 7}
    assert started[0].requests == [("POST", "/api/v1/reservations/7/release/")]
    assert len(retries(result)) == 1


@pytest.mark.parametrize("answer", [(503, PORTAL_503), "drop", "hang"], ids=["503", "dropped", "timed out"])
def test_it_never_sends_a_post_again_that_may_have_been_done(fake_portal, waits, monkeypatch, answer):
    """To a portal that does not keep Idempotency-Keys (an older one: its answers do not say
    `Idempotency-Keys: kept`; asked once where the answer was lost). tests/test_idempotency.py has
    the portal that does."""
    monkeypatch.setattr("gpu_cli.api.TIMEOUT", httpx.Timeout(1.0))
    fake = fake_portal([answer, (404, {"detail": "Not found."})])

    result = gpu("release", "7")

    assert result.exit_code == 3
    asked = [("GET", "/api/v1/")] if answer == "drop" else []
    assert fake.requests == [("POST", "/api/v1/reservations/7/release/"), *asked]
    assert waits == [] and retries(result) == []
    assert "It may or may not be done: check before you try again." in result.stderr


def test_it_waits_out_a_database_outage_of_the_portal(portal, alice, tmp_path, waits, monkeypatch):
    """The real portal: 503 while its database is away (portal/outage.py), then the answer."""
    outage = DatabaseDown(tmp_path)
    try:
        monkeypatch.setattr("gpu_cli.api.sleep", lambda seconds: outage.end())
        result = gpu("queue", "--json")
    finally:
        outage.end()

    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == []
    assert retries(result) == ["gpu: the portal answered 503 (database unavailable); retrying in 1 s…"]


def test_gpu_retry_seconds_must_be_a_number_of_seconds(portal, monkeypatch):
    monkeypatch.setenv(api.RETRY_ENV, "a minute")
    result = gpu("queue")
    assert result.exit_code == 2 and "GPU_RETRY_SECONDS='a minute'" in result.stderr


# --- the installed command ------------------------------------------------------------------------


def test_the_installed_gpu_command_talks_to_the_portal(portal, alice, booking, sent):
    job = _job(alice, booking)
    done = subprocess.run([GPU_BIN, "jobs", "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [j["id"] for j in json.loads(done.stdout)] == [job.pk]

    env = {**os.environ, config.URL_ENV: f"http://127.0.0.1:{free_port()}"}
    done = subprocess.run([GPU_BIN, "status"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 3 and "Cannot reach the portal" in done.stderr
    # GPU_RETRY_SECONDS bounds how long it keeps trying: a second, so one wait of a second.
    env[api.RETRY_ENV] = "1"
    done = subprocess.run([GPU_BIN, "status"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 3 and "Cannot reach the portal" in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "retrying in" in line]
    assert line.startswith(f"gpu: cannot reach the portal at {env[config.URL_ENV]} (")
    assert line.endswith("Connection refused); retrying in 1 s…")


def test_the_command_line_imports_nothing_of_the_portal():
    """On a laptop only gpu_cli and its dependencies are installed."""
    code = "import json, sys, gpu_cli.main; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(done.stdout))
    assert not loaded & {"django", "rest_framework", "portal", "gpus", "jobs", "celery"}


@pytest.mark.worker
def test_run_wait_runs_the_script_on_a_real_worker(portal, alice, start_worker, tmp_path):
    host = server_names()[0]
    server_report_ingest(snapshot=make_snapshot(host, gpus=4, simulated=True))
    start_worker(host)
    booking = reservation_create(user=alice, gpus=[f"GPU-{host}-00"])
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('hello from', sys.argv[1:], flush=True)\nsys.exit(3)\n")
    result = gpu("run", str(script), "--reservation", str(booking.pk), "--wait", "--", "--epochs", "2")
    assert result.exit_code == 3, result.output
    assert "hello from ['--epochs', '2']" in result.stdout
    assert f"Job {Job.objects.get().pk} failed: Exited with code 3." in result.stderr

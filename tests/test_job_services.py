"""Job services and the API without a worker: every rule, every refusal writes nothing."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from itertools import pairwise

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db.models.functions import Now
from rest_framework.test import APIClient

from gpus.booking import reservation_cancel, reservation_create
from gpus.inventory import ProcessInfo
from gpus.models import GPUProcess, Reservation
from gpus.services import server_report_ingest
from jobs.logs.store import LogWriter, log_append, log_end, log_stream
from jobs.models import Job, LogChunk
from jobs.services import job_cancel, jobs_reconcile
from jobs.submit import (
    ScriptUpload,
    _check_memory_mode,
    _check_script,
    _check_threads,
    _check_time_limit,
    job_submit,
    parse_args,
)
from portal.errors import Conflict, Forbidden, Invalid
from tests.factories import make_snapshot

SCRIPT = b"print('hello')\n"


@pytest.fixture
def api(alice) -> APIClient:
    client = APIClient()
    client.force_authenticate(alice)
    return client


def _submit(user, booking, **kwargs) -> Job:
    kwargs.setdefault("script", ScriptUpload(name="train.py", content=SCRIPT))
    return job_submit(user=user, reservation=booking, **kwargs)


def test_it_queues_a_job_and_dispatches_it_after_commit(
    alice, booking, sent, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        job = _submit(alice, booking, args="--epochs 3 'a b'")
    assert job.status == Job.Status.QUEUED
    assert job.gpu_uuids == ["GPU-box1-00"] and job.server.name == "box1"
    assert job.args == ["--epochs", "3", "a b"]
    assert job.memory_mode == Job.MemoryMode.LIMIT  # shared booking default
    assert job.intra_op_threads == 2  # 32 CPUs × (8 GB of 23.2 bookable) / 4 cards
    assert sent == [(job.pk, "host.box1")]


def test_it_holds_a_job_for_an_upcoming_booking_until_it_starts(alice, box, sent, t0):
    upcoming = reservation_create(user=alice, gpus=[box[1].uuid], start=t0, end=t0 + timedelta(hours=2))
    job = _submit(alice, upcoming)
    assert job.dispatched_at is None and job.not_before == t0
    assert jobs_reconcile(now=t0 - timedelta(seconds=1))["dispatched"] == 0
    assert jobs_reconcile(now=t0)["dispatched"] == 1
    assert jobs_reconcile(now=t0)["dispatched"] == 0  # dispatched once
    assert job.memory_mode == Job.MemoryMode.ALL  # whole-card default


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({"script_path": "../../etc/passwd.py", "script": None}, "script_path", "'..'"),
        ({"script_path": "/etc/passwd.py", "script": None}, "script_path", "outside the job folders"),
        ({"script": ScriptUpload(name="x.sh", content=b"ls")}, "script", ".py"),
        ({"args": "data.csv | grep x"}, "args", "shell"),
        ({"args": "a; rm -rf /"}, "args", "shell"),
        ({"args": "$HOME/x"}, "args", "shell"),
        ({"args": "'unclosed"}, "args", "quote"),
        ({"env": "CUDA_VISIBLE_DEVICES=0"}, "env", "set by the portal"),
        ({"env": {"PORTAL_JOB_ID": "1"}}, "env", "set by the portal"),
        ({"env": {"1BAD": "x"}}, "env", "not a variable name"),
        ({"interpreter": "conda-nope"}, "interpreter", "default"),
        ({"time_limit_minutes": 100_000}, "time_limit_minutes", "at most"),
        ({"memory_mode": "all"}, "memory_mode", "whole-card"),
        ({"mirrored": True}, "mirrored", "two or more"),
        ({"intra_op_threads": 0}, "intra_op_threads", "between 1"),
        ({"workdir": "/tmp/../etc"}, "workdir", "'..'"),
    ],
)
def test_it_refuses_bad_input_naming_the_field_and_writes_nothing(alice, booking, sent, kwargs, field, words):
    with pytest.raises(Invalid) as error:
        _submit(alice, booking, **kwargs)
    assert error.value.field == field
    assert words in error.value.message
    assert not Job.objects.exists() and not sent


def test_it_keeps_quoted_shell_characters_as_literal_arguments():
    assert parse_args("--sep '|' --pattern \"a;b\"") == ["--sep", "|", "--pattern", "a;b"]
    assert parse_args(["a | b", "$X"]) == ["a | b", "$X"]  # a list is never parsed


# --- job_submit's steps, alone (no database) ----------------------------------------------


def test_it_takes_an_uploads_own_name_or_a_paths_and_wants_exactly_one():
    upload = ScriptUpload(name="runs/2024/train.py", content=SCRIPT)
    assert _check_script(upload, "") == ("train.py", "", "print('hello')\n")
    for script, path, words in (
        (None, "", "Upload a .py script, or"),
        (None, "   ", "Upload a .py script, or"),
        (upload, "train.py", "not both"),
    ):
        with pytest.raises(Invalid, match=words) as error:
            _check_script(script, path)
        assert error.value.field == "script"


def test_it_measures_the_time_limit_from_when_the_job_can_start(t0):
    upcoming = Reservation(start=t0 + timedelta(hours=1), end=t0 + timedelta(hours=3))
    _check_time_limit(None, upcoming, t0)  # until the booking ends
    _check_time_limit(120, upcoming, t0)
    with pytest.raises(Invalid, match="at most 120 minutes") as error:
        _check_time_limit(121, upcoming, t0)  # not 180: the job waits for the booking
    assert error.value.field == "time_limit_minutes"
    _check_time_limit(30, upcoming, t0 + timedelta(hours=2, minutes=30))  # active: from now
    with pytest.raises(Invalid, match="at least 1 minute"):
        _check_time_limit(0, upcoming, t0)


def test_it_defaults_the_memory_mode_by_booking_and_keeps_room_for_the_cuda_context(settings):
    settings.GPU_CONTEXT_HEADROOM_MB = 512
    assert _check_memory_mode(None, None) == Job.MemoryMode.ALL  # whole cards
    assert _check_memory_mode(None, 8192) == Job.MemoryMode.LIMIT  # a share of a card
    assert _check_memory_mode(Job.MemoryMode.GROW, 512) == Job.MemoryMode.GROW
    for mode in (Job.MemoryMode.LIMIT, Job.MemoryMode.LIMIT_GROW):
        with pytest.raises(Invalid, match="512 MiB CUDA context headroom"):
            _check_memory_mode(mode, 512)
    with pytest.raises(Invalid, match="must be one of") as error:
        _check_memory_mode("most", None)
    assert error.value.field == "memory_mode"


def test_it_defaults_threads_to_the_bookings_cpu_share_and_names_the_bad_field():
    assert _check_threads(None, None, 8) == (8, 2)
    assert _check_threads(None, None, 2) == (2, 1)
    assert _check_threads(3, None, 8) == (3, 2)
    assert _check_threads(None, 5, 8) == (8, 5)
    with pytest.raises(Invalid, match="between 1 and 256") as error:
        _check_threads(4, 257, 8)
    assert error.value.field == "inter_op_threads"


def test_it_refuses_a_huge_upload(alice, booking, settings):
    settings.JOB_UPLOAD_MAX_KB = 1
    with pytest.raises(Invalid, match="limit is 1 KB"):
        _submit(alice, booking, script=ScriptUpload(name="big.py", content=b"#" * 2000))


def test_it_refuses_a_script_link_that_leads_out_of_the_roots(alice, booking, settings, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret.py").write_text("print(1)")
    (root / "link.py").symlink_to(tmp_path / "secret.py")
    settings.JOB_ROOTS = [root]
    with pytest.raises(Invalid, match="leads out of the job folders"):
        _submit(alice, booking, script=None, script_path=str(root / "link.py"))
    (root / "ok.py").write_text("print(1)")
    assert _submit(alice, booking, script=None, script_path="ok.py").script_path == str(root / "ok.py")


def test_it_runs_one_job_at_a_time_per_booking(alice, booking, sent):
    first = _submit(alice, booking)
    with pytest.raises(Conflict, match=f"Job {first.pk}"):
        _submit(alice, booking)
    job_cancel(user=alice, job=first)
    assert _submit(alice, booking).pk != first.pk


def test_it_runs_jobs_only_on_the_users_own_open_bookings(alice, bob, charlie, booking, sent):
    with pytest.raises(Forbidden):
        _submit(bob, booking)  # a teammate's booking
    with pytest.raises(Invalid, match="no booking"):
        _submit(charlie, booking)
    reservation_cancel(user=alice, reservation=booking)  # active: released
    with pytest.raises(Invalid, match="released"):
        _submit(alice, booking)


def test_it_cancels_a_queued_job_at_once_and_a_running_one_through_its_worker(
    alice, leader, bob, booking, sent
):
    job = _submit(alice, booking)
    with pytest.raises(Forbidden):
        job_cancel(user=bob, job=job)
    assert job_cancel(user=alice, job=job).status == Job.Status.CANCELLED
    with pytest.raises(Invalid, match="already cancelled"):
        job_cancel(user=alice, job=job)
    running = _submit(alice, booking)
    Job.objects.filter(pk=running.pk).update(status=Job.Status.RUNNING)
    with pytest.raises(Invalid, match="Give a reason: alice will see it"):
        job_cancel(user=leader, job=running)  # someone else's job: its owner is told why
    running = job_cancel(user=leader, job=running, reason="the demo")
    assert (
        running.status == Job.Status.RUNNING
        and running.cancel_requested_at
        and (running.cancelled_by, running.cancel_reason) == (leader, "the demo")
    )


def test_it_marks_jobs_without_heartbeat_lost_and_frees_the_booking(alice, booking, sent, settings):
    job = _submit(alice, booking)

    # Beats and their cut-off are the database's clock (portal.clock): the beat is aged there.
    def beat_ago(seconds: int) -> None:
        Job.objects.filter(pk=job.pk).update(
            status=Job.Status.RUNNING, heartbeat_at=Now() - timedelta(seconds=seconds), worker="gpu1"
        )

    beat_ago(settings.JOB_LOST_AFTER_SECONDS - 1)
    assert jobs_reconcile()["lost"] == 0
    beat_ago(settings.JOB_LOST_AFTER_SECONDS + 1)
    assert jobs_reconcile()["lost"] == 1
    job.refresh_from_db()
    assert job.status == Job.Status.LOST and "gpu1" in job.message
    assert b"no heartbeat" in b"".join(log_stream(job.pk))
    assert _submit(alice, booking).status == Job.Status.QUEUED  # the cards are free for a new job


def test_it_drops_queued_jobs_whose_booking_was_cancelled(alice, leader, box, sent, t0):
    upcoming = reservation_create(user=alice, gpus=[box[2].uuid], start=t0, end=t0 + timedelta(hours=1))
    job = _submit(alice, upcoming)
    reservation_cancel(user=alice, reservation=upcoming)
    assert jobs_reconcile()["expired"] == 1
    job.refresh_from_db()
    assert job.status == Job.Status.CANCELLED and "booking" in job.message


def test_it_records_peak_memory_and_utilization_from_telemetry(alice, booking, sent):
    job = _submit(alice, booking)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, pid=7)
    for memory, util in ((3000, 50), (5000, 70), (4000, 90)):
        snapshot = make_snapshot("box1", gpus=4, util=util, processes=0)
        # A child of the job (pid 9) in the job's session (7, the pid the worker recorded).
        held = replace(snapshot.gpus[0], processes=(ProcessInfo(9, "alice", "python", memory, session_id=7),))
        server_report_ingest(snapshot=replace(snapshot, gpus=(held, *snapshot.gpus[1:])))
    job.refresh_from_db()
    assert job.peak_memory_mb == 5000
    assert job.mean_utilization_pct == 70.0
    assert GPUProcess.objects.get().job_label == f"job {job.pk}"


# --- logs -----------------------------------------------------------------------------


def _job(alice, booking, sent) -> Job:
    return _submit(alice, booking)


def test_it_timestamps_lines_and_tails_from_an_offset(alice, booking, sent):
    job = _job(alice, booking, sent)
    writer = LogWriter(job.pk)
    writer.feed(b"one\ntw")
    writer.feed(b"o\n")
    writer.flush()
    first = b"".join(log_stream(job.pk))
    lines = first.decode().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == ["one", "two"]
    assert lines[0][:4].isdigit() and lines[0][23] == "Z"
    offset = log_end(job.pk)
    assert offset == len(first)
    writer.feed(b"three\n")
    writer.close()
    assert b"".join(log_stream(job.pk, offset)).endswith(b" three\n")
    assert not b"".join(log_stream(job.pk, offset)).count(b"two")


def test_it_keeps_the_head_and_the_tail_under_the_cap(alice, booking, sent):
    job = _job(alice, booking, sent)
    writer = LogWriter(job.pk, cap_bytes=64 * 1024)
    for n in range(5000):
        writer.feed(f"line {n:05d} ".encode() + b"x" * 40 + b"\n")
        if n % 100 == 0:
            writer.flush()
    writer.close()
    job.refresh_from_db()
    stored = sum(LogChunk.objects.filter(job=job).values_list("size", flat=True))
    assert stored <= 64 * 1024 + 16 * 1024  # a chunk of slack at most
    assert job.log_dropped_bytes == job.log_bytes - stored > 0
    text = b"".join(log_stream(job.pk)).decode()
    assert "line 00000" in text and "line 04999" in text and "line 02500" not in text
    assert f"{job.log_dropped_bytes:,} bytes of this log were dropped" in text


# --- API ------------------------------------------------------------------------------


def test_it_submits_an_upload_through_the_api(api, booking, sent):
    upload = SimpleUploadedFile("train.py", SCRIPT, content_type="text/x-python")
    response = api.post(
        "/api/v1/jobs/",
        {"reservation": booking.pk, "script": upload, "args": "--lr 0.1", "env": "WANDB_MODE=offline"},
        format="multipart",
    )
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (
        body["status"] == "queued"
        and body["args"] == ["--lr", "0.1"]
        and body["env"] == {"WANDB_MODE": "offline"}
    )
    assert api.get(f"/api/v1/jobs/{body['id']}/").json()["name"] == "train.py"
    assert [j["id"] for j in api.get("/api/v1/jobs/?status=queued").json()["results"]] == [body["id"]]


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"script_path": "../../../etc/passwd.py"}, "script_path"),
        ({"script_path": "train.py", "args": "x && y"}, "args"),
        ({"script_path": "train.py", "env": {"TF_CONFIG": "{}"}}, "env"),
        ({"script_path": "train.py", "args": 3}, "args"),
    ],
)
def test_it_answers_bad_api_input_with_a_400_naming_the_field(api, booking, sent, data, field):
    response = api.post("/api/v1/jobs/", {"reservation": booking.pk, **data}, format="json")
    assert response.status_code == 400
    body = response.json()
    assert body["code"] == "invalid" and field in body["errors"]
    assert not Job.objects.exists()


def test_it_answers_a_huge_api_upload_with_a_400(api, booking, settings):
    settings.JOB_UPLOAD_MAX_KB = 4
    upload = SimpleUploadedFile("big.py", b"#" * 100_000)
    response = api.post("/api/v1/jobs/", {"reservation": booking.pk, "script": upload}, format="multipart")
    assert response.status_code == 400 and "limit is 4 KB" in response.json()["detail"]
    assert not Job.objects.exists()


def test_it_shows_jobs_to_the_owner_leaders_and_admins_only(
    alice, bob, charlie, leader, admin_user, booking, sent
):
    job = _submit(alice, booking)
    writer = LogWriter(job.pk)
    writer.write_line("hello")
    writer.close()
    client = APIClient()
    for user, code in ((alice, 200), (leader, 200), (admin_user, 200), (bob, 404), (charlie, 404)):
        client.force_authenticate(user)
        assert client.get(f"/api/v1/jobs/{job.pk}/").status_code == code, user
        assert client.get(f"/api/v1/jobs/{job.pk}/log/").status_code == code, user
        listed = [j["id"] for j in client.get("/api/v1/jobs/").json()["results"]]
        assert (job.pk in listed) == (code == 200), user
    client.force_authenticate(bob)
    assert client.post(f"/api/v1/jobs/{job.pk}/cancel/").status_code == 404
    client.force_authenticate(leader)
    cancel = client.post(f"/api/v1/jobs/{job.pk}/cancel/", {"reason": "the demo"}, format="json").json()
    assert (cancel["status"], cancel["cancelled_by"], cancel["cancel_reason"]) == (
        "cancelled",
        "leader",
        "the demo",
    )


def test_it_streams_the_log_as_text_from_an_offset(api, alice, booking, sent):
    job = _submit(alice, booking)
    writer = LogWriter(job.pk)
    writer.feed(b"first\nsecond\n")
    writer.close()
    response = api.get(f"/api/v1/jobs/{job.pk}/log/", HTTP_ACCEPT="text/plain")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain")
    assert response.streaming
    body = b"".join(response.streaming_content)
    assert body.count(b"\n") == 2 and int(response["X-Log-Next-Offset"]) == len(body)
    tail = api.get(f"/api/v1/jobs/{job.pk}/log/?offset={len(body) - 7}")
    assert b"".join(tail.streaming_content) == b"second\n"
    assert api.get(f"/api/v1/jobs/{job.pk}/log/?offset=-1").status_code == 400


def test_it_leaves_a_job_for_the_reconciler_when_the_broker_is_down(
    alice, booking, monkeypatch, django_capture_on_commit_callbacks
):
    def broker_down(**kwargs):
        raise ConnectionError("redis is restarting")

    monkeypatch.setattr("jobs.tasks.run_job.apply_async", broker_down)
    with django_capture_on_commit_callbacks(execute=True):
        job = _submit(alice, booking)  # the user still gets their queued job
    job.refresh_from_db()
    assert job.status == Job.Status.QUEUED and job.dispatched_at is None
    sent: list = []
    monkeypatch.setattr("jobs.tasks.run_job.apply_async", lambda args, queue: sent.append(args[0]))
    with django_capture_on_commit_callbacks(execute=True):
        assert jobs_reconcile()["dispatched"] == 1
    assert sent == [job.pk]


def test_it_continues_the_log_after_a_line_the_reconciler_appended(alice, booking, sent):
    """A worker out of touch for a while: the reconciler wrote "lost" into the log meanwhile."""
    job = _submit(alice, booking)
    writer = LogWriter(job.pk)
    writer.feed(b"epoch 1\n")
    writer.flush()
    log_append(job.pk, "[portal] Lost: no heartbeat")
    writer.feed(b"epoch 2\n")
    writer.close()  # would collide on the chunk number without a resync
    lines = [line.split(" ", 1)[1] for line in b"".join(log_stream(job.pk)).decode().splitlines()]
    assert lines == ["epoch 1", "[portal] Lost: no heartbeat", "epoch 2"]
    starts = list(LogChunk.objects.filter(job=job).order_by("seq").values_list("start", "size"))
    assert all(a + size == b for (a, size), (b, _) in pairwise(starts))
    job.refresh_from_db()
    assert job.log_bytes == sum(size for _, size in starts)


def test_it_reports_every_bad_field_at_once(alice, booking):
    """Nine bad fields are not nine rounds (issue 23): each check runs and all are reported."""
    with pytest.raises(Invalid) as error:
        job_submit(
            user=alice,
            reservation=booking,
            script=None,
            interpreter="no-such-python",
            env="1BAD=x",
            memory_mode="bogus",
            intra_op_threads=0,
        )
    assert {"script", "interpreter", "env", "memory_mode"} <= set(error.value.errors)
    assert not Job.objects.exists()


def test_the_api_and_the_form_show_every_bad_field_at_once(client, alice, booking):
    from rest_framework.test import APIClient

    api = APIClient()
    api.force_authenticate(alice)
    body = {"reservation": booking.pk, "interpreter": "no-such-python", "env": {"1BAD": "x"}}
    answer = api.post("/api/v1/jobs/", body, format="json")
    assert answer.status_code == 400
    assert {"script", "interpreter", "env"} <= set(answer.json()["errors"])
    client.force_login(alice)
    page = client.post("/jobs/new/", {"reservation": booking.pk, "interpreter": "default", "env": "1BAD=x"})
    form = page.context["form"]
    assert {"script", "env"} <= set(form.errors), form.errors

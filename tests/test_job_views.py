"""Job pages: the form, lists and history, one job, its log, cancel; who may see or do what."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.models import GPUProcess
from gpus.services import server_report_ingest
from jobs.logs.store import LogWriter
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from portal.timefmt import format_duration
from tests.factories import job_form_data, make_snapshot

SCRIPT = b"print('hello from the job')\n"


@pytest.fixture(autouse=True)
def dispatched(monkeypatch) -> list:
    """No broker in these tests: record what job_submit would send to the worker."""
    sent: list = []
    monkeypatch.setattr("jobs.tasks.run_job.apply_async", lambda *args, **kwargs: sent.append((args, kwargs)))
    return sent


@pytest.fixture
def job(alice, booking) -> Job:
    return job_submit(
        user=alice, reservation=booking, script=ScriptUpload(name="train.py", content=SCRIPT), args="--lr 0.1"
    )


def field_errors(response, field: str) -> list[str]:
    return response.context["form"].errors.get(field, [])


# --- the form ---------------------------------------------------------------------------


def test_it_offers_only_my_open_bookings_preselected_from_the_booking_page(client, alice, bob, booking, box):
    reservation_create(user=bob, gpus=[box[1].uuid])
    client.force_login(alice)
    response = client.get(reverse("job_new") + f"?reservation={booking.pk}")
    assert response.status_code == 200
    html = response.content.decode()
    until = timezone.localtime(booking.end).strftime("%a %H:%M")
    assert f"#{booking.pk} box1 GPU 0 · 8 GiB · until {until}" in html
    assert re.search(rf'<option value="{booking.pk}" selected>', html)
    assert list(response.context["form"].fields["reservation"].queryset) == [booking]  # not bob's
    assert "TF_FORCE_GPU_ALLOW_GROWTH" in html  # the memory mode's help text


def test_it_submits_an_uploaded_script_and_redirects_to_the_job_page(
    client, alice, booking, dispatched, django_capture_on_commit_callbacks
):
    client.force_login(alice)
    upload = SimpleUploadedFile("train.py", SCRIPT)
    data = job_form_data(booking, script=upload, args="--epochs 2 --name 'run a'", env="WANDB_MODE=offline")
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(reverse("job_new"), data)
    job = Job.objects.get()
    assert dispatched == [((), {"args": [job.pk], "queue": "host.box1"})]  # the id, after commit
    assert response.status_code == 302 and response.url == reverse("job_detail", args=[job.pk])
    assert job.status == Job.Status.QUEUED and job.owner == alice
    assert job.script_source == SCRIPT.decode() and job.name == "train.py"
    assert job.args == ["--epochs", "2", "--name", "run a"]
    assert job.env == {"WANDB_MODE": "offline"}
    assert job.memory_mode == Job.MemoryMode.LIMIT  # the service's default on a shared card
    assert job.soft_placement is True and job.mirrored is False
    page = client.get(response.url).content.decode()
    assert (
        f"Submitted job {job.pk} (train.py) at " in page and "to box1, to start as soon as its worker" in page
    )
    assert "--epochs 2 --name &#x27;run a&#x27;" in page  # shlex.join, escaped


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        ({"env": "CUDA_VISIBLE_DEVICES=1"}, "env", "set by the portal from your booking"),
        ({"args": "a | b"}, "args", "never run through a shell"),
        ({"script_path": "../etc/passwd", "script": None}, "script_path", "may not contain '..'"),
        ({"memory_mode": "all"}, "memory_mode", "whole-card bookings"),
        ({"time_limit_minutes": "0"}, "time_limit_minutes", "at least 1 minute"),
        ({"intra_op_threads": "1000"}, "intra_op_threads", "between 1 and 256"),
        ({"mirrored": "on"}, "mirrored", "two or more cards"),
        ({"script": None}, "script", "Upload a .py script, or give the path"),
    ],
)
def test_it_shows_service_errors_beside_the_field_and_writes_nothing(
    client, alice, booking, overrides, field, words
):
    client.force_login(alice)
    data = job_form_data(booking, script=SimpleUploadedFile("train.py", SCRIPT))
    data.update(overrides)
    data = {k: v for k, v in data.items() if v is not None}
    response = client.post(reverse("job_new"), data)
    assert response.status_code == 200
    assert any(words in e for e in field_errors(response, field)), response.context["form"].errors
    html = response.content.decode()
    # Rendered in the field's own group: after its label, before the next field's label.
    group = rf'<label[^>]*for="id_{field}"(?:(?!<label).)*?class="errorlist"'
    assert re.search(group, html, re.S)
    assert not Job.objects.exists()


def test_it_refuses_a_too_large_upload_beside_the_script_field(client, alice, booking, settings):
    settings.JOB_UPLOAD_MAX_KB = 1
    client.force_login(alice)
    upload = SimpleUploadedFile("big.py", b"x = 1\n" * 1000)
    response = client.post(reverse("job_new"), job_form_data(booking, script=upload))
    assert response.status_code == 200
    assert any("the limit is 1 KB" in e for e in field_errors(response, "script"))
    assert not Job.objects.exists()


def test_it_refuses_someone_elses_booking_in_the_form(client, bob, booking):
    client.force_login(bob)
    upload = SimpleUploadedFile("train.py", SCRIPT)
    response = client.post(reverse("job_new"), job_form_data(booking, script=upload))
    assert response.status_code == 200
    assert "not one of your active or upcoming bookings" in field_errors(response, "reservation")[0]
    assert not Job.objects.exists()


def test_it_shows_a_second_job_on_the_same_booking_as_a_form_error(client, alice, booking, job):
    client.force_login(alice)
    upload = SimpleUploadedFile("again.py", SCRIPT)
    response = client.post(reverse("job_new"), job_form_data(booking, script=upload))
    assert response.status_code == 200
    errors = response.context["form"].non_field_errors()
    assert f"Job {job.pk} (train.py) is still queued" in errors[0]
    assert Job.objects.count() == 1


def test_it_runs_the_example_from_the_button(client, alice, booking, dispatched):
    client.force_login(alice)
    response = client.post(
        reverse("job_example"), {"reservation": booking.pk, "next": reverse("my_reservations")}
    )
    job = Job.objects.get()
    assert response.status_code == 302 and response.url == reverse("job_detail", args=[job.pk])
    assert job.name == "keras_example.py" and "model.fit" in job.script_source
    assert job.status == Job.Status.QUEUED and job.args == []


def test_it_reports_a_refused_example_and_goes_back(client, alice, bob, booking, job):
    client.force_login(alice)
    back = reverse("my_reservations")
    response = client.post(reverse("job_example"), {"reservation": booking.pk, "next": back})
    assert response.status_code == 302 and response.url == back
    page = client.get(back).content.decode()
    assert "Run the example: Job" in page and "one job runs on a booking at a time" in page
    assert Job.objects.count() == 1
    client.force_login(bob)
    response = client.post(reverse("job_example"), {"reservation": booking.pk}, follow=True)
    assert "Jobs run on your own bookings only" in response.content.decode()


def test_it_shows_run_buttons_on_the_owners_open_bookings(client, alice, bob, booking):
    client.force_login(alice)
    for url in (reverse("reservation_detail", args=[booking.pk]), reverse("my_reservations")):
        html = client.get(url).content.decode()
        assert f"/jobs/new/?reservation={booking.pk}" in html and "Run the example" in html
    client.force_login(bob)  # a teammate sees the booking, not the buttons
    html = client.get(reverse("reservation_detail", args=[booking.pk])).content.decode()
    assert "Run a job" not in html and "Run the example" not in html


# --- one job, its log, cancel -----------------------------------------------------------


@pytest.mark.parametrize(
    ("who", "status"),
    [("alice", 200), ("bob", 404), ("charlie", 404), ("leader", 200), ("admin_user", 200)],
)
def test_it_shows_the_job_its_log_and_download_only_to_those_who_may_see_it(
    client, request, job, who, status
):
    client.force_login(request.getfixturevalue(who))
    for name in ("job_detail", "job_log_tail", "job_log_download"):
        assert client.get(reverse(name, args=[job.pk])).status_code == status, name


@pytest.mark.parametrize(
    ("who", "status", "cancelled"),
    [
        ("alice", 302, True),
        ("bob", 404, False),
        ("charlie", 404, False),
        ("leader", 302, True),
        ("admin_user", 302, True),
    ],
)
def test_it_lets_owner_leaders_and_admins_cancel(client, request, job, who, status, cancelled):
    user = request.getfixturevalue(who)
    client.force_login(user)
    page = client.get(reverse("job_detail", args=[job.pk]))
    if status == 302:
        assert ("Cancel job" if who == "alice" else "Cancel alice's job…") in page.content.decode()
    # Someone else's: confirmed, with the reason its owner is told (tests/test_cancel_others.py).
    data = {} if who == "alice" else {"reason": "the demo", "confirm": "1"}
    response = client.post(reverse("job_cancel", args=[job.pk]), data)
    assert response.status_code == status
    job.refresh_from_db()
    assert (job.status == Job.Status.CANCELLED) is cancelled
    if cancelled:
        assert job.cancelled_by == user and response.url == reverse("job_detail", args=[job.pk])


def test_it_cancels_a_queued_job_and_says_so(client, alice, job):
    client.force_login(alice)
    response = client.post(reverse("job_cancel", args=[job.pk]), follow=True)
    job.refresh_from_db()
    assert job.status == Job.Status.CANCELLED and job.finished_at
    html = response.content.decode()
    assert f"Cancel requested: job {job.pk} (train.py) is cancelled." in html
    assert "Cancel job" not in html  # nothing left to cancel
    again = client.post(reverse("job_cancel", args=[job.pk]), follow=True).content.decode()
    assert "is already cancelled; there is nothing to cancel" in again


def test_it_requests_a_cancel_of_a_running_job(client, alice, job):
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, started_at=timezone.now())
    client.force_login(alice)
    html = client.post(reverse("job_cancel", args=[job.pk]), follow=True).content.decode()
    job.refresh_from_db()
    assert job.status == Job.Status.RUNNING and job.cancel_requested_at
    assert "gets SIGTERM now" in html


def test_it_only_cancels_by_post(client, alice, job):
    client.force_login(alice)
    assert client.get(reverse("job_cancel", args=[job.pk])).status_code == 405


def test_it_shows_what_the_job_runs_and_reads_the_status_while_active(client, alice, job, box):
    client.force_login(alice)
    html = client.get(reverse("job_detail", args=[job.pk])).content.decode()
    assert "uploaded: train.py" in html and "<details" in html and "hello from the job" in html
    assert "--lr 0.1" in html and "Limit to my booking" in html
    assert f'href="{reverse("reservation_detail", args=[job.reservation_id])}"' in html
    assert "GPU 0" in html and box[0].uuid in html
    assert f'data-log-url="{reverse("job_log_tail", args=[job.pk])}"' in html and 'id="job-log"' in html
    assert "js/job_log.js" in html and reverse("job_log_download", args=[job.pk]) in html
    # The page's one stream, its log in the exact form (docs/live.md)
    assert f'data-events-url="{reverse("job_events", args=[job.pk])}?encoding=json"' in html
    part = client.get(reverse("job_detail", args=[job.pk]) + "?part=status").content.decode()
    assert part.lstrip().startswith('<section id="job-status"') and 'data-live="job telemetry"' in part
    assert 'hx-trigger="every 2s" data-poll-fallback' in part  # when not pushed
    assert "<html" not in part

    now = timezone.now()
    Job.objects.filter(pk=job.pk).update(
        status=Job.Status.SUCCEEDED,
        started_at=now - timedelta(minutes=3, seconds=7),
        finished_at=now,
        exit_code=0,
        peak_memory_mb=1536,
        utilization_sum=150,
        utilization_samples=3,
        launcher_line="[portal] launcher: job 1 · memory_limit 7680 MiB per GPU",
        env_applied={"CUDA_VISIBLE_DEVICES": box[0].uuid},
        log_bytes=2048,
    )
    part = client.get(reverse("job_detail", args=[job.pk]) + "?part=status").content.decode()
    assert "hx-trigger" not in part  # finished: the polling stops
    for words in ("Succeeded", "3 min 07 s", "1.5 GiB", "50.0 %", "memory_limit 7680 MiB", "2.0\xa0KB"):
        assert words in part, words
    assert f"<code>CUDA_VISIBLE_DEVICES</code></th><td><code>{box[0].uuid}</code>" in part
    assert "Cancel job" not in part


def test_it_formats_durations():
    assert format_duration(None) == ""
    assert format_duration(timedelta(seconds=12)) == "12 s"
    assert format_duration(timedelta(minutes=3, seconds=7)) == "3 min 07 s"
    assert format_duration(timedelta(hours=1, minutes=2, seconds=9)) == "1 h 02 min"


def _write(job: Job, *lines: str) -> None:
    writer = LogWriter(job.pk)
    for line in lines:
        writer.write_line(line)
    writer.close()


def test_it_downloads_the_log_as_a_streamed_text_attachment(client, alice, job):
    _write(job, "hello", "world")
    client.force_login(alice)
    response = client.get(reverse("job_log_download", args=[job.pk]))
    assert response.status_code == 200 and response.streaming
    assert response["Content-Type"].startswith("text/plain")
    assert response["Content-Disposition"] == f'attachment; filename="job-{job.pk}-train.log"'
    lines = b"".join(response.streaming_content).decode().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == ["hello", "world"]
    assert all(line[:19] == line[:19].strip() and line[10] == "T" for line in lines)  # timestamped


def test_it_tails_the_log_from_an_offset(client, alice, job):
    _write(job, "hello")
    client.force_login(alice)
    url = reverse("job_log_tail", args=[job.pk])
    first = client.get(url + "?offset=0")
    body = b"".join(first.streaming_content)
    assert body.endswith(b" hello\n") and first["X-Job-Status"] == "queued"
    offset = int(first["X-Log-Next-Offset"])
    assert offset == len(body)
    assert "attachment" not in first.get("Content-Disposition", "")

    nothing = client.get(f"{url}?offset={offset}")
    assert b"".join(nothing.streaming_content) == b"" and int(nothing["X-Log-Next-Offset"]) == offset

    _write(job, "world")
    second = client.get(f"{url}?offset={offset}")
    new = b"".join(second.streaming_content)
    assert new.endswith(b" world\n") and b"hello" not in new
    assert int(second["X-Log-Next-Offset"]) == offset + len(new)


@pytest.mark.parametrize("offset", ["-1", "abc", "1.5"])
def test_it_refuses_a_bad_offset_saying_how(client, alice, job, offset):
    client.force_login(alice)
    response = client.get(reverse("job_log_tail", args=[job.pk]) + f"?offset={offset}")
    assert response.status_code == 400
    assert "offset must be a whole number of bytes" in response.content.decode()


# --- lists -------------------------------------------------------------------------------


@pytest.fixture
def jobs_around(alice, bob, box, charlie):
    """alice: a queued job on box1 and a failed one on box2 last week; bob: a succeeded job on
    box1; charlie (another team): one job on box2."""
    server_report_ingest(snapshot=make_snapshot("box2", gpus=2))
    upload = ScriptUpload(name="a.py", content=SCRIPT)

    def submit(user, gpu: str, status: str | None = None, days_ago: int = 0) -> Job:
        booking = reservation_create(user=user, gpus=[gpu], memory_mb=8192)
        job = job_submit(user=user, reservation=booking, script=upload)
        if status or days_ago:
            created = timezone.now() - timedelta(days=days_ago)
            Job.objects.filter(pk=job.pk).update(status=status or job.status, created_at=created)
        return Job.objects.get(pk=job.pk)

    return {
        "alice_queued": submit(alice, box[0].uuid),
        "alice_failed": submit(alice, "GPU-box2-00", Job.Status.FAILED, days_ago=7),
        "bob_done": submit(bob, box[1].uuid, Job.Status.SUCCEEDED),
        "charlie": submit(charlie, "GPU-box2-01"),
    }


def listed(response) -> set[int]:
    assert response.status_code == 200
    return {job.pk for job in response.context["jobs"]}


def test_it_lists_my_jobs_with_filters(client, alice, jobs_around):
    client.force_login(alice)
    url = reverse("my_jobs")
    mine = {jobs_around["alice_queued"].pk, jobs_around["alice_failed"].pk}
    response = client.get(url)
    assert listed(response) == mine
    html = response.content.decode()
    assert '<span class="badge queued">Queued</span>' in html and "GPU 0" in html
    assert listed(client.get(url, {"status": "failed"})) == {jobs_around["alice_failed"].pk}
    assert listed(client.get(url, {"server": "box1"})) == {jobs_around["alice_queued"].pk}
    today = timezone.localdate().isoformat()
    assert listed(client.get(url, {"since": today})) == {jobs_around["alice_queued"].pk}


def test_it_shows_history_to_leaders_for_their_team_and_to_admins_for_all(
    client, alice, bob, leader, admin_user, charlie, jobs_around
):
    url = reverse("job_history")
    team_jobs = {jobs_around[k].pk for k in ("alice_queued", "alice_failed", "bob_done")}
    client.force_login(leader)
    assert listed(client.get(url)) == team_jobs
    assert listed(client.get(url, {"user": "bob"})) == {jobs_around["bob_done"].pk}
    assert listed(client.get(url, {"team": "vision-lab", "status": "succeeded"})) == {
        jobs_around["bob_done"].pk
    }
    assert listed(client.get(url, {"server": "box2"})) == {jobs_around["alice_failed"].pk}
    week_ago = (timezone.localdate() - timedelta(days=7)).isoformat()
    yesterday = (timezone.localdate() - timedelta(days=1)).isoformat()
    assert listed(client.get(url, {"since": week_ago, "until": yesterday})) == {
        jobs_around["alice_failed"].pk
    }
    client.force_login(admin_user)
    assert listed(client.get(url)) == team_jobs | {jobs_around["charlie"].pk}
    client.force_login(bob)  # a member who leads no team: only their own
    assert listed(client.get(url)) == {jobs_around["bob_done"].pk}


@pytest.mark.parametrize(
    ("params", "field", "words"),
    [
        ({"since": "last week"}, "since", "is not a date; write it as YYYY-MM-DD"),
        ({"until": "2025-13-01"}, "until", "is not a date"),
        ({"status": "exploded"}, "status", "Unknown status"),
    ],
)
def test_it_shows_a_bad_filter_beside_the_filter_and_lists_nothing(
    client, leader, jobs_around, params, field, words
):
    client.force_login(leader)
    response = client.get(reverse("job_history"), params)
    assert listed(response) == set()
    assert words in response.context["filter_form"].errors[field][0]
    assert words.split(";")[0] in response.content.decode().replace("&#x27;", "'")


def test_it_paginates_25_a_page_and_keeps_filters_in_page_links(client, alice, job):
    Job.objects.filter(pk=job.pk).update(status=Job.Status.CANCELLED)
    job.refresh_from_db()
    clones = []
    for _ in range(29):
        job.pk = None
        clones.append(Job(**{f.attname: getattr(job, f.attname) for f in Job._meta.concrete_fields}))
    Job.objects.bulk_create(clones)
    client.force_login(alice)
    first = client.get(reverse("my_jobs"), {"status": "cancelled", "server": "box1"})
    assert len(first.context["jobs"]) == 25
    html = first.content.decode()
    assert "Page 1 of 2" in html
    assert "?status=cancelled&amp;server=box1&amp;page=2" in html
    second = client.get(reverse("my_jobs"), {"status": "cancelled", "server": "box1", "page": 2})
    assert len(second.context["jobs"]) == 5


def test_it_links_a_jobs_process_on_the_dashboard(client, alice, job, box):
    GPUProcess.objects.create(gpu=box[0], pid=4242, username="alice", used_memory_mb=900, job_id=job.pk)
    GPUProcess.objects.create(gpu=box[0], pid=4343, username="eve", used_memory_mb=100)
    client.force_login(alice)
    html = client.get(reverse("dashboard_servers")).content.decode()
    assert f'<a class="job" href="/jobs/{job.pk}/">job {job.pk}</a>' in html
    assert 'pid 4343 · 100 MiB · <span class="muted">unmanaged</span>' in html


def test_it_links_jobs_in_the_nav_and_needs_a_login(client, alice):
    assert client.get(reverse("my_jobs")).status_code == 302
    client.force_login(alice)
    assert f'href="{reverse("my_jobs")}"' in client.get(reverse("my_jobs")).content.decode()


def test_the_job_page_puts_the_log_first(client, alice, booking, sent):
    """The log right under the status, above what runs and the charts (issue 23)."""
    job = job_submit(
        user=alice, reservation=booking, script=ScriptUpload(name="train.py", content=b"print(1)\n")
    )
    client.force_login(alice)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert page.index('id="job-status"') < page.index("<h2>Log</h2>") < page.index("<h2>What runs</h2>")


def test_an_invented_process_of_the_simulation_is_marked_so(client, alice):
    """Scenery, not a finding (issue 23): the simulated inventory's made-up processes say so."""
    server_report_ingest(snapshot=make_snapshot("sim1", gpus=1, simulated=True))
    client.force_login(alice)
    html = client.get(reverse("dashboard_servers")).content.decode()
    assert '<span class="badge simulated" title="Invented by the simulated inventory' in html


def test_a_preempted_jobs_page_says_its_times_are_its_last_runs(client, alice, box):
    from tests.factories import queue_job

    job = queue_job(alice, preemptible=True)
    now = timezone.now()
    Job.objects.filter(pk=job.pk).update(preemptions=2, requeued_at=now - timedelta(minutes=5))
    client.force_login(alice)
    page = client.get(reverse("job_detail", args=[job.pk])).content.decode()
    assert "preempted 2 times so far (the times below are its last run's)" in page
    Job.objects.filter(pk=job.pk).update(status=Job.Status.SUCCEEDED, started_at=now, finished_at=now)
    page = client.get(reverse("job_detail", args=[job.pk])).content.decode()
    assert "preempted 2 times (the times below are its last run's)" in page

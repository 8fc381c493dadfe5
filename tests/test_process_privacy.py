"""Whose command line a member sees: the whole of it for admins and for the process's owner (its
job's owner, else whoever holds its Unix account), else the program's name only, on the dashboard
and in the API alike (gpus.selectors.CommandLines)."""

from __future__ import annotations

import html

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from gpus import hooks
from gpus.models import GPUProcess
from gpus.selectors import program_name
from jobs.models import Job
from portal.models import Profile

pytestmark = pytest.mark.django_db

MINE = "/usr/bin/python3 train.py --token s3cret-of-alice"
JOB = "/opt/conda/bin/python /srv/jobs/job-1/train.py --api-key k3y-of-the-job"
# Seen by admins and by alice (alice's own process, and her job's process run as the shared
# account); teammates, outsiders and leaders see the program only.
FULL = {"alice": (MINE, JOB), "admin": (MINE, JOB)}
CUT = ("python3", "python")


@pytest.fixture
def processes(alice, team, box) -> list[GPUProcess]:
    """On box1 GPU 0: alice's own process, and her job's, run as the shared JOB_USER account."""
    GPUProcess.objects.all().delete()
    job = Job.objects.create(owner=alice, team=team, name="train.py", server=box[0].server)
    return [
        GPUProcess.objects.create(gpu=box[0], pid=4242, username="alice", command=MINE, used_memory_mb=900),
        GPUProcess.objects.create(
            gpu=box[0], pid=4343, username="gpujob", command=JOB, used_memory_mb=800, job_id=job.pk
        ),
    ]


def _seen_in_the_api(user, uuid: str) -> list[tuple[str, ...]]:
    api = APIClient()
    api.force_authenticate(user)
    listed = {g["uuid"]: g for g in api.get("/api/v1/gpus/").json()}[uuid]["processes"]
    detail = api.get(f"/api/v1/gpus/{uuid}/").json()["processes"]
    return [tuple(p["command"] for p in rows) for rows in (listed, detail)]


@pytest.mark.parametrize("who", ["alice", "bob", "leader", "charlie", "admin_user"])
def test_the_api_shows_a_whole_command_line_to_its_owner_and_admins_only(request, processes, box, who):
    user = request.getfixturevalue(who)
    expected = FULL.get(user.username, CUT)
    assert _seen_in_the_api(user, box[0].uuid) == [expected, expected]


@pytest.mark.parametrize("who", ["alice", "bob", "leader", "charlie", "admin_user"])
def test_the_dashboard_shows_a_whole_command_line_to_its_owner_and_admins_only(
    client, request, processes, who
):
    user = request.getfixturevalue(who)
    client.force_login(user)
    page = client.get(reverse("dashboard")).content.decode()
    live = client.get(reverse("dashboard_servers")).content.decode()
    for text in (page, live):
        shown = [html.unescape(t) for t in _titles(text)]
        assert shown == list(FULL.get(user.username, CUT))
        if user.username not in FULL:
            assert "s3cret" not in text and "k3y" not in text


def _titles(text: str) -> list[str]:
    procs = text.split('<td class="procs">', 1)[1].split("</td>", 1)[0]
    return [part.split('"', 1)[0] for part in procs.split(' title="')[1:]]


def test_a_process_is_its_unix_accounts_holders(client, alice, box):
    """Not the portal user who happens to share its name: alice logs in to the hosts as asmith."""
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "asmith"})
    GPUProcess.objects.all().delete()
    GPUProcess.objects.create(gpu=box[0], pid=1, username="asmith", command="python a.py --x 1")
    GPUProcess.objects.create(gpu=box[0], pid=2, username="alice", command="python b.py --y 2")
    assert _seen_in_the_api(alice, box[0].uuid) == [("python a.py --x 1", "python")] * 2


def test_a_job_process_is_the_jobs_owners_whatever_account_runs_it(bob, box, processes):
    """bob's Unix account runs alice's job (JOB_USER=bob): still hers, not his."""
    GPUProcess.objects.filter(pid=4343).update(username="bob")
    assert _seen_in_the_api(bob, box[0].uuid) == [CUT, CUT]


def test_the_jobs_app_answers_whose_jobs_they_are(alice, bob, team):
    job = Job.objects.create(owner=alice, team=team, name="train.py")
    assert set(hooks.own_jobs(alice, [job.pk])) == {job.pk}
    assert not set(hooks.own_jobs(bob, [job.pk]))


@pytest.mark.parametrize(
    ("command", "program"),
    [
        ("/usr/bin/python3 train.py --password hunter2", "python3"),
        ("python", "python"),
        ("  torchrun --nproc 4 x.py", "torchrun"),
        ("", ""),
    ],
)
def test_others_see_the_programs_name_only(command, program):
    assert program_name(command) == program


@pytest.fixture
def violation(alice, bob, box):
    """alice's process on a card bob has booked: bob and alice's leader are told, and may look."""
    from django.utils import timezone

    from gpus.booking import reservation_create
    from gpus.models import Violation

    booking = reservation_create(user=bob, gpus=[box[0].uuid])
    now = timezone.now()
    return Violation.objects.create(
        kind=Violation.Kind.INTRUDER, gpu=box[0], server=box[0].server, pid=4242, os_user="alice",
        user=alice, reservation=booking, command=MINE, memory_mb=900, first_seen=now, last_seen=now,
    )  # fmt: skip


@pytest.mark.parametrize("who", ["alice", "bob", "leader", "admin_user"])
def test_a_violation_shows_its_whole_command_line_to_its_process_owner_and_admins_only(
    client, request, violation, who
):
    user = request.getfixturevalue(who)
    expected = MINE if user.username in ("alice", "admin") else "python3"
    api = APIClient()
    api.force_authenticate(user)
    assert api.get(f"/api/v1/violations/{violation.pk}/").json()["command"] == expected
    client.force_login(user)
    page = html.unescape(client.get(reverse("violation_detail", args=[violation.pk])).content.decode())
    assert f"<code>{expected}</code>" in page
    if expected != MINE:
        assert "s3cret-of-alice" not in page


def test_the_watchdogs_notice_shows_the_whole_command_line_to_the_process_owner_only(violation, bob, alice):
    from jobs.watchdog.notify import tell_about
    from portal.models import Notification

    tell_about(violation, event="seen")
    bodies = {n.user.username: n.body for n in Notification.objects.select_related("user")}
    assert "s3cret-of-alice" in bodies["alice"]
    assert "bob" in bodies and "s3cret-of-alice" not in bodies["bob"] and ": python3" in bodies["bob"]

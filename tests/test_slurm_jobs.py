"""Jobs on a Slurm cluster without a cluster (issue 37): the submit's checks as the API answers them,
the portal's own scheduling kept off the cluster's cards, and what the Slurm executor writes and
reads. The real cluster's tier is tests/test_slurm.py."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.db import connection, transaction
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_create, reservation_extend
from gpus.models import Reservation, Server, SlurmCluster
from gpus.services import servers_report_ingest
from gpus.slurm_booking import reservation_name, slurm_nodes_book, slurm_reservations_sync
from gpus.slurm_cli import SlurmRefused, SlurmUnreachable
from gpus.slurm_inventory import cluster_snapshot
from jobs.host import slurm_runner
from jobs.host.executors.base import RunEnd, RunSpec
from jobs.host.executors.slurm import (
    FileOutput,
    SlurmExecutor,
    SlurmRequest,
    exit_of,
    jobcomp_find,
    slurm_job_name,
    state_of,
)
from jobs.models import InteractiveSession, Job
from jobs.queue.scheduler import schedule_pass
from jobs.runs import runs_lost_mark
from jobs.sessions.services import session_start
from jobs.slurm import FIXES, answer_check, check_key, slurm_submit_check
from portal.errors import Invalid, ServiceError
from portal.models import AuditEntry, Notification, Profile
from tests.factories import MembershipFactory, TeamFactory, UserFactory, job_form_data, queue_job
from tests.job_helpers import job_log
from tests.test_cli import _own_config, gpu, portal  # noqa: F401 - the CLI against a live server
from tests.test_slurm_inventory import JOBS, NODES

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice():
    user = UserFactory(username="alice")
    MembershipFactory(user=user, team=TeamFactory(slug="lab"))
    return user


@pytest.fixture
def cluster(tmp_path, monkeypatch, settings):
    # Slurm's word before a job is written is its worker's to give (jobs/host/slurm_checks.py):
    # yes here, with no cluster to ask (tests/test_slurm.py asks a real one).
    monkeypatch.setattr("jobs.submit.slurm_submit_check", lambda **kwargs: None)
    server = Server.objects.create(name="cluster-a", kind=Server.Kind.SLURM)
    SlurmCluster.objects.create(server=server, job_root=str(tmp_path), partitions="gpu,long")
    servers_report_ingest(snapshots=[cluster_snapshot("cluster-a", NODES, JOBS)])  # online, 3 nodes
    settings.WORKER_SERVER = "cluster-a"  # this process is its worker (jobs.host.launch.job_claim)
    return server


def post(user, **data):  # type: ignore[no-untyped-def]
    api = APIClient()
    api.force_authenticate(user)
    script = ("train.py", b"print('hi')\n", "text/x-python")
    return api.post("/api/v1/jobs/", {"script": _upload(*script), **data}, format="multipart")


def _upload(name: str, content: bytes, kind: str):  # type: ignore[no-untyped-def]
    from django.core.files.uploadedfile import SimpleUploadedFile

    return SimpleUploadedFile(name, content, content_type=kind)


def test_the_api_sends_a_job_to_the_cluster_with_its_partition(alice, cluster):
    response = post(alice, server="cluster-a", gpu_count=2, partition="long", time_limit_minutes=30)
    assert response.status_code == 201, response.json()
    job = Job.objects.get(pk=response.json()["id"])
    assert (job.server, job.gpu_count, job.partition, job.reservation, job.status) == (
        cluster,
        2,
        "long",
        None,
        "queued",
    )
    assert job.dispatched_at is not None and not job.queued  # to the cluster's worker, not the queue
    assert response.json()["partition"] == "long"


@pytest.mark.django_db(transaction=True)
def test_slurm_is_asked_outside_any_transaction_and_the_job_saved_after(alice, cluster, monkeypatch):
    # Slurm may take seconds to answer; a transaction held open meanwhile would hold SQLite's one
    # write lock (every booking and job of the portal waiting) or a PostgreSQL transaction.
    asked = []

    def slurm_says_yes(**kwargs):  # type: ignore[no-untyped-def]
        asked.append((connection.in_atomic_block, Job.objects.count()))

    monkeypatch.setattr("jobs.submit.slurm_submit_check", slurm_says_yes)
    response = post(alice, server="cluster-a", gpu_count=1)
    assert response.status_code == 201, response.json()
    assert asked == [(False, 0)] and Job.objects.count() == 1


def test_a_job_is_never_saved_otherwise_than_slurm_was_asked_about_it(alice, cluster, monkeypatch):
    # An admin's change while Slurm answers (here the partitions, so the default is another):
    # the checks under the transaction place the job elsewhere than the one Slurm said yes to.
    asked = []

    def slurm_says_yes(*, user, fields):  # type: ignore[no-untyped-def]
        asked.append(fields["partition"])
        SlurmCluster.objects.filter(server=cluster).update(partitions="long,gpu")

    monkeypatch.setattr("jobs.submit.slurm_submit_check", slurm_says_yes)
    response = post(alice, server="cluster-a", gpu_count=1)
    assert asked == ["gpu"]
    assert response.status_code == 409 and "changed while" in response.json()["detail"], response.json()
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        ({"partition": "debug", "gpu_count": 1}, "partition", "choose one of gpu, long"),
        ({"gpu_count": 5}, "gpu_count", "at most 4"),
        ({}, "gpu_count", "how many GPUs"),
        ({"gpu_count": 1, "array": "0-3"}, "array", "not sent to Slurm"),
        ({"gpu_count": 1, "time_limit_minutes": 0}, "time_limit_minutes", "at least 1 minute"),
        ({"gpu_count": 1, "time_limit_minutes": 10**9}, "time_limit_minutes", "at most 525600 minutes"),
        ({"gpu_count": 1, "partition": "--uid=0"}, "partition", "not a partition name"),
    ],
)
def test_a_bad_submit_is_a_400_naming_the_field_and_writes_nothing(alice, cluster, data, field, words):
    response = post(alice, server="cluster-a", **data)
    assert response.status_code == 400
    assert words in " ".join(response.json()["errors"][field])
    assert not Job.objects.exists()


def test_a_partition_on_a_gpu_host_says_what_it_is_for(alice, cluster):
    response = post(alice, gpu_count=1, partition="gpu")
    assert response.status_code == 400 and "Slurm cluster" in response.json()["errors"]["partition"][0]


def test_the_portal_never_books_or_queues_onto_a_clusters_cards(alice, cluster):
    soon = timezone.now() + timedelta(hours=1)
    with pytest.raises(ServiceError, match="Slurm schedules its cards"):
        reservation_create(
            user=alice, gpus=["slurm:cluster-a:vm:2"], start=soon, end=soon + timedelta(hours=1)
        )
    with pytest.raises(ServiceError):  # picked by the portal: none of the cluster's is a candidate
        reservation_create(user=alice, count=1, start=soon, end=soon + timedelta(hours=1))
    Server.objects.filter(pk=cluster.pk).update(job_slots=4, job_slots_at=timezone.now())  # a worker says so
    job = queue_job(alice, gpus=1)  # the queue's: it waits for a card of the portal's own
    schedule_pass()
    job.refresh_from_db()
    assert (job.status, job.server, job.reservation) == ("pending", None, None)


def test_the_batch_script_quotes_every_word_and_carries_nothing_of_the_workers(tmp_path):
    request = SlurmRequest(2, 30, "gpu", tmp_path / "out.log", reservation="r1")
    executor = SlurmExecutor(None, request)  # type: ignore[arg-type]
    nobody = pwd.getpwnam("nobody")
    spec = RunSpec(
        ["python3", "-u", "x.py", "$(rm -rf ~)", "a b"], {"X": "it's"}, tmp_path, "portal-7", nobody
    )
    script = executor.batch_script(spec)
    assert script.endswith("exec /usr/bin/env 'X=it'\"'\"'s' python3 -u x.py '$(rm -rf ~)' 'a b'\n")
    args = executor.sbatch_args(spec)
    assert "--export=NIL" in args and f"--uid={nobody.pw_uid}" in args
    assert {"--gres=gpu:2", "--time=30", "--partition=gpu", "--reservation=r1"} <= set(args)
    assert args[-1] == "--open-mode=append"  # the script comes on stdin, never from a file


@pytest.mark.parametrize("shell", [["/bin/sh"], ["bash", "--posix"]], ids=["sh", "bash-posix"])
def test_a_carriage_return_or_a_shells_own_name_in_the_env_reaches_the_job(tmp_path, shell):
    """sbatch refuses a script with CR LF in it ("Batch script contains DOS line breaks"), and the
    submit's own check let such a value through (a value pasted from a Windows editor): the job
    failed in sbatch. And where /bin/sh is bash (RHEL's), `export UID=5` ended the script before
    its command: UID is read-only there. The script holds no CR and assigns nothing now (env(1)
    sets the variables), and the job gets every value as it was given."""
    executor = SlurmExecutor(None, SlurmRequest(1, None, "", tmp_path / "out.log"))  # type: ignore[arg-type]
    argv = ["/bin/sh", "-c", 'printf "%s|%s|%s" "$X" "$UID" "$1"', "sh", "x\ry\r"]
    script = executor.batch_script(RunSpec(argv, {"X": "a\r\nb'c", "UID": "5"}, tmp_path, "portal-7", None))
    assert "\r" not in script
    ran = subprocess.run(shell, input=script.encode(), capture_output=True, check=True)
    assert ran.stdout == b"a\r\nb'c|5|x\ry\r"


def test_it_reads_slurms_exit_codes_states_and_completion_log(tmp_path):
    assert exit_of("3:0") == RunEnd(code=3) and exit_of("0:9") == RunEnd(signal=9)
    assert state_of({"JobState": "TIMEOUT", "ExitCode": "0:15"}).status == "timed_out"
    assert state_of({"JobState": "COMPLETED", "ExitCode": "1:0"}).status == "failed"
    pending = state_of({"JobState": "PENDING", "Reason": "Resources"})
    assert (pending.ended, pending.reason) == (False, "Resources")
    log = tmp_path / "jobcomp.txt"
    log.write_text(
        "JobId=7 UserId=nobody(65534) JobState=FAILED ExitCode=2:0 NodeList=vm\n"
        "JobId=8 UserId=nobody(65534) JobState=COMPLETED ExitCode=0:0 NodeList=vm\n"
    )
    found = jobcomp_find(str(log), "7")
    assert found is not None and state_of(found, forgotten=True).exit == RunEnd(code=2)
    assert jobcomp_find(str(log), "9") is None and jobcomp_find(str(tmp_path / "none"), "7") is None


def test_the_dashboard_shows_a_clusters_nodes_their_state_and_which_job_holds_each_card(
    alice, cluster, client
):
    client.force_login(alice)
    page = client.get("/").content.decode()
    assert "Slurm cluster" in page and "whole nodes only" in page
    assert 'data-node="gpu02"' in page and "node-drained" in page and "Kill task failed" in page
    assert "gpu02:2" in page and "Slurm job 3" in page and "free in Slurm" in page
    assert "?server=cluster-a&amp;gpu=" not in page  # no card of it is booked alone


def test_the_api_books_whole_nodes_of_a_cluster_and_nothing_less(alice, cluster):
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    api = APIClient()
    api.force_authenticate(alice)
    made = api.post("/api/v1/reservations/", {"server": "cluster-a", "nodes": ["vm"]}, format="json")
    assert made.status_code == 201, made.json()
    assert len(made.json()["allocations"]) == 4 and made.json()["slurm_reservation"] == ""  # the worker's
    mixed = api.post(
        "/api/v1/reservations/", {"server": "cluster-a", "nodes": ["vm"], "count": 1}, format="json"
    )
    assert mixed.status_code == 400 and "whole nodes" in mixed.json()["errors"]["count"][0]
    down = api.post("/api/v1/reservations/", {"server": "cluster-a", "nodes": ["cpu01"]}, format="json")
    assert down.status_code == 400 and "down in Slurm" in down.json()["errors"]["nodes"][0]
    again = api.post("/api/v1/reservations/", {"server": "cluster-a", "nodes": ["vm"]}, format="json")
    assert again.status_code == 409  # its cards are booked: the same rule as any booking


def test_a_job_on_a_booking_of_whole_nodes_goes_to_slurm_without_naming_the_cluster(alice, cluster):
    """The booking says where: its job is Slurm's, with its GPU count and partition, never the
    portal's run on every card of the booking's nodes."""
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    booking = slurm_nodes_book(user=alice, server="cluster-a", nodes=["vm", "gpu02"])
    response = post(alice, reservation=booking.pk, gpu_count=2, partition="long")
    assert response.status_code == 201, response.json()
    job = Job.objects.get(pk=response.json()["id"])
    assert (job.server, job.reservation, job.gpu_count, job.gpu_uuids, job.partition) == (
        cluster,
        booking,
        2,
        [],
        "long",
    )
    response = post(alice, reservation=booking.pk)
    assert response.status_code == 400 and "how many GPUs" in response.json()["errors"]["gpu_count"][0]
    assert Job.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_gpu_run_and_book_reach_a_cluster_as_the_cli_sends_them(
    portal,  # noqa: F811
    alice,
    cluster,
    tmp_path,
    monkeypatch,
):
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    result = gpu(
        "run", str(script), "--server", "cluster-a", "--gpus", "2", "--partition", "long", "--time", "1h"
    )
    assert result.exit_code == 0, result.output
    job = Job.objects.get()
    assert (job.server_id, job.gpu_count, job.partition, job.time_limit_minutes) == (
        cluster.pk,
        2,
        "long",
        60,
    )
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    result = gpu("book", "--server", "cluster-a", "--node", "vm", "--time", "2h")
    assert result.exit_code == 0, result.output
    assert Reservation.objects.get().allocations.count() == 4
    refused = gpu("book", "--server", "cluster-a", "--node", "vm", "--gpus", "1")
    assert refused.exit_code != 0 and "whole nodes" in refused.output
    booking = Reservation.objects.get()  # docs/slurm.md's: a job in it, with its GPU count
    result = gpu("run", str(script), "--server", "cluster-a", "--gpus", "4", "--reservation", str(booking.pk))
    assert result.exit_code == 0, result.output
    assert Job.objects.filter(reservation=booking, gpu_count=4, server=cluster).exists()
    monkeypatch.setattr("jobs.submit.slurm_submit_check", slurm_submit_check)  # no worker to answer
    monkeypatch.setattr("jobs.slurm.CHECK_MARGIN_SECONDS", 1)
    SlurmCluster.objects.filter(server=cluster).update(command_timeout_seconds=0)
    result = gpu("run", str(script), "--server", "cluster-a", "--gpus", "1")
    assert result.exit_code == 3 and "The worker of cluster-a did not answer within 1 s" in result.output
    assert "may or may not be done" not in result.output and Job.objects.count() == 2
    redis.Redis.from_url(settings.REDIS_URL).delete(check_key("cluster-a"))


def test_the_output_is_read_only_from_a_plain_file_of_the_jobs_own_account(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("root's\n")
    mine = tmp_path / "mine.log"
    mine.write_text("line 1\n")
    assert FileOutput(mine, uid=os.getuid()).read() == b"line 1\n"
    link = tmp_path / "link.log"
    link.symlink_to(secret)
    for path, uid in ((link, os.getuid()), (secret, os.getuid() + 1)):
        output = FileOutput(path, uid=uid)
        assert output.read() == b"" and output.refused  # never read, and said why
    assert FileOutput(tmp_path / "not-yet.log").read() == b""  # the job has not started: nothing yet


def test_the_output_is_read_again_after_a_truncation_and_never_past_what_the_log_keeps(tmp_path):
    path = tmp_path / "out.log"
    path.write_bytes(b"first try, a long line\n")
    output = FileOutput(path, uid=os.getuid(), keep=1 << 20)
    assert output.read() == b"first try, a long line\n"
    path.write_bytes(b"again\n")  # the job's `: > out.log`: cut, and written anew
    assert output.read() == b"again\n" and "read again from its start" in output.notes.pop()
    os.truncate(path, 1 << 40)  # a terabyte, sparse: only the last `keep` bytes are read
    assert len(b"".join(iter(output.read, b""))) == 1 << 20
    assert output.notes == [
        f"{(1 << 40) - 6 - (1 << 20):,} bytes of its output skipped: more than its log keeps"
    ]


def test_the_follower_reads_a_slice_of_the_output_each_tick_and_the_rest_at_the_end(
    alice, cluster, tmp_path, monkeypatch
):
    monkeypatch.setattr(slurm_runner, "TAKE_MAX", 4096)  # Slurm is asked between slices
    job = Job.objects.get(pk=post(alice, server="cluster-a", gpu_count=1).json()["id"])
    path = tmp_path / "out.log"
    path.write_bytes(b"line\n" * 4096)
    output, follower = FileOutput(path, uid=os.getuid()), slurm_runner.SlurmFollower(job)
    follower._take(output)
    assert output.offset == 4096
    follower._take(output, to_end=True)
    assert output.offset == path.stat().st_size


def _fake_slurm(  # type: ignore[no-untyped-def]
    folder, squeue_says: str = "", *, sbatch: str = "exec sleep 5", state: str = "COMPLETED"
) -> None:
    """sbatch that takes the job and then (by default) does not answer in time; squeue and
    scontrol that do, the job in `state`."""
    folder.mkdir()
    scripts = {
        "sbatch": f'cat > /dev/null\necho "$@" > {folder}/sbatch.args\n{sbatch}\n',
        "squeue": f"echo \"$@\" > {folder}/squeue.args\necho '{squeue_says}'\n",
        "scontrol": 'case "$2" in\n'
        f"job) echo 'JobId=4242 JobState={state} Reason=None ExitCode=0:0 NodeList=vm' ;;\n"
        "partition) echo 'PartitionName=gpu Default=YES RootOnly=NO' ;;\n"
        "esac\n",
    }
    for name, body in scripts.items():
        (folder / name).write_text("#!/bin/sh\n" + body)
        (folder / name).chmod(0o755)


@pytest.mark.parametrize(("squeue_says", "status"), [("4242", "succeeded"), ("", "failed")])
def test_a_job_sbatch_took_without_answering_in_time_is_found_and_followed(
    alice, cluster, tmp_path, squeue_says, status
):
    """sbatch's answer lost is not its job lost: Slurm is asked for it by name and account, and a
    job it took is followed, never left running unseen (and a job it did not take ends failed)."""
    _fake_slurm(tmp_path / "bin", squeue_says)
    SlurmCluster.objects.filter(server=cluster).update(
        bin_dir=str(tmp_path / "bin"), command_timeout_seconds=1
    )
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    job = Job.objects.get(pk=post(alice, server="cluster-a", gpu_count=1).json()["id"])
    assert slurm_runner.slurm_job_run(job.pk) == status
    job.refresh_from_db()
    assert job.slurm_job_id == squeue_says
    asked = (tmp_path / "bin" / "squeue.args").read_text().split()
    assert f"--name={slurm_job_name(job.pk)}" in asked and f"--user={pwd.getpwnam('nobody').pw_uid}" in asked
    if status == "failed":
        assert "Slurm did not answer" in job.message


def test_a_job_slurm_keeps_in_a_state_the_portal_does_not_know_ends_lost_saying_so(alice, cluster, tmp_path):
    """Not followed for ever: after SLURM_LOST_AFTER_SECONDS it is lost, with what Slurm last
    said and when, in its log, its owner's end notice and the audit log."""
    _fake_slurm(tmp_path / "bin", sbatch="echo 4242", state="REVOKED")
    SlurmCluster.objects.filter(server=cluster).update(bin_dir=str(tmp_path / "bin"))
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    job = Job.objects.get(pk=post(alice, server="cluster-a", gpu_count=1).json()["id"])
    with override_settings(SLURM_LOST_AFTER_SECONDS=1):
        assert slurm_runner.slurm_job_run(job.pk) == "lost"
    job.refresh_from_db()
    assert job.message.startswith("Lost: Slurm has named a state the portal does not know for")
    assert "Slurm last said REVOKED at" in job.message and "Slurm job 4242 may still run there" in job.message
    log = job_log(job.pk)
    assert "Slurm says the job is REVOKED, a state the portal does not know" in log and job.message in log
    assert AuditEntry.objects.get(action=AuditEntry.Action.JOB_LOST).data["slurm_job"] == "4242"
    assert job.message in Notification.objects.get(user=alice, kind=Notification.Kind.JOB_FAILED).body


def test_the_reconciler_gives_a_slurm_job_the_clusters_cut_off_before_it_is_lost(alice, cluster):
    """Slurm runs the job on while its cluster's worker is away, and a restarted worker follows
    it again: only after SLURM_LOST_AFTER_SECONDS without a beat is it lost."""
    job = Job.objects.get(pk=post(alice, server="cluster-a", gpu_count=1).json()["id"])
    beat = timezone.now() - timedelta(seconds=settings.JOB_LOST_AFTER_SECONDS + 30)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, slurm_job_id="77", heartbeat_at=beat)
    assert runs_lost_mark()["lost"] == 0
    beat = timezone.now() - timedelta(seconds=settings.SLURM_LOST_AFTER_SECONDS + 30)
    Job.objects.filter(pk=job.pk).update(heartbeat_at=beat)
    assert runs_lost_mark()["lost"] == 1
    job.refresh_from_db()
    assert job.status == "lost" and "Slurm job 77 may still run there" in job.message


@pytest.mark.parametrize(
    ("said", "field"),
    [
        ("Access denied to requested reservation", "reservation"),
        ("invalid partition specified: debug; Invalid partition name specified", "partition"),
        ("Invalid account or account/partition combination specified", "account"),
        ("Invalid generic resource (gres) specification", "gpu_count"),
        ("Requested time limit is invalid (missing or exceeds some limit)", "time_limit_minutes"),
        ("Job violates accounting/QOS policy (job submit limit, user's size and/or time limits)", "server"),
    ],
)
def test_slurms_refusal_goes_beside_the_field_its_words_are_about(cluster, said, field):
    with pytest.raises(Invalid) as refused:
        answer_check(cluster, {"refused": said, "slurm": True})
    assert refused.value.field == field
    assert refused.value.message == f"Slurm on cluster-a refused the job: {said}. {FIXES[field]}"


def test_a_cluster_whose_worker_does_not_answer_is_a_503_naming_the_server_and_nothing_is_written(
    alice, cluster, client, monkeypatch
):
    monkeypatch.setattr("jobs.submit.slurm_submit_check", slurm_submit_check)  # asked for real
    monkeypatch.setattr("jobs.slurm.CHECK_MARGIN_SECONDS", 1)
    SlurmCluster.objects.filter(server=cluster).update(command_timeout_seconds=0)  # 1 s in all
    questions = redis.Redis.from_url(settings.REDIS_URL)
    questions.delete(check_key("cluster-a"))
    response = post(alice, server="cluster-a", gpu_count=2, partition="long")
    assert response.status_code == 503 and response["Retry-After"] == str(settings.OUTAGE_RETRY_AFTER_SECONDS)
    assert "The worker of cluster-a did not answer within 1 s" in response.json()["errors"]["server"][0]
    asked = json.loads(questions.lpop(check_key("cluster-a")))  # as the worker would take it
    assert (asked["user"], asked["gpus"], asked["partition"], asked["booking"]) == (alice.pk, 2, "long", None)
    client.force_login(alice)
    form = {**job_form_data(None), "reservation": "", "server": "cluster-a", "gpu_count": "1"}
    page = client.post(
        reverse("job_new"), {**form, "script": _upload("t.py", b"print(1)\n", "text/x-python")}
    )
    assert page.status_code == 200 and "did not answer" in page.context["form"].errors["server"][0]
    assert not Job.objects.exists()
    questions.delete(check_key("cluster-a"))


@pytest.mark.parametrize(("squeue_says", "status"), [("4242", "succeeded"), ("", "lost")])
def test_a_restarted_worker_finds_a_job_whose_sbatch_it_did_not_see_answered(
    alice, cluster, tmp_path, squeue_says, status
):
    """Its previous worker died between sbatch and its answer: Slurm is asked for the job by its
    name, and a job it has is followed to its end; none, and the job is lost, saying so."""
    _fake_slurm(tmp_path / "bin", squeue_says)
    SlurmCluster.objects.filter(server=cluster).update(bin_dir=str(tmp_path / "bin"))
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    job = Job.objects.get(pk=post(alice, server="cluster-a", gpu_count=1).json()["id"])
    Job.objects.filter(pk=job.pk).update(status=Job.Status.STARTING)  # claimed by the worker that died
    assert slurm_runner.slurm_jobs_resume("cluster-b") == []
    assert slurm_runner.SlurmFollower(Job.objects.get(pk=job.pk)).resume() == status
    job.refresh_from_db()
    assert (job.status, job.slurm_job_id) == (status, squeue_says)
    if status == "lost":
        assert (
            job.message
            == f"Lost: its worker stopped while sending it to Slurm, which has no {slurm_job_name(job.pk)}."
        )


def test_no_job_folder_is_made_in_a_jobs_folder_others_may_change(alice, cluster, tmp_path):
    """There another account could swap <folder>/<account> for a link between root's check and
    its mkdir: docs/slurm.md's root's 755 is checked before anything is made."""
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    tmp_path.chmod(0o777)
    job = Job.objects.get(pk=post(alice, server="cluster-a", gpu_count=1).json()["id"])
    assert slurm_runner.slurm_job_run(job.pk) == "failed"
    job.refresh_from_db()
    assert "writable by root only" in job.message and not (tmp_path / "nobody").exists()


def test_a_booking_is_never_reserved_for_an_account_slurm_would_read_as_several(alice, cluster):
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    booking = slurm_nodes_book(user=alice, server="cluster-a", nodes=["vm"])
    Profile.objects.filter(user=alice).update(unix_account="alice,root")
    calls = []
    commands = type("Recording", (), {"run": lambda self, *args, **kw: calls.append(args)})()
    assert slurm_reservations_sync(server=cluster, commands=commands)["refused"] == 1
    booking.refresh_from_db()
    assert not calls and "'alice,root' is no account name" in booking.slurm_error


@pytest.mark.parametrize("kind", ["jupyterlab", "shell"])
def test_no_session_opens_on_a_booking_of_slurm_nodes(alice, cluster, kind):
    """A lab or a shell would run on the login node, with cards that are on Slurm's nodes."""
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    booking = slurm_nodes_book(user=alice, server="cluster-a", nodes=["vm"])
    with pytest.raises(Invalid, match="gpu run --server cluster-a") as refused:
        session_start(user=alice, reservation=booking.pk, kind=kind, host="cluster-a", command=["bash"])
    assert refused.value.field == "reservation" and not InteractiveSession.objects.exists()


def test_a_count_or_an_extension_on_a_cluster_is_refused_naming_the_field_and_the_fix(alice, cluster):
    soon = timezone.now() + timedelta(hours=1)
    with pytest.raises(Invalid, match="book whole nodes of it") as refused:
        reservation_create(user=alice, count=1, server="cluster-a", start=soon, end=soon + timedelta(hours=1))
    assert refused.value.field == "server"
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    booking = slurm_nodes_book(
        user=alice, server="cluster-a", nodes=["vm"], start=soon, end=soon + timedelta(hours=1)
    )
    with pytest.raises(Invalid, match="book the nodes again from its end") as refused:
        reservation_extend(user=alice, reservation=booking, end=soon + timedelta(hours=2))
    assert refused.value.field == "end"
    booking.refresh_from_db()
    assert booking.end == soon + timedelta(hours=1)


class _Scontrol:
    """scontrol as the worker's pass meets it: each call answers as `says` tells, in turn."""

    def __init__(self, *says: Exception | str) -> None:
        self.says, self.calls = list(says), []

    def run(self, command, args, **kw):  # type: ignore[no-untyped-def]
        self.calls.append(args)
        said = self.says.pop(0) if self.says else ""
        if isinstance(said, Exception):
            raise said
        return said

    def show(self, thing, *args):  # type: ignore[no-untyped-def]
        return self.run("scontrol", ["show", thing, *args, "-o"])


def test_a_reservation_made_stays_recorded_when_slurm_stops_answering_later_in_the_pass(alice, cluster):
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    first = slurm_nodes_book(user=alice, server="cluster-a", nodes=["vm"])
    second = slurm_nodes_book(user=alice, server="cluster-a", nodes=["gpu02"])
    scontrol = _Scontrol("", SlurmUnreachable("scontrol did not answer within 10 s"))
    with transaction.atomic():  # as the worker's pass runs it
        assert slurm_reservations_sync(server=cluster, commands=scontrol)["made"] == 1
    first.refresh_from_db(), second.refresh_from_db()
    made = [b.slurm_reservation == reservation_name(b.pk) for b in (first, second)]
    assert sorted(made) == [False, True] and first.slurm_error == second.slurm_error == ""  # one tried again


def test_a_reservation_slurm_already_holds_under_its_name_is_the_bookings(alice, cluster):
    """Made by a pass whose answer or record was lost: ours (the name is the booking's)."""
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    booking = slurm_nodes_book(user=alice, server="cluster-a", nodes=["vm"])
    overlaps = SlurmRefused("Error creating the reservation: Requested reservation overlaps with another")
    held = f"ReservationName={reservation_name(booking.pk)} StartTime=now Nodes=vm Users=nobody\n"
    assert slurm_reservations_sync(server=cluster, commands=_Scontrol(overlaps, held))["made"] == 1
    booking.refresh_from_db()
    assert (booking.slurm_reservation, booking.slurm_error) == (reservation_name(booking.pk), "")
    other = slurm_nodes_book(user=alice, server="cluster-a", nodes=["gpu02"])  # Slurm holds none for it
    gone = SlurmRefused(f"Reservation {reservation_name(other.pk)} not found")
    assert slurm_reservations_sync(server=cluster, commands=_Scontrol(overlaps, gone))["refused"] == 1
    other.refresh_from_db()
    assert other.slurm_reservation == "" and "overlaps with another" in other.slurm_error


def test_a_booking_is_never_reserved_for_a_system_account(alice, cluster):
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    booking = slurm_nodes_book(user=alice, server="cluster-a", nodes=["vm"])
    Profile.objects.filter(user=alice).update(unix_account="root")
    scontrol = _Scontrol()
    assert slurm_reservations_sync(server=cluster, commands=scontrol)["refused"] == 1
    booking.refresh_from_db()
    assert not scontrol.calls and "system account" in booking.slurm_error


def test_an_admin_adds_a_cluster_and_its_settings_on_the_server_page(client, admin_user, tmp_path):
    client.force_login(admin_user)
    form = {
        "name": "cluster-b",
        "hostname": "",
        "kind": "slurm",
        "cpu_count": 0,
        "ram_mb": 0,
        "slurm-TOTAL_FORMS": 1,
        "slurm-INITIAL_FORMS": 0,
        "slurm-0-bin_dir": "usr/bin",
        "slurm-0-slurm_conf": "/etc/slurm/slurm.conf",
        "slurm-0-partitions": "gpu, long",
        "slurm-0-job_root": str(tmp_path),
        "slurm-0-command_timeout_seconds": 10,
        "slurm_nodes-TOTAL_FORMS": 0,
        "slurm_nodes-INITIAL_FORMS": 0,
        "gpus-TOTAL_FORMS": 0,
        "gpus-INITIAL_FORMS": 0,
    }
    refused = client.post("/admin/gpus/server/add/", form)
    assert refused.status_code == 200 and "Give an absolute path, e.g. /usr/bin." in refused.content.decode()
    assert not Server.objects.filter(name="cluster-b").exists()
    slashed = client.post(
        "/admin/gpus/server/add/", {**form, "slurm-0-bin_dir": "/usr/bin", "slurm-0-job_root": "/shared/a\\b"}
    )
    assert "Slurm drops a backslash from a job&#x27;s output path" in slashed.content.decode()
    assert not Server.objects.filter(name="cluster-b").exists()
    made = client.post("/admin/gpus/server/add/", {**form, "slurm-0-bin_dir": "/usr/bin"})
    assert made.status_code == 302, made.content.decode()[-3000:]
    cluster = SlurmCluster.objects.get(server__name="cluster-b")
    assert cluster.server.kind == "slurm" and cluster.partition_list == ["gpu", "long"]
    assert client.get(f"/admin/gpus/server/{cluster.server.pk}/change/").status_code == 200


def test_the_job_form_sends_a_job_to_a_cluster_and_shows_refusals_beside_their_fields(alice, cluster, client):
    client.force_login(alice)
    form = {
        **job_form_data(None),
        "reservation": "",
        "server": "cluster-a",
        "gpu_count": "2",
        "partition": "long",
    }
    made = client.post(
        reverse("job_new"), {**form, "script": _upload("train.py", b"print(1)\n", "text/x-python")}
    )
    assert made.status_code == 302
    assert Job.objects.values_list("server__name", "gpu_count", "partition").get() == ("cluster-a", 2, "long")
    for field, value, words in (
        ("partition", "debug", "choose one of gpu, long"),
        ("memory", "8G", "whole cards"),
    ):
        refused = client.post(
            reverse("job_new"),
            {**form, field: value, "script": _upload("train.py", b"print(1)\n", "text/x-python")},
        )
        assert refused.status_code == 200
        assert any(words in e for e in refused.context["form"].errors.get(field, [])), refused.context[
            "form"
        ].errors
    assert Job.objects.count() == 1


def test_two_portals_on_one_cluster_never_take_each_others_reservation(alice, cluster, settings):
    """Both number their bookings from 1. Before, the second's create was refused as an overlap,
    `_held` found `portal-1` and took it for its own, then deleted it at its own booking's end."""
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    booking = slurm_nodes_book(user=alice, server="cluster-a", nodes=["vm"])
    settings.PORTAL_INSTANCE_ID = "the-other-lab"
    theirs = reservation_name(booking.pk)
    settings.PORTAL_INSTANCE_ID = "this-lab"
    assert theirs != reservation_name(booking.pk)
    overlaps = SlurmRefused("Error creating the reservation: Requested reservation overlaps with another")
    held = f"ReservationName={theirs} StartTime=now Nodes=vm Users=nobody\n"
    assert slurm_reservations_sync(server=cluster, commands=_Scontrol(overlaps, held))["refused"] == 1
    booking.refresh_from_db()
    assert booking.slurm_reservation == "" and "overlaps with another" in booking.slurm_error


def test_a_command_whose_path_has_an_equals_sign_is_refused_not_misread_by_env(tmp_path):
    """env(1) takes every leading word with '=' for a variable: `env X=1 /opt/py=3/bin/python -u
    ...` ran `-u` ("env: '-u': No such file or directory", 127) where `export X=1; exec ...` ran the
    interpreter. JOB_INTERPRETERS=default=/opt/py=3/bin/python is a valid setting (env_pairs splits
    at the first '='). The script is refused rather than written to run something else."""
    folder = tmp_path / "py=3"
    folder.mkdir()
    (folder / "python3").symlink_to(sys.executable)
    executor = SlurmExecutor(None, SlurmRequest(1, None, "", tmp_path / "out.log"))  # type: ignore[arg-type]
    spec = RunSpec([str(folder / "python3"), "-c", "print('ran')"], {"X": "1"}, tmp_path, "portal-7", None)
    before = subprocess.run(["/usr/bin/env", "X=1", *spec.argv], capture_output=True)  # the script's line
    assert before.returncode == 127 and b"ran" not in before.stdout, before
    with pytest.raises(ValueError, match="'='"):
        executor.batch_script(spec)

"""The Slurm tier (issue 37): jobs on a real single-node Slurm 22.05 cluster (tests/slurm_cluster.py,
started once per test process), submitted by the portal's service as two users (Slurm asked
first by the cluster worker's check, jobs/host/slurm_checks.py, a thread here), followed by the
cluster worker's follower (jobs/host/slurm_runner.py, in a thread here), read back from the
portal's pages. Every test cancels its Slurm jobs before it ends; the cluster's teardown cancels
whatever is left before it stops the daemons."""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import connection
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone

from gpus.booking import reservation_cancel, reservation_create, reservation_release
from gpus.inventory import BackendUnavailable
from gpus.models import GPU, Reservation, Server, SlurmCluster, SlurmNode
from gpus.services import servers_report_ingest
from gpus.slurm_booking import reservation_name, slurm_nodes_book, slurm_reservations_sync
from gpus.slurm_cli import SlurmRefused
from gpus.slurm_inventory import SlurmBackend
from jobs.host.executors.slurm import FileOutput, SlurmExecutor, SlurmRequest, SlurmRun, slurm_job_name
from jobs.host.slurm_checks import SlurmSubmitChecks
from jobs.host.slurm_runner import slurm_job_run
from jobs.models import Job
from jobs.services import job_cancel
from jobs.submit import ScriptUpload, job_submit
from portal.errors import Invalid, Unavailable
from portal.models import AuditEntry, Notification, Profile
from portal.pids import ProcessId
from tests.factories import MembershipFactory, TeamFactory, UserFactory
from tests.job_helpers import job_log
from tests.slurm_cluster import Cluster, slurm_cluster  # noqa: F401 - the session's cluster
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)  # the follower runs in a thread of its own

HOUR = timedelta(hours=1)
FOLLOWERS: list[threading.Thread] = []
SHOW = b"""import os, pwd
print("who", pwd.getpwuid(os.getuid()).pw_name, "gpus", os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
"""
COUNT = b"""import time
for i in range(60):
    print("line", i, flush=True)
    time.sleep(0.1)
"""
TICKS = b"""import sys, time
for i in range(600):
    print("tick", i, flush=True)
    time.sleep(0.1)
"""


@pytest.fixture
def cluster(slurm_cluster: Cluster) -> Iterator[Cluster]:  # noqa: F811
    server = Server.objects.create(name="cluster-a", kind=Server.Kind.SLURM)
    SlurmCluster.objects.create(
        server=server,
        slurm_conf=str(slurm_cluster.conf),
        job_root=str(slurm_cluster.job_root),
        command_timeout_seconds=2,
    )
    checks = SlurmSubmitChecks("cluster-a")  # the worker's answers to job_submit's question
    checks.start()
    try:
        # This process is the cluster's worker (its claim: jobs.host.launch.job_claim).
        with override_settings(JOB_INTERPRETERS={"default": "/usr/bin/python3"}, WORKER_SERVER="cluster-a"):
            yield slurm_cluster
    finally:
        checks.stop()
        checks.join(10)
    slurm_cluster.ctld.send_signal(signal.SIGCONT)
    slurm_cluster.controller_start()
    slurm_cluster.cancel_all()
    for thread in FOLLOWERS:  # each ends with its job, before the database is emptied
        thread.join(30)
    FOLLOWERS.clear()


@pytest.fixture
def people() -> tuple:
    """alice runs as `nobody`, bob as `slurm`: two Unix accounts every Slurm install has."""
    team = TeamFactory(slug="lab")
    alice, bob = UserFactory(username="alice"), UserFactory(username="bob")
    for user, unix in ((alice, "nobody"), (bob, "slurm")):
        MembershipFactory(user=user, team=team)
        Profile.objects.update_or_create(user=user, defaults={"unix_account": unix})
    return alice, bob


def submit(user, script: bytes, gpus: int, **kwargs) -> Job:  # type: ignore[no-untyped-def]
    return job_submit(
        user=user,
        server="cluster-a",
        gpu_count=gpus,
        script=ScriptUpload("run.py", script),
        time_limit_minutes=5,
        **kwargs,
    )


def follow(job: Job) -> threading.Thread:
    """The cluster worker's follower for `job`, as run_job runs it on the login node."""

    def run() -> None:
        try:
            slurm_job_run(job.pk)
        finally:
            connection.close()

    thread = threading.Thread(target=run, name=f"follow-{job.pk}", daemon=True)
    thread.start()
    FOLLOWERS.append(thread)
    return thread


def row(job: Job) -> Job:
    return Job.objects.get(pk=job.pk)


def ended(job: Job, timeout: float = 30) -> Job:
    return wait_for(lambda: (j := row(job)).is_finished and j, timeout, what=f"job {job.pk} ended")


def test_it_runs_jobs_as_two_users_on_the_gpus_they_asked_for(cluster, people):
    alice, bob = people
    jobs = [submit(alice, SHOW, 2), submit(bob, SHOW, 1)]
    for job in jobs:
        follow(job)
    done = [ended(job) for job in jobs]
    assert [j.status for j in done] == ["succeeded", "succeeded"]
    assert all(j.slurm_job_id and j.exit_code == 0 and j.slurm_state == "COMPLETED" for j in done)
    assert re.search(r"who nobody gpus \d,\d\n", job_log(done[0].pk))  # two cards, Slurm's pick
    assert re.search(r"who slurm gpus \d\n", job_log(done[1].pk))
    assert f"is Slurm job {done[0].slurm_job_id} on cluster-a" in job_log(done[0].pk)


def test_a_waiting_job_shows_slurms_reason_and_a_running_one_its_live_log_until_cancelled(
    cluster, people, client
):
    alice, bob = people
    first = submit(alice, TICKS, 4)
    follow(first)
    wait_for(  # Slurm's state is asked once a second, the log read five times as often
        lambda: "tick 3" in job_log(first.pk) and row(first).slurm_state == "RUNNING",
        30,
        what="live lines of the running job, and its state",
    )
    client.force_login(alice)
    page = client.get(reverse("job_detail", args=[first.pk])).content.decode()
    assert f"Slurm job {row(first).slurm_job_id}" in page and "RUNNING" in page
    tail = client.get(reverse("job_log_tail", args=[first.pk]))
    assert "tick 3" in b"".join(tail.streaming_content).decode()
    snapshot = SlurmBackend("cluster-a").snapshot()  # the inventory: every card held by the first
    assert {g.slurm_job for g in snapshot.gpus} == {row(first).slurm_job_id}
    assert [n.state for n in snapshot.nodes] == ["mixed"] or [n.state for n in snapshot.nodes] == [
        "allocated"
    ]

    second = submit(bob, SHOW, 1)
    follow(second)
    wait_for(lambda: row(second).slurm_reason == "Resources", 20, what="Slurm's pending reason")
    assert row(second).slurm_state == "PENDING" and row(second).status == "starting"

    job_cancel(user=alice, job=first)
    assert ended(first).status == "cancelled"
    assert row(first).message == "Cancelled by alice (scancel)."
    assert ended(second).status == "succeeded"  # its cards freed, it ran


def test_a_job_slurm_forgot_is_still_remembered(cluster, people):
    alice, _ = people
    job = submit(alice, SHOW, 1)
    follow(job)
    done = ended(job)
    commands = cluster.commands
    wait_for(lambda: _forgotten(commands, done.slurm_job_id), 30, what="Slurm to forget the job (MinJobAge)")
    again = row(job)
    assert (again.status, again.exit_code, again.slurm_job_id) == ("succeeded", 0, done.slurm_job_id)
    # And a follower that comes back after Slurm forgot it reads its end from the completion log.
    request = SlurmRequest(
        1, None, "", cluster.folder / "x", cluster.folder / "x", jobcomp=str(cluster.jobcomp)
    )
    run = SlurmRun("again", ProcessId(0, -1.0), 0, FileOutput(cluster.folder / "x"), job_id=done.slurm_job_id)
    state = SlurmExecutor(commands, request).state(run)
    assert (state.forgotten, state.status, state.exit.returncode) == (True, "succeeded", 0)


def _forgotten(commands, job_id: str) -> bool:  # type: ignore[no-untyped-def]
    try:
        commands.show("job", job_id)
    except SlurmRefused as exc:
        return "Invalid job id" in str(exc)
    return False


def test_slurms_refusal_is_a_field_error_in_its_own_words_and_nothing_is_written(cluster, people):
    """Slurm is asked before the job is written (sbatch --test-only as its owner, by the
    cluster's worker): an unknown partition, a booking whose reservation is not the account's."""
    alice, bob = people
    with pytest.raises(Invalid) as refused:
        submit(alice, SHOW, 1, partition="nosuch")
    assert refused.value.field == "partition" and "Invalid partition name specified" in refused.value.message
    server = Server.objects.get(name="cluster-a")
    servers_report_ingest(snapshots=[SlurmBackend("cluster-a").snapshot()])
    booking = slurm_nodes_book(
        user=alice, server="cluster-a", nodes=[cluster.node], end=timezone.now() + HOUR
    )
    assert slurm_reservations_sync(server=server, commands=cluster.commands)["made"] == 1  # for nobody
    try:
        Profile.objects.filter(user=bob).update(unix_account=None)
        Profile.objects.filter(user=alice).update(unix_account="slurm")  # her account changed since
        with pytest.raises(Invalid) as refused:
            submit(alice, SHOW, 1, reservation=booking.pk)
        assert refused.value.field == "reservation"
        assert "refused the job: Access denied to requested reservation" in refused.value.message
        assert not Job.objects.exists()
    finally:
        reservation_release(user=alice, reservation=booking)
        assert slurm_reservations_sync(server=server, commands=cluster.commands)["removed"] == 1
    SlurmCluster.objects.filter(server__name="cluster-a").update(partitions="gpu,other")
    with pytest.raises(Invalid) as refused:  # the portal's own, before Slurm is asked
        submit(alice, SHOW, 1, partition="nosuch")
    assert refused.value.field == "partition" and "choose one of gpu, other" in refused.value.message


def test_a_partition_only_root_may_use_is_refused_before_roots_sbatch_could_take_it(cluster, people):
    """Slurm takes a RootOnly partition's job from root's sbatch (--uid) and holds it for ever
    (PartitionConfig), and its --test-only says yes: the worker refuses it first, in the
    cluster's default partition too."""
    alice, _ = people
    with pytest.raises(Invalid, match="partition admin takes root's jobs only") as refused:
        submit(alice, SHOW, 1, partition="admin")
    assert refused.value.field == "partition"
    cluster.commands.run("scontrol", ["update", "PartitionName=admin", "Default=YES"])
    try:
        with pytest.raises(Invalid, match="partition admin takes root's jobs only"):
            submit(alice, SHOW, 1)
    finally:
        cluster.commands.run("scontrol", ["update", "PartitionName=gpu", "Default=YES"])
    assert not Job.objects.exists()


def test_a_job_cancelled_while_slurm_keeps_it_waiting_ends_cancelled(cluster, people):
    alice, bob = people
    first = submit(alice, TICKS, 4)
    follow(first)
    wait_for(lambda: row(first).slurm_state == "RUNNING", 20, what="the first job running")
    waiting = submit(bob, SHOW, 1)
    follow(waiting)
    wait_for(lambda: row(waiting).slurm_reason == "Resources", 20, what="the second one waiting")
    job_cancel(user=bob, job=waiting)
    done = ended(waiting)
    assert (done.status, done.message, done.started_at) == ("cancelled", "Cancelled by bob (scancel).", None)
    assert row(first).status == "running"
    job_cancel(user=alice, job=first)
    assert ended(first).status == "cancelled"


def test_a_cluster_that_stops_answering_goes_offline_and_its_jobs_say_so(cluster, people):
    alice, _ = people
    job = submit(
        alice, b"import time\nprint('start', flush=True)\ntime.sleep(4)\nprint('done', flush=True)\n", 1
    )
    follow(job)
    wait_for(lambda: row(job).status == "running", 20, what="the job running")
    cluster.ctld.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(BackendUnavailable, match="does not answer"):
            SlurmBackend("cluster-a").snapshot()  # no telemetry: the server goes offline
        wait_for(lambda: "does not answer" in job_log(job.pk), 20, what="the job's log saying so")
        assert row(job).slurm_reason.startswith("The cluster does not answer")
    finally:
        cluster.ctld.send_signal(signal.SIGCONT)
    done = ended(job, 40)
    assert done.status == "succeeded"
    assert "the cluster answers again" in job_log(job.pk) and "done" in job_log(job.pk)


def test_a_cluster_stopped_past_its_cut_off_ends_its_jobs_lost_and_takes_no_new_one(cluster, people):
    """Its controller stopped (the job runs on under slurmd): new jobs are a 503 naming the
    cluster, and a job followed gets SLURM_LOST_AFTER_SECONDS before it ends lost, saying what
    Slurm last said and when, in its log, its owner's notice and the audit log."""
    alice, _ = people
    job = submit(alice, TICKS, 1)
    follow(job)
    wait_for(lambda: "tick 2" in job_log(job.pk) and row(job).status == "running", 30, what="the job running")
    cluster.controller_stop()
    try:
        with override_settings(SLURM_LOST_AFTER_SECONDS=2):
            with pytest.raises(Unavailable, match="Slurm cluster cluster-a does not answer") as refused:
                submit(alice, SHOW, 1)
            assert refused.value.field == "server" and refused.value.status == 503
            done = ended(job)
    finally:
        cluster.controller_start()
    assert done.status == "lost" and Job.objects.count() == 1
    assert done.message.startswith("Lost: Slurm cluster cluster-a has not answered since")
    assert "Slurm last said RUNNING at" in done.message and done.message in job_log(job.pk)
    assert AuditEntry.objects.filter(action=AuditEntry.Action.JOB_LOST, target=f"job {job.pk}").exists()
    assert Notification.objects.filter(user=alice, kind=Notification.Kind.JOB_FAILED).exists()


def test_a_whole_node_booking_keeps_another_users_job_out_until_it_ends(cluster, people):
    alice, bob = people
    server = Server.objects.get(name="cluster-a")
    servers_report_ingest(snapshots=[SlurmBackend("cluster-a").snapshot()])  # its node and cards
    booking = slurm_nodes_book(
        user=alice, server="cluster-a", nodes=[cluster.node], end=timezone.now() + HOUR
    )
    assert slurm_reservations_sync(server=server, commands=cluster.commands)["made"] == 1
    held = cluster.commands.show("reservation", reservation_name(booking.pk))
    assert "Users=nobody" in held and f"Nodes={cluster.node}" in held
    Reservation.objects.filter(pk=booking.pk).update(slurm_reservation="")  # a pass's record lost
    assert slurm_reservations_sync(server=server, commands=cluster.commands)["made"] == 1  # Slurm's is ours
    assert Reservation.objects.filter(pk=booking.pk, slurm_error="").exclude(slurm_reservation="").exists()

    outside = submit(bob, SHOW, 1)
    follow(outside)
    wait_for(
        lambda: row(outside).slurm_state == "PENDING" and row(outside).slurm_reason, 20, what="bob waiting"
    )
    inside = submit(alice, SHOW, 4, reservation=booking.pk)
    follow(inside)
    assert ended(inside).status == "succeeded"  # in its reservation, on every card of the node
    assert row(outside).slurm_state == "PENDING"  # still kept out

    reservation_release(user=alice, reservation=booking)
    assert slurm_reservations_sync(server=server, commands=cluster.commands)["removed"] == 1
    assert ended(outside).status == "succeeded"  # the node is everyone's again


def test_a_job_in_a_booking_released_early_is_stopped_and_the_reservation_removed(cluster, people):
    """As on a GPU host: the booking's end is its jobs' end (Slurm also keeps a reservation that
    a job still runs in)."""
    alice, _ = people
    server = Server.objects.get(name="cluster-a")
    servers_report_ingest(snapshots=[SlurmBackend("cluster-a").snapshot()])
    booking = slurm_nodes_book(
        user=alice, server="cluster-a", nodes=[cluster.node], end=timezone.now() + HOUR
    )
    assert slurm_reservations_sync(server=server, commands=cluster.commands)["made"] == 1
    job = submit(alice, TICKS, 1, reservation=booking.pk)
    follow(job)
    wait_for(lambda: "tick 2" in job_log(job.pk), 30, what="the job running in its booking")
    reservation_release(user=alice, reservation=booking)
    done = ended(job)
    assert done.status == "cancelled" and "alice released the booking" in done.message
    wait_for(
        lambda: slurm_reservations_sync(server=server, commands=cluster.commands)["removed"],
        20,
        what="its Slurm reservation removed",
    )


def test_a_job_waiting_for_its_booking_ends_when_the_booking_is_cancelled(cluster, people):
    alice, _ = people
    server = Server.objects.get(name="cluster-a")
    servers_report_ingest(snapshots=[SlurmBackend("cluster-a").snapshot()])
    start = timezone.now() + HOUR
    booking = slurm_nodes_book(
        user=alice, server="cluster-a", nodes=[cluster.node], start=start, end=start + HOUR
    )
    assert slurm_reservations_sync(server=server, commands=cluster.commands)["made"] == 1
    job = submit(alice, SHOW, 1, reservation=booking.pk)
    follow(job)
    wait_for(lambda: row(job).slurm_state == "PENDING", 20, what="the job waiting for its booking")
    reservation_cancel(user=alice, reservation=booking)
    done = ended(job)
    # A cancel is no time-out: cancelled, saying who cancelled the booking (issue 41).
    assert done.status == "cancelled" and done.message.startswith("Cancelled: alice cancelled the booking at")
    assert slurm_reservations_sync(server=server, commands=cluster.commands)["removed"] == 1


def test_only_whole_nodes_of_a_cluster_are_booked(cluster, people):
    alice, _ = people
    servers_report_ingest(snapshots=[SlurmBackend("cluster-a").snapshot()])
    with pytest.raises(Invalid, match="has no node nosuch") as refused:
        slurm_nodes_book(user=alice, server="cluster-a", nodes=["nosuch"])
    assert refused.value.field == "nodes"
    one_card = GPU.objects.filter(server__name="cluster-a").values_list("uuid", flat=True)[:1]
    with pytest.raises(Invalid, match="book whole nodes"):
        reservation_create(user=alice, gpus=list(one_card))


def test_the_clusters_own_worker_runs_a_job_sent_to_it_and_follows_it_again_after_a_restart(
    cluster, people, start_worker
):
    """The login node's worker as deployed (GPU_BACKEND=slurm, queue host.cluster-a), the portal's
    worker collecting its telemetry: the job's message reaches it as job_submit sends it. Killed
    (SIGKILL) while a job runs, its next start follows the job on: its end, and its whole log."""
    alice, _ = people
    start_worker(None)
    env = {"GPU_BACKEND": "slurm", "JOB_INTERPRETERS": "default=/usr/bin/python3"}
    worker = start_worker("cluster-a", extra_env=env)
    wait_for(lambda: Server.objects.online().filter(name="cluster-a").exists(), 30, what="the cluster online")
    assert SlurmNode.objects.get(server__name="cluster-a").gpus == 4
    job = submit(alice, SHOW, 2)
    assert ended(job).status == "succeeded"
    assert re.search(r"who nobody gpus \d,\d\n", job_log(job.pk))

    counting = submit(alice, COUNT, 1)
    wait_for(lambda: "line 5\n" in job_log(counting.pk), 30, what="the job's first lines")
    worker.kill()  # its follower with it, mid-job
    worker.wait()
    start_worker("cluster-a", extra_env=env)
    done = ended(counting, 60)
    log = job_log(counting.pk)
    assert done.status == "succeeded" and "started again: it follows Slurm job" in log
    assert [int(n) for n in re.findall(r"line (\d+)\n", log)] == list(range(60))  # each line once


def test_a_percent_sign_in_the_jobs_folder_is_no_symbol_to_sbatch(cluster, people):
    """sbatch reads --output as a filename pattern: a folder named `lab%j` had Slurm write the
    output to `lab<job id>/…`, and the portal read nothing. `%%` is a `%` to it."""
    alice, _ = people
    root = cluster.job_root / "lab%j"
    root.mkdir(mode=0o755, exist_ok=True)
    SlurmCluster.objects.filter(server__name="cluster-a").update(job_root=str(root))
    job = submit(alice, SHOW, 1)
    follow(job)
    done = ended(job)
    assert done.status == "succeeded", done.message
    assert re.search(r"who nobody gpus \d\n", job_log(done.pk))
    assert (root / "nobody" / f"job-{done.pk}" / "output.log").exists()


ECHO = b"""import os, sys
print("X=" + repr(os.environ.get("X")), "ARGS=" + repr(sys.argv[1:]), flush=True)
"""


@pytest.mark.parametrize("instance", ["Lab.A_b c", "portal-two"])
def test_names_with_the_instance_and_a_cr_in_env_and_args_on_real_slurm(cluster, people, settings, instance):
    settings.PORTAL_INSTANCE_ID = instance
    alice, _ = people
    values = ["\r", "", "a\r", 'it\'s "q" $HOME `id` \\ \r\n\r']
    job = submit(alice, ECHO, 1, env={"X": "v\r\n'\r"}, args=values)
    follow(job)
    done = ended(job)
    log = job_log(done.pk)
    assert done.status == "succeeded", (done.message, log)
    assert "X=" + repr("v\r\n'\r") in log and f"ARGS={values!r}" in log, log
    assert slurm_job_name(job.pk).startswith("portal-")
    server = Server.objects.get(name="cluster-a")
    servers_report_ingest(snapshots=[SlurmBackend("cluster-a").snapshot()])
    booking = slurm_nodes_book(
        user=alice, server="cluster-a", nodes=[cluster.node], end=timezone.now() + HOUR
    )
    assert slurm_reservations_sync(server=server, commands=cluster.commands)["made"] == 1
    assert "Users=nobody" in cluster.commands.show("reservation", reservation_name(booking.pk))
    cluster.commands.run("scontrol", ["delete", f"ReservationName={reservation_name(booking.pk)}"])

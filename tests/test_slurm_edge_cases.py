# ruff: noqa: F811 - the fixtures imported from tests.test_slurm_jobs
"""Edge cases a hostile review found (2026-11-30): the Slurm follower against what a real cluster
and a real outage do (fakes of scontrol/scancel, no cluster)."""

from __future__ import annotations

import pwd

import pytest
from django.db import OperationalError
from django.utils import timezone

from gpus.models import Reservation, SlurmCluster
from gpus.slurm_booking import reservation_name, slurm_nodes_book, slurm_reservations_sync
from jobs.host import slurm_runner
from jobs.host.executors.slurm import slurm_job_name
from jobs.models import Job
from portal.models import Profile
from tests.job_helpers import job_log
from tests.test_slurm_jobs import _Scontrol, alice, cluster, post  # noqa: F401 - fixtures

pytestmark = pytest.mark.django_db


def _fake(folder, job_line: str) -> None:  # type: ignore[no-untyped-def]
    """scontrol that says `job_line` of any job; scancel and sbatch that take anything."""
    folder.mkdir()
    scripts = {
        "scontrol": 'case "$2" in\n'
        f"job) echo '{job_line}' ;;\n"
        "partition) echo 'PartitionName=gpu Default=YES RootOnly=NO' ;;\n"
        "esac\n",
        "scancel": f'echo "$@" >> {folder}/scancel.args\n',
        "sbatch": "cat > /dev/null\necho 4242\n",
        "squeue": "echo 4242\n",
    }
    for name, body in scripts.items():
        (folder / name).write_text("#!/bin/sh\n" + body)
        (folder / name).chmod(0o755)


def _running(alice, cluster, tmp_path, job_line: str, **fields) -> Job:  # type: ignore[no-untyped-def]
    _fake(tmp_path / "bin", job_line)
    SlurmCluster.objects.filter(server=cluster).update(bin_dir=str(tmp_path / "bin"))
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    job = Job.objects.get(pk=post(alice, server="cluster-a", gpu_count=1).json()["id"])
    Job.objects.filter(pk=job.pk).update(
        status=Job.Status.RUNNING, slurm_job_id="4242", heartbeat_at=timezone.now(), **fields
    )
    return Job.objects.get(pk=job.pk)


def _says(tmp_path, job_line: str) -> None:  # type: ignore[no-untyped-def]
    """scontrol says `job_line` of the job from now on."""
    script = f"#!/bin/sh\ncase \"$2\" in\njob) echo '{job_line}' ;;\nesac\n"
    (tmp_path / "bin" / "scontrol").write_text(script)


def test_a_reused_slurm_job_id_whose_job_ended_is_never_taken_for_this_jobs_end(
    alice,
    cluster,
    tmp_path,
):
    """A controller whose state was wiped reuses ids (docs/slurm.md: 'another job is never taken
    for it'): Slurm job 4242 is now someone else's job, which COMPLETED. The portal's job must not
    be recorded as succeeded with that job's exit code."""
    job = _running(
        alice,
        cluster,
        tmp_path,
        "JobId=4242 JobName=someone-elses JobState=COMPLETED Reason=None ExitCode=0:0",
    )
    status = slurm_runner.SlurmFollower(job).resume()
    job.refresh_from_db()
    assert status == "lost", (status, job.message)
    assert "another job now" in job.message


@pytest.mark.django_db(transaction=True)  # the follower closes a broken connection, as in production
def test_a_database_blip_while_following_does_not_abandon_the_slurm_job(
    alice,
    cluster,
    tmp_path,
    monkeypatch,
):
    """A PostgreSQL restart of a second while the follower runs: the follower goes on and records
    the end Slurm gives, rather than dying and leaving the job to be marked lost 10 minutes later
    while Slurm runs it to its end."""
    job = _running(
        alice,
        cluster,
        tmp_path,
        "placeholder",
    )
    line = f"JobId=4242 JobName={slurm_job_name(job.pk)} JobState=COMPLETED Reason=None ExitCode=0:0"
    (tmp_path / "bin" / "scontrol").write_text(
        "#!/bin/sh\n" + f"case \"$2\" in\njob) echo '{line}' ;;\nesac\n"
    )
    real_ask, calls = slurm_runner.SlurmFollower._ask, []

    def ask_once_away(self, executor, run):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return real_ask(self, executor, run)

    monkeypatch.setattr(slurm_runner.SlurmFollower, "_ask", ask_once_away)
    monkeypatch.setattr(slurm_runner, "STATE_SECONDS", 0.05)
    status = slurm_runner.SlurmFollower(job).resume()
    job.refresh_from_db()
    assert (status, job.status) == ("succeeded", "succeeded")


def test_a_portal_cancel_without_a_person_ends_with_the_portals_reason_not_as_slurms(
    alice,
    cluster,
    tmp_path,
):
    """A leaver's work (jobs.leavers) asks the job to stop with cancelled_by=None and the reason in
    its message; the follower's scancel ends it. Its end must keep that reason, not say someone
    cancelled it in Slurm behind the portal's back."""
    job = _running(alice, cluster, tmp_path, "placeholder")
    line = f"JobId=4242 JobName={slurm_job_name(job.pk)} JobState=CANCELLED Reason=None ExitCode=0:15"
    (tmp_path / "bin" / "scontrol").write_text(
        "#!/bin/sh\n" + f"case \"$2\" in\njob) echo '{line}' ;;\nesac\n"
    )
    Job.objects.filter(pk=job.pk).update(
        cancel_requested_at=timezone.now(), cancelled_by=None, message="Cancelled: alice left the lab."
    )
    assert slurm_runner.SlurmFollower(Job.objects.get(pk=job.pk)).resume() == "cancelled"
    job.refresh_from_db()
    assert job.message == "Cancelled: alice left the lab.", job.message
    assert "Cancelled in Slurm" not in job_log(job.pk)


def test_a_reused_slurm_job_id_is_never_scancelled_for_this_jobs_cancel(alice, cluster, tmp_path):
    """The same reuse, the other job RUNNING, and this job's owner asked to cancel while the
    worker was away: root's scancel must never reach the other account's job."""
    job = _running(
        alice,
        cluster,
        tmp_path,
        "JobId=4242 JobName=someone-elses JobState=RUNNING Reason=None ExitCode=0:0",
        cancel_requested_at=timezone.now(),
        cancelled_by=alice,
    )
    assert slurm_runner.SlurmFollower(job).resume() == "lost"
    assert not (tmp_path / "bin" / "scancel.args").exists(), (tmp_path / "bin" / "scancel.args").read_text()


def test_a_slurm_job_whose_message_died_with_redis_is_sent_again(alice, cluster):
    """Redis restarted empty after the submit's message went out: the cluster's worker's pickup
    (HostPickup, which the Slurm worker starts for exactly this: docs/slurm.md) must find the
    queued job again. A job without a booking (every plain `gpu run --server cluster-a`) has no
    reservation, and the pickup's query only looks at jobs inside a booking's window: it stays
    queued for ever."""
    from datetime import timedelta

    from jobs.host.pickup import stranded_jobs

    job = Job.objects.get(pk=post(alice, server="cluster-a", gpu_count=1).json()["id"])
    assert job.status == Job.Status.QUEUED and job.reservation_id is None and job.dispatched_at
    now = timezone.now() + timedelta(minutes=5)  # long after its message should have started it
    assert [j.pk for j in stranded_jobs("cluster-a", slots=64, now=now)] == [job.pk]


def test_a_job_slurm_could_not_launch_says_so_and_is_not_killed_by_a_signal_53(alice, cluster, tmp_path):
    """What slurmd says of a batch job it could not start (a working directory or output folder
    missing on the compute node), as the real 22.05 cluster of tests/slurm_cluster.py prints it:
    `JobState=FAILED Reason=JobLaunchFailure ExitCode=0:53`. 53 is no signal the job got."""
    job = _running(alice, cluster, tmp_path, "placeholder")
    name = slurm_job_name(job.pk)
    line = f"JobId=4242 JobName={name} JobState=FAILED Reason=JobLaunchFailure ExitCode=0:53"
    (tmp_path / "bin" / "scontrol").write_text(
        "#!/bin/sh\n" + f"case \"$2\" in\njob) echo '{line}' ;;\nesac\n"
    )
    assert slurm_runner.SlurmFollower(Job.objects.get(pk=job.pk)).resume() == "failed"
    job.refresh_from_db()
    assert "JobLaunchFailure" in job.message and "signal 53" not in job.message, job.message
    assert job.exit_code is None


def test_another_portals_job_under_this_jobs_slurm_id_is_not_this_ones(alice, cluster, tmp_path, settings):
    """Two portals on one cluster both have a job 1: before, both named theirs `portal-1` in Slurm,
    so a reused id (or the lookup of a job whose sbatch answer was lost) took the other's for ours.
    The name carries the instance now."""
    job = _running(alice, cluster, tmp_path, "placeholder")
    settings.PORTAL_INSTANCE_ID = "the-other-lab"
    theirs = slurm_job_name(job.pk)
    settings.PORTAL_INSTANCE_ID = "this-lab"
    assert theirs != slurm_job_name(job.pk) and theirs.startswith("portal-the-other-lab-")
    line = f"JobId=4242 JobName={theirs} JobState=COMPLETED Reason=None ExitCode=0:0"
    _says(tmp_path, line)
    assert slurm_runner.SlurmFollower(Job.objects.get(pk=job.pk)).resume() == "lost"
    assert "another job now" in Job.objects.get(pk=job.pk).message


def test_a_job_the_release_before_sent_is_followed_again_after_the_upgrade(alice, cluster, tmp_path):
    """Sent as `portal-<id>` (the name before the instance was in it); its Slurm id on the row says
    it is ours: its end is recorded, not called another job's."""
    job = _running(alice, cluster, tmp_path, "placeholder")
    line = f"JobId=4242 JobName=portal-{job.pk} JobState=COMPLETED Reason=None ExitCode=0:0"
    _says(tmp_path, line)
    assert slurm_runner.SlurmFollower(Job.objects.get(pk=job.pk)).resume() == "succeeded"


def test_a_slurm_job_out_of_memory_says_so_and_not_a_signal_125(alice, cluster, tmp_path):
    """Slurm 22.05 ends a job over its memory as `JobState=OUT_OF_MEMORY Reason=OutOfMemory
    ExitCode=0:125`: 125 is Slurm's mark, no signal. The kernel's OOM killer sent SIGKILL."""
    job = _running(alice, cluster, tmp_path, "placeholder")
    name = slurm_job_name(job.pk)
    line = f"JobId=4242 JobName={name} JobState=OUT_OF_MEMORY Reason=OutOfMemory ExitCode=0:125"
    _says(tmp_path, line)
    assert slurm_runner.SlurmFollower(Job.objects.get(pk=job.pk)).resume() == "failed"
    job.refresh_from_db()
    assert "went over the memory Slurm gives it" in job.message and "125" not in job.message, job.message
    assert job.exit_code == -9


def test_a_pre_upgrade_job_whose_sbatch_answer_was_lost_is_found_by_its_former_name(alice, cluster, tmp_path):
    """The release before sent the job as `portal-<id>`, and its worker stopped before sbatch's
    answer reached the row. After the upgrade the worker asks Slurm only for the new name: the
    job is called lost while Slurm runs it on, unfollowed."""
    folder = tmp_path / "bin"
    folder.mkdir()
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    job = Job.objects.get(pk=post(alice, server="cluster-a", gpu_count=1).json()["id"])
    scripts = {  # Slurm holds the job under the name the release before gave it
        "squeue": f'case "$*" in *--name=portal-{job.pk}\\ *) echo 4242 ;; esac\n',
        "scontrol": 'case "$2" in\n'
        f"job) echo 'JobId=4242 JobName=portal-{job.pk} JobState=COMPLETED Reason=None ExitCode=0:0' ;;\n"
        "esac\n",
    }
    for name, body in scripts.items():
        (folder / name).write_text("#!/bin/sh\n" + body)
        (folder / name).chmod(0o755)
    SlurmCluster.objects.filter(server=cluster).update(bin_dir=str(folder))
    Job.objects.filter(pk=job.pk).update(status=Job.Status.STARTING)  # claimed by the worker that died
    assert slurm_runner.SlurmFollower(Job.objects.get(pk=job.pk)).resume() == "succeeded", Job.objects.get(
        pk=job.pk
    ).message


def test_a_long_instance_id_still_fits_the_bookings_slurm_reservation_column(alice, cluster, settings):
    """`Reservation.slurm_reservation` holds 64 characters; `portal-<instance>-<id>` with a
    PORTAL_INSTANCE_ID of 50 characters is longer. PostgreSQL refuses the pass's UPDATE (the
    reservation made in Slurm is never recorded, every pass again); SQLite stores it."""
    settings.PORTAL_INSTANCE_ID = "physics-department-gpu-portal.cluster.example.org"
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    booking = slurm_nodes_book(user=alice, server="cluster-a", nodes=["vm"])
    column = Reservation._meta.get_field("slurm_reservation").max_length
    assert len(reservation_name(booking.pk)) <= column, reservation_name(booking.pk)
    assert slurm_reservations_sync(server=cluster, commands=_Scontrol(""))["made"] == 1


def test_a_job_name_with_a_long_instance_id_stays_bounded(settings):
    """Bounded as the reservation's: a readable part, then the digest that keeps it apart."""
    settings.PORTAL_INSTANCE_ID = "x" * 2000  # slurmctld refuses a job name over 1024 characters
    assert len(slurm_job_name(123456)) <= 64


def test_another_portals_job_of_the_former_name_is_not_taken_for_ours(alice, cluster, tmp_path):
    """`portal-<id>` carries no instance: another portal on the cluster, a release behind, names
    its job 1 so too. Under a reused Slurm id it was taken for ours (its end recorded as this
    job's); as its own account's only, now."""
    job = _running(alice, cluster, tmp_path, "placeholder")  # runs as `nobody`
    theirs = f"JobId=4242 JobName=portal-{job.pk} UserId=someone(4001) JobState=COMPLETED ExitCode=0:0"
    _says(tmp_path, theirs)
    assert slurm_runner.SlurmFollower(Job.objects.get(pk=job.pk)).resume() == "lost"
    assert "another job now" in Job.objects.get(pk=job.pk).message
    nobody = pwd.getpwnam("nobody").pw_uid
    (tmp_path / "again").mkdir()
    job = _running(alice, cluster, tmp_path / "again", "placeholder")
    ours = f"JobId=4242 JobName=portal-{job.pk} UserId=nobody({nobody}) JobState=COMPLETED ExitCode=0:0"
    _says(tmp_path / "again", ours)
    assert slurm_runner.SlurmFollower(Job.objects.get(pk=job.pk)).resume() == "succeeded"


def test_a_job_followed_again_waits_for_a_database_that_goes_away_just_after_the_workers_start(
    alice, cluster, tmp_path, monkeypatch
):
    """The start's listing found the database (HostWorker.patiently); the job's own thread met
    it away a moment later (a restarting database): logged, and never followed again."""
    job = _running(alice, cluster, tmp_path, "placeholder")
    real, tries, followed = slurm_runner.SlurmFollower, [], []

    class Follower(real):  # type: ignore[misc, valid-type]
        def __init__(self, job):  # type: ignore[no-untyped-def]
            tries.append(1)
            if len(tries) == 1:
                raise OperationalError("server closed the connection unexpectedly")
            super().__init__(job)

        def resume(self) -> str:
            followed.append(self.job.pk)
            return "running"

    monkeypatch.setattr(slurm_runner, "SlurmFollower", Follower)
    monkeypatch.setattr(slurm_runner.connection, "close", lambda: None)  # the test's own connection
    monkeypatch.setattr("jobs.host.launch.time.sleep", lambda s: None)
    slurm_runner._resume(job.pk)
    assert followed == [job.pk]

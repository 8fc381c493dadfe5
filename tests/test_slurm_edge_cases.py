# ruff: noqa: F811 - the fixtures imported from tests.test_slurm_jobs
"""Edge cases a hostile review found (2026-11-30): the Slurm follower against what a real cluster
and a real outage do (fakes of scontrol/scancel, no cluster)."""

from __future__ import annotations

import pytest
from django.db import OperationalError
from django.utils import timezone

from gpus.models import SlurmCluster
from jobs.host import slurm_runner
from jobs.host.executors.slurm import slurm_job_name
from jobs.models import Job
from portal.models import Profile
from tests.job_helpers import job_log
from tests.test_slurm_jobs import alice, cluster, post  # noqa: F401 - fixtures

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

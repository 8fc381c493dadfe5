"""A preemptible job's checkpoint folder: kept across its runs, named in its environment.

A preemptible job (jobs.preemption) may be stopped and started again, on another card, any
number of times. Each run gets a fresh job folder (jobs/host/folders.py renames an old one
aside), so what it must find again lives in a folder of its own under JOB_FOLDERS, kept across
its runs: `checkpoint-<job id>-<its submit time>` (the submit time keeps a job of an earlier,
reset database from ever finding this one's). The job learns it from two variables:

- PORTAL_PREEMPTIBLE=1: it may be stopped (SIGTERM, then SIGKILL after its grace) at any time;
- PORTAL_CHECKPOINT_DIR: where to keep what it resumes from (keras.callbacks.BackupAndRestore,
  jobs/examples/keras_example.py).

On another server the folder is only the same one where JOB_FOLDERS is shared storage; otherwise
a run there starts from the beginning (docs/queue.md, "Preemptible jobs").

The folder goes when the job ends for good (succeeded, failed, cancelled, timed out; lost, once
CHECKPOINT_LOST_KEEP has passed): at once by the supervisor that recorded the end
(`checkpoint_remove`), and by each host's sweep (`checkpoints_sweep`, every
CHECKPOINT_SWEEP_SECONDS in the host's pickup thread) for a job that ended while it waited in the
queue, or on another host. A requeued job keeps it.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db.models import Q
from django.utils import timezone

from jobs.environment import JobSetupError
from jobs.host.folders import JobFolderError, job_folder_keep, job_folder_names, job_folder_remove
from jobs.host.launch import Launch
from jobs.models import Job

log = logging.getLogger(__name__)

PREEMPTIBLE_VAR = "PORTAL_PREEMPTIBLE"
CHECKPOINT_VAR = "PORTAL_CHECKPOINT_DIR"
PREFIX = "checkpoint-"
CHECKPOINT_SWEEP_SECONDS = 300  # the hosts' sweep of ended jobs' folders: cheap, and never urgent
# A job the reconciler marked lost may still come back to the queue: its worker, out of touch,
# may have preempted it and spooled that end, which its replay records over LOST (jobs.runs).
CHECKPOINT_LOST_KEEP = timedelta(days=7)


def checkpoint_name(job: Job) -> str:
    """The folder's name under JOB_FOLDERS: this job's, and no other database's job of that id."""
    return f"{PREFIX}{job.pk}-{job.created_at:%Y%m%d%H%M%S%f}"


def checkpoint_ready(launch: Launch, job: Job) -> Launch:
    """`launch` with the job's checkpoint folder made (or found again) and named in its
    environment; in a container image, also mounted writable. A job that is not preemptible is
    given neither variable."""
    if not job.preemptible:
        return launch
    try:
        folder = job_folder_keep(checkpoint_name(job), account=launch.account)
    except JobFolderError as exc:
        raise JobSetupError(f"{exc} (its checkpoint folder)") from None
    portal = {PREEMPTIBLE_VAR: "1", CHECKPOINT_VAR: str(folder)}
    launch.env.update(portal)
    launch.env_applied = dict(sorted({**launch.env_applied, **portal}.items()))
    if launch.image is not None:
        launch.mounts = ((str(folder), True), *launch.mounts)
    return launch


def came_back_words(job: Job, applied: dict[str, str]) -> str:
    """The log's line when a preempted job runs again."""
    times = "once" if job.preemptions == 1 else f"{job.preemptions} times"
    where = applied.get(CHECKPOINT_VAR, "")
    return (
        f"[portal] back from the queue: this job was preempted {times} and runs again; "
        f"it resumes from what it kept in {CHECKPOINT_VAR} ({where})."
    )


def checkpoint_remove(job: Job) -> bool:
    """The job ended for good: its checkpoint folder on this host goes. Whether one was there.
    A failure is logged, never raised: the sweep tries again."""
    try:
        return job_folder_remove(checkpoint_name(job))
    except OSError as exc:
        log.warning("Job %s: could not remove its checkpoint folder (%s); the sweep tries again", job.pk, exc)
        return False


def checkpoint_after(job: Job, status: str) -> None:
    """Once its end is stored: a preemptible job that ended for good loses its folder at once;
    one back in the queue keeps it. A job its supervisor sent back (`status` PENDING) may have
    been stored as ended all the same (cancelled in its grace, jobs.runs): its row says which."""
    if not job.preemptible:
        return
    if status == Job.Status.PENDING:
        status = Job.objects.filter(pk=job.pk).values_list("status", flat=True).first() or status
    if status in Job.FINISHED:
        checkpoint_remove(job)


def checkpoints_sweep() -> int:
    """This host's checkpoint folders of jobs that have ended for good, removed; how many. A job
    still in the queue or running keeps its folder, and so does one marked lost for
    CHECKPOINT_LOST_KEEP; a folder no job of this database names (an earlier, reset database's:
    its submit time differs) is left alone for its admin."""
    names = job_folder_names(PREFIX)
    ids = {int(name.split("-")[1]) for name in names if name.count("-") == 2 and name.split("-")[1].isdigit()}
    if not ids:
        return 0
    lost_long_ago = Q(status=Job.Status.LOST, finished_at__lt=timezone.now() - CHECKPOINT_LOST_KEEP)
    for_good = Q(status__in=set(Job.FINISHED) - {Job.Status.LOST}) | lost_long_ago
    ended = Job.objects.filter(for_good, pk__in=ids).only("pk", "created_at")
    removed = 0
    for job in ended:
        if checkpoint_name(job) in names:
            removed += checkpoint_remove(job)
    return removed

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
"""

from __future__ import annotations

from jobs.environment import JobSetupError
from jobs.host.folders import JobFolderError, job_folder_keep
from jobs.host.launch import Launch
from jobs.models import Job

PREEMPTIBLE_VAR = "PORTAL_PREEMPTIBLE"
CHECKPOINT_VAR = "PORTAL_CHECKPOINT_DIR"


def checkpoint_name(job: Job) -> str:
    """The folder's name under JOB_FOLDERS: this job's, and no other database's job of that id."""
    return f"checkpoint-{job.pk}-{job.created_at:%Y%m%d%H%M%S%f}"


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

"""A GPU host's worker and its jobs: whether its folders are safe, before it starts
(`host_worker_check`), what a previous worker left running, when it starts (`kill_orphans`),
whether containers work here, also then (`containers_report`), and
its running jobs, when it stops (`running_jobs_stop`; its stop flag goes once they have:
`running_jobs_stopped`). jobs/signals.py calls them from the worker's signals.

On SIGTERM (systemctl stop) Celery's warm shutdown waits for running tasks. Each job's
supervisor sees the stop flag within a second and stops its job the usual way (SIGTERM,
SIGKILL after JOB_KILL_GRACE_SECONDS), so the worker exits within the grace period
instead of waiting for a multi-hour run, and the job is recorded as cancelled rather
than lost.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import signal
import socket
import time
from collections.abc import Sequence
from datetime import timedelta

import psutil
from django.conf import settings
from django.db import DatabaseError, connection
from django.db.models import DurationField, ExpressionWrapper, F, Q
from django.db.models.functions import Now
from django.urls import reverse
from django.utils import timezone

from gpus.models import Server
from gpus.procinfo import session_of
from jobs.host import containers
from jobs.host.dcgm import mapping_check
from jobs.host.folders import FolderError, job_folders_check
from jobs.host.spool import spool_check, stop_flag, stop_flag_lower, stop_flag_raise
from jobs.logs.store import log_append
from jobs.models import Job
from jobs.preemption import shut_down_words
from portal.accounts import JOB_USER_OWNER, unix_account_name
from portal.models import AuditEntry, Notification
from portal.notifications import notification_send
from portal.pids import ProcessId, Sent, send, session_members

log = logging.getLogger(__name__)

ORPHAN_LOOKBACK = timedelta(days=1)  # lost jobs older than this have long been killed
CLOCK_SLACK_SECONDS = 5  # boot_time() is derived from the clock, which may have been adjusted since


class JobsAsRootRefused(Exception):
    """A worker run as root that would run every job as root, and nobody said it should."""


def host_worker_check() -> None:
    """Before a GPU host's worker takes anything: its jobs would not run as root unasked
    (`jobs_account_check`); the folders it writes into as root (JOB_FOLDERS,
    JOB_SPOOL_DIR, DCGM_HPC_JOB_MAPPING_DIR) and every folder above them are root's or the
    worker's and writable by nobody else, and the account jobs run as can pass through to
    JOB_FOLDERS (jobs/host/folders.py). Otherwise the worker refuses to start, and says which folder,
    which setting and the fix: a job's account that can write one of them could make the worker
    write where it points, and one that cannot reach JOB_FOLDERS fails every job.

    SystemExit, not an exception: Celery logs and swallows what a signal's receiver raises."""
    try:
        jobs_account_check()
        job_folders_check(job_user=settings.JOB_USER)
        spool_check()
        mapping_check()
    except (FolderError, JobsAsRootRefused) as exc:
        log.critical("The worker of %s does not start: %s", settings.WORKER_SERVER, exc)
        raise SystemExit(f"The worker of {settings.WORKER_SERVER} does not start: {exc}") from None


def jobs_as_root() -> bool:
    """Whether this host's jobs run as root: its worker does, and JOB_USER names no other account
    (JOB_USER=root, or none under PORTAL_DEVELOPMENT). A Slurm cluster's run as their owners."""
    return os.geteuid() == 0 and not settings.JOB_USER and settings.GPU_BACKEND != "slurm"


def jobs_account_check() -> None:
    """A worker run as root with no JOB_USER would run every job as root: a job could read the env
    file (the database password, SECRET_KEY) and do anything on the host. Refused, unless the
    admin said JOB_USER=root, which is said loudly in the log (and on the admins' dashboard:
    `jobs_as_root_record`); under PORTAL_DEVELOPMENT (`make run`, which says so once itself, and
    the tests) it is allowed."""
    if not jobs_as_root():
        return
    host = socket.gethostname()
    if settings.JOB_USER_ROOT:
        log.warning(
            "JOB_USER=root: EVERY JOB ON %s (%s) RUNS AS ROOT, and can read and change anything on this"
            " host, the env file's database password and SECRET_KEY among them. Set JOB_USER to an"
            ' account (e.g. gpujob) or @owner to end it (docs/jobs.md, "Who a job runs as").',
            settings.WORKER_SERVER,
            host,
        )
    elif not settings.PORTAL_DEVELOPMENT:
        raise JobsAsRootRefused(
            "it runs as root and JOB_USER is empty, so every job would run as root too, able to read"
            " the env file's database password and SECRET_KEY. Set JOB_USER=gpujob (one account for"
            " every job: useradd --system --create-home --shell /usr/sbin/nologin gpujob),"
            " JOB_USER=@owner (each job as its owner's Unix account), or JOB_USER=root to run jobs as"
            ' root all the same, said in the log and on the dashboard (docs/jobs.md, "Who a job runs as").'
        )


def jobs_as_root_record(server: str) -> bool:
    """Whether this host's jobs run as root, written on its server for the admins' dashboard; False
    while the server has no row yet (the collector makes it from the first report) or the database
    is away: the caller asks again with the next snapshot."""
    try:
        return bool(Server.objects.filter(name=server).update(jobs_as_root=jobs_as_root()))
    except DatabaseError as exc:
        log.debug("Could not record whether jobs run as root on %s yet: %s", server, exc)
        return False


def containers_report(server: str) -> tuple[bool, str]:
    """Whether jobs in container images can run on this host (jobs.host.containers.runtime_status),
    written on its server for the job form and the queue (Server.containers_ok/containers_detail).
    A check that fails is a no, with the reason: the form then offers no image here, and says why
    on the server's line. Called in a thread of its own at the worker's start (HostWorker.start):
    asking the runtime can take seconds, and the worker takes jobs meanwhile."""
    try:
        ok, detail = containers.runtime_status()
    except Exception as exc:  # a broken runtime must never keep the worker from starting
        log.exception("Could not check whether containers work on %s", server)
        ok, detail = False, f"The check failed: {exc!r}"
    detail = detail[: Server._meta.get_field("containers_detail").max_length]
    try:
        Server.objects.filter(name=server).update(containers_ok=ok, containers_detail=detail)
    except DatabaseError as exc:  # the database away at the start: the next start says it again
        log.warning("Could not record whether containers work on %s (%s): %s", server, exc, detail)
    log.info("Containers on %s: %s", server, f"yes, {detail}" if ok else f"no: {detail}")
    return ok, detail


def containers_leftovers_remove(server: str) -> list[str]:
    """The containers of this portal and host that a killed worker left (stopped, or still holding
    processes that kill_orphans could not prove: one that left the job's session), removed when
    the worker starts: after kill_orphans (which ended, and said so, what it could prove a job's),
    before the worker takes a job, so none of them is a live run's. A job's container that still
    ran is said in its log, the audit log and to its owner. Nothing to do where Podman is absent."""
    if shutil.which(settings.CONTAINER_PODMAN) is None:
        return []
    # Rootless: JOB_USER's own Podman holds them; under @owner each owner's, not swept here
    # (host_account says so: docs/containers.md); root mode: the worker's.
    try:
        removed = containers.leftovers_remove(containers.host_account())
    except containers.ContainerError as exc:
        log.warning("Could not look for containers a previous worker of %s left: %s", server, exc)
        return []
    for name, work, state in removed:
        log.warning("Removed container %s (%s, %s), left by the last worker of %s", name, work, state, server)
        kind, _, pk = work.partition("-")
        if kind == "job" and pk.isdigit() and state not in ("exited", "stopped", "created"):
            job = Job.objects.filter(pk=int(pk)).select_related("owner").first()
            if job is not None:
                _record_left_running(job, f"its container {name}, still {state}")
    return [name for name, _work, _state in removed]


def kill_orphans(server: str) -> int:
    """Job processes of this server left from a previous worker (its pool process was killed
    and only the launcher died with it): no supervisor watches them now, so they go.

    Found by the job's session, named by its leader's pid *and* start (Job.pid, Job.pid_started;
    portal.pids.session_members), and of the job's account: a leaderless session whose id merely
    equals a recycled job pid is never taken for the job's. A session recorded before this boot
    cannot have survived it. A job recorded without its session's start (by an older worker) is
    not proof enough: its candidates are named in the worker's log and left alone. Each process
    ended is said in the job's log, the audit log and a notification to its owner. Called when
    the host's worker starts, before it takes a job, so no job of this host is supervised yet.
    """
    jobs = Job.objects.filter(
        Q(status__in=(Job.Status.STARTING, Job.Status.RUNNING))
        | Q(status=Job.Status.LOST, finished_at__gte=timezone.now() - ORPHAN_LOOKBACK),
        server__name=server,
        worker=socket.gethostname()[:200],
        pid__isnull=False,
        started_at__isnull=False,
    ).select_related("owner__profile")
    # Heartbeats are the database's clock (portal.clock), process start times this host's: the
    # beat's age, measured by the database, is taken back from this host's now. Read before the
    # query runs, so the moment is never later than the beat was (no process is proved too many).
    jobs = jobs.annotate(beat_age=ExpressionWrapper(Now() - F("heartbeat_at"), output_field=DurationField()))
    read_at = time.time()
    killed = 0
    for job in jobs:
        if (uid := _job_uid(job)) is None:
            continue
        held_at = (
            read_at - job.beat_age.total_seconds() if job.beat_age is not None else job.started_at.timestamp()
        )
        try:
            killed += _end_orphans_of(job, uid, held_at)
        except Exception:  # one job's leftovers never stop the sweep of the others
            log.exception("Could not end what job %s left running", job.pk)
    return killed


def _end_orphans_of(job: Job, uid: int, held_at: float) -> int:
    if job.pid_started is None:
        _warn_unproved(job, uid, "it has no recorded session start (an older worker ran it)")
        return 0
    if job.pid_started < psutil.boot_time() - CLOCK_SLACK_SECONDS:
        return 0  # started before this boot: nothing of that session is left
    ended = []
    # `held_at`: the last moment the supervisor held the leader (alive, or exited and not yet
    # reaped), on this host's clock, so the session id was surely the job's: what was made by
    # then and still lives proves it.
    members = session_members(ProcessId(job.pid, job.pid_started), held_at=held_at)
    if not members:
        _warn_unproved(job, uid, "none of them was there while its worker still watched it")
    for member in members:
        try:
            if psutil.Process(member.pid).uids().real != uid:
                continue
        except psutil.Error:
            continue
        if send(member, signal.SIGKILL) is Sent.SENT:
            log.warning("Killed process %s left by a previous worker (job %s's session)", member.pid, job.pk)
            ended.append(member.pid)
    if ended:
        _record_orphans_ended(job, ended)
    return len(ended)


def _job_uid(job: Job) -> int | None:
    """The uid the job ran as (JOB_USER's, its owner's under @owner, else the worker's)."""
    if not settings.JOB_USER:
        return os.getuid()
    name = unix_account_name(job.owner) if settings.JOB_USER == JOB_USER_OWNER else settings.JOB_USER
    try:
        return pwd.getpwnam(name).pw_uid if name else None
    except KeyError:
        return None  # no such account here: the job never started as it


def _warn_unproved(job: Job, uid: int, why: str) -> None:
    """Processes in a session with the job's id that cannot be proved to be the job's are left
    alone, and named in the worker's log for an operator to check."""
    if candidates := [p.pid for p in psutil.process_iter(["uids"]) if _in_session(p, job.pid, uid)]:
        log.warning(
            "Job %s: process(es) %s in session %s are left alone, as they cannot be proved to be its"
            " (%s); check them by hand",
            job.pk,
            candidates,
            job.pid,
            why,
        )


def _in_session(proc: psutil.Process, sid: int, uid: int) -> bool:
    return session_of(proc.pid) == sid and proc.info["uids"] is not None and proc.info["uids"].real == uid


def _record_orphans_ended(job: Job, pids: list[int]) -> None:
    _record_left_running(job, f"process(es) {', '.join(map(str, pids))}", pids)


def _record_left_running(job: Job, what: str, pids: Sequence[int] = ()) -> None:
    """Nothing is killed silently: the job's log, the audit log and its owner are told."""
    why = (
        f"Killed {what} that job {job.pk} left running on"
        f" {socket.gethostname()} when its worker died: nothing watched them any more."
    )
    log_append(job.pk, f"[portal] {why}")
    AuditEntry.objects.create(
        actor=None,
        team_id=job.team_id,
        action=AuditEntry.Action.JOB_CANCEL,
        target=f"job {job.pk}",
        message=why,
        data={"job": job.pk, "pids": list(pids), "host": socket.gethostname()},
    )
    notification_send(
        user=job.owner,
        kind=Notification.Kind.JOB_STOPPED,
        subject=f"Job {job.pk}: what it left running was stopped",
        body=why,
        url=reverse("job_detail", args=[job.pk]),
        key=f"orphans:{job.pk}",
    )


def running_jobs_stop() -> int:
    """A GPU host's worker is stopping: ask its running jobs to stop; returns how many rows said so.

    Its supervisors learn it from a flag on this host's disk (jobs.host.spool.stop_flag), which
    needs no database; the row says it too when the database answers. A fresh connection:
    the one this process had may have died with a database restart."""
    flag = stop_flag(os.getpid())
    if flag is not None:
        try:
            stop_flag_raise(flag)
        except OSError:
            log.exception("Could not write the stop flag %s", flag)
    connection.close()
    now, host = timezone.now(), socket.gethostname()
    try:
        mine = Job.objects.filter(
            status__in=(Job.Status.STARTING, Job.Status.RUNNING),
            server__name=settings.WORKER_SERVER,
            worker=host[:200],
            cancel_requested_at=None,
        )
        # A preemptible job goes back to the queue, as when preempted (jobs.preemption): nobody
        # cancelled it, and it resumes from its checkpoint elsewhere. One asked to leave already
        # keeps its first reason.
        stopping = mine.filter(preemptible=True, queued=True, preempt_requested_at=None).update(
            preempt_requested_at=now,
            preempt_reason=shut_down_words(host),
            preempt_grace_seconds=settings.JOB_KILL_GRACE_SECONDS,
        )
        stopping += mine.filter(preemptible=False).update(
            cancel_requested_at=now, message=f"The worker on {host} shut down."
        )
    except DatabaseError:
        log.warning("Worker shutting down while the database is away: its jobs stop by the flag alone")
        return 0
    if stopping:
        log.warning("Worker shutting down: stopping %d running job(s)", stopping)
    return stopping


def running_jobs_stopped() -> None:
    """The end of a GPU host worker's shutdown (its pool has finished): the stop flag that
    `running_jobs_stop` raised is removed, so none is left in JOB_SPOOL_DIR per shutdown."""
    flag = stop_flag(os.getpid())
    if flag is None:
        return
    try:
        stop_flag_lower(flag)
    except OSError as exc:
        log.error("Could not remove the stop flag %s: %s", flag, exc)

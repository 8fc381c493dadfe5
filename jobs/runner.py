"""The worker's side of a job: claim it, build its environment, supervise the subprocess.

The worker never imports TensorFlow (GPU memory taken by a long-lived worker is never
given back): every job is a subprocess in its own session, started through
jobs/launcher-bin/launcher.py with the job's interpreter, without any of the worker's
privileges (portal.processes.start_job_process). Cancel and time limits send SIGTERM to the
job's session (every process of it, by identity: jobs/supervision.py) and SIGKILL after
JOB_KILL_GRACE_SECONDS. A worker that may not signal its job (JOB_USER without CAP_KILL) says so
on the job and in its log, and keeps watching it until it ends by itself. While the database is
away the supervisor keeps the job's last known deadline and enforces it alone; its end waits in
this host's spool (jobs/spool.py, jobs/replay.py).
"""

from __future__ import annotations

import logging
import os
import pwd
import queue
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TypeVar

from django.conf import settings
from django.db import DatabaseError, close_old_connections
from django.utils import timezone

from gpus.models import Allocation, Reservation
from jobs import paths
from jobs.environment import BookedCard, JobSetupError, job_environment
from jobs.folders import JobFolderError, job_folder_make
from jobs.leavers import deactivated, owner_active, user_work_stop
from jobs.logs import LogWriter
from jobs.metrics import MetricsRecorder
from jobs.models import Job
from jobs.replay import job_end_store
from jobs.scheduler import queued_job_ended
from jobs.spool import EndRecord, LogSpool, spool_name, stop_flag, worker_stopping
from jobs.supervision import JobOutput, JobSession
from portal.accounts import JOB_USER_OWNER, unix_account_name
from portal.errors import Invalid
from portal.outage import WHAT, outage_of
from portal.processes import PRIVILEGES_EXIT_CODE, WORKDIR_EXIT_CODE, start_job_process

log = logging.getLogger(__name__)
T = TypeVar("T")

# In a folder of its own that is no package: Python puts the launcher's folder first on the
# job's sys.path, and nothing else in it may shadow a module of the user's or the standard library.
LAUNCHER = Path(__file__).resolve().parent / "launcher-bin" / "launcher.py"
TICK_SECONDS = 0.1
CANCEL_POLL_SECONDS = 1.0
END_RETRY_SECONDS = 2.0
CANNOT_STOP = "Could not stop: permission denied"


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    env_applied: dict[str, str]  # the portal's own variables, shown on the job's page
    account: pwd.struct_passwd | None  # the job runs as it (JOB_USER; None: as the worker)


def launch_for(job: Job) -> Launch:
    """Everything the subprocess gets: argv, cwd and the environment built from the booking.

    The steps with side effects are here (the job's folder, the upload, chown); the environment
    itself comes from the pure `job_environment`."""
    # Every card of a booking holds the same memory_mb; the first card's size stands for all.
    first = _patiently(
        job.pk,
        lambda: Allocation.objects.select_related("gpu").get(
            reservation_id=job.reservation_id, gpu_id=job.gpu_uuids[0]
        ),
    )
    interpreter = settings.JOB_INTERPRETERS.get(job.interpreter)
    if not interpreter or not os.access(interpreter, os.X_OK):
        raise JobSetupError(
            f"Python environment {job.interpreter!r} ({interpreter or 'not configured'}) is not "
            f"executable on {socket.gethostname()}; check JOB_INTERPRETERS on this host."
        )
    account = _job_account(job)
    script, cwd = _prepare_folders(job, account)
    home = Path(interpreter).parent.parent  # a venv's root holds pyvenv.cfg, beside its bin/
    built = job_environment(
        job,
        BookedCard.of(first),
        inherited=os.environ,
        interpreter=interpreter,
        venv=str(home) if (home / "pyvenv.cfg").is_file() else None,
        server=settings.WORKER_SERVER,
        instance=settings.PORTAL_INSTANCE_ID,
        headroom_mb=settings.GPU_CONTEXT_HEADROOM_MB,
        account=account,
    )
    argv = [interpreter, "-u", str(LAUNCHER), str(script), *job.args]
    return Launch(argv=argv, env=built.env, cwd=cwd, env_applied=built.applied, account=account)


def _job_account(job: Job) -> pwd.struct_passwd | None:
    """The account the job runs as, in its HOME (None: as the worker's own user).

    JOB_USER names one account for every job, or is "@owner": each job runs as its owner's Unix
    account (portal.accounts.unix_account_name), so its files are theirs and the GPU watchdog
    sees their name on the card. Never root or a system account (below JOB_MIN_UID).
    """
    if not settings.JOB_USER:
        return None
    host = socket.gethostname()
    if settings.JOB_USER == JOB_USER_OWNER:
        name, source = unix_account_name(job.owner), f"{job.owner.username}'s Unix account"
        if name is None:
            raise JobSetupError(
                f"{job.owner.username} has no Unix account the portal can vouch for (none on their"
                f" profile, and '{job.owner.username}' is someone else's or came from a source not"
                " trusted for Unix accounts): an admin sets or confirms theirs on their profile."
            )
    else:
        name, source = settings.JOB_USER, "JOB_USER"
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        raise JobSetupError(
            f"{source} {name!r} is no account on {host}: an admin sets the Unix account on the"
            " person's profile, or creates the account on the host."
        ) from None
    if account.pw_uid < settings.JOB_MIN_UID:
        raise JobSetupError(
            f"{source} {name!r} has uid {account.pw_uid} on {host}, below JOB_MIN_UID"
            f" ({settings.JOB_MIN_UID}): jobs never run as root or a system account."
        )
    if account.pw_gid == os.getegid():
        # The worker's group may read its env file and write what the worker shares with it.
        raise JobSetupError(
            f"{source} {name!r} has the worker's own group (gid {account.pw_gid}) on {host}: jobs never"
            " run in it. Give the account a primary group of its own."
        )
    return account


def _prepare_folders(job: Job, account: pwd.struct_passwd | None) -> tuple[Path, Path]:
    """The script and the working directory. The job's own folder is made fresh where no job
    can plant anything, with the upload in it (jobs/folders.py); a script path or working
    directory the job chose is only checked here, by its text and where its links lead, and
    is opened and entered by the job's own process alone, once it has dropped the worker's
    privileges (portal.processes): the worker never writes, changes or enters it."""
    host = socket.gethostname()
    try:
        cwd = (
            paths.checked_path(job.workdir, field="workdir", what="working directory")
            if job.workdir
            else None
        )
        script = (
            paths.checked_path(job.script_path, field="script_path", what="script path")
            if job.script_path
            else None
        )
        # The job's own folder: its default working directory and where an upload is put
        # (never into a chosen working directory, where it could overwrite the user's file).
        folder = job_folder_make(
            job.pk, upload=None if script else (job.name, job.script_source), account=account
        )
    except Invalid as exc:
        raise JobSetupError(exc.message) from None
    except JobFolderError as exc:
        raise JobSetupError(f"{exc} (on {host})") from None
    if script is None:
        script = folder.path / job.name
    elif not script.is_file():
        raise JobSetupError(f"The script {script} does not exist on {host}.")
    if cwd is not None and not cwd.is_dir():
        raise JobSetupError(f"The working directory {cwd} does not exist on {host}.")
    return script, cwd or folder.path


class Supervisor:
    """Run one claimed job to its end, recording everything on the Job row."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.spool = _spool_for(job)
        try:
            self.writer = LogWriter(job.pk, spool=self.spool)
        except Exception:
            if self.spool is not None:
                self.spool.close()  # and its lock: the next try takes it again
            raise
        self.metrics = MetricsRecorder(job.pk)  # the training curves, taken out of the output
        self.proc: subprocess.Popen[bytes] | None = None
        self.session: JobSession | None = None
        self.booking_end: datetime = job.reservation.end  # the last deadline the database gave
        self.db_away: str | None = None  # the outage a database step last met, said once
        self.stop_reason: str | None = None  # Job.Status to record once the process is gone
        self.final_status: str | None = None  # the end as the worker saw it, stored or spooled
        self.stop_message = ""
        self.term_sent_at: float | None = None
        self.killed = False
        self.not_stopped = ""  # why the job could not be stopped, for its final message
        self.launcher_seen = False
        self.first_output = bytearray()  # the launcher's line is among the first output
        # The worker's shutdown, told without the database (prefork: the parent; solo: itself).
        self.stop_flags = [flag for pid in {os.getpid(), os.getppid()} if (flag := stop_flag(pid))]
        self.shutting_down = False
        self.running_recorded = False
        self.env_applied: dict[str, str] = {}

    # --- the loop --------------------------------------------------------------------

    def run(self) -> None:
        job = self.job
        try:
            launch = launch_for(job)
        except JobSetupError as exc:
            self.writer.write_line(f"[portal] cannot start: {exc}")
            self._guarded(self.writer.close)
            self._finish(Job.Status.FAILED, None, str(exc))
            return
        if stopped := _patiently(job.pk, self._stopped_before_start):
            self.writer.write_line(f"[portal] {stopped} The job never started.")
            self._guarded(self.writer.close)
            self._finish(Job.Status.CANCELLED, None, stopped)
            return
        self.writer.write_line(
            f"[portal] job {job.pk} on {settings.WORKER_SERVER} ({socket.gethostname()}): "
            f"{' '.join(launch.argv[3:])} in {launch.cwd}"
        )
        account = launch.account  # JOB_USER's: jobs run as an account that cannot read the worker's secrets
        try:
            self.proc = start_job_process(
                launch.argv,
                env=launch.env,
                cwd=launch.cwd,
                user=account.pw_uid if account is not None else None,
                group=account.pw_gid if account is not None else None,
            )
        except OSError as exc:
            self.writer.write_line(f"[portal] cannot start: {exc}")
            self.writer.close()
            self._finish(Job.Status.FAILED, None, f"Could not start {launch.argv[0]}: {exc}")
            return
        self.session = JobSession(self.proc)  # its identity, taken before anything can reap it
        job.started_at = timezone.now()
        self.env_applied = launch.env_applied
        # Its process runs now, whatever the database says: watched from here on, and the row
        # told it runs as soon as the database answers (tried again on every poll until then).
        self.running_recorded = self._guarded(self._record_running)
        self._supervise()

    def _record_running(self) -> None:
        assert self.session is not None and self.job.started_at is not None
        Job.objects.filter(pk=self.job.pk, status=Job.Status.STARTING).update(
            status=Job.Status.RUNNING,
            # pid and start together name the job's session for good (the orphan sweep's proof).
            pid=self.session.leader.pid,
            pid_started=self.session.leader.started,
            started_at=self.job.started_at,
            heartbeat_at=timezone.now(),
            env_applied=self.env_applied,
        )

    def _stopped_before_start(self) -> str:
        """A cancel asked for since the claim (its owner, a leader, or the owner's deactivation):
        the job is not started at all, rather than started and stopped at once."""
        row = (
            Job.objects.filter(pk=self.job.pk)
            .values("cancel_requested_at", "cancelled_by__username", "message")
            .get()
        )
        if not row["cancel_requested_at"]:
            return ""
        who = row["cancelled_by__username"]
        return f"Cancelled by {who}." if who else row["message"] or "Cancelled."

    def _supervise(self) -> None:
        assert self.proc is not None and self.session is not None
        output = JobOutput(self.proc.stdout, tick=TICK_SECONDS)
        try:
            self._loop(output.chunks)
        except Exception:
            log.exception("Job %s: the supervisor failed", self.job.pk)
            self._kill_now()  # never leave a job running unwatched
        # The main process has exited but is not reaped: its pid still names the session, so the
        # sweep cannot reach a process that took the pid since. Reaped only after it.
        self.session.wait_exit()
        self._end_session()
        code = self.session.reap()
        self._drain(output)
        self._guarded(self.writer.close)
        self._record(code)

    def _loop(self, chunks: queue.Queue[bytes | None]) -> None:
        """Until the job has exited and its output is drained: log, heartbeat, cancel, limits."""
        assert self.proc is not None
        last_poll = last_beat = time.monotonic()
        eof = False
        exited_at: float | None = None
        while True:
            if exited_at is None and self.session is not None and self.session.exited():
                exited_at = time.monotonic()
            if exited_at is not None and (eof or time.monotonic() - exited_at > settings.JOB_DRAIN_SECONDS):
                # Done; a child that kept the output pipe open (a server started in the
                # background) does not keep the job alive: _end_session ends it.
                return
            deadline = time.monotonic() + TICK_SECONDS
            while not eof:
                try:
                    data = chunks.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if data is None:
                    eof = True
                    break
                self._note_launcher_line(data)
                self._take_output(data)
            if eof:
                time.sleep(max(0.0, deadline - time.monotonic()))  # output closed; waiting for the exit
            if late := self.metrics.release():  # held back in case it became a record; it did not
                self.writer.feed(late)
            self._guarded(self.writer.maybe_flush)
            self._guarded(self.metrics.maybe_flush)
            now = time.monotonic()
            if now - last_poll >= CANCEL_POLL_SECONDS:
                last_poll = now
                self._check_shutdown()
                if not self.running_recorded:
                    self.running_recorded = self._guarded(self._record_running)
                beat = now - last_beat >= settings.JOB_HEARTBEAT_SECONDS
                if self._guarded(lambda: self._check_row(beat), reads=True):  # noqa: B023 - called at once
                    last_beat = now if beat else last_beat
                else:
                    self._check_deadline_alone()
            self._escalate()

    def _drain(self, output: JobOutput) -> None:
        """Whatever the job wrote just before the end, for JOB_DRAIN_SECONDS at most, heartbeat
        kept: a process that left the job's session (setsid) and holds the pipe must not hold the
        supervisor (and its pool process) for ever. Past that the pipe is closed, saying so."""

        def beat() -> None:
            self._guarded(lambda: Job.objects.filter(pk=self.job.pk).update(heartbeat_at=timezone.now()))

        if not output.drain(
            settings.JOB_DRAIN_SECONDS, self._take_output, beat, settings.JOB_HEARTBEAT_SECONDS
        ):
            self.writer.write_line(
                f"[portal] output still came {settings.JOB_DRAIN_SECONDS} s after the job ended, from a"
                " process that left its session: no longer read."
            )
        if late := self.metrics.release(everything=True):
            self.writer.feed(late)
        self._guarded(self.metrics.flush)

    def _take_output(self, data: bytes) -> None:
        """The job's training records to their table (jobs/metrics.py), the rest of its output to the log."""
        if rest := self.metrics.feed(data):
            self.writer.feed(rest)
        if note := self.metrics.full_note():
            self.writer.write_line(note)

    def _guarded(self, step: Callable[[], object], *, reads: bool = False) -> bool:
        """Run a database step; a failure (database restarting) is logged and tried again
        on the next tick. The log keeps what it could not write yet; a heartbeat missed for
        longer than JOB_LOST_AFTER_SECONDS makes the reconciler mark the job lost, which
        this loop then sees and honours. An outage is one line (and one when it is over), not a
        traceback every tick; any other database error keeps its traceback. Only a step that
        always `reads` the database proves it back (a flush with nothing pending reaches none)."""
        try:
            step()
        except DatabaseError as exc:
            close_old_connections()
            if (service := outage_of(exc)) is None:
                log.warning("Job %s: database step failed; retrying", self.job.pk, exc_info=True)
            elif service != self.db_away:
                log.warning("Job %s: %s is away (%s); its steps wait for it", self.job.pk, WHAT[service], exc)
            self.db_away = service or self.db_away
            return False
        if self.db_away and reads:
            log.warning("Job %s: %s answers again", self.job.pk, WHAT[self.db_away])
            self.db_away = None
        return True

    def _note_launcher_line(self, data: bytes) -> None:
        if self.launcher_seen or len(self.first_output) > 8192:
            return
        self.first_output += data
        for line in bytes(self.first_output).split(b"\n")[:-1]:
            if line.startswith(b"[portal] launcher:"):
                self.launcher_seen = True
                text = line.decode(errors="replace")[:1000]
                self._guarded(lambda: Job.objects.filter(pk=self.job.pk).update(launcher_line=text))  # noqa: B023
                return

    def _check_row(self, beat: bool) -> None:
        """Heartbeat, and pick up a cancel request or a moved booking end (release, cancel)."""
        now = timezone.now()
        if beat:
            Job.objects.filter(pk=self.job.pk).update(heartbeat_at=now)
        row = (
            Job.objects.filter(pk=self.job.pk)
            .values(
                "status",
                "started_at",
                "cancel_requested_at",
                "cancelled_by__username",
                "watchdog_stop",
                "message",
                "reservation__end",
                "reservation__cancelled_at",
            )
            .get()
        )
        if self.stop_reason:
            return
        # The row is the record: the time limit counts from the start it shows; both are kept
        # to be enforced without the database while it is away (_check_deadline_alone).
        self.job.started_at = row["started_at"] or self.job.started_at
        self.booking_end = row["reservation__end"]
        if row["status"] == Job.Status.LOST:
            # Declared dead while this worker could not reach the database: its booking may
            # already hold a new job, so this one must not go on.
            self._stop(Job.Status.LOST, "This job was marked lost while its worker was out of touch.")
        elif row["watchdog_stop"]:
            self._stop(Job.Status.FAILED, row["watchdog_stop"])
        elif row["cancel_requested_at"]:
            who = row["cancelled_by__username"]
            self._stop(
                Job.Status.CANCELLED, f"Cancelled by {who}." if who else row["message"] or "Cancelled."
            )
        elif row["reservation__cancelled_at"] and now >= row["reservation__end"]:
            self._stop(Job.Status.TIMED_OUT, "The booking was cancelled; the job was stopped.")
        elif why := self._past_deadline(now):
            self._stop(Job.Status.TIMED_OUT, why)

    def _past_deadline(self, now: datetime) -> str:
        """Why the job must stop now (its time limit, its booking's end), from the last start and
        booking end the database gave; "" while it may run on."""
        if now < self.job.deadline(self.booking_end):
            return ""
        limit = self.job.time_limit_minutes
        if limit and self.job.started_at and now >= self.job.started_at + timedelta(minutes=limit):
            return f"Time limit of {limit} min reached."
        return "The booking ended; the job was stopped."

    def _check_deadline_alone(self) -> None:
        """The database is away: the last deadline it gave still holds, enforced here alone. The
        job's end is recorded once the database answers (this host's spool keeps it till then)."""
        if not self.stop_reason and (why := self._past_deadline(timezone.now())):
            self.writer.write_line(
                "[portal] the database is away: the job is stopped by the last deadline it gave;"
                " its end is recorded when the database answers."
            )
            self._stop(Job.Status.TIMED_OUT, why)

    def _check_shutdown(self) -> None:
        if self.shutting_down or not any(flag.exists() for flag in self.stop_flags):
            return
        self.shutting_down = True  # its end is then spooled at once, never waited for
        if not self.stop_reason:
            self._stop(Job.Status.CANCELLED, f"The worker on {socket.gethostname()} shut down.")

    def _stop(self, status: str, message: str) -> None:
        self.stop_reason, self.stop_message = status, message
        grace = settings.JOB_KILL_GRACE_SECONDS
        self.writer.write_line(f"[portal] {message} Sending SIGTERM; SIGKILL in {grace} s if still running.")
        self.term_sent_at = time.monotonic()
        if not self._signal(signal.SIGTERM):
            self._stop_denied()

    def _stop_denied(self) -> None:
        """The worker may not signal the job (JOB_USER without CAP_KILL). Crashing would leave it
        running unwatched; instead it runs on, watched as before (heartbeat, log, its end
        recorded when it comes), and its row says so while it does."""
        self.not_stopped = f"{CANNOT_STOP}; it ran until it ended by itself."
        self.writer.write_line(
            "[portal] could not send SIGTERM: permission denied. The job runs on; "
            "the portal keeps watching it and records its end."
        )
        note = f"{self.stop_message} {CANNOT_STOP}; the job is still running."[:1000]
        self._guarded(
            lambda: Job.objects.filter(pk=self.job.pk, status=Job.Status.RUNNING).update(message=note)
        )

    def _escalate(self) -> None:
        if self.term_sent_at is None or self.killed:
            return
        if time.monotonic() - self.term_sent_at >= settings.JOB_KILL_GRACE_SECONDS:
            self.writer.write_line("[portal] still running after the grace period: SIGKILL.")
            self.killed = True  # one attempt: a denied SIGKILL is said once, not on every tick
            if not self._signal(signal.SIGKILL):
                self.writer.write_line("[portal] could not send SIGKILL: permission denied.")

    def _signal(self, sig: signal.Signals) -> bool:
        """Signal every process of the job's session, each by its identity (jobs/supervision.py);
        False when the worker may not. Nothing left to signal counts as signalled."""
        assert self.session is not None
        allowed = self.session.signal(sig)
        if not allowed:
            log.warning(
                "Job %s: may not send %s to its processes (permission denied: CAP_KILL?)",
                self.job.pk,
                sig.name,
            )
        return allowed

    def _kill_now(self) -> None:
        """The supervisor itself failed: stop the job at once rather than leave it unwatched."""
        log.error("Job %s: supervisor failed; killing the job", self.job.pk)
        killed = self._signal(signal.SIGKILL)
        if not killed:  # nothing else is left to do: wait for its end, so that it is recorded
            log.error("Job %s: may not kill it either; waiting for it to end by itself", self.job.pk)
            self.not_stopped = self.not_stopped or f"{CANNOT_STOP}; it ran until it ended by itself."
        self.stop_reason = self.stop_reason or Job.Status.FAILED
        self.stop_message = self.stop_message or (
            "The worker's supervisor failed; the job was killed."
            if killed
            else "The worker's supervisor failed."
        )

    def _end_session(self) -> None:
        """The main process is gone; whatever it left in its session goes with it, whatever
        process groups it made there."""
        assert self.session is not None
        if not self.session.end():
            self.writer.write_line(
                "[portal] the job left processes running that the worker may not kill: permission denied."
            )
            self.not_stopped = self.not_stopped or "Could not stop what it left running: permission denied."

    def _record(self, code: int) -> None:
        if self.stop_reason:
            status, message = self.stop_reason, self.stop_message
        elif code == 0:
            status, message = Job.Status.SUCCEEDED, ""
        elif code == PRIVILEGES_EXIT_CODE and not self.launcher_seen:
            status = Job.Status.FAILED
            message = (
                f"Did not start: its process could not drop the worker's privileges (exit code {code}; "
                "the log says which step failed)."
            )
        elif code == WORKDIR_EXIT_CODE and not self.launcher_seen:
            status = Job.Status.FAILED
            message = (
                f"Did not start: its account may not enter its working directory (exit code {code}; "
                "the log says why)."
            )
        else:
            status = Job.Status.FAILED
            message = f"Exited with code {code}." if code > 0 else f"Killed by signal {-code}."
        self._finish(status, code, " ".join(filter(None, (message, self.not_stopped))))

    def _finish(self, status: str, code: int | None, message: str) -> None:
        """Record the outcome after the log's last bytes, once. The end goes to this host's
        spool first (jobs/spool.py): while the database is away it is tried every 2 s for
        JOB_END_WAIT_SECONDS, and after that left to the host's spool thread (`spool_replay`),
        which records it once the database is back. Nothing of it is ever lost.

        The worker's word is final even over LOST (marked while it was out of touch)."""
        self.final_status = status
        record = EndRecord(
            status=status, exit_code=code, message=message[:1000], finished_at=timezone.now().isoformat()
        )
        if self.spool is not None:
            try:
                record.write(self.spool.name)
            except OSError:
                log.exception("Job %s: could not spool its end; the database is its only record", self.job.pk)
        if not self._store_end(record):
            return
        if self.spool is not None:
            EndRecord.remove(self.spool.name)
            self.spool.close(remove=True)
        self._guarded(lambda: queued_job_ended(self.job))

    def _store_end(self, record: EndRecord) -> bool:
        """Try the end every END_RETRY_SECONDS until it is stored (True), or until the worker
        shuts down (it waits for no database) or JOB_END_WAIT_SECONDS pass (False): the spool then
        records it once the database is back; without a spool it is given up, the reconciler marks
        the job lost and the worker's log says how it ended."""
        deadline = time.monotonic() + settings.JOB_END_WAIT_SECONDS
        while True:
            try:
                recorded = job_end_store(self.job.pk, self.writer, record)
            except DatabaseError:
                close_old_connections()
                if self._stopping() or time.monotonic() >= deadline:
                    break
                log.warning(
                    "Job %s: could not record its end; retrying in %s s", self.job.pk, END_RETRY_SECONDS
                )
                retry_at = time.monotonic() + END_RETRY_SECONDS
                while time.monotonic() < retry_at and not self._stopping():
                    time.sleep(TICK_SECONDS)
                continue
            if recorded:  # once: the replay (or the reconciler's LOST line) never logs it again
                log.info("Job %s finished: %s %s", self.job.pk, record.status, record.message)
            else:
                log.info("Job %s: its end (%s) was recorded already", self.job.pk, record.status)
            return True
        if self.spool is not None:
            log.error(
                "Job %s ended %s while the database was away; this host's spool records it once the"
                " database is back",
                self.job.pk,
                record.status,
            )
            self.spool.close()  # unlocked: spool_replay takes it from here
        else:
            log.error(
                "Job %s ended %s (%s) while the database was away, and this host has no spool to keep it:"
                " its end is not recorded; the reconciler marks it lost",
                self.job.pk,
                record.status,
                record.message,
            )
        return False

    def _stopping(self) -> bool:
        self.shutting_down = self.shutting_down or worker_stopping()
        return self.shutting_down


def _spool_for(job: Job) -> LogSpool | None:
    try:
        return LogSpool(spool_name(job.pk, job.created_at), cap_bytes=settings.JOB_LOG_MAX_MB * 1024 * 1024)
    except OSError:
        log.exception("Job %s: no spool on this host (JOB_SPOOL_DIR); its log waits in memory only", job.pk)
        return None


def job_claim(job_id: int, now: datetime | None = None) -> Job | None:
    """QUEUED → STARTING, once: a re-delivered message finds 0 rows and does nothing.

    Only while its owner's account is active, in the same UPDATE: a deactivated owner's job is
    cancelled instead, saying why (jobs.leavers.user_work_stop: with the rest of their work, in
    the audit log and to their leaders), and never runs."""
    now = now or timezone.now()
    claimed = Job.objects.filter(owner_active(), pk=job_id, status=Job.Status.QUEUED).update(
        status=Job.Status.STARTING, worker=socket.gethostname()[:200], heartbeat_at=now
    )
    if not claimed:
        left = Job.objects.select_related("owner").filter(pk=job_id, status=Job.Status.QUEUED).first()
        if left is not None and not left.owner.is_active:
            log.warning("Job %s not started: %s", job_id, deactivated(left.owner))
            user_work_stop(user=left.owner, reason=deactivated(left.owner), now=now)
        return None
    return _patiently(job_id, lambda: Job.objects.select_related("reservation", "server").get(pk=job_id))


def _patiently(job_id: int, step: Callable[[], T]) -> T:
    """A database step between the claim and the job's start: retried every 2 s while the
    database is away (a restart), for up to JOB_END_WAIT_SECONDS; raised after that (the job is
    then marked lost by the reconciler, its message saying the worker could not go on)."""
    deadline = time.monotonic() + settings.JOB_END_WAIT_SECONDS
    while True:
        try:
            return step()
        except DatabaseError:
            close_old_connections()
            if time.monotonic() >= deadline or worker_stopping():
                raise  # a worker shutting down waits for no database
            log.warning("Job %s: the database is away before the job's start; retrying in 2 s", job_id)
            time.sleep(2)


def job_run(job_id: int) -> str | None:
    """Claim and run a job to its end; returns its final status (None: not ours to run)."""
    job = job_claim(job_id)
    if job is None:
        log.info("Job %s is not queued (already claimed, cancelled or gone): nothing to do", job_id)
        return None
    if job.reservation.status_at(timezone.now()) != Reservation.Status.ACTIVE:
        Job.objects.filter(pk=job_id, status=Job.Status.STARTING).update(
            status=Job.Status.CANCELLED,
            finished_at=timezone.now(),
            message="Cancelled: the booking is not active (ended or cancelled before the job started).",
        )
        return Job.Status.CANCELLED
    supervisor = _patiently(job_id, lambda: Supervisor(job))
    supervisor.run()
    try:
        return Job.objects.values_list("status", flat=True).get(pk=job_id)
    except DatabaseError:  # away: the end waits in the spool, as the worker's log said
        close_old_connections()
        return supervisor.final_status

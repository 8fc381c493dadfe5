"""The worker's side of a job: claim it, build its environment, supervise the subprocess.

The worker never imports TensorFlow (GPU memory taken by a long-lived worker is never
given back): every job is a subprocess in its own session, started through
jobs/launcher-bin/launcher.py with the job's interpreter. Cancel and time limits send
SIGTERM to the job's process group and SIGKILL after JOB_KILL_GRACE_SECONDS.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db import DatabaseError, close_old_connections
from django.utils import timezone

from gpus.models import Allocation, Reservation
from jobs import paths
from jobs.environment import BookedCard, job_environment
from jobs.logs import LogWriter
from jobs.models import Job
from portal.errors import Invalid
from portal.processes import die_with_parent

log = logging.getLogger(__name__)

# In a folder of its own that is no package: Python puts the launcher's folder first on the
# job's sys.path, and nothing else in it may shadow a module of the user's or the standard library.
LAUNCHER = Path(__file__).resolve().parent / "launcher-bin" / "launcher.py"
TICK_SECONDS = 0.1
CANCEL_POLL_SECONDS = 1.0
DRAIN_SECONDS = 2.0  # output still read after the job's main process exited
FINISH_ATTEMPTS = 30  # × 2 s: ride out a database restart


class JobSetupError(Exception):
    """The job cannot start here (missing script, interpreter or folder): it FAILS, no retry."""


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    env_applied: dict[str, str]  # the portal's own variables, shown on the job's page
    account: pwd.struct_passwd | None  # JOB_USER's: the job runs as it (None: as the worker)


def launch_for(job: Job) -> Launch:
    """Everything the subprocess gets: argv, cwd and the environment built from the booking.

    The steps with side effects are here (the job's folder, the upload, chown); the environment
    itself comes from the pure `job_environment`."""
    # Every card of a booking holds the same memory_mb; the first card's size stands for all.
    first = Allocation.objects.select_related("gpu").get(
        reservation_id=job.reservation_id, gpu_id=job.gpu_uuids[0]
    )
    interpreter = settings.JOB_INTERPRETERS.get(job.interpreter)
    if not interpreter or not os.access(interpreter, os.X_OK):
        raise JobSetupError(
            f"Python environment {job.interpreter!r} ({interpreter or 'not configured'}) is not "
            f"executable on {socket.gethostname()}; check JOB_INTERPRETERS on this host."
        )
    account = _job_account()
    script, cwd = _prepare_folders(job, account)
    home = Path(interpreter).parent.parent  # a venv's root holds pyvenv.cfg, beside its bin/
    built = job_environment(
        job,
        BookedCard.of(first),
        inherited=os.environ,
        interpreter=interpreter,
        venv=str(home) if (home / "pyvenv.cfg").is_file() else None,
        server=settings.WORKER_SERVER,
        headroom_mb=settings.GPU_CONTEXT_HEADROOM_MB,
        account=account,
    )
    argv = [interpreter, "-u", str(LAUNCHER), str(script), *job.args]
    return Launch(argv=argv, env=built.env, cwd=cwd, env_applied=built.applied, account=account)


def _job_account() -> pwd.struct_passwd | None:
    """JOB_USER's account: jobs run as it, in its HOME (None: as the worker's own user)."""
    if not settings.JOB_USER:
        return None
    try:
        return pwd.getpwnam(settings.JOB_USER)
    except KeyError:
        raise JobSetupError(
            f"JOB_USER={settings.JOB_USER!r} is no account on {socket.gethostname()}."
        ) from None


def _prepare_folders(job: Job, account: pwd.struct_passwd | None) -> tuple[Path, Path]:
    """The script and the working directory, checked; an upload is written into the job's folder."""
    try:
        # The job's own folder: its default working directory and where an upload is put
        # (never into a chosen working directory, where it could overwrite the user's file).
        own = paths.roots()[0] / f"job-{job.pk}"
        own.mkdir(parents=True, exist_ok=True)
        cwd = (
            paths.checked_path(job.workdir, field="workdir", what="working directory") if job.workdir else own
        )
        if job.script_path:
            script = paths.checked_path(job.script_path, field="script_path", what="script path")
        else:
            script = own / job.name
            script.write_text(job.script_source)
        if account is not None:
            # The job's own folder becomes the job user's once the upload is in it: a worker
            # that is not root could not write there afterwards.
            os.chown(own, account.pw_uid, account.pw_gid)
    except Invalid as exc:
        raise JobSetupError(exc.message) from None
    except OSError as exc:
        raise JobSetupError(f"Cannot prepare the job's folder on {socket.gethostname()}: {exc}") from None
    if not script.is_file():
        raise JobSetupError(f"The script {script} does not exist on {socket.gethostname()}.")
    if not cwd.is_dir():
        raise JobSetupError(f"The working directory {cwd} does not exist on {socket.gethostname()}.")
    return script, cwd


def _pump(stream, out: queue.Queue[bytes | None]) -> None:  # type: ignore[no-untyped-def]
    """Reader thread: the job's single stdout+stderr pipe, as it comes, then None at EOF."""
    fd = stream.fileno()
    while True:
        data = os.read(fd, 65536)
        if not data:
            break
        out.put(data)
    out.put(None)


class Supervisor:
    """Run one claimed job to its end, recording everything on the Job row."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.writer = LogWriter(job.pk)
        self.proc: subprocess.Popen[bytes] | None = None
        self.stop_reason: str | None = None  # Job.Status to record once the process is gone
        self.stop_message = ""
        self.term_sent_at: float | None = None
        self.killed = False
        self.launcher_seen = False
        self.first_output = bytearray()  # the launcher's line is among the first output

    # --- the loop --------------------------------------------------------------------

    def run(self) -> None:
        job = self.job
        try:
            launch = launch_for(job)
        except JobSetupError as exc:
            self.writer.write_line(f"[portal] cannot start: {exc}")
            self.writer.close()
            self._finish(Job.Status.FAILED, None, str(exc))
            return
        self.writer.write_line(
            f"[portal] job {job.pk} on {settings.WORKER_SERVER} ({socket.gethostname()}): "
            f"{' '.join(launch.argv[3:])} in {launch.cwd}"
        )
        try:
            self.proc = subprocess.Popen(
                launch.argv,
                cwd=launch.cwd,
                env=launch.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,  # one pipe: stdout and stderr interleaved in order
                start_new_session=True,
                close_fds=True,
                # SIGKILL the job if the worker dies (SIGKILL, the OOM killer): a lost job
                # must not hold its cards behind the portal's back.
                preexec_fn=die_with_parent(signal.SIGKILL),
                # JOB_USER: jobs run as an account that cannot read the worker's secrets.
                **(
                    {"user": launch.account.pw_uid, "group": launch.account.pw_gid, "extra_groups": []}
                    if launch.account is not None
                    else {}
                ),
            )
        except OSError as exc:
            self.writer.write_line(f"[portal] cannot start: {exc}")
            self.writer.close()
            self._finish(Job.Status.FAILED, None, f"Could not start {launch.argv[0]}: {exc}")
            return
        now = timezone.now()
        Job.objects.filter(pk=job.pk, status=Job.Status.STARTING).update(
            status=Job.Status.RUNNING,
            pid=self.proc.pid,
            started_at=now,
            heartbeat_at=now,
            env_applied=launch.env_applied,
        )
        job.started_at = now
        self._supervise()

    def _supervise(self) -> None:
        assert self.proc is not None
        chunks: queue.Queue[bytes | None] = queue.Queue()
        reader = threading.Thread(target=_pump, args=(self.proc.stdout, chunks), daemon=True)
        reader.start()
        try:
            self._loop(chunks)
            code = self.proc.wait()
        except Exception:
            log.exception("Job %s: the supervisor failed", self.job.pk)
            code = self._kill_now()  # never leave a job running unwatched
        self._reap_group()
        self._drain(chunks)
        self._guarded(self.writer.close)
        self._record(code)

    def _loop(self, chunks: queue.Queue[bytes | None]) -> None:
        """Until the job has exited and its output is drained: log, heartbeat, cancel, limits."""
        assert self.proc is not None
        last_poll = last_beat = time.monotonic()
        eof = False
        exited_at: float | None = None
        while True:
            if exited_at is None and self.proc.poll() is not None:
                exited_at = time.monotonic()
            if exited_at is not None and (eof or time.monotonic() - exited_at > DRAIN_SECONDS):
                # Done; a child that kept the output pipe open (a server started in the
                # background) does not keep the job alive: _reap_group ends it.
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
                self.writer.feed(data)
            if eof:
                time.sleep(max(0.0, deadline - time.monotonic()))  # output closed; waiting for the exit
            self._guarded(self.writer.maybe_flush)
            now = time.monotonic()
            if now - last_poll >= CANCEL_POLL_SECONDS:
                last_poll = now
                beat = now - last_beat >= settings.JOB_HEARTBEAT_SECONDS
                if self._guarded(lambda: self._check_row(beat)) and beat:  # noqa: B023 - called at once
                    last_beat = now
            self._escalate()

    def _drain(self, chunks: queue.Queue[bytes | None]) -> None:
        """Whatever the job wrote just before the end."""
        with contextlib.suppress(queue.Empty):
            while (data := chunks.get(timeout=0.2)) is not None:
                self.writer.feed(data)

    def _guarded(self, step: Callable[[], object]) -> bool:
        """Run a database step; a failure (database restarting) is logged and tried again
        on the next tick. The log keeps what it could not write yet; a heartbeat missed for
        longer than JOB_LOST_AFTER_SECONDS makes the reconciler mark the job lost, which
        this loop then sees and honours."""
        try:
            step()
        except DatabaseError:
            log.warning("Job %s: database step failed; retrying", self.job.pk, exc_info=True)
            close_old_connections()
            return False
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
                "message",
                "reservation__end",
                "reservation__cancelled_at",
            )
            .get()
        )
        if self.stop_reason:
            return
        # The row is the record: the time limit counts from the start it shows.
        self.job.started_at = row["started_at"] or self.job.started_at
        if row["status"] == Job.Status.LOST:
            # Declared dead while this worker could not reach the database: its booking may
            # already hold a new job, so this one must not go on.
            self._stop(Job.Status.LOST, "This job was marked lost while its worker was out of touch.")
        elif row["cancel_requested_at"]:
            who = row["cancelled_by__username"]
            self._stop(
                Job.Status.CANCELLED, f"Cancelled by {who}." if who else row["message"] or "Cancelled."
            )
        elif row["reservation__cancelled_at"] and now >= row["reservation__end"]:
            self._stop(Job.Status.TIMED_OUT, "The booking was cancelled; the job was stopped.")
        elif now >= self.job.deadline(row["reservation__end"]):
            limit = self.job.time_limit_minutes
            if limit and now >= self.job.started_at + timedelta(minutes=limit):
                self._stop(Job.Status.TIMED_OUT, f"Time limit of {limit} min reached.")
            else:
                self._stop(Job.Status.TIMED_OUT, "The booking ended; the job was stopped.")

    def _stop(self, status: str, message: str) -> None:
        self.stop_reason, self.stop_message = status, message
        grace = settings.JOB_KILL_GRACE_SECONDS
        self.writer.write_line(f"[portal] {message} Sending SIGTERM; SIGKILL in {grace} s if still running.")
        self._signal(signal.SIGTERM)
        self.term_sent_at = time.monotonic()

    def _escalate(self) -> None:
        if self.term_sent_at is None or self.killed:
            return
        if time.monotonic() - self.term_sent_at >= settings.JOB_KILL_GRACE_SECONDS:
            self.writer.write_line("[portal] still running after the grace period: SIGKILL.")
            self._signal(signal.SIGKILL)
            self.killed = True

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)  # the session leader's pid is the group id

    def _kill_now(self) -> int:
        """The supervisor itself failed: stop the job at once rather than leave it unwatched."""
        log.error("Job %s: supervisor failed; killing the job", self.job.pk)
        self.stop_reason = self.stop_reason or Job.Status.FAILED
        self.stop_message = self.stop_message or "The worker's supervisor failed; the job was killed."
        self._signal(signal.SIGKILL)
        assert self.proc is not None
        return self.proc.wait()

    def _reap_group(self) -> None:
        """The main process is gone; anything it left in its group goes with it."""
        self._signal(signal.SIGKILL)

    def _record(self, code: int) -> None:
        if self.stop_reason:
            status, message = self.stop_reason, self.stop_message
        elif code == 0:
            status, message = Job.Status.SUCCEEDED, ""
        else:
            status = Job.Status.FAILED
            message = f"Exited with code {code}." if code > 0 else f"Killed by signal {-code}."
        self._finish(status, code, message)

    def _finish(self, status: str, code: int | None, message: str) -> None:
        """Record the outcome; a database that is restarting gets FINISH_ATTEMPTS tries.

        The worker's word is final even over LOST (marked while it was out of touch)."""
        for attempt in range(FINISH_ATTEMPTS):
            try:
                Job.objects.filter(
                    pk=self.job.pk, status__in=(Job.Status.STARTING, Job.Status.RUNNING, Job.Status.LOST)
                ).update(status=status, exit_code=code, finished_at=timezone.now(), message=message[:1000])
                break
            except DatabaseError:
                if attempt == FINISH_ATTEMPTS - 1:
                    raise
                log.warning("Job %s: could not record its end; retrying", self.job.pk)
                close_old_connections()
                time.sleep(2)
        log.info("Job %s finished: %s %s", self.job.pk, status, message)


def job_claim(job_id: int, now: datetime | None = None) -> Job | None:
    """QUEUED → STARTING, once: a re-delivered message finds 0 rows and does nothing."""
    now = now or timezone.now()
    claimed = Job.objects.filter(pk=job_id, status=Job.Status.QUEUED).update(
        status=Job.Status.STARTING, worker=socket.gethostname()[:200], heartbeat_at=now
    )
    if not claimed:
        return None
    return Job.objects.select_related("reservation", "server").get(pk=job_id)


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
    Supervisor(job).run()
    return Job.objects.values_list("status", flat=True).get(pk=job_id)

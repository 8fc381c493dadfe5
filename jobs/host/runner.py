"""The worker's side of a job: claim it, build its environment, supervise the subprocess.

The worker never imports TensorFlow (GPU memory taken by a long-lived worker is never
given back): every job is a subprocess in its own session, started through
jobs/host/launcher-bin/launcher.py with the job's interpreter, without any of the worker's
privileges, by the executor `executor_for` gives (jobs/host/executors: starting, signalling, sweeping
and reaping the job's processes live there). Cancel and time limits send SIGTERM to the job's
processes and SIGKILL after JOB_KILL_GRACE_SECONDS. A worker that may not signal its job
(JOB_USER without CAP_KILL) says so on the job and in its log, and keeps watching it until it
ends by itself. While the database is away, or hangs, the supervisor keeps the job's last known
deadline and enforces it alone: the database steps run in a thread of their own and the
deadline, the worker's shutdown and the SIGKILL escalation in another that never waits on them;
the job's end waits in this host's spool (jobs/host/end.py, jobs/host/replay.py).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TypeVar

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DatabaseError, close_old_connections, connections
from django.db.models.functions import Now
from django.utils import timezone

from gpus.booking_ends import ENDED_EARLY_FIELDS, ended_early_of, ended_early_words, not_started_words
from gpus.models import Reservation
from jobs.environment import JobSetupError
from jobs.host.checkpoints import came_back_words, checkpoint_after, checkpoint_ready
from jobs.host.dcgm import job_name, work_ended, work_started
from jobs.host.end import job_end_keep
from jobs.host.executors import Run, RunEnd, RunOutput, executor_for
from jobs.host.executors.output import follow
from jobs.host.launch import image_ready, job_claim, launch_for, patiently
from jobs.host.slurm_runner import slurm_job_run
from jobs.host.spool import EndRecord, job_spool, stop_flag, worker_stopping
from jobs.logs.store import LogWriter
from jobs.metrics import MetricsRecorder
from jobs.models import Job
from jobs.preemption import BOOKING_ENDED, deadline_stop, preempted_words, requeue_unstarted, shut_down_words
from jobs.runs import (
    CANCELLED_FIELDS,
    LOST_FOUND_ALIVE,
    cancelled_words,
    queued_job_ended,
    stopped_before_start,
)
from portal.unreachable import WHAT, outage_of

log = logging.getLogger(__name__)
T = TypeVar("T")

TICK_SECONDS = 0.1
CANCEL_POLL_SECONDS = 1.0
# The row unread for this long (the database away, or a query that hangs): the last deadline it
# gave is enforced without it.
STALE_ROW_SECONDS = 3 * CANCEL_POLL_SECONDS
BEAT_WAIT_SECONDS = 10.0  # how long a job's end waits for a heartbeat in flight (`_reap`)
CANNOT_STOP = "Could not stop: permission denied"


class Supervisor:
    """Run one claimed job to its end, recording everything on the Job row."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.spool = job_spool(job.pk, job.created_at)
        try:
            self.writer = LogWriter(job.pk, spool=self.spool)
        except Exception:
            if self.spool is not None:
                self.spool.close()  # and its lock: the next try takes it again
            raise
        self.metrics = MetricsRecorder(job.pk)  # the training curves, taken out of the output
        self.executor = executor_for(job)
        self.session: Run | None = None  # the job's processes, once started
        self.booking_end: datetime = job.reservation.end  # the last deadline the database gave
        self.db_away: str | None = None  # the outage a database step last met, said once
        self.stop_reason: str | None = None  # Job.Status to record once the process is gone
        self.final_status: str | None = None  # the end as the worker saw it, stored or spooled
        self.stop_message = ""
        self.term_sent_at: float | None = None
        self.grace = settings.JOB_KILL_GRACE_SECONDS  # SIGTERM to SIGKILL: a preemption sets its own
        self.killed = False
        self.not_stopped = ""  # why the job could not be stopped, for its final message
        self.launcher_seen = False
        self.first_output = bytearray()  # the launcher's line is among the first output
        # The worker's shutdown, told without the database (prefork: the parent; solo: itself).
        self.stop_flags = [flag for pid in {os.getpid(), os.getppid()} if (flag := stop_flag(pid))]
        self.shutting_down = False
        self.running_recorded = False
        self.env_applied: dict[str, str] = {}
        # Stop decisions come from three threads (the loop, the database steps, the enforcer):
        # one at a time. What they say for the job's log waits in `notes` for the loop, the
        # writer's one user. Once `closed` (the leader has exited) no thread decides anything,
        # and no heartbeat is taken: every one is from before the leader is reaped.
        self.lock = threading.RLock()
        # Held by the database thread's heartbeat UPDATE: a beat is the database's `Now()`, so it
        # is taken when the statement runs, and the leader is reaped only after it (`_reap`).
        self.beating = threading.Lock()
        self.notes: deque[str] = deque()
        self.closed = False
        self.row_read_at = time.monotonic()
        self.db_later: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self.db_failed = False
        self.unlisted_said = False
        self.main_thread = threading.get_ident()  # the one that must react to a stop

    # --- the loop --------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        finally:
            # Whatever happened, the spool's lock is let go: what it keeps goes to the replay.
            if self.spool is not None:
                self.spool.close()

    def _run(self) -> None:
        job = self.job
        if self.spool is None:
            self.writer.write_line(
                "[portal] this host's spool (JOB_SPOOL_DIR) cannot be used (the worker's log says why):"
                " should the database go away, this job's output waits in the worker's memory only."
            )
        try:
            launch = checkpoint_ready(launch_for(job), job)  # a preemptible job's checkpoint folder
            # A first use pulls it, saying so in the log, the job's heartbeat kept meanwhile.
            image_ready(launch, self.writer.write_line, self._starting_beat)
        except JobSetupError as exc:
            if self._ended_before_start():  # a pull stopped by a cancel: the cancel is the end
                return
            self.writer.write_line(f"[portal] cannot start: {exc}")
            self._guarded(self.writer.close)
            self._finish(Job.Status.FAILED, None, str(exc))
            return
        if self._ended_before_start():
            return
        if job.preemptions:
            self.writer.write_line(came_back_words(job, launch.env_applied))
        where = f" in image {launch.image.name}" if launch.image else ""
        self.writer.write_line(
            f"[portal] job {job.pk} on {settings.WORKER_SERVER} ({socket.gethostname()}){where}: "
            f"{' '.join(launch.argv[3:])} in {launch.cwd}"
        )
        # As JOB_USER's account (launch.account): jobs run as one that cannot read the worker's secrets.
        spec = launch.spec(f"Job {job.pk}", job.gpu_uuids)
        # DCGM's hpc_job label (jobs/host/dcgm.py), written before the process starts: a job's
        # first use of its cards is already its (after the start, a quick job could run unnamed).
        work_started(job_name(job.pk), job.gpu_uuids)
        try:
            self.session = self.executor.start(spec)  # its identity, taken before anything can reap it
        except OSError as exc:  # _finish takes the label away again
            self.writer.write_line(f"[portal] cannot start: {exc}")
            self.writer.close()
            self._finish(Job.Status.FAILED, None, f"Could not start {launch.argv[0]}: {exc}")
            return
        job.started_at = timezone.now()
        self.env_applied = launch.env_applied
        # Its process runs now, whatever the database says: watched from here on, and the row
        # told it runs as soon as the database answers (tried again on every poll until then).
        self.running_recorded = self._guarded(self._record_running)
        self._supervise()

    def _starting_beat(self) -> bool:
        """The heartbeat while the job's image is pulled; False once the job is not to start any
        more (cancelled, preempted, taken for lost): the pull stops (launch.image_ready_for)."""
        return bool(
            Job.objects.filter(
                pk=self.job.pk,
                status=Job.Status.STARTING,
                cancel_requested_at=None,
                preempt_requested_at=None,
            ).update(heartbeat_at=Now())
        )

    def _ended_before_start(self) -> bool:
        """Whether a cancel or a preemption came before the start (jobs.runs.stopped_before_start),
        and if so the job's end recorded, the job never started."""
        status, stopped = patiently(self.job.pk, lambda: stopped_before_start(self.job.pk))
        if not stopped:
            return False
        again = " this time" if status == Job.Status.PENDING else ""
        self.writer.write_line(f"[portal] {stopped} The job never started{again}.")
        self._guarded(self.writer.close)
        self._finish(status, None, stopped)
        return True

    def _record_running(self) -> None:
        assert self.session is not None and self.job.started_at is not None
        with self.lock:
            if self.closed:
                return  # its end records it; no heartbeat from after the leader's exit
            self.beating.acquire()  # never held long by another: the beats are this thread's too
        try:
            self._mark_running()
        finally:
            self.beating.release()

    def _mark_running(self) -> None:
        assert self.session is not None
        Job.objects.transition(
            self.job.pk,
            from_=Job.Status.STARTING,
            to=Job.Status.RUNNING,
            # pid and start together name the job's session for good (the orphan sweep's proof).
            pid=self.session.leader.pid,
            pid_started=self.session.leader.started,
            started_at=self.job.started_at,
            heartbeat_at=Now(),  # the database's clock (portal.clock), the reconciler's too
            env_applied=self.env_applied,
        )

    def _supervise(self) -> None:
        assert self.session is not None
        output = self.session.output
        self.row_read_at = time.monotonic()
        enforcer = self._helper(self._enforce, "enforcer")
        self._helper(self._db_steps, "db")
        try:
            self._loop()
        except Exception:
            log.exception("Job %s: the supervisor failed", self.job.pk)
            self._kill_now()  # never leave a job running unwatched
        # The main process has exited but is not reaped: its pid still names the session, so the
        # sweep cannot reach a process that took the pid since. Reaped only after it and after the
        # last output, so that every heartbeat is from while the leader was unreaped (the proof
        # kill_orphans takes Job.heartbeat_at for).
        self.executor.wait(self.session)
        with self.lock:
            self.closed = True
        self.db_later.put(None)  # a database step that hangs is left to itself: it decides nothing now
        enforcer.join(timeout=5)
        self._end_session()
        self._drain(output)
        end = self._reap()
        self._write_notes()
        self._guarded(self.writer.close)
        self._record(end)

    def _reap(self) -> RunEnd:
        """Reap the leader once no heartbeat UPDATE is in flight: a beat is the database's time of
        that statement, and kill_orphans trusts Job.heartbeat_at as a moment the session id was
        still the job's. A database that holds the statement past BEAT_WAIT_SECONDS (frozen) does
        not hold the job's end: said in the worker's log, and the leader reaped."""
        assert self.session is not None
        if self.beating.acquire(timeout=BEAT_WAIT_SECONDS):
            self.beating.release()
        else:
            log.warning(
                "Job %s: a heartbeat was still in flight %s s after the job ended; reaped anyway",
                self.job.pk,
                BEAT_WAIT_SECONDS,
            )
        return self.executor.collect(self.session)

    def _helper(self, target: Callable[[], None], what: str) -> threading.Thread:
        """A thread of this supervisor's with a database connection of its own (closed at its
        end), so that a query that hangs there holds up no other thread's. Only inside a
        caller's open transaction (a test's) is the caller's connection shared: the rows it
        wrote are seen through it alone."""
        conn = connections[DEFAULT_DB_ALIAS]
        shared = conn.in_atomic_block
        if shared:
            conn.inc_thread_sharing()

        def run() -> None:
            if shared:
                connections[DEFAULT_DB_ALIAS] = conn
            try:
                target()
            finally:
                if shared:
                    conn.dec_thread_sharing()
                else:
                    connections.close_all()  # this thread's own

        thread = threading.Thread(target=run, name=f"job-{self.job.pk}-{what}", daemon=True)
        thread.start()
        return thread

    def _loop(self) -> None:
        """Until the job has exited and its output is drained (jobs/host/executors/output.py): its
        output to the log and the metrics. Cancel, limits and the shutdown are decided by the other
        threads (`_db_steps`, `_enforce`); their lines for the log are written here."""
        assert self.session is not None
        follow(
            self.executor,
            self.session,
            take=self._take_first_output,
            tick=self._tick,
            tick_seconds=TICK_SECONDS,
            drain_seconds=settings.JOB_DRAIN_SECONDS,
        )

    def _take_first_output(self, data: bytes) -> None:
        self._note_launcher_line(data)
        self._take_output(data)

    def _tick(self) -> None:
        if self.db_failed:
            raise RuntimeError("the supervisor's database steps failed")
        self._write_notes()
        if late := self.metrics.release():  # held back in case it became a record; it did not
            self.writer.feed(late)
        self._guarded(self.writer.maybe_flush)
        self._guarded(self.metrics.maybe_flush)

    def _say(self, line: str) -> None:
        """A line for the job's log from any thread; the loop writes it (`_write_notes`)."""
        self.notes.append(line)

    def _write_notes(self) -> None:
        while self.notes:
            self.writer.write_line(self.notes.popleft())

    def _db_steps(self) -> None:
        """The database's part, in a thread of its own: a query that hangs holds up no deadline
        (`_enforce`). Until the supervisor closes: the running mark until it is stored, the steps
        handed to it (`db_later`), and every CANCEL_POLL_SECONDS the row (heartbeat, cancel,
        booking end), whose decisions are taken when it answers."""
        last_beat = time.monotonic()
        next_poll = last_beat + CANCEL_POLL_SECONDS
        try:
            while not self.closed:
                try:
                    step = self.db_later.get(timeout=max(0.0, next_poll - time.monotonic()))
                except queue.Empty:
                    now = time.monotonic()
                    next_poll = now + CANCEL_POLL_SECONDS
                    if not self.running_recorded:
                        self.running_recorded = self._guarded(self._record_running)
                    beat = now - last_beat >= settings.JOB_HEARTBEAT_SECONDS
                    if self._guarded(lambda: self._check_row(beat), reads=True):  # noqa: B023 - called at once
                        self.row_read_at = time.monotonic()
                        last_beat = now if beat else last_beat
                    continue
                if step is None:
                    return
                self._guarded(step)
        except Exception:
            if not self.closed:  # the loop sees it and kills the job rather than leave it unwatched
                log.exception("Job %s: the supervisor's database steps failed", self.job.pk)
                self.db_failed = True

    def _enforce(self) -> None:
        """Every tick, whatever the database does: the worker's shutdown, the last deadline the
        database gave (once its row has gone unread for STALE_ROW_SECONDS), SIGKILL after the
        grace period. Nothing here waits for the database."""
        while not self.closed:
            try:
                with self.lock:
                    if self.closed:
                        return
                    self._check_shutdown()
                    if time.monotonic() - self.row_read_at > STALE_ROW_SECONDS:
                        self._check_deadline_alone()
                    self._escalate()
            except Exception:
                log.exception("Job %s: the supervisor's enforcer failed; trying again", self.job.pk)
            time.sleep(TICK_SECONDS)

    def _drain(self, output: RunOutput) -> None:
        """Whatever the job wrote just before the end, for JOB_DRAIN_SECONDS at most, heartbeat
        kept (the leader is not reaped yet): a process that left the job's session (setsid) and
        holds the pipe must not hold the supervisor (and its pool process) for ever. Past that
        the pipe is closed, saying so. Nothing to wait for once the loop saw the output's end."""

        def beat() -> None:
            # On this (the main) thread, before the reap: the statement's time is from before it.
            self._guarded(lambda: Job.objects.filter(pk=self.job.pk).update(heartbeat_at=Now()))

        self._write_notes()
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
        """The job's training records to their table (jobs/metrics.py), the rest of its output to the log.
        The portal's lines waiting to be written go first: a line says why before the signal it
        announces is sent (`_stop`), so the job's answer to that signal comes after it in the log."""
        self._write_notes()
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
        always `reads` the database proves it back (a flush with nothing pending reaches none).
        While the worker shuts down and the database does not answer, the main thread tries
        nothing: the log and the end wait in the spool (`skips_database`)."""
        if self.skips_database():
            return False
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
            self.writer.backoff = 0.0  # its log waits for no backoff now (LogWriter.flush)
        return True

    def skips_database(self) -> bool:
        """The worker is stopping and the row has gone unread for STALE_ROW_SECONDS (the database
        away or frozen): the main thread, which must end the job and return, waits for no query.
        The database thread keeps trying (each query has its deadline, portal/postgresql)."""
        return (
            self.shutting_down
            and threading.get_ident() == self.main_thread
            and time.monotonic() - self.row_read_at > STALE_ROW_SECONDS
        )

    def _note_launcher_line(self, data: bytes) -> None:
        if self.launcher_seen or len(self.first_output) > 8192:
            return
        self.first_output += data
        for line in bytes(self.first_output).split(b"\n")[:-1]:
            if line.startswith(b"[portal] launcher:"):
                self.launcher_seen = True
                text = line.decode(errors="replace")[:1000]
                self.db_later.put(lambda: Job.objects.filter(pk=self.job.pk).update(launcher_line=text))  # noqa: B023
                return

    def _check_row(self, beat: bool) -> None:
        """Heartbeat, and pick up a cancel request or a moved booking end (release, cancel)."""
        with self.lock:
            if self.closed:
                return
            now = timezone.now()  # this host's clock: for the deadlines _apply_row checks here
            # Closed is checked and the beat claimed at once: the leader is reaped only after it.
            beating = beat and self.beating.acquire(blocking=False)
        if beating:
            try:
                # The database's clock, as the reconciler's cut-off (portal.clock); a beat the
                # kill_orphans proof may trust, as the reap waits for it (`_reap`).
                Job.objects.filter(pk=self.job.pk).update(heartbeat_at=Now())
            finally:
                self.beating.release()
        row = (
            Job.objects.filter(pk=self.job.pk)
            .values(
                "status",
                "started_at",
                "cancel_requested_at",
                *CANCELLED_FIELDS,
                "watchdog_stop",
                "preempt_requested_at",
                "preempt_reason",
                "preempt_grace_seconds",
                "reservation__end",
                *(f"reservation__{field}" for field in ENDED_EARLY_FIELDS),
            )
            .get()
        )
        with self.lock:
            if not (self.stop_reason or self.closed):
                self._apply_row(row, now)

    def _apply_row(self, row: dict, now: datetime) -> None:
        """What the row says, taken under the lock (it may arrive while the enforcer acts)."""
        # The row is the record: the time limit counts from the start it shows; both are kept
        # to be enforced without the database while it is away (_check_deadline_alone).
        self.job.started_at = row["started_at"] or self.job.started_at
        self.booking_end = row["reservation__end"]
        if row["status"] == Job.Status.LOST:
            # Declared dead while this worker could not reach the database: its booking may
            # already hold a new job, so this one must not go on (jobs.runs: a lost run is stopped,
            # never taken back; its end, recorded LOST, tells the owner and the audit log).
            self._stop(Job.Status.LOST, f"This job was stopped: {LOST_FOUND_ALIVE}.")
        elif row["watchdog_stop"]:
            self._stop(Job.Status.FAILED, row["watchdog_stop"])
        elif row["cancel_requested_at"]:
            self._stop(Job.Status.CANCELLED, cancelled_words(row))
        elif row["preempt_requested_at"]:
            # Asked to leave its cards (jobs.preemption): stopped, then back in the queue, not ended.
            grace = row["preempt_grace_seconds"] or settings.PREEMPT_GRACE_SECONDS
            self._stop(Job.Status.PENDING, preempted_words(row["preempt_reason"]), grace=grace)
        elif (early := ended_early_words(row, "reservation__")) and now >= row["reservation__end"]:
            # Released or cancelled early, by its owner, a leader, an admin or the portal: one rule
            # (gpus.booking_ends). Nobody's time ran out: cancelled, saying who and why.
            self._stop(Job.Status.CANCELLED, f"Cancelled: {early}.")
        elif why := self._past_deadline(now):
            self._stop(*deadline_stop(self.job, why))

    def _past_deadline(self, now: datetime) -> str:
        """Why the job must stop now (its time limit, its booking's end), from the last start and
        booking end the database gave; "" while it may run on."""
        if now < self.job.deadline(self.booking_end):
            return ""
        limit = self.job.time_limit_minutes
        if limit and self.job.started_at and now >= self.job.started_at + timedelta(minutes=limit):
            return f"Time limit of {limit} min reached."
        return BOOKING_ENDED

    def _check_deadline_alone(self) -> None:
        """The database is away or hangs: the last deadline it gave still holds, enforced here
        alone. The job's end is recorded once the database answers (this host's spool keeps it
        till then)."""
        if not self.stop_reason and (why := self._past_deadline(timezone.now())):
            self._say(
                "[portal] the database is away: the job is stopped by the last deadline it gave;"
                " its end is recorded when the database answers."
            )
            self._stop(*deadline_stop(self.job, why))

    def _check_shutdown(self) -> None:
        if self.shutting_down or not any(flag.exists() for flag in self.stop_flags):
            return
        self.shutting_down = True  # its end is then spooled at once, never waited for
        if self.stop_reason:
            return
        if self.job.preemptible and self.job.queued:
            # Nobody cancelled it: back to the queue as a preempted job (jobs.preemption), to
            # resume from its checkpoint, never counted as cancelled (running_jobs_stop's rule).
            self._stop(Job.Status.PENDING, preempted_words(shut_down_words(socket.gethostname())))
        else:
            self._stop(Job.Status.CANCELLED, f"The worker on {socket.gethostname()} shut down.")

    def _stop(self, status: str, message: str, *, grace: int | None = None) -> None:
        """Stop the job, to be recorded as `status` (PENDING: preempted, back to the queue)."""
        self.stop_reason, self.stop_message = status, message
        self.grace = grace = grace or settings.JOB_KILL_GRACE_SECONDS
        self._say(f"[portal] {message} Sending SIGTERM; SIGKILL in {grace} s if still running.")
        self.term_sent_at = time.monotonic()
        if not self._signal(signal.SIGTERM):
            self._stop_denied()

    def _stop_denied(self) -> None:
        """The worker may not signal the job (JOB_USER without CAP_KILL). Crashing would leave it
        running unwatched; instead it runs on, watched as before (heartbeat, log, its end
        recorded when it comes), and its row says so while it does."""
        self.not_stopped = f"{CANNOT_STOP}; it ran until it ended by itself."
        self._say(
            "[portal] could not send SIGTERM: permission denied. The job runs on; "
            "the portal keeps watching it and records its end."
        )
        note = f"{self.stop_message} {CANNOT_STOP}; the job is still running."[:1000]
        self.db_later.put(
            lambda: Job.objects.filter(pk=self.job.pk, status=Job.Status.RUNNING).update(message=note)
        )

    def _escalate(self) -> None:
        if self.term_sent_at is None or self.killed:
            return
        if time.monotonic() - self.term_sent_at >= self.grace:
            self._say("[portal] still running after the grace period: SIGKILL.")
            self.killed = True  # one attempt: a denied SIGKILL is said once, not on every tick
            if not self._signal(signal.SIGKILL):
                self._say("[portal] could not send SIGKILL: permission denied.")

    def _signal(self, sig: signal.Signals) -> bool:
        """Signal every process of the job, each by its identity (jobs/host/executors); False when the
        worker may not. What the executor has to say about it goes to the job's log."""
        assert self.session is not None
        done = self.executor.signal(self.session, sig)
        for line in done.lines:
            self._say(line)
        return not done.denied

    def _kill_now(self) -> None:
        """The supervisor itself failed: stop the job at once rather than leave it unwatched."""
        log.error("Job %s: supervisor failed; killing the job", self.job.pk)
        with self.lock:
            try:
                killed = self._signal(signal.SIGKILL)
            except Exception:  # its end is still waited for, reaped and recorded
                log.exception("Job %s: could not kill it; waiting for it to end by itself", self.job.pk)
                killed = False
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
        """The main process is gone; whatever it left goes with it (the executor's sweep). A
        failure there still lets the leader be reaped and the end recorded."""
        assert self.session is not None
        done = self.executor.sweep(self.session)
        for line in done.lines:
            self._say(line)
        self.not_stopped = self.not_stopped or done.problem

    def _record(self, end: RunEnd) -> None:
        code = end.returncode
        if self.stop_reason:
            status, message = self.stop_reason, self.stop_message
        elif code == 0:
            status, message = Job.Status.SUCCEEDED, ""
        elif not self.launcher_seen and (why := self.executor.did_not_start(end)):
            status, message = Job.Status.FAILED, why  # the launcher never ran: the executor's failure
        else:
            status, message = Job.Status.FAILED, end.describe()
        dropped = self.spool.dropped_note if self.spool is not None else ""
        self._finish(status, code, " ".join(filter(None, (message, self.not_stopped, dropped))))

    def _finish(self, status: str, code: int | None, message: str) -> None:
        """Record the outcome after the log's last bytes, once: spooled first, then stored, or
        left to this host's spool thread while the database is away (jobs/host/end.py).

        The worker's word is final even over LOST (marked while it was out of touch)."""
        self.final_status = status
        work_ended(job_name(self.job.pk))
        sent = self.job.dispatched_at
        record = EndRecord(
            status=status,
            exit_code=code,
            message=message[:1000],
            finished_at=timezone.now().isoformat(),
            run=sent.isoformat() if sent else "",
        )
        stored = job_end_keep(
            self.job.pk,
            record,
            writer=self.writer,
            spool=self.spool,
            stopping=self._stopping,
            skips_database=self.skips_database,
        )
        work_ended(job_name(self.job.pk))  # again: a refresh may have read the row before its end
        if stored:
            self._guarded(lambda: queued_job_ended(self.job))
        if stored:  # ended for good, its checkpoint folder goes; a requeued job keeps it
            self._guarded(lambda: checkpoint_after(self.job, status))

    def _stopping(self) -> bool:
        self.shutting_down = self.shutting_down or worker_stopping()
        return self.shutting_down


def job_run(job_id: int) -> str | None:
    """Claim and run a job to its end; returns its final status (None: not ours to run)."""
    if settings.GPU_BACKEND == "slurm":  # this worker is a Slurm cluster's (jobs/host/slurm_runner.py)
        return slurm_job_run(job_id)
    job = job_claim(job_id)
    if job is None:
        log.info("Job %s is not queued (already claimed, cancelled or gone): nothing to do", job_id)
        return None
    if (status := job.reservation.status_at(timezone.now())) != Reservation.Status.ACTIVE:
        # Ended or ended early before its start: who ended it and why, by the one rule.
        if requeue_unstarted(job):  # a borrower whose loan ended meanwhile
            return Job.Status.PENDING
        asked, cancelled = stopped_before_start(job_id)  # a person's cancel meanwhile says who
        why = (
            cancelled
            if asked == Job.Status.CANCELLED
            else "Cancelled: the booking had not started when the worker took the job."
            if status == Reservation.Status.UPCOMING
            else not_started_words(ended_early_of(job.reservation), job.reservation.end)
        )
        Job.objects.transition(
            job_id,
            from_=Job.Status.STARTING,
            to=Job.Status.CANCELLED,
            finished_at=timezone.now(),
            message=why,
        )
        return Job.Status.CANCELLED
    supervisor = patiently(job_id, lambda: Supervisor(job))
    supervisor.run()
    if supervisor.skips_database():  # stopping, the database not answering: as the log said
        return supervisor.final_status
    try:
        return Job.objects.values_list("status", flat=True).get(pk=job_id)
    except DatabaseError:  # away: the end waits in the spool, as the worker's log said
        close_old_connections()
        return supervisor.final_status

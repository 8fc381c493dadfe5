"""The worker's side of a job on a Slurm cluster (issue 37; docs/slurm.md): claim it, write its
folder on the shared filesystem, submit it as its owner through the Slurm executor
(jobs/host/executors/slurm.py), then follow it to its end: Slurm's state and reason on the row,
its output file into the job's log as it grows, a cancel as `scancel`, and its end recorded once
(jobs.runs.job_end_record), as a GPU host's supervisor records one.

The worker runs on the cluster's login node (GPU_BACKEND=slurm, WORKER_SERVER = the cluster's
server name), as root: `sbatch --uid` is root's. It beats for the job while it follows it. A
worker that restarts follows its jobs again (`slurm_jobs_resume`), their output from where their
log had it (`Job.slurm_output_offset`, stored with the log's bytes); the reconciler marks a Slurm
job lost only after SLURM_LOST_AFTER_SECONDS without a beat, and Slurm runs it on meanwhile.

A cluster that stops answering is said once in the job's log and on its page (`slurm_reason`); the
worker keeps trying, and the job's end is read when Slurm answers again, from its completion log
if Slurm has forgotten the job meanwhile. Not for ever: a cluster silent, or a job in a state the
portal does not know, for SLURM_LOST_AFTER_SECONDS ends the job lost, saying what Slurm last said
and when (its log, its owner's end notice, the audit log).
"""

from __future__ import annotations

import json
import logging
import pwd
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection
from django.db.models.functions import Now
from django.utils import timezone

from gpus.booking_ends import ENDED_EARLY_FIELDS, ended_early_words
from gpus.models import Reservation
from gpus.slurm_cli import SlurmError, SlurmRefused, SlurmTimedOut, SlurmUnreachable
from gpus.slurm_inventory import commands_for
from jobs.host.executors.base import RunEnd, RunSpec
from jobs.host.executors.slurm import (
    READ_MAX,
    FileOutput,
    SlurmExecutor,
    SlurmJobState,
    SlurmRequest,
    SlurmRun,
    slurm_job_name,
)
from jobs.host.launch import LAUNCHER, job_claim, patiently
from jobs.host.slurm_setup import (
    SlurmSetupError,
    job_account,
    job_folder,
    job_folder_make,
    jobcomp_location,
    partition_check,
)
from jobs.host.spool import EndRecord
from jobs.logs.store import LogWriter
from jobs.models import Job
from jobs.runs import CANCELLED_FIELDS, cancelled_words, job_end_record
from portal.models import AuditEntry
from portal.timefmt import format_duration, format_time

log = logging.getLogger(__name__)

TICK_SECONDS = 0.2  # how often the output file is read
TAKE_MAX = 8 << 20  # the most of it read in one tick: Slurm is still asked, and the job beats
STATE_SECONDS = 1.0  # how often Slurm is asked, and the job beats
OUTPUT = "output.log"
RESERVATION_WAIT_SECONDS = 30
LOOKUP_SECONDS = 120  # how long a job whose sbatch timed out is looked for while Slurm does not answer
FOLLOWED = (Job.Status.STARTING, Job.Status.RUNNING)


def slurm_job_run(job_id: int) -> str | None:
    """Claim job `job_id`, submit it to this worker's Slurm cluster and follow it to its end;
    its final status (None: not ours to run). Again for the same id: a no-op (the claim)."""
    job = job_claim(job_id)
    if job is None:
        log.info("Job %s is not queued (already claimed, cancelled or gone): nothing to do", job_id)
        return None
    return SlurmFollower(job).run()


def slurm_jobs_resume(server: str) -> list[int]:
    """At the start of a cluster's worker, before it takes any message: the jobs its previous
    worker was following (starting or running on `server`: one worker serves one server, and a
    stopped worker's leftovers are ended with it, by systemd or runportal), each followed again
    in a thread of its own. Their ids."""
    ids = list(Job.objects.filter(server__name=server, status__in=FOLLOWED).values_list("pk", flat=True))
    for pk in ids:
        threading.Thread(target=_resume, args=(pk,), name=f"slurm-resume-{pk}", daemon=True).start()
    return ids


def _resume(job_id: int) -> None:
    def follower() -> SlurmFollower | None:
        related = Job.objects.select_related("reservation", "server", "server__slurm")
        job = related.filter(pk=job_id, status__in=FOLLOWED).first()
        return SlurmFollower(job) if job is not None else None

    try:
        # The database may go away again just after the worker's start found it (a restart):
        # waited for, as the start waited, or the job would turn lost while Slurm runs it on.
        if (found := patiently(job_id, follower)) is not None:
            found.resume()
    except Exception:  # a thread's end: said, and the reconciler's cut-off still holds for the job
        log.exception("Job %s: following it again failed", job_id)
    finally:
        connection.close()  # this thread's own


@dataclass
class SlurmNews:
    """What Slurm last said of a followed job, and when: what a follower gives up on."""

    heard: float = field(default_factory=time.monotonic)  # Slurm's last answer
    known: float = field(default_factory=time.monotonic)  # the last state the portal knows
    said: str = ""  # e.g. "PENDING (Resources)"
    said_at: datetime | None = None
    silent_since: datetime | None = None  # the first question unanswered since its last answer

    def answered(self, state: SlurmJobState) -> None:
        self.heard, self.silent_since = time.monotonic(), None
        if state.known:
            self.known = self.heard
        self.said = state.state + (f" ({state.reason})" if state.reason else "")
        self.said_at = timezone.now()

    def silent(self) -> None:
        self.silent_since = self.silent_since or timezone.now()

    def given_up(self, server: str, why_silent: str) -> str:
        """Why the job is followed no more, "" while it is: its cluster silent, or Slurm naming a
        state the portal does not know, for SLURM_LOST_AFTER_SECONDS."""
        limit, now = settings.SLURM_LOST_AFTER_SECONDS, time.monotonic()
        if now - self.heard >= limit:
            since = format_time(self.silent_since or timezone.now())
            why = f"Slurm cluster {server} has not answered since {since} ({why_silent})"
        elif now - self.known >= limit:
            unknown_for = format_duration(timedelta(seconds=now - self.known))
            why = f"Slurm has named a state the portal does not know for {unknown_for}"
        else:
            return ""
        last = (
            f"Slurm last said {self.said} at {format_time(self.said_at)}"
            if self.said_at
            else "Slurm said nothing of it since this worker followed it"
        )
        return f"{why}; {last}"


class SlurmFollower:
    """One claimed job, from sbatch to its end."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.cluster = job.server.slurm
        self.commands = commands_for(self.cluster)
        self.writer = LogWriter(job.pk)
        self.cancel_sent = False
        self.unreachable_said = ""
        self.unknown_said = ""
        self.running_recorded = False
        self.output_refused = False
        self.lost_said = ""
        self.database_away = False  # the follower's last pass met a database outage
        self.stopped: tuple[str, str] | None = None  # (status, message) of the portal's own stop
        self.news = SlurmNews()

    def run(self) -> str:
        try:
            account, folder = self._prepare()
            request = self._request(folder)
            argv = self._argv(folder)
        except SlurmSetupError as exc:
            return self._end(
                "failed", None, f"Could not send it to Slurm: {exc}", f"[portal] cannot start: {exc}"
            )
        executor = SlurmExecutor(self.commands, request)
        spec = RunSpec(argv, self._env(), self.job.workdir or folder, slurm_job_name(self.job.pk), account)
        try:
            run = self._submit(executor, spec)
        except SlurmRefused as exc:
            return self._end(
                "failed", None, f"Refused by Slurm: {exc}", f"[portal] Slurm refused the job: {exc}"
            )
        except SlurmUnreachable as exc:
            return self._end(
                "failed", None, f"Slurm did not answer: {exc}", f"[portal] Slurm did not answer: {exc}"
            )
        self.job.slurm_job_id = run.job_id
        # Slurm has the job now: its id must reach the row, or nobody would ever follow it.
        patiently(
            self.job.pk,
            lambda: Job.objects.filter(pk=self.job.pk).update(slurm_job_id=run.job_id, slurm_state="PENDING"),
        )
        self.writer.write_line(
            f"[portal] job {self.job.pk} is Slurm job {run.job_id} on {self.job.server.name}"
            f" ({self.job.gpu_count} GPU(s), partition {self.job.partition or 'default'})"
        )
        return self._follow(executor, run)

    def resume(self) -> str:
        """Follow again a job the cluster's previous worker followed, its output from where the
        job's log has it (`Job.slurm_output_offset`), its end recorded once. Without a Slurm job
        id, its sbatch was cut short: Slurm is asked for a job of its name."""
        try:
            account = job_account(self.job.owner)
        except SlurmSetupError as exc:
            return self._lost(f"its cluster's worker restarted and cannot follow it again: {exc}")
        folder = job_folder(self.cluster, account, self.job.pk)
        request = SlurmRequest(
            gpus=self.job.gpu_count or 0,
            minutes=self.job.time_limit_minutes,
            partition=self.job.partition,
            output=folder / OUTPUT,
            jobcomp=jobcomp_location(self.commands),
            output_keep=settings.JOB_LOG_MAX_MB << 20,
        )
        executor = SlurmExecutor(self.commands, request)
        spec = RunSpec([], {}, folder, slurm_job_name(self.job.pk), account)
        # A job the release before sent is `portal-<id>` in Slurm (its owner's: `find` asks by account).
        former = f"portal-{self.job.pk}"
        job_id = self.job.slurm_job_id
        if not job_id:
            try:
                found = executor.find(spec) or executor.find(replace(spec, name=former))
            except SlurmError as exc:
                return self._lost(
                    f"its worker stopped while sending it to Slurm, which does not answer ({exc})"
                )
            if found is None:
                return self._lost(f"its worker stopped while sending it to Slurm, which has no {spec.name}")
            job_id = self.job.slurm_job_id = found.job_id
            Job.objects.filter(pk=self.job.pk).update(slurm_job_id=job_id)
        offset = self.job.slurm_output_offset
        run = executor.attach(spec, job_id, offset=offset, former=former)
        self.running_recorded = self.job.status == Job.Status.RUNNING
        self.writer.write_line(
            f"[portal] the worker of {self.job.server.name} started again: it follows Slurm job {job_id}"
            f" again (its output from byte {offset:,})."
        )
        return self._follow(executor, run)

    def _submit(self, executor: SlurmExecutor, spec: RunSpec) -> SlurmRun:
        """sbatch. Its timeout does not say Slurm did not take the job (the answer may be what
        was lost): Slurm is asked for a job of its name and account until it answers, for
        LOOKUP_SECONDS at most, and one it took is followed, never left to run unseen."""
        try:
            return executor.start(spec)
        except SlurmTimedOut as exc:
            timed_out = exc
        self._unreachable(str(timed_out))
        give_up = time.monotonic() + LOOKUP_SECONDS
        while True:
            try:
                found = executor.find(spec)
            except SlurmUnreachable as exc:
                if time.monotonic() >= give_up:
                    raise SlurmUnreachable(
                        f"{timed_out}, nor since: should it have taken the job, it is {spec.name} in Slurm"
                    ) from None
                self._unreachable(str(exc))
                time.sleep(STATE_SECONDS)
                continue
            if found is None:
                raise timed_out
            self.writer.write_line(f"[portal] sbatch did not answer, but Slurm took the job: {found.job_id}.")
            return found

    # --- before sbatch -----------------------------------------------------------------

    def _prepare(self) -> tuple[pwd.struct_passwd, Path]:
        """The owner's account and the job's own folder (jobs/host/slurm_setup.py)."""
        account = job_account(self.job.owner)
        folder = job_folder(self.cluster, account, self.job.pk)
        script = None if self.job.script_path else (self.job.name, self.job.script_source)
        job_folder_make(folder, account, script)
        return account, folder

    def _request(self, folder: Path) -> SlurmRequest:
        try:
            partition_check(self.commands, self.job.partition)
        except SlurmUnreachable as exc:
            raise SlurmSetupError(f"Slurm did not answer: {exc}") from None
        return SlurmRequest(
            gpus=self.job.gpu_count or 0,
            minutes=self.job.time_limit_minutes,
            partition=self.job.partition,
            output=folder / OUTPUT,
            reservation=self._reservation(),
            jobcomp=jobcomp_location(self.commands),
            output_keep=settings.JOB_LOG_MAX_MB << 20,
        )

    def _reservation(self) -> str:
        """The Slurm reservation of the job's booking of whole nodes, once the cluster's worker has
        made it (gpus/slurm_booking.py: a pass every few seconds); "" without a booking."""
        if self.job.reservation_id is None:
            return ""
        give_up = time.monotonic() + RESERVATION_WAIT_SECONDS
        while True:
            name, error = (
                Reservation.objects.filter(pk=self.job.reservation_id)
                .values_list("slurm_reservation", "slurm_error")
                .get()
            )
            if name:
                return name
            if error or time.monotonic() >= give_up:
                raise SlurmSetupError(
                    error
                    or f"its booking's Slurm reservation was not made within {RESERVATION_WAIT_SECONDS} s"
                )
            time.sleep(0.5)

    def _argv(self, folder: Path) -> list[str]:
        job = self.job
        interpreter = settings.JOB_INTERPRETERS.get(job.interpreter) or settings.JOB_INTERPRETERS["default"]
        script = job.script_path or str(folder / job.name)
        if "=" in interpreter:  # the batch script's env(1) would take it for a variable
            raise SlurmSetupError(
                f"its interpreter {interpreter} has '=' in its path, which the batch script's env(1) "
                "reads as a variable: an admin names it by a path without one (JOB_INTERPRETERS)",
                field="interpreter",
            )
        return [interpreter, "-u", str(folder / "launcher" / LAUNCHER.name), script, *job.args]

    def _env(self) -> dict[str, str]:
        """The job's own variables, then the portal's; Slurm adds its own (CUDA_VISIBLE_DEVICES)."""
        job = self.job
        config = {
            "job_id": job.pk,
            "allow_growth": True,  # whole cards: Slurm gives no share of one
            "intra_op_threads": job.intra_op_threads,
            "inter_op_threads": job.inter_op_threads,
            "soft_placement": job.soft_placement,
            "log_placement": job.log_placement,
            "mirrored": job.mirrored,
        }
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            **job.env,
            "PYTHONUNBUFFERED": "1",
            "PORTAL_JOB_ID": str(job.pk),
            "PORTAL_LAUNCH_CONFIG": json.dumps(config),
        }

    # --- after sbatch ------------------------------------------------------------------

    def _follow(self, executor: SlurmExecutor, run: SlurmRun) -> str:
        output = run.output
        assert isinstance(output, FileOutput)
        # Stored with the log's bytes, in their transaction: where a restarted worker reads on from.
        self.writer.stored_fields = lambda: {
            "slurm_output_offset": max(0, output.offset - len(self.writer.partial))
        }
        asked_at = 0.0
        while True:
            try:
                self._take(output)
                if time.monotonic() - asked_at >= STATE_SECONDS:
                    asked_at = time.monotonic()
                    state = self._ask(executor, run)
                    # Another job's id first (a wiped controller reuses ids): never its end as ours.
                    if why := self._given_up(state, run):
                        self._take(output, to_end=True)
                        return self._lost(why)
                    if state is not None and (state.ended or state.state == "FORGOTTEN"):
                        self._take(output, to_end=True)  # all that is left (FileOutput.keep at most)
                        return self._ended(state, run)
            except DatabaseError as exc:  # a restart of the database: Slurm runs the job on
                close_old_connections()  # a broken connection is not reused
                if not self.database_away:  # said once an outage, not every tick
                    log.warning(
                        "Job %s: the database is away (%s); following Slurm job %s on",
                        self.job.pk,
                        exc,
                        run.job_id,
                    )
                self.database_away = True
                asked_at = 0.0
            else:
                self.database_away = False
            time.sleep(TICK_SECONDS)

    def _given_up(self, state: SlurmJobState | None, run: SlurmRun) -> str:
        if state is not None and not run.ours(state):  # its id reused by Slurm
            return f"Slurm job {run.job_id} is another job now ({state.name}): Slurm has forgotten this one"
        why = self.news.given_up(self.job.server.name, self.unreachable_said)
        return (
            f"{why}. Slurm job {run.job_id} may still run there: the portal follows it no more" if why else ""
        )

    def _take(self, output: FileOutput, *, to_end: bool = False) -> None:
        """What the output file gained, TAKE_MAX bytes at most (`to_end`: all of it)."""
        budget, taken = None if to_end else TAKE_MAX, 0
        while budget is None or taken < budget:
            data = output.read(READ_MAX if budget is None else budget - taken)
            if not data:
                break
            taken += len(data)
            self.writer.feed(data)
        while output.notes:
            self.writer.write_line(f"[portal] {output.notes.pop(0)}.")
        if output.refused and not self.output_refused:
            self.output_refused = True
            self.writer.write_line(f"[portal] {output.refused}.")
        self.writer.maybe_flush()

    def _ask(self, executor: SlurmExecutor, run: SlurmRun) -> SlurmJobState | None:
        """Slurm's word on the job, on its row, with a beat; a cancel asked for is sent."""
        try:
            state = executor.state(run)
        except SlurmError as exc:
            self._unreachable(str(exc))
            return None
        if not run.ours(state):  # its id reused: nothing is sent to it
            return state
        if self.unreachable_said:
            self.writer.write_line("[portal] the cluster answers again.")
            self.unreachable_said = ""
        self.news.answered(state)
        if not state.known and state.state not in ("FORGOTTEN", self.unknown_said):
            self.unknown_said = state.state
            self.writer.write_line(
                f"[portal] Slurm says the job is {state.state}, a state the portal does not know; it is"
                f" followed for {settings.SLURM_LOST_AFTER_SECONDS} s at most unless Slurm says more."
            )
        fields = {"slurm_state": state.state[:32], "slurm_reason": state.reason[:200], "heartbeat_at": Now()}
        Job.objects.filter(pk=self.job.pk).update(**fields)
        if state.state == "RUNNING" and not self.running_recorded:
            self.running_recorded = Job.objects.transition(
                self.job.pk, from_=Job.Status.STARTING, to=Job.Status.RUNNING, started_at=timezone.now()
            )
        self._cancel_if_asked(executor, run)
        self._stop_if_booking_over(executor, run)
        return state

    def _stop_if_booking_over(self, executor: SlurmExecutor, run: SlurmRun) -> None:
        """A job in a booking ends with it, as on a GPU host (jobs.host.runner): released or
        cancelled early, Slurm would run it on, and keep the reservation it runs in."""
        if self.stopped is not None or (why := self._booking_over()) is None:
            return
        if self._scancel(executor, run, why[1]):
            self.stopped = why

    def _booking_over(self) -> tuple[str, str] | None:
        if self.job.reservation_id is None:
            return None
        row = (
            Reservation.objects.filter(pk=self.job.reservation_id).values("end", *ENDED_EARLY_FIELDS).first()
        )
        # Cancelled before its start, a booking keeps its end; its job, pending in Slurm for the
        # reservation, would wait there for ever once the reservation is removed.
        if row is None or (row["cancelled_at"] is None and timezone.now() < row["end"]):
            return None
        if early := ended_early_words(row):  # released or cancelled: one rule (gpus.booking_ends)
            return "cancelled", f"Cancelled: {early}."
        return "timed_out", "The booking ended; the job was stopped."

    def _cancel_if_asked(self, executor: SlurmExecutor, run: SlurmRun) -> None:
        if self.cancel_sent:
            return
        asked = Job.objects.filter(pk=self.job.pk, cancel_requested_at__isnull=False)
        if (row := asked.values(*CANCELLED_FIELDS).first()) is None:
            return
        self.cancel_sent = self._scancel(executor, run, f"cancel asked ({cancelled_words(row)})")

    def _scancel(self, executor: SlurmExecutor, run: SlurmRun, why: str) -> bool:
        """scancel sent, said in the log with why; False when it failed (tried again next poll)."""
        try:
            executor.signal(run, signal.SIGTERM)
        except SlurmError as exc:
            self.writer.write_line(f"[portal] scancel failed, tried again: {exc}")
            return False
        self.writer.write_line(f"[portal] {why} scancel {run.job_id} sent.")
        return True

    def _unreachable(self, why: str) -> None:
        self.news.silent()
        Job.objects.filter(pk=self.job.pk).update(
            slurm_reason=f"The cluster does not answer: {why}"[:200], heartbeat_at=Now()
        )
        if why != self.unreachable_said:
            self.writer.write_line(f"[portal] the cluster does not answer ({why}); the job runs on in Slurm.")
            self.unreachable_said = why

    def _ended(self, state: SlurmJobState, run: SlurmRun) -> str:
        exit_ = state.exit
        if state.state == "FORGOTTEN":
            return self._lost(
                f"Slurm job {run.job_id} is gone from Slurm and from its completion log: its end is unknown"
            )
        status = state.status
        asked = (
            Job.objects.filter(pk=self.job.pk).values(*CANCELLED_FIELDS, "cancel_requested_at").first() or {}
        )
        by = asked.get("cancelled_by__username")
        if status == "cancelled" and self.stopped is not None and not by:  # its booking's end
            status, message = self.stopped
        elif status == "cancelled":
            # Who asked and why, as a host's job says it (jobs.runs.cancelled_words): a person, or
            # the portal itself (a leaver's work: its reason is the row's message).
            message = (
                cancelled_words(asked, " (scancel)")
                if asked.get("cancel_requested_at")
                else "Cancelled in Slurm (scancel)."
            )
        elif status == "timed_out":
            message = "Timed out: Slurm ended it at its time limit."
        elif status == "failed":
            said = state.state + (f" ({state.reason})" if state.reason else "")
            if state.reason == "JobLaunchFailure":  # slurmd's error code, never a signal the job got
                exit_ = None
                said += ": Slurm could not start it on its node (its working directory or folder there?)"
            elif state.state == "OUT_OF_MEMORY":
                said += ": it went over the memory Slurm gives it on its node, and was killed"
                if exit_ is None or exit_.signal == 125:  # Slurm's mark (0:125): the OOM killer's SIGKILL
                    exit_ = RunEnd(signal=int(signal.SIGKILL))
            message = f"Slurm: {said}; {exit_.describe() if exit_ else ''}".strip(" ;")
        else:
            message = ""
        if state.forgotten:
            message = f"{message} (from the cluster's completion log)".strip()
        code = exit_.returncode if exit_ is not None else None
        return self._end(status, code, message)

    def _end(self, status: str, code: int | None, message: str, line: str = "") -> str:
        if line:
            self.writer.write_line(line)
        self.writer.close()
        finished = datetime.now(tz=timezone.get_current_timezone()).isoformat()
        job_end_record(self.job.pk, self.writer, EndRecord(status, code, message[:1000], finished))
        Job.objects.filter(pk=self.job.pk).update(slurm_reason="")
        return status

    def _lost(self, why: str) -> str:
        """The job followed no more, as lost: why, in its log, its message (its owner's end notice
        quotes it: jobs.notices) and the audit log. Slurm may run it on: nothing is stopped."""
        message = f"Lost: {why}."[:1000]
        if message != self.lost_said:  # once, though the database's outage makes it tried again
            self.writer.write_line(f"[portal] {message}")
            self.lost_said = message
        self.writer.close()
        job = self.job
        Job.objects.transition(
            job.pk,
            from_=FOLLOWED,
            to=Job.Status.LOST,
            told=lambda: _lost_audit(job, message),
            finished_at=timezone.now(),
            message=message,
            slurm_reason="",
        )
        return Job.Status.LOST


def _lost_audit(job: Job, message: str) -> None:
    AuditEntry.objects.create(
        actor=None,
        team_id=job.team_id,
        action=AuditEntry.Action.JOB_LOST,
        target=f"job {job.pk}",
        message=f"Job {job.pk} ({job.name}) of {job.owner} on {job.server.name}: {message}",
        data={"job": job.pk, "slurm_job": job.slurm_job_id, "server": job.server.name},
    )

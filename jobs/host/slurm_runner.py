"""The worker's side of a job on a Slurm cluster (issue 37; docs/slurm.md): claim it, write its
folder on the shared filesystem, submit it as its owner through the Slurm executor
(jobs/host/executors/slurm.py), then follow it to its end: Slurm's state and reason on the row,
its output file into the job's log as it grows, a cancel as `scancel`, and its end recorded once
(jobs.runs.job_end_record), as a GPU host's supervisor records one.

The worker runs on the cluster's login node (GPU_BACKEND=slurm, WORKER_SERVER = the cluster's
server name), as root: `sbatch --uid` is root's. It beats for the job while it follows it, so a
worker that dies has its jobs marked lost by the reconciler, as on a GPU host; the job itself runs
on in Slurm. A cluster that stops answering is said once in the job's log and on its page
(`slurm_reason`); the worker keeps trying, and the job's end is read when Slurm answers again,
from its completion log if Slurm has forgotten the job meanwhile.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import signal
import stat
import time
from datetime import datetime
from pathlib import Path

from django.conf import settings
from django.db.models.functions import Now
from django.utils import timezone

from gpus.booking_ends import ENDED_EARLY_FIELDS, ended_early_words
from gpus.models import Reservation
from gpus.slurm_cli import SlurmError, SlurmRefused, SlurmTimedOut, SlurmUnreachable, records
from gpus.slurm_inventory import commands_for
from jobs.host.executors.base import RunSpec
from jobs.host.executors.slurm import (
    READ_MAX,
    FileOutput,
    SlurmExecutor,
    SlurmJobState,
    SlurmRequest,
    SlurmRun,
)
from jobs.host.launch import LAUNCHER, job_claim
from jobs.host.spool import EndRecord
from jobs.logs.store import LogWriter
from jobs.models import Job
from jobs.runs import job_end_record
from portal.accounts import unix_account_name

log = logging.getLogger(__name__)

TICK_SECONDS = 0.2  # how often the output file is read
TAKE_MAX = 8 << 20  # the most of it read in one tick: Slurm is still asked, and the job beats
STATE_SECONDS = 1.0  # how often Slurm is asked, and the job beats
OUTPUT = "output.log"
RESERVATION_WAIT_SECONDS = 30
LOOKUP_SECONDS = 120  # how long a job whose sbatch timed out is looked for while Slurm does not answer


class SlurmSetupError(Exception):
    """The job cannot be sent to Slurm: its message says why and what to do."""


def slurm_job_run(job_id: int) -> str | None:
    """Claim job `job_id`, submit it to this worker's Slurm cluster and follow it to its end;
    its final status (None: not ours to run). Again for the same id: a no-op (the claim)."""
    job = job_claim(job_id)
    if job is None:
        log.info("Job %s is not queued (already claimed, cancelled or gone): nothing to do", job_id)
        return None
    return SlurmFollower(job).run()


class SlurmFollower:
    """One claimed job, from sbatch to its end."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.cluster = job.server.slurm
        self.commands = commands_for(self.cluster)
        self.writer = LogWriter(job.pk)
        self.cancel_sent = False
        self.unreachable_said = ""
        self.running_recorded = False
        self.output_refused = False
        self.stopped: tuple[str, str] | None = None  # (status, message) of the portal's own stop

    def run(self) -> str:
        try:
            account, folder = self._prepare()
            request = self._request(folder)
        except SlurmSetupError as exc:
            return self._end(
                "failed", None, f"Could not send it to Slurm: {exc}", f"[portal] cannot start: {exc}"
            )
        executor = SlurmExecutor(self.commands, request)
        spec = RunSpec(
            self._argv(folder), self._env(), self.job.workdir or folder, f"portal-{self.job.pk}", account
        )
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
        Job.objects.filter(pk=self.job.pk).update(slurm_job_id=run.job_id, slurm_state="PENDING")
        self.writer.write_line(
            f"[portal] job {self.job.pk} is Slurm job {run.job_id} on {self.job.server.name}"
            f" ({self.job.gpu_count} GPU(s), partition {self.job.partition or 'default'})"
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
        """The owner's account and the job's own folder, made by root and handed to the account
        only once the script and the launcher are in it: nothing can be planted there first. The
        account's folder above it stays root's, so the account can never swap its job folder for
        a link while root writes there."""
        name = unix_account_name(self.job.owner)
        if name is None:
            raise SlurmSetupError(
                f"{self.job.owner} has no Unix account the portal can vouch for: an admin sets theirs"
                " on their profile."
            )
        try:
            account = pwd.getpwnam(name)
        except KeyError:
            raise SlurmSetupError(f"there is no account {name!r} on the login node") from None
        if account.pw_uid < settings.JOB_MIN_UID:
            raise SlurmSetupError(f"account {name!r} is a system account (uid below JOB_MIN_UID)")
        mine = Path(self.cluster.job_root) / name
        folder = mine / f"job-{self.job.pk}"
        try:
            if not _root_only(mine.parent):  # else its account folders could be swapped for links
                raise SlurmSetupError(
                    f"the jobs' folder {mine.parent} is not writable by root only; an admin makes it "
                    "root's, mode 755"
                )
            mine.mkdir(mode=0o755, exist_ok=True)
            if not _root_only(mine):
                raise SlurmSetupError(f"{mine} is not a folder only root may change; an admin removes it")
            folder.mkdir(mode=0o700)
            shutil.copytree(LAUNCHER.parent, folder / "launcher")
            if not self.job.script_path:
                (folder / self.job.name).write_text(self.job.script_source)
            for path in [folder, *folder.rglob("*")]:
                os.lchown(path, account.pw_uid, account.pw_gid)
        except OSError as exc:
            raise SlurmSetupError(f"cannot make its folder {folder}: {exc.strerror or exc}") from None
        return account, folder

    def _request(self, folder: Path) -> SlurmRequest:
        self._check_partition(self.job.partition)
        return SlurmRequest(
            gpus=self.job.gpu_count or 0,
            minutes=self.job.time_limit_minutes,
            partition=self.job.partition,
            output=folder / OUTPUT,
            reservation=self._reservation(),
            jobcomp=self._jobcomp(),
            output_keep=settings.JOB_LOG_MAX_MB << 20,
        )

    def _check_partition(self, partition: str) -> None:
        """Slurm takes a RootOnly partition's job from root's sbatch, then holds it for ever
        (PartitionConfig): it checks the submitter, and the portal submits as root for its users.
        Refused here, the cluster's default partition too; an unknown one is Slurm's to refuse."""
        try:
            found = records(self.commands.show("partition", *([partition] if partition else [])))
        except SlurmRefused:
            return
        except SlurmUnreachable as exc:
            raise SlurmSetupError(f"Slurm did not answer: {exc}") from None
        for record in found:
            if (partition or record.get("Default") == "YES") and record.get("RootOnly") == "YES":
                raise SlurmSetupError(
                    f"partition {record.get('PartitionName')} takes root's jobs only (RootOnly): "
                    "submit to another partition"
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

    def _jobcomp(self) -> str:
        """The cluster's completion log (jobcomp/filetxt), where forgotten jobs are looked up."""
        try:
            config = self.commands.run("scontrol", ["show", "config"])
        except SlurmError:
            return ""
        for line in config.splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "JobCompLoc" and value.strip().startswith("/"):
                return value.strip()
        return ""

    def _argv(self, folder: Path) -> list[str]:
        job = self.job
        interpreter = settings.JOB_INTERPRETERS.get(job.interpreter) or settings.JOB_INTERPRETERS["default"]
        script = job.script_path or str(folder / job.name)
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
        asked_at = 0.0
        while True:
            self._take(output)
            if time.monotonic() - asked_at >= STATE_SECONDS:
                asked_at = time.monotonic()
                state = self._ask(executor, run)
                if state is not None and (state.ended or state.state == "FORGOTTEN"):
                    self._take(output, to_end=True)  # all that is left (FileOutput.keep at most)
                    return self._ended(state, run)
            time.sleep(TICK_SECONDS)

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
        if self.unreachable_said:
            self.writer.write_line("[portal] the cluster answers again.")
            self.unreachable_said = ""
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
        if (
            self.cancel_sent
            or not Job.objects.filter(pk=self.job.pk, cancel_requested_at__isnull=False).exists()
        ):
            return
        self.cancel_sent = self._scancel(executor, run, "cancel asked:")

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
        Job.objects.filter(pk=self.job.pk).update(
            slurm_reason=f"The cluster does not answer: {why}"[:200], heartbeat_at=Now()
        )
        if why != self.unreachable_said:
            self.writer.write_line(f"[portal] the cluster does not answer ({why}); the job runs on in Slurm.")
            self.unreachable_said = why

    def _ended(self, state: SlurmJobState, run: SlurmRun) -> str:
        exit_ = state.exit
        if state.state == "FORGOTTEN":
            return self._end(
                "lost",
                None,
                f"Slurm job {run.job_id} is gone from Slurm and from its completion log: its end is unknown.",
            )
        status = state.status
        by = Job.objects.filter(pk=self.job.pk).values_list("cancelled_by__username", flat=True).first()
        if status == "cancelled" and self.stopped is not None and not by:  # its booking's end
            status, message = self.stopped
        elif status == "cancelled":
            message = f"Cancelled by {by} (scancel)." if by else "Cancelled in Slurm (scancel)."
        elif status == "timed_out":
            message = "Timed out: Slurm ended it at its time limit."
        elif status == "failed":
            message = f"Slurm: {state.state}; {exit_.describe() if exit_ else ''}".strip()
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


def _root_only(path: Path) -> bool:
    """A folder itself (not a link) that only root may change."""
    found = os.lstat(path)
    return stat.S_ISDIR(found.st_mode) and found.st_uid == 0 and not found.st_mode & 0o022

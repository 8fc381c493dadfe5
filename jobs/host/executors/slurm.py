"""The Slurm executor: a run is a batch job on a Slurm cluster (`SlurmExecutor`; issue 37).

The worker runs on the cluster's login node, as root, and submits each job as its owner
(`sbatch --uid`), with `--export=NIL` so that nothing of the worker's environment reaches the job:
the batch script sets the job's own variables and `exec`s the portal's launcher around the user's
script, as on a GPU host. Slurm, not the worker, owns the processes: they run on a compute node
the worker cannot see, so a run is named by Slurm's job id, signals go through `scancel`, and
there is nothing for the worker to sweep or reap. Output is the job's file on the shared
filesystem, read as it grows (`FileOutput`).

A job Slurm has forgotten (its MinJobAge passed while the worker was away) is looked up in the
cluster's job completion log (JobCompType=jobcomp/filetxt), so its end is still recorded as it was.
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpus.slurm_cli import SlurmCommands, SlurmRefused, records
from jobs.host.executors.base import Run, RunEnd, RunSpec, Signalled
from portal.names import SLURM_NAME_INSTANCE, instance_label
from portal.pids import ProcessId

READ_MAX = 1 << 20  # one read of the output file at most
FORGOTTEN = "Invalid job id specified"  # what scontrol says of a job it no longer knows
# Slurm's end states as the portal's (jobs.models.Job.Status), and the states it waits or runs in.
ENDS = {
    "COMPLETED": "succeeded",
    "FAILED": "failed",
    "OUT_OF_MEMORY": "failed",
    "NODE_FAIL": "failed",
    "BOOT_FAIL": "failed",
    "DEADLINE": "failed",
    "PREEMPTED": "failed",
    "TIMEOUT": "timed_out",
    "CANCELLED": "cancelled",
}
# The states a job waits or runs in (squeue(1), "JOB STATE CODES"): any other is one the portal
# does not know, and a job that stays in one is not followed for ever (jobs/host/slurm_runner.py).
LIVE = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "STOPPED",
        "SIGNALING",
        "STAGE_OUT",
        "RESIZING",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "SPECIAL_EXIT",
        "RESV_DEL_HOLD",
    }
)


@dataclass(frozen=True)
class SlurmJobState:
    """A job as Slurm last described it: its state (RUNNING), why it waits (Resources), its exit
    code or signal once it ended, its nodes, and its name. `forgotten`: found only in the
    completion log."""

    state: str
    reason: str = ""
    exit: RunEnd | None = None
    nodes: str = ""
    forgotten: bool = False
    name: str = ""
    uid: int | None = None  # its account's, where Slurm says (`UserId=nobody(65534)`)

    @property
    def ended(self) -> bool:
        return self.state in ENDS

    @property
    def known(self) -> bool:
        """A state the portal knows: one a job waits or runs in, or an end."""
        return self.state in ENDS or self.state in LIVE

    @property
    def status(self) -> str:
        """The portal's status for an ended job (a non-zero exit is a failure whatever Slurm says)."""
        status = ENDS.get(self.state, "failed")
        return "failed" if status == "succeeded" and self.exit and self.exit.returncode else status


def exit_of(text: str) -> RunEnd:
    """Slurm's `ExitCode=3:0` (code 3) or `0:9` (signal 9)."""
    code, _, sig = text.partition(":")
    if sig.isdigit() and int(sig):
        return RunEnd(signal=int(sig))
    return RunEnd(code=int(code) if code.isdigit() else 0)


def state_of(record: dict[str, str], *, forgotten: bool = False) -> SlurmJobState:
    state = record.get("JobState", "").split()[0] if record.get("JobState") else "UNKNOWN"
    reason = record.get("Reason", "")
    return SlurmJobState(
        state=state,
        reason="" if reason in ("None", "(null)") else reason,
        exit=exit_of(record.get("ExitCode", "0:0")) if state in ENDS else None,
        nodes=record.get("NodeList", ""),
        forgotten=forgotten,
        name=record.get("JobName") or record.get("Name", ""),  # jobcomp/filetxt says Name=
        uid=int(uid.group(1)) if (uid := re.search(r"\((\d+)\)\Z", record.get("UserId", ""))) else None,
    )


def jobcomp_find(path: str, job_id: str) -> dict[str, str] | None:
    """The job's record in a jobcomp/filetxt log (its last one: a requeued job has several), read
    a line at a time: Slurm never rotates that log, which grows to gigabytes on a busy cluster."""
    first, found = f"JobId={job_id}", ""
    try:
        with open(path, errors="replace") as log:
            for line in log:
                if line.split(" ", 1)[0] == first:
                    found = line
    except OSError:
        return None
    return records(found)[0] if found else None


class FileOutput:
    """A Slurm job's output file as a `RunOutput`: what was added since the last read; its end is
    the job's end (`finish`), after which what is left is read and then None."""

    def __init__(
        self, path: Path, *, uid: int | None = None, tick: float = 0.1, keep: int | None = None
    ) -> None:
        self.path = path
        self.uid = uid  # the job's account: the file must be its own
        self.tick = tick
        self.keep = keep  # at most this much unread is read: the log keeps no more (JOB_LOG_MAX_MB)
        self.offset = 0
        self.finished = False
        self.eof = False
        self.refused = ""  # why the file is not read (said once by the caller)
        self.notes: list[str] = []  # what the caller says in the log: a truncation, a skip

    def read(self, limit: int = READ_MAX) -> bytes:
        """What was added since the last read, `limit` bytes at most. The file is in the job's own
        folder, which its account may change: a link, a FIFO, or a file that is not the account's
        own (a hard link to another's) is never read by the root worker (`refused` says why). A
        file cut shorter is read again from its start; an unread part larger than `keep` (a sparse
        file of a terabyte) is skipped to its last `keep` bytes, never read only to be dropped."""
        if self.refused:
            return b""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return b""  # not made yet: the job has not started
        except OSError as exc:
            self.refused = f"cannot open its output {self.path}: {exc.strerror or exc}"
            return b""
        with os.fdopen(fd, "rb") as f:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1 or self.uid not in (None, found.st_uid):
                self.refused = f"its output {self.path} is not a plain file of the job's account: not read"
                return b""
            self._catch_up(found.st_size)
            f.seek(self.offset)
            data = f.read(min(limit, READ_MAX))
        self.offset += len(data)
        return data

    def _catch_up(self, size: int) -> None:
        if size < self.offset:  # truncated (a job's `: > out.log`): what is there now is new
            self.notes.append(f"its output was cut to {size:,} bytes: read again from its start")
            self.offset = 0
        if self.keep is not None and size - self.offset > self.keep:
            skipped = size - self.offset - self.keep
            self.notes.append(f"{skipped:,} bytes of its output skipped: more than its log keeps")
            self.offset += skipped

    def finish(self) -> None:
        self.finished = True

    def get(self, timeout: float | None) -> bytes | None:
        data = self.read()
        if data:
            return data
        if self.finished:
            self.eof = True
            return None
        time.sleep(min(timeout or self.tick, self.tick))
        raise queue.Empty

    def drain(
        self, seconds: float, take: Callable[[bytes], None], beat: Callable[[], None], beat_every: float
    ) -> bool:
        give_up = time.monotonic() + seconds
        while time.monotonic() < give_up:
            data = self.read()
            if not data:
                self.eof = True
                return True
            take(data)
        return False


@dataclass
class SlurmRun(Run):
    """A run of `SlurmExecutor`: Slurm's job id, and its last known state."""

    job_id: str = field(kw_only=True)
    last: SlurmJobState | None = field(default=None, kw_only=True)
    former: str = field(default="", kw_only=True)  # its name as the release before named jobs
    uid: int | None = field(default=None, kw_only=True)  # the account it runs as

    def ours(self, state: SlurmJobState) -> bool:
        """Whether the job Slurm describes under this run's id is this run's, by its name: a job
        id is reused once Slurm has forgotten the job (a controller whose state was wiped). The
        former name carries no instance (another portal's job of the same id had it too): it is
        ours only as our job's account's."""
        if not state.name or state.name == self.name:
            return True
        return bool(self.former) and state.name == self.former and state.uid in (None, self.uid)


@dataclass(frozen=True)
class SlurmRequest:
    """What a job asks Slurm for, beside what any run has (RunSpec)."""

    gpus: int
    minutes: int | None
    partition: str
    output: Path
    reservation: str = ""
    jobcomp: str = ""  # the cluster's JobCompLoc, for jobs it has forgotten
    output_keep: int | None = None  # the most of its output worth reading (FileOutput.keep)


class SlurmExecutor:
    """Runs work as Slurm batch jobs (jobs.host.executors.Executor), one request per executor."""

    def __init__(self, commands: SlurmCommands, request: SlurmRequest) -> None:
        self.commands = commands
        self.request = request

    def batch_script(self, spec: RunSpec) -> str:
        """Its command in place of the shell, the job's own variables set by env(1): nothing of
        the worker's (sbatch --export=NIL), no shell syntax of the user's (every word quoted), and
        no assignment by the shell, which a name the shell keeps read-only would make fatal
        (`UID`, `PPID`, `SHELLOPTS`: where /bin/sh is bash, `export UID=5` ends the script)."""
        if spec.argv and "=" in spec.argv[0]:
            # env(1) takes every leading word with '=' for a variable: the command would be the
            # next word ("env: '-u': No such file or directory"). No quoting helps; refused.
            raise ValueError(f"env(1) cannot run a command whose name has '=' in it: {spec.argv[0]!r}")
        words = [f"{name}={value}" for name, value in sorted(spec.env.items())] + list(spec.argv)
        lines = ["#!/bin/sh", f"# {spec.name}, written by the GPU lab portal"]
        lines.append("exec /usr/bin/env " + " ".join(_sh_word(word) for word in words))
        return "\n".join(lines) + "\n"

    def sbatch_args(self, spec: RunSpec) -> list[str]:
        r = self.request
        args = ["--parsable", f"--job-name={_job_name(spec)}", "--export=NIL"]
        if spec.account is not None:  # as its owner: only root may say so (the login node's worker)
            args += [f"--uid={spec.account.pw_uid}", f"--gid={spec.account.pw_gid}"]
        if r.gpus:
            args.append(f"--gres=gpu:{r.gpus}")
        if r.minutes:
            args.append(f"--time={r.minutes}")
        if r.partition:
            args.append(f"--partition={r.partition}")
        if r.reservation:
            args.append(f"--reservation={r.reservation}")
        args += [f"--chdir={spec.cwd}", f"--output={_filename_pattern(r.output)}", "--open-mode=append"]
        return args  # the script comes on stdin (`start`)

    def start(self, spec: RunSpec) -> SlurmRun:
        """sbatch, the script on its stdin: no file the job's account could swap for another
        before root's sbatch reads it. SlurmRefused (Slurm's words) or SlurmUnreachable when it
        is not taken."""
        script = self.batch_script(spec).encode()
        job_id = self.commands.run("sbatch", self.sbatch_args(spec), stdin=script).strip().split(";")[0]
        return self.attach(spec, job_id)

    def test(self, spec: RunSpec) -> None:
        """`sbatch --test-only` with the same options as `start`: Slurm checks the job as its owner
        would submit it (the partition, the reservation's users, the account's limits) and runs
        nothing. SlurmRefused (Slurm's words) or SlurmUnreachable when it would not be taken."""
        script = self.batch_script(spec).encode()
        self.commands.run("sbatch", ["--test-only", *self.sbatch_args(spec)], stdin=script)

    def find(self, spec: RunSpec) -> SlurmRun | None:
        """The job `start` sent for `spec`, should Slurm have taken it though sbatch's answer was
        lost (SlurmTimedOut): by its name and account, in any state Slurm still remembers."""
        args = ["--noheader", f"--name={_job_name(spec)}", "--states=all", "--format=%i"]
        if spec.account is not None:
            args.append(f"--user={spec.account.pw_uid}")
        found = self.commands.run("squeue", args).split()
        return self.attach(spec, found[0]) if found else None

    def attach(self, spec: RunSpec, job_id: str, *, offset: int = 0, former: str = "") -> SlurmRun:
        """The run of Slurm job `job_id`, its output read from `offset` on (what the job's log
        holds already, when a restarted worker follows it again); `former`: another name it may
        have in Slurm (SlurmRun.former)."""
        # No process of the worker's is the run: pid 0 is never signalled (portal.pids), and the
        # orphan sweep has nothing to find.
        uid = spec.account.pw_uid if spec.account is not None else None
        output = FileOutput(self.request.output, uid=uid, keep=self.request.output_keep)
        output.offset = offset
        return SlurmRun(_job_name(spec), ProcessId(0, -1.0), 0, output, job_id=job_id, former=former, uid=uid)

    def state(self, run: Run) -> SlurmJobState:
        """As Slurm says now, or as its completion log says once it has forgotten the job."""
        slurm = _slurm(run)
        try:
            found = records(self.commands.show("job", slurm.job_id))
        except SlurmRefused as exc:
            if FORGOTTEN not in str(exc):
                raise
            found = []
        if found:
            slurm.last = state_of(found[0])
        else:
            kept = jobcomp_find(self.request.jobcomp, slurm.job_id) if self.request.jobcomp else None
            slurm.last = (
                state_of(kept, forgotten=True) if kept else SlurmJobState("FORGOTTEN", forgotten=True)
            )
        return slurm.last

    def poll(self, run: Run) -> RunEnd | None:
        now = self.state(run)
        if now.state == "FORGOTTEN":
            return RunEnd(code=None)
        return now.exit if now.ended else None

    def wait(self, run: Run) -> RunEnd:
        while (end := self.poll(run)) is None:
            time.sleep(0.5)
        return end

    def signal(self, run: Run, sig: signal.Signals) -> Signalled:
        """SIGTERM: Slurm's own cancel (SIGTERM to every step, SIGKILL after its KillWait);
        any other signal to the whole job as it is."""
        job_id = _slurm(run).job_id
        args = [job_id] if sig == signal.SIGTERM else [f"--signal={sig.name[3:]}", "--full", job_id]
        self.commands.run("scancel", args)
        return Signalled(sent=1)

    def sweep(self, run: Run) -> Signalled:
        return Signalled()  # Slurm ends what a job leaves on its node

    def collect(self, run: Run) -> RunEnd:
        last = _slurm(run).last
        return (last.exit if last else None) or RunEnd()

    def stop(self, run: Run, grace: float) -> RunEnd:
        if self.poll(run) is None:
            self.signal(run, signal.SIGTERM)
        return self.wait(run)

    def did_not_start(self, end: RunEnd) -> str:
        return ""


def _sh_word(value: str) -> str:
    """One word for /bin/sh, quoted, with no carriage return in the script's text: sbatch refuses a
    script with a CR before a newline ("Batch script contains DOS line breaks"), and a value may
    hold one (an env value pasted from a Windows editor). Each CR is printf's, inside the word."""
    return "\"$(printf '\\r')\"".join(shlex.quote(part) for part in value.split("\r"))


def _filename_pattern(path: Path) -> str:
    """`path` as sbatch reads --output, a filename pattern: `%%` is a `%` (else `%j` in a folder's
    name would be the job id). A backslash would turn the symbols off and be dropped: the
    cluster's jobs' folder may hold none (gpus.slurm_models.SlurmCluster.clean)."""
    return str(path).replace("%", "%%")


def slurm_job_name(job_id: int) -> str:
    """`portal-<instance>-job-<id>`: the portal job's name in Slurm, by which a job whose sbatch
    answer was lost is found again and a reused Slurm id told apart. With this portal's instance
    (portal.names.instance_label): two portals on one cluster number their jobs alike."""
    return f"portal-{instance_label(SLURM_NAME_INSTANCE)}-job-{job_id}".lower()


def _job_name(spec: RunSpec) -> str:
    return spec.name.lower().replace(" ", "-")


def _slurm(run: Run) -> SlurmRun:
    assert isinstance(run, SlurmRun), f"{run.name} was not started by SlurmExecutor"
    return run

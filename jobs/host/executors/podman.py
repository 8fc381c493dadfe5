"""The Podman executor: a run is a container (`Podman`), for work whose image is set (issue 34,
docs/containers.md).

The worker starts `podman run` attached (its output is the run's, through a pipe as for a local
process) and waits on that client for the exit code. The container's first process is catatonit
(`--init`): runc makes it a session leader, and it forwards the signals it gets to the command. Its
*host* pid and start time (found at start from conmon's files, `_conmon_child`) are the run's
leader, so Job.pid names the container's session and the watchdog, the dashboard and the orphan
sweep attribute every process in it to the job (gpus.procinfo.session_of) as they do a local one's.

Signals go by identity, with no Podman in the path (a Podman that hangs or fails on its lock must
never keep a job from being stopped): SIGKILL to the init, proved by pid and start time (a pidfd,
portal.pids.send): the kernel then kills everything in the container's PID namespace at once, a
process that left the session (setsid) included. Any other signal goes once to each process of the
init's session, by identity, the init left out (it would hand the signal to the command a second
time), as a local run's do. Podman is for the start and the cleanup alone: after the exit the
worker reads whether the kernel's OOM killer ended it (`podman inspect`, only for an exit code
128+N it cannot otherwise read) and removes the container (`podman rm --force`; no `--rm`, so the
record is still there to read): no process, no container, no mount is left.

What the container gets (jobs/host/executors/podman_args.py): the booked cards alone, the job's
folders at their own paths, the account's uid and gid, no capabilities, no new privileges, no
network unless the image's admin allowed it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import psutil
from django.conf import settings

from jobs.host import containers, rootless
from jobs.host.containers import ContainerError, last_line, podman, podman_command, podman_env
from jobs.host.executors.base import Run, RunEnd, RunSpec, Signalled
from jobs.host.executors.output import PipeOutput
from jobs.host.executors.podman_args import env_file_text, run_argv
from portal import pids
from portal.pids import ProcessId, Sent, session_members, started_at
from portal.processes import die_with_parent

log = logging.getLogger(__name__)

INSPECT_PAUSE_SECONDS = 0.01  # between two looks for the init, or for what is left
SWEEP_SECONDS = 5.0
# Podman's own exit codes before the command ran (as `docker run`'s): its error, a command that
# could not be invoked, a command not found.
PODMAN_ERROR, CANNOT_INVOKE, NOT_FOUND = 125, 126, 127
FIRST_PASSED_FD = 3  # RunSpec.pass_fds reach the container's command as 3, 4, ... (--preserve-fds)


@dataclass
class PodmanRun(Run):
    """A run of `Podman`: the attached client, and the container by name and id."""

    proc: subprocess.Popen[bytes] = field(kw_only=True, repr=False)
    container: str = field(kw_only=True)
    container_id: str = field(kw_only=True, default="")
    folder: Path | None = field(kw_only=True, default=None, repr=False)  # its environment, cid, conmon's pid
    account: pwd.struct_passwd | None = field(
        kw_only=True, default=None, repr=False
    )  # whose Podman (rootless)
    sent: set[int] = field(kw_only=True, default_factory=set)  # what 128+N from podman may mean
    oom_killed: bool = field(kw_only=True, default=False)  # Podman's record, read before its removal
    collected: bool = field(kw_only=True, default=False)
    init_gone_at: float | None = field(kw_only=True, default=None)  # monotonic: the client outlives it


class Podman:
    """The executor that runs work in a container (jobs.host.executors.Executor), named
    `container` (portal-<instance>-<digest>-job-<id>: one per job, found again by a restarted worker)."""

    def __init__(self, container: str, *, tick: float = 0.1) -> None:
        self.container = container
        self.tick = tick

    def start(self, spec: RunSpec) -> PodmanRun:
        """`podman run` attached, and the container's init found; OSError when Podman cannot
        start it (the message says why and what to do). Whatever fails, nothing is left: no
        client, no container, no run folder (which holds the job's environment, its secrets)."""
        if spec.image is None:
            raise OSError(f"{spec.name} has no image: it runs on the host (LocalProcess)")
        account = _podman_account(spec)
        folder: Path | None = None
        try:
            folder = _run_folder(self.container, spec.env, account)
            argv = run_argv(spec, self.container, folder, rootless=account is not None)
            run = self._launch(spec, podman_command(*argv, account=account), folder, account)
            self._find_init(run)
        except BaseException as exc:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            if isinstance(exc, ContainerError):
                raise OSError(str(exc)) from None
            raise
        return run

    def _launch(
        self, spec: RunSpec, command: list[str], folder: Path, account: pwd.struct_passwd | None
    ) -> PodmanRun:
        """The attached `podman run` client, in a session of its own."""
        proc = subprocess.Popen(
            command,
            cwd="/",
            env=podman_env(account),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # Podman's own errors land in the job's log, with its output
            start_new_session=True,  # never in the worker's group: a signal to it misses the client
            close_fds=True,
            pass_fds=tuple(range(FIRST_PASSED_FD, FIRST_PASSED_FD + len(spec.pass_fds))),
            preexec_fn=_preexec(spec.pass_fds),
            **rootless.as_account(account),  # type: ignore[arg-type]
        )
        assert proc.stdout is not None
        output = PipeOutput(proc.stdout, tick=self.tick)
        return PodmanRun(
            spec.name, ProcessId(proc.pid, started_at(proc.pid) or -1.0), proc.pid, output,
            proc=proc, container=self.container, folder=folder, account=account,
        )  # fmt: skip

    def _find_init(self, run: PodmanRun) -> None:
        """The container's init by host pid and start time: conmon's child (conmon's pid and the
        container's id come from files Podman writes in the run's own folder, and conmon's command
        line names that id), read without a `podman` per look, which would contend for Podman's
        lock with the start itself. A container that ended before it was seen keeps the client as
        its leader: nothing of it is left to attribute, and a client that outlives it is stuck as
        one that outlives a container seen (a short script under load ended between two looks,
        and its stuck client held the job's end until CONTAINER_START_SECONDS)."""
        assert run.folder is not None
        give_up = time.monotonic() + settings.CONTAINER_START_SECONDS
        while run.proc.poll() is None:
            found = _conmon_child(run.folder)
            if found is not None:
                run.container_id, run.leader = found
                run.sid = run.leader.pid
                return
            if _conmon_gone(run.folder):
                run.init_gone_at = time.monotonic()  # it ran and ended unseen: only its client is left
                return
            if time.monotonic() > give_up:
                limit = settings.CONTAINER_START_SECONDS
                self._abandon(run, f"the container did not start in CONTAINER_START_SECONDS ({limit} s)")
            time.sleep(INSPECT_PAUSE_SECONDS)

    @staticmethod
    def _abandon(run: PodmanRun, why: str) -> NoReturn:
        """A start given up: the client's group killed and reaped first (an unreaped child of the
        worker's: its group is proved), the container's init too if it came meanwhile (by
        identity), then the container removed; OSError saying why (the runner fails the job with
        it). A removal that fails is said: the worker's next start removes what is left."""
        pids.send_group(run.proc.pid, signal.SIGKILL)
        run.proc.wait()
        if isinstance(run.output, PipeOutput):
            run.output.stop.set()  # nobody reads it any more
        assert run.folder is not None
        if (found := _conmon_child(run.folder)) is not None:
            pids.send(found[1], signal.SIGKILL)
        if left := _remove(run):
            why += f"; its container {run.container} may be left until the worker's next start ({left})"
        raise OSError(why)

    def poll(self, run: Run) -> RunEnd | None:
        podman_run = _run(run)
        code = podman_run.proc.poll()
        if code is None and _client_stuck(podman_run):
            code = _client_end(podman_run)
        return None if code is None else _end_of(code, podman_run.sent)

    def wait(self, run: Run) -> RunEnd:
        return _end_of(_client_end(_run(run)), _run(run).sent)

    def signal(self, run: Run, sig: signal.Signals) -> Signalled:
        """`sig` by identity, never through Podman: SIGKILL to the init (its PID namespace with
        it), any other signal once to each process of the init's session but the init. Never
        raises: what could not be done is said in the lines."""
        podman_run = _run(run)
        done = Signalled()
        if podman_run.collected or not podman_run.container_id:
            return done  # reaped, or never seen running (it ended at once): nothing of it to signal
        try:
            if sig == signal.SIGKILL:
                targets = [podman_run.leader]
            else:
                targets = [m for m in session_members(podman_run.leader) if m.pid != podman_run.leader.pid]
            for target in targets:
                outcome = pids.send(target, sig)
                done.sent += outcome is Sent.SENT
                done.denied = done.denied or outcome is Sent.DENIED
        except Exception as exc:
            log.exception("%s: could not send %s to its container's processes", run.name, sig.name)
            done.lines.append(f"[portal] {sig.name} could not be sent to the container ({exc!r}).")
            return done
        if done.sent:
            podman_run.sent.add(int(sig))
        elif done.denied:
            log.warning("%s: may not send %s to its container (permission denied)", run.name, sig.name)
        elif podman_run.proc.poll() is None and podman_run.leader.is_alive():
            done.lines.append(f"[portal] {sig.name} reached no process of the container: not signalled.")
            log.error("%s: %s reached no process of its container, though it runs", run.name, sig.name)
        return done

    def sweep(self, run: Run) -> Signalled:
        """The container's init SIGKILLed by identity (its namespace with it, whatever Podman does
        next), how it ended read while Podman still has it, and the container removed; then
        nothing of its session may be left: what is, is SIGKILLed until SWEEP_SECONDS, and said."""
        podman_run = _run(run)
        done = Signalled()
        if podman_run.container_id:
            pids.send(podman_run.leader, signal.SIGKILL)
            _read_end(podman_run, done)
        if why := _remove(podman_run):
            done.lines.append(f"[portal] could not remove the container {podman_run.container}: {why}")
            done.problem = "Its container may not have been removed (the worker's next start removes it)."
        if not podman_run.container_id:
            return done
        give_up = time.monotonic() + SWEEP_SECONDS
        while members := session_members(podman_run.leader):
            for member in members:
                done.sent += pids.send(member, signal.SIGKILL) is Sent.SENT
            if time.monotonic() > give_up:
                done.left = len(members)
                done.lines.append(f"[portal] {done.left} process(es) of the container outlived its removal.")
                done.problem = "Some of what it left running could not be stopped."
                break
            time.sleep(INSPECT_PAUSE_SECONDS)
        return done

    def collect(self, run: Run) -> RunEnd:
        podman_run = _run(run)
        end = _end_of(_client_end(podman_run), podman_run.sent, oom_killed=podman_run.oom_killed)
        podman_run.collected = True
        if podman_run.folder is not None:
            shutil.rmtree(podman_run.folder, ignore_errors=True)
        return end

    def stop(self, run: Run, grace: float) -> RunEnd:
        if self.poll(run) is None:
            self.signal(run, signal.SIGTERM)
            give_up = time.monotonic() + grace
            while self.poll(run) is None and time.monotonic() < give_up:
                time.sleep(self.tick)
            self.signal(run, signal.SIGKILL)
        self.wait(run)
        self.sweep(run)
        return self.collect(run)

    def did_not_start(self, end: RunEnd) -> str:
        if end.code == PODMAN_ERROR:
            return (
                "Did not start: Podman could not start its container (exit code 125; the log says why:"
                " an image not on this host, a folder that could not be mounted). An admin checks the"
                " image on this server (manage.py images_pull) or the host's containers."
            )
        if end.code in (CANNOT_INVOKE, NOT_FOUND):
            return (
                f"Did not start: the image has no python3 that runs (exit code {end.code}). An admin"
                " gives the image a python3 on its PATH, or you choose another image."
            )
        return ""


def _preexec(fds: Sequence[int]) -> Callable[[], None]:
    """The `podman run` client's preexec_fn: it dies with the worker, and holds `fds` (a lab's
    listening socket) at FIRST_PASSED_FD, FIRST_PASSED_FD + 1, ... in order, which
    `--preserve-fds` (podman_args.run_argv) hands on to the container's command at the same
    numbers: Podman passes only a run of descriptors from 3, never others at their own numbers.
    Each is copied above that run first, so that one already there is never overwritten before
    it is copied; close_fds then closes every other (the copies above included)."""
    dies = die_with_parent(signal.SIGKILL)
    wanted = tuple(fds)

    def preexec() -> None:
        dies()
        above = [fcntl.fcntl(fd, fcntl.F_DUPFD, FIRST_PASSED_FD + len(wanted)) for fd in wanted]
        for number, fd in enumerate(above, start=FIRST_PASSED_FD):
            os.dup2(fd, number)  # inheritable, as dup2 makes it

    return preexec


def _run(run: Run) -> PodmanRun:
    assert isinstance(run, PodmanRun), f"{run.name} was not started by Podman"
    return run


def _client_stuck(run: PodmanRun) -> bool:
    """Whether the `podman run` client has outlived the container's init by COMMAND_SECONDS
    (stuck on Podman's lock): the job has ended, whatever the client says."""
    if run.init_gone_at is None:
        if not run.container_id or run.leader.is_alive():
            return False
        run.init_gone_at = time.monotonic()
    return time.monotonic() - run.init_gone_at > containers.COMMAND_SECONDS


def _client_end(run: PodmanRun) -> int:
    """The `podman run` client's exit code. It waits as long as the container's init lives (the
    job runs); once the init is gone, a client that has not exited within COMMAND_SECONDS (stuck on
    Podman's lock) has its group killed (an unreaped child's: proved) and is reaped, said in the
    worker's log: a hung Podman never holds a job's end. The code is then the client's signal."""
    while True:
        try:
            return run.proc.wait(timeout=0 if _client_stuck(run) else containers.COMMAND_SECONDS)
        except subprocess.TimeoutExpired:
            if not _client_stuck(run):
                continue  # the job still runs (the client rightly waits with it), or just ended
            log.error(
                "%s: podman run had not exited %s s after its container ended: killed",
                run.name,
                containers.COMMAND_SECONDS,
            )
            pids.send_group(run.proc.pid, signal.SIGKILL)
            return run.proc.wait()


def _end_of(returncode: int, sent: set[int], *, oom_killed: bool = False) -> RunEnd:
    """Podman answers 128+N for a command killed by signal N (catatonit passes it on), and as
    well for a script's own exit(128+N): read as signal N only when the portal sent N, or N is
    SIGKILL and Podman saw the OOM killer end it; otherwise the code, as a shell gives it."""
    if returncode < 0:
        return RunEnd(signal=-returncode)  # the client itself was killed (never by the portal)
    number = returncode - 128
    if number > 0 and (number in sent or (oom_killed and number == signal.SIGKILL)):
        return RunEnd(signal=number)
    return RunEnd(code=returncode)


def _read_end(run: PodmanRun, done: Signalled) -> None:
    """For an exit code 128+N the portal did not cause: whether the OOM killer ended it (Podman's
    record of the container, read before it is removed), and, if not, a line that says what the
    code may mean. A Podman that fails to answer leaves it unknown: the code stands."""
    code = run.proc.poll()
    if code is None or code <= 128 or code - 128 in run.sent:
        return
    try:
        found = podman(
            "inspect", "--type", "container", "--format", "{{.Id}} {{.State.OOMKilled}}", "--", run.container,
            account=run.account,
        ).stdout.split()  # fmt: skip
    except ContainerError as exc:
        log.warning("%s: could not read how its container ended: %s", run.name, exc)
        found = []
    run.oom_killed = found == [run.container_id, "true"]
    if run.oom_killed and code - 128 == signal.SIGKILL:
        done.lines.append("[portal] the kernel's OOM killer ended the container (out of memory).")
        return
    try:
        name = signal.Signals(code - 128).name
    except ValueError:
        return
    done.lines.append(
        f"[portal] exit code {code} = 128 + {code - 128} ({name}): in a container, a process killed by"
        f" {name} and one that exited with {code} end alike; the portal sent no {name}."
    )


def _remove(run: PodmanRun) -> str:
    """`podman rm --force` of the run's container: "" once removed (or gone), else why not (said
    in the worker's log too)."""
    try:
        removed = podman("rm", "--force", "--ignore", "--time", "0", "--", run.container, account=run.account)
        why = "" if removed.returncode == 0 else last_line(removed.stderr)
    except ContainerError as exc:
        why = str(exc)
    if why:
        log.error("%s: could not remove its container %s: %s", run.name, run.container, why)
    return why


def _podman_account(spec: RunSpec) -> pwd.struct_passwd | None:
    """Whose Podman runs the container: the job's account's own in rootless mode (which needs
    one: JOB_USER), else the worker's (None)."""
    if settings.CONTAINER_MODE != "rootless":
        return None
    if spec.account is None:
        raise OSError(
            "CONTAINER_MODE=rootless runs each container as the job's account, and JOB_USER names"
            " none: an admin sets JOB_USER (docs/containers.md)."
        )
    return spec.account


def _run_folder(container: str, env: dict[str, str], account: pwd.struct_passwd | None) -> Path:
    """A folder of the worker's alone for one run (the account's alone, rootless, whose Podman
    reads and writes it): the container's environment (never on Podman's command line, where
    every account on the host can read it), the files Podman writes its id and conmon's pid to.
    Its parent lets others pass but not list. Removed once the run is collected."""
    text = env_file_text(env)  # refused before anything is written
    parent = Path(settings.VAR_DIR) / "containers"
    parent.mkdir(mode=0o711, exist_ok=True)
    os.chmod(parent, 0o711)
    folder = Path(tempfile.mkdtemp(prefix=f"{container}.", dir=parent))
    try:
        (folder / "env").write_text(text)
        if account is not None:
            os.chown(folder, account.pw_uid, account.pw_gid)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def _read(path: Path) -> str:
    """A small file Podman wrote, never through a link (rootless: the folder is the account's)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as opened:
        return opened.read(4096).strip()


def _conmon_gone(folder: Path) -> bool:
    """Whether the container's conmon came and went: Podman wrote the container's id, conmon its
    pid, and no process has that pid now (conmon stays until its container has ended and its exit
    is written). A pid taken again since reads as not gone, and the look goes on."""
    try:
        return bool(_read(folder / "cid")) and not psutil.pid_exists(int(_read(folder / "conmon.pid")))
    except (OSError, ValueError):
        return False


def _conmon_child(folder: Path) -> tuple[str, ProcessId] | None:
    """(container id, its init) once runc has created it; None until then. Conmon's command line
    names the container's id and the pid file runc writes the init's pid to once created (before
    that, conmon's child is `runc create` itself); the init is conmon's child."""
    try:
        container_id = _read(folder / "cid")
        conmon = psutil.Process(int(_read(folder / "conmon.pid")))
        args = conmon.cmdline()
        if not container_id or container_id not in args or "-p" not in args:
            return None  # not (or no longer) the conmon of this container
        init = psutil.Process(int(_read(Path(args[args.index("-p") + 1]))))
        if init.ppid() != conmon.pid:
            return None
        return container_id, ProcessId(init.pid, init.create_time())
    except (OSError, ValueError, IndexError, psutil.Error):
        return None

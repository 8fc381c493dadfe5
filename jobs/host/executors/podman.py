"""The Podman executor: a run is a container (`Podman`), for work whose image is set (issue 34,
docs/containers.md).

The worker starts `podman run --rm` attached (its output is the run's, through a pipe as for a
local process) and waits on that client for the exit code. The container's first process is
catatonit (`--init`): runc makes it a session leader, and it forwards the signals it gets to the
command. Its *host* pid (`podman inspect {{.State.Pid}}`) and start time are the run's leader, so
Job.pid names the container's session and the watchdog, the dashboard and the orphan sweep
attribute every process in it to the job (gpus.procinfo.session_of) as they do a local one's.

Signals prove the container first: its id, and its init's host pid with its start time, checked
before each one. SIGKILL goes to the init (`podman kill`): the kernel then kills everything in the
container's PID namespace at once, a process that left the session (setsid) included. Other
signals go to the init, which hands them to the command, and to every process of its session by
identity, as a local run's do. After the exit the container is removed (`podman rm --force`, beside
`--rm`): no process, no container, no mount is left.

What the container gets (jobs/host/executors/podman_args.py): the booked cards alone, the job's
folders at their own paths, the account's uid and gid, no capabilities, no new privileges, no
network unless the image's admin allowed it.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from django.conf import settings

from jobs.host import rootless
from jobs.host.containers import ContainerError, podman, podman_command, podman_env
from jobs.host.executors.base import Run, RunEnd, RunSpec, Signalled
from jobs.host.executors.output import PipeOutput
from jobs.host.executors.podman_args import env_file_text, run_argv
from portal import pids
from portal.pids import ProcessId, Sent, session_members, started_at
from portal.processes import die_with_parent

log = logging.getLogger(__name__)

INSPECT_PAUSE_SECONDS = 0.01
SWEEP_SECONDS = 5.0
# Podman's own exit codes before the command ran (as `docker run`'s): its error, a command that
# could not be invoked, a command not found.
PODMAN_ERROR, CANNOT_INVOKE, NOT_FOUND = 125, 126, 127


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
    collected: bool = field(kw_only=True, default=False)


class Podman:
    """The executor that runs work in a container (jobs.host.executors.Executor), named
    `container` (portal-<instance>-job-<id>: one per job, found again by a restarted worker)."""

    def __init__(self, container: str, *, tick: float = 0.1) -> None:
        self.container = container
        self.tick = tick

    def start(self, spec: RunSpec) -> PodmanRun:
        """`podman run` attached, and the container's init found; OSError when Podman cannot
        start it (the message says why and what to do)."""
        if spec.image is None:
            raise OSError(f"{spec.name} has no image: it runs on the host (LocalProcess)")
        account = _podman_account(spec)
        try:
            folder = _run_folder(self.container, spec.env, account)
            argv = run_argv(spec, self.container, folder, rootless=account is not None)
            command, env = podman_command(*argv, account=account), podman_env(account)
        except ContainerError as exc:
            raise OSError(str(exc)) from None
        proc = subprocess.Popen(
            command,
            cwd="/",
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # Podman's own errors land in the job's log, with its output
            start_new_session=True,  # never in the worker's group: a signal to it misses the client
            close_fds=True,
            preexec_fn=die_with_parent(signal.SIGKILL),
            **rootless.as_account(account),  # type: ignore[arg-type]
        )
        assert proc.stdout is not None
        output = PipeOutput(proc.stdout, tick=self.tick)
        run = PodmanRun(
            spec.name, ProcessId(proc.pid, started_at(proc.pid) or -1.0), proc.pid, output,
            proc=proc, container=self.container, folder=folder, account=account,
        )  # fmt: skip
        self._find_init(run)
        return run

    def _find_init(self, run: PodmanRun) -> None:
        """The container's init by host pid and start time: conmon's child (conmon's pid and the
        container's id come from files Podman writes in the run's own folder, and conmon's command
        line names that id), read without a `podman` per look, which would contend for Podman's
        lock with the start itself. A container that ended before it was seen keeps the client as
        its leader: nothing of it is left to attribute."""
        assert run.folder is not None
        give_up = time.monotonic() + settings.CONTAINER_START_SECONDS
        while run.proc.poll() is None:
            found = _conmon_child(run.folder)
            if found is not None:
                run.container_id, run.leader = found
                run.sid = run.leader.pid
                return
            if time.monotonic() > give_up:
                podman("rm", "--force", "--ignore", "--time", "0", run.container, account=run.account)
                run.proc.kill()
                limit = settings.CONTAINER_START_SECONDS
                raise OSError(f"the container did not start in CONTAINER_START_SECONDS ({limit} s)")
            time.sleep(INSPECT_PAUSE_SECONDS)

    @staticmethod
    def _inspect(name: str, account: pwd.struct_passwd | None) -> tuple[str, int] | None:
        """(id, host pid of its init; 0 when not running) of the container named `name`; None: none."""
        try:
            done = podman(
                "inspect", "--type", "container", "--format", "{{.Id}} {{.State.Pid}}", name, account=account
            )
        except ContainerError:
            return None
        parts = done.stdout.split()
        if done.returncode != 0 or len(parts) != 2 or not parts[1].isdigit():
            return None
        return parts[0], int(parts[1])

    def poll(self, run: Run) -> RunEnd | None:
        code = _run(run).proc.poll()
        return None if code is None else _end_of(code, _run(run).sent)

    def wait(self, run: Run) -> RunEnd:
        return _end_of(_run(run).proc.wait(), _run(run).sent)

    def signal(self, run: Run, sig: signal.Signals) -> Signalled:
        """The container proved (id, init's pid and start), then `sig` to its init (SIGKILL: the
        whole PID namespace with it) and, for any other signal, to every process of its session
        by identity. A container already gone counts as signalled."""
        podman_run = _run(run)
        done = Signalled()
        if podman_run.collected or not self._proved(podman_run):
            return done
        podman_run.sent.add(int(sig))
        killed = podman("kill", "--signal", sig.name, podman_run.container_id, account=podman_run.account)
        done.sent += killed.returncode == 0
        if sig != signal.SIGKILL:
            for member in session_members(podman_run.leader):
                if member.pid != podman_run.leader.pid:
                    outcome = pids.send(member, sig)
                    done.sent += outcome is Sent.SENT
                    done.denied = done.denied or outcome is Sent.DENIED
        if killed.returncode != 0 and self._proved(podman_run):
            done.lines.append(
                f"[portal] podman kill --signal {sig.name} failed: {killed.stderr.strip()[:300]}"
            )
            log.error("%s: podman kill %s failed: %s", run.name, sig.name, killed.stderr.strip())
        return done

    def _proved(self, run: PodmanRun) -> bool:
        """The container is still this run's: the same id, its init the same process."""
        if not run.container_id:
            return False  # never seen running (ended at once): nothing of it to signal
        found = self._inspect(run.container, run.account)
        return (
            found is not None
            and found[0] == run.container_id
            and found[1] == run.leader.pid
            and run.leader.is_alive()
        )

    def sweep(self, run: Run) -> Signalled:
        """The container removed (killed first if it still runs), then nothing of its session may
        be left: what is, is SIGKILLed by identity until SWEEP_SECONDS, and said."""
        podman_run = _run(run)
        done = Signalled()
        try:
            podman(
                "rm", "--force", "--ignore", "--time", "0", podman_run.container, account=podman_run.account
            )
        except ContainerError as exc:
            done.lines.append(f"[portal] could not remove the container {podman_run.container}: {exc}")
            done.problem = "Its container may not have been removed."
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
        end = _end_of(podman_run.proc.wait(), podman_run.sent)
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


def _run(run: Run) -> PodmanRun:
    assert isinstance(run, PodmanRun), f"{run.name} was not started by Podman"
    return run


def _end_of(returncode: int, sent: set[int]) -> RunEnd:
    """Podman answers 128+N for a command killed by signal N (catatonit passes it on): read as
    that signal when the portal sent N, or N is SIGKILL (what else ends a job with 137: the OOM
    killer); otherwise the code the script chose."""
    if returncode < 0:
        return RunEnd(signal=-returncode)
    if returncode > 128 and (returncode - 128 in sent or returncode - 128 == signal.SIGKILL):
        return RunEnd(signal=returncode - 128)
    return RunEnd(code=returncode)


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
    parent = Path(settings.VAR_DIR) / "containers"
    parent.mkdir(mode=0o711, exist_ok=True)
    os.chmod(parent, 0o711)
    folder = Path(tempfile.mkdtemp(prefix=f"{container}.", dir=parent))
    (folder / "env").write_text(env_file_text(env))
    if account is not None:
        os.chown(folder, account.pw_uid, account.pw_gid)
    return folder


def _read(path: Path) -> str:
    """A small file Podman wrote, never through a link (rootless: the folder is the account's)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as opened:
        return opened.read(4096).strip()


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

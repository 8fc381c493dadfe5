"""The local process executor: a run is a subprocess in a session of its own (`LocalProcess`).

A run starts in a session of its own (portal.processes.start_job_process: JOB_USER's account, no
privileges, SIGKILLed with the worker), and everything it starts stays in that session whatever
process groups it makes (setpgid, `process_group=0`): only setsid leaves it, and then the process is
no longer the run's to prove (a cgroup per job is the complete answer to that: docs/jobs.md). So a
stop, a cancel and the final sweep reach every process of the session (portal.pids), each named by
its pid and start time and signalled through a pidfd: never a bare `kill` of a pid that may have
been reaped and reused since.

The leader (the run's main process) is the worker's own child: its pid cannot be reused until
the worker reaps it. So its exit is detected without reaping (`waitid(..., WNOWAIT)`), the
session is swept while the pid still names it, and only then is the leader reaped (`collect`).
Until then its process group (the leader's pid: a session leader cannot leave it) is signalled
whole with `killpg`, which the kernel does at once against fork: a process that forks and exits in
a loop escapes a scan of /proc, never a group signal. Groups the run made are signalled the same
way once a live member of the session shows them (portal.pids.groups_of).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

from jobs.host.executors.base import Run, RunEnd, RunSpec, Signalled
from jobs.host.executors.output import PipeOutput
from portal import pids
from portal.pids import ProcessId, Sent, groups_of, send_group, session_groups, session_members, started_at
from portal.processes import PRIVILEGES_EXIT_CODE, WORKDIR_EXIT_CODE, start_job_process

log = logging.getLogger(__name__)

SWEEP_SECONDS = 5.0  # the end sweep gives up after this, saying what it could not end
SWEEP_PAUSE_SECONDS = 0.02
SWEEP_QUIET_ROUNDS = 3  # a pid that lives for a fork may slip one scan; three in a row, not likely


class JobSession:
    """The session of a run's main process `proc`, which the caller started and has not reaped."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        # A pidfd names the leader without /proc (hidepid=2 hides another account's processes);
        # none to be had (no pidfds, EMFILE...): the unreaped pid is as good, only for the leader.
        try:
            self.pidfd: int | None = os.pidfd_open(proc.pid)
        except OSError as exc:
            log.warning(
                "No pidfd for the job's process %s (%s): signalled by its unreaped pid", proc.pid, exc
            )
            self.pidfd = None
        # Not reaped yet (zombie at worst), so this pid is still the child's: its start is its own.
        started = started_at(proc.pid)
        # Unreadable (hidepid): a start no process has, so no other process is taken for it.
        self.leader = ProcessId(proc.pid, started if started is not None else -1.0)
        self.reaped = False

    def exited(self) -> bool:
        """Whether the main process has exited; it stays unreaped, so its pid stays the job's."""
        if self.proc.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True  # reaped by someone else (never here): treated as gone

    def wait_exit(self) -> None:
        """Block until the main process has exited, without reaping it."""
        if self.proc.returncode is not None:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)

    def visible(self) -> bool:
        """Whether this worker can see the job's processes in /proc (not so under hidepid=2 with
        JOB_USER); its own unreaped child is always there to be seen otherwise."""
        return started_at(self.proc.pid) is not None

    def signal(self, sig: signal.Signals) -> Signalled:
        """`sig` to every live process of the job's session, each by its identity; SIGKILL also to
        its process group at once. Where the members cannot be seen, the leader through its pidfd
        (and SIGKILL its group): said in `unlisted`. Nothing after `reap`."""
        done = Signalled()
        if self.reaped:
            return done
        members = session_members(self.leader, held=True)
        done.unlisted = not self.visible()
        if done.unlisted:
            self._leader_signal(sig, done)
        for member in members:
            if done.unlisted and member.pid == self.leader.pid:
                continue  # signalled through its pidfd
            self._count(pids.send(member, sig), done)
        if sig == signal.SIGKILL and not done.denied:
            self._count(send_group(self.leader.pid, sig), done)
        return done

    def end(self) -> Signalled:
        """SIGKILL to what is left of the session, round after round until three scans in a row
        find nothing, for SWEEP_SECONDS at most (`left`: what was still there). Each round: every
        member by identity, then (none refused) the leader's group and every group a live member
        shows, at once. Call it before `reap`."""
        done = Signalled(unlisted=not self.visible())
        give_up = time.monotonic() + SWEEP_SECONDS
        quiet = 0
        while not self.reaped:
            members = [m for m in session_members(self.leader, held=True) if m.pid != self.leader.pid]
            for member in members:
                self._count(pids.send(member, signal.SIGKILL), done)
            if done.denied:
                done.left = len(members)
                break  # the group signals would be refused as well: nothing more to do here
            groups = groups_of(members) | session_groups(self.leader.pid)
            for pgid in {self.leader.pid} | groups:
                self._count(send_group(pgid, signal.SIGKILL), done)
            quiet = 0 if members or groups - {self.leader.pid} else quiet + 1
            if quiet >= SWEEP_QUIET_ROUNDS:
                break
            if time.monotonic() >= give_up:
                done.left = len(members)
                break
            time.sleep(SWEEP_PAUSE_SECONDS)
        return done

    def _leader_signal(self, sig: signal.Signals, done: Signalled) -> None:
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, sig)
            else:
                os.kill(self.proc.pid, sig)  # unreaped: the pid is still the leader's
        except ProcessLookupError:
            return
        except PermissionError:
            done.denied = True
            return
        except OSError as exc:
            if exc.errno != errno.ESRCH:
                raise
            return
        done.sent += 1

    @staticmethod
    def _count(outcome: Sent, done: Signalled) -> None:
        done.sent += outcome is Sent.SENT
        done.denied = done.denied or outcome is Sent.DENIED

    def reap(self) -> int:
        """The main process's exit status (Popen's returncode); its pid is free from here on."""
        self.reaped = True  # before the wait: nothing is signalled in its name from here on
        code = self.proc.wait()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        return code


@dataclass
class LocalRun(Run):
    """A run of `LocalProcess`: the handle, plus the session that proves its processes."""

    session: JobSession = field(kw_only=True, repr=False)


class LocalProcess:
    """The executor that runs work as a subprocess of the worker (jobs.host.executors.Executor)."""

    def __init__(self, *, tick: float = 0.1) -> None:
        self.tick = tick  # how often the output's reader looks for a stop, and waits for room

    def start(self, spec: RunSpec) -> LocalRun:
        account = spec.account
        proc = start_job_process(
            list(spec.argv),
            env=spec.env,
            cwd=spec.cwd,
            user=account.pw_uid if account is not None else None,
            group=account.pw_gid if account is not None else None,
            pass_fds=spec.pass_fds,
        )
        session = JobSession(proc)  # its identity, taken before anything can reap it
        assert proc.stdout is not None
        output = PipeOutput(proc.stdout, tick=self.tick)
        return LocalRun(spec.name, session.leader, proc.pid, output, session=session)

    def poll(self, run: Run) -> RunEnd | None:
        proc = _session(run).proc
        if proc.returncode is not None:
            return _end_of(proc.returncode)
        try:
            found = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return RunEnd()  # reaped by someone else (never here): treated as gone
        if found is None:
            return None
        if found.si_code == os.CLD_EXITED:
            return RunEnd(code=found.si_status)
        return RunEnd(signal=found.si_status)  # CLD_KILLED, CLD_DUMPED

    def wait(self, run: Run) -> RunEnd:
        _session(run).wait_exit()
        return self.poll(run) or RunEnd()

    def signal(self, run: Run, sig: signal.Signals) -> Signalled:
        """Every process of the run's session, each by its identity; nothing left to signal
        counts as signalled, and a signal that reached nothing while the run runs, or processes
        that cannot be seen, are said."""
        session = _session(run)
        done = session.signal(sig)
        _say_unseen(run, done, sig.name)
        if done.denied:
            log.warning(
                "%s: may not send %s to its processes (permission denied: CAP_KILL?)", run.name, sig.name
            )
        elif not done.sent and not session.exited():
            done.lines.append(f"[portal] {sig.name} reached no process of the job: it was not signalled.")
            log.error("%s: %s reached no process of it, though it runs", run.name, sig.name)
        return done

    def sweep(self, run: Run) -> Signalled:
        """Whatever the main process left in its session goes with it, whatever process groups it
        made there. A failure here is said, and still lets the run be collected."""
        try:
            done = _session(run).end()
        except Exception:
            log.exception("%s: the end sweep failed; what it left may run on", run.name)
            return Signalled(
                lines=["[portal] the worker could not end what the job left running (see the worker's log)."],
                problem="What it left running may not have been stopped.",
            )
        _say_unseen(run, done, "the end sweep (SIGKILL)")
        if done.denied:
            done.lines.append(
                "[portal] the job left processes running that the worker may not kill: permission denied."
            )
            done.problem = "Could not stop what it left running: permission denied."
        elif done.left:
            done.lines.append(
                f"[portal] {done.left} process(es) of the job's session were still there after the end"
                " sweep gave up; they may run on."
            )
            log.error("%s: %s process(es) of its session survived the end sweep", run.name, done.left)
            done.problem = "Some of what it left running could not be stopped."
        return done

    def collect(self, run: Run) -> RunEnd:
        return _end_of(_session(run).reap())

    def stop(self, run: Run, grace: float) -> RunEnd:
        if self.poll(run) is None:
            self.signal(run, signal.SIGTERM)
            give_up = time.monotonic() + grace
            while self.poll(run) is None and time.monotonic() < give_up:
                time.sleep(self.tick)
            self.signal(run, signal.SIGKILL)
        self.sweep(run)
        return self.collect(run)

    def did_not_start(self, end: RunEnd) -> str:
        """The exit codes the job's child ends with before exec (portal.processes): only meant so
        when the command never spoke (the caller knows: the launcher's line)."""
        if end.code == PRIVILEGES_EXIT_CODE:
            return (
                f"Did not start: its process could not drop the worker's privileges (exit code {end.code}; "
                "the log says which step failed)."
            )
        if end.code == WORKDIR_EXIT_CODE:
            return (
                f"Did not start: its account may not enter its working directory (exit code {end.code}; "
                "the log says why)."
            )
        return ""


def _session(run: Run) -> JobSession:
    assert isinstance(run, LocalRun), f"{run.name} was not started by LocalProcess"
    return run.session


def _end_of(returncode: int) -> RunEnd:
    return RunEnd(signal=-returncode) if returncode < 0 else RunEnd(code=returncode)


def _say_unseen(run: Run, done: Signalled, what: str) -> None:
    """Processes this worker cannot see (/proc hidepid) are said once per run."""
    if not done.unlisted or run.unlisted_said:
        return
    run.unlisted_said = True
    done.lines.append(
        "[portal] this worker cannot see the job's processes (/proc mounted with hidepid?): "
        f"{what} went to its main process and its process group only; what it started in"
        " other groups may run on."
    )
    log.error(
        "%s: cannot list its processes (/proc hidepid?); %s went to its main process and group only",
        run.name,
        what,
    )

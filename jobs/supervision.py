"""A job's processes, by identity: signalled, ended and reaped as one session (jobs/runner.py).

A job starts in a session of its own (portal.processes.start_job_process), and everything it
starts stays in that session whatever process groups it makes (setpgid, `process_group=0`): only
setsid leaves it, and then the process is no longer the job's to prove (a cgroup per job is the
complete answer to that: docs/jobs.md). So a stop, a cancel and the final sweep reach every
process of the session (portal.pids), each named by its pid and start time and signalled through
a pidfd: never a bare `kill` of a pid that may have been reaped and reused since.

The leader (the job's main process) is the worker's own child: its pid cannot be reused until
the worker reaps it. So its exit is detected without reaping (`waitid(..., WNOWAIT)`), the
session is swept while the pid still names it, and only then is the leader reaped. Until then
its process group (the leader's pid: a session leader cannot leave it) is signalled whole with
`killpg`, which the kernel does at once against fork: a process that forks and exits in a loop
escapes a scan of /proc, never a group signal. Groups the job made are signalled the same way
once a live member of the session shows them (portal.pids.groups_of).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from portal import pids
from portal.pids import ProcessId, Sent, groups_of, send_group, session_groups, session_members, started_at

log = logging.getLogger(__name__)

SWEEP_SECONDS = 5.0  # the end sweep gives up after this, saying what it could not end
SWEEP_PAUSE_SECONDS = 0.02
SWEEP_QUIET_ROUNDS = 3  # a pid that lives for a fork may slip one scan; three in a row, not likely
# 4 MiB at most between the pipe and the supervisor: past that the job waits, not the worker's memory.
OUTPUT_QUEUE_CHUNKS = 64


@dataclass
class Signalled:
    """What one signal to the job's session did."""

    sent: int = 0  # processes (or groups) it reached
    denied: bool = False  # one of them the worker may not signal (JOB_USER without CAP_KILL)
    unlisted: bool = False  # members unseen (/proc hidepid): the leader and its group only
    left: int = 0  # the end sweep: processes still there when it gave up


class JobSession:
    """The session of a job's main process `proc`, which the caller started and has not reaped."""

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


class JobOutput:
    """The job's one stdout+stderr pipe, read by a thread of its own into `chunks` (None at the
    end), at most OUTPUT_QUEUE_CHUNKS ahead of the supervisor: past that the thread stops reading
    and the pipe pushes back on the job. The thread stops at EOF or when told (a process that
    left the job's session may hold the pipe open for ever) and closes the pipe itself: the one
    thread that reads it. Whoever takes the None (`get`) sets `eof`."""

    def __init__(self, stream: IO[bytes], *, tick: float) -> None:
        self.chunks: queue.Queue[bytes | None] = queue.Queue(maxsize=OUTPUT_QUEUE_CHUNKS)
        self.stop = threading.Event()
        self.eof = False
        self.tick = tick
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def get(self, timeout: float) -> bytes | None:
        """The next chunk (queue.Empty after `timeout`); None once the output has ended."""
        if self.eof:
            return None
        data = self.chunks.get(timeout=timeout)
        self.eof = data is None
        return data

    def _put(self, data: bytes | None) -> bool:
        """Wait for room, a tick at a time; give up once told to stop (nobody reads any more)."""
        while True:
            try:
                self.chunks.put(data, timeout=self.tick)
                return True
            except queue.Full:
                if self.stop.is_set():
                    return False

    def _pump(self, stream: IO[bytes]) -> None:
        fd = stream.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        try:
            while not self.stop.is_set():
                if not poller.poll(self.tick * 1000):
                    continue
                data = os.read(fd, 65536)
                if not data or not self._put(data):
                    break
        finally:
            stream.close()
            self._put(None)

    def drain(
        self, seconds: float, take: Callable[[bytes], None], beat: Callable[[], None], beat_every: float
    ) -> bool:
        """Hand what is left to `take` until EOF (True, at once if it came already), or for
        `seconds` at most, calling `beat` every `beat_every`; then stop reading and close the pipe
        (False)."""
        deadline = last_beat = time.monotonic()
        deadline += seconds
        while not self.eof and (left := deadline - time.monotonic()) > 0:
            if time.monotonic() - last_beat >= beat_every:
                last_beat = time.monotonic()
                beat()
            try:
                data = self.get(timeout=min(self.tick, left))
            except queue.Empty:
                continue
            if data is not None:
                take(data)
        if self.eof:
            return True
        self.stop.set()  # the reader sees it within a tick
        with contextlib.suppress(queue.Empty):
            while (data := self.get(timeout=1.0)) is not None:
                take(data)
        return False

"""A job's processes, by identity: signalled, ended and reaped as one session (jobs/runner.py).

A job starts in a session of its own (portal.processes.start_job_process), and everything it
starts stays in that session whatever process groups it makes (setpgid, `process_group=0`): only
setsid leaves it, and then the process is no longer the job's to prove. So a stop, a cancel and
the final sweep reach every process of the session (portal.pids.send_session), each named by its
pid and start time and signalled through a pidfd: never a bare `killpg` of a pid that may have
been reaped and reused since.

The leader (the job's main process) is the worker's own child: its pid cannot be reused until
the worker reaps it. So its exit is detected without reaping (`waitid(..., WNOWAIT)`), the
session is swept while the pid still names it, and only then is the leader reaped.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO

from portal.pids import ProcessId, send_session, started_at

SWEEP_ROUNDS = 20  # a member that forks while the sweep runs is found on the next round
SWEEP_PAUSE_SECONDS = 0.05


class JobSession:
    """The session of a job's main process `proc`, which the caller started and has not reaped."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        # Not reaped yet (zombie at worst), so this pid is still the child's: its start is its own.
        started = started_at(proc.pid)
        # Unreadable (no /proc?): a start no process has, so nothing is ever signalled in its name.
        self.leader = ProcessId(proc.pid, started if started is not None else -1.0)

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

    def signal(self, sig: signal.Signals) -> bool:
        """`sig` to every live process of the job's session; False when the worker may not signal
        one of them (JOB_USER without CAP_KILL). Nothing left to signal counts as signalled."""
        _, denied = send_session(self.leader, sig)
        return not denied

    def end(self) -> bool:
        """SIGKILL to what is left of the session, round after round until nothing answers (a
        member may fork while it runs). Call it before `reap`; False when one may not be killed."""
        allowed = True
        for _ in range(SWEEP_ROUNDS):
            sent, denied = send_session(self.leader, signal.SIGKILL)
            allowed = allowed and not denied
            if not sent:
                break
            time.sleep(SWEEP_PAUSE_SECONDS)
        return allowed

    def reap(self) -> int:
        """The main process's exit status (Popen's returncode); its pid is free from here on."""
        return self.proc.wait()


class JobOutput:
    """The job's one stdout+stderr pipe, read by a thread of its own into `chunks` (None at the
    end). The thread stops at EOF or when told (a process that left the job's session may hold
    the pipe open for ever) and closes the pipe itself: the one thread that reads it."""

    def __init__(self, stream: IO[bytes], *, tick: float) -> None:
        self.chunks: queue.Queue[bytes | None] = queue.Queue()
        self.stop = threading.Event()
        self.tick = tick
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[bytes]) -> None:
        fd = stream.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        try:
            while not self.stop.is_set():
                if not poller.poll(self.tick * 1000):
                    continue
                data = os.read(fd, 65536)
                if not data:
                    break
                self.chunks.put(data)
        finally:
            stream.close()
            self.chunks.put(None)

    def drain(
        self, seconds: float, take: Callable[[bytes], None], beat: Callable[[], None], beat_every: float
    ) -> bool:
        """Hand what is left to `take` until EOF (True), or for `seconds` at most, calling `beat`
        every `beat_every`; then stop reading and close the pipe (False)."""
        deadline = last_beat = time.monotonic()
        deadline += seconds
        while (left := deadline - time.monotonic()) > 0:
            if time.monotonic() - last_beat >= beat_every:
                last_beat = time.monotonic()
                beat()
            try:
                data = self.chunks.get(timeout=min(self.tick, left))
            except queue.Empty:
                continue
            if data is None:
                return True
            take(data)
        self.stop.set()  # the reader sees it within a tick
        with contextlib.suppress(queue.Empty):
            while (data := self.chunks.get(timeout=1.0)) is not None:
                take(data)
        return False

"""Keep `make run`'s processes running: restart a child that dies, with a growing delay.

`runportal` starts the web server and the Celery workers as children of one process, and
`python -m portal.embedded_redis` its redis-server (portal/embedded_redis.py). When one dies
(the OOM killer, a crash, `kill -9`) only that one is started again, after 1 s, 2 s, 4 s ...
up to MAX_DELAY_SECONDS; the delay starts over at 1 s once the child has stayed up for
HEALTHY_AFTER_SECONDS. Everything stops only when `ProcessSupervisor.stop()` is called
(runportal does on Ctrl-C or SIGTERM, embedded_redis once its command has ended); a second
Ctrl-C or SIGTERM during runportal's graceful stop kills every child at once.

Each child runs in its own process group, and a dead child's group is killed before it is
started again: a Celery worker's embedded beat has no parent-death signal and outlives a
SIGKILLed worker, and gunicorn's workers notice their master's death only later. Without
this a restarted worker would run beside its predecessor's leftovers. A group is only ever
signalled while its leader is our child and unreaped (running, or a zombie we have seen with
WNOWAIT), so its id cannot have been reused by an unrelated process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from portal.processes import die_with_parent

FIRST_DELAY_SECONDS = 1.0
MAX_DELAY_SECONDS = 30.0
HEALTHY_AFTER_SECONDS = 60.0  # up this long: the next death starts the delays over
STOP_GRACE_SECONDS = 20.0  # after SIGTERM on stop, then SIGKILL
TICK_SECONDS = 0.2


@dataclass(frozen=True)
class ChildSpec:
    """How to start one child, again and again."""

    name: str  # in log lines: "worker host.box1", "web server"
    argv: Sequence[str]
    env: Mapping[str, str] | None = None  # None: the supervisor's own environment
    stdout: int | None = None  # e.g. subprocess.DEVNULL; None: the supervisor's own


@dataclass
class Backoff:
    """The delay before restarting one child. Pure: the caller passes the times."""

    first: float = FIRST_DELAY_SECONDS
    cap: float = MAX_DELAY_SECONDS
    healthy_after: float = HEALTHY_AFTER_SECONDS
    failures: int = 0  # deaths since the child last stayed up for `healthy_after`

    def delay(self, *, started_at: float, died_at: float) -> float:
        if died_at - started_at >= self.healthy_after:
            self.failures = 0
        delay = min(self.cap, self.first * 2 ** min(self.failures, 32))
        self.failures += 1
        return delay


def exit_status(returncode: int) -> str:
    """Popen's returncode in words: "exit code 1", "killed by SIGKILL"."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _exit_code(proc: subprocess.Popen) -> int | None:
    """None while `proc` runs; once it has exited, kill what it left in its group, then reap it."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        # WNOWAIT: look without reaping, so the group id stays ours until the kill below.
        exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        # Reaped elsewhere: its pid, and so its group id, may be an unrelated process's by
        # now. Its leftovers are no longer ours to kill; record it as gone (Popen says 0).
        return proc.wait()
    if not exited:
        return None
    _kill_group(proc.pid)
    return proc.wait()


@dataclass
class _Child:
    spec: ChildSpec
    backoff: Backoff = field(default_factory=Backoff)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_at: float | None = None  # set while dead and waiting out its delay


class ProcessSupervisor:
    """Start `specs`, restart each one that dies, stop them all on `stop()`.

    `clock` (seconds, monotonic) times the restarts; tests pass a fake one and call
    `poll()` themselves instead of `run()`.
    """

    def __init__(
        self,
        specs: Sequence[ChildSpec],
        *,
        log: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        stop_grace: float = STOP_GRACE_SECONDS,
    ) -> None:
        self.children = [_Child(spec) for spec in specs]
        self.log = log
        self.clock = clock
        self.stop_grace = stop_grace
        self.stopping = False
        self.hurry = False  # asked to stop again while stopping: no more grace

    def request_stop(self, *_: object) -> None:
        """Safe from a signal handler: `run()` stops everything on its next tick; asked again
        while stopping, `stop()` kills every child at once instead of waiting out the grace."""
        if self.stopping:
            self.hurry = True
        self.stopping = True

    def run(self) -> None:
        """Start every child and keep them running until `request_stop()`; then stop them."""
        try:
            self.start()
            while not self.stopping:
                self.poll()
                time.sleep(TICK_SECONDS)
        finally:
            self.stop()

    def start(self) -> None:
        now = self.clock()
        for child in self.children:
            self._start(child, now)

    def poll(self) -> None:
        """One pass: note the children that died, restart those whose delay is over."""
        now = self.clock()
        for child in self.children:
            if child.proc is not None:
                code = _exit_code(child.proc)
                if code is not None:
                    child.proc = None
                    self._schedule(child, now, exit_status(code))
            elif child.restart_at is not None and now >= child.restart_at and not self.stopping:
                self._start(child, now)
                if child.proc is not None:
                    self.log(f"{child.spec.name} restarted (pid {child.proc.pid})")

    def stop(self) -> None:
        """SIGTERM to every child's main process (Celery's warm shutdown, gunicorn's graceful
        one), SIGKILL to the group of any still running after `stop_grace` seconds, or to every
        group at once on a second `request_stop()` (Ctrl-C again)."""
        self.stopping = True
        running = [c for c in self.children if c.proc is not None and _exit_code(c.proc) is None]
        for child in running:
            # os.kill, not Popen.terminate: that may reap the child before its group is swept.
            os.kill(child.proc.pid, signal.SIGTERM)  # type: ignore[union-attr] - unreaped: still ours
        deadline = time.monotonic() + self.stop_grace  # real time: a stop must end
        while running and not self.hurry and time.monotonic() < deadline:
            time.sleep(0.1)
            running = [c for c in running if _exit_code(c.proc) is None]  # type: ignore[arg-type]
        if running and self.hurry:
            self.log("asked to stop again: killing every child now")
        for child in running:
            assert child.proc is not None
            if not self.hurry:
                self.log(f"{child.spec.name} still running {self.stop_grace:g} s after SIGTERM: killing it")
            _kill_group(child.proc.pid)  # still unreaped: the group is ours
        for child in running:
            child.proc.wait()  # type: ignore[union-attr]

    def _start(self, child: _Child, now: float) -> None:
        child.started_at, child.restart_at = now, None
        try:
            child.proc = subprocess.Popen(
                list(child.spec.argv),
                env=None if child.spec.env is None else dict(child.spec.env),
                stdin=subprocess.DEVNULL,
                stdout=child.spec.stdout,
                # Its own group: leftovers can be killed with it, and Ctrl-C reaches only
                # the supervisor, which then stops the children in order.
                process_group=0,
                # SIGTERM, a clean stop, if the supervisor itself is killed.
                preexec_fn=die_with_parent(signal.SIGTERM),
            )
        except OSError as exc:
            self._schedule(child, now, f"could not start: {exc}")

    def _schedule(self, child: _Child, now: float, status: str) -> None:
        delay = child.backoff.delay(started_at=child.started_at, died_at=now)
        child.restart_at = now + delay
        self.log(f"{child.spec.name} exited ({status}); restarting it in {delay:g} s")

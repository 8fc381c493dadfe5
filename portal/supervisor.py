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

`stop()` never returns while a child is left: past the grace every child still running is
SIGKILLed (its group, and itself by its handle) and reaped. With `adopt_orphans` (runportal) the
supervisor is also the child subreaper of what its children start: a process one of them leaves
outside its group (a job in a session of its own under a host worker killed for not stopping)
becomes the supervisor's own child, is reaped as it ends, and is SIGKILLed on stop, by the pid
of a child it holds unreaped. Every kill is said, naming the process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import psutil

from portal.processes import become_subreaper, die_with_parent

FIRST_DELAY_SECONDS = 1.0
MAX_DELAY_SECONDS = 30.0
HEALTHY_AFTER_SECONDS = 60.0  # up this long: the next death starts the delays over
STOP_GRACE_SECONDS = 20.0  # after SIGTERM on stop, then SIGKILL
ORPHANS_KILL_SECONDS = 5.0  # on stop, SIGKILL what the children left behind, for at most this long
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
        adopt_orphans: bool = False,
    ) -> None:
        self.children = [_Child(spec) for spec in specs]
        self.adopt_orphans = adopt_orphans and become_subreaper()
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

    def _say(self, line: str) -> None:
        """Log, never raising: a closed terminal must not keep `stop()` from killing anything."""
        with contextlib.suppress(Exception):
            self.log(line)

    def start(self) -> None:
        now = self.clock()
        for child in self.children:
            self._start(child, now)

    def poll(self) -> None:
        """One pass: note the children that died, restart those whose delay is over."""
        now = self.clock()
        self._reap_orphans()
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
        one), SIGKILL to any still running after `stop_grace` seconds, or to every one at once on
        a second `request_stop()` (Ctrl-C again); then SIGKILL to what they left behind (adopted
        orphans). Returns only once every child is reaped, whatever happens on the way."""
        self.stopping = True
        running = [c for c in self.children if c.proc is not None and _exit_code(c.proc) is None]
        try:
            for child in running:
                # os.kill, not Popen.terminate: that may reap the child before its group is swept.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.proc.pid, signal.SIGTERM)  # type: ignore[union-attr] - unreaped: still ours
            deadline = time.monotonic() + self.stop_grace  # real time: a stop must end
            while running and not self.hurry and time.monotonic() < deadline:
                time.sleep(0.1)
                self._reap_orphans()
                running = [c for c in running if _exit_code(c.proc) is None]  # type: ignore[arg-type]
        finally:
            self._kill(running)
            self._kill_orphans()

    def _kill(self, running: list[_Child]) -> None:
        """SIGKILL each child still running (its group, then itself by its handle) and reap it."""
        running = [c for c in running if c.proc is not None and _exit_code(c.proc) is None]
        if running and self.hurry:
            self._say("asked to stop again: killing every child now")
        for child in running:
            assert child.proc is not None
            if not self.hurry:
                self._say(
                    f"{child.spec.name} (pid {child.proc.pid}) still running {self.stop_grace:g} s"
                    " after SIGTERM: killed it (SIGKILL)"
                )
            _kill_group(child.proc.pid)  # still unreaped: the group is ours
            with contextlib.suppress(ProcessLookupError):
                child.proc.kill()  # and itself, should it have left its group
        for child in running:
            child.proc.wait()  # type: ignore[union-attr]

    def _orphans(self) -> list[psutil.Process]:
        """Our children that we did not start: adopted from a child that died (subreaper)."""
        if not self.adopt_orphans:
            return []
        ours = {c.proc.pid for c in self.children if c.proc is not None}
        try:
            return [p for p in psutil.Process().children() if p.pid not in ours]
        except psutil.Error:
            return []

    def _reap_orphans(self) -> None:
        """Reap the adopted orphans that have ended (a zombie each otherwise)."""
        for orphan in self._orphans():
            with contextlib.suppress(ChildProcessError):
                os.waitpid(orphan.pid, os.WNOHANG)

    def _kill_orphans(self) -> None:
        """SIGKILL what the children left behind, by pids that are our own unreaped children, until
        none is left (a killed orphan's own children are adopted next) or ORPHANS_KILL_SECONDS."""
        deadline = time.monotonic() + ORPHANS_KILL_SECONDS
        refused: set[int] = set()
        while (
            orphans := [o for o in self._orphans() if o.pid not in refused]
        ) and time.monotonic() < deadline:
            for orphan in orphans:
                try:
                    done, _ = os.waitpid(orphan.pid, os.WNOHANG)
                except ChildProcessError:
                    continue
                if done:
                    continue  # it had ended: reaped
                name = "?"
                with contextlib.suppress(psutil.Error):
                    name = " ".join(orphan.cmdline())[:120] or orphan.name()
                try:
                    os.kill(orphan.pid, signal.SIGKILL)  # our child, unreaped: the pid is its
                except PermissionError:  # a job as another account, where we lack CAP_KILL
                    self._say(f"could not kill pid {orphan.pid} ({name}), left by a child: permission denied")
                    refused.add(orphan.pid)
                    continue
                except ProcessLookupError:
                    continue
                self._say(f"killed pid {orphan.pid} ({name}), left running by a child (SIGKILL)")
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(orphan.pid, 0)
            time.sleep(0.05)

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

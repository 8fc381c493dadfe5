"""The executor interface: what a way of running work on a GPU host must offer (jobs/host/executors).

Kept apart from any one way of running (jobs/host/executors/local.py) so that a second one (a
container runtime) implements it without importing the first, and callers (jobs/host/runner.py,
jobs/host/lab.py) type against it alone.
"""

from __future__ import annotations

import pwd
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from portal.pids import ProcessId


@dataclass(frozen=True)
class ImageSpec:
    """The container image a run is in (gpus.ContainerImage, as the host needs it): its short name
    for the log, where the host gets it, and whether the host's network is inside."""

    name: str
    reference: str
    network: bool = False


@dataclass(frozen=True)
class RunSpec:
    """What to run: the command, its environment and folder, the account it runs as (JOB_USER's,
    or the owner's under JOB_USER=@owner; None: the worker's own), the worker's descriptors it
    inherits (a lab's listening socket: at the same numbers on the host, as 3, 4, ... in their
    order in a container, which is all Podman can pass) and the booked cards by UUID (a
    runtime that isolates devices exposes these and no other). `name` is how the worker's log
    names the run ("Job 12", "Session 3")."""

    argv: Sequence[str]
    env: dict[str, str]
    cwd: Path | str
    name: str
    account: pwd.struct_passwd | None = None
    pass_fds: Sequence[int] = ()
    gpu_uuids: Sequence[str] = ()
    image: ImageSpec | None = None  # None: on the host (LocalProcess); else in it (a container executor)
    # In an image only: the booked cards' /dev/nvidia<N> numbers (gpu_uuids' order), and the host
    # folders it sees at their own paths, (path, writable): the job's folder, JOB_ROOTS, the launcher.
    gpu_minors: Sequence[int] = ()
    mounts: Sequence[tuple[str, bool]] = ()


class RunOutput(Protocol):
    """The run's stdout and stderr, interleaved in order, as chunks of bytes read ahead by a
    bounded amount (past that the run waits, not the worker's memory)."""

    eof: bool

    def get(self, timeout: float | None) -> bytes | None:
        """The next chunk (queue.Empty after `timeout`); None once the output has ended."""
        ...

    def drain(
        self, seconds: float, take: Callable[[bytes], None], beat: Callable[[], None], beat_every: float
    ) -> bool:
        """What is left to `take` until its end (True) or for `seconds` at most (False: closed)."""
        ...


@dataclass
class Run:
    """A started run: its main process by identity (pid and start time: what proves it before
    every signal, and what the row records for the orphan sweep), the session its processes share,
    and its output. An executor may subclass it to keep what it needs (a container's id)."""

    name: str
    leader: ProcessId
    sid: int
    output: RunOutput
    unlisted_said: bool = field(default=False, repr=False)  # "cannot see its processes", said once

    @property
    def pid(self) -> int:
        return self.leader.pid

    @property
    def started(self) -> float:
        return self.leader.started


@dataclass(frozen=True)
class RunEnd:
    """How the main process ended: an exit code, or the signal that killed it."""

    code: int | None = None
    signal: int | None = None

    @property
    def returncode(self) -> int:
        """Popen's: the exit code, or minus the signal (what Job.exit_code records)."""
        return -self.signal if self.signal is not None else (self.code or 0)

    def describe(self) -> str:
        """For a run that failed: how."""
        return f"Exited with code {self.code}." if self.signal is None else f"Killed by signal {self.signal}."


@dataclass
class Signalled:
    """What one signal to a run's processes did. `lines` are for the run's own log, said by the
    executor in its own terms; `problem` (the end sweep) is for its final message."""

    sent: int = 0  # processes (or groups) it reached
    denied: bool = False  # one of them the worker may not signal (JOB_USER without CAP_KILL)
    unlisted: bool = False  # members unseen (/proc hidepid): the leader and its group only
    left: int = 0  # the end sweep: processes still there when it gave up
    lines: list[str] = field(default_factory=list)
    problem: str = ""


class Executor(Protocol):
    """One way of running work on a GPU host. See jobs/host/executors/__init__.py for when each method
    is called and what an implementation must guarantee."""

    def start(self, spec: RunSpec) -> Run:
        """Start `spec` in a session (process group) of its own; OSError when it cannot."""
        ...

    def poll(self, run: Run) -> RunEnd | None:
        """The main process's end once it has exited (not collected: its ids stay the run's)."""
        ...

    def wait(self, run: Run) -> RunEnd:
        """Block until the main process has exited; not collected either."""
        ...

    def signal(self, run: Run, sig: signal.Signals) -> Signalled:
        """`sig` to every process of the run, each proved first; nothing once collected."""
        ...

    def sweep(self, run: Run) -> Signalled:
        """The main process has exited: SIGKILL whatever it left, until nothing is left."""
        ...

    def collect(self, run: Run) -> RunEnd:
        """Release the run (reap it): its ids may name other processes from here on."""
        ...

    def stop(self, run: Run, grace: float) -> RunEnd:
        """The whole run, ended: SIGTERM, SIGKILL after `grace`, swept and collected."""
        ...

    def did_not_start(self, end: RunEnd) -> str:
        """Why a run that ended before running its command never ran it ("" if not so)."""
        ...

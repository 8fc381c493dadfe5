"""A `podman pull`'s progress in bytes (issue 34: "pulling tf-2.17: 1.2 / 4.8 GB" in the job's log),
for jobs.host.containers.image_pull.

Podman 4.3 prints no progress without a terminal: piped, a pull says "Copying blob sha256:..."
once per layer and nothing for minutes. So the pull runs under a pseudo-terminal (`pty`) with a
window wide enough for a whole bar, and its progress bars (containers/image's, the same for a
registry and for an oci-archive:/docker-archive: file) are read: each redraw says
"Copying blob 1a2b3c4d [====>----] 12.3MiB / 45.6MiB", a finished layer "Copying blob 1a2b3c4d
done", a cached one "... skipped: already exists". The sizes of the layers seen so far are added
up; a layer not started yet is not in the total (the bars of the layers appear as their copies
start), so the total may grow during a pull.

Why not the others: polling the storage's size while Podman pulls knows no total and counts the
unpacked layers (2-3 times the download), and a look at the sizes first (`skopeo inspect`) needs
skopeo, which Podman does not bring, and knows nothing of an archive. The bars need only Podman.

A line is said at the first bar, then at most every PROGRESS_SECONDS, and once more when the
last layer is done: a 4 GB pull says a few dozen lines, never one per chunk.
"""

from __future__ import annotations

import codecs
import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from portal.pids import send_group

PROGRESS_SECONDS = 5.0
DRAIN_SECONDS = 5.0  # what a pull killed at its deadline still prints, read this long at most
LINE_MAX = 4096  # a line longer than this is no bar (a window is WINDOW wide): only its end is kept
LINES_KEPT = 200  # Podman's other lines, the last of them (its error, the image's id)
WINDOW = (50, 250)  # rows, columns: mpb cuts a bar to the window's width ("…" in a 0-wide one)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SIZE = r"(\d+(?:\.\d+)?)\s*([KMGT]?i?B|b)"
BAR = re.compile(rf"^Copying blob (\S+) .*?{SIZE} / {SIZE}")
DONE = re.compile(r"^Copying blob (\S+) (?:done|skipped)")
UNITS = {"b": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
UNITS |= {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * UNITS.get(unit, 1))


def shown(done: int, total: int) -> str:
    """ "1.2 / 4.8 GB", "12.3 / 45.6 MB": decimal units, as people read disk sizes."""
    unit, scale = ("GB", 1e9) if total >= 1e9 else ("MB", 1e6)
    return f"{done / scale:.1f} / {total / scale:.1f} {unit}"


@dataclass
class PullProgress:
    """What a pull's terminal output said: each layer's (copied, size) by its short digest, and
    its other lines (Podman's words, an error, the image's id)."""

    layers: dict[str, tuple[int, int]] = field(default_factory=dict)
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=LINES_KEPT))
    rest: str = ""

    def feed(self, text: str) -> None:
        """Take more of the output (a redraw may be cut anywhere)."""
        *complete, rest = re.split(r"\r?\n|\r", self.rest + text)
        self.rest = rest[-LINE_MAX:]
        for raw in complete:
            self._line(ANSI.sub("", raw).strip())

    def end(self) -> None:
        if self.rest:
            self._line(ANSI.sub("", self.rest).strip())
            self.rest = ""

    def _line(self, line: str) -> None:
        if not line or line == "…":
            return
        if found := BAR.match(line):
            blob, copied, size = found[1], _bytes(found[2], found[3]), _bytes(found[4], found[5])
            self.layers[blob] = (min(copied, size), size)
        elif found := DONE.match(line):
            size = self.layers.get(found[1], (0, 0))[1]
            self.layers[found[1]] = (size, size)
        elif not line.startswith("Copying config"):
            self.lines.append(line)

    @property
    def copied(self) -> int:
        return sum(copied for copied, _ in self.layers.values())

    @property
    def total(self) -> int:
        return sum(size for _, size in self.layers.values())


@dataclass
class Pulled:
    code: int
    progress: PullProgress


@dataclass
class _Bound:
    """A pull's deadline, and whether its group was killed for it (once)."""

    proc: subprocess.Popen[bytes]
    deadline: float
    stop: threading.Event | None = None
    killed: bool = False

    def left(self) -> float:
        """Seconds to the deadline, which a stop asked for brings to now (once)."""
        now = time.monotonic()
        if self.stop is not None and self.stop.is_set():
            self.deadline = min(self.deadline, now)
        return self.deadline - now

    def kill(self) -> None:
        """SIGKILL to the pull's process group: `proc`, not reaped yet, proves the group its own."""
        if not self.killed:
            self.killed = True
            send_group(self.proc.pid, signal.SIGKILL)


def pull_in_pty(
    argv: list[str],
    say: Callable[[str], None],
    timeout: float,
    *,
    stop: threading.Event | None = None,
    **popen: object,
) -> Pulled:
    """Run `argv` (a `podman pull`) under a pseudo-terminal, saying its progress in bytes
    (`say("1.2 / 4.8 GB")`) at most every PROGRESS_SECONDS; its exit code (negative: killed
    after `timeout` seconds, or once `stop` is set: its run ended meanwhile) and what it printed.
    `popen`: the rest of Popen's arguments (its account, environment).

    Bounded: after `timeout` the pull's whole process group is killed, not its first process
    alone (rootless Podman re-runs itself as a child, which holds the terminal too), and what is
    left is read for DRAIN_SECONDS at most (a process that left the group may hold the terminal
    for ever). The first process is reaped only at the end, so its group is still provably the
    pull's when it is killed."""
    master, slave = pty.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", *WINDOW, 0, 0))
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, start_new_session=True, **popen
        )  # type: ignore[call-overload]
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)  # the child's copy is the only one: its end is the master's EIO
    progress = PullProgress()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character cut between reads
    bound = _Bound(proc, time.monotonic() + timeout, stop)
    said_at: float | None = None
    said = ""
    try:
        while chunk := _read(master, bound):
            progress.feed(decoder.decode(chunk))
            now = time.monotonic()
            if progress.total and (said_at is None or now - said_at >= PROGRESS_SECONDS):
                said_at, said = now, shown(progress.copied, progress.total)
                say(said)
        progress.end()
        code = _reaped(bound)
    finally:
        os.close(master)
        if proc.returncode is None:  # an error on the way: its group first, while it is still ours
            bound.kill()
            proc.wait()
    if progress.total and shown(progress.copied, progress.total) != said:
        say(shown(progress.copied, progress.total))  # the last word: all of it, when it went well
    return Pulled(code, progress)


def _read(master: int, bound: _Bound) -> bytes:
    """The next output (b"" once the pull has closed its terminal, or DRAIN_SECONDS after its
    deadline); at the deadline the pull's group is killed (never reaped here: the group stays
    provably the pull's)."""
    while True:
        left = bound.left()
        if left <= 0:
            bound.kill()
            if left <= -DRAIN_SECONDS:
                return b""  # a process that left the group holds the terminal: no longer read
        ready, _, _ = select.select([master], [], [], min(left, 1.0) if left > 0 else 0.1)
        if not ready:
            continue
        try:
            return os.read(master, 65536)
        except OSError:  # EIO: every copy of the terminal's other end is closed
            return b""


def _reaped(bound: _Bound) -> int:
    """The pull's exit code, waited for until its deadline (a pull that closed its terminal but
    runs on), then its group killed."""
    try:
        return bound.proc.wait(timeout=max(0.0, bound.left()))
    except subprocess.TimeoutExpired:
        bound.kill()
        return bound.proc.wait()

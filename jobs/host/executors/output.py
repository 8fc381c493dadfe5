"""A run's output as it comes (jobs/host/executors): read from its pipe ahead of the supervisor by a
bounded amount (`PipeOutput`), and followed until the run has ended (`follow`). Any executor whose
run writes to a pipe (a local process, a container's attached output) hands a `PipeOutput` on.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import threading
import time
from collections.abc import Callable
from typing import IO

from jobs.host.executors.base import Executor, Run

# 4 MiB at most between the pipe and the supervisor: past that the job waits, not the worker's memory.
OUTPUT_QUEUE_CHUNKS = 64


class PipeOutput:
    """A run's one stdout+stderr pipe, read by a thread of its own into `chunks` (None at the
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

    def get(self, timeout: float | None) -> bytes | None:
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


def follow(
    executor: Executor,
    run: Run,
    *,
    take: Callable[[bytes], None],
    tick: Callable[[], None],
    tick_seconds: float,
    drain_seconds: float,
) -> None:
    """Each chunk of the run's output to `take` and `tick` every `tick_seconds`, until its main
    process has exited and its output ended, or `drain_seconds` after the exit: a child that kept
    the pipe open (a server started in the background) does not keep the run alive, the sweep
    (`Executor.sweep`) ends it."""
    output = run.output
    exited_at: float | None = None
    while True:
        tick()
        if exited_at is None and executor.poll(run) is not None:
            exited_at = time.monotonic()
        if exited_at is not None and (output.eof or time.monotonic() - exited_at > drain_seconds):
            return
        deadline = time.monotonic() + tick_seconds
        while not output.eof:
            try:
                data = output.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if data is None:
                break
            take(data)
        if output.eof:
            time.sleep(max(0.0, deadline - time.monotonic()))  # output closed; waiting for the exit

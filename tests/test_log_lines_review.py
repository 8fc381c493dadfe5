"""A review's cases against lines stored as they are drawn (jobs/logs/store.py): the writer's
resync after the reconciler appended to an open line, the spool's dropped marker beside an open
line, a writer given a spool left inside a line, a notice's log tail inside a long bar; and, from a
second review, a value of the job's environment that a portal line split while it was drawn."""

from __future__ import annotations

import re

import pytest
from django.db import OperationalError

from jobs.host.spool import LogSpool, spool_name
from jobs.logs.store import LogWriter, log_append, log_stream, timestamp
from jobs.models import Job
from jobs.notices import log_tail
from tests.test_log_stream import _setup, job, server  # noqa: F401 - the stream's fixtures

STAMP = rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z "


def stored(job: Job) -> bytes:  # noqa: F811
    return b"".join(log_stream(job.pk))


def _waited(writer: LogWriter) -> None:
    writer.partial_since -= 1.0
    writer.maybe_flush()


def _each_line_stamped_once(data: bytes) -> None:
    lines = data.split(b"\n")
    assert lines[-1] == b"", data
    for line in lines[:-1]:
        assert re.match(STAMP, line), (line, data)
        assert len(re.findall(STAMP, line)) == 1, (line, data)


class Away:
    def __init__(self, monkeypatch) -> None:  # type: ignore[no-untyped-def]
        self.down = False
        real = LogWriter._store

        def store(writer, data):  # type: ignore[no-untyped-def]
            if self.down:
                raise OperationalError("server closed the connection unexpectedly")
            return real(writer, data)

        monkeypatch.setattr(LogWriter, "_store", store)


# 1. The IntegrityError resync: the reconciler ended the open line while the worker was out of
#    touch; the worker's next bytes were built as the line's continuation (no timestamp).
def test_resync_after_log_append_on_an_open_line_keeps_a_timestamp_at_each_line_start(job):  # noqa: F811
    writer = LogWriter(job.pk)
    writer.feed(b"\r1/9 [==")
    _waited(writer)
    writer.flush()  # stored, open
    log_append(job.pk, "[portal] Lost: its worker stopped answering.")  # ends the line itself
    writer.feed(b"\r2/9 [====\n")  # the worker is back: seq collides -> IntegrityError -> _resync
    writer.close()
    _each_line_stamped_once(stored(job))


# 2. The spool's dropped marker after an open line: (a) the spool kept nothing, so the marker
#    is glued to the stored open line; (b) the writer's `open` stays True after the marker when
#    the kept spool bytes end with a newline, so the next line has no timestamp.
def test_spool_dropped_marker_after_a_stored_open_line_is_a_line_of_its_own(job, monkeypatch):  # noqa: F811
    away = Away(monkeypatch)
    spool = LogSpool(spool_name(job.pk, job.created_at), cap_bytes=1 << 20)
    try:
        writer = LogWriter(job.pk, spool=spool)
        writer.feed(b"\r1/9 [==")
        _waited(writer)
        writer.flush()  # stored, open
        away.down = True
        spool.refused_by = "could not be written: No space left on device"  # the disk refuses
        writer.feed(b"=" * 40)
        _waited(writer)
        with pytest.raises(OperationalError):
            writer.flush()  # refused: dropped
        assert spool.dropped and not spool.size
        away.down = False
        writer.feed(b"later\n")
        writer.close()
        _each_line_stamped_once(stored(job))
    finally:
        spool.close(remove=True)


def test_spool_dropped_marker_ends_the_writers_open_line(job, monkeypatch):  # noqa: F811
    away = Away(monkeypatch)
    spool = LogSpool(spool_name(job.pk, job.created_at), cap_bytes=30)  # exactly "<stamp>kept\n"
    try:
        writer = LogWriter(job.pk, spool=spool)
        away.down = True
        writer.feed(b"kept\n")
        with pytest.raises(OperationalError):
            writer.flush()  # on the spool
        writer.feed(b"\r1/9 " + b"=" * 60)
        _waited(writer)  # taken open: open = True
        with pytest.raises(OperationalError):
            writer.flush()  # refused: the spool is full
        assert spool.dropped
        away.down = False
        writer.flush()  # "kept\n" + marker
        writer.feed(b"next line\n")
        writer.close()
        _each_line_stamped_once(stored(job))
    finally:
        spool.close(remove=True)


# 3. A writer given a spool that ends inside a line (the replay's writer, a supervisor that finds
#    its job's spool left over): `open` is taken from the database only, so its first portal line
#    is glued to the spooled bar.
def test_a_writer_on_a_spool_left_inside_a_line_starts_its_portal_line_on_a_new_line(job):  # noqa: F811
    spool = LogSpool(spool_name(job.pk, job.created_at), cap_bytes=1 << 20)
    try:
        spool.append(timestamp() + b"\r3/9 [======")  # what a worker that died mid-bar spooled
        writer = LogWriter(job.pk, spool=spool)
        writer.write_line("[portal] Preempted. It does not go back to the queue.")
        writer.close()
        _each_line_stamped_once(stored(job))
    finally:
        spool.close(remove=True)


# 4. The end notice's tail: a job killed inside a long epoch (its bar one line now, > 8 KB)
#    loses the bar from its tail; before, the last half-second's piece was a line of its own.
def test_log_tail_of_a_job_stopped_inside_a_long_bar_shows_the_bar(job):  # noqa: F811
    writer = LogWriter(job.pk)
    writer.feed(b"Epoch 1/3\n")
    for step in range(1, 400):
        writer.feed(f"\r{step}/999 [=====>....] - loss: 0.{step:04d}".encode())
        _waited(writer)  # taken as it is drawn
    writer.write_line("[portal] Time limit reached: stopped.")
    writer.close()
    tail = log_tail(job)
    assert "399/999" in tail, tail


def test_a_secret_a_portal_line_split_while_drawn_is_masked_in_the_notice_tail(job):  # noqa: F811
    """A second review: the job printed half a value of its environment, its line was stored as
    far as drawn, a portal line came, then the rest: the mask allowed only a newline inside a
    value, so both halves went out to a possibly shared chat room. The portal line stays."""
    secret = "sk-live-0123456789abcdefABCDEF"
    Job.objects.filter(pk=job.pk).update(env={"API_KEY": secret})
    job.refresh_from_db()
    writer = LogWriter(job.pk)
    writer.feed(b"connecting with key " + secret[:16].encode())
    _waited(writer)  # the line as far as drawn: stored, open
    writer.write_line("[portal] Time limit in 5 minutes: the job is stopped then.")
    writer.feed(secret[16:].encode() + b" ok\n")
    writer.close()
    tail = log_tail(job)
    assert secret[:16] not in tail and secret[16:] not in tail, tail
    assert tail.split("\n") == [
        "connecting with key ****",
        "[portal] Time limit in 5 minutes: the job is stopped then.",
        " ok",
    ]

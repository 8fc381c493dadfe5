"""What the database cannot take waits on the host's disk and goes in later, in order and once
(jobs/host/spool.py). The outage here is the database refusing writes inside this process; the fault
suite (tests/test_faults.py) stops a real PostgreSQL under a real worker."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from django.db import OperationalError

from gpus.booking import reservation_create
from jobs.host import end as host_end
from jobs.host.replay import spool_replay
from jobs.host.runner import job_run
from jobs.host.spool import EndRecord, LogSpool, spool_dir, spool_name, spooled_names
from jobs.logs import store as logs
from jobs.logs.store import LogWriter
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from tests.fault_servers import small_disk, small_disk_unavailable
from tests.job_helpers import job_log
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db

TWENTY = "import time\nfor i in range(20):\n    print(f'line {i:02d}', flush=True)\n"


class Outage:
    """The database refuses the log's writes and the job's end while `down` is set."""

    def __init__(self, monkeypatch) -> None:
        self.down = False
        real_store, real_end = LogWriter._store, host_end.job_end_record

        def store(writer, data):  # type: ignore[no-untyped-def]
            if self.down:
                raise OperationalError("server closed the connection unexpectedly")
            return real_store(writer, data)

        def end(job_id, writer, record):  # type: ignore[no-untyped-def]
            if self.down:
                writer.flush()  # what is pending goes to the spool, and this raises
                raise OperationalError("server closed the connection unexpectedly")
            return real_end(job_id, writer, record)

        monkeypatch.setattr(LogWriter, "_store", store)
        monkeypatch.setattr(host_end, "job_end_record", end)


@pytest.fixture
def outage(monkeypatch) -> Outage:
    return Outage(monkeypatch)


@pytest.fixture
def job(alice, box) -> Job:
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    return job_submit(
        user=alice, reservation=booking, script=ScriptUpload(name="t.py", content=TWENTY.encode())
    )


def test_a_log_the_database_cannot_take_waits_on_disk_and_goes_in_once(job, outage):
    spool = LogSpool(spool_name(job.pk, job.created_at), cap_bytes=1 << 20)
    writer = LogWriter(job.pk, spool=spool)
    writer.feed(b"one\n")
    writer.flush()
    outage.down = True
    for text in (b"two\n", b"three\n"):
        writer.feed(text)
        with pytest.raises(OperationalError):
            writer.flush()
    assert b"two\n" in spool.read() and b"three\n" in spool.read() and not writer.pending
    outage.down = False
    writer.feed(b"four\n")
    writer.flush()
    lines = [line.split(" ", 1)[1] for line in job_log(job.pk).splitlines()]
    assert lines == ["one", "two", "three", "four"]
    assert spool.size == 0
    spool.close(remove=True)
    assert not spooled_names()


def test_a_full_spool_says_how_much_it_dropped(job, outage):
    spool = LogSpool(spool_name(job.pk, job.created_at), cap_bytes=100)
    writer = LogWriter(job.pk, spool=spool)
    outage.down = True
    writer.feed(b"x" * 60 + b"\n" + b"y" * 60 + b"\n")
    with pytest.raises(OperationalError):
        writer.flush()
    assert spool.size == 100 and spool.dropped > 0
    outage.down = False
    writer.flush()
    log = job_log(job.pk)
    assert "x" * 60 in log and "bytes of output were dropped here" in log
    spool.close(remove=True)


@pytest.mark.django_db(transaction=True)  # the runner closes a connection after an error, as in a worker
def test_a_job_ending_while_the_database_is_away_keeps_every_line_and_its_end_once(
    job, outage, settings, monkeypatch
):
    settings.JOB_END_WAIT_SECONDS = 0  # the supervisor gives up at once: the replay records it
    real_feed = LogWriter.feed

    def feed(writer, data):  # type: ignore[no-untyped-def]
        if b"line 10" in data:
            outage.down = True  # half the lines are stored; the database goes away
        real_feed(writer, data)

    monkeypatch.setattr(LogWriter, "feed", feed)
    job_run(job.pk)
    name = spool_name(job.pk, job.created_at)
    assert EndRecord.read(name).status == Job.Status.SUCCEEDED
    assert Job.objects.get(pk=job.pk).status == Job.Status.RUNNING  # not recorded yet
    assert spool_replay() == 0  # still away: nothing written, nothing lost
    outage.down = False
    assert spool_replay() == 1
    job.refresh_from_db()
    assert job.status == Job.Status.SUCCEEDED and job.exit_code == 0 and job.finished_at
    printed = [line for line in job_log(job.pk).splitlines() if " line " in line]
    assert [line.split(" ", 1)[1] for line in printed] == [f"line {i:02d}" for i in range(20)]
    assert spool_replay() == 0 and not spooled_names()


def test_a_spool_of_another_database_is_never_replayed(job):
    stale = spool_dir() / f"job-{job.pk}-123.log"  # same id, another creation time: another database
    stale.write_bytes(b"2020-01-01T00:00:00.000Z not this job's\n")
    assert spool_replay() == 0
    assert not stale.exists() and "not this job's" not in job_log(job.pk)


def test_a_progress_bar_without_newlines_is_capped_while_the_database_is_away(job, outage, monkeypatch):
    monkeypatch.setattr(logs, "MAX_PENDING_BYTES", 64 * 1024)
    writer = LogWriter(job.pk, cap_bytes=64 * 1024)  # no spool: everything waits in memory
    outage.down = True
    for step in range(20_000):  # ~1 MB of "\r" updates, never a newline
        writer.feed(f"\r{step:>6} / 20000 [{'#' * 40}]".encode())
        with contextlib.suppress(OperationalError):
            writer.maybe_flush()
    assert len(writer.pending) + len(writer.partial) <= 64 * 1024 + writer.chunk_bytes
    assert writer.dropped > 800_000
    outage.down = False
    writer.close()
    log = job_log(job.pk)
    assert "19999 / 20000" in log and len(log) < 200 * 1024


def test_a_spool_the_database_could_not_take_goes_in_though_the_job_prints_no_more(job, outage, monkeypatch):
    spool = LogSpool(spool_name(job.pk, job.created_at), cap_bytes=1 << 20)
    writer = LogWriter(job.pk, spool=spool)
    outage.down = True
    writer.feed(b"the last line\n")
    with pytest.raises(OperationalError):
        writer.flush()
    outage.down = False
    writer.maybe_flush()  # within its 2 s: not yet
    assert spool.size
    writer.last_flush -= logs.SPOOL_RETRY_SECONDS  # 2 s on, with nothing printed since
    writer.maybe_flush()
    assert spool.size == 0 and "the last line" in job_log(job.pk)
    spool.close(remove=True)


def test_a_spool_unlinked_while_its_lock_was_awaited_is_opened_again(job):
    name = spool_name(job.pk, job.created_at)
    holder = LogSpool(name, cap_bytes=1 << 20)
    got: list[LogSpool] = []
    waiter = threading.Thread(target=lambda: got.append(LogSpool(name, cap_bytes=1 << 20)))
    waiter.start()
    wait_for(lambda: _waits_for_lock(holder.path), timeout=10, what="the second open to wait for the lock")
    holder.close(remove=True)  # finished: unlinked, then unlocked, as the replay does
    waiter.join(timeout=10)
    spool = got[0]
    assert os.fstat(spool.fd).st_ino == os.stat(spool.path).st_ino  # the file that has the name
    spool.close(remove=True)


def _waits_for_lock(path: Path) -> bool:
    """Whether some process waits for a flock on `path` (/proc/locks lists waiters with '->')."""
    inode = os.stat(path).st_ino
    return any("->" in line and f":{inode} " in line for line in Path("/proc/locks").read_text().splitlines())


def test_a_forked_child_does_not_keep_a_spools_lock(job):
    name = spool_name(job.pk, job.created_at)
    spool = LogSpool(name, cap_bytes=1 << 20)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # as a prefork pool child: it must hold no copy of the lock
        os.write(write, b"1" if spool.fd == -1 else b"0")
        time.sleep(10)  # alive while the parent checks the lock
        os._exit(0)
    os.close(write)
    forked = psutil.Process(child)  # this process's child, not reaped yet: its pid is no one else's
    try:
        assert os.read(read, 1) == b"1"
        spool.close()
        again = LogSpool.locked_by_nobody(name, cap_bytes=1 << 20)  # None if the child held it
        assert again is not None
        again.close(remove=True)
    finally:
        os.close(read)
        forked.kill()
        os.waitpid(child, 0)


def test_one_broken_spool_does_not_stop_the_others(job, alice, box, caplog):
    booking = reservation_create(user=alice, gpus=[box[1].uuid], memory_mb=8192)
    other = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="u.py", content=b"print(1)"))
    Job.objects.filter(pk=other.pk).update(status=Job.Status.RUNNING)
    (spool_dir() / f"{spool_name(job.pk, job.created_at)}.end").write_text("{not json")  # first in line
    name = spool_name(other.pk, other.created_at)
    spool = LogSpool(name, cap_bytes=1 << 20)
    spool.append(b"2026-01-01T00:00:00.000Z its last line\n")
    spool.close()
    end = EndRecord(status="succeeded", exit_code=0, message="", finished_at="2026-01-01T00:00:01+00:00")
    end.write(name)
    failed: set[str] = set()  # the spool thread's, across its rounds (jobs.threads.SpoolReplay)
    with caplog.at_level(logging.ERROR, logger="jobs.host.replay"):
        assert spool_replay(failed=failed) == 1
        assert spool_replay(failed=failed) == 0  # the broken one again: said once, not every round
    other.refresh_from_db()
    assert other.status == Job.Status.SUCCEEDED and "its last line" in job_log(other.pk)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"Spool {spool_name(job.pk, job.created_at)} could not be replayed"
    ]


# Steady output of ~170 kB: more than the small disk below holds.
STEADY = (
    b"import time\nfor i in range(600):\n"
    b"    print(f'line {i:03d} ' + 'x' * 250, flush=True)\n    time.sleep(0.002)\n"
)


@pytest.fixture
def full_disk_spool(tmp_path, settings) -> Iterator[Path]:
    """JOB_SPOOL_DIR on a 64 kB tmpfs: a disk that really fills (ENOSPC)."""
    if why := small_disk_unavailable():
        pytest.skip(why)
    with small_disk(tmp_path / "spool", size="64k") as folder:
        settings.JOB_SPOOL_DIR = folder
        yield folder


@pytest.mark.django_db(transaction=True)  # the runner closes a connection after an error, as in a worker
def test_a_full_spool_disk_drops_output_but_never_the_job(alice, box, outage, full_disk_spool, monkeypatch):
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="s.py", content=STEADY))
    monkeypatch.setattr(host_end, "END_RETRY_SECONDS", 0.1)
    real_feed, spooling_end = LogWriter.feed, host_end.job_end_record
    tries: list[str] = []

    lines = [0]  # line ends fed so far: reads split the output anywhere, even inside "line 100"

    def feed(writer, data):  # type: ignore[no-untyped-def]
        if outage.down:
            real_feed(writer, data)
            return
        # Over 100 lines stored first: on a loaded machine one read held all of them and more, and
        # the outage came before any was written.
        at = -1
        for _ in range(120 - lines[0]):  # the launcher's own lines come first
            at = data.find(b"\n", at + 1)
            if at < 0:
                lines[0] += data.count(b"\n")
                real_feed(writer, data)
                return
        real_feed(writer, data[: at + 1])
        writer.flush()
        outage.down = True  # the database goes away; the spool's disk fills while it is
        real_feed(writer, data[at + 1 :])

    def end(job_id, writer, record):  # type: ignore[no-untyped-def]
        tries.append(record.status)
        if len(tries) > 1:
            outage.down = False  # back for the end's second try
        return spooling_end(job_id, writer, record)

    monkeypatch.setattr(LogWriter, "feed", feed)
    monkeypatch.setattr(host_end, "job_end_record", end)
    assert job_run(job.pk) == Job.Status.SUCCEEDED  # never killed for its log
    job.refresh_from_db()
    assert (job.status, job.exit_code) == (Job.Status.SUCCEEDED, 0)
    assert "bytes of its output were dropped while the database was away" in job.message
    assert "No space left on device" in job.message
    log = job_log(job.pk)
    printed = [line.split(" ", 1)[1][:8] for line in log.splitlines() if " line " in line]
    kept = len(printed)
    assert 100 < kept < 600 and printed == [f"line {i:03d}" for i in range(kept)], printed[-3:]
    marker = log.index("bytes of output were dropped here")
    assert log.index(f"line {kept - 1:03d}") < marker and "No space left on device" in log[marker:]
    assert not spooled_names()  # stored, then emptied: nothing left for the replay


def test_a_job_runs_on_when_the_spool_folder_is_unusable_and_says_so(job, tmp_path, settings, caplog):
    if why := small_disk_unavailable():
        pytest.skip(why)
    with small_disk(tmp_path / "ro", read_only=True) as read_only:
        settings.JOB_SPOOL_DIR = read_only / "spool"  # cannot be made: as if removed since the start
        with caplog.at_level(logging.WARNING):
            assert job_run(job.pk) == Job.Status.SUCCEEDED
    log = job_log(job.pk)
    assert "[portal] this host's spool (JOB_SPOOL_DIR) cannot be used" in log and "line 19" in log
    said = [r for r in caplog.records if "JOB_SPOOL_DIR" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is None, [r.getMessage() for r in caplog.records]

"""A job's output as it arrives, published on Redis for the live log streams (jobs/logs/stream.py).

The database stays the record (jobs/logs/store.py); a message is a nudge that lets a watcher show a
line within milliseconds instead of after the worker's next flush (LOG_FLUSH_SECONDS). One
pub/sub channel per job, five kinds of message, each a header line and, for `live`, the bytes:

- ``L <start>\\n<bytes>``: output that the log will hold at [start, start + len) once stored.
  Sent by LogWriter as it takes the output, only while its offsets are known to be the stored
  ones (its last write reached the database and nothing waits in its spool);
- ``S <end>\\n``: the log is stored up to byte `end` (after each write that reached the database);
- ``C <end>\\n``: no more output from this writer (the job is ending): a watcher reads the status;
- ``J 0\\n``: the job's row changed (its status, its message, a cancel asked for): the job page
  reads it, and a stream reads whether the job ended (`job_changed`, once the change commits);
- ``M <seq>\\n``: training-curve records are stored up to `seq` (jobs.metrics): the page reads them.

Publishing never fails the job: Redis away costs the watchers their speed, not a byte, since a
stream reads what it missed from the database. After a failure nothing is tried for a few
seconds (portal.changes.Publisher), so a dead Redis adds no timeouts to every line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from django.db import transaction

from portal.changes import JOBS, Publisher, change_publish
from portal.names import redis_key

log = logging.getLogger(__name__)

LIVE, STORED, CLOSED, JOB, METRICS = b"L", b"S", b"C", b"J", b"M"


def channel(job_id: int) -> str:
    """One portal's job: two portals may share a Redis, and their job ids collide."""
    return redis_key("joblog", job_id)


def encode(kind: bytes, offset: int, data: bytes = b"") -> bytes:
    return kind + b" %d\n" % offset + data


def decode(message: bytes) -> tuple[bytes, int, bytes]:
    """(kind, offset, data) of a message; ValueError for anything else."""
    header, _, data = message.partition(b"\n")
    kind, _, offset = header.partition(b" ")
    if kind not in (LIVE, STORED, CLOSED, JOB, METRICS):
        raise ValueError(f"not a log message: {header[:40]!r}")
    return kind, int(offset), data


publisher = Publisher("Live log", "watchers read it from the database")


def publish(job_id: int, kind: bytes, offset: int, data: bytes = b"") -> None:
    publisher.publish(channel(job_id), encode(kind, offset, data))


def job_changed(job_ids: Iterable[int], *, server: int | None = None) -> None:
    """Once this commits: each job's page reads its row again (and its log streams whether it
    ended), and every page that lists jobs (the dashboard, the queue) reads its list. Every
    change of a job's status goes through here; `server` is the jobs' server, when one."""
    ids = list(job_ids)
    if not ids:
        return
    for job_id in ids:
        transaction.on_commit(lambda job_id=job_id: publish(job_id, JOB, 0))
    change_publish(JOBS, server=server)

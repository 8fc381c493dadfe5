"""A job's output as it arrives, published on Redis for the live log streams (jobs/log_stream.py).

The database stays the record (jobs/logs.py); a message is a nudge that lets a watcher show a
line within milliseconds instead of after the worker's next flush (LOG_FLUSH_SECONDS). One
pub/sub channel per job, three kinds of message, each a header line and, for `live`, the bytes:

- ``L <start>\\n<bytes>``: output that the log will hold at [start, start + len) once stored.
  Sent by LogWriter as it takes the output, only while its offsets are known to be the stored
  ones (its last write reached the database and nothing waits in its spool);
- ``S <end>\\n``: the log is stored up to byte `end` (after each write that reached the database);
- ``C <end>\\n``: no more output from this writer (the job is ending): a watcher reads the status.

Publishing never fails the job: Redis away costs the watchers their speed, not a byte, since a
stream reads what it missed from the database. After a failure nothing is tried for a few
seconds (portal.changes.Publisher), so a dead Redis adds no timeouts to every line.
"""

from __future__ import annotations

import logging

from django.conf import settings

from portal.changes import Publisher

log = logging.getLogger(__name__)

LIVE, STORED, CLOSED = b"L", b"S", b"C"


def channel(job_id: int) -> str:
    """One portal's job: two portals may share a Redis, and their job ids collide."""
    return f"portal:{settings.PORTAL_INSTANCE_ID}:joblog:{job_id}"


def encode(kind: bytes, offset: int, data: bytes = b"") -> bytes:
    return kind + b" %d\n" % offset + data


def decode(message: bytes) -> tuple[bytes, int, bytes]:
    """(kind, offset, data) of a message; ValueError for anything else."""
    header, _, data = message.partition(b"\n")
    kind, _, offset = header.partition(b" ")
    if kind not in (LIVE, STORED, CLOSED):
        raise ValueError(f"not a log message: {header[:40]!r}")
    return kind, int(offset), data


publisher = Publisher("Live log", "watchers read it from the database")


def publish(job_id: int, kind: bytes, offset: int, data: bytes = b"") -> None:
    publisher.publish(channel(job_id), encode(kind, offset, data))

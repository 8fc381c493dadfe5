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
stream reads what it missed from the database. After a failure nothing is tried for
RETRY_AFTER_SECONDS, so a dead Redis adds no timeouts to every line.
"""

from __future__ import annotations

import logging
import os
import time

import redis
from django.conf import settings

log = logging.getLogger(__name__)

LIVE, STORED, CLOSED = b"L", b"S", b"C"
RETRY_AFTER_SECONDS = 5.0
TIMEOUT_SECONDS = 0.5


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


class Publisher:
    """One Redis connection per process (a prefork pool's child makes its own after the fork)."""

    def __init__(self) -> None:
        self._client: redis.Redis | None = None
        self._pid = 0
        self._quiet_until = 0.0

    def publish(self, job_id: int, kind: bytes, offset: int, data: bytes = b"") -> None:
        now = time.monotonic()
        if now < self._quiet_until:
            return
        try:
            if self._client is None or self._pid != os.getpid():
                self._client = redis.Redis.from_url(
                    settings.REDIS_URL, socket_timeout=TIMEOUT_SECONDS, socket_connect_timeout=TIMEOUT_SECONDS
                )
                self._pid = os.getpid()
            self._client.publish(channel(job_id), encode(kind, offset, data))
        except redis.RedisError as exc:
            if not self._quiet_until:
                log.warning("Live log unpublished (%s): watchers read it from the database", exc)
            self._quiet_until = now + RETRY_AFTER_SECONDS
            return
        if self._quiet_until:
            log.info("Live log published again")
        self._quiet_until = 0.0


publisher = Publisher()


def publish(job_id: int, kind: bytes, offset: int, data: bytes = b"") -> None:
    publisher.publish(job_id, kind, offset, data)

"""Wake a periodic thread of the portal's worker at once, from any process: a Redis list per name.

The queue's scheduler runs every QUEUE_SCHEDULE_SECONDS, and at once when a card frees up: a job
ends on some GPU host, a booking is released or cancelled on the web server. Those processes
push to the list after their transaction commits; the thread blocks on it between passes.
A lost wake-up (Redis away) costs at most one interval, never correctness.
"""

from __future__ import annotations

import logging

import redis
from django.conf import settings
from django.db import transaction

from portal.names import redis_key

log = logging.getLogger(__name__)


# The wake-up channels, by what they wake. The jobs scheduler waits on this one; whoever frees
# cards or queues a job wakes it (gpus' booking release and cancel, jobs' submit and ends).
QUEUE_SCHEDULER = "queue"


def key(name: str) -> str:
    """This portal's list for `name`: a second portal on the same Redis wakes its own threads only."""
    return redis_key("wake", name)


def client(timeout: float) -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=timeout, socket_connect_timeout=5)


def wake_on_commit(name: str) -> None:
    """Wake `name` once the current transaction commits (at once outside one)."""
    transaction.on_commit(lambda: wake(name))


def wake(name: str) -> None:
    try:
        conn = client(5)
        pipe = conn.pipeline()
        pipe.lpush(key(name), 1)
        pipe.ltrim(key(name), 0, 0)  # one pending wake-up is enough
        pipe.execute()
    except redis.RedisError:
        log.warning("Could not wake %s; it runs on its next interval", name, exc_info=True)


def wait(conn: redis.Redis, name: str, timeout: float) -> bool:
    """Block until woken or `timeout` seconds pass; True when woken."""
    return conn.blpop([key(name)], timeout=max(1, round(timeout))) is not None

"""A change feed for the pages that show live state: a tiny message on Redis pub/sub when
something they show has changed (docs/live.md, "The dashboard and the bell").

The database stays the record; a message only tells a page to read it now rather than at its
next poll. Two channels per portal (two portals may share a Redis):

- `changes`: {"topic": "telemetry" | "bookings" | "jobs", "server": id or null}, for everyone;
- `user:<id>`: {"topic": "notifications"}, for that user's pages only.

Messages go out once the transaction commits (a page that reads on the message must see the
change). Each also counts one on `changes-count`: a page keeps the count as it was when its request
began (`ChangesSeenMiddleware`), its stream says the count once it listens (`ready`), and a page
whose count is behind reads its live parts once, for a change published between its render and
its stream's start reached no one.

Publishing never fails the caller: Redis away costs the pages their speed (they poll again), and
after a failure nothing is tried for RETRY_AFTER_SECONDS; the outage is logged once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from functools import partial

import redis
from django.conf import settings
from django.db import transaction

from portal.names import redis_key

log = logging.getLogger(__name__)

TELEMETRY, BOOKINGS, JOBS, NOTIFICATIONS = "telemetry", "bookings", "jobs", "notifications"
TOPICS = (TELEMETRY, BOOKINGS, JOBS, NOTIFICATIONS)
RETRY_AFTER_SECONDS = 5.0
TIMEOUT_SECONDS = 0.5


def channel() -> str:
    return redis_key("changes")


def user_channel(user_id: int) -> str:
    return redis_key("user", user_id)


def count_key() -> str:
    return redis_key("changes-count")


class Publisher:
    """Redis pub/sub that never fails its caller (this module's changes, and a job's live log:
    jobs.logs.live). One connection per process (a prefork pool's child makes its own after the
    fork); after a failure nothing is tried for RETRY_AFTER_SECONDS, and the outage is said once.
    `what` and `meanwhile` word that line: what went unpublished, and what its readers do instead."""

    def __init__(
        self,
        what: str = "Changes",
        meanwhile: str = "pages see them at their next poll",
        *,
        counted: bool = False,
    ) -> None:
        self.what, self.meanwhile, self.counted = what, meanwhile, counted
        self._client: redis.Redis | None = None
        self._pid = 0
        self._quiet_until = 0.0

    def publish(self, channel: str, payload: bytes | str) -> None:
        self.publish_many(channel, [payload])

    def publish_many(self, channel: str, payloads: Sequence[bytes | str]) -> None:
        """Each of `payloads` on `channel`, in order, in one round trip (a telemetry round tells
        its 64 servers' pages at once: 64 round trips took 10 ms of the round)."""
        now = time.monotonic()
        if now < self._quiet_until or not payloads:
            return
        try:
            pipe = self._redis().pipeline(transaction=False)
            if self.counted:  # counted first, so no message outruns its count
                pipe.incrby(count_key(), len(payloads))
            for payload in payloads:
                pipe.publish(channel, payload)
            pipe.execute()
        except redis.RedisError as exc:
            self._failed(exc, now)
            return
        if self._quiet_until:
            log.info("%s published again", self.what)
        self._quiet_until = 0.0

    def count(self) -> int | None:
        """How many changes were published so far (this portal's), or None when Redis cannot say."""
        now = time.monotonic()
        if now < self._quiet_until:
            return None
        try:
            return int(self._redis().get(count_key()) or 0)
        except redis.RedisError:
            return None  # the page reads its parts at `ready`; only a failed publish stops publishing

    def _redis(self) -> redis.Redis:
        if self._client is None or self._pid != os.getpid():
            self._client = redis.Redis.from_url(
                settings.REDIS_URL, socket_timeout=TIMEOUT_SECONDS, socket_connect_timeout=TIMEOUT_SECONDS
            )
            self._pid = os.getpid()
        return self._client

    def _failed(self, exc: redis.RedisError, now: float) -> None:
        if not self._quiet_until:
            log.warning("%s unpublished (%s): %s", self.what, exc, self.meanwhile)
        self._quiet_until = now + RETRY_AFTER_SECONDS


publisher = Publisher(counted=True)


def changes_count() -> int | None:
    """The change count now (None: Redis cannot say, and a page then reads its parts at `ready`)."""
    return publisher.count()


class ChangesSeenMiddleware:
    """Notes the change count as a page's request begins (`request.changes_seen`), before the view
    reads anything: what was published after that may be missing from the page (base.html gives
    it to the page's stream, static/js/live.js). Pages only: htmx partials, the API and the
    streams do without."""

    def __init__(self, get_response) -> None:  # type: ignore[no-untyped-def]
        self.get_response = get_response

    def __call__(self, request):  # type: ignore[no-untyped-def]
        if (
            request.method == "GET"
            and not request.headers.get("HX-Request")
            and _is_page(request.path)
            # A signed-in page's (only those have the stream, base.html); its session cookie says
            # so without a read of the session, which must stay the view's (a database away is
            # the view's outage page, portal.outage, not a middleware's error).
            and settings.SESSION_COOKIE_NAME in request.COOKIES
        ):
            request.changes_seen = changes_count()
        return self.get_response(request)


def _is_page(path: str) -> bool:
    """A portal page's path: not the API, static files, the streams, a log, or a lab's proxied files."""
    if path.startswith(("/api/", "/static/", "/events/")) or path.endswith(("/events/", "/log/")):
        return False
    return "/lab/" not in path


def change_publish(topic: str, *, server: int | None = None) -> None:
    """Tell every open page that `topic` changed (on `server`, when one), once this commits."""
    changes_publish(topic, servers=[server])


def changes_publish(topic: str, *, servers: Sequence[int | None]) -> None:
    """`change_publish` for each of `servers`, once this commits: one message each, all sent in
    one round trip."""
    if topic not in (TELEMETRY, BOOKINGS, JOBS):
        raise ValueError(f"unknown change topic {topic!r}")
    messages = [json.dumps({"topic": topic, "server": server}) for server in servers]
    transaction.on_commit(lambda: publisher.publish_many(channel(), messages))


def user_change_publish(user_id: int, topic: str = NOTIFICATIONS) -> None:
    """Tell `user_id`'s open pages (and nobody else's) that their `topic` changed, once this commits."""
    transaction.on_commit(partial(publisher.publish, user_channel(user_id), json.dumps({"topic": topic})))

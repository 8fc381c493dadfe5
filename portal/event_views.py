"""GET /events/: the change feed (portal/changes.py) for the viewer's pages, as server-sent events.

One stream per page: `event: ready` once it listens, then `event: <topic>` with the message as
JSON for telemetry, bookings and jobs, and for the viewer's own notifications only. A comment
every LOG_STREAM_KEEPALIVE_SECONDS keeps proxies open. A page reads what changed from its usual
endpoints; a page that missed messages (reconnecting) reads everything again at `ready`.

Async like the log stream (jobs/logs/stream.py), and like it ASGI only: it waits on Redis and
never on the ORM, whose only use (the session's user) comes before the loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.handlers.asgi import ASGIRequest
from django.db import connection
from django.http import Http404, HttpRequest, StreamingHttpResponse
from django.views.decorators.http import require_GET

from portal import changes
from portal.subscriptions import Lost, hub

log = logging.getLogger(__name__)

RETRY_MS = 2000
# `ready`'s data: the change count once the stream listens (portal.changes), "" when Redis cannot say.
READY = "event: ready\ndata: {}\n\n"
KEEPALIVE = b": keep-alive\n\n"


@require_GET
@login_required
async def events(request: HttpRequest) -> StreamingHttpResponse:
    if not isinstance(request, ASGIRequest):  # WSGI would hold the answer forever: pages poll instead
        raise Http404("The change feed needs the portal served over ASGI (portal.asgi).")
    user = await request.auser()
    await sync_to_async(_close_db)()  # the session's lookup: a stream may last for days
    response = StreamingHttpResponse(relay(user.pk), content_type="text/event-stream; charset=utf-8")
    response["Cache-Control"] = "no-store"
    response["X-Accel-Buffering"] = "no"
    return response


def _close_db() -> None:
    """In the thread that holds it (`connection` is looked up where it is called, not here)."""
    connection.close()


def event(raw: bytes | str) -> bytes:
    """One event from a published message; empty for anything that is not one."""
    try:
        message = json.loads(raw)
        topic = message["topic"]
    except (ValueError, TypeError, KeyError):
        return b""
    if topic not in changes.TOPICS:
        return b""
    return f"event: {topic}\ndata: {json.dumps(message)}\n\n".encode()


async def relay(user_id: int) -> AsyncIterator[bytes]:
    """Ends when Redis is away: the page reconnects after RETRY_MS and polls meanwhile."""
    keepalive = settings.LOG_STREAM_KEEPALIVE_SECONDS
    yield f"retry: {RETRY_MS}\n\n".encode()
    try:
        subscription = await hub().listen([changes.channel(), changes.user_channel(user_id)])
    except redis.RedisError as exc:
        log.warning("Change feed without Redis (%s): pages poll until it is back", exc)
        return
    async with subscription:
        # Read once the subscription is confirmed: a change counted after this reaches the stream.
        count = await asyncio.to_thread(changes.changes_count)
        yield READY.format("" if count is None else count).encode()
        loop = asyncio.get_running_loop()
        next_keepalive = loop.time() + keepalive
        while True:
            wait = next_keepalive - loop.time()
            if wait <= 0:
                next_keepalive = loop.time() + keepalive
                yield KEEPALIVE
                continue
            try:
                raw = await subscription.get(timeout=wait)
            except Lost as exc:
                log.info("Change feed lost messages (%s): the page reconnects and reads everything", exc)
                return
            if raw is not None and (out := event(raw.data)):
                yield out

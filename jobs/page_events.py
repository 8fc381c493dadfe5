"""GET /jobs/<id>/events/: the job page's one stream (docs/live.md, "The job page").

A job page needs the change feed every page has (the bell; portal/event_views.py), the job's log
as it is printed (jobs/logs/stream.py), and word when the job's row or its training curves change.
One EventSource brings them all: two would hold two of the six connections a browser opens to one
host over HTTP/1.1, and three job tabs would then stall every other request to the portal.

The events are the feed's (`ready`, `telemetry`, `bookings`, `jobs`, `notifications`), the log's
unnamed ones with their byte offsets as ids and `end`, and `job` and `metrics`. Only the log's
events carry an id, so the browser's Last-Event-ID on a reconnect is the log's offset, and the log
resumes exactly there. After `end` the stream stays open for the feed. Access: the log's (the
job's owner, leaders of its team, admins; 404 for anyone else).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from asgiref.sync import sync_to_async
from django.contrib.auth.decorators import login_required
from django.core.handlers.asgi import ASGIRequest
from django.db import connection
from django.http import Http404, HttpRequest, HttpResponseBadRequest, HttpResponseBase, StreamingHttpResponse
from django.views.decorators.http import require_GET

from jobs.logs import stream as log_stream
from jobs.models import Job
from portal.errors import Invalid
from portal.event_views import relay
from portal.streaming import merged


@require_GET
@login_required
async def job_events(request: HttpRequest, pk: int) -> HttpResponseBase:
    if not isinstance(request, ASGIRequest):  # WSGI would hold the answer forever: the page polls
        raise Http404("The job page's stream needs the portal served over ASGI (portal.asgi).")
    try:
        offset = log_stream.resume_offset(request.headers.get("Last-Event-ID"), request.GET.get("offset"))
        exact = log_stream.exact_asked(request.GET.get("encoding"))
    except Invalid as error:
        return HttpResponseBadRequest(error.message, content_type="text/plain; charset=utf-8")
    user = await request.auser()
    if not await sync_to_async(_visible)(user, pk):
        raise Http404("No such job.")
    stream = merged(relay(user.pk), _log(pk, offset, exact))
    response = StreamingHttpResponse(stream, content_type="text/event-stream; charset=utf-8")
    response["Cache-Control"] = "no-store"
    response["X-Accel-Buffering"] = "no"
    return response


def _visible(user: object, pk: int) -> bool:
    try:
        return Job.objects.restrict(user).filter(pk=pk).exists()
    finally:
        connection.close()  # this thread's: the stream may last for days


async def _log(job_id: int, offset: int, exact: bool) -> AsyncIterator[bytes]:
    """The log's events with the page's; after `end` it waits, for the feed goes on. Ending
    otherwise (Redis or the database away) ends the whole stream: the page reconnects. The page
    asks `?encoding=json` (`exact`), so that a progress bar's carriage returns reach it."""
    ended = False
    async for chunk in log_stream.events(job_id, offset, page=True, exact=exact):
        ended = chunk.endswith(log_stream.END)
        yield chunk
    if ended:
        await asyncio.Event().wait()  # until the merged stream closes and cancels this

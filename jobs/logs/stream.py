"""GET /api/v1/jobs/<id>/log/stream/: a job's log as server-sent events, live (docs/live.md).

Each event is whole lines of the log: one `data:` line per log line (its raw text, without the
newline), and `id:` the byte offset just after them. SSE cannot carry a carriage return inside a
line, so with `?encoding=json` an event's data is instead one JSON string holding its bytes
exactly (a progress bar's carriage returns, every newline; a byte that is no UTF-8 as the
escape of Python's surrogateescape stand-in), sent as they come, a line still being drawn
included: what `gpu logs -f` and the job page ask for. A
client that reconnects with that id in `Last-Event-ID` (or `?offset=`) gets exactly the bytes
after it. `event: end` follows the last bytes once the job has ended. A comment line every
LOG_STREAM_KEEPALIVE_SECONDS keeps proxies from closing a quiet stream.

The database is the record, Redis the nudge (jobs/logs/live.py). The stream subscribes first,
then reads what is stored from its offset, then relays what is published, skipping by offset
what it already sent; a gap (output published before it subscribed, or never published: the
writer's database was away) is read from the database at the next "stored up to" message.
Database reads happen only then, when the writer closes, and once per keep-alive (the job's
status: a job that ends without its worker, e.g. cancelled while queued, publishes nothing),
each in a thread and with its connection closed after it: a stream may last for days.

Only this stream is async; the view that answers it is DRF's like the rest (jobs/api.py), so the
access rules are the log's. It needs an ASGI server: under WSGI Django would read it to its end
before sending anything.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.db import DatabaseError, connection
from django.http import StreamingHttpResponse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.exceptions import NotFound
from rest_framework.generics import GenericAPIView
from rest_framework.permissions import IsAuthenticated
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request

from jobs.logs import live as log_live
from jobs.logs.store import log_end, log_pieces, parse_offset, utf8_incomplete
from jobs.models import Job
from portal.errors import Invalid
from portal.subscriptions import Lost, Subscription, hub

log = logging.getLogger(__name__)

READ_BYTES = 4 * 1024 * 1024  # at most this much read from the database per thread hop
AHEAD_BYTES = 8 * 1024 * 1024  # live output held while a gap before it is read
CLOSE_CHECKS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)  # after the writer closed: when to read the status
RETRY_MS = 2000
# A line about a job's end may be written just after its status (the reconciler's "lost"): a
# stream that sees the end goes on listening this long after it before it says `end`.
END_SETTLE_SECONDS = 1.0  # EventSource's reconnection delay, e.g. while Redis is away
STATE_SHARE_SECONDS = 0.5  # one read of a job's status serves its streams that ask this soon after
_LINE_BREAK = re.compile("\r\n|\r|\n")
# Escaped in the exact form beyond what json escapes: what clients that split lines as
# str.splitlines does (httpx's iter_lines) would take for a line's end.
_LINE_ENDS = (("\x85", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))
ENCODINGS = ("text", "json")


class EventStreamRenderer(BaseRenderer):
    """Lets DRF accept `Accept: text/event-stream` (EventSource sends it); only error bodies come
    through here, as plain text: the stream itself is a StreamingHttpResponse."""

    media_type = "text/event-stream"
    format = "sse"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):  # type: ignore[no-untyped-def]
        if isinstance(data, dict):
            return str(data.get("detail", data)).encode()
        return str(data).encode()


class JobLogStream(GenericAPIView):
    """The job's log as server-sent events, live until the job ends (docs/live.md). Visible as
    GET …/log/ is: to the owner, leaders of the job's team and admins; 404 for everyone else."""

    permission_classes = [IsAuthenticated]
    renderer_classes = [EventStreamRenderer, JSONRenderer]
    pagination_class = None
    filter_backends = []

    def get_queryset(self):  # type: ignore[no-untyped-def]
        if getattr(self, "swagger_fake_view", False):  # schema generation: no request user
            return Job.objects.none()
        return Job.objects.restrict(self.request.user).select_related("owner", "team", "server")

    @extend_schema(
        parameters=[
            OpenApiParameter("offset", int, required=False, description="Bytes after this offset."),
            OpenApiParameter(
                "encoding",
                str,
                required=False,
                enum=ENCODINGS,
                description="text (default): one data line per log line. json: each event's data is"
                " one JSON string of its bytes exactly, carriage returns included.",
            ),
            OpenApiParameter(
                "Last-Event-ID", str, OpenApiParameter.HEADER, required=False, description="Wins over offset."
            ),
        ],
        responses={(200, "text/event-stream"): OpenApiTypes.STR},
    )
    def get(self, request: Request, pk: int) -> StreamingHttpResponse:
        job = self.get_object()
        if not isinstance(request._request, ASGIRequest):
            # WSGI would read the stream to the job's end before sending a byte: say where to go.
            raise NotFound(
                "The live log needs the portal served over ASGI (portal.asgi, as `make run` and"
                f" deploy/ do); read /api/v1/jobs/{job.pk}/log/?offset= instead."
            )
        offset = resume_offset(request.headers.get("Last-Event-ID"), request.query_params.get("offset"))
        exact = exact_asked(request.query_params.get("encoding"))
        return log_event_response(job, offset=offset, exact=exact)


def resume_offset(last_event_id: str | None, offset: str | None) -> int:
    """Where to start: after Last-Event-ID (what EventSource sends on a reconnect), else ?offset=."""
    return parse_offset(last_event_id if last_event_id not in (None, "") else offset)


def exact_asked(raw: str | None) -> bool:
    """Whether `?encoding=` of a log stream asks for the exact form (json); Invalid, naming the
    field, for anything but text or json."""
    encoding = raw or "text"
    if encoding not in ENCODINGS:
        raise Invalid(
            "encoding must be text (one data line per log line, the default) or json (each event's"
            " bytes exactly, as one JSON string), e.g. ?encoding=json.",
            field="encoding",
        )
    return encoding == "json"


def log_event_response(job: Job, *, offset: int, exact: bool = False) -> StreamingHttpResponse:
    response = StreamingHttpResponse(
        events(job.pk, offset, exact=exact), content_type="text/event-stream; charset=utf-8"
    )
    response["Cache-Control"] = "no-store"
    response["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
    # What the events' data is: a client that asked for JSON knows it got it (an older portal
    # ignores ?encoding= and sends text).
    response["X-Log-Encoding"] = "json" if exact else "text"
    return response


def event(text: bytes, end: int, *, exact: bool = False) -> bytes:
    """One event: the lines of `text`, one `data:` line each, and the offset after them. SSE has no
    way to carry a carriage return inside a line: it ends a `data:` line as a newline does.
    `exact`: one `data:` line, `text` as a JSON string that gives back its very bytes."""
    if exact:
        return b"data: " + exact_json(text) + f"\nid: {end}\n\n".encode()
    body = text.decode("utf-8", "replace")
    if body.endswith("\n"):
        body = body[:-1]
    lines = "".join(f"data: {line}\n" for line in _LINE_BREAK.split(body))
    return f"{lines}id: {end}\n\n".encode()


def exact_json(text: bytes) -> bytes:
    """`text` as a JSON string, UTF-8 as it is (a bar's "━" one character, not six), each byte that
    is no UTF-8 as the escape of its surrogateescape stand-in: `json.loads(it).encode("utf-8",
    "surrogateescape") == text`. JSON has the escape for a lone surrogate; JSON.parse keeps it.
    U+0085, U+2028 and U+2029 are escaped too (`_LINE_ENDS`); json escapes the other controls.
    The stand-ins are escaped by the codec (backslashreplace writes a surrogate as JSON does):
    a function called per byte took 4-6 s for 4 MB of Latin-1, on the event loop."""
    dumped = json.dumps(text.decode("utf-8", "surrogateescape"), ensure_ascii=False)
    for char, escaped in _LINE_ENDS:
        if char in dumped:
            dumped = dumped.replace(char, escaped)
    return dumped.encode("utf-8", "backslashreplace")


END = b"event: end\ndata: \n\n"
KEEPALIVE = b": keep-alive\n\n"


@dataclass
class Cursor:
    """What this stream has sent (`sent`, the last id) and received (`have`); the bytes between
    them wait for their line's end (the exact form: only for a character's). `ahead` holds live
    output past a gap, by offset."""

    sent: int
    exact: bool = False  # events as `event(exact=True)` writes them
    have: int = -1
    held: bytearray = field(default_factory=bytearray)
    ahead: list[tuple[int, bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.have = self.sent

    def take(self, piece: bytes, start: int, end: int) -> bytes:
        """The log's [start, end), or a marker standing for it (the cap dropped those bytes);
        returns the events now complete (whole lines)."""
        if end <= self.have:
            return b""
        if len(piece) != end - start:  # a marker: the reader resumes after what it stands for
            out = self.flush()
            self.sent = self.have = end
            return out + event(piece, end, exact=self.exact)
        if start < self.have:  # a repeat in part
            piece = piece[self.have - start :]
        self.held += piece
        self.have = end
        if self.exact:
            # Bytes exactly, a line still being drawn included (a progress bar, stored as it comes:
            # jobs/logs/store.py), but for a character whose rest has not come yet.
            cut = len(self.held) - utf8_incomplete(self.held)
            if not cut:
                return b""
        else:  # whole lines: the text form cannot say where a line it sent in part goes on
            cut = self.held.rfind(b"\n") + 1
            if not cut and len(self.held) < READ_BYTES:
                return b""
            cut = cut or len(self.held)
        out = event(bytes(self.held[:cut]), self.sent + cut, exact=self.exact)
        del self.held[:cut]
        self.sent += cut
        return out

    def flush(self) -> bytes:
        """Whatever is held, though its line has not ended (the log's end, a marker next)."""
        if not self.held:
            return b""
        out = event(bytes(self.held), self.have, exact=self.exact)
        self.held.clear()
        self.sent = self.have
        return out

    def live(self, start: int, data: bytes) -> bytes:
        end = start + len(data)
        if end <= self.have:
            return b""
        if start > self.have:
            if sum(len(d) for _, d in self.ahead) < AHEAD_BYTES:
                self.ahead.append((start, data))
            return b""  # the database has the gap, or will: read at the next "stored"
        return self.take(data[self.have - start :], self.have, end)

    def drain_ahead(self) -> bytes:
        out, rest = b"", []
        for start, data in sorted(self.ahead):
            if start <= self.have:
                out += self.live(start, data)
            else:
                rest.append((start, data))
        self.ahead = rest
        return out


def _pieces(job_id: int, start: int, until: int) -> tuple[list[tuple[bytes, int, int]], bool]:
    """Stored pieces in [start, until), at most READ_BYTES of them; and whether more remain."""
    pieces, size = [], 0
    for piece, begin, end in log_pieces(job_id, start, until=until):
        pieces.append((piece, begin, end))
        size += len(piece)
        if size >= READ_BYTES and end < until:
            return pieces, True
    return pieces, False


def _state_row(job_id: int) -> tuple[float, int]:
    """(how long ago the job ended, or -1 while it has not; where its stored log ends). The status
    is read first: a log written before the status (the worker's) is then all there."""
    row = Job.objects.filter(pk=job_id).values("status", "finished_at").first()
    end = log_end(job_id)
    if row is None or row["status"] not in Job.FINISHED:
        return (-1.0 if row is not None else END_SETTLE_SECONDS), end
    if row["finished_at"] is None:
        return END_SETTLE_SECONDS, end
    return max(0.0, (timezone.now() - row["finished_at"]).total_seconds()), end


# Each read runs in a thread and closes its connection after it: a stream may last for days.


def _read(job_id: int, start: int, until: int) -> tuple[list[tuple[bytes, int, int]], bool]:
    try:
        return _pieces(job_id, start, until)
    finally:
        connection.close()


def _state(job_id: int) -> tuple[float, int]:
    try:
        return _state_row(job_id)
    finally:
        connection.close()


def _opening(job_id: int, start: int) -> tuple[tuple[float, int], list[tuple[bytes, int, int]], bool]:
    """A stream's first read: the job's state and the stored bytes from `start` (`_pieces`), on the
    connection its request's view opened, then closed. One connection per stream opened, not three:
    500 streams opening at once made the API wait behind their connects (docs/benchmarks.md)."""
    try:
        state = _state_row(job_id)
        return (state, *_pieces(job_id, start, state[1]))
    finally:
        connection.close()


_StateReads = dict[int, "tuple[float, asyncio.Future[tuple[float, int]]]"]
_shared_states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _StateReads]
_shared_states = weakref.WeakKeyDictionary()


async def job_state(job_id: int, *, since: float) -> tuple[float, int]:
    """`_state`, from a read that started at or after `since` (the loop's time): one read serves
    every stream of the job in this process that needs one from that moment on, e.g. all 500
    watchers told by one message that the job changed (`Message.at` is the same for each). A
    read that started earlier might predate the change, or the caller's subscription."""
    loop = asyncio.get_running_loop()
    reads = _shared_states.setdefault(loop, {})
    found = reads.get(job_id)
    if found is not None and found[0] >= since:
        return await asyncio.shield(found[1])
    started, read = loop.time(), asyncio.ensure_future(sync_to_async(_state)(job_id))
    reads[job_id] = (started, read)

    # Kept a while after it is done: callers just behind (needing one from `started` on) share it.
    read.add_done_callback(lambda _: loop.call_later(STATE_SHARE_SECONDS, _forget, reads, job_id, read))
    return await asyncio.shield(read)


def _forget(reads: _StateReads, job_id: int, read: asyncio.Future[tuple[float, int]]) -> None:
    if job_id in reads and reads[job_id][1] is read:
        del reads[job_id]


async def _catch_up(cursor: Cursor, job_id: int, until: int) -> AsyncIterator[bytes]:
    """The stored bytes from what the stream has up to `until`, then what waited ahead of them."""
    more = cursor.have < until
    while more:
        pieces, more = await sync_to_async(_read)(job_id, cursor.have, until)
        if not pieces:
            break
        yield b"".join(cursor.take(*piece) for piece in pieces)
    if cursor.ahead:
        yield cursor.drain_ahead()


async def events(
    job_id: int, offset: int, *, page: bool = False, exact: bool = False
) -> AsyncIterator[bytes]:
    """The stream (module docstring). Ends after `event: end`, or when Redis is away: the client
    reconnects after RETRY_MS with its Last-Event-ID, and reads on from the database. `page`: the
    job page's stream (jobs/page_events.py) also says when the job's row or its training curves
    changed (`event: job`, `event: metrics`). `exact`: the log's events as JSON (`event`)."""
    # The view's connection, held by this request's thread, serves the first read (`_opening`),
    # which then closes it.
    cursor = Cursor(offset, exact)
    yield f"retry: {RETRY_MS}\n\n".encode()
    try:
        subscription = await hub().listen([log_live.channel(job_id)])
    except redis.RedisError as exc:
        log.warning("Live log of job %s without Redis (%s): stored bytes only", job_id, exc)
        ended_for, end = await sync_to_async(_state)(job_id)
        async for out in _catch_up(cursor, job_id, end):
            yield out
        yield cursor.flush() + (END if ended_for >= END_SETTLE_SECONDS else b"")
        return
    async with subscription:
        try:
            async for out in _follow(cursor, job_id, subscription, page=page):
                yield out
        except DatabaseError as exc:  # the database restarting: the client reconnects, and reads on
            log.warning("Live log of job %s lost the database (%s): the client reconnects", job_id, exc)
            yield cursor.flush()


def _jittered(seconds: float) -> float:
    # Each keep-alive also reads the job's row: streams opened together (a web server restart
    # reconnects every tab at once) would otherwise read it together every period, a burst of
    # connections that bench_streams saw in the delivery tail. ±20 % spreads them out.
    return seconds * random.uniform(0.8, 1.2)


JOB_CHANGED = b"event: job\ndata: \n\n"


def metrics_event(seq: int) -> bytes:
    return f'event: metrics\ndata: {{"seq": {seq}}}\n\n'.encode()


async def _follow(cursor: Cursor, job_id: int, sub: Subscription, *, page: bool) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    keepalive = settings.LOG_STREAM_KEEPALIVE_SECONDS
    next_keepalive = loop.time() + _jittered(keepalive)
    checks: list[float] = []  # when to read the status again (the writer closed; the job just ended)
    # The status read must be from this time on: first after subscribing (nothing falls between).
    since: float | None = sub.since
    opening = True
    while since is not None:
        if opening:
            (ended_for, end), pieces, _ = await sync_to_async(_opening)(job_id, cursor.have)
            if out := b"".join(cursor.take(*piece) for piece in pieces):
                yield out
            opening = False
        else:
            ended_for, end = await job_state(job_id, since=since)
        async for out in _catch_up(cursor, job_id, end):  # the rest, where the first read held more
            yield out
        if ended_for >= END_SETTLE_SECONDS:
            yield cursor.flush() + (JOB_CHANGED if page else b"") + END  # the page reads the final status
            return
        if ended_for >= 0:  # a line about the end may follow it (the reconciler's "lost")
            checks = [loop.time() + END_SETTLE_SECONDS - ended_for]
        since = None
        while since is None:
            now = loop.time()
            if now >= next_keepalive:
                next_keepalive = now + _jittered(keepalive)
                yield KEEPALIVE  # and read the row: a job that ended without a word ends here
                since = now - STATE_SHARE_SECONDS
                break
            if checks and now >= checks[0]:
                since = checks.pop(0)
                break
            wake = min([next_keepalive, *checks])
            try:
                received = await sub.get(timeout=wake - now)
            except Lost as exc:
                log.info("Live log of job %s lost messages (%s): the client reconnects", job_id, exc)
                yield cursor.flush()
                return
            if received is None:
                continue
            try:
                kind, at, data = log_live.decode(received.data)
            except ValueError:
                continue
            if kind == log_live.LIVE:
                if out := cursor.live(at, data):
                    yield out
            elif kind == log_live.STORED:
                if at > cursor.have:
                    async for out in _catch_up(cursor, job_id, at):
                        yield out
            elif kind == log_live.METRICS:
                if page:
                    yield metrics_event(at)
            elif kind == log_live.CLOSED:  # the writer closed: the job's status comes just after
                since = received.at
                checks = sorted({*checks, *(received.at + delay for delay in CLOSE_CHECKS)})
            elif kind == log_live.JOB:  # the page reads the job's status; this stream, whether it ended
                if page:
                    yield JOB_CHANGED
                since = received.at

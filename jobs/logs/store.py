"""Job logs: written in chunks to the database by the worker, read back in constant memory.

Why the database: a worker may run on another host with no shared filesystem, and the
log must outlive that host. The worker flushes every LOG_FLUSH_SECONDS or whenever 1 MB is
pending; live watchers do not wait for that: each line is also published on Redis as it is
taken (jobs/logs/live.py, read by the event stream in jobs/logs/stream.py, docs/live.md).

Each line is stored with the time it began: a line still being drawn (a progress bar redrawn with
carriage returns) is stored as it comes, each LOG_FLUSH_SECONDS, and what follows continues that
line until its newline, so the stored log is the job's bytes with a timestamp at each line's start.

Offsets are byte positions in the job's whole output (timestamps included). The cap
(JOB_LOG_MAX_MB) keeps the first half as `head` chunks and the newest half as tail
chunks, dropping the oldest tail chunk as new ones arrive; readers put a marker line
where bytes were dropped, and offsets stay valid for tailing clients throughout.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import F, Max
from django.db.models.functions import Length, Substr
from django.utils import timezone
from django.utils.http import content_disposition_header

from jobs.host.spool import LogSpool
from jobs.logs import live as log_live
from jobs.models import Job, LogChunk
from jobs.paths import download_name
from portal.errors import Invalid
from portal.streaming import SyncStreamingHttpResponse

CHUNK_BYTES = 1024 * 1024
LOG_FLUSH_SECONDS = 0.5
READ_BATCH = 4  # chunks per query while streaming: ≤ 4 MB in memory at a time
MAX_PENDING_BYTES = 16 * CHUNK_BYTES  # held in the worker while the database cannot take it
SPOOL_RETRY_SECONDS = 2.0  # a spool waiting for the database is tried this often, output or not


def timestamp(at: float | None = None) -> bytes:
    moment = datetime.fromtimestamp(time.time() if at is None else at, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.").encode() + f"{moment.microsecond // 1000:03d}Z ".encode()


def utf8_incomplete(data: bytes | bytearray) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character that has not ended (0 to 3).
    Bytes that are no UTF-8 (a numpy array's raw bytes) count 0: nothing is held for them."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # the character's first byte: how long is it?
            length = (
                2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
            )
            return back if length > back else 0
    return 0


# The timestamp `timestamp()` puts at each line's start (MULTILINE: at every line's, for a reader
# that strips them); bytes that do not begin so go on with a line.
STAMP = re.compile(rb"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ", re.MULTILINE)


def _line_started(data: bytes) -> bytes:
    """`data`, which went on with a line, made to start a line of its own: its newline that ended
    that line dropped, or a timestamp before its first bytes."""
    if data[:1] == b"\n":
        return data[1:]
    return data if STAMP.match(data) else timestamp() + data


def _ends_open(job_id: int) -> bool:
    """Whether the job's stored log ends inside a line (its writer stopped while a bar was being
    drawn): what is appended after it starts a line of its own."""
    last = (
        LogChunk.objects.filter(job_id=job_id)
        .order_by("-seq")
        .annotate(last=Substr("data", Length("data"), 1))
        .values_list("last", flat=True)
        .first()
    )
    return last is not None and bytes(last) != b"\n"


def dropped_marker(dropped: int) -> bytes:
    return (
        f"\n[portal] … {dropped:,} bytes of this log were dropped here: the log cap "
        f"(JOB_LOG_MAX_MB={settings.JOB_LOG_MAX_MB}) keeps the first and the last part …\n\n"
    ).encode()


def spool_dropped_marker(spool: LogSpool) -> bytes:
    """Where the spool's gap is: how much, and why (its cap, or the disk's error)."""
    return (
        timestamp()
        + (
            f"[portal] … {spool.dropped:,} bytes of output were dropped here: the database was away and"
            f" this host's spool for the job {spool.dropped_why} …\n"
        ).encode()
    )


class LogWriter:
    """The worker's side: timestamps each line and stores it in chunks under the cap.

    With a `spool` (jobs/host/spool.py), what the database cannot take now goes to the host's disk
    and is stored, in order and once, at the next flush that reaches the database.

    Output is also published as it is taken (jobs/logs/live.py), at the offsets it will be stored
    at, but only while those are known (`in_sync`: the last write reached the database and the
    spool is empty); each write that reaches the database is announced too, so a live stream
    reads from the database what was not published."""

    def __init__(self, job_id: int, cap_bytes: int | None = None, *, spool: LogSpool | None = None) -> None:
        self.job_id = job_id
        self.spool = spool
        cap = cap_bytes or settings.JOB_LOG_MAX_MB * 1024 * 1024
        self.head_limit = cap // 2
        self.tail_limit = cap - self.head_limit
        self.chunk_bytes = max(1024, min(CHUNK_BYTES, self.tail_limit // 4))
        state = LogChunk.objects.filter(job_id=job_id).aggregate(seq=Max("seq"))
        self.seq = state["seq"] or 0
        job = Job.objects.filter(pk=job_id).values("log_bytes", "log_dropped_bytes").get()
        self.total = job["log_bytes"]
        self.dropped = job["log_dropped_bytes"]
        self.tail: deque[tuple[int, int]] = deque(
            LogChunk.objects.filter(job_id=job_id, head=False).order_by("seq").values_list("seq", "size")
        )
        self.tail_bytes = sum(size for _, size in self.tail)
        self.pending = bytearray()
        self.partial = bytearray()  # a line still waiting for its newline
        self.partial_since = 0.0
        # What was taken ends inside a line, stored without a newline of its own: the next bytes
        # continue it, with no timestamp of their own. What waits in a spool left over goes first.
        if spool is not None and spool.size:
            self.open = spool.ends_open()
        else:
            self.open = bool(self.total) and _ends_open(job_id)
        self.last_flush = time.monotonic()
        self.in_sync = not (spool is not None and (spool.size or spool.dropped))
        # More of the job's row, written with every store in its transaction (a Slurm job's place
        # in its output file: jobs/host/slurm_runner.py).
        self.stored_fields: Callable[[], dict[str, Any]] | None = None

    def _add(self, data: bytes) -> None:
        """Output taken: pending for the next flush, and out to live watchers now."""
        if self.in_sync:
            log_live.publish(self.job_id, log_live.LIVE, self.total + len(self.pending), data)
        self.pending += data

    def feed(self, data: bytes) -> None:
        """Add raw output; complete lines get their timestamp now (the time they arrived)."""
        self.partial += data
        if b"\n" not in data:
            if len(self.partial) == len(data):
                self.partial_since = time.monotonic()
            if len(self.partial) >= self.chunk_bytes:
                self._take_partial()  # a progress bar (\r) without end: taken, and capped, as lines are
            return
        stamp = timestamp()
        *lines, rest = bytes(self.partial).split(b"\n")
        self._add(b"".join(self._stamp(stamp) + line + b"\n" for line in lines))
        self.partial = bytearray(rest)
        self.partial_since = time.monotonic()
        self._cap_pending()

    def _cap_pending(self) -> None:
        """The database has been away for a while: keep the newest output, count the rest as
        dropped (the reader shows the gap), and never grow without bound."""
        if len(self.pending) > MAX_PENDING_BYTES:
            excess = len(self.pending) - MAX_PENDING_BYTES
            del self.pending[:excess]
            self.total += excess
            self.dropped += excess

    def _stamp(self, stamp: bytes) -> bytes:
        """A line's timestamp where a line starts; nothing where the bytes continue an open one."""
        if self.open:
            self.open = False
            return b""
        return stamp

    def _take_partial(self, *, whole: bool = False) -> None:
        """The line being drawn as far as it came, without a newline: what follows continues it.
        Not a character the pipe's last read ended inside (kept for the rest, else each half reads
        as U+FFFD). `whole`: all of it, and the line ended (the job's output has ended)."""
        keep = 0 if whole else utf8_incomplete(self.partial)
        if whole:
            if self.partial or self.open:
                self._add(self._stamp(timestamp()) + bytes(self.partial) + b"\n")
            self.partial.clear()
            return
        if keep == len(self.partial):
            self.partial_since = time.monotonic()  # only that character's start: wait for the rest
            return
        self._add(self._stamp(timestamp()) + bytes(self.partial[: len(self.partial) - keep]))
        self.open = True
        del self.partial[: len(self.partial) - keep]
        self.partial_since = time.monotonic()
        self._cap_pending()

    def write_line(self, text: str) -> None:
        """A line of the portal's own (what it applied, why it stopped the job), on a line of its
        own: a line the job was drawing ends first, and goes on after it on a new line."""
        ended = b"\n" if self.open else b""
        self.open = False
        self._add(ended + timestamp() + text.rstrip("\n").encode() + b"\n")

    # After a failed flush the next waits: 2 s, doubling up to 30 s, back to none once one
    # succeeds (or the caller knows the database answers again and clears `backoff`). Each try
    # rebuilds every pending row: not every 2 s per job against a database that is away.
    FLUSH_BACKOFF_MAX_SECONDS = 30.0
    backoff = 0.0

    def maybe_flush(self) -> None:
        now = time.monotonic()
        if self.partial and now - self.partial_since >= LOG_FLUSH_SECONDS:
            self._take_partial()  # e.g. a progress bar without newlines: show it anyway
        if now - self.last_flush < self.backoff:
            return
        spooled = self.spool is not None and (self.spool.size or self.spool.dropped)
        if (
            len(self.pending) >= self.chunk_bytes
            or (self.pending and now - self.last_flush >= LOG_FLUSH_SECONDS)
            # What waits on disk goes in once the database is back, though the job prints nothing more.
            or (spooled and now - self.last_flush >= SPOOL_RETRY_SECONDS)
        ):
            self.flush()

    def close(self) -> None:
        try:
            if self.partial or self.open:
                self._take_partial(whole=True)
            self.flush()
        finally:
            # Watchers read the job's status now rather than at their next keep-alive.
            log_live.publish(self.job_id, log_live.CLOSED, self.total)

    def flush(self) -> None:
        """Store what is pending. On a database error nothing is lost: the bytes go to the
        spool on disk (without one, back to memory) and out with the next flush, after
        anything older, and the error is raised for the caller to retry."""
        self.last_flush = time.monotonic()
        try:
            self._flush()
        except Exception:
            self.in_sync = False  # offsets of what comes next are known again after a write
            self.backoff = min(self.FLUSH_BACKOFF_MAX_SECONDS, 2 * self.backoff or SPOOL_RETRY_SECONDS)
            raise
        self.in_sync = True
        self.backoff = 0.0

    def _flush(self) -> None:
        if self.spool is not None and (self.spool.size or self.spool.dropped):
            if self.pending:  # older bytes wait on disk: these go after them
                self.spool.append(bytes(self.pending))
                self.pending.clear()
            data = self.spool.read()
            if self.spool.dropped:
                # The marker is a line of its own, after what was kept (or what is stored), and
                # what comes after it starts a line: the bytes it stands for ended inside one.
                ends_open = data[-1:] != b"\n" if data else bool(self.total) and _ends_open(self.job_id)
                if ends_open:
                    data += b"\n"
                self.open = False
                data += spool_dropped_marker(self.spool)
            if data and not (self.total and _ends_open(self.job_id)):
                data = _line_started(data)  # what it went on with was ended meanwhile (log_append)
            self._store_once(data)
            self.spool.clear()
            return
        if not self.pending:
            return
        data = bytes(self.pending)
        try:
            self._store_once(data)
        except Exception:
            if self.spool is not None:
                self.spool.append(data)
                self.pending.clear()
            raise  # without a spool it stays pending, in place: nothing copied back on every try
        self.pending.clear()

    def _store_once(self, data: bytes) -> None:
        """Store `data` after what is stored; on failure the writer's state is as before."""
        saved = (self.seq, self.total, self.dropped, self.tail_bytes, deque(self.tail))
        try:
            try:
                self._store(data)
            except IntegrityError:
                # Someone else appended (the reconciler's "lost" line while this worker was
                # out of touch): continue after what is stored, on a line of its own if that
                # ended the line these bytes went on with.
                self.seq, self.total, self.dropped, self.tail_bytes, self.tail = saved
                self._resync()
                if not _ends_open(self.job_id):
                    data = _line_started(data)
                self._store(data)
        except Exception:
            self.seq, self.total, self.dropped, self.tail_bytes, self.tail = saved
            raise
        log_live.publish(self.job_id, log_live.STORED, self.total)

    def _resync(self) -> None:
        self.seq = LogChunk.objects.filter(job_id=self.job_id).aggregate(seq=Max("seq"))["seq"] or 0
        stored = Job.objects.filter(pk=self.job_id).values_list("log_bytes", flat=True).get()
        self.total = max(self.total, stored)

    def _store(self, data: bytes) -> None:
        rows: list[LogChunk] = []
        for piece in range(0, len(data), self.chunk_bytes):
            rows += self._chunks(data[piece : piece + self.chunk_bytes])
        drop: list[int] = []
        while self.tail_bytes > self.tail_limit and self.tail:
            seq, size = self.tail.popleft()
            drop.append(seq)
            self.tail_bytes -= size
            self.dropped += size
        with transaction.atomic():
            LogChunk.objects.bulk_create(rows)
            if drop:
                LogChunk.objects.filter(job_id=self.job_id, seq__in=drop).delete()
            more = self.stored_fields() if self.stored_fields is not None else {}
            Job.objects.filter(pk=self.job_id).update(
                log_bytes=self.total, log_dropped_bytes=self.dropped, **more
            )

    def _chunks(self, data: bytes) -> list[LogChunk]:
        """Store `data`, splitting it where the head ends; tail chunks join the drop queue."""
        rows = []
        while data:
            room = self.head_limit - self.total
            part = data[:room] if room > 0 else data
            self.seq += 1
            head = room > 0
            rows.append(
                LogChunk(
                    job_id=self.job_id, seq=self.seq, start=self.total, size=len(part), head=head, data=part
                )
            )
            if not head:
                self.tail.append((self.seq, len(part)))
                self.tail_bytes += len(part)
            self.total += len(part)
            data = data[len(part) :]
        return rows


def log_append(job_id: int, text: str, *, now: datetime | None = None) -> None:
    """Append one portal line to a job's log from outside its worker (e.g. the reconciler)."""
    with transaction.atomic():
        job = Job.objects.select_for_update(no_key=True).filter(pk=job_id).values("log_bytes").get()
        seq = (LogChunk.objects.filter(job_id=job_id).aggregate(seq=Max("seq"))["seq"] or 0) + 1
        at = (now or timezone.now()).timestamp()
        ended = b"\n" if job["log_bytes"] and _ends_open(job_id) else b""  # a line of its own
        data = ended + timestamp(at) + text.rstrip("\n").encode() + b"\n"
        LogChunk.objects.create(
            job_id=job_id, seq=seq, start=job["log_bytes"], size=len(data), head=False, data=data
        )
        Job.objects.filter(pk=job_id).update(log_bytes=F("log_bytes") + len(data))
        end = job["log_bytes"] + len(data)
        # Written from outside the worker, about a job that ended: watchers read its status.
        transaction.on_commit(lambda: log_live.publish(job_id, log_live.CLOSED, end))


def parse_offset(raw: str | None) -> int:
    """`?offset=` as a byte count, or Invalid naming the field (ASCII digits only)."""
    raw = (raw or "0").strip()
    if not re.fullmatch(r"[0-9]{1,18}", raw):
        raise Invalid(
            "offset must be a whole number of bytes, e.g. ?offset=0 (from the start) or the last "
            "X-Log-Next-Offset header.",
            field="offset",
        )
    return int(raw)


def log_end(job_id: int) -> int:
    """The offset just past the last stored byte: where a tailing client continues."""
    last = LogChunk.objects.filter(job_id=job_id).order_by("-seq").values_list("start", "size").first()
    return last[0] + last[1] if last else 0


_CHUNKS_SQL = (
    "SELECT seq, start, size, data FROM jobs_logchunk"
    " WHERE job_id = %s AND seq > %s AND start >= %s AND start < %s ORDER BY seq LIMIT %s"
)


def _chunk_batch(job_id: int, after_seq: int, lowest: int, below: int) -> list[tuple]:
    """The next READ_BATCH chunks after `after_seq` whose start is in [lowest, below).

    On PostgreSQL through a binary-format cursor: Django's client-side cursor receives
    bytea as hex text, which PostgreSQL encodes and psycopg decodes again, capping a 1 GB
    download at ~150 MB/s; binary transfer reads it at ~300 MB/s (bench/bench_jobs.py)."""
    params = [job_id, after_seq, lowest, below, READ_BATCH]
    if connection.vendor == "postgresql":
        import psycopg

        connection.ensure_connection()
        with psycopg.Cursor(connection.connection) as cursor:
            cursor.execute(_CHUNKS_SQL, params, binary=True)
            return cursor.fetchall()
    with connection.cursor() as cursor:
        cursor.execute(_CHUNKS_SQL, params)
        return cursor.fetchall()


def log_stream(job_id: int, offset: int = 0, *, until: int | None = None) -> Iterator[bytes]:
    """The stored log from byte `offset` (of the whole output) up to `until`, chunk by chunk.

    Reads READ_BATCH chunks per query by sequence number, so memory stays flat however
    large the log; a marker line stands where the cap dropped bytes."""
    for piece, _, _ in log_pieces(job_id, offset, until=until):
        yield piece


def log_pieces(job_id: int, offset: int = 0, *, until: int | None = None) -> Iterator[tuple[bytes, int, int]]:
    """log_stream's pieces, each with the range [start, end) of the log it stands for: a marker's
    range is the bytes the cap dropped (and not its length), so a reader that resumes at its end
    skips the gap once."""
    last_seq, position = 0, offset
    below = until if until is not None else 2**62
    while True:
        batch = _chunk_batch(job_id, last_seq, offset - CHUNK_BYTES, below)
        if not batch:
            return
        for seq, start, size, data in batch:
            last_seq = seq
            end = start + size
            if end <= position:
                continue
            if start > position:  # the cap dropped [position, start)
                yield dropped_marker(start - position), position, start
                position = start
            piece = data[position - start :] if position > start else data
            if until is not None and end > until:
                piece = piece[: until - max(start, position)]
                end = until
            yield bytes(piece), max(start, position), end
            position = end


def log_response(job: Job, *, offset: int = 0, attachment: bool = False) -> SyncStreamingHttpResponse:
    """The log as text/plain, streamed; headers tell a tailing client where to go on."""
    end = log_end(job.pk)
    response = SyncStreamingHttpResponse(
        log_stream(job.pk, offset, until=end), content_type="text/plain; charset=utf-8"
    )
    response["X-Log-Next-Offset"] = str(max(end, offset))
    response["X-Job-Status"] = job.status
    response["Cache-Control"] = "no-store"
    if attachment:
        response["Content-Disposition"] = content_disposition_header(
            as_attachment=True, filename=download_name(job.pk, job.name, ".log")
        )
    return response

"""Training curves: the records a job's Keras fit() reports, stored, read back, and the cards' use.

The launcher (jobs/host/launcher-bin/_portal_launch_curves.py, `MetricsReporter`) prints each
record on the job's
output as one line, `[portal-metrics] {"kind": "epoch", "epoch": 3, "step": 120, "loss": 0.31, ...}`.
The worker reads that output as one pipe; `MetricsRecorder` takes the records out of it before the
log sees it and stores them as JobMetric rows, flushed at the log's cadence.

Why the job's own output and not a pipe of its own: the worker starts the job through
portal.processes.start_job_process, which passes it no other descriptor. The line is the job's to
write, so it is read like any user input: a line longer than MAX_LINE_BYTES, bad JSON, a value that
is no finite number in range, a name that is no metric name, more than MAX_METRICS names or more than
MAX_RECORDS records are never stored. A line is taken out of the log only when it was stored: anything
else stays in the log, so nothing the job printed is lost.

Why out of the log: at a batch record a second, a day's run would add 86,400 lines of JSON to the log,
crowd out the script's own output on the page and eat JOB_LOG_MAX_MB, whose cap then drops the middle
of what the user printed. The records are on the job's page, in the API and in the CSV instead.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from django.db import DataError, IntegrityError, transaction
from django.db.models import Max
from django.http import StreamingHttpResponse
from django.utils import timezone
from django.utils.http import content_disposition_header

from gpus.models import GPU, TelemetrySample
from jobs.logs import live as log_live
from jobs.logs.store import LOG_FLUSH_SECONDS
from jobs.models import Job, JobMetric
from jobs.paths import download_name
from portal.errors import Invalid
from portal.streaming import SyncStreamingHttpResponse

log = logging.getLogger(__name__)

PREFIX = b"[portal-metrics]"  # the launcher's METRICS_PREFIX
MAX_LINE_BYTES = 4096  # the launcher writes at most this much per record (PIPE_BUF)
MAX_METRICS = 32  # names per record; more are left out
# Per job. The launcher thins batch records as a run grows long (about 25,000 in 3 days), so only a
# script that prints such lines itself comes near it; beyond it, records stay in the log.
MAX_RECORDS = 100_000
MAX_PENDING = 10_000  # held in the worker while the database cannot take them: the newest are kept
MAX_EPOCH = 2**31 - 1
MAX_STEP = 10**15
PAGE_RECORDS = 10_000  # per API answer: a client asks again with ?since= the last seq it got
FIELDS = ("seq", "kind", "epoch", "step", "at")  # a record's own keys; never metric names
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/@+-]{0,63}", re.ASCII)  # starts with no CSV formula sign


# --------------------------------------------------------------------------------------------------------
# The worker's side


def parse_record(payload: bytes) -> dict[str, Any] | None:
    """One record from what follows the prefix, or None when it is none.

    {"kind", "epoch", "step", "values"}: kind "epoch" or "batch"; epoch and step whole numbers in range
    or None; values {name: finite float or None}, names checked, at most MAX_METRICS."""
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError):  # bad JSON, bad UTF-8, too deep, an int of 5,000 digits
        return None
    if not isinstance(data, dict) or data.get("kind") not in JobMetric.Kind.values:
        return None
    try:
        epoch, step = _count(data.get("epoch"), MAX_EPOCH), _count(data.get("step"), MAX_STEP)
    except ValueError:
        return None
    values: dict[str, float | None] = {}
    for name, value in data.items():
        if name in FIELDS or not isinstance(name, str) or not NAME.fullmatch(name):
            continue
        try:
            values[name] = _metric(value)
        except ValueError:
            continue
        if len(values) == MAX_METRICS:
            break
    if not values:
        return None
    return {"kind": data["kind"], "epoch": epoch, "step": step, "values": values}


def _count(value: Any, most: int) -> int | None:
    """A whole number in [0, most], or None; ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise ValueError(value)
    return value


def _metric(value: Any) -> float | None:
    """A finite number, or None for null (NaN, ±inf); ValueError for anything else (text, lists, bool)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(value)
    try:
        number = float(value)
    except OverflowError:  # an integer beyond a float
        raise ValueError(value) from None
    return number if math.isfinite(number) else None


def _prefix_tail(data: bytes) -> int:
    """How many bytes at the end of `data` could begin PREFIX (held until the next read)."""
    for size in range(min(len(PREFIX) - 1, len(data)), 0, -1):
        if PREFIX.startswith(data[-size:]):
            return size
    return 0


class MetricsRecorder:
    """The worker's side: takes the records out of the job's output and stores them.

    `feed` returns the output for the log, the stored records' lines taken out (so a progress bar
    that a record interrupted reads on as before). A record may arrive in two reads: what could
    still become one is held back, for at most LOG_FLUSH_SECONDS (`release`).
    """

    def __init__(self, job_id: int, *, clock: Any = time.monotonic) -> None:
        self.job_id = job_id
        self.clock = clock
        self.seq = JobMetric.objects.filter(job_id=job_id).aggregate(seq=Max("seq"))["seq"] or 0
        self.pending: list[JobMetric] = []
        self.held = b""
        self.held_since = 0.0
        self.last_flush = clock()
        self.full = False  # MAX_RECORDS reached: said once in the log

    def feed(self, data: bytes) -> bytes:
        carried = bool(self.held)
        buffer, self.held = self.held + data, b""
        out = bytearray()
        position = 0
        while True:
            start = buffer.find(PREFIX, position)
            if start < 0:
                keep = _prefix_tail(buffer[position:])
                out += buffer[position : len(buffer) - keep]
                self._hold(buffer[len(buffer) - keep :], still=carried and keep == len(buffer))
                return bytes(out)
            out += buffer[position:start]
            end = buffer.find(b"\n", start, start + MAX_LINE_BYTES)
            if end < 0 and len(buffer) - start < MAX_LINE_BYTES:
                self._hold(buffer[start:], still=carried and start == 0)  # the rest is on its way
                return bytes(out)
            if end < 0:  # too long for a record: it is the job's text
                out += PREFIX
                position = start + len(PREFIX)
                continue
            if not self._take(buffer[start + len(PREFIX) : end]):
                out += buffer[start : end + 1]
            position = end + 1

    def _hold(self, data: bytes, *, still: bool) -> None:
        """Keep `data` for the next read; `still`: it began in an earlier read, which its age counts from."""
        if data and not still:
            self.held_since = self.clock()
        self.held = data

    def release(self, *, everything: bool = False) -> bytes:
        """What was held back and has not become a record in time (all of it at the end): for the log."""
        if not self.held or not (everything or self.clock() - self.held_since >= LOG_FLUSH_SECONDS):
            return b""
        data, self.held = self.held, b""
        return data

    def _take(self, payload: bytes) -> bool:
        record = parse_record(payload)
        if record is None:
            return False
        if self.seq >= MAX_RECORDS:
            return False
        self.seq += 1
        self.pending.append(JobMetric(job_id=self.job_id, seq=self.seq, at=timezone.now(), **record))
        if len(self.pending) > MAX_PENDING:
            del self.pending[: len(self.pending) - MAX_PENDING]
        return True

    def full_note(self) -> str | None:
        """A line for the log, once, when the job has used up MAX_RECORDS."""
        if self.full or self.seq < MAX_RECORDS:
            return None
        self.full = True
        return (
            f"[portal] training curves: this job has {MAX_RECORDS:,} records, the most that are kept; "
            "later [portal-metrics] lines stay in the log"
        )

    def maybe_flush(self) -> None:
        if self.pending and self.clock() - self.last_flush >= LOG_FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Store what is pending. While the database is away it stays pending for the next flush;
        rows the database refuses are dropped, not tried again on every tick."""
        self.last_flush = self.clock()
        if not self.pending:
            return
        try:
            with transaction.atomic():
                JobMetric.objects.bulk_create(self.pending, batch_size=500)
        except (DataError, IntegrityError):
            log.exception("Job %s: the database refused %d training records", self.job_id, len(self.pending))
        else:
            log_live.publish(self.job_id, log_live.METRICS, self.pending[-1].seq)  # for the job page
        self.pending = []


# --------------------------------------------------------------------------------------------------------
# Reading them back


def parse_since(raw: str | None) -> int:
    """`?since=` as a record number (seq), or Invalid naming the field."""
    raw = (raw or "0").strip()
    if not re.fullmatch(r"[0-9]{1,18}", raw):
        raise Invalid(
            "since must be a whole number: 0 for every record, or the seq of the last record you have.",
            field="since",
        )
    return int(raw)


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    return {name: row[name] for name in FIELDS} | row["values"]


def metric_records(job_id: int, *, since: int = 0, limit: int = PAGE_RECORDS) -> list[dict[str, Any]]:
    """The job's records after `since`, oldest first: seq, kind, epoch, step, at and the metrics."""
    rows = (
        JobMetric.objects.filter(job_id=job_id, seq__gt=since)
        .order_by("seq")
        .values(*FIELDS, "values")[:limit]
    )
    return [_flat(row) for row in rows]


def metric_names(job_id: int) -> list[str]:
    """Every metric name of the job's records, in the order they first came."""
    names: dict[str, None] = {}
    for values in JobMetric.objects.filter(job_id=job_id).order_by("seq").values_list("values", flat=True):
        names.update(dict.fromkeys(values))
    return list(names)


def metrics_csv(job_id: int) -> Iterator[str]:
    """The records as CSV, a line at a time: the record's fields, then one column per metric name
    (the union over the job's records; empty where a record has none, or null)."""
    columns = [*FIELDS, *metric_names(job_id)]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore")

    def line(row: dict[str, Any]) -> str:
        writer.writerow(row)
        text = buffer.getvalue()
        buffer.seek(0)
        buffer.truncate()
        return text

    yield line(dict(zip(columns, columns, strict=True)))
    rows = JobMetric.objects.filter(job_id=job_id).order_by("seq").values(*FIELDS, "values")
    for row in rows.iterator(chunk_size=2000):
        record = _flat(row)
        record["at"] = record["at"].isoformat()
        yield line(record)


def metrics_csv_response(job: Job) -> StreamingHttpResponse:
    """The records as a CSV attachment, streamed (the page's download and the API's ?format=csv)."""
    # Piece by piece under ASGI too (portal.streaming): Django's own would read it whole first.
    response = SyncStreamingHttpResponse(metrics_csv(job.pk), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = content_disposition_header(
        as_attachment=True, filename=download_name(job.pk, job.name, "-metrics.csv")
    )
    response["Cache-Control"] = "no-store"
    return response


def job_card_usage(job: Job, *, now: datetime | None = None) -> dict[str, Any]:
    """The utilization and memory of the job's cards over its life, from the telemetry samples
    (one per card per TELEMETRY_HISTORY_SECONDS, kept TELEMETRY_RETENTION_HOURS). These are the
    cards' figures: on a shared card they include the other bookings' use."""
    if job.started_at is None:
        return {"started_at": None, "cards": []}
    until = job.finished_at or now or timezone.now()
    gpus = {gpu.uuid: gpu for gpu in GPU.objects.filter(uuid__in=job.gpu_uuids)}
    points: dict[str, list[dict[str, Any]]] = {uuid: [] for uuid in job.gpu_uuids}
    samples = (
        TelemetrySample.objects.filter(gpu_id__in=job.gpu_uuids, at__gte=job.started_at, at__lte=until)
        .order_by("at")
        .values_list("gpu_id", "at", "utilization_pct", "memory_used_mb")
    )
    for uuid, at, util, mem in samples:
        points[uuid].append({"at": at.isoformat(), "util": util, "mem": mem})
    cards = []
    for uuid in job.gpu_uuids:
        gpu = gpus.get(uuid)
        cards.append(
            {
                "uuid": uuid,
                "label": f"GPU {gpu.index}" if gpu else uuid,
                "memory_total_mb": gpu.memory_total_mb if gpu else None,
                "points": points[uuid],
            }
        )
    return {"started_at": job.started_at.isoformat(), "cards": cards}

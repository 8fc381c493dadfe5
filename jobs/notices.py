"""What a job's owner is told of it: a queued job's start after waiting, its end, an array's end
(issue 39; docs/notifications.md, "Jobs").

Told inside the transaction of the status change itself (`JOB_CHANGE_TOLD` in jobs/models.py,
given by JobsConfig.ready), wherever it is made: the supervisor, the spool's replay, the
reconciler's lost mark, a cancel. The inbox entry and its channel deliveries commit with the change
or not at all; the mail and the channel messages go once it commits (portal.notifications,
`transaction.on_commit`).

An end is told once. The job's `end_noticed_at` (an array's `noticed_at`) is claimed by a
conditional UPDATE in that transaction, so an end recorded again (a lost job's worker saying how it
really ended, a spool replayed after a database outage) finds it claimed and tells nothing. The
array's last task is found under a lock on the array's row: two tasks ending at once each count
the others' ends only after the other's transaction committed, so one of them sees the array done.
"""

from __future__ import annotations

import base64
import json
import logging
import re
from datetime import datetime, timedelta
from urllib.parse import quote, quote_plus

from django.conf import settings
from django.db import InterfaceError, OperationalError, transaction
from django.db.models import Max, Min, Q, Sum
from django.urls import reverse
from django.utils import timezone

from jobs.logs.store import STAMP
from jobs.models import Job, JobArray, LogChunk
from portal.models import Notification
from portal.notifications import job_notify_of, notification_send
from portal.timefmt import format_duration

log = logging.getLogger(__name__)
Status = Job.Status
Kind = Notification.Kind
# Which ends are told, and as what: a timed-out or lost job did not do its work either.
ENDS = {
    Status.SUCCEEDED: Kind.JOB_SUCCEEDED,
    Status.FAILED: Kind.JOB_FAILED,
    Status.TIMED_OUT: Kind.JOB_FAILED,
    Status.LOST: Kind.JOB_FAILED,
}
LOG_LINES = 10  # the end of its log: enough for a traceback's last frames, not a log in a chat room
LOG_TAIL_BYTES = 8192  # read from the log's end to find them
SECRET_MIN_LENGTH = 3  # an environment value this long is masked in the log's lines ("1" is no secret)
MASK = "****"
ARRAY_LISTED = 10  # an array's failed tasks named one by one, at most
# What a terminal acts on and does not show: colours and cursor moves (CSI), titles (OSC), the rest
# of ESC's two-character sequences, and backspaces (Keras's progress bar writes all of them). A
# title left unended ends with its line: else it hid every line after it.
_TERMINAL_CODES = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b\n]*(?:\x07|\x1b\\)?|[ -/]*[0-~])|\x08")


def job_change_notify(job_id: int, status: str) -> None:
    """A job's change just made (inside its transaction): tell its owner what they asked for.

    A notice can never cost the record of a start or an end: a bug in it, or a row the database
    refuses (IntegrityError, DataError: rolled back to its savepoint, the transaction is whole
    again), is logged, and the change commits without it. Only the database being away or
    busy (OperationalError, InterfaceError: a lost connection, a deadlock) goes up, and the
    change is retried as any would be. A change that tells nothing (STARTING, PENDING, QUEUED:
    the scheduler's and the launcher's) costs no query, not even the savepoint."""
    if status != Status.RUNNING and status not in ENDS and status != Status.CANCELLED:
        return
    try:
        with transaction.atomic():
            if status == Status.RUNNING:
                _started(job_id)
            else:
                _ended(job_id, status)
    except (OperationalError, InterfaceError):
        raise
    except Exception:
        log.exception("Job %s: its %s notice failed; the change is recorded without it", job_id, status)


# --- a start --------------------------------------------------------------------------------


def _started(job_id: int) -> None:
    """A queued job started: told when asked for ("start"). An array's, for its first task only."""
    job = Job.objects.select_related("owner", "server").get(pk=job_id)
    if not job.queued or not _wants(job, "start"):
        return
    ran = Q(started_at__isnull=False) & ~Q(pk=job_id) | Q(requeued_at__isnull=False)  # a task ran before
    if job.array_id and Job.objects.filter(ran, array_id=job.array_id).exists():
        return  # an array starts once, with its first task
    waited = _waited(job)
    waited = timezone.now() - _queued_at(job) if waited is None else waited
    what = f"Array {job.array_id}" if job.array_id else f"Job {job.pk}"
    notification_send(
        user=job.owner,
        kind=Kind.JOB_STARTED,
        subject=f"{what} ({job.name}) started on {_server(job)} after {_length(waited)}",
        body="\n".join(
            [
                f"{what} ({job.name}) started on {_server(job)}, cards {', '.join(job.gpu_uuids) or '?'}.",
                f"Script: {_script(job)}",
                f"Waited in the queue: {_length(waited)}{_since_preempted(job)}",
            ]
        ),
        url=_url(job),
        # A preempted job starts again: each start is its own. An array's first tasks starting
        # at once may each think itself the first: one key holds the mails and messages to one.
        key=f"array-start:{job.array_id}" if job.array_id else f"job-start:{job.pk}:{job.preemptions}",
    )


# --- an end ---------------------------------------------------------------------------------


def _ended(job_id: int, status: str) -> None:
    if not Job.objects.filter(pk=job_id, end_noticed_at=None).update(end_noticed_at=timezone.now()):
        return  # told already: this end was recorded again
    job = Job.objects.select_related("owner", "server").get(pk=job_id)
    if job.array_id is not None:
        _array_ended(job.array_id)
    elif status in ENDS and _wants(job, "end" if status == Status.SUCCEEDED else "fail"):
        _end_send(job)


def _end_send(job: Job) -> None:
    kind = ENDS[job.status]
    subject = f"Job {job.pk} ({job.name}) {_outcome(job)}"
    lines = [
        f"{subject}.",
        f"Script: {_script(job)}",
        f"Server: {_server(job)}",
        f"Ran: {_length(job.duration)}" + (f", after waiting {_length(_waited(job))}" if job.queued else ""),
        *(
            [f"Preempted: back in the queue {_times(job.preemptions)}; these are its last run's"]
            if job.requeued_at
            else []
        ),
        f"Exit code: {'none' if job.exit_code is None else job.exit_code}",
    ]
    if job.message:  # the supervisor's words may quote what the job was given
        lines.append(f"Why: {secrets_mask(job, job.message)}")
    if tail := log_tail(job):
        lines += ["", f"The last lines of its log (secrets of its environment masked as {MASK}):", tail]
    notification_send(
        user=job.owner,
        kind=kind,
        subject=subject,
        body="\n".join(lines),
        url=_url(job),
        # A job requeued after it was told lost ends again: that end's mail is no repeat.
        key=f"job-end:{job.pk}:{job.preemptions}",
    )


def _array_ended(array_id: int) -> None:
    """One of an array's tasks ended: the array is told once, when its last task has."""
    array = JobArray.objects.select_for_update(no_key=True).get(pk=array_id)  # see the module's docstring
    tasks = Job.objects.filter(array_id=array_id)
    if tasks.exclude(status__in=Job.FINISHED).exists() or array.noticed_at is not None:
        return
    if not JobArray.objects.filter(pk=array_id, noticed_at=None).update(noticed_at=timezone.now()):
        return
    counts = {status: tasks.filter(status=status).count() for status in Job.FINISHED}
    failed = counts[Status.FAILED] + counts[Status.TIMED_OUT] + counts[Status.LOST]
    if failed + counts[Status.SUCCEEDED] == 0:
        return  # every task cancelled: whoever cancelled them knows
    first = tasks.select_related("owner", "server").order_by("array_index").first()
    assert first is not None
    span = tasks.aggregate(start=Min("started_at"), end=Max("finished_at"), requeued=Sum("preemptions"))
    ran = span["end"] - span["start"] if span["start"] and span["end"] else None
    if not _wants(first, "fail" if failed else "end", ran=ran):
        return
    _array_send(array, first, counts, failed, ran, key=f"array-end:{array.pk}:{span['requeued'] or 0}")


def _array_send(
    array: JobArray, first: Job, counts: dict[str, int], failed: int, ran: timedelta | None, *, key: str
) -> None:
    """`key`: the array's, and how many times its tasks were requeued (a task told lost, then
    requeued by its worker, ends the array again: that end's mail is no repeat)."""
    words = [f"{counts[s]} {s.label.lower()}" for s in Job.FINISHED if counts[s]]
    subject = f"Array {array.pk} ({first.name}, {array.size} tasks) ended: {', '.join(words)}"
    lines = [
        f"{subject}.",
        f"Script: {_script(first)}",
        f"Ran: {_length(ran)}, from its first start to its last end",
    ]
    bad = Job.objects.filter(array=array, status__in=[s for s, k in ENDS.items() if k == Kind.JOB_FAILED])
    for task in bad.order_by("array_index")[:ARRAY_LISTED]:
        code = "" if task.exit_code is None else f", exit code {task.exit_code}"
        lines.append(f"Task {task.array_index} (job {task.pk}): {task.get_status_display().lower()}{code}")
    if failed > ARRAY_LISTED:
        lines.append(f"… and {failed - ARRAY_LISTED} more.")
    notification_send(
        user=first.owner,
        kind=Kind.JOB_FAILED if failed else Kind.JOB_SUCCEEDED,
        subject=subject,
        body="\n".join(lines),
        url=f"{reverse('my_jobs')}?array={array.pk}",
        key=key,
    )


# --- who wants what -------------------------------------------------------------------------


def _wants(job: Job, event: str, *, ran: timedelta | None = None) -> bool:
    """The job's own choice wins; else its owner's, where a success counts only for a job that
    ran JOB_END_NOTIFY_MIN_MINUTES or longer (the job that asks for "end" is told of any)."""
    if job.notify is not None:
        return event in job.notify
    if event not in job_notify_of(job.owner):
        return False
    if event != "end":
        return True
    if ran is None:  # a job that went back to the queue ran before its last run: its whole life counts
        ran = (job.finished_at or timezone.now()) - job.created_at if job.requeued_at else job.duration
    return ran is not None and ran >= timedelta(minutes=settings.JOB_END_NOTIFY_MIN_MINUTES)


# --- its words ------------------------------------------------------------------------------


def log_tail(job: Job, lines: int = LOG_LINES) -> str:
    """The last `lines` lines of the job's log, without their timestamps, each value of the job's
    own environment (an API key, a password) masked: a message may land in a shared chat room.

    Masked over the whole window read, before its last lines are taken: a secret split over two
    lines (a line of the portal's own came while the job's line was being drawn), or one of many
    lines (a key file), is masked whole. The window's first line is dropped, up to its first
    newline or carriage return, when the log goes on before it: it may begin inside a secret,
    whose end alone would not be masked. (A progress bar's line, stored whole however long an
    epoch draws it, keeps its redraws after that carriage return.)"""
    chunks = LogChunk.objects.filter(job_id=job.pk)
    # A worker stores a chunk per flush, often a line or two: as many as the window needs (their
    # sizes first, so a megabyte's chunk is never read for its last 8 KB's sake).
    wanted, first_start, size = [], 0, 0
    for pk, start, length in chunks.order_by("-seq").values_list("pk", "start", "size")[: lines + 1]:
        wanted.append(pk)
        first_start, size = start, size + length
        if size >= LOG_TAIL_BYTES:
            break
    if not wanted:
        return ""
    data = b"".join(
        bytes(chunk) for chunk in chunks.filter(pk__in=wanted).order_by("seq").values_list("data", flat=True)
    )
    cut = first_start > 0 or len(data) > LOG_TAIL_BYTES
    data = data[-LOG_TAIL_BYTES:]
    if cut:
        ends = [at for at in (data.find(b"\n"), data.find(b"\r")) if at >= 0]
        data = data[min(ends) + 1 :] if ends else b""
    # PostgreSQL refuses NUL in text: the notice's row would fail inside the end's transaction.
    text = STAMP.sub(b"", data).replace(b"\0", b"").decode("utf-8", errors="replace")
    # Masked before a redraw hides part of a secret; its lines as a terminal shows them (a
    # progress bar that redraws itself with \r is one line, not one a redraw).
    text = secrets_mask(job, _TERMINAL_CODES.sub("", text).rstrip("\n"))
    return "\n".join(_as_shown(line) for line in text.split("\n")[-lines:])


def _as_shown(line: str) -> str:
    """A line as a terminal leaves it: each carriage return starts writing over it again."""
    shown = ""
    for part in line.split("\r"):
        shown = part + shown[len(part) :]
    return shown.rstrip()


_SPLIT = r"(?:\n(?:\[portal\][^\n]*\n)*)?"  # where a value's halves may sit apart in the log
_PORTAL_LINE = re.compile(r"\[portal\][^\n]*")


def secrets_mask(job: Job, text: str) -> str:
    """`text` with each value of the job's environment masked, as written and in the forms a
    program prints it in (URL-encoded, in JSON, in base64 alone or inside a longer base64 such
    as an `Authorization: Basic` header), even where the log's writer broke it over two lines,
    or the portal's own lines came between its halves (a time limit's warning while the job's line
    was being drawn: jobs/logs/store.py). Values shorter than SECRET_MIN_LENGTH stay: masking "1"
    or "en" would mask every line."""
    forms: set[str] = set()
    for value in {str(v) for v in (job.env or {}).values()}:
        if len(value) >= SECRET_MIN_LENGTH:
            forms |= _forms(value)
    forms = {form for form in forms if len(form) >= SECRET_MIN_LENGTH}
    # Each form found on its own, a line break (and portal lines after it) allowed anywhere inside
    # it; the spans found are merged, so two values that overlap ("xab" in "xabcdef12") are masked
    # as one, whole.
    spans = sorted(
        (found.start(), found.end())
        for form in forms
        for found in re.finditer(_SPLIT.join(map(re.escape, form)), text)
    )
    masked, done = [], 0
    for start, end in spans:
        if start < done:  # overlaps the span before: it grows
            masked[-1] = (masked[-1][0], max(masked[-1][1], end))
        else:
            masked.append((start, end))
        done = max(done, end)
    pieces, at = [], 0
    for start, end in masked:  # the mask keeps the line breaks and portal lines: lines stay in place
        inside = text[start:end].split("\n")
        kept = [
            line if 0 < n < len(inside) - 1 and _PORTAL_LINE.fullmatch(line) else ""
            for n, line in enumerate(inside)
        ]
        pieces += [text[at:start], MASK + "\n".join(kept)]
        at = end
    return "".join(pieces) + text[at:]


def _forms(value: str) -> set[str]:
    forms = {value, quote(value, safe=""), quote(value), quote_plus(value), json.dumps(value)[1:-1]}
    forms |= {line for line in value.splitlines() if line.strip()}  # a key file's lines, each
    raw = value.encode()
    whole = base64.b64encode(raw).decode()
    forms |= {whole, whole.rstrip("="), base64.urlsafe_b64encode(raw).decode().rstrip("=")}
    for shift in range(3):  # where the value falls in a longer base64 text: its 3 alignments
        encoded = base64.b64encode(b"\0" * shift + raw).decode()
        # Only the characters that the value's bits alone decide, whatever comes before and after.
        core = encoded[-(-8 * shift // 6) : 8 * (shift + len(raw)) // 6]
        if len(core) >= 4:
            forms |= {core, core.replace("+", "-").replace("/", "_")}
    return forms


def _outcome(job: Job) -> str:
    if job.status == Status.SUCCEEDED:
        return "succeeded"
    if job.status == Status.FAILED:
        return f"failed (exit code {job.exit_code})" if job.exit_code is not None else "failed"
    return "timed out" if job.status == Status.TIMED_OUT else "was lost"


def _script(job: Job) -> str:
    return job.script_path or f"{job.name} (uploaded)"


def _server(job: Job) -> str:
    return job.server.name if job.server else "no server"


def _url(job: Job) -> str:
    return reverse("job_detail", args=[job.pk])


def _queued_at(job: Job) -> datetime:
    """Since when its run waited: its submission, or its last return to the queue (a preempted job
    waits again, and its earlier runs are no wait)."""
    return job.requeued_at or job.created_at


def _waited(job: Job) -> timedelta | None:
    return job.started_at - _queued_at(job) if job.started_at else None


def _since_preempted(job: Job) -> str:
    if not job.requeued_at:
        return ""
    submitted = _length(timezone.now() - job.created_at)
    return f" since its last run was preempted (submitted {submitted} ago)"


def _times(n: int) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"


def _length(span: timedelta | None) -> str:
    """1 h 05 min, 4 min 10 s, 12 s (portal.timefmt's); "not at all" for a job that never started."""
    return format_duration(span) if span is not None else "not at all"

"""Job submission: `job_submit` and its named steps. The web form and the API both call it.

Every rule is checked before anything is written; a refusal is a ServiceError naming
the field and the fix. Booked and queued jobs go through the same steps: where it runs
(`_place_on_booking`, or jobs.queue.requests.QueueRequest for the queue), what it runs
(`_check_program`), how TensorFlow is set up (`_check_tensorflow`), then the save.
Dispatch happens after commit (jobs.services.dispatch).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.utils import timezone

from gpus.booking import reservation_lock
from gpus.models import Allocation, ContainerImage, Reservation, Server, format_mb
from jobs import paths
from jobs.environment import RESERVED_ENV, RESERVED_PREFIXES
from jobs.images import image_check, image_named
from jobs.lending import loans_take_back
from jobs.models import Job, JobArray
from jobs.queue.requests import QueueRequest
from jobs.services import cpu_share, default_threads, dispatch
from jobs.slurm import slurm_booking_cluster, slurm_cluster_named, slurm_place, slurm_submit_check
from portal.changes import JOBS, change_publish
from portal.errors import Conflict, Errors, Forbidden, Invalid
from portal.notifications import job_notify_parse
from portal.timefmt import format_time
from portal.wakeups import QUEUE_SCHEDULER, wake_on_commit

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")  # \Z: `$` lets a final newline in
MAX_ENV_VARS = 50
MAX_ENV_VALUE = 4096
MAX_ARGS = 200
MAX_THREADS = 256
# Unquoted shell syntax: jobs never run through a shell, so these would reach the script
# as literal words, which is never what someone typing them meant.
_SHELL_OPERATORS = set("|&;<>()")


@dataclass(frozen=True)
class ScriptUpload:
    name: str
    content: bytes
    size: int | None = None  # the uploaded size, when only the first bytes were kept

    @classmethod
    def from_file(cls, upload: Any) -> ScriptUpload:
        """A form's or the API's uploaded file. jobs.uploads.CappedUploadHandler already kept
        at most one byte past the limit, and its size says how large the upload really was."""
        return cls(name=upload.name, content=upload.read(), size=upload.size)


# --- validation helpers ---------------------------------------------------------------


def parse_args(args: str | Sequence[str] | None) -> list[str]:
    """A command-line string (shlex) or a list of strings → the argv list after the script."""
    if args is None:
        return []
    if isinstance(args, str):
        try:
            parsed = shlex.split(args)
        except ValueError as exc:
            raise Invalid(f"Arguments: {exc}; close every quote you open.", field="args") from None
        syntax = _shell_syntax(args)
        if syntax:
            raise Invalid(
                f"Arguments: {syntax!r} is shell syntax, but jobs never run through a shell "
                "(no pipes, redirects, ';', '&&', $VARIABLES or `commands`). Put it in single quotes, "
                f"e.g. '{syntax}', to pass it to your script literally.",
                field="args",
            )
    else:
        if not all(isinstance(a, str) for a in args):
            raise Invalid("Arguments must be a list of strings.", field="args")
        parsed = list(args)
    if len(parsed) > MAX_ARGS:
        raise Invalid(f"{len(parsed)} arguments; keep it to {MAX_ARGS}.", field="args")
    if any("\x00" in a or len(a) > 4096 for a in parsed):
        raise Invalid("An argument is longer than 4096 characters or holds a NUL byte.", field="args")
    return parsed


def _shell_syntax(text: str) -> str:
    """The first character a shell would treat as syntax: unquoted |&;<>() or a $ or `
    outside single quotes (a shell expands those even in double quotes); '' if none."""
    quote = ""
    escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif quote == "'":
            quote = "" if char == "'" else quote
        elif char == "\\":
            escaped = True
        elif char in "$`":
            return char
        elif quote == '"':
            quote = "" if char == '"' else quote
        elif char in "'\"":
            quote = char
        elif char in _SHELL_OPERATORS:
            return char
    return ""


def parse_env(env: str | Mapping[str, Any] | None) -> dict[str, str]:
    """`NAME=value` lines (the form) or a mapping (the API) → checked extra variables."""
    if not env:
        return {}
    if isinstance(env, str):
        pairs: dict[str, str] = {}
        for number, line in enumerate(env.splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            name, sep, value = line.partition("=")
            if not sep:
                raise Invalid(f"Environment line {number}: write NAME=value.", field="env")
            pairs[name.strip()] = value
        env = pairs
    if not isinstance(env, Mapping):
        raise Invalid(
            'Environment: give an object of names to values, e.g. {"WANDB_MODE": "offline"}.', field="env"
        )
    if len(env) > MAX_ENV_VARS:
        raise Invalid(f"{len(env)} environment variables; keep it to {MAX_ENV_VARS}.", field="env")
    checked: dict[str, str] = {}
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            raise Invalid(
                f"Environment: {name!r} is not a variable name; use letters, digits and '_', "
                "not starting with a digit.",
                field="env",
            )
        if name in RESERVED_ENV or name.startswith(RESERVED_PREFIXES):
            raise Invalid(
                f"Environment: {name} is set by the portal from your booking and cannot be overridden; "
                "remove it (choose cards by booking them, memory and threads in the job's own settings).",
                field="env",
            )
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise Invalid(f"Environment: the value of {name} must be text.", field="env")
        value = str(value)
        if "\x00" in value:
            raise Invalid(f"Environment: the value of {name} holds a NUL character; remove it.", field="env")
        if len(value) > MAX_ENV_VALUE:
            raise Invalid(f"Environment: {name} is longer than {MAX_ENV_VALUE} characters.", field="env")
        checked[name] = value
    return checked


# --- the service ----------------------------------------------------------------------


def job_submit(
    *,
    user: AbstractBaseUser,
    reservation: Reservation | int | None = None,
    script: ScriptUpload | None = None,
    script_path: str = "",
    args: str | Sequence[str] | None = None,
    workdir: str = "",
    interpreter: str = "default",
    image: str | None = None,
    env: str | Mapping[str, Any] | None = None,
    time_limit_minutes: int | None = None,
    memory_mode: str | None = None,
    intra_op_threads: int | None = None,
    inter_op_threads: int | None = None,
    soft_placement: bool = True,
    log_placement: bool = False,
    mirrored: bool = False,
    gpu_count: int | None = None,
    memory_mb: int | None = None,
    server: str | None = None,
    array: str = "",
    nice: int = 0,
    begin_at: datetime | None = None,
    team: str | None = None,
    preemptible: bool = False,
    partition: str = "",
    notify: str | Sequence[str] | None = None,
    now: datetime | None = None,
) -> Job:
    """Run a job on a booking's server and cards (it starts when the booking does), or, without a
    booking, queue it for `gpu_count` cards (`memory_mb` each, or whole) for its time limit: the
    scheduler starts it when cards are free (jobs/queue/scheduler.py); or send it to a Slurm
    cluster (`_place`). An `array` ("0-99%8") queues one job per index; the first is returned. An
    `image` runs it in that container image (`_check_image`); `notify` is what its owner is told
    of it (jobs/notices.py).

    One path of named steps for every kind: where it runs, what it runs, how TensorFlow is set
    up, then the save. Raises a ServiceError (field and fix in the message) and writes nothing on
    bad input: every step before the save only reads.
    """
    now = now or timezone.now()
    ask = _Ask(gpu_count, memory_mb, server, time_limit_minutes, array, nice, begin_at, team, preemptible)

    def checked() -> tuple[_Place, dict[str, Any]]:
        errors = Errors()  # every bad field at once: where it runs, what it runs, TensorFlow's settings
        place = errors.check(_place, user, reservation, ask, partition, now)
        program = errors.check(_check_program, script, script_path, args, workdir, interpreter, env)
        chosen = errors.check(_check_image, image, place)
        told = errors.check(job_notify_parse, notify)
        threads = (intra_op_threads, inter_op_threads)
        tensorflow = errors.check(_check_tensorflow, place, memory_mode, mirrored, threads) if place else None
        errors.raise_any()
        assert place is not None and program is not None and tensorflow is not None
        fields = {"owner": user, "created_at": now, **place.fields, **program, **tensorflow, "image": chosen}
        fields |= {"soft_placement": soft_placement, "log_placement": log_placement, "notify": told}
        return place, fields

    asked = _asked_of_slurm(user, server, reservation, checked)
    # The checks again under the transaction that saves: what they read (bookings, quotas) may have
    # moved while Slurm answered; a Slurm cluster gives the same answer, so it is not asked twice,
    # unless what it would be asked moved too (an admin's partitions, a server made a cluster).
    with transaction.atomic():
        if reservation is not None:
            # First, in the booking services' order: a release committed between the checks and
            # the save left a job queued on a booking released early (PostgreSQL).
            reservation_lock(reservation)
        place, fields = checked()
        if place.slurm and _slurm_asked(place) != asked:
            raise Conflict(
                "Where the job would go changed while Slurm was asked about it (the cluster's "
                "partitions or nodes, or the booking); submit it again."
            )
        return _save(user, place, fields, now)


def _asked_of_slurm(
    user: AbstractBaseUser,
    server: str | None,
    reservation: Reservation | int | None,
    checked: Callable[[], tuple[_Place, dict[str, Any]]],
) -> tuple[object, ...] | None:
    """For a job that goes to a Slurm cluster, what only Slurm knows, asked once every check of
    the portal's passed (`checked`), and outside any transaction: Slurm may take seconds to
    answer, and a transaction open that long holds SQLite's one write lock (every booking and job
    of the portal waits) or a PostgreSQL one. What it was asked (`_slurm_asked`); None elsewhere."""
    if not (slurm_cluster_named(server) or slurm_booking_cluster(reservation)):
        return None
    place, _ = checked()
    slurm_submit_check(user=user, fields=place.fields)
    return _slurm_asked(place)


def _slurm_asked(place: _Place) -> tuple[object, ...]:
    """What Slurm is asked about a job (jobs.slurm.slurm_submit_check sends these)."""
    fields = place.fields
    booking = fields.get("reservation")
    return (
        fields["server"].pk,
        fields["gpu_count"],
        fields["time_limit_minutes"],
        fields["partition"],
        booking.pk if booking is not None else None,
    )


def _save(user: AbstractBaseUser, place: _Place, fields: dict[str, Any], now: datetime) -> Job:
    """The checked job saved where `_place` put it: queued, sent to Slurm, or on its booking."""
    if place.request is not None:
        return _save_queued(user, place.request, fields, now)
    job = Job(**fields)
    if place.slurm:  # Slurm schedules it: sent to the cluster's worker at once, one job of many
        job.not_before = now  # due now: the reconciler sends it again should this send be lost
        job.save()
        dispatch(job, now)
        change_publish(JOBS)  # the jobs' open pages show it
        return job
    _save_alone_on_booking(job)
    _start_on_booking(user, job, now)
    return job


@dataclass(frozen=True)
class _Ask:
    """What a job asks for beyond a booking: the queue's cards, server, time, array and order."""

    gpu_count: int | None
    memory_mb: int | None
    server: str | None
    time_limit_minutes: int | None
    array: str
    nice: int
    begin_at: datetime | None
    team: str | None
    preemptible: bool


def _place(
    user: AbstractBaseUser, reservation: Reservation | int | None, ask: _Ask, partition: str, now: datetime
) -> _Place:
    """Where the job runs: on the booking, or in the queue for the cards it asks for, or on a Slurm
    cluster (its `server`, or its booking's), for `gpu_count` GPUs in `partition` (jobs/slurm.py),
    through the cluster's worker. Only a queued job may be `preemptible`: stopped and requeued
    at its old place (jobs.preemption)."""
    cluster = slurm_cluster_named(ask.server) or slurm_booking_cluster(reservation)
    if cluster is not None:
        booking = _check_slurm_booking(user, reservation, cluster, now) if reservation is not None else None
        if ask.memory_mb is not None or ask.preemptible:
            raise Invalid(
                "Slurm gives whole cards and never preempts the portal's way: leave memory and "
                "preemptible empty on a Slurm cluster.",
                field="memory_mb" if ask.memory_mb is not None else "preemptible",
            )
        fields = slurm_place(
            user=user,
            server=cluster,
            gpu_count=ask.gpu_count,
            time_limit_minutes=ask.time_limit_minutes,
            partition=partition,
            team=ask.team,
            booking=booking,
            array=ask.array,
        )
        return _Place(fields, fields["gpu_count"], None, None, slurm=True)
    if partition:
        raise Invalid("A partition is a Slurm cluster's; name the cluster as the server.", field="partition")
    if reservation is None and ask.gpu_count is not None:
        request = QueueRequest.check(user=user, now=now, **asdict(ask))
        return _Place(request.job_fields(), request.gpu_count, request.memory_mb, None, request)
    if ask.preemptible and reservation is not None:
        raise Invalid(
            "Only a queued job can be preemptible: your booking's cards are yours, nobody takes them "
            "back. Leave the booking empty to queue it, or leave preemptible off.",
            field="preemptible",
        )
    if reservation is not None:  # what only a queued job asks for, refused as gpu_count and array are
        queued = {
            "server": ask.server,
            "memory_mb": ask.memory_mb,
            "begin_at": ask.begin_at,
            "nice": ask.nice,
            "team": ask.team,
        }
        if given := [name for name, value in queued.items() if value]:
            raise Invalid(
                f"{given[0]} is for a queued job; a booking already fixes where, when and for which team "
                f"it runs. Leave {given[0]} out, or leave the booking out to queue the job.",
                field=given[0],
            )
    return _place_on_booking(user, reservation, ask.gpu_count, ask.array, ask.time_limit_minutes, now)


@dataclass(frozen=True)
class _Place:
    """Where a job runs: on a booking's cards, known now, or in the queue, for cards found later."""

    fields: dict[str, Any]  # the Job fields that say where
    cards: int
    shared_mb: int | None  # memory per card; None: whole cards
    cpu_share: int | None  # None: known when the scheduler books its cards
    request: QueueRequest | None = None  # a queued job's checked request
    slurm: bool = False  # on a Slurm cluster, which places it (jobs/slurm.py)


def _place_on_booking(
    user: AbstractBaseUser,
    reservation: Reservation | int | None,
    gpu_count: int | None,
    array: str,
    time_limit_minutes: int | None,
    now: datetime,
) -> _Place:
    if gpu_count is not None or array:
        raise Invalid(
            "A job runs either on a booking or in the queue: give a booking, or cards (gpu_count) "
            "without one.",
            field="gpu_count" if gpu_count is not None else "array",
        )
    booking, allocations = _check_booking(user, reservation, now)
    _check_time_limit(time_limit_minutes, booking, now)
    server = allocations[0].gpu.server
    fields = {
        "reservation": booking,
        "team": booking.team,
        "server": server,
        "gpu_uuids": [a.gpu_id for a in allocations],
        "time_limit_minutes": time_limit_minutes,
        "not_before": booking.start,
    }
    return _Place(fields, len(allocations), allocations[0].memory_mb, cpu_share(server, allocations))


def _check_slurm_booking(
    user: AbstractBaseUser, reservation: Reservation | int, cluster: Server, now: datetime
) -> Reservation:
    """The user's booking of whole nodes of `cluster`, whose Slurm reservation the job goes in."""
    booking, allocations = _check_booking(user, reservation, now)
    if allocations[0].gpu.server_id != cluster.pk:
        raise Invalid(
            f"Booking {booking.pk} is on {allocations[0].gpu.server.name}, not on {cluster.name}; name "
            "its server, or leave the booking out.",
            field="reservation",
        )
    if booking.slurm_error:
        raise Invalid(f"Booking {booking.pk}: {booking.slurm_error}", field="reservation")
    return booking


def _check_program(
    script: ScriptUpload | None,
    script_path: str,
    args: str | Sequence[str] | None,
    workdir: str,
    interpreter: str,
    env: str | Mapping[str, Any] | None,
) -> dict[str, Any]:
    """What the job runs: its script, arguments, folder, Python and extra environment; every bad
    one of them at once."""
    errors = Errors()
    script_fields = errors.check(_check_script, script, script_path)
    checked = {
        "args": errors.check(parse_args, args),
        "workdir": errors.check(_check_workdir, workdir),
        "interpreter": errors.check(_check_interpreter, interpreter),
        "env": errors.check(parse_env, env),
    }
    errors.raise_any()
    name, path_text, source = script_fields
    return {"name": name[:200], "script_path": path_text, "script_source": source, **checked}


def _check_image(name: str | None, place: _Place | None) -> ContainerImage | None:
    """The container image of that name (None: on the host), runnable where the job runs: the
    booking's server, or the queued job's; a queued job without a server needs some server where
    it runs (the scheduler places it on such a server only: jobs.queue.scheduler._pending).
    `place` None (where it runs was refused, with its own message): only the name is checked."""
    if place is None:
        return image_named(name)
    server = place.fields.get("server") or (place.request.server if place.request else None)
    return image_check(name, server, fix="queue it on" if place.request else "book")


def _check_tensorflow(
    place: _Place, memory_mode: str | None, mirrored: bool, threads: tuple[int | None, int | None]
) -> dict[str, Any]:
    """TensorFlow's memory mode, MirroredStrategy and thread counts for where the job runs."""
    errors = Errors()
    mode = errors.check(_check_memory_mode, memory_mode, place.shared_mb)
    errors.check(_check_mirrored, mirrored, place.cards, queued=place.request is not None)
    counted = errors.check(_check_threads, *threads, place.cpu_share)
    errors.raise_any()
    intra, inter = counted
    return {
        "memory_mode": mode,
        "mirrored": mirrored,
        "intra_op_threads": intra,
        "inter_op_threads": inter,
    }


def _save_queued(user: AbstractBaseUser, request: QueueRequest, fields: dict[str, Any], now: datetime) -> Job:
    """A queued job, or an array of them, PENDING until the scheduler books its cards."""
    if request.indices is None:
        job = Job.objects.create(**fields)
    else:
        array = JobArray.objects.create(
            owner=user,
            spec=request.array_spec,
            size=len(request.indices),
            max_running=request.max_running,
            created_at=now,
        )
        tasks = Job.objects.bulk_create(Job(**fields, array=array, array_index=i) for i in request.indices)
        job = tasks[0] if tasks[0].pk else Job.objects.filter(array=array).order_by("pk").first()
    wake_on_commit(QUEUE_SCHEDULER)
    change_publish(JOBS)  # the queue's open pages show it
    return job


# --- job_submit's steps: each checks one part of the request and writes nothing ------------


def _check_booking(
    user: AbstractBaseUser, reservation: Reservation | int | None, now: datetime
) -> tuple[Reservation, list[Allocation]]:
    """The user's own active or upcoming booking, and its cards in index order, on a server
    that takes new jobs."""
    if reservation is None:
        raise Invalid(
            "Choose the booking the job runs on, or ask for cards (gpu_count) to queue it.",
            field="reservation",
        )
    pk = reservation if isinstance(reservation, int) else reservation.pk
    booking = Reservation.objects.restrict(user).select_related("team").filter(pk=pk).first()
    if booking is None:
        raise Invalid(
            f"There is no booking {pk} of yours; choose one from your reservations.", field="reservation"
        )
    if booking.owner_id != user.pk:
        raise Forbidden("Jobs run on your own bookings only; this one is someone else's.")
    status = booking.status_at(now)
    if status not in (Reservation.Status.UPCOMING, Reservation.Status.ACTIVE):
        raise Invalid(
            f"Booking {booking.pk} is {status.label.lower()}; run jobs on an active or upcoming booking.",
            field="reservation",
        )
    allocations = list(booking.allocations.select_related("gpu__server").order_by("gpu__index"))
    if not allocations:
        raise Invalid(f"Booking {booking.pk} holds no cards.", field="reservation")
    server = allocations[0].gpu.server
    if server.draining:
        raise Invalid(
            f"{server.name} is draining: no new jobs go there. Book another server.", field="reservation"
        )
    return booking, allocations


def _check_script(script: ScriptUpload | None, script_path: str) -> tuple[str, str, str]:
    """(name, path, source): an upload's name and source, or a .py path under the job roots."""
    given = bool(script_path and script_path.strip())
    if script and given:
        raise Invalid("Upload a .py script or give the path of one on the server, not both.", field="script")
    if not script and not given:
        raise Invalid("Upload a .py script, or give the path of one on the server.", field="script")
    if script:
        # Its own name, without folders a client sent: the worker writes it in the job's folder.
        name = script.name.rsplit("/", 1)[-1]
        paths.checked_file_name(name, field="script", what="script's file name")
        return name, "", _check_upload(script)
    path = paths.checked_path(script_path, field="script_path", what="script path")
    if path.suffix != ".py":
        raise Invalid(
            f"{path.name!r} is not a Python script; give the path of a .py file.", field="script_path"
        )
    return path.name, str(path), ""


def _check_upload(upload: ScriptUpload) -> str:
    """The uploaded script's source: a .py name, within JOB_UPLOAD_MAX_KB, UTF-8 text."""
    limit = settings.JOB_UPLOAD_MAX_KB * 1024
    if not upload.name.endswith(".py"):
        raise Invalid(f"{upload.name!r} is not a Python script; upload a .py file.", field="script")
    size = max(upload.size or 0, len(upload.content))
    if size > limit:
        raise Invalid(
            f"The script is {size / 1024:,.0f} KB; the limit is {settings.JOB_UPLOAD_MAX_KB} KB. "
            "Put large code under a job folder and give its path instead.",
            field="script",
        )
    try:
        source = upload.content.decode("utf-8")
    except UnicodeDecodeError:
        raise Invalid("The script is not UTF-8 text; upload a .py source file.", field="script") from None
    if "\x00" in source:
        raise Invalid("The script holds NUL bytes; upload a .py source file.", field="script")
    return source


def _check_workdir(workdir: str) -> str:
    """A folder under the job roots, or '' for the job's own folder."""
    if not workdir.strip():
        return ""
    return str(paths.checked_path(workdir, field="workdir", what="working directory"))


def _check_interpreter(name: str) -> str:
    """One of JOB_INTERPRETERS' names; empty means "default"."""
    name = (name or "default").strip()
    if name not in settings.JOB_INTERPRETERS:
        raise Invalid(
            f"Unknown Python environment {name!r}; choose one of {', '.join(settings.JOB_INTERPRETERS)}.",
            field="interpreter",
        )
    return name


def _check_time_limit(minutes: int | None, booking: Reservation, now: datetime) -> None:
    """None (until the booking ends), or at least a minute and no longer than the booking has left
    from the job's start."""
    if minutes is None:
        return
    if minutes < 1:
        raise Invalid(
            "The time limit must be at least 1 minute; leave it empty to run until the booking ends.",
            field="time_limit_minutes",
        )
    longest = int((booking.end - max(now, booking.start)).total_seconds() // 60)
    if minutes > longest:
        raise Invalid(
            f"The booking ends at {format_time(booking.end)}: the time limit can be at most "
            f"{longest} minutes. Extend the booking first for a longer run.",
            field="time_limit_minutes",
        )


def _check_memory_mode(memory_mode: str | None, shared_mb: int | None) -> str:
    """The TF memory mode, defaulting by booking: "limit" on a shared card, "all" on whole cards.
    "all" needs whole cards; a limit needs more memory than the CUDA context's headroom."""
    mode = memory_mode or (Job.MemoryMode.LIMIT if shared_mb else Job.MemoryMode.ALL)
    if mode not in Job.MemoryMode.values:
        raise Invalid(f"Memory mode must be one of {', '.join(Job.MemoryMode.values)}.", field="memory_mode")
    if mode == Job.MemoryMode.ALL and shared_mb:
        raise Invalid(
            "'TF default: take all' is for whole-card bookings; this booking shares the card "
            f"({format_mb(shared_mb)}). Choose 'limit to my booking' or 'grow as needed'.",
            field="memory_mode",
        )
    limited = mode in (Job.MemoryMode.LIMIT, Job.MemoryMode.LIMIT_GROW)
    if limited and shared_mb and shared_mb <= settings.GPU_CONTEXT_HEADROOM_MB:
        raise Invalid(
            f"{format_mb(shared_mb)} leaves nothing for TensorFlow after the "
            f"{settings.GPU_CONTEXT_HEADROOM_MB} MiB CUDA context headroom; book more memory or choose "
            "'grow as needed'.",
            field="memory_mode",
        )
    return mode


def _check_mirrored(mirrored: bool, cards: int, *, queued: bool) -> None:
    if mirrored and cards < 2:
        fix = "two or more cards; ask for more, or" if queued else "a booking of two or more cards;"
        raise Invalid(f"MirroredStrategy needs {fix} untick it.", field="mirrored")


def _check_threads(intra: int | None, inter: int | None, share: int | None) -> tuple[int | None, int | None]:
    """(intra-op, inter-op) threads: each as asked, 1 to MAX_THREADS, or the default for the
    booking's CPU `share` (None for a queued job: its default waits for its booking's share)."""
    intra, inter = _check_thread_counts(intra, inter)
    if share is None:
        return intra, inter
    intra_default, inter_default = default_threads(share)
    return intra or intra_default, inter or inter_default


def _check_thread_counts(intra: int | None, inter: int | None) -> tuple[int | None, int | None]:
    """Each thread count as asked, 1 to MAX_THREADS, or None for the default."""
    for value, field in ((intra, "intra_op_threads"), (inter, "inter_op_threads")):
        if value is not None and not 1 <= value <= MAX_THREADS:
            raise Invalid(
                f"Threads must be between 1 and {MAX_THREADS}; leave empty for the default.", field=field
            )
    return intra, inter


def _start_on_booking(user: AbstractBaseUser, job: Job, now: datetime) -> None:
    """A job on a booking that has started is sent at once; the owner comes first, so a job of the
    queue on their lent booking leaves it now (jobs/lending.py), and this one is sent as soon as
    it has left (jobs.services.dispatch waits for that; the pass its leaving wakes sends it)."""
    if job.not_before <= now:
        loans_take_back(booking=job.reservation_id, why=f"{user} started job {job.pk} on it", now=now)
        dispatch(job, now)


def _save_alone_on_booking(job: Job) -> None:
    """Save the job unless another is active on its booking: one job runs on a booking at a time
    (a database constraint settles two submits racing past the check)."""
    running = Job.objects.filter(reservation=job.reservation, status__in=Job.ACTIVE).first()
    if running:
        raise Conflict(
            f"Job {running.pk} ({running.name}) is still {running.get_status_display().lower()} on booking "
            f"{job.reservation.pk}; one job runs on a booking at a time. Wait for it or cancel it.",
        )
    try:
        with transaction.atomic():
            job.save()
    except IntegrityError:  # a concurrent submit on the same booking won the race
        raise Conflict(
            f"Another job was just submitted on booking {job.reservation.pk}; one job runs on a booking "
            "at a time."
        ) from None

"""Interactive work on a booking: `gpu exec` and `gpu shell` (jobs.models.InteractiveSession).

The `gpu` command runs on the booking's host, as the booking's owner, and asks here first:
`session_start` checks the booking (the caller's own, active now, on that host) and answers the
booking's environment, the same variables a job on it gets (jobs.environment.session_environment).
The command then starts in a session of its own and records its leader (`session_running`), which
is how the host's watchdog counts its GPU processes as the booking's. Every SESSION_BEAT_SECONDS it
beats (`session_beat`): the answer is the booking's end as it stands now (extended, released) and
whether someone ended the session from the portal; the command stops itself at that end, with a
warning SESSION_WARN_MINUTES before it in the terminal and the inbox. `session_finish` records its
end and why; a session whose beats stopped (its `gpu` was killed, its host died) is ended by
the reconciler (jobs.runs.runs_lost_mark), and from then on its processes are no longer the booking's.

The host given is the caller's word: it only keeps a mistake (the environment of cards on another
host) from happening. It grants nothing: the variables name the caller's own booking, and the
watchdog judges what runs on the cards, whatever the command claims.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models.functions import Now
from django.template import Context
from django.utils import timezone

from gpus.booking import reservation_lock
from gpus.hooks import Work
from gpus.images import runnable_text
from gpus.models import Allocation, ContainerImage, Reservation, Server
from jobs.environment import BookedCard, JobSetupError, session_environment
from jobs.images import image_check
from jobs.lending import loans_take_back
from jobs.models import InteractiveSession, Job
from jobs.runs import LOST_FOUND_ALIVE, session_is_lost, session_lost_stop
from jobs.sending import HostSender
from jobs.sessions.notices import session_stopped_tell, session_warn_ending
from jobs.tasks import run_session
from portal.access import can_manage
from portal.clock import db_now
from portal.errors import Forbidden, Invalid
from portal.timefmt import format_time

log = logging.getLogger(__name__)

COMMAND_MAX_ARGS = 1000
COMMAND_MAX_CHARS = 64 * 1024
MESSAGE_MAX = 500


def host_matches(server: Server, host: str) -> bool:
    """The host a command runs on is the server's: its portal name or its hostname, fully
    qualified or not, in any case."""
    host = host.strip().lower()
    if not host:
        return False
    names = {server.name.lower(), server.hostname.strip().lower()} - {""}
    short = host.split(".", 1)[0]
    return host in names or short in {name.split(".", 1)[0] for name in names}


@transaction.atomic
def session_start(
    *,
    user: AbstractBaseUser,
    reservation: int | None = None,
    kind: str,
    host: str = "",
    command: Sequence[str] = (),
    image: str | None = None,
    now: datetime | None = None,
) -> tuple[InteractiveSession, dict[str, str]]:
    """A new session (STARTING) on the caller's booking active now on `host`, and its environment.
    A JupyterLab session may run in a container `image` (by name) that its server can run.

    Refused, naming the field: an unknown kind, an empty or huge command, no booking of the
    caller's on that host now (or several, without `reservation`), a booking that is not active,
    or one on another host; an image for a terminal session, or one its server cannot run.
    Someone else's booking: Forbidden."""
    now = now or timezone.now()
    if kind not in InteractiveSession.Kind.values:
        raise Invalid(f"Kind must be one of {', '.join(InteractiveSession.Kind.values)}.", field="kind")
    lab = kind == InteractiveSession.Kind.JUPYTERLAB
    argv = LAB_COMMAND if lab else _check_command(command)
    if not lab and (not host or not host.strip()):
        raise Invalid("Say which host the command runs on (its hostname).", field="host")
    booking, allocations = _booking_on_host(user, reservation, None if lab else host.strip(), now, kind)
    if lab and (open_lab := active_lab(booking.pk)) is not None:
        raise Invalid(
            f"Booking {booking.pk} already has JupyterLab session {open_lab.pk} "
            f"({open_lab.get_status_display().lower()}): open that one, or end it first.",
            field="reservation",
        )
    server = allocations[0].gpu.server
    chosen = _check_image(image, lab=lab, server=server)
    session = InteractiveSession.objects.create(
        owner=user,
        reservation=booking,
        server=server,
        kind=kind,
        command=argv,
        gpu_uuids=[a.gpu_id for a in allocations],
        created_at=now,
        beat_at=Now(),  # every beat and its cut-off: the database's clock (portal.clock)
        token=secrets.token_urlsafe(32) if lab else "",
        image=chosen,
    )
    try:
        env = session_environment(
            session,
            BookedCard.of(allocations[0]),
            server=server.name,
            instance=settings.PORTAL_INSTANCE_ID,
            headroom_mb=settings.GPU_CONTEXT_HEADROOM_MB,
        )
    except JobSetupError as exc:
        raise Invalid(str(exc), field="reservation") from None
    if lab:
        if server.draining:
            raise Invalid(f"{server.name} is draining: no new sessions start there.", field="reservation")
        transaction.on_commit(partial(_send, session.pk, server.queue))
    return _owner_back(session, now), env


def _owner_back(session: InteractiveSession, now: datetime) -> InteractiveSession:
    """The owner comes first: a job of the queue on their lent booking leaves it now."""
    why = f"{session.owner} started {session.get_kind_display()} on it"
    loans_take_back(booking=session.reservation_id, why=why, now=now)
    return session


LAB_COMMAND = ["jupyter", "lab"]
LAB_RESEND_SECONDS = 30  # a lab no worker took this long after its message: sent again
_send = HostSender(run_session, "session", log)  # after a failure the reconciler sends it again (labs_resend)


def _check_image(image: str | None, *, lab: bool, server: Server) -> ContainerImage | None:
    """The container image a JupyterLab opens in: one its server can run (jobs.images.image_check)
    that an admin marked as having JupyterLab (ContainerImage.objects.for_labs). No image for a
    terminal session: it runs in the caller's own shell. Refused here, naming `image` and the
    images that would do, before anything is written, so the page and the API never offer what
    the host would fail."""
    if not image:
        return None
    if not lab:
        raise Invalid("An image is for jobs and labs: gpu exec and gpu shell run on the host.", field="image")
    chosen = image_check(image, server, fix="open JupyterLab on a booking of", labs=True)
    assert chosen is not None
    if not chosen.has_jupyterlab:
        labs = runnable_text(ContainerImage.objects.for_labs(server).prefetch_related("servers"))
        raise Invalid(
            f"Image {chosen.name} has no JupyterLab (only jobs run in it); choose one of {labs},"
            " or open JupyterLab without an image (on the host).",
            field="image",
        )
    return chosen


def _check_command(command: Sequence[str]) -> list[str]:
    if isinstance(command, str) or not all(isinstance(arg, str) for arg in command):
        raise Invalid("Give the command as a list of strings (its argv).", field="command")
    argv = list(command)
    if not argv or not argv[0]:
        raise Invalid("Give the command to run, e.g. ['python', 'train.py'].", field="command")
    if len(argv) > COMMAND_MAX_ARGS or sum(len(arg) for arg in argv) > COMMAND_MAX_CHARS:
        raise Invalid(
            f"The command is too long to record (at most {COMMAND_MAX_ARGS} arguments, "
            f"{COMMAND_MAX_CHARS // 1024} KiB).",
            field="command",
        )
    if any("\x00" in arg for arg in argv):
        raise Invalid("The command holds a NUL character, which no argv can.", field="command")
    return argv


def _booking_on_host(
    user: AbstractBaseUser, reservation: int | None, host: str | None, now: datetime, kind: str
) -> tuple[Reservation, list[Allocation]]:
    """The caller's booking active now, with its cards in index order, on `host` (None: any);
    `kind`, the session's, for how a refusal says to run it elsewhere."""
    if reservation is None:
        mine = Reservation.objects.filter(owner=user).with_status("active", now)
        if host is not None:
            mine = mine.filter(allocations__gpu__server__in=_servers_named(host))
        mine = mine.distinct().order_by("pk")
        host = host or "any server"
        found = list(mine.values_list("pk", flat=True)[:10])
        if not found:
            raise _none_on_host(user, host, now, kind)
        if len(found) > 1:
            listed = ", ".join(f"#{pk}" for pk in found)
            raise Invalid(
                f"You have several bookings active on {host} ({listed}): choose one with --reservation N.",
                field="reservation",
            )
        reservation = found[0]
    # Its row locked before it is read, as the booking services lock it (gpus.booking): a release
    # or a cancel at the same moment either waits or is read here, and two starts of a lab on it
    # (a double click) take turns, so the second sees the first's lab (`active_lab`).
    reservation_lock(reservation)
    booking = Reservation.objects.restrict(user).filter(pk=reservation).first()
    if booking is None:
        raise Invalid(
            f"There is no booking {reservation} of yours; see `gpu reservations`.", field="reservation"
        )
    if booking.owner_id != user.pk:
        raise Forbidden("Interactive work runs on your own bookings only; this one is someone else's.")
    status = booking.status_at(now)
    if status != Reservation.Status.ACTIVE:
        when = (
            f" (it starts at {format_time(booking.start)})" if status == Reservation.Status.UPCOMING else ""
        )
        raise Invalid(
            f"Booking {booking.pk} is {status.label.lower()}{when}; gpu exec runs within a booking's "
            "window only.",
            field="reservation",
        )
    allocations = list(booking.allocations.select_related("gpu__server").order_by("gpu__index"))
    if not allocations:
        raise Invalid(f"Booking {booking.pk} holds no cards.", field="reservation")
    server = allocations[0].gpu.server
    _check_not_slurm(booking, server)
    if host is not None and not host_matches(server, host):
        raise Invalid(
            f"Booking {booking.pk} is on {server.name}{_hostname(server)}, not on {host}: "
            f"{_how_to_run_on(server, kind)}",
            field="host",
        )
    return booking, allocations


def _check_not_slurm(booking: Reservation, server: Server) -> None:
    """A session would run on the cluster's login node, and the booking's cards are on Slurm's."""
    if server.kind == Server.Kind.SLURM:
        raise Invalid(
            f"Booking {booking.pk} holds nodes of {server.name}, a Slurm cluster: work runs there as a "
            f"Slurm job (gpu run --server {server.name} --reservation {booking.pk}), not in a session.",
            field="reservation",
        )


def _servers_named(host: str) -> list[int]:
    return [server.pk for server in Server.objects.all() if host_matches(server, host)]


def _none_on_host(user: AbstractBaseUser, host: str, now: datetime, kind: str) -> Invalid:
    """No booking of the caller's active on `host`: where their first active one is, and how to
    run there (on `make run`'s simulated inventory, the only way a newcomer learns GPU_SERVER)."""
    elsewhere = (
        Allocation.objects.filter(
            reservation__in=Reservation.objects.filter(owner=user).with_status("active", now)
        )
        .select_related("gpu__server")
        .order_by("reservation_id", "gpu__index")
        .first()
    )
    if elsewhere is None:
        return Invalid(f"You have no booking active now on {host}. Book a card on it.", field="reservation")
    server = elsewhere.gpu.server
    return Invalid(
        f"You have no booking active now on {host}; your booking {elsewhere.reservation_id} is on "
        f"{server.name}{_hostname(server)}: {_how_to_run_on(server, kind)}",
        field="reservation",
    )


def _how_to_run_on(server: Server, kind: str) -> str:
    """How to run it on `server` after all. A simulated server (`make run`'s inventory) has no
    machine of its own: its work runs on the portal's, whose hostname the portal does not know it
    by. A real one may be this machine under another name. Either way GPU_SERVER
    (gpu_cli.interactive.HOST_ENV) names it, which a newcomer cannot guess from "run it there"."""
    typed = "gpu shell" if kind == InteractiveSession.Kind.SHELL else "gpu exec …"
    named = f"`GPU_SERVER={server.name} {typed}`"
    if server.simulated:
        return f"{server.name} is simulated, with no machine of its own: run {named} on the portal's machine."
    return (
        f"run the command on {server.name}, or, where this machine is {server.name} under another name, "
        f"{named}."
    )


def _hostname(server: Server) -> str:
    return f" ({server.hostname})" if server.hostname and server.hostname != server.name else ""


@transaction.atomic
def session_running(*, session: InteractiveSession, pid: Any, pid_started: Any) -> InteractiveSession:
    """STARTING → RUNNING: the command's session leader, whose session id the watchdog reads."""
    _terminal_only(session)
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
        raise Invalid("pid must be the command's process id (an integer above 1).", field="pid")
    if pid_started is not None and (
        isinstance(pid_started, bool) or not isinstance(pid_started, int | float)
    ):
        raise Invalid(
            "pid_started must be the process's start time in epoch seconds, or null.", field="pid_started"
        )
    now = timezone.now()
    updated = InteractiveSession.objects.transition(
        session.pk,
        from_=InteractiveSession.Status.STARTING,
        to=InteractiveSession.Status.RUNNING,
        pid=pid,
        pid_started=pid_started,
        started_at=now,
        beat_at=Now(),
    )
    if not updated:
        session.refresh_from_db()
        raise Invalid(
            f"Session {session.pk} is {session.get_status_display().lower()}, not starting.", field="pid"
        )
    session.refresh_from_db()
    return session


def session_beat(*, session: InteractiveSession, now: datetime | None = None) -> dict[str, Any]:
    """The command is alive: what it must know now (the booking's end, whether to stop). The first
    beat within SESSION_WARN_MINUTES of the end also tells the owner's inbox."""
    _terminal_only(session)
    now = now or timezone.now()
    if session_is_lost(session) and session.end_requested_at is None:
        # Marked lost, yet its command beats: a lost run is stopped, never taken back (jobs.runs).
        # The answer below tells `gpu` to end it; the stop is told once, by the first such beat.
        session_lost_stop(session, lambda: session_stopped_tell(session, LOST_FOUND_ALIVE))
        session.refresh_from_db()
    # The database's clock, as the reconciler's cut-off (portal.clock): this web server's may be off.
    active = InteractiveSession.objects.filter(pk=session.pk, status__in=InteractiveSession.ACTIVE)
    active.update(beat_at=Now())
    ends_at, warn_at = session_times(session)
    if session.is_active and now >= warn_at and session.warned_at is None:
        session_warn_ending(session, ends_at, now)
    # Judged by the database's clock, as the lost cut-off is: a web server's clock may be off, and
    # `gpu` keeps to an end once asked (one ahead would stop its command before the booking ends).
    # Asked from the warning on by this server's clock: one query less for every other beat.
    asked = session.end_requested_at
    db = db_now() if session.is_active and (now >= warn_at or asked) else None
    over = db is not None and db >= ends_at
    # The end `gpu` had to keep: the booking's, or an end asked on the portal before it.
    if asked is not None and asked < ends_at:
        due, what = asked, f"it was ended from the portal at {format_time(asked)}"
    else:
        due, what = ends_at, f"its booking ended at {format_time(ends_at)}"
    if db is not None and db >= due + overrun_allowed():
        session = _overrun_end(session, what)
    message = ""
    if session.end_requested_at:
        message = "the session was ended from the portal"
    elif session.is_active and over:
        message = f"its booking ended at {format_time(ends_at)}"
    elif not session.is_active:
        message = session.message or f"the session is {session.get_status_display().lower()}"
    return {
        "status": session.status,
        "ends_at": ends_at,
        "warn_at": warn_at,
        "end_requested": bool(session.end_requested_at) or not session.is_active or over,
        "message": message,
    }


def overrun_allowed() -> timedelta:
    """How long past its booking's end a session may still beat: `gpu` stops its command at the end,
    SIGKILL after the grace, and says so at its next beat at the latest."""
    return timedelta(seconds=settings.JOB_KILL_GRACE_SECONDS + settings.SESSION_LOST_AFTER_SECONDS)


def _overrun_end(session: InteractiveSession, what: str) -> InteractiveSession:
    """A `gpu` that beats on long after its end (its booking's, or one asked on the portal: an old
    or changed client that ignores it): the session is ended on its row, told to its owner and
    the audit log. What it left running on the cards is the watchdog's to judge as any process."""
    why = (
        f"{what} and gpu on {session.server.name} had not ended it "
        f"{int(overrun_allowed().total_seconds())} s later; processes it left on the cards are judged "
        "as anyone's"
    )
    InteractiveSession.objects.transition(
        session.pk,
        from_=InteractiveSession.ACTIVE,
        to=InteractiveSession.Status.ENDED,
        told=lambda: session_stopped_tell(session, why),
        finished_at=timezone.now(),
        message=f"Ended: {why}."[:MESSAGE_MAX],
    )
    session.refresh_from_db()
    return session


def session_times(session: InteractiveSession) -> tuple[datetime, datetime]:
    """When the session must end (its booking's end as it stands) and when it is warned."""
    booking = session.reservation
    # Released early: `end` moved to the release; cancelled: it holds nothing from the cancel on.
    ends_at = min(booking.end, booking.cancelled_at) if booking.cancelled_at else booking.end
    return ends_at, ends_at - timedelta(minutes=settings.SESSION_WARN_MINUTES)


def _terminal_only(session: InteractiveSession) -> None:
    """A pid, a beat and an end come from `gpu` in a terminal; a lab's from its worker alone (a pid
    named by its owner would be the one the worker ends)."""
    if session.kind not in InteractiveSession.TERMINAL_KINDS:
        raise Invalid(
            f"Session {session.pk} is a {session.get_kind_display()}, which its host's worker runs: "
            "end it with DELETE.",
            field="kind",
        )


@transaction.atomic
def session_finish(
    *, session: InteractiveSession, exit_code: Any, message: Any, now: datetime | None = None
) -> InteractiveSession:
    """The command ended: ENDED (FAILED if it never ran), with its exit code and, where `gpu`
    stopped it, why: that stop is told to the inbox and the audit log as well. Once only."""
    now = now or timezone.now()
    if exit_code is not None and (isinstance(exit_code, bool) or not isinstance(exit_code, int)):
        raise Invalid(
            "exit_code must be an integer, or null where the command did not run.", field="exit_code"
        )
    if not isinstance(message, str):
        raise Invalid("message must be text (why the command was stopped, or empty).", field="message")
    _terminal_only(session)
    status = InteractiveSession.Status.ENDED if session.pid else InteractiveSession.Status.FAILED
    message = " ".join(message.split())[:MESSAGE_MAX]
    if not InteractiveSession.objects.transition(
        session.pk,
        from_=InteractiveSession.ACTIVE,
        to=status,
        finished_at=now,
        exit_code=exit_code,
        message=message,
    ):
        return session  # already ended (lost, or a repeated finish): the first word stands
    session.refresh_from_db()
    if message and status == InteractiveSession.Status.ENDED:
        session_stopped_tell(session, f"gpu on {session.server.name} reports: {message}", reported=True)
    return session


def active_lab(reservation_id: int) -> InteractiveSession | None:
    """The booking's JupyterLab that is starting or running: one a booking (it holds a worker slot
    on the host, and opens as many notebooks and kernels as its owner likes)."""
    return (
        InteractiveSession.objects.filter(
            reservation_id=reservation_id,
            kind=InteractiveSession.Kind.JUPYTERLAB,
            status__in=InteractiveSession.ACTIVE,
        )
        .order_by("pk")
        .first()
    )


@transaction.atomic
def session_end_request(*, session: InteractiveSession, by: AbstractBaseUser) -> InteractiveSession:
    """Ended from the portal (DELETE, the End button): `gpu` sees it at its next beat and stops the
    command; a lab's supervisor within a second."""
    InteractiveSession.objects.filter(
        pk=session.pk, status__in=InteractiveSession.ACTIVE, end_requested_at=None
    ).update(end_requested_at=Now(), end_requested_by=by)
    session.refresh_from_db()
    return session


def labs_resend(*, now: datetime | None = None) -> None:
    """The labs still waiting for a worker LAB_RESEND_SECONDS after their message, sent again (a
    lost message; the claim makes a second one harmless)."""
    now = now or timezone.now()
    untaken = InteractiveSession.objects.filter(
        kind=InteractiveSession.Kind.JUPYTERLAB,
        status=InteractiveSession.Status.STARTING,
        worker="",
        created_at__lt=now - timedelta(seconds=LAB_RESEND_SECONDS),
        created_at__gte=now - timedelta(seconds=settings.SESSION_LOST_AFTER_SECONDS),
    )
    for pk, queue in untaken.values_list("pk", "server__name"):
        _send(pk, f"host.{queue}")


def booking_sessions_context(context: Context) -> dict[str, Any]:
    """The booking page's sessions (portal.hooks.RESERVATION_SESSIONS): those of its booking `r`
    that the viewer may see (its owner, its team's leaders, admins), newest first."""
    booking, viewer = context["r"], context["request"].user
    rows = InteractiveSession.objects.restrict(viewer).filter(reservation=booking).select_related("server")
    jobs = Job.objects.filter(reservation=booking).order_by("-created_at")
    if not (viewer.pk == booking.owner_id or can_manage(viewer, booking)):
        jobs = jobs.none()  # a teammate sees the booking, not what runs on it (as Job.objects.restrict)
    return {"sessions": list(rows[:50]), "booking_jobs": list(jobs[:50])}


def lab_images_context(context: Context) -> dict[str, Any]:
    """The Run buttons' (portal.hooks.RESERVATION_ACTIONS) images for "Open JupyterLab" on an
    active booking `r`: those its server can open a lab in (ContainerImage.objects.for_labs, the
    rule `_check_image` applies). The images are read once per page (a list has a button a row);
    the booking's server from its allocations (prefetched on lists)."""
    booking = context.get("r")
    if booking is None or booking.status != Reservation.Status.ACTIVE:
        return {"lab_images": []}
    allocations = list(booking.allocations.all())
    if not allocations:
        return {"lab_images": []}
    request = context.get("request")
    images = getattr(request, "_lab_images", None)
    if images is None:
        images = list(ContainerImage.objects.for_labs().prefetch_related("servers"))
        if request is not None:
            request._lab_images = images
    server_id = allocations[0].gpu.server_id
    return {
        "lab_images": [
            i for i in images if any(s.pk == server_id and s.containers_ok for s in i.servers.all())
        ]
    }


def sessions_by_session(sessions: Mapping[int, Iterable[int]]) -> dict[tuple[int, int], int]:
    """{(server id, session id): interactive session id} for the running sessions' processes (the
    dashboard's "session N", gpus.hooks): a command's session, or one of a lab's kernels'. Shown
    only: the watchdog proves the owner besides (jobs.watchdog.rules.SessionFacts)."""
    wanted = {(server, sid) for server, sids in sessions.items() for sid in sids}
    rows = InteractiveSession.objects.filter(
        status=InteractiveSession.Status.RUNNING, server_id__in=list(sessions), pid__isnull=False
    ).values_list("server_id", "pid", "kernels", "pk")
    found = {}
    for server, pid, kernels, pk in rows:
        for sid in [pid, *(int(k) for k, _ in kernels)]:
            if (server, sid) in wanted:
                found[(server, sid)] = pk
    return found


def work_on(reservation_id: int) -> list[Work]:
    """What runs on the booking now (gpus.hooks.work_on_booking): its jobs that a worker has or
    will have, and its open sessions; what a release or a cancel would stop."""
    jobs = Job.objects.filter(
        reservation_id=reservation_id, status__in=(Job.Status.QUEUED, Job.Status.STARTING, Job.Status.RUNNING)
    ).values_list("pk", "name", "status")
    sessions = InteractiveSession.objects.filter(
        reservation_id=reservation_id, status__in=InteractiveSession.ACTIVE
    ).values_list("pk", "kind", "status")
    kinds = dict(InteractiveSession.Kind.choices)
    return [
        *(
            Work(f"job {pk} ({name}), {status}", f"/jobs/{pk}/", waiting=status == Job.Status.QUEUED)
            for pk, name, status in jobs
        ),
        *(Work(f"{kinds[kind]} session {pk}, {status}", f"/sessions/{pk}/") for pk, kind, status in sessions),
    ]

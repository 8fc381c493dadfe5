"""JupyterLab sessions on a booking's host: the worker's side (jobs.models.InteractiveSession,
kind "jupyterlab"; the portal's proxy is jobs.sessions.lab_proxy).

`session_start` (jobs.sessions.services) writes the row (STARTING, with a random token) and sends its id
to the booking's host queue once committed; `lab_run` there claims it (a conditional UPDATE on
`worker`, so a message delivered twice starts one lab) and starts JupyterLab as a job is started
(the executor `executor_for` gives, jobs/host/executors: a session of its own, JOB_USER's account, no
privileges, SIGKILLed with the worker) in the booking's environment (the cards by UUID, every framework's
memory caps: jobs.environment.session_environment). The token reaches the server through its
environment (JUPYTER_TOKEN), never its command line, which every user can read; the browser never
sees it (the proxy adds it). The server serves the base URL /sessions/<id>/lab/, the path the
portal serves it at. A session with an image runs in a container of it (the Podman executor; what
differs is jobs/host/lab_image.py's: the image pulled first, the socket passed in as fd 3).

A GPU host is shared with people who have shells, and any of them can listen on a free port. So
the lab's address is never a port picked and published first: the worker binds and listens on
SESSION_BIND_ADDRESS (the kernel picks the port) before the lab's process exists, hands it that
socket alone (an inherited fd, PORTAL_LAB_LISTEN_FD) and closes its own copy; the lab's launcher
(jobs/host/jupyter/lab_launcher.py) has Jupyter serve on it and never binds a port itself. Nothing
else can listen at that address while the socket lives. Readiness is asked without the token
(Jupyter's `GET <base>api`); then `listener_proof` checks that the socket listening at the
address is the one the worker made and that the lab's own process holds it. Only then does the
row turn RUNNING with the address, and the token goes only over connections checked the same way.
A lab whose listener is not proved (or whose launcher refused the socket) ends FAILED saying why,
told to its owner and the audit log (jobs.sessions.notices.lab_start_refused_tell).

Once RUNNING, every TICK_SECONDS this supervisor (the Celery task, holding a pool slot as a job
does) reads the row and ends the lab:
- when someone ends the session (DELETE, the End button);
- when the booking ends (its owner warned SESSION_WARN_MINUTES before, in the inbox);
- after SESSION_IDLE_MINUTES without kernel or terminal activity (no kernel busy, none active since);
- when the server exits by itself.
Its kernels run in sessions of their own (jupyter_client starts each with start_new_session),
so they are recorded on the row (`kernels`, each by pid and start) as they come: the watchdog
counts them as the booking's, and the end reaches them by identity, also after the worker
died (`lab_orphans_end`, when the host's worker starts). Every stop that was not the owner's own
request is said in the inbox and the audit log (jobs.sessions.notices.session_stopped_tell).
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import logging
import os
import pwd
import signal
import socket
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path

import psutil
from django.conf import settings
from django.db import DatabaseError, close_old_connections
from django.db.models import Q
from django.db.models.functions import Now
from django.utils import timezone

from gpus.booking_ends import ended_early_of
from gpus.models import Reservation
from jobs.environment import INHERITED_ENV, BookedCard, JobSetupError, activation, session_environment
from jobs.host.containers import ContainerError, last_line, podman
from jobs.host.dcgm import session_name, work_ended, work_started
from jobs.host.executors import Run, RunOutput, RunSpec, executor_for
from jobs.host.executors.podman import Podman
from jobs.host.lab_image import in_image, lab_image, lab_image_env, lab_image_ready
from jobs.host.lab_listener import Listener, listen, listener_proof, listening_at
from jobs.host.launch import LAUNCHER, account_of
from jobs.host.spool import worker_stopping
from jobs.models import InteractiveSession, lab_path
from jobs.runs import LOST_FOUND_ALIVE, session_is_lost, session_lost_stop
from jobs.sessions.notices import lab_start_refused_tell, session_stopped_tell, session_warn_ending
from portal.accounts import JOB_USER_OWNER
from portal.pids import ProcessId, Sent, send, session_members
from portal.timefmt import format_time

log = logging.getLogger(__name__)

TICK_SECONDS = 1.0
KERNEL_CHECK_SECONDS = 5.0  # kernels recorded, and their activity read, this often
READY_POLL_SECONDS = 0.2
OUTPUT_LINES = 40  # the server's last lines, kept for the message of a lab that failed to start
Session = InteractiveSession.Status
KERNELS = Path(__file__).resolve().parent / "jupyter"  # kernels/python3: the portal's kernel spec
LAB_LAUNCHER = KERNELS / "lab_launcher.py"  # run by the job's interpreter: standard library only
LISTEN_FD_ENV = "PORTAL_LAB_LISTEN_FD"  # the launcher's LISTEN_FD_ENV
LISTENER_REFUSED_EXIT_CODE = 3  # the launcher's REFUSED_EXIT_CODE: no listening socket was passed
HTTP_TIMEOUT_SECONDS = 2.0


def idle_limit_seconds() -> float:
    return settings.SESSION_IDLE_MINUTES * 60.0


def lab_run(session_id: int) -> str | None:
    """Claim and run a JupyterLab session to its end; its final status (None: not ours)."""
    worker = socket.gethostname()[:200]
    claimed = InteractiveSession.objects.filter(
        pk=session_id, kind=InteractiveSession.Kind.JUPYTERLAB, status=Session.STARTING, worker=""
    ).update(worker=worker, beat_at=Now())
    if not claimed:
        log.info("Session %s is not waiting for a worker: nothing to do", session_id)
        return None
    session = InteractiveSession.objects.select_related("reservation", "owner", "server").get(pk=session_id)
    return LabSupervisor(session).run()


class LabSupervisor:
    def __init__(self, session: InteractiveSession) -> None:
        self.session = session
        self.pk = session.pk
        self.executor = executor_for(session)
        self.proc: Run | None = None  # the lab's processes, once started
        self.output: collections.deque[str] = collections.deque(maxlen=OUTPUT_LINES)
        self.address = ""
        self.ends_at = session.reservation.end  # the last the database said
        self.kernels: list[list[float]] = []
        self.kernels_stored = True  # `kernels` is on the row (a failed write is tried again)
        self.last_kernel_activity = time.time()
        self.database_away = False
        self.ran = False  # it answered once: RUNNING
        self.uid = os.getuid()  # the account the lab runs as (set at its start)
        self.gid = os.getgid()
        self.listener: Listener | None = None  # the socket the worker made for it (set at its start)
        self.refused = False  # its listener was not proved: its owner and the audit log are told
        self.reader: threading.Thread | None = None

    def run(self) -> str:
        # DCGM's hpc_job label (jobs/host/dcgm.py), before the process starts: its first use of
        # the card is already the lab's. _finish takes it away again, a failed start too.
        work_started(session_name(self.pk), self.session.gpu_uuids)
        try:
            self.proc = self._start()
        except (JobSetupError, OSError) as exc:
            # An end asked for meanwhile (a pull it stopped): that is why, not the stopped pull.
            why = self._check_row() or f"JupyterLab could not start: {exc}"
            return self._finish(Session.FAILED, why, None)
        InteractiveSession.objects.filter(pk=self.pk).update(
            pid=self.proc.leader.pid, pid_started=self.proc.leader.started
        )
        self.reader = threading.Thread(target=self._read, args=(self.proc.output,), daemon=True)
        self.reader.start()
        why = self._wait_ready() or self._prove()
        if why is None:
            self.ran = True
            InteractiveSession.objects.transition(
                self.pk,
                from_=Session.STARTING,
                to=Session.RUNNING,
                address=self.address,
                started_at=timezone.now(),
                beat_at=Now(),
                message="",  # what the start said (a pull's progress) is over
            )
            why = self._supervise()
        return self._stop(why)

    # --- start ---------------------------------------------------------------------------------

    def _start(self) -> Run:
        session = self.session
        allocation = session.reservation.allocations.select_related("gpu").order_by("gpu__index").first()
        if allocation is None:
            raise JobSetupError(f"booking {session.reservation_id} holds no cards")
        if settings.JOB_USER and settings.JOB_USER != JOB_USER_OWNER:
            # One account for everyone's labs: each could read the others' tokens (their
            # environment) and files, and reach them on this host past the portal.
            raise JobSetupError(
                f"JupyterLab sessions need JOB_USER={JOB_USER_OWNER} (each lab as its owner's account), "
                f"not the one shared account {settings.JOB_USER!r}: ask an admin"
            )
        account = account_of(session.owner)
        self.uid = account.pw_uid if account is not None else os.getuid()
        self.gid = account.pw_gid if account is not None else os.getgid()
        image = lab_image(session)
        if image is not None:  # before the socket: a first use pulls the image, maybe for minutes
            lab_image_ready(image, account, self._say_starting, self._starting_beat)
        interpreter = settings.JOB_INTERPRETERS["default"]
        env = _lab_environment(
            session, BookedCard.of(allocation), account, interpreter, in_image=image is not None
        )
        root = Path(account.pw_dir if account is not None else settings.JOB_ROOTS[0])
        if account is None:
            root.mkdir(parents=True, exist_ok=True)  # the worker's own folder for its own user's labs
        argv = [
            interpreter,
            str(LAB_LAUNCHER),  # Jupyter on the socket below: no port on this command line
            "--no-browser",
            f"--ServerApp.ip={settings.SESSION_BIND_ADDRESS}",
            f"--ServerApp.base_url={lab_path(session.pk)}",
            f"--ServerApp.root_dir={root}",
            "--ServerApp.allow_remote_access=True",  # the portal's proxy may run on another host
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",  # lab networks are closed
            "--LabApp.news_url=",
        ]
        if account is None and os.geteuid() == 0:
            # A worker run as root with no JOB_USER (a container, CI): the lab is as privileged as
            # its jobs are there. JOB_USER never names root (JOB_MIN_UID).
            argv.append("--allow-root")
        sock, self.listener = listen(settings.SESSION_BIND_ADDRESS)
        self.address = self.listener.address
        env[LISTEN_FD_ENV] = str(sock.fileno())
        spec = RunSpec(argv, env, root, f"Session {session.pk}", account, [sock.fileno()], session.gpu_uuids)
        try:
            if image is not None:
                spec = in_image(spec, session, image, str(KERNELS))
            return self.executor.start(spec)
        finally:
            sock.close()  # the lab's copy is the only one left: its listener dies with it

    def _say_starting(self, line: str) -> None:
        """A line of the start (an image's pull: "pulling tf-2.17: 1.2 / 4.8 GB"), in the worker's
        log and as the session's message, which its page shows while it starts."""
        line = line.removeprefix("[portal] ")  # the job log's mark: the page is the portal's already
        log.info("Session %s: %s", self.pk, line)
        with contextlib.suppress(DatabaseError):  # only words: the start goes on without them
            InteractiveSession.objects.filter(pk=self.pk, status=Session.STARTING).update(message=line[:500])

    def _starting_beat(self) -> bool:
        """The beat while the lab's image is pulled; False once the lab is not to start any more
        (ended from the portal, taken for lost): the pull stops (launch.image_ready_for)."""
        return bool(
            InteractiveSession.objects.filter(
                pk=self.pk, status=Session.STARTING, end_requested_at=None
            ).update(beat_at=Now())
        )

    def _read(self, output: RunOutput) -> None:
        """The server's output, drained (a full pipe would block it); its last lines kept."""
        rest = b""
        while (chunk := output.get(timeout=None)) is not None:
            *lines, rest = (rest + chunk).split(b"\n")
            self.output.extend(line.decode(errors="replace").rstrip() for line in lines)
        if rest:
            self.output.append(rest.decode(errors="replace").rstrip())

    def _wait_ready(self) -> str | None:
        """None once a server answers at the lab's address (asked without the token: nothing
        there is proved yet); else why it will never (exited, ended, too slow)."""
        assert self.proc is not None
        deadline = time.monotonic() + settings.SESSION_START_SECONDS
        while time.monotonic() < deadline:
            if (end := self.executor.poll(self.proc)) is not None:
                if self.reader is not None:
                    self.reader.join(timeout=HTTP_TIMEOUT_SECONDS)  # its last words, to the end
                if end.code == LISTENER_REFUSED_EXIT_CODE:
                    self.refused = True
                    return (
                        f"JupyterLab refused the listening socket the worker passed it: {self._last_lines()}"
                    )
                return f"JupyterLab exited while starting: {self._last_lines()}"
            if self._api("", token=False) is not None:
                return None
            if reason := self._check_row():
                return reason
            time.sleep(READY_POLL_SECONDS)
        return f"JupyterLab did not answer within {settings.SESSION_START_SECONDS} s: {self._last_lines()}"

    def _prove(self) -> str | None:
        """None when the server that answered is the lab this worker started; else why not."""
        assert self.proc is not None and self.listener is not None
        why = listener_proof(self.executor, self.proc, self.listener, uid=self.uid, gid=self.gid)
        if why is not None:
            self.refused = True
            log.error("Session %s: %s", self.pk, why)
        return why

    def _last_lines(self) -> str:
        lines = [line for line in self.output if line.strip()][-5:]
        return " | ".join(lines)[-400:] or "no output"

    def _api(self, path: str, *, token: bool = True) -> object | None:
        """GET <base>api/<path> on the lab's server: its JSON answer, or None.

        With `token`, the lab's token goes only over a connection to the proved listener: the
        connection is made first and the listener checked after (`listening_at`). The socket the
        worker made still listening there now was listening there when the connection was made
        (it listened from before the lab started, and a closed socket never comes back), so the
        connection is the lab's: a server that exits and leaves its port to someone else between
        two polls never gets the token."""
        assert self.listener is not None
        listener = self.listener
        connection = http.client.HTTPConnection(listener.host, listener.port, timeout=HTTP_TIMEOUT_SECONDS)
        headers = {}
        try:
            connection.connect()
            if token:
                if listening_at(listener) != {listener.inode}:
                    return None
                headers["Authorization"] = f"token {self.session.token}"
            connection.request("GET", f"{lab_path(self.pk)}api/{path}".rstrip("/"), headers=headers)
            response = connection.getresponse()
            body = response.read(1 << 20)
        except (OSError, http.client.HTTPException):
            return None
        finally:
            connection.close()
        if response.status != 200:
            return None
        try:
            return json.loads(body)
        except ValueError:
            return None

    # --- supervise -----------------------------------------------------------------------------

    def _supervise(self) -> str:
        """Until the lab must end: why."""
        assert self.proc is not None
        next_kernel_check = 0.0
        while True:
            if self.executor.poll(self.proc) is not None:
                return "JupyterLab exited by itself"
            if worker_stopping():
                return f"the worker on {socket.gethostname()} shut down"
            if reason := self._check_row():
                return reason
            if time.monotonic() >= next_kernel_check:
                next_kernel_check = time.monotonic() + KERNEL_CHECK_SECONDS
                if reason := self._check_kernels():
                    return reason
            time.sleep(TICK_SECONDS)

    def _check_row(self) -> str | None:
        """The row's word (an end asked for, the booking's end, a warning due), with a beat; the
        database away: the last end it gave still holds."""
        now = timezone.now()
        try:
            close_old_connections()
            # The database's clock: the relay compares the beat with it (lab_handoff.lab_for_owner).
            InteractiveSession.objects.filter(pk=self.pk).update(beat_at=Now())
            row = InteractiveSession.objects.select_related(
                "reservation__released_by", "server", "owner"
            ).get(pk=self.pk)
            self.database_away = False
        except DatabaseError as exc:
            if not self.database_away:
                log.warning(
                    "Session %s: the database is away (%s); its booking's end still holds", self.pk, exc
                )
            self.database_away = True
            # As the database's own answer says it (below): ends_at is UTC, not the portal's zone.
            return f"the booking ended at {format_time(self.ends_at)}" if now >= self.ends_at else None
        self.session = row
        if session_is_lost(row):
            # Marked lost while this supervisor could not reach the database: a lost run is
            # stopped, never taken back (jobs.runs); the stop is told once, here.
            session_lost_stop(row, lambda: session_stopped_tell(row, LOST_FOUND_ALIVE))
            return LOST_FOUND_ALIVE
        booking = row.reservation
        self.ends_at = min(booking.end, booking.cancelled_at) if booking.cancelled_at else booking.end
        if row.end_requested_at:
            return "ended from the portal"
        if row.status not in InteractiveSession.ACTIVE:
            return f"the session was marked {row.get_status_display().lower()}"
        if booking.status_at(now) != Reservation.Status.ACTIVE:
            # Released or cancelled early: who and why, as a job says it (gpus.booking_ends).
            return ended_early_of(booking) or f"the booking ended at {format_time(self.ends_at)}"
        if row.warned_at is None and now >= self.ends_at - timedelta(minutes=settings.SESSION_WARN_MINUTES):
            session_warn_ending(row, self.ends_at, now)
        return None

    def _check_kernels(self) -> str | None:
        """Record the kernels' sessions; why to end when no kernel was active for too long."""
        assert self.proc is not None
        kernels = _kernel_sessions(self.proc.leader.pid)
        if kernels != self.kernels or not self.kernels_stored:
            self.kernels = kernels  # ended by `_stop` whether the row has them or not
            try:
                InteractiveSession.objects.filter(pk=self.pk).update(kernels=kernels)
            except DatabaseError:
                self.kernels_stored = False  # the watchdog and a restarted worker read them there
            else:
                self.kernels_stored = True
        listed = self._api("kernels")
        if not isinstance(listed, list):
            return None
        busy = any(k.get("execution_state") == "busy" for k in listed)
        # Its terminals too (jupyter_server_terminals: each with its last input or output): work
        # typed and run there (`python train.py`) is no idleness.
        terminals = self._api("terminals")
        listed = [*listed, *(terminals if isinstance(terminals, list) else [])]
        activity = (_parsed(k.get("last_activity")) for k in listed if isinstance(k, dict))
        latest = max((a for a in activity if a is not None), default=None)
        if busy or latest is None:
            self.last_kernel_activity = time.time() if busy else self.last_kernel_activity
        else:
            self.last_kernel_activity = max(self.last_kernel_activity, latest)
        idle = time.time() - self.last_kernel_activity
        if idle >= idle_limit_seconds():
            return f"no kernel activity for {settings.SESSION_IDLE_MINUTES} min: an idle lab ends then"
        return None

    # --- stop ----------------------------------------------------------------------------------

    def _stop(self, why: str) -> str:
        """End the server and its kernels (SIGTERM: Jupyter shuts its kernels down; SIGKILL to what
        is left after the grace period), reap it and record why."""
        assert self.proc is not None
        # The portal's relay sends the token to the row's address: it stops before the server
        # closes its listener, after which anyone on the host could listen at that address.
        with contextlib.suppress(DatabaseError):
            InteractiveSession.objects.filter(pk=self.pk).update(address="")
        # Its kernels are sessions of their own: listed while the server is its unreaped child
        # (its pid names it alone), ended by identity once the server is gone.
        self.kernels = _merge(self.kernels, _kernel_sessions(self.proc.leader.pid))
        end = self.executor.stop(self.proc, settings.JOB_KILL_GRACE_SECONDS)
        end_kernels(self.kernels, self.uid)
        return self._finish(Session.ENDED if self.ran else Session.FAILED, why, end.returncode)

    def _finish(self, status: str, why: str, code: int | None) -> str:
        work_ended(session_name(self.pk))
        message = f"{why[:1].upper()}{why[1:]}."[:500]
        updated = InteractiveSession.objects.transition(
            self.pk,
            from_=InteractiveSession.ACTIVE,
            to=status,
            told=lambda: self._tell(status, why),  # in the change's transaction: never one without the other
            finished_at=timezone.now(),
            exit_code=code,
            message=message,
            kernels=[],
        )
        if not updated:  # ended meanwhile (lost): its kernels were ended by `_stop` all the same
            InteractiveSession.objects.filter(pk=self.pk).update(kernels=[])
        work_ended(session_name(self.pk))  # again: a refresh may have read the row before
        log.info("Session %s: %s (%s)", self.pk, status, why)
        return status

    def _tell(self, status: str, why: str) -> None:
        """The owner's inbox and the audit log: a refused start, or a stop that was not the owner's
        own (an end from the portal by someone else, the booking's end, idle)."""
        if not self.refused and (status != Session.ENDED or why == "JupyterLab exited by itself"):
            return
        session = InteractiveSession.objects.select_related("reservation", "owner", "server").get(pk=self.pk)
        if self.refused:
            lab_start_refused_tell(session, why)
        stopped = status == Session.ENDED and why != "JupyterLab exited by itself"
        if stopped and not (why == "ended from the portal" and _ended_by_owner(session)):
            session_stopped_tell(session, why)


def _lab_environment(
    session: InteractiveSession,
    card: BookedCard,
    account: pwd.struct_passwd | None,
    interpreter: str,
    *,
    in_image: bool,
) -> dict[str, str]:
    """The lab's environment: the worker's INHERITED_ENV (in an image, not the host's paths, and
    no activation of the host's interpreter), the account's names, the booking's (its cards, every
    framework's caps), the token and the portal's kernel spec (jobs.host.lab_image.in_image
    adds what an image changes)."""
    env = (
        lab_image_env(os.environ)
        if in_image
        else {n: os.environ[n] for n in INHERITED_ENV if n in os.environ}
    )
    if account is not None:
        env.update(HOME=account.pw_dir, USER=account.pw_name, LOGNAME=account.pw_name)
    if not in_image:
        env.update(activation(interpreter, None, env.get("PATH")))
    env.update(
        session_environment(
            session,
            card,
            server=settings.WORKER_SERVER,
            instance=settings.PORTAL_INSTANCE_ID,
            headroom_mb=settings.GPU_CONTEXT_HEADROOM_MB,
        )
    )
    env["JUPYTER_TOKEN"] = session.token  # not on the command line, which anyone can read
    # The portal's Python kernel spec first: it applies the TF and PyTorch caps in each kernel.
    env["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(KERNELS), os.environ.get("JUPYTER_PATH")]))
    env["PORTAL_LAUNCHER"] = str(LAUNCHER)
    return env


def _ended_by_owner(session: InteractiveSession) -> bool:
    return session.end_requested_by_id in (None, session.owner_id)


def end_kernels(kernels: list[list[float]], uid: int | None = None) -> int:
    """SIGKILL every process of each recorded kernel session, by identity (pid and start); with
    `uid`, only those of that account (a row's pids are never the proof alone)."""
    return sum(end_session(ProcessId(int(pid), float(started)), uid) for pid, started in kernels)


def end_session(leader: ProcessId, uid: int | None) -> int:
    """SIGKILL every live member of the leader's session (by identity), of account `uid` only."""
    ended = 0
    for member in session_members(leader):
        try:
            if uid is not None and psutil.Process(member.pid).uids().real != uid:
                continue
        except psutil.Error:
            continue
        ended += send(member, signal.SIGKILL) is Sent.SENT
    return ended


def _kernel_sessions(leader: int) -> list[list[float]]:
    """[pid, start] of each session the server's descendants lead (its kernels, its terminals)."""
    try:
        children = psutil.Process(leader).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for child in children:
        try:
            if os.getsid(child.pid) == child.pid:
                found.append([child.pid, child.create_time()])
        except (OSError, psutil.Error):
            continue
    return sorted(found)


def _merge(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    return sorted({(int(p), float(s)) for p, s in [*a, *b]}, key=lambda k: k[0])  # type: ignore[return-value]


def _parsed(value: object) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def lab_orphans_end(server: str) -> int:
    """The labs a previous worker of this host left running (it died or was restarted): their
    server and kernels are ended by identity and the session says so. Called when the host's
    worker starts, before it takes any work."""
    # Also those the reconciler ended as lost meanwhile: their kernels outlive the server.
    left = Q(status__in=InteractiveSession.ACTIVE) | (Q(status=Session.ENDED) & ~Q(kernels=[]))
    rows = InteractiveSession.objects.filter(
        left, kind=InteractiveSession.Kind.JUPYTERLAB, server__name=server, worker=socket.gethostname()[:200]
    )
    ended = 0
    for session in rows.select_related("reservation", "owner__profile", "server"):
        try:
            account = account_of(session.owner)
        except JobSetupError:
            continue  # no account to prove its processes by: left to the watchdog
        uid = account.pw_uid if account is not None else os.getuid()
        if session.pid and session.pid_started:
            ended += end_session(ProcessId(session.pid, session.pid_started), uid)
        ended += end_kernels(session.kernels, uid)
        _container_remove(session, account)
        InteractiveSession.objects.filter(pk=session.pk).update(kernels=[])
        why = "its worker restarted, which ends the labs it ran; start a new one from the booking"
        InteractiveSession.objects.transition(
            session.pk,
            from_=InteractiveSession.ACTIVE,
            to=Session.ENDED,
            told=lambda session=session, why=why: session_stopped_tell(session, why),
            finished_at=timezone.now(),
            message=f"Ended: {why}.",
        )
    return ended


def _container_remove(session: InteractiveSession, account: pwd.struct_passwd | None) -> None:
    """A lab's container that its dead worker left in its owner's rootless Podman, removed (its
    record, and what the lab wrote in the image): no worker's start sweeps an owner's Podman
    (jobs.host.worker.containers_leftovers_remove sweeps root's, or JOB_USER's), and labs run
    under JOB_USER=@owner. Root mode's was removed by that sweep already."""
    executor = executor_for(session)
    if settings.CONTAINER_MODE != "rootless" or account is None or not isinstance(executor, Podman):
        return
    try:
        done = podman("rm", "--force", "--ignore", "--time", "0", "--", executor.container, account=account)
    except ContainerError as exc:
        log.warning("Session %s: could not remove its container %s: %s", session.pk, executor.container, exc)
        return
    if done.returncode != 0:
        why = last_line(done.stderr)
        log.warning("Session %s: could not remove its container %s: %s", session.pk, executor.container, why)

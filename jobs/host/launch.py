"""What a claimed job's process is started with: the launcher's argv, its folder and working
directory, its account, and the environment built from its booking (jobs.environment). The steps
with side effects are here (the job's folder, the upload, chown); the worker's supervision of the
process is jobs/host/runner.py's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TypeVar

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import DatabaseError, close_old_connections, connection
from django.db.models import Q
from django.db.models.functions import Now
from django.utils import timezone

from gpus.models import GPU, Allocation, ContainerImage, Server
from jobs import paths
from jobs.environment import BookedCard, JobSetupError, job_environment
from jobs.host.containers import ContainerError, account_status, card_minors, image_pull, runtime_status
from jobs.host.executors.base import ImageSpec, RunSpec
from jobs.host.folders import JobFolderError, job_folder_make
from jobs.host.spool import worker_stopping
from jobs.leavers import deactivated, owner_active, user_work_stop
from jobs.models import Job
from portal.accounts import JOB_USER_OWNER, unix_account_name
from portal.errors import Invalid

log = logging.getLogger(__name__)
T = TypeVar("T")

# In a folder of its own that is no package: Python puts the launcher's folder first on the
# job's sys.path, and nothing else in it may shadow a module of the user's or the standard library.
LAUNCHER = Path(__file__).resolve().parent / "launcher-bin" / "launcher.py"
IMAGE_PYTHON = "python3"  # a job in an image runs the image's, found on the image's PATH
IMAGE_VAR = "PORTAL_IMAGE"  # the image's name, for the launcher's line
# The worker's variables that name the host's files: a job in an image has the image's instead.
HOST_ONLY_ENV = frozenset({"PATH", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "SHELL", "TMPDIR"})


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    env_applied: dict[str, str]  # the portal's own variables, shown on the job's page
    account: pwd.struct_passwd | None  # the job runs as it (JOB_USER; None: as the worker)
    image: ImageSpec | None = None  # in this container image (issue 34); None: on the host
    gpu_minors: tuple[int, ...] = ()  # in an image: the booked cards' /dev/nvidia<N> numbers
    mounts: tuple[tuple[str, bool], ...] = ()  # in an image: the host folders it sees, (path, writable)

    def spec(self, name: str, gpu_uuids: list[str], pass_fds: tuple[int, ...] = ()) -> RunSpec:
        """What the executor starts (jobs/host/executors)."""
        return RunSpec(
            self.argv, self.env, self.cwd, name, self.account, pass_fds, gpu_uuids,
            image=self.image, gpu_minors=self.gpu_minors, mounts=self.mounts,
        )  # fmt: skip


def launch_for(job: Job) -> Launch:
    """Everything the subprocess gets: argv, cwd and the environment built from the booking.

    The steps with side effects are here (the job's folder, the upload, chown); the environment
    itself comes from the pure `job_environment`. In an image the interpreter is the image's
    python3 (`in_image`)."""
    # Every card of a booking holds the same memory_mb; the first card's size stands for all.
    first = patiently(
        job.pk,
        lambda: Allocation.objects.select_related("gpu").get(
            reservation_id=job.reservation_id, gpu_id=job.gpu_uuids[0]
        ),
    )
    image = patiently(job.pk, lambda: job.image) if job.image_id is not None else None
    interpreter = IMAGE_PYTHON if image is not None else settings.JOB_INTERPRETERS.get(job.interpreter)
    if image is None and (not interpreter or not os.access(interpreter, os.X_OK)):
        raise JobSetupError(
            f"Python environment {job.interpreter!r} ({interpreter or 'not configured'}) is not "
            f"executable on {socket.gethostname()}; check JOB_INTERPRETERS on this host."
        )
    assert interpreter is not None
    account = _job_account(job)
    script, cwd, folder = _prepare_folders(job, account)
    home = Path(interpreter).parent.parent  # a venv's root holds pyvenv.cfg, beside its bin/
    built = job_environment(
        job,
        BookedCard.of(first),
        inherited=os.environ if image is None else image_inherited(os.environ),
        interpreter=interpreter,
        venv=str(home) if image is None and (home / "pyvenv.cfg").is_file() else None,
        server=settings.WORKER_SERVER,
        instance=settings.PORTAL_INSTANCE_ID,
        headroom_mb=settings.GPU_CONTEXT_HEADROOM_MB,
        account=account,
    )
    argv = [interpreter, "-u", str(LAUNCHER), str(script), *job.args]
    launch = Launch(argv=argv, env=built.env, cwd=cwd, env_applied=built.applied, account=account)
    return in_image(launch, image, job, folder) if image is not None else launch


def image_inherited(environ: Mapping[str, str]) -> dict[str, str]:
    """The worker's variables a job in an image inherits: not the host's paths (PATH,
    LD_LIBRARY_PATH, CUDA_HOME...), which would hide the image's own."""
    return {name: value for name, value in environ.items() if name not in HOST_ONLY_ENV}


def in_image(launch: Launch, image: ContainerImage, job: Job, folder: Path) -> Launch:
    """`launch` in `image`: the image's PATH unless the job sets its own, the booked cards named
    for the NVIDIA runtime's conventions too, the image's name for the launcher's line, and what
    the container sees of the host (the job's folder, JOB_ROOTS, the launcher read-only)."""
    if launch.account is None and os.geteuid() == 0:
        raise JobSetupError(
            f"Jobs in container images never run as root, and this host's worker ({socket.gethostname()}) "
            "runs as root with no JOB_USER: an admin sets JOB_USER (an account, or @owner) there."
        )
    if "PATH" not in job.env:
        launch.env.pop("PATH", None)
    portal = {"NVIDIA_VISIBLE_DEVICES": ",".join(job.gpu_uuids) or "void", IMAGE_VAR: image.name}
    launch.env.update(portal)
    launch.env_applied = dict(sorted({**launch.env_applied, **portal}.items()))
    launch.image = ImageSpec(image.name, image.reference, image.network)
    indexes = dict(GPU.objects.filter(pk__in=job.gpu_uuids).values_list("pk", "index"))
    try:
        launch.gpu_minors = card_minors(job.gpu_uuids, indexes)
    except ContainerError as exc:
        raise JobSetupError(f"{exc} (on {socket.gethostname()})") from None
    folders = [str(folder), *(str(root) for root in settings.JOB_ROOTS)]
    launch.mounts = (*((path, True) for path in dict.fromkeys(folders)), (str(LAUNCHER.parent), False))
    return launch


def image_ready(launch: Launch, say: Callable[[str], None], beat: Callable[[], bool] | None = None) -> None:
    """The launch's image on this host (pulled on its first use, saying so in the job's log, and
    `beat` every JOB_HEARTBEAT_SECONDS meanwhile); JobSetupError saying what to do when it cannot
    be had."""
    if launch.image is not None:
        image_ready_for(launch.image, launch.account, say, beat)


def image_ready_for(
    image: ImageSpec,
    account: pwd.struct_passwd | None,
    say: Callable[[str], None],
    beat: Callable[[], bool] | None = None,
) -> None:
    """`image` on this host for work run as `account` (a job's, a lab's): containers working here
    (and, rootless, for that account), the image pulled on its first use, saying so; JobSetupError
    saying what to do when it cannot be had. A pull of a few GB takes minutes, some of them
    silent (a layer being unpacked), longer than a run's lost cut-off: `beat` (the run's
    heartbeat) is called every JOB_HEARTBEAT_SECONDS meanwhile, so the reconciler never takes a
    run that is pulling for lost. A beat that answers False (the run was cancelled, ended or
    taken for lost meanwhile) stops the pull: nothing waits for it any more, and a cancel must
    not wait for CONTAINER_PULL_SECONDS."""
    account = account if settings.CONTAINER_MODE == "rootless" else None
    ok, why = runtime_status()
    if ok and account is not None:  # rootless: this account's ranges and Podman, not only the host's
        ok, why = account_status(account)
    if not ok:
        raise JobSetupError(f"Containers cannot run on {socket.gethostname()}: {why}")
    try:
        with beating(beat, settings.JOB_HEARTBEAT_SECONDS) as stop:
            image_pull(
                image.reference,
                lambda line: say(f"[portal] {line}"),
                account=account,
                name=image.name,
                stop=stop,
            )
    except ContainerError as exc:
        raise JobSetupError(f"Image {image.name}: {exc}") from None


BEAT_JOIN_SECONDS = 10.0


@contextlib.contextmanager
def beating(beat: Callable[[], bool] | None, every: float) -> Iterator[threading.Event]:
    """`beat()` every `every` seconds in a thread of its own while the block runs (none: nothing);
    the block gets an event set once a beat answers False (the run is not to start any more), and
    no beat follows that one. A beat the database refuses is only logged: the next one may pass."""
    unwanted = threading.Event()
    if beat is None:
        yield unwanted
        return
    done = threading.Event()

    def beats() -> None:
        try:
            while not done.wait(every):
                try:
                    if not beat():
                        unwanted.set()
                        return
                except DatabaseError as exc:
                    log.warning("A heartbeat during a pull failed: %s", exc)
        finally:
            connection.close()  # this thread's own

    thread = threading.Thread(target=beats, name="pull-beat", daemon=True)
    thread.start()
    try:
        yield unwanted
    finally:
        done.set()
        # A beat in flight on a frozen database may hang until the connection gives up: the run
        # does not wait for it longer than this. A late beat changes nothing: it is conditional
        # on the run still starting (Supervisor._starting_beat, the lab's).
        thread.join(BEAT_JOIN_SECONDS)


def _job_account(job: Job) -> pwd.struct_passwd | None:
    return account_of(job.owner)


def account_of(owner: AbstractBaseUser) -> pwd.struct_passwd | None:
    """The account the owner's jobs and labs run as, in its HOME (None: as the worker's own user).

    JOB_USER names one account for every job, or is "@owner": each job runs as its owner's Unix
    account (portal.accounts.unix_account_name), so its files are theirs and the GPU watchdog
    sees their name on the card. Never root or a system account (below JOB_MIN_UID).
    """
    if not settings.JOB_USER:
        return None
    host = socket.gethostname()
    if settings.JOB_USER == JOB_USER_OWNER:
        name, source = unix_account_name(owner), f"{owner.username}'s Unix account"
        if name is None:
            raise JobSetupError(
                f"{owner.username} has no Unix account the portal can vouch for (none on their"
                f" profile, and '{owner.username}' is someone else's or came from a source not"
                " trusted for Unix accounts): an admin sets or confirms theirs on their profile."
            )
    else:
        name, source = settings.JOB_USER, "JOB_USER"
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        raise JobSetupError(
            f"{source} {name!r} is no account on {host}: an admin sets the Unix account on the"
            " person's profile, or creates the account on the host."
        ) from None
    if account.pw_uid < settings.JOB_MIN_UID:
        raise JobSetupError(
            f"{source} {name!r} has uid {account.pw_uid} on {host}, below JOB_MIN_UID"
            f" ({settings.JOB_MIN_UID}): jobs never run as root or a system account."
        )
    if account.pw_gid == os.getegid():
        # The worker's group may read its env file and write what the worker shares with it.
        raise JobSetupError(
            f"{source} {name!r} has the worker's own group (gid {account.pw_gid}) on {host}: jobs never"
            " run in it. Give the account a primary group of its own."
        )
    return account


def _prepare_folders(job: Job, account: pwd.struct_passwd | None) -> tuple[Path, Path, Path]:
    """The script, the working directory and the job's own folder. The job's own folder is made
    fresh where no job can plant anything, with the upload in it (jobs/host/folders.py); a script
    path or working directory the job chose is only checked here, by its text and where its links
    lead, and is opened and entered by the job's own process alone, once it has dropped the
    worker's privileges (portal.processes): the worker never writes, changes or enters it."""
    host = socket.gethostname()
    try:
        cwd = (
            paths.checked_path(job.workdir, field="workdir", what="working directory")
            if job.workdir
            else None
        )
        script = (
            paths.checked_path(job.script_path, field="script_path", what="script path")
            if job.script_path
            else None
        )
        # The job's own folder: its default working directory and where an upload is put
        # (never into a chosen working directory, where it could overwrite the user's file).
        folder = job_folder_make(
            job.pk, upload=None if script else (job.name, job.script_source), account=account
        )
    except Invalid as exc:
        raise JobSetupError(exc.message) from None
    except JobFolderError as exc:
        raise JobSetupError(f"{exc} (on {host})") from None
    if script is None:
        script = folder.path / job.name
    elif not script.is_file():
        raise JobSetupError(f"The script {script} does not exist on {host}.")
    if cwd is not None and not cwd.is_dir():
        raise JobSetupError(f"The working directory {cwd} does not exist on {host}.")
    return script, cwd or folder.path, folder.path


def patiently(job_id: int, step: Callable[[], T]) -> T:
    """A database step between the claim and the job's start: retried every 2 s while the
    database is away (a restart), for up to JOB_END_WAIT_SECONDS; raised after that (the job is
    then marked lost by the reconciler, its message saying the worker could not go on)."""
    deadline = time.monotonic() + settings.JOB_END_WAIT_SECONDS
    while True:
        try:
            return step()
        except DatabaseError:
            close_old_connections()
            if time.monotonic() >= deadline or worker_stopping():
                raise  # a worker shutting down waits for no database
            log.warning("Job %s: the database is away before the job's start; retrying in 2 s", job_id)
            time.sleep(2)


def this_server() -> Q:
    """Jobs of this worker's server (WORKER_SERVER). A subquery on the server's id, not a join,
    for the reason `owner_active` gives: every condition of a claim stays in the UPDATE's WHERE."""
    return Q(server__in=Server.objects.filter(name=settings.WORKER_SERVER).values("pk"))


def job_claim(job_id: int, now: datetime | None = None) -> Job | None:
    """QUEUED → STARTING, once: a re-delivered message finds 0 rows and does nothing.

    Only a job of this worker's server (WORKER_SERVER, whose queue brought the message): a job
    sent here, then put back in the queue before any worker took it (a preemptible one whose loan
    ended, jobs.preemption) and sent to another server, is not run here when the old message
    comes late.

    Only while its owner's account is active, in the same UPDATE: a deactivated owner's job is
    cancelled instead, saying why (jobs.leavers.user_work_stop: with the rest of their work, in
    the audit log and to their leaders), and never runs."""
    now = now or timezone.now()
    # Patient as the steps after it: the message is acked when the task starts (jobs.tasks), so a
    # claim that failed with the database away (a restart) left the job queued, taken for sent,
    # and never sent again. Retrying the one conditional UPDATE is safe; a claim that committed
    # but whose answer was lost is known by its token (a second message for the job has another).
    token, tries = uuid.uuid4(), []

    def claim() -> bool:
        tries.append(1)
        return Job.objects.transition(
            job_id,
            from_=Job.Status.QUEUED,
            to=Job.Status.STARTING,
            where=owner_active() & this_server(),
            worker=socket.gethostname()[:200],
            claim_token=token,
            # The database's clock, as the reconciler's cut-off (portal.clock): this host's may be off.
            heartbeat_at=Now(),
        )

    claimed = patiently(job_id, claim)
    if not claimed and len(tries) > 1:
        # A try that raised may have committed all the same (its answer lost in a restart, or a
        # COMMIT still waiting with the row locked while the retry's UPDATE found 0 rows): the row
        # then carries this claim's token, and the job is ours to run.
        mine = Job.objects.filter(pk=job_id, status=Job.Status.STARTING, claim_token=token)
        claimed = patiently(job_id, mine.exists)
    if not claimed:
        queued = Job.objects.filter(pk=job_id, status=Job.Status.QUEUED)
        left = queued.select_related("owner", "server").first()
        if left is not None and left.server.name != settings.WORKER_SERVER:
            # Sent here before it went back to the queue and elsewhere; or this worker serves
            # another server's queue than WORKER_SERVER names, a set-up to mend: say which.
            log.warning(
                "Job %s is queued for server %s, not this worker's (WORKER_SERVER=%s): not run here",
                job_id,
                left.server.name,
                settings.WORKER_SERVER,
            )
        elif left is not None and not left.owner.is_active:
            log.warning("Job %s not started: %s", job_id, deactivated(left.owner))
            user_work_stop(user=left.owner, reason=deactivated(left.owner), now=now)
        return None
    return patiently(job_id, lambda: Job.objects.select_related("reservation", "server").get(pk=job_id))

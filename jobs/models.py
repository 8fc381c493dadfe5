"""Training jobs and their logs.

The Job row is the record of a run: Celery only carries its id, and every status change
is one conditional UPDATE on this row, `Job.objects.transition` (jobs/lifecycle.py; the claim
QUEUED → STARTING above all), so a message delivered twice can never start a second run. Every
state, every transition and who makes it: docs/jobs.md, "States".

Status transitions:
    PENDING → QUEUED (a queued job: the scheduler booked its cards, jobs/queue/scheduler.py)
    PENDING → CANCELLED (cancelled while it waited)
    QUEUED → STARTING (a worker claimed it) → RUNNING (the subprocess started)
    RUNNING → SUCCEEDED (exit 0) | FAILED (exit ≠ 0, or it could not start)
            | CANCELLED (a user asked) | TIMED_OUT (time limit or booking end)
    QUEUED → CANCELLED (cancelled before any worker took it)
    QUEUED/STARTING/RUNNING → PENDING (a preemptible job preempted: back in the queue at its old
            place, its booking released, `preemptions` counted; jobs/preemption.py)
    STARTING/RUNNING → LOST (no heartbeat for JOB_LOST_AFTER_SECONDS: the worker or host died);
            a lost job found alive is stopped by its worker, never taken back (jobs/runs.py)
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Collection
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone

from jobs.lifecycle import job_published, transition
from portal.access import VIEW, check_action, is_admin, teams_led_by


def exit_words(code: int | None) -> str:
    """An exit code as recorded, "-15 (SIGTERM)" for one a signal ended; "" for none."""
    if code is None:
        return ""
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"{code} (signal {-code})"
    return str(code)


class JobArray(models.Model):
    """Many jobs from one script, each with its PORTAL_ARRAY_INDEX ("0-99%8": 100 tasks, at most 8
    running at once). Its tasks are Job rows pointing here; they are cancelled all at once."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="job_arrays")
    spec = models.CharField(max_length=50, help_text='As given, e.g. "0-99%8".')
    size = models.PositiveIntegerField()
    max_running = models.PositiveIntegerField(null=True, blank=True, help_text="None: no limit.")
    created_at = models.DateTimeField(default=timezone.now)
    # Its owner was told that every task had ended (jobs.notices): set once, by a conditional
    # UPDATE, so the array is told once however its last tasks' ends race or come again.
    noticed_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"array {self.pk} ({self.spec})"


# What a made change of a job tells, inside its transaction (jobs.notices.job_change_notify: its
# start, its end): given by JobsConfig.ready(), since the notices read logs and arrays, which build
# on this module. Each takes the job's id and its new status.
JOB_CHANGE_TOLD: list[Callable[[int, str], None]] = []


class RunQuerySet(models.QuerySet):
    """What jobs and sessions share: their one status change (jobs.lifecycle.transition).
    `published`: how a made change is told to the pages once it commits (None: not at all)."""

    published: Callable[[models.QuerySet, int], None] | None = None

    def transition(
        self,
        pk: int,
        *,
        from_: str | Collection[str],
        to: str,
        where: models.Q | None = None,
        told: Callable[[], None] | None = None,
        **fields: Any,
    ) -> bool:
        """The one status change of a run: from a status in `from_` to `to`, if still so (and
        `where`); `told` writes what is due with it, in its transaction."""
        published = type(self).published
        return transition(self, pk, from_=from_, to=to, where=where, told=told, published=published, **fields)


# How long past its grace a borrower asked to leave may still hold its lender's job (JobQuerySet.
# borrowers_gone): its supervisor's poll and its end's record fit well within it.
BORROWER_HOLD_MARGIN = timedelta(seconds=30)


class JobQuerySet(RunQuerySet):
    """Job.objects: the named reads and the one status change of a job (issue 32), published once
    it commits (its page, its log streams, the lists of jobs, its server's cards)."""

    published = staticmethod(job_published)

    def transition(
        self,
        pk: int,
        *,
        from_: str | Collection[str],
        to: str,
        where: models.Q | None = None,
        told: Callable[[], None] | None = None,
        **fields: Any,
    ) -> bool:
        """RunQuerySet.transition, and what a made change tells its owner (JOB_CHANGE_TOLD), in
        the same transaction: wherever a job starts or ends, it is told, and only if it was made."""

        def tell() -> None:
            if told is not None:
                told()
            for hook in JOB_CHANGE_TOLD:
                hook(pk, to)

        return super().transition(pk, from_=from_, to=to, where=where, told=tell, **fields)

    def restrict(self, user, action: str = VIEW) -> JobQuerySet:  # type: ignore[no-untyped-def]
        """The jobs `user` may see or change (cancel): their own and every job of the teams they
        lead; admins all. One set for both actions: a teammate who does not lead sees neither (the
        booking, not what runs on it). Pages, the API and selectors all ask here."""
        check_action(action)
        if is_admin(user):
            return self
        return self.filter(models.Q(owner=user) | models.Q(team_id__in=teams_led_by(user)))

    def borrowers_gone(self, now: datetime) -> JobQuerySet:
        """The jobs whose booking has no borrower left on its cards (jobs/lending.py): a job of
        the queue on a loan of that booking, still queued, starting or running. The owner's job
        on a lent booking is sent to its host only then, so it never starts beside a borrower
        that is still leaving (its grace: LEND_GRACE_SECONDS). A borrower asked to leave (or
        cancelled) longer ago than its grace and BORROWER_HOLD_MARGIN holds it no longer: its
        supervisor has killed it by then, or cannot (no CAP_KILL; the database away, its end
        spooled), and the owner comes first."""
        grace = max(settings.LEND_GRACE_SECONDS, settings.JOB_KILL_GRACE_SECONDS)
        overdue = now - timedelta(seconds=grace) - BORROWER_HOLD_MARGIN
        on_cards = Job.objects.filter(
            reservation__lent_from=models.OuterRef("reservation"), status__in=Job.ON_CARDS
        ).exclude(models.Q(preempt_requested_at__lt=overdue) | models.Q(cancel_requested_at__lt=overdue))
        return self.exclude(models.Exists(on_cards))


class Job(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        QUEUED = "queued", "Queued"
        STARTING = "starting", "Starting"
        RUNNING = "running", "Running"
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed"
        CANCELLED = "cancelled", "Cancelled"
        TIMED_OUT = "timed_out", "Timed out"
        LOST = "lost", "Lost"

    class Reason(models.TextChoices):
        """Why a pending job waits, in Slurm's spirit."""

        RESOURCES = "resources", "Not enough free cards now"
        PRIORITY = "priority", "Jobs of higher priority come first"
        QUOTA = "quota", "You or your team are at a quota limit"
        BEGIN_TIME = "begin_time", "It asked for a later start"
        DRAINING = "draining", "The chosen server is draining"
        OFFLINE = "offline", "The chosen server is offline"
        ARRAY_LIMIT = "array_limit", "Its array already runs as many tasks as it may"

    ACTIVE = (Status.PENDING, Status.QUEUED, Status.STARTING, Status.RUNNING)
    FINISHED = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED, Status.TIMED_OUT, Status.LOST)
    # On its booking's cards, or about to be: a message may start it at any moment.
    ON_CARDS = (Status.QUEUED, Status.STARTING, Status.RUNNING)

    class MemoryMode(models.TextChoices):
        LIMIT = "limit", "Limit to my booking"
        LIMIT_GROW = "limit_grow", "Limit to my booking and grow as needed"
        GROW = "grow", "Grow as needed"
        ALL = "all", "TF default: take all (whole cards only)"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")
    # None while a queued job is pending: the scheduler books its cards when it starts it.
    reservation = models.ForeignKey(
        "gpus.Reservation", null=True, blank=True, on_delete=models.PROTECT, related_name="jobs"
    )
    team = models.ForeignKey("portal.Team", on_delete=models.PROTECT, related_name="jobs")
    server = models.ForeignKey(
        "gpus.Server", null=True, blank=True, on_delete=models.PROTECT, related_name="jobs"
    )
    gpu_uuids = models.JSONField(default=list, help_text="The booked cards, in index order.")
    name = models.CharField(max_length=200, help_text="The script's file name, for lists.")
    # The script: an upload (kept here, so any host can run it) or a path under JOB_ROOTS.
    script_path = models.CharField(max_length=1000, blank=True)
    script_source = models.TextField(blank=True)
    args = models.JSONField(default=list)
    workdir = models.CharField(max_length=1000, blank=True, help_text="Empty: a fresh per-job folder.")
    interpreter = models.CharField(max_length=64, default="default")
    image = models.ForeignKey(
        "gpus.ContainerImage",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="jobs",
        help_text="Run in this container image (docs/containers.md); empty: on the host, as before.",
    )
    env = models.JSONField(default=dict, help_text="Extra environment variables given by the user.")
    time_limit_minutes = models.PositiveIntegerField(null=True, blank=True)
    # Memory settings (every framework: jobs/environment.framework_memory_env) and TensorFlow's,
    # applied by jobs/host/launcher-bin/launcher.py.
    memory_mode = models.CharField(max_length=16, choices=MemoryMode.choices, default=MemoryMode.LIMIT)
    intra_op_threads = models.PositiveSmallIntegerField(null=True, blank=True)
    inter_op_threads = models.PositiveSmallIntegerField(null=True, blank=True)
    soft_placement = models.BooleanField(default=True)
    log_placement = models.BooleanField(default=False)
    mirrored = models.BooleanField(default=False)
    # A queued job (no booking given): what it asks for; the scheduler books it for
    # [start, start + time_limit_minutes) and releases that booking when the job ends.
    queued = models.BooleanField(default=False, help_text="Submitted to the queue rather than to a booking.")
    gpu_count = models.PositiveSmallIntegerField(null=True, blank=True)
    memory_mb = models.PositiveIntegerField(
        null=True, blank=True, help_text="MiB per card; empty: whole cards."
    )
    request_server = models.ForeignKey(
        "gpus.Server", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    nice = models.PositiveIntegerField(default=0, help_text="Lowers the job's priority by this much.")
    begin_at = models.DateTimeField(null=True, blank=True, help_text="Not before this time.")
    pending_reason = models.CharField(max_length=16, choices=Reason.choices, blank=True)
    array = models.ForeignKey(JobArray, null=True, blank=True, on_delete=models.CASCADE, related_name="tasks")
    array_index = models.PositiveIntegerField(null=True, blank=True)
    # A queued job that may be interrupted (jobs/preemption.py): SIGTERM, a grace, SIGKILL, and back
    # to the queue at its old place (its created_at and priority are kept), never counted as failed.
    preemptible = models.BooleanField(
        default=False, help_text="Queued only: may be stopped and requeued; it resumes from its checkpoint."
    )
    preemptions = models.PositiveIntegerField(default=0, help_text="Times it was preempted and requeued.")
    # When it last went back to the queue: its next run's wait counts from here (jobs.notices).
    requeued_at = models.DateTimeField(null=True, blank=True)
    # A preemption asked for and not yet done: the job's supervisor stops it (runner), after this grace.
    preempt_requested_at = models.DateTimeField(null=True, blank=True)
    preempt_reason = models.CharField(max_length=500, blank=True)
    preempt_grace_seconds = models.PositiveSmallIntegerField(null=True, blank=True)
    # What its owner is told of it (portal.models.JOB_NOTIFY_EVENTS); None: their preference.
    notify = models.JSONField(null=True, blank=True, help_text='Of "start", "end", "fail"; empty: yours.')
    # Its end was told (jobs.notices): set once by a conditional UPDATE, so an end recorded again
    # (a lost job's worker saying how it really ended, a spool replayed) is never told twice.
    end_noticed_at = models.DateTimeField(null=True, blank=True)

    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED, db_index=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    not_before = models.DateTimeField(
        null=True, blank=True, help_text="The booking's start: the job waits until then."
    )
    dispatched_at = models.DateTimeField(null=True, blank=True)
    # Written by the claim (jobs.host.launch.job_claim): a claim whose COMMIT went through but
    # whose answer was lost knows its own row on the retry.
    claim_token = models.UUIDField(null=True, blank=True, editable=False)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    cancelled_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Why someone cancelled it, as its owner is told (required when it is someone else's job:
    # jobs.services.job_cancel); its end says it. A database default: an older release's
    # processes insert jobs without it.
    cancel_reason = models.CharField(max_length=500, blank=True, default="", db_default="")
    worker = models.CharField(max_length=200, blank=True, help_text="The worker host that ran it.")
    pid = models.PositiveIntegerField(null=True, blank=True)
    # The job's session leader's start (psutil create_time): pid and start time together name
    # the job's session for good, so a recycled pid is never taken for it (portal.pids).
    pid_started = models.FloatField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    message = models.CharField(max_length=1000, blank=True, help_text="Why it failed, was lost or stopped.")
    # Set by the GPU watchdog (jobs/host/watchdog.py) to stop a running job that broke its booking:
    # the job's supervisor stops it and records it failed with this message.
    watchdog_stop = models.CharField(max_length=500, blank=True)
    env_applied = models.JSONField(default=dict, help_text="The environment the portal set for the job.")
    launcher_line = models.CharField(max_length=1000, blank=True)
    # From telemetry: the job's processes on its cards.
    peak_memory_mb = models.PositiveIntegerField(null=True, blank=True)
    utilization_sum = models.FloatField(default=0)
    utilization_samples = models.PositiveIntegerField(default=0)
    # The log: every byte the job wrote (with timestamps), and how many the cap dropped.
    log_bytes = models.PositiveBigIntegerField(default=0)
    log_dropped_bytes = models.PositiveBigIntegerField(default=0)
    # On a Slurm cluster (jobs/host/slurm_runner.py): Slurm's job id, its state and reason as the
    # cluster last said them (PENDING, Resources), and the partition it went to.
    slurm_job_id = models.CharField("Slurm job id", max_length=32, blank=True)
    slurm_state = models.CharField(max_length=32, blank=True)
    slurm_reason = models.CharField(max_length=200, blank=True)
    partition = models.CharField(max_length=64, blank=True)
    # How much of its output file the log holds, stored with the log's bytes: where a restarted
    # cluster worker reads on from.
    slurm_output_offset = models.PositiveBigIntegerField(default=0, db_default=0)

    objects = JobQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            # One job at a time per booking: two would each take the booking's memory.
            models.UniqueConstraint(
                fields=["reservation"],
                condition=models.Q(status__in=["queued", "starting", "running"]),
                name="job_one_active_per_reservation",
            )
        ]
        indexes = [
            models.Index(fields=["owner", "-created_at"], name="job_owner_created"),
            models.Index(fields=["status", "created_at"], name="job_status_created"),
            # The usage rollup reads the jobs that ended in an hour, once a minute (gpus/usage.py).
            models.Index(fields=["finished_at"], name="job_finished"),
            models.Index(fields=["team", "-created_at"], name="job_team_created"),
        ]

    def __str__(self) -> str:
        return f"job {self.pk} ({self.name})"

    @property
    def is_active(self) -> bool:
        return self.status in self.ACTIVE

    @property
    def is_finished(self) -> bool:
        return self.status in self.FINISHED

    @property
    def duration(self) -> timedelta | None:
        if not self.started_at:
            return None
        return (self.finished_at or timezone.now()) - self.started_at

    @property
    def exit_label(self) -> str:
        """The exit code as recorded (minus N after signal N, as Popen's), with the signal named:
        "-15 (SIGTERM)" reads as the cancel it was, where a bare -15 looked like a fault."""
        return exit_words(self.exit_code)

    @property
    def mean_utilization_pct(self) -> float | None:
        if not self.utilization_samples:
            return None
        return round(self.utilization_sum / self.utilization_samples, 1)

    def deadline(self, booking_end: datetime) -> datetime:
        """When the job must stop: its time limit from the start, or the booking's end."""
        if self.time_limit_minutes and self.started_at:
            return min(booking_end, self.started_at + timedelta(minutes=self.time_limit_minutes))
        return booking_end


class LoanRun(models.Model):
    """A borrower's run on a loan (jobs/lending.py) that it left for the queue (jobs.preemption):
    kept, since the job's row forgets its run when it goes back, and the loan's cards were put to
    work all the same (jobs/lending_report.py counts it as used). A run that ends for good stays
    on the job's row."""

    loan = models.ForeignKey("gpus.Reservation", on_delete=models.CASCADE, related_name="+")
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="loan_runs")
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"job {self.job_id} on loan {self.loan_id}"


class LendingTotal(models.Model):
    """The GPU-time lent to the queue and used by its borrowers of the loans settled for good
    (jobs/lending_report.py), by lending team and server: /metrics' counters run from the first
    loan ever made, and read these few rows and the loans since `through`, not every loan.

    Keyed by the team's and server's rows, not their names: a renamed team's series moves to its
    new name whole, settled and unsettled alike, and never drops. A settle writes `through` on
    every row in its one transaction, so a scrape's one read of the rows sees all of them as of
    one settle, and reads the loans that ended after it."""

    team = models.ForeignKey("portal.Team", on_delete=models.CASCADE, related_name="+")
    server = models.ForeignKey("gpus.Server", on_delete=models.CASCADE, related_name="+")
    # Milliseconds, whole: sums of integers are the same in any order, so a counter never dips by a
    # float's last digit when its loans move from the scrape's own sum to these rows.
    lent_ms = models.BigIntegerField(default=0)
    used_ms = models.BigIntegerField(default=0)
    through = models.DateTimeField(help_text="Every loan that ended by this is in the totals.")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "server"], name="lending_total_unique")]

    def __str__(self) -> str:
        return f"team {self.team_id}, server {self.server_id}: lent {self.lent_ms} ms through {self.through}"


class LendingSettle(models.Model):
    """The one row the settles lock, so they take turns, and where they stopped (`through`, as on
    every LendingTotal row)."""

    through = models.DateTimeField()

    def __str__(self) -> str:
        return f"loans settled through {self.through}"


class LogChunk(models.Model):
    """A piece of a job's log as the worker flushed it (≤ 1 MB each).

    `start` is the chunk's byte offset in the job's whole output, so offsets stay valid
    for tailing clients even after the cap dropped middle chunks. `head` chunks are the
    first half of the cap and are never dropped; tail chunks are dropped oldest-first.
    """

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="log_chunks")
    seq = models.PositiveIntegerField()
    start = models.PositiveBigIntegerField()
    size = models.PositiveIntegerField()
    head = models.BooleanField(default=True)
    data = models.BinaryField()

    class Meta:
        ordering = ["job", "seq"]
        constraints = [models.UniqueConstraint(fields=["job", "seq"], name="logchunk_unique_seq")]

    def __str__(self) -> str:
        return f"log chunk {self.seq} of job {self.job_id}"


class JobMetric(models.Model):
    """One record of a job's training curves: what Keras reported after an epoch or a batch.

    The launcher's callback prints it on the job's output; the worker takes it out of the log and
    stores it here (jobs/metrics.py). `seq` numbers a job's records in arrival order, so a page
    polls for those after the last it has; `at` is when the worker received it. `values` maps metric
    names to numbers (null: NaN or infinite, e.g. a diverged loss).
    """

    class Kind(models.TextChoices):
        EPOCH = "epoch", "Epoch"
        BATCH = "batch", "Batch"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metrics")
    seq = models.PositiveIntegerField()
    kind = models.CharField(max_length=8, choices=Kind.choices)
    epoch = models.PositiveIntegerField(null=True, blank=True, help_text="From 1, as in the log.")
    step = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Training batches so far, over every fit() of the job."
    )
    at = models.DateTimeField()
    values = models.JSONField(default=dict)

    class Meta:
        ordering = ["job", "seq"]
        constraints = [models.UniqueConstraint(fields=["job", "seq"], name="jobmetric_unique_seq")]

    def __str__(self) -> str:
        return f"metrics {self.seq} of job {self.job_id}"


class InteractiveSessionQuerySet(RunQuerySet):
    """InteractiveSession.objects. A session's change is published nowhere: the pages that show
    sessions read them when they load."""

    def restrict(self, user, action: str = VIEW) -> InteractiveSessionQuerySet:  # type: ignore[no-untyped-def]
        """The sessions `user` may see or change (end): the owner's, those on bookings of the teams
        the user leads, and all for admins: as jobs."""
        check_action(action)
        if is_admin(user):
            return self
        return self.filter(models.Q(owner=user) | models.Q(reservation__team__in=teams_led_by(user)))

    def holding_slots(self) -> InteractiveSessionQuerySet:
        """Those that take a job slot of their host's worker: a JupyterLab runs as a task of its
        pool, as a job does (jobs.host.lab), from its start until it ends. The pickup and the queue's
        scheduler count them as busy (jobs.host.pickup, jobs.queue.scheduler)."""
        return self.filter(kind=InteractiveSession.Kind.JUPYTERLAB, status__in=InteractiveSession.ACTIVE)


class InteractiveSession(models.Model):
    """Interactive work on a booking, beside its jobs: `gpu exec` and `gpu shell` in a terminal on
    the booking's host (JupyterLab sessions join them as a third kind).

    The row is the record, as a job's is. The `gpu` command on the host creates it (STARTING),
    starts the command in a session of its own and records that session's leader (`pid`, with its
    start time), which is how the host's watchdog knows the command's GPU processes as the
    booking's: by session id, and only those run by the booking's owner (a pid the owner names is
    the owner's claim, so it can never cover anyone else's process). The command beats every
    SESSION_BEAT_SECONDS; the beat answers the booking's end as it stands, and whether the session
    was ended from the portal.

    Status transitions (each one `InteractiveSession.objects.transition`; the table with who
    makes each is docs/jobs.md, "States"):
        STARTING → RUNNING (the command runs; its pid is recorded; a lab: its server answers)
        STARTING/RUNNING → ENDED (the command ended, or no beat for SESSION_LOST_AFTER_SECONDS:
            "Lost: …"; a lost session found alive is stopped, never taken back: jobs/runs.py)
        STARTING → FAILED (the command could not start)

    A JupyterLab session (jobs.host.lab) is started by the host's worker instead, which beats for it and
    records its kernels' sessions; the portal proxies to it (jobs.sessions.lab_proxy) with its token.
    """

    class Kind(models.TextChoices):
        EXEC = "exec", "gpu exec"
        SHELL = "shell", "gpu shell"
        JUPYTERLAB = "jupyterlab", "JupyterLab"

    class Status(models.TextChoices):
        STARTING = "starting", "Starting"
        RUNNING = "running", "Running"
        ENDED = "ended", "Ended"
        FAILED = "failed", "Failed"

    ACTIVE = (Status.STARTING, Status.RUNNING)
    # Started on the host by `gpu` in a terminal; a JupyterLab by the host's worker (jobs.host.lab).
    TERMINAL_KINDS = (Kind.EXEC, Kind.SHELL)

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="interactive_sessions"
    )
    reservation = models.ForeignKey(
        "gpus.Reservation", on_delete=models.CASCADE, related_name="interactive_sessions"
    )
    server = models.ForeignKey("gpus.Server", on_delete=models.PROTECT, related_name="interactive_sessions")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.STARTING)
    command = models.JSONField(default=list, help_text="The argv as given.")
    gpu_uuids = models.JSONField(default=list)
    image = models.ForeignKey(
        "gpus.ContainerImage",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="sessions",
        help_text="A lab run in this container image (docs/containers.md); empty: on the host.",
    )
    pid = models.PositiveIntegerField(null=True, blank=True, help_text="The command's session leader.")
    pid_started = models.FloatField(null=True, blank=True, help_text="Its start (epoch seconds).")
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    beat_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    message = models.CharField(max_length=500, blank=True)
    end_requested_at = models.DateTimeField(null=True, blank=True, help_text="Ended from the portal.")
    end_requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # JupyterLab (jobs.host.lab): the host's worker runs the server; the portal proxies to it.
    worker = models.CharField(max_length=255, blank=True, help_text="The worker that runs it (JupyterLab).")
    address = models.CharField(max_length=255, blank=True, help_text="host:port of the Jupyter server.")
    token = models.CharField(max_length=128, blank=True, help_text="The Jupyter server's; never shown.")
    kernels = models.JSONField(
        default=list, blank=True, help_text="[pid, start] of each kernel's session, as last seen."
    )
    warned_at = models.DateTimeField(null=True, blank=True, help_text="Told that the booking ends soon.")

    objects = InteractiveSessionQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-pk"]
        indexes = [
            models.Index(fields=["server", "status"], name="session_server_status"),
            models.Index(fields=["owner", "created_at"], name="session_owner_created"),
        ]

    def __str__(self) -> str:
        return f"{self.get_kind_display()} session {self.pk}"

    @property
    def is_active(self) -> bool:
        return self.status in self.ACTIVE

    @property
    def team_id(self) -> int:
        """The booking's team: its leaders may end the session (portal.access.can_manage)."""
        return self.reservation.team_id

    @property
    def duration(self) -> timedelta | None:
        if not self.started_at:
            return None
        return (self.finished_at or timezone.now()) - self.started_at


class LabGrant(models.Model):
    """A browser's way into one JupyterLab on the labs' own origin (jobs.sessions.lab_handoff, which says
    the whole hand-off; docs/sessions.md, "Two origins").

    The portal issues it as a ticket for one lab, one user, the portal session that asked and the
    state cookie of the browser that asked; the labs' origin redeems it once, within
    LAB_TICKET_SECONDS, and it becomes the grant behind that browser's cookie for that lab. Only
    SHA-256 digests of the ticket, the state and the cookie are kept. `portal_session_key` is the
    portal session's own key (django_session's primary key, so no secret that table does not
    already hold): each lab request checks that this session still exists and still names `user`.

    Status transitions:
        issued (used_at empty) → redeemed (used_at and cookie_digest set): once, by a conditional
            UPDATE, and only before expires_at
        issued, past expires_at → deleted; any, once its lab is no longer running → deleted
            (both when the next ticket is issued)
    """

    session = models.ForeignKey(InteractiveSession, on_delete=models.CASCADE, related_name="lab_grants")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    portal_session_key = models.CharField(max_length=40)
    ticket_digest = models.CharField(max_length=64, unique=True)
    state_digest = models.CharField(max_length=64)
    expires_at = models.DateTimeField(help_text="The ticket's end; a grant lasts as its portal session.")
    used_at = models.DateTimeField(null=True, blank=True)
    cookie_digest = models.CharField(max_length=64, null=True, blank=True, unique=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["expires_at"], name="labgrant_expires")]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(used_at__isnull=True, cookie_digest__isnull=True)
                | models.Q(used_at__isnull=False, cookie_digest__isnull=False),
                name="labgrant_redeemed_with_cookie",
            )
        ]

    def __str__(self) -> str:
        return f"lab grant {self.pk} for session {self.session_id}"


def lab_path(pk: int) -> str:
    """Where the portal serves a JupyterLab session (jobs.sessions.lab_proxy): its Jupyter
    server's base URL."""
    return f"/sessions/{pk}/lab/"

"""Job forms. They normalise types only; every rule lives in jobs/submit.py (job_submit)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings
from django.utils import timezone

from gpus.filters import server_choices
from gpus.forms import parse_memory_mb
from gpus.models import ContainerImage, Reservation
from jobs.models import Job
from jobs.submit import ScriptUpload
from portal.forms import CARDS_ERRORS, SERVER_ERRORS, ServiceErrorsMixin
from portal.timefmt import short_time


def reservation_label(reservation: Reservation) -> str:
    """'#12 box1 GPU 0, 1 · 8 GiB · until Mon 18:00' (prefetch allocations__gpu__server)."""
    end = short_time(reservation.end)
    if reservation.start > timezone.now():
        return f"#{reservation.pk} {reservation.summary} · from {short_time(reservation.start)} until {end}"
    return f"#{reservation.pk} {reservation.summary} · until {end}"


def image_choices() -> list[tuple[str, str]]:
    """The images a job can run in now (on some server where containers work), each with its
    description and those servers; the service checks the booking's or queue's server."""
    images = ContainerImage.objects.runnable().prefetch_related("servers")
    return [("", "None: run on the host"), *((image.name, image_label(image)) for image in images)]


def image_label(image: ContainerImage) -> str:
    """'tf-2.17 — TensorFlow 2.17 with CUDA 12 (on gpu-01, gpu-02)' (prefetch servers)."""
    servers = ", ".join(sorted(s.name for s in image.servers.all() if s.containers_ok))
    about = f" — {image.description}" if image.description else ""
    return f"{image.name}{about} (on {servers})"


# What its owner is told of a job (jobs/notices.py): the combinations people ask for, as
# job_submit's `notify` reads them. Empty: the owner's preference on their profile.
NOTIFY_CHOICES = [
    ("", "As in my profile"),
    ("end,fail", "When it ends, well or not"),
    ("fail", "Only if it fails (or times out, or is lost)"),
    ("start,end,fail", "When a queued job starts, and when it ends"),
    ("none", "Never"),
]


class ReservationChoiceField(forms.ModelChoiceField):
    def label_from_instance(self, obj: Reservation) -> str:  # type: ignore[override]
        return reservation_label(obj)


class JobForm(ServiceErrorsMixin, forms.Form):
    """One Python script on one of the user's own open bookings, with its memory and TensorFlow settings."""

    service_fields = {"memory_mb": "memory"}  # the service's field → this form's, for its refusals

    reservation = ReservationChoiceField(
        queryset=Reservation.objects.none(),
        required=False,
        label="Booking",
        empty_label="— none: queue it (give the cards below) —",
        error_messages={
            "invalid_choice": "That is not one of your active or upcoming bookings; choose one from the list "
            "(book cards under Reservations first).",
        },
        help_text="The job runs on this booking's server and cards only, and starts when the booking does. "
        "One job at a time per booking. Or leave it empty and queue the job: it starts as soon as cards "
        "are free, in fair-share order.",
    )
    gpu_count = forms.IntegerField(
        required=False,
        min_value=1,
        error_messages=CARDS_ERRORS,
        label="Queue: cards",
        help_text="Without a booking: how many cards, all on one server. The portal books them for the "
        "time limit when they are free, and releases them when the job ends.",
    )
    memory = forms.CharField(
        required=False,
        label="Queue: memory per card",
        help_text="Empty: whole cards. Or a share, e.g. 8G (GiB) or 4096M (MiB).",
    )
    server = forms.ChoiceField(
        required=False,
        error_messages=SERVER_ERRORS,
        label="Queue: server",
        help_text="Empty: any server. A Slurm cluster sends the job to Slurm, which picks node and cards.",
    )
    partition = forms.CharField(
        required=False,
        max_length=64,
        label="Slurm: partition",
        help_text="On a Slurm cluster only. Empty: the first partition the portal shows for it.",
    )
    array = forms.CharField(
        required=False,
        max_length=50,
        label="Queue: array",
        help_text="Run the script once per index, e.g. 0-99, or 0-99%8 for at most 8 at once; each task gets "
        "PORTAL_ARRAY_INDEX.",
    )
    preemptible = forms.BooleanField(
        required=False,
        label="Queue: preemptible",
        help_text="It may be stopped (SIGTERM, then SIGKILL after a grace) when its cards are wanted back, "
        "and goes back to the queue at its old place; it may also run on idle booked cards lent to the "
        "queue. Keep a checkpoint in PORTAL_CHECKPOINT_DIR to resume where it left off.",
    )
    script = forms.FileField(
        required=False,
        label="Upload a script",
        help_text="A .py file, kept by the portal so any host can run it. Or give a path below instead.",
    )
    script_path = forms.CharField(
        required=False,
        max_length=1000,
        label="…or a script on the server",
        help_text="A .py file under the lab's job folders (your admin knows where they are); a relative "
        "path starts at the first one. '..' and symlinks leading out are refused.",
    )
    args = forms.CharField(
        required=False,
        max_length=20_000,
        label="Arguments",
        help_text="Split like a shell command line, e.g. --epochs 3 --name 'run a'. Jobs never run through "
        "a shell: quote |, ;, > or $VAR to pass them literally.",
    )
    workdir = forms.CharField(
        required=False,
        max_length=1000,
        label="Working directory",
        help_text="A folder under the job folders. Empty: a fresh folder named after the job.",
    )
    interpreter = forms.ChoiceField(
        label="Python environment",
        help_text="The Python that runs the script, as your admins set them up; it needs TensorFlow if "
        "the script imports it.",
    )
    image = forms.ChoiceField(
        required=False,
        label="Container image",
        help_text="Run the script inside this image (its own Python, CUDA and TensorFlow), with only your "
        "cards in it; only images on servers where containers work are offered. Empty: on the host, "
        "in the Python environment above.",
    )
    env = forms.CharField(
        required=False,
        label="Extra environment variables",
        widget=forms.Textarea(attrs={"rows": 3, "placeholder": "WANDB_MODE=offline"}),
        help_text="One NAME=value per line. CUDA_VISIBLE_DEVICES, TF_FORCE_GPU_ALLOW_GROWTH, thread counts "
        "and PORTAL_* are set by the portal from your booking and cannot be overridden.",
    )
    time_limit_minutes = forms.IntegerField(
        required=False,
        label="Time limit (minutes)",
        help_text="Stop the job (SIGTERM, then SIGKILL) after this long. Empty: it may run until the "
        "booking ends, when it is stopped anyway; a queued job gets the queue's default.",
    )
    notify = forms.ChoiceField(
        required=False,
        label="Tell me",
        choices=NOTIFY_CHOICES,
        help_text="In your inbox, and by mail and chat as your profile says. A job array is told once, "
        "when all its tasks are done.",
        error_messages={
            "invalid_choice": "Choose one of the listed options: as in your profile, when it ends, "
            "only if it fails, when it starts and ends, or never."
        },
    )
    memory_mode = forms.ChoiceField(
        required=False,
        label="GPU memory",
        help_text="Limit: TensorFlow may use the booked memory minus the CUDA context headroom "
        "(a logical GPU with memory_limit); Grow: allocate as needed (TF_FORCE_GPU_ALLOW_GROWTH) instead "
        "of all at once; Take all: TF's default, whole-card bookings only. Default: limit on shared cards, "
        "take all on whole cards. Limit and Grow also cap JAX and PyTorch at the same share; Take all "
        "caps no framework (docs/jobs.md).",
    )
    intra_op_threads = forms.IntegerField(
        required=False,
        label="Intra-op threads",
        help_text="Threads inside one op (a matmul). Empty: the booking's share of the host's CPUs, so "
        "jobs on the same host do not oversubscribe it.",
    )
    inter_op_threads = forms.IntegerField(
        required=False,
        label="Inter-op threads",
        help_text="Independent ops run in parallel. Empty: 1–2, which suits most models.",
    )
    soft_placement = forms.BooleanField(
        required=False,
        initial=True,
        label="Soft device placement",
        help_text="An op with no GPU kernel runs on the CPU instead of failing "
        "(tf.config.set_soft_device_placement).",
    )
    log_placement = forms.BooleanField(
        required=False,
        label="Log device placement",
        help_text="Log the device of every op (tf.debugging.set_log_device_placement): verbose, for "
        "finding ops that fall back to the CPU.",
    )
    mirrored = forms.BooleanField(
        required=False,
        label="Use all my cards (MirroredStrategy)",
        help_text="Keras models built by the script replicate over the booked cards; bookings of two or "
        "more cards only. Without it TensorFlow uses the first card.",
    )

    def __init__(self, *args: Any, user: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        own = Reservation.objects.filter(owner=user).with_status("open", timezone.now())
        self.fields["reservation"].queryset = own.prefetch_related("allocations__gpu__server").order_by(
            "start", "id"
        )
        self.fields["interpreter"].choices = [(name, name) for name in settings.JOB_INTERPRETERS]
        self.fields["server"].choices = server_choices()
        self.fields["image"].choices = image_choices()
        self.fields["memory_mode"].choices = [("", "Default for the booking"), *Job.MemoryMode.choices]
        self.initial.setdefault("interpreter", "default")

    def clean_memory(self) -> int | None:
        return parse_memory_mb(self.cleaned_data["memory"])

    def service_kwargs(self) -> dict[str, Any]:
        data = self.cleaned_data
        # Always passed: beside a booking the service refuses each, by its field, where dropping
        # them ran one plain job for an array of ten (as `preemptible` below).
        queued = {
            "gpu_count": (data["gpu_count"] or 1) if data["reservation"] is None else data["gpu_count"],
            "memory_mb": data["memory"],
            "server": data["server"] or None,
            "array": data["array"],
            "partition": data["partition"],
        }
        return {
            **queued,
            # Always passed: on a booking the service refuses it beside the field (a job on a
            # booking is never preemptible), where dropping it ran an ordinary job unasked.
            "preemptible": data["preemptible"],
            "reservation": data["reservation"],
            "script": ScriptUpload.from_file(data["script"]) if data["script"] is not None else None,
            "script_path": data["script_path"],
            "args": data["args"],
            "workdir": data["workdir"],
            "interpreter": data["interpreter"],
            "image": data["image"] or None,
            "env": data["env"],
            "time_limit_minutes": data["time_limit_minutes"],
            "memory_mode": data["memory_mode"] or None,
            "intra_op_threads": data["intra_op_threads"],
            "inter_op_threads": data["inter_op_threads"],
            "soft_placement": data["soft_placement"],
            "log_placement": data["log_placement"],
            "mirrored": data["mirrored"],
            "notify": data["notify"] or None,
        }


class JobCancelForm(ServiceErrorsMixin, forms.Form):
    """The reason asked on the confirm step of a cancel of someone else's job; its rule is the
    service's (jobs.services.job_cancel_reason_check)."""

    reason = forms.CharField(
        required=False,
        max_length=500,
        help_text="Required: the job's owner sees it, in their inbox and in the job's log.",
    )

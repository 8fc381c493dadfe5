"""The container images people may run jobs and labs in (issue 34; docs/containers.md), kept apart
from gpus/models.py for that module's length and imported there, so callers import every model
from gpus.models.

An admin lists each image once: its short name (what people pick: `tf-2.17`), where a host gets it
(`reference`) and which servers have it or may pull it. Nothing else can be run in a container:
a job names an image of this list, never a reference of its own.
"""

from __future__ import annotations

from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone

IMAGE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z"  # also the API's lookup (gpus.api.ImageViewSet)
# Where a host gets an image, one of three shapes; never anything Podman could read as an option
# (a leading "-"), never blanks or control characters (it is one argument on Podman's command line).
_PATH = r"/(?!.*(?:^|/)\.\.?(?:/|\Z))[A-Za-z0-9._@+=,:/-]*[A-Za-z0-9._@+=,-]"  # absolute, no . or .. parts
IMAGE_REFERENCE = (
    rf"^(?:{_PATH}"  # a root filesystem folder on the hosts
    rf"|(?:oci-archive|docker-archive):{_PATH}"  # an archive file on the hosts
    r"|(?!(?:oci|docker)-archive:)[A-Za-z0-9][A-Za-z0-9.-]*(?::[0-9]+)?"  # a registry (and port), or a name
    r"(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*"  # /repository/path
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?)\Z"  # :tag, @digest
)


class ContainerImageQuerySet(models.QuerySet):
    def runnable(self, server: object | None = None) -> ContainerImageQuerySet:
        """The images a job can run in now: on a server (this one, if given) whose worker found
        that containers work there. The one rule for the job form, the lab button and the checks."""
        if server is None:
            return self.filter(servers__containers_ok=True).distinct()
        return self.filter(servers=server, servers__containers_ok=True).distinct()

    def for_labs(self, server: object | None = None) -> ContainerImageQuerySet:
        """The images a JupyterLab can open in now: runnable (on `server`, if given) and marked
        by an admin as having JupyterLab. The one rule for the lab button, the API and the host."""
        return self.runnable(server).filter(has_jupyterlab=True)


class ContainerImage(models.Model):
    # Not a SlugField: versions have dots ("tf-2.17"), which a slug refuses.
    name = models.CharField(
        max_length=64,
        unique=True,
        validators=[
            RegexValidator(
                IMAGE_NAME,
                "Letters, digits, '.', '-' and '_', starting with a letter or digit, e.g. tf-2.17.",
            )
        ],
        help_text='What people pick: the job form, `gpu run --image` ("tf-2.17").',
    )
    reference = models.CharField(
        max_length=1000,
        validators=[
            RegexValidator(
                IMAGE_REFERENCE,
                "An OCI reference (registry.lab.example/tf:2.17), oci-archive:/path or docker-archive:/path "
                "to a file on the hosts, or the absolute path of a root filesystem folder on the hosts; "
                "no spaces, no leading '-', no '.' or '..' in a path.",
            )
        ],
        help_text=(
            "Where a host gets it: an OCI reference from the lab's registry "
            "(registry.lab.example/tf:2.17), an oci-archive:/docker-archive: file, or a root "
            "filesystem folder on the hosts (an absolute path)."
        ),
    )
    description = models.CharField(max_length=500, blank=True)
    servers = models.ManyToManyField(
        "gpus.Server", related_name="images", blank=True, help_text="The servers that have it."
    )
    network = models.BooleanField(
        default=False,
        help_text="Jobs in it see the host's network (off: no network at all, the safe default).",
    )
    has_jupyterlab = models.BooleanField(
        "has JupyterLab",
        default=False,
        help_text=(
            "Its python3 can run `jupyter lab` (jupyterlab, jupyter_server 2 and ipykernel installed): "
            "people may open JupyterLab in it. Off: jobs only."
        ),
    )
    created_at = models.DateTimeField(default=timezone.now)

    objects = ContainerImageQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def is_rootfs(self) -> bool:
        """A root filesystem folder on the hosts, run with `podman --rootfs`, never pulled."""
        return self.reference.startswith("/")


class ImagePull(models.Model):
    """The last pre-pull of an image on a server (jobs' images_pull task, the admin's "Pull on
    every host now"), as its host's worker recorded it: one row per pair, replaced each time."""

    image = models.ForeignKey(ContainerImage, on_delete=models.CASCADE, related_name="pulls")
    server = models.ForeignKey("gpus.Server", on_delete=models.CASCADE, related_name="image_pulls")
    ok = models.BooleanField()
    detail = models.CharField(max_length=1000, blank=True, help_text="The pull's last words, or its error.")
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["image", "server"], name="image_pull_one_per_server")]
        ordering = ["image", "server"]

    def __str__(self) -> str:
        return f"{self.image_id} on {self.server_id}: {'ok' if self.ok else 'failed'}"

"""Container images on the portal's side (issue 34, docs/containers.md): the rule of which image
a job or lab may run in where (`image_check`: jobs.submit and jobs.sessions.services), and sending
the pre-pull to each host that has them (`images_pull_send`: the admin's "Pull on every host now"
and `manage.py images_pull`). The pull itself runs on the host (jobs.host.images, the task
jobs.tasks.pull_images).

The message is a nudge: a host whose worker is down pulls when it is back (the message waits in
its queue), and a job's first run in an image pulls it anyway. Each host records what its pull did
(gpus.models.ImagePull), shown in the admin.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from gpus.images import runnable_text
from gpus.models import ContainerImage, Server
from jobs.tasks import pull_images
from portal.errors import Invalid
from portal.unreachable import outage_of

log = logging.getLogger(__name__)


def image_named(name: str | None, *, labs: bool = False) -> ContainerImage | None:
    """The image of that name (prefetched servers); None for no name: on the host. `labs`: the
    refusal suggests only images a lab opens in."""
    name = (name or "").strip()
    if not name:
        return None
    image = ContainerImage.objects.filter(name=name).prefetch_related("servers").first()
    if image is None:
        raise Invalid(
            f"There is no image {name!r}; choose one of {_runnable_images(labs=labs)}.", field="image"
        )
    return image


def image_check(
    name: str | None, server: Server | None, *, fix: str = "book", labs: bool = False
) -> ContainerImage | None:
    """The image of that name if it can run on `server` now (it has the image, and containers
    work there: ContainerImage.objects.runnable), or, `server` None, on some server. Refused
    naming the field `image`, with the images that can run and the servers each runs on (`labs`:
    those a JupyterLab opens in, ContainerImage.objects.for_labs: a lab's refusal never suggests
    an image it would refuse next); `fix` says how to get elsewhere ("book", "queue it on")."""
    image = image_named(name, labs=labs)
    if image is None:
        return None
    where = f"{fix} a server where {image.name} runs: {runnable_text([image])}"
    if server is None:
        if not ContainerImage.objects.runnable().filter(pk=image.pk).exists():
            raise Invalid(
                f"No server can run image {image.name} now: none that has it has working containers. "
                f"Choose one of {_runnable_images(labs=labs)}.",
                field="image",
            )
    elif not server.containers_ok:
        found = f" ({server.containers_detail})" if server.containers_detail else ""
        raise Invalid(
            f"Containers do not work on {server.name}{found}, so no image runs there: leave the image "
            f"empty, or {where}.",
            field="image",
        )
    elif not any(s.pk == server.pk for s in image.servers.all()):
        others = _runnable_images(server, labs=labs)
        raise Invalid(
            f"{server.name} does not have image {image.name}; choose one of {others}, or {where}.",
            field="image",
        )
    return image


def _runnable_images(server: Server | None = None, *, labs: bool = False) -> str:
    """The images a job (`labs`: a lab) can run in (on `server`, if given), with their servers,
    for a refusal."""
    images = ContainerImage.objects.for_labs(server) if labs else ContainerImage.objects.runnable(server)
    return runnable_text(images.prefetch_related("servers"))


@dataclass(frozen=True)
class PullSent:
    """One host's message: which images it was asked to pull, or why it could not be asked."""

    server: str
    queue: str
    images: list[str]
    error: str = ""

    def __str__(self) -> str:
        names = ", ".join(self.images)
        if self.error:
            return f"{self.server}: NOT sent ({self.error}); images {names}"
        return f"{self.server}: {names} (sent to {self.queue})"


def images_pull_send(*, images: Sequence[str] = (), servers: Sequence[str] = ()) -> list[PullSent]:
    """One pull_images message per server that has any of `images` (by name; none: every image),
    limited to `servers` (by name; none: all of them). Unknown names: Invalid naming `image` or
    `server`, nothing sent. Returns what was sent where, a send that failed included."""
    chosen = _named(ContainerImage.objects.all(), images, "image")
    hosts = _named(Server.objects.all(), servers, "server")
    wanted: dict[Server, list[ContainerImage]] = defaultdict(list)
    through = ContainerImage.servers.through.objects.filter(containerimage__in=chosen, server__in=hosts)
    for row in through.select_related("containerimage", "server").order_by(
        "server__name", "containerimage__name"
    ):
        wanted[row.server].append(row.containerimage)
    return [_send(server, found) for server, found in wanted.items()]


def _named(queryset, names: Sequence[str], field: str):  # type: ignore[no-untyped-def]
    """The rows of these names (none given: every row); Invalid naming the unknown ones."""
    if not names:
        return queryset
    found = queryset.filter(name__in=names)
    unknown = sorted(set(names) - set(found.values_list("name", flat=True)))
    if unknown:
        known = ", ".join(queryset.values_list("name", flat=True)) or "none yet"
        raise Invalid(f"No {field} named {', '.join(unknown)}; choose from {known}.", field=field)
    return found


def _send(server: Server, images: list[ContainerImage]) -> PullSent:
    names = [image.name for image in images]
    try:
        pull_images.apply_async(args=[server.pk, [image.pk for image in images]], queue=server.queue)
    except Exception as exc:  # the broker away: said, never a 500 (the admin and the command show it)
        log.warning(
            "Could not send the pull of %s to %s: %r",
            names,
            server.queue,
            exc,
            exc_info=outage_of(exc) is None,
        )
        return PullSent(server.name, server.queue, names, error=str(exc) or type(exc).__name__)
    log.info("Sent the pull of %s to %s", ", ".join(names), server.queue)
    return PullSent(server.name, server.queue, names)

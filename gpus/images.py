"""The container image catalogue's reads and writes (gpus.models.ContainerImage, ImagePull):
where each image can run, the words that list them, and the pre-pulls' outcomes."""

from __future__ import annotations

from collections.abc import Iterable

from django.utils import timezone

from gpus.models import ContainerImage, ImagePull, Server


def runnable_servers(image_ids: Iterable[int]) -> dict[int, set[int]]:
    """{image id: the ids of its servers where containers work}, one query: where the queue may
    place a job in each image (an image on no such server: an empty set)."""
    found: dict[int, set[int]] = {pk: set() for pk in image_ids}
    through = ContainerImage.servers.through.objects.filter(
        containerimage_id__in=list(found), server__containers_ok=True
    )
    for image_id, server_id in through.values_list("containerimage_id", "server_id"):
        found[image_id].add(server_id)
    return found


def runnable_text(images: Iterable[ContainerImage]) -> str:
    """ "tf-2.17, pytorch-2.5 (on gpu-01)": the images with the servers each runs on, for the
    messages that list the allowed images (prefetch servers)."""
    text = []
    for image in images:
        servers = sorted(s.name for s in image.servers.all() if s.containers_ok)
        text.append(f"{image.name} (on {', '.join(servers)})" if servers else image.name)
    return ", ".join(text) or "(none: no image is on a server where containers work; ask an admin)"


def image_pull_record(*, image: ContainerImage, server: Server, ok: bool, detail: str) -> ImagePull:
    """The outcome of a pull, kept as the pair's last (its words cut to the column)."""
    row, _ = ImagePull.objects.update_or_create(
        image=image, server=server, defaults={"ok": ok, "detail": detail[:1000], "at": timezone.now()}
    )
    return row

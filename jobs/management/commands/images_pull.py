"""`manage.py images_pull [--image NAME] [--server NAME] [--here]`: pre-pull the container images
on their hosts (docs/containers.md). Without --here it sends one message per host that has them
(the admin's "Pull on every host now") and says what it sent; with --here, on a GPU host, it pulls
in this process and says how each pull went."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from gpus.models import Server
from jobs.images import images_pull_send
from jobs.tasks import pull_images_now
from portal.errors import Invalid


class Command(BaseCommand):
    help = (
        "Pre-pull container images on the hosts that have them: one message per host (or, with "
        "--here, pull on this host now)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--image", action="append", default=[], metavar="NAME", help="only this image (repeatable)"
        )
        parser.add_argument(
            "--server", action="append", default=[], metavar="NAME", help="only this server (repeatable)"
        )
        parser.add_argument(
            "--here",
            action="store_true",
            help="pull on this host now, in this process (the server: --server, else WORKER_SERVER)",
        )

    def handle(self, *args: Any, image: list[str], server: list[str], here: bool, **options: Any) -> None:
        if here:
            self._here(image, server)
            return
        try:
            sent = images_pull_send(images=image, servers=server)
        except Invalid as exc:
            raise CommandError(exc.message) from None
        if not sent:
            self.stdout.write("Nothing to pull: no server has these images (set them in the admin).")
        for one in sent:
            self.stdout.write(f"Sent: {one}" if not one.error else str(one))
        if any(one.error for one in sent):
            raise CommandError("Some hosts could not be told; run it again once the broker answers.")

    def _here(self, images: list[str], servers: list[str]) -> None:
        if len(servers) > 1:
            raise CommandError("--here pulls on this host only: give at most one --server.")
        name = servers[0] if servers else settings.WORKER_SERVER
        host = Server.objects.filter(name=name).first()
        if host is None:
            raise CommandError(f"No server named {name!r}; give this host's with --server.")
        wanted = host.images.filter(name__in=images) if images else host.images.all()
        missing = sorted(set(images) - set(wanted.values_list("name", flat=True)))
        if missing:
            raise CommandError(f"{', '.join(missing)} not listed for {name}; add it to {name} in the admin.")
        ids = list(wanted.values_list("pk", flat=True))
        pulled = pull_images_now(host.pk, ids)  # the host's task, run here: it records each as well
        for image, ok, detail in sorted(pulled):
            self.stdout.write(f"{image}: {'pulled' if ok else 'FAILED'}: {detail}")
        if len(pulled) < len(ids) or not all(ok for _, ok, _ in pulled):
            raise CommandError("Some images could not be pulled (above).")

"""The world of tests/test_access_matrix.py: its roles, alice's private markers, the people made
once for the file (Cast) and the things of alice's made on first use (World)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.test import Client, override_settings
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.models import GPU, ContainerImage, Reservation, Violation
from gpus.services import server_report_ingest
from jobs.models import InteractiveSession, Job
from jobs.sessions.services import session_start
from jobs.submit import ScriptUpload, job_submit
from portal.channels import channel_create
from portal.models import ApiToken, Membership, Notification, NotificationChannel, Team
from portal.notifications import notification_send
from portal.services import api_token_create
from tests.factories import MembershipFactory, TeamFactory, UserFactory, make_snapshot

ROLES = ("anonymous", "owner", "teammate", "outsider", "leader", "admin")

# Markers in the owner's private things; PRIVATE_FROM says who must never see each.
BOOKING_NOTE = "note-of-alices-booking"
JOB_NAME = "alices_private_run.py"
QUEUED_JOB_NAME = "alices_queued_run.py"
VIOLATION_COMMAND = "alices-violating-command"
NOTIFICATION_SUBJECT = "alices-private-notification"
SESSION_COMMAND = "alices_private_session.py"
CHANNEL_SECRET = "alicesChannelHookKey42"
PRIVATE_FROM = {
    BOOKING_NOTE: {"anonymous", "outsider"},  # teammates see the team's bookings
    JOB_NAME: {"anonymous", "teammate", "outsider"},  # owner, leaders, admins
    QUEUED_JOB_NAME: {"anonymous", "outsider"},  # the queue names teammates' jobs (docs/queue.md)
    VIOLATION_COMMAND: {"anonymous", "teammate", "outsider"},  # caused, own booking, leaders, admins
    NOTIFICATION_SUBJECT: {"anonymous", "teammate", "outsider", "leader", "admin"},  # hers alone
    SESSION_COMMAND: {"anonymous", "teammate", "outsider"},  # owner, leaders, admins (as jobs)
    CHANNEL_SECRET: set(ROLES),  # a channel URL's key: stored encrypted, shown masked to everyone
}


@dataclass(frozen=True)
class Cast:
    """The rows every case starts with, made once for the module (`cast`): the people of World
    by role (user ids), their team and a signed-in session of each."""

    team: int
    users: dict[str, int]
    sessions: dict[str, str]


def _cast_make() -> Cast:
    team = TeamFactory(name="Vision Lab", slug="vision-lab")
    leader = Membership.Role.LEADER
    users = {
        "owner": MembershipFactory(team=team, user=UserFactory(username="alice")).user,
        "teammate": MembershipFactory(team=team, user=UserFactory(username="bob")).user,
        "outsider": MembershipFactory(user=UserFactory(username="charlie")).user,
        "leader": MembershipFactory(team=team, user=UserFactory(username="leader"), role=leader).user,
        "admin": UserFactory(username="admin", is_staff=True, is_superuser=True),
    }
    sessions = {}
    for role, user in users.items():  # as a browser holds one: signed in once, its cookie sent
        client = Client()
        client.force_login(user)
        sessions[role] = client.cookies[settings.SESSION_COOKIE_NAME].value
    return Cast(team=team.pk, users={role: user.pk for role, user in users.items()}, sessions=sessions)


@contextlib.contextmanager
def cast_held(django_db_blocker) -> Iterator[Cast]:  # type: ignore[no-untyped-def]
    """The Cast, made in a transaction held open for the block and rolled back after it (for a
    module-scoped fixture). Each case runs in a savepoint inside it (pytest-django's), rolled
    back after the case: what a case writes, to these rows too, is gone before the next, as if
    each had made them."""
    with django_db_blocker.unblock(), transaction.atomic():
        with override_settings(PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"]):
            made = _cast_make()
        yield made
        transaction.set_rollback(True)


class World:
    """alice (the owner) in Vision Lab with bob (teammate) and its leader; charlie in another
    team; an admin (the Cast: read here as they stand). box1 with two cards, alice's active
    booking of its GPU 0, her job on it, a violation of hers on it and a notification: each
    made on first use."""

    def __init__(self, cast: Cast) -> None:
        self.cast = cast

    @cached_property
    def team(self) -> Team:
        return Team.objects.get(pk=self.cast.team)

    def _person(self, role: str) -> Any:
        return get_user_model().objects.get(pk=self.cast.users[role])

    @cached_property
    def alice(self) -> Any:
        return self._person("owner")

    def user(self, role: str) -> Any:
        return getattr(self, role)

    @property
    def anonymous(self) -> None:
        return None

    @property
    def owner(self) -> Any:
        return self.alice

    @cached_property
    def teammate(self) -> Any:
        return self._person("teammate")

    @cached_property
    def outsider(self) -> Any:
        return self._person("outsider")

    @cached_property
    def leader(self) -> Any:
        return self._person("leader")

    @cached_property
    def admin(self) -> Any:
        return self._person("admin")

    @cached_property
    def box(self) -> list[GPU]:
        """Reporting now: a host is offline SERVER_OFFLINE_AFTER_SECONDS after its last report,
        sooner than this file runs, so each case has its own (not the Cast's)."""
        server_report_ingest(snapshot=make_snapshot("box1", gpus=2))
        return list(GPU.objects.filter(server__name="box1").order_by("index"))

    @cached_property
    def image(self) -> ContainerImage:
        """A container image on box1 (the catalogue: every member reads it, nobody writes it)."""
        image = ContainerImage.objects.create(name="tf-2.17", reference="registry.lab.example/tf:2.17")
        image.servers.set([self.box[0].server])
        return image

    @cached_property
    def booking(self) -> Reservation:
        """alice's active 8 GiB booking of box1 GPU 0 (active: the owner can release it)."""
        return reservation_create(user=self.alice, gpus=[self.box[0].uuid], memory_mb=8192, note=BOOKING_NOTE)

    @cached_property
    def job(self) -> Job:
        script = ScriptUpload(name=JOB_NAME, content=b"print('hello')\n")
        return job_submit(user=self.alice, reservation=self.booking, script=script)

    @cached_property
    def queued_job(self) -> Job:
        script = ScriptUpload(name=QUEUED_JOB_NAME, content=b"print('hello')\n")
        self.box  # noqa: B018 - a server to queue for
        return job_submit(user=self.alice, gpu_count=1, time_limit_minutes=60, script=script)

    @cached_property
    def violation(self) -> Violation:
        now = timezone.now()
        gpu = self.box[0]
        return Violation.objects.create(
            kind=Violation.Kind.OVER_MEMORY, gpu=gpu, server=gpu.server, pid=4242, user=self.alice,
            job_id=self.job.pk, reservation=self.booking, command=VIOLATION_COMMAND, memory_mb=9000,
            booked_mb=8192, first_seen=now, last_seen=now,
        )  # fmt: skip

    @cached_property
    def notification(self) -> Notification:
        kind = Notification.Kind.OVER_MEMORY
        return notification_send(user=self.alice, kind=kind, subject=NOTIFICATION_SUBJECT, body="-", url="/")

    @cached_property
    def session(self) -> InteractiveSession:
        """alice's `gpu exec` on her booking, starting (its command not recorded yet)."""
        command = ["python", SESSION_COMMAND]
        return session_start(
            user=self.alice, reservation=self.booking.pk, kind="exec", host="box1", command=command
        )[0]

    @cached_property
    def token(self) -> ApiToken:
        return api_token_create(user=self.alice, name="laptop", expires_at=None)[0]

    @cached_property
    def channel(self) -> NotificationChannel:
        """alice's own webhook; nothing listens there, so a test send fails at once. Loopback is
        inside the portal's network: allowed here (`_channels_to_loopback`)."""
        return channel_create(by=self.alice, url=f"json://127.0.0.1:9/hooks/{CHANNEL_SECRET}")

    def populate(self) -> None:
        """Everything of alice's, for the pages that list what someone may see."""
        names = ("violation", "notification", "queued_job", "session", "channel")  # a violation: booking, job
        for name in names:
            getattr(self, name)

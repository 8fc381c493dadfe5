"""Bookings of whole nodes of a Slurm cluster (issue 37; docs/slurm.md).

Slurm 22.05 reserves whole nodes, not a GPU count, so a booking on a cluster is every card of some
of its nodes (`slurm_nodes_book`): an ordinary portal booking (quotas, reports, the calendar count
it as any other), which Slurm then holds as a reservation for its owner's Unix account,
`portal-<instance>-<booking id>`. Jobs submitted in the booking go with `--reservation`; nobody else's job
runs on those nodes while it lasts.

The reservation is made and removed by the cluster's worker on its login node, which holds the
operator credential (root there): a pass over the rows every round (`slurm_reservations_sync`,
run by `SlurmReservationSync`), so a booking made or cancelled while the worker was away is
caught up when it is back. What Slurm refuses (nodes busy at the start, an unknown account) is
kept on the booking (`slurm_error`) and said on its page and to jobs submitted in it.
"""

from __future__ import annotations

import logging
import pwd
import re
from collections.abc import Sequence
from datetime import datetime

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import close_old_connections, transaction
from django.db.models import Q
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.models import GPU, Reservation, Server, SlurmNode
from gpus.slurm_cli import SlurmCommands, SlurmError, SlurmRefused, SlurmUnreachable, records
from gpus.slurm_inventory import commands_for
from portal.accounts import unix_account_name
from portal.errors import Invalid
from portal.names import SLURM_NAME_INSTANCE, instance_label
from portal.periodic import PeriodicThread, start_thread

log = logging.getLogger(__name__)

NOT_FOUND = "Reservation not found"  # what scontrol says of a reservation already gone
ACCOUNT = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\Z")  # a POSIX login name


def reservation_name(booking_id: int) -> str:
    """`portal-<instance>-<booking id>`: with this portal's instance (portal.names.instance_label),
    since two portals on one cluster number their bookings alike, and one would take the other's
    reservation for its own (`_held`), then delete it at its own booking's end. The instance's
    characters are cut to SLURM_NAME_INSTANCE: the name fits `Reservation.slurm_reservation`."""
    return f"portal-{instance_label(SLURM_NAME_INSTANCE)}-{booking_id}"


def slurm_nodes_book(
    *,
    user: AbstractBaseUser,
    server: str,
    nodes: Sequence[str],
    start: datetime | None = None,
    end: datetime | None = None,
    note: str = "",
    team: str | None = None,
    now: datetime | None = None,
) -> Reservation:
    """Book every card of `nodes` of the Slurm cluster `server` for `user`: whole nodes only, as
    Slurm 22.05 reserves them. Every rule of a booking holds (reservation_create); Invalid naming
    the field otherwise, and nothing written."""
    cluster = Server.objects.filter(name=server, kind=Server.Kind.SLURM).first()
    if cluster is None:
        raise Invalid(f"There is no Slurm cluster {server!r}; whole nodes are booked on one.", field="server")
    wanted = sorted(set(nodes))
    if not wanted:
        raise Invalid("Name the nodes to book: a Slurm cluster is booked by whole nodes.", field="nodes")
    known = dict(SlurmNode.objects.filter(server=cluster, name__in=wanted).values_list("name", "state"))
    if missing := [n for n in wanted if n not in known]:
        raise Invalid(f"{server} has no node {missing[0]}; pick one of its nodes.", field="nodes")
    if down := [n for n, state in known.items() if state == SlurmNode.State.DOWN]:
        raise Invalid(f"Node {down[0]} is down in Slurm; pick another node.", field="nodes")
    cards = list(GPU.objects.filter(server=cluster, node__in=wanted).values_list("uuid", flat=True))
    if bare := sorted(set(wanted) - set(GPU.objects.filter(uuid__in=cards).values_list("node", flat=True))):
        raise Invalid(f"Node {bare[0]} has no GPUs; the portal books GPU nodes only.", field="nodes")
    if unix_account_name(user) is None:
        raise Invalid(
            "You have no Unix account the portal can vouch for, and Slurm reserves nodes for one: an admin "
            "sets yours on your profile.",
            field="nodes",
        )
    return reservation_create(
        user=user, gpus=cards, start=start, end=end, note=note, team=team, now=now, whole_nodes=True
    )


def booking_nodes(booking: Reservation) -> list[str]:
    return sorted(set(booking.allocations.values_list("gpu__node", flat=True)))


def _slurm_time(at: datetime, now: datetime) -> str:
    """Slurm's time on the login node: its own local clock, to the second; `now` if past."""
    return (
        "now"
        if at <= now
        else timezone.localtime(at, timezone.get_default_timezone()).strftime("%Y-%m-%dT%H:%M:%S")
    )


def slurm_reservations_sync(*, server: Server, commands: SlurmCommands, now: datetime | None = None) -> dict:
    """The cluster's worker's pass: a Slurm reservation made for each live booking of whole nodes
    that has none yet, and removed for each that was cancelled, released or is over. Safe to run
    again: each step is decided from the row and recorded on it."""
    now = now or timezone.now()
    mine = Reservation.objects.filter(allocations__gpu__server=server).distinct()
    live = Q(cancelled_at__isnull=True, end__gt=now)
    done = {"made": 0, "removed": 0, "refused": 0}
    try:
        for booking in mine.filter(live, slurm_reservation="", slurm_error="").select_related("owner"):
            done["made" if _make(booking, commands, now) else "refused"] += 1
        for booking in mine.exclude(live).exclude(slurm_reservation=""):
            done["removed"] += _remove(booking, commands)
    except SlurmUnreachable as exc:  # the rest waits for the next pass; what was done stays recorded
        log.warning("Slurm reservations of %s: the pass stopped, Slurm does not answer: %s", server.name, exc)
    return done


def _make(booking: Reservation, commands: SlurmCommands, now: datetime) -> bool:
    name = reservation_name(booking.pk)
    account = unix_account_name(booking.owner) or ""
    if not ACCOUNT.match(account):  # one account, never a list Slurm would read as several users
        Reservation.objects.filter(pk=booking.pk).update(
            slurm_error=f"The owner's Unix account {account!r} is no account name Slurm can reserve for."[
                :500
            ]
        )
        return False
    if _system_account(account):  # as for its jobs (jobs/host/slurm_runner.py): never root's nodes
        Reservation.objects.filter(pk=booking.pk).update(
            slurm_error=f"The owner's Unix account {account!r} is a system account (uid below JOB_MIN_UID); "
            "an admin sets theirs on their profile."
        )
        return False
    args = [
        "create",
        "reservation",
        f"ReservationName={name}",
        f"StartTime={_slurm_time(booking.start, now)}",
        f"EndTime={_slurm_time(booking.end, now)}",
        f"Users={account}",
        f"Nodes={','.join(booking_nodes(booking))}",
    ]
    try:
        commands.run("scontrol", args)
    except SlurmRefused as exc:
        if _held(commands, name):  # made by a pass whose answer or record was lost: the name is ours
            Reservation.objects.filter(pk=booking.pk).update(slurm_reservation=name)
            return True
        Reservation.objects.filter(pk=booking.pk).update(
            slurm_error=f"Slurm would not reserve them: {exc}"[:500]
        )
        log.warning("Booking %s: Slurm refused its reservation: %s", booking.pk, exc)
        return False
    Reservation.objects.filter(pk=booking.pk).update(slurm_reservation=name)
    return True


def _system_account(name: str) -> bool:
    """Below JOB_MIN_UID on this login node (root among them); an account it does not know is
    Slurm's to refuse, in its own words."""
    try:
        return pwd.getpwnam(name).pw_uid < settings.JOB_MIN_UID
    except KeyError:
        return False


def _held(commands: SlurmCommands, name: str) -> bool:
    """Whether Slurm holds reservation `name`: Slurm 22.05 says a second create of it overlaps
    (its own nodes), not that the name is taken."""
    try:
        return any(r.get("ReservationName") == name for r in records(commands.show("reservation", name)))
    except SlurmRefused:
        return False


def _remove(booking: Reservation, commands: SlurmCommands) -> int:
    try:
        commands.run("scontrol", ["delete", f"ReservationName={booking.slurm_reservation}"])
    except SlurmRefused as exc:
        if NOT_FOUND.lower() not in str(exc).lower():  # already gone (it ended in Slurm): done too
            log.warning("Booking %s: Slurm kept its reservation: %s", booking.pk, exc)
            return 0
    Reservation.objects.filter(pk=booking.pk).update(slurm_reservation="")
    return 1


class SlurmReservationSync(PeriodicThread):
    """The pass, every few seconds, on the cluster's worker (GPU_BACKEND=slurm)."""

    def __init__(self, server_name: str, interval: float = 2.0) -> None:
        super().__init__("slurm-reservations", interval)
        self.server_name = server_name

    def step(self) -> None:
        close_old_connections()
        server = Server.objects.select_related("slurm").filter(name=self.server_name).first()
        if server is None or not hasattr(server, "slurm"):
            return
        try:
            with transaction.atomic():
                slurm_reservations_sync(server=server, commands=commands_for(server.slurm))
        except SlurmError as exc:
            log.warning("Slurm reservations of %s not synced: %s", self.server_name, exc)


def start_reservation_sync(server_name: str) -> None:
    start_thread(SlurmReservationSync(server_name))

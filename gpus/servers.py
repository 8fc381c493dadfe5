"""What admins do with a server, and how one joins.

A GPU host is never added by hand: its worker's first report registers it (gpus/services.py), with
the name, driver, CPUs and cards it reads itself. HOST_JOIN is what to run on the host, the words
the admin's server list and an admin's empty dashboard show, and docs/deploy.md's steps (a test
holds them together). Only a Slurm cluster is added in the admin, because its worker needs its
Slurm settings before it can report (docs/slurm.md).

Draining is the admins': no new bookings of its cards, no new job starts there (not even on a
booking made before), queued jobs that asked for it wait; what is booked or running goes on.
"""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from gpus.models import Allocation, Server
from portal.access import is_admin
from portal.changes import TELEMETRY, change_publish
from portal.clock import db_now
from portal.errors import Forbidden, Invalid
from portal.models import AuditEntry

# What an admin runs on a new GPU host, as docs/deploy.md says ("Install on a GPU host").
HOST_JOIN_UNIT = "cp deploy/gpu-portal-worker.service /etc/systemd/system/"
HOST_JOIN_START = "systemctl daemon-reload && systemctl enable --now gpu-portal-worker"
HOST_JOIN = (
    "A GPU host joins by itself: install the portal's checkout on it with the portal host's "
    "/etc/gpu-portal/env (docs/deploy.md, “Install on a GPU host”), then, as root, "
    f"“{HOST_JOIN_UNIT} && {HOST_JOIN_START}”. Its first report registers it here within seconds, "
    "named by WORKER_SERVER (default: its short host name)."
)
DRAIN_MEANS = (
    "No new bookings of its cards, and no new job starts there, not even on a booking made before; "
    "queued jobs that asked for it wait. Bookings already made stay (their owners may still extend "
    "or release them), and running jobs go on to their end."
)
REASON_MAX = Server._meta.get_field("drain_reason").max_length


@transaction.atomic
def server_drain_set(*, actor: AbstractBaseUser, server: Server, draining: bool, reason: str = "") -> bool:
    """Drain the server (with why, shown to people who would book it) or put it back in service.
    Audited; False, with nothing written, when it is so already."""
    if not is_admin(actor):
        raise Forbidden("Only admins drain a server or put it back in service; ask one.")
    if "\x00" in reason:  # PostgreSQL text cannot hold it (a 500 there); SQLite would keep it
        raise Invalid("The reason holds a NUL character; write it without one.", field="reason")
    reason = " ".join(reason.split()) if draining else ""
    if len(reason) > REASON_MAX:
        raise Invalid(f"Keep the reason to {REASON_MAX} characters at most.", field="reason")
    changed = Server.objects.filter(pk=server.pk, draining=not draining).update(
        draining=draining, drain_reason=reason
    )
    if not changed:
        return False
    server.draining, server.drain_reason = draining, reason
    held = bookings_held(server)
    if draining:
        message = f"{actor} drained {server}" + (f": {reason}" if reason else "")
        message += f" ({held} booking(s) on it go on)"
    else:
        message = f"{actor} put {server} back in service"
    AuditEntry.objects.create(
        actor=actor,
        action=AuditEntry.Action.SERVER_DRAIN,
        target=f"server {server.name}",
        message=message,
        data={"server": server.name, "draining": draining, "reason": reason, "bookings": held},
    )
    change_publish(TELEMETRY, server=server.pk)  # once committed: the dashboard shows the badge
    return True


def bookings_held(server: Server) -> int:
    """The bookings holding a card of `server` now or later: what a drain lets go on."""
    live = Allocation.objects.filter(live=True, gpu__server=server, end__gt=db_now())
    return live.values("reservation_id").distinct().count()

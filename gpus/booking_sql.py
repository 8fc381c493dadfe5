"""The three reads every booking makes while it holds its locks, in plain SQL.

Why not the ORM here: on the 2-core reference machine one ORM query costs 1.1-1.6 ms of
client CPU against 0.14-0.3 ms for the same statement through the cursor, and each
booking makes several of these with row locks held (bench/bench_booking.py). The SQL is
portable: `FOR UPDATE` is added only where the database has it (PostgreSQL; SQLite
serialises writers with BEGIN IMMEDIATE instead), and datetimes go through Django's own
adapters both ways.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from django.db import connection

from gpus.models import GPU, Server
from portal.models import Membership, Team

if TYPE_CHECKING:
    from gpus.booking import Held


def _for_update(of: str) -> str:
    if not connection.features.has_select_for_update:
        return ""
    return f" FOR UPDATE OF {of}" if connection.features.has_select_for_update_of else " FOR UPDATE"


def _placeholders(values: Sequence[object]) -> str:
    return ", ".join(["%s"] * len(values))


def _db_time(value: datetime) -> object:
    return connection.ops.adapt_datetimefield_value(value)


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)  # SQLite hands back naive UTC


def membership_for_update(
    user_id: int, *, team_id: int | None = None, team_slug: str | None = None
) -> Membership | None:
    """The user's membership (of `team_id`/`team_slug`, else their first team by name), row-locked,
    with its team attached."""
    where, params = "m.user_id = %s", [user_id]
    if team_id is not None:
        where, params = where + " AND m.team_id = %s", [*params, team_id]
    elif team_slug:
        where, params = where + " AND t.slug = %s", [*params, team_slug]
    sql = (
        "SELECT m.id, m.role, m.max_cards, m.max_gb, m.gpu_hours_per_week, m.max_booking_hours,"
        " t.id, t.name, t.slug, t.max_cards, t.max_gb, t.gpu_hours_per_week"
        " FROM portal_membership m JOIN portal_team t ON t.id = m.team_id"
        f" WHERE {where} ORDER BY t.name LIMIT 1{_for_update('m')}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    if row is None:
        return None
    team = Team(
        id=row[6], name=row[7], slug=row[8], max_cards=row[9], max_gb=row[10], gpu_hours_per_week=row[11]
    )
    membership = Membership(
        id=row[0],
        user_id=user_id,
        team_id=team.pk,
        role=row[1],
        max_cards=row[2],
        max_gb=row[3],
        gpu_hours_per_week=row[4],
        max_booking_hours=row[5],
    )
    membership.team = team
    return membership


def gpus_for_update(uuids: Sequence[str]) -> list[GPU]:
    """The cards, row-locked in UUID order (the one lock order every booking uses), with their
    server attached. Only the fields the booking rules read are loaded."""
    sql = (
        'SELECT g.uuid, g."index", g.name, g.memory_total_mb, g.memory_reserved_mb,'
        " s.id, s.name, s.draining"
        " FROM gpus_gpu g JOIN gpus_server s ON s.id = g.server_id"
        f" WHERE g.uuid IN ({_placeholders(uuids)}) ORDER BY g.uuid{_for_update('g')}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, list(uuids))
        rows = cursor.fetchall()
    gpus = []
    for uuid, index, name, total, reserved, server_id, server_name, draining in rows:
        gpu = GPU(uuid=uuid, index=index, name=name, memory_total_mb=total, memory_reserved_mb=reserved)
        gpu.server = Server(id=server_id, name=server_name, draining=bool(draining))
        gpus.append(gpu)
    return gpus


def allocations_on(
    uuids: Sequence[str], start: datetime, end: datetime, *, exclude: int | None = None
) -> dict[str, list[Held]]:
    """Live allocations on these cards overlapping [start, end), by card UUID, oldest first."""
    from gpus.booking import Held

    sql = (
        'SELECT gpu_id, start, "end", memory_mb FROM gpus_allocation'
        f' WHERE live = %s AND gpu_id IN ({_placeholders(uuids)}) AND "end" > %s AND start < %s'
    )
    params: list[object] = [True, *uuids, _db_time(start), _db_time(end)]
    if exclude is not None:
        sql += " AND reservation_id <> %s"
        params.append(exclude)
    held: dict[str, list[Held]] = defaultdict(list)
    with connection.cursor() as cursor:
        cursor.execute(sql + " ORDER BY start", params)
        for gpu_id, held_start, held_end, memory_mb in cursor.fetchall():
            held[gpu_id].append(Held(_aware(held_start), _aware(held_end), memory_mb))
    return held


def lock_team(team_id: int) -> None:
    """Row-lock the team so two bookings cannot both pass its quota (a no-op on SQLite)."""
    if connection.features.has_select_for_update:
        with connection.cursor() as cursor:
            cursor.execute("SELECT id FROM portal_team WHERE id = %s FOR UPDATE", [team_id])


def insert_reservation(
    *,
    owner_id: int,
    team_id: int,
    start: datetime,
    end: datetime,
    note: str,
    created_at: datetime,
    allocations: Sequence[tuple[str, int | None]],
) -> int:
    """Write a reservation and its (card UUID, memory MB) allocations; returns its id."""
    times = [_db_time(start), _db_time(end)]
    with connection.cursor() as cursor:
        cursor.execute(
            'INSERT INTO gpus_reservation (owner_id, team_id, start, "end", booked_end, note, created_at,'
            " cancel_reason) VALUES (%s, %s, %s, %s, %s, %s, %s, '') RETURNING id",
            [owner_id, team_id, *times, times[1], note, _db_time(created_at)],
        )
        reservation_id = cursor.fetchone()[0]
        rows = [[reservation_id, uuid, memory_mb, *times, True] for uuid, memory_mb in allocations]
        cursor.execute(
            'INSERT INTO gpus_allocation (reservation_id, gpu_id, memory_mb, start, "end", live) VALUES '
            + ", ".join(["(%s, %s, %s, %s, %s, %s)"] * len(rows)),
            [value for row in rows for value in row],
        )
    return reservation_id


def insert_audit(
    *, actor_id: int, team_id: int | None, action: str, target: str, message: str, data: dict, at: datetime
) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO portal_auditentry (at, actor_id, team_id, action, target, message, data)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s)",
            [
                _db_time(at),
                actor_id,
                team_id,
                action,
                target,
                message,
                connection.ops.adapt_json_value(data, None),
            ],
        )

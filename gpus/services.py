"""Writes to the inventory. The telemetry loop of every GPU host calls these."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, replace
from datetime import datetime, timedelta
from typing import NamedTuple

from django.conf import settings
from django.db import connection, transaction
from django.db.models.functions import Now
from django.db.models.sql import Query
from django.dispatch import Signal
from django.utils import timezone

from gpus.hooks import interactive_sessions, job_sessions
from gpus.inventory import CardState, GPUInfo, Snapshot
from gpus.models import GPU, GPUProcess, Server, SlurmNode, TelemetrySample
from gpus.sanitize import checked_snapshot
from gpus.selectors import GPU_LIVE_FIELDS, SERVER_LIVE_FIELDS
from gpus.usage import UsageRollup, usage_observe
from portal.changes import TELEMETRY, change_publish

# Sent once per telemetry round, inside its transaction, with `cards`: every reported card
# (GPUInfo, its processes carrying the job ids resolved from their sessions). A signal because
# the jobs app builds on gpus, not the reverse: jobs listens and writes its own rows.
telemetry_ingested = Signal()

_GPU_STATIC_FIELDS = [
    "server",  # values_list("server") reads the id
    "index",
    "name",
    "pci_bus_id",
    "memory_total_mb",
    "memory_reserved_mb",
    "mig_mode",
    "node",
]
_GPU_LIVE_FIELDS = [*GPU_LIVE_FIELDS, "updated_at"]  # the values below are written in this order
# The values below are written in this order; `last_seen` apart, as the database's `Now()`.
_SERVER_LIVE_FIELDS = [f for f in SERVER_LIVE_FIELDS if f != "last_seen"]


def _bulk_update(
    model: type, fields: list[str], key: str, rows: list[tuple], *, now_fields: Sequence[str] = ()
) -> None:
    """UPDATE many rows by `key` (each row: the fields' values, then the key's): raw SQL,
    because the ORM misses the ingest goal by ten times. `now_fields` are set to the database's
    `Now()` (compiled by Django for the backend), in the same statement.

    `make bench` (bench_inventory, one round of 64 reports / 512 GPUs, goal ≤ 50 ms): with
    `bulk_update` (a CASE per column and row) the round took 445 ms on SQLite and 570-750 ms on
    PostgreSQL; with this and `_bulk_insert`, 9-17 ms and 30-49 ms. Both are tested on both
    databases through the telemetry tests (`make test` on SQLite, CI on PostgreSQL).
    """
    if not rows:
        return
    quote, table = connection.ops.quote_name, connection.ops.quote_name(model._meta.db_table)
    columns = [model._meta.get_field(f) for f in [*fields, key]]
    now_sql, _ = Query(model).get_compiler(connection=connection).compile(Now())
    now_set = "".join(f", {quote(model._meta.get_field(f).column)} = {now_sql}" for f in now_fields)
    if connection.vendor == "postgresql":
        # One statement over arrays: PostgreSQL parses and plans it once for all rows.
        sources = ", ".join(f"unnest(%s::{c.db_type(connection)}[]) AS {quote(c.column)}" for c in columns)
        assignments = ", ".join(f"{quote(c.column)} = v.{quote(c.column)}" for c in columns[:-1])
        key_column = quote(columns[-1].column)
        sql = f"UPDATE {table} AS t SET {assignments}{now_set} FROM (SELECT {sources}) AS v"
        sql += f" WHERE t.{key_column} = v.{key_column}"
        with connection.cursor() as cursor:
            cursor.execute(sql, [list(values) for values in zip(*rows, strict=True)])
        return
    assignments = ", ".join(f"{quote(c.column)} = %s" for c in columns[:-1])
    with connection.cursor() as cursor:  # sqlite3 runs executemany in a C loop
        cursor.executemany(
            f"UPDATE {table} SET {assignments}{now_set} WHERE {quote(columns[-1].column)} = %s", rows
        )


def _bulk_insert(model: type, fields: list[str], rows: list[tuple]) -> None:
    """INSERT many rows (each row: the fields' values) in one statement over arrays on PostgreSQL.

    Raw for the same reason as `_bulk_update`: the process lists (1,024 rows a round in the
    bench) through `bulk_create` took the PostgreSQL round to 54-73 ms against 42-49 ms with
    this (goal ≤ 50 ms, measured side by side, 40 rounds each).
    """
    if not rows:
        return
    quote, table = connection.ops.quote_name, connection.ops.quote_name(model._meta.db_table)
    columns = [model._meta.get_field(f) for f in fields]
    names = ", ".join(quote(c.column) for c in columns)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            sources = ", ".join(f"unnest(%s::{c.db_type(connection)}[])" for c in columns)
            cursor.execute(
                f"INSERT INTO {table} ({names}) SELECT {sources}", [list(v) for v in zip(*rows, strict=True)]
            )
        else:
            cursor.executemany(
                f"INSERT INTO {table} ({names}) VALUES ({', '.join(['%s'] * len(columns))})", rows
            )


@transaction.atomic
def servers_report_ingest(
    *, snapshots: Sequence[Snapshot], now: datetime | None = None, rollup: UsageRollup | None = None
) -> None:
    """Record one telemetry round of many hosts in one transaction of bulk statements.

    The collector calls this with every host's latest report. Its cost is what the
    round's data costs: cards are created or re-described only when they are new or their
    hardware facts changed; the numbers that move every round are one set-based UPDATE per
    table (`_bulk_update`); process lists and chart points are one INSERT each (`_bulk_insert`).
    Re-running it with the same snapshots only moves `last_seen`; process lists are
    replaced, never appended to; `draining` belongs to the admins and is never touched.
    Every number is range-checked first (gpus.sanitize): one host's garbage costs that value,
    never the round. A lost or unresponsive card keeps its stored hardware facts. `rollup`: the
    collector's usage rollup (gpus/usage.py), which counts the round; none elsewhere.
    """
    checked = [c for c in map(checked_snapshot, snapshots) if c is not None]
    if not checked:
        return
    now = now or timezone.now()
    latest = {s.host.name: s for s in checked}  # a host's newer report wins
    db_now = connection.ops.adapt_datetimefield_value(now)
    known = _servers_register(latest)
    _servers_update_live(latest)
    cards = [(known[name].pk, g) for name, s in latest.items() for g in s.gpus]
    stored = _gpus_describe(cards)
    cards = _jobs_attribute([(server_id, g) for server_id, g in cards if g.uuid in stored])
    _gpus_update_live(cards, db_now)
    _processes_replace([k.pk for k in known.values()], cards)
    _slurm_nodes_replace(latest, known, now)
    # Inside the transaction: the jobs app records its running jobs' memory and utilization.
    telemetry_ingested.send(sender=GPUProcess, cards=[g for _, g in cards])
    _history_record(latest, known, now, stored)
    usage_observe(
        rollup=rollup, cards=cards, now=now
    )  # the usage rollup (gpus/usage.py): memory, a write a minute
    for server in known.values():  # once committed: open pages read the round (those of its server)
        change_publish(TELEMETRY, server=server.pk)


class _Known(NamedTuple):
    pk: int
    last_history_at: datetime | None


def _servers_register(latest: dict[str, Snapshot]) -> dict[str, _Known]:
    """Every reporting host's row, by name; new hosts get one (a racing collector's insert wins)."""

    def read() -> dict[str, _Known]:
        rows = Server.objects.filter(name__in=latest).values_list("name", "pk", "last_history_at")
        return {name: _Known(pk, at) for name, pk, at in rows}

    known = read()
    new_servers = [Server(name=name) for name in latest if name not in known]
    if new_servers:
        Server.objects.bulk_create(new_servers, ignore_conflicts=True)
        known = read()
    return known


def _servers_update_live(latest: dict[str, Snapshot]) -> None:
    """The host facts every report carries, and `last_seen`: one UPDATE for all hosts."""
    _bulk_update(
        Server,
        _SERVER_LIVE_FIELDS,
        "name",
        [
            (
                s.host.hostname,
                s.host.simulated,
                s.host.driver_version,
                s.host.cuda_version,
                s.host.cpu_count,
                s.host.ram_mb,
                name,
            )
            for name, s in latest.items()
        ],
        # The database's clock, which every reader of `last_seen` compares with (portal.clock):
        # the collector's host clock may be minutes off the web servers' and the scheduler's.
        now_fields=["last_seen"],
    )


def _card_facts(server_id: int, g: GPUInfo) -> tuple:
    """A card's hardware facts in `_GPU_STATIC_FIELDS` order, as values_list reads them back."""
    return (
        server_id,
        g.index,
        g.name,
        g.pci_bus_id,
        g.memory_total_mb,
        g.memory_reserved_mb,
        g.mig_mode or "",
        g.node,
    )


def _gpus_describe(cards: list[tuple[int, GPUInfo]]) -> set[str]:
    """Create new cards and re-describe changed ones (moved, renumbered, MIG mode changed):
    one SELECT, and an upsert only when something differs. Returns the UUIDs that have a row.

    A lost or unresponsive card reports placeholders, not facts: it is never created or
    re-described from them, so a card that fell off the bus keeps its name, memory and PCI id.
    """
    described = {
        row[0]: row[1:]
        for row in GPU.objects.filter(uuid__in=[g.uuid for _, g in cards]).values_list(
            "uuid", *_GPU_STATIC_FIELDS
        )
    }
    changed = [
        GPU(
            uuid=g.uuid,
            server_id=server_id,
            index=g.index,
            name=g.name,
            pci_bus_id=g.pci_bus_id,
            memory_total_mb=g.memory_total_mb,
            memory_reserved_mb=g.memory_reserved_mb,
            mig_mode=g.mig_mode or "",
            node=g.node,
        )
        for server_id, g in cards
        if g.state == CardState.OK and described.get(g.uuid) != _card_facts(server_id, g)
    ]
    if changed:
        GPU.objects.bulk_create(
            changed, update_conflicts=True, unique_fields=["uuid"], update_fields=_GPU_STATIC_FIELDS
        )
    return set(described) | {g.uuid for g in changed}


def _jobs_attribute(cards: list[tuple[int, GPUInfo]]) -> list[tuple[int, GPUInfo]]:
    """Each process's job, from its session (see gpus.procinfo): one question for the round."""
    sessions: dict[int, set[int]] = defaultdict(set)
    for server_id, g in cards:
        sessions[server_id].update(p.session_id for p in g.processes or () if p.session_id)
    if not any(sessions.values()):
        return cards
    jobs = job_sessions(dict(sessions))  # jobs knows its jobs, gpus only asks (gpus.hooks)
    interactive = interactive_sessions(dict(sessions))
    if not jobs and not interactive:
        return cards
    return [
        (
            server_id,
            g
            if g.processes is None
            else replace(
                g,
                processes=tuple(
                    replace(
                        p,
                        job_id=jobs.get((server_id, p.session_id)),
                        interactive_id=interactive.get((server_id, p.session_id)),
                    )
                    for p in g.processes
                ),
            ),
        )
        for server_id, g in cards
    ]


def _gpus_update_live(cards: list[tuple[int, GPUInfo]], db_now: object) -> None:
    """The numbers that move every round: one UPDATE for all cards."""
    _bulk_update(
        GPU,
        _GPU_LIVE_FIELDS,
        "uuid",
        [
            (
                g.memory_used_mb,
                g.utilization_pct,
                g.temperature_c,
                g.power_w,
                g.power_limit_w,
                g.state,
                g.processes is not None,
                g.slurm_job,
                db_now,
                g.uuid,
            )
            for _, g in cards
        ],
    )


def _slurm_nodes_replace(latest: dict[str, Snapshot], known: dict[str, _Known], now: datetime) -> None:
    """A Slurm cluster's nodes as its round read them, replaced (a delete and a bulk insert, as
    process lists are); a GPU host reports none and has none."""
    clusters = {name: s for name, s in latest.items() if s.nodes}
    if not clusters:
        return
    SlurmNode.objects.filter(server_id__in=[known[name].pk for name in clusters]).delete()
    SlurmNode.objects.bulk_create(
        SlurmNode(server_id=known[name].pk, updated_at=now, **asdict(n))
        for name, s in clusters.items()
        for n in s.nodes
    )


def _processes_replace(server_ids: list[int], cards: list[tuple[int, GPUInfo]]) -> None:
    """The reporting hosts' process lists, replaced (never appended to): a delete and a bulk insert."""
    GPUProcess.objects.filter(gpu__server_id__in=server_ids).delete()
    _bulk_insert(
        GPUProcess,
        # `started` with the pid is the process's identity (portal.pids): what a later look at
        # the row may compare with before it acts on that pid.
        [
            "gpu",
            "pid",
            "username",
            "command",
            "used_memory_mb",
            "session_id",
            "started",
            "job_id",
            "interactive_id",
        ],
        [
            (
                g.uuid,
                p.pid,
                p.username,
                p.command,
                p.used_memory_mb,
                p.session_id,
                p.started,
                p.job_id,
                p.interactive_id,
            )
            for _, g in cards
            for p in g.processes or ()
        ],
    )


def _history_record(
    latest: dict[str, Snapshot], known: dict[str, _Known], now: datetime, stored: set[str]
) -> None:
    """A chart point per card of the hosts whose last one is TELEMETRY_HISTORY_SECONDS old."""
    history_every = timedelta(seconds=settings.TELEMETRY_HISTORY_SECONDS)
    due = {name for name, (_, at) in known.items() if at is None or now - at >= history_every}
    if not due:
        return
    db_now = connection.ops.adapt_datetimefield_value(now)
    _bulk_insert(
        TelemetrySample,
        ["gpu", "at", "memory_used_mb", "utilization_pct", "temperature_c", "power_w"],
        [
            (g.uuid, db_now, g.memory_used_mb, g.utilization_pct, g.temperature_c, g.power_w)
            for name in due
            for g in latest[name].gpus
            if g.uuid in stored
        ],
    )
    Server.objects.filter(name__in=due).update(last_history_at=now)


def server_report_ingest(*, snapshot: Snapshot, now: datetime | None = None) -> Server:
    """Record one host's report on its own (tests, `report_telemetry --direct`)."""
    servers_report_ingest(snapshots=[snapshot], now=now)
    return Server.objects.get(name=snapshot.host.name)


def telemetry_prune(*, now: datetime | None = None) -> int:
    """Delete history older than TELEMETRY_RETENTION_HOURS; returns the rows deleted."""
    cutoff = (now or timezone.now()) - timedelta(hours=settings.TELEMETRY_RETENTION_HOURS)
    deleted, _ = TelemetrySample.objects.filter(at__lt=cutoff).delete()
    return deleted

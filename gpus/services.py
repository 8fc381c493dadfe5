"""Writes to the inventory. The telemetry loop of every GPU host calls these."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, replace
from datetime import datetime, timedelta
from typing import NamedTuple

from django.conf import settings
from django.db import connection, transaction
from django.dispatch import Signal
from django.utils import timezone

from gpus.bulk import rows_insert, rows_update
from gpus.hooks import interactive_sessions, job_sessions
from gpus.inventory import PROCESS_FIELDS, CardState, GPUInfo, ProcessInfo, Snapshot, process_values
from gpus.models import GPU, GPUProcess, Server, SlurmNode, TelemetrySample
from gpus.sanitize import checked_snapshot
from gpus.selectors import GPU_LIVE_FIELDS, SERVER_LIVE_FIELDS
from gpus.usage import UsageRollup, usage_observe
from portal.changes import TELEMETRY, changes_publish

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
# The values below are written in this order.
_GPU_LIVE_FIELDS = [*GPU_LIVE_FIELDS, "processes_digest", "updated_at"]
# The values below are written in this order; `last_seen` apart, as the database's `Now()`.
_SERVER_LIVE_FIELDS = [f for f in SERVER_LIVE_FIELDS if f != "last_seen"]


@transaction.atomic
def servers_report_ingest(
    *, snapshots: Sequence[Snapshot], now: datetime | None = None, rollup: UsageRollup | None = None
) -> None:
    """Record one telemetry round of many hosts in one transaction of bulk statements.

    The collector calls this with every host's latest report. Its cost is what the round's data
    costs, in a fixed number of statements however many hosts and cards (gpus/bulk.py): cards are
    created or re-described only when they are new or their hardware facts changed; the numbers
    that move every round are one UPDATE per table; a card's process list is written only when it
    differs from the stored one (`GPU.processes_digest`), and then replaced, never appended to.
    Re-running it with the same snapshots only moves `last_seen` and `updated_at`; `draining`
    belongs to the admins and is never touched. Every number is range-checked first
    (gpus.sanitize): one host's garbage costs that value, never the round. A lost or unresponsive
    card keeps its stored hardware facts. `rollup`: the collector's usage rollup (gpus/usage.py),
    which counts the round; none elsewhere.
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
    stored = _gpus_describe(cards, [k.pk for k in known.values()])
    cards = _jobs_attribute([(server_id, g) for server_id, g in cards if g.uuid in stored.digests])
    processes = {g.uuid: _process_rows(g) for _, g in cards}
    digests = {uuid: _digest(rows) for uuid, rows in processes.items()}
    _gpus_update_live(cards, digests, db_now)
    _processes_replace(processes, digests, stored)
    _slurm_nodes_replace(latest, known, now)
    # Inside the transaction: the jobs app records its running jobs' memory and utilization.
    telemetry_ingested.send(sender=GPUProcess, cards=[g for _, g in cards])
    _history_record(latest, known, now, stored.digests)
    usage_observe(
        rollup=rollup, cards=cards, now=now
    )  # the usage rollup (gpus/usage.py): memory, a write a minute
    # Once committed: open pages read the round (those of its servers), in one message batch.
    changes_publish(TELEMETRY, servers=[server.pk for server in known.values()])


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
    rows_update(
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


class _Stored(NamedTuple):
    digests: dict[str, str]  # each reported card that has a row: its process list's stored digest
    unreported: dict[str, str]  # the reporting servers' other cards (not in their reports): the same


def _gpus_describe(cards: list[tuple[int, GPUInfo]], server_ids: list[int]) -> _Stored:
    """Create new cards and re-describe changed ones (moved, renumbered, MIG mode changed): one
    SELECT of the reporting servers' cards (one more for cards not found there: new or moved), and
    an upsert only when something differs.

    A lost or unresponsive card reports placeholders, not facts: it is never created or
    re-described from them, so a card that fell off the bus keeps its name, memory and PCI id.

    The read row-locks the reporting servers' cards in UUID order, the order every booking locks
    them in (gpus.booking._locked_gpus): the round's UPDATEs lock the rows they change in
    whatever order the plan meets them, and a booking holding one card and waiting for another
    deadlocked with the round holding the second (PostgreSQL's "deadlock detected", a 500 on
    the booking, seen under concurrent bookings in the fault suite). FOR NO KEY UPDATE, what an
    UPDATE of these columns takes anyway: no stronger. Nothing on SQLite, whose writers take the
    whole database at once.
    """
    fields = ("uuid", *_GPU_STATIC_FIELDS, "processes_digest")
    ours = GPU.objects.select_for_update(no_key=True).filter(server_id__in=server_ids).order_by("uuid")
    described = {row[0]: row[1:] for row in ours.values_list(*fields)}
    reported = {g.uuid for _, g in cards}
    if missing := reported - described.keys():
        described |= {row[0]: row[1:] for row in GPU.objects.filter(uuid__in=missing).values_list(*fields)}
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
        if g.state == CardState.OK and described.get(g.uuid, ())[:-1] != _card_facts(server_id, g)
    ]
    if changed:
        GPU.objects.bulk_create(
            changed, update_conflicts=True, unique_fields=["uuid"], update_fields=_GPU_STATIC_FIELDS
        )
    digests = {uuid: row[-1] for uuid, row in described.items()}
    created = {card.uuid for card in changed} - digests.keys()  # a new row's digest is "" (unknown)
    return _Stored(
        digests={uuid: digests.get(uuid, "") for uuid in reported if uuid in digests or uuid in created},
        unreported={uuid: digest for uuid, digest in digests.items() if uuid not in reported},
    )


def _jobs_attribute(cards: list[tuple[int, GPUInfo]]) -> list[tuple[int, GPUInfo]]:
    """Each process's job, from its session (see gpus.procinfo): one question for the round."""
    sessions: dict[int, set[int]] = defaultdict(set)
    for server_id, g in cards:
        for p in g.processes or ():
            sessions[server_id].update(s for s in (p.session_id, p.parent_session_id) if s)
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
                        job_id=_by_session(jobs, server_id, p),
                        interactive_id=_by_session(interactive, server_id, p),
                    )
                    for p in g.processes
                ),
            ),
        )
        for server_id, g in cards
    ]


def _by_session(runs: dict[tuple[int, int], int], server_id: int, p: ProcessInfo) -> int | None:
    """The run of the process's session, else of the session it left (setsid: gpus.procinfo)."""
    found = runs.get((server_id, p.session_id)) if p.session_id else None
    if found is None and p.parent_session_id:
        found = runs.get((server_id, p.parent_session_id))
    return found


def _gpus_update_live(cards: list[tuple[int, GPUInfo]], digests: dict[str, str], db_now: object) -> None:
    """The numbers that move every round, and each card's process-list digest: one UPDATE."""
    rows_update(
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
                digests[g.uuid],
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


_NO_PROCESSES = "none"  # the digest of an empty list (or an unreadable one: no rows either)


def _process_rows(g: GPUInfo) -> list[tuple]:
    """Its processes' rows: the columns of PROCESS_FIELDS after the card's (`gpu`). `started` with
    the pid is the process's identity (portal.pids), what a later look may compare before it acts."""
    return [process_values(p) for p in g.processes or ()]


def _digest(rows: list[tuple]) -> str:
    """What a card's stored process rows are, in 24 characters: equal digests, equal rows. ""
    (a new card's, or one from before digests) is no digest: its rows are written afresh."""
    if not rows:
        return _NO_PROCESSES
    return hashlib.blake2b(repr(rows).encode(), digest_size=12).hexdigest()


def _processes_replace(processes: dict[str, list[tuple]], digests: dict[str, str], stored: _Stored) -> None:
    """The process lists that changed, replaced (never appended to): a DELETE and a COPY of those
    cards' rows, none at all when no list changed (a steady lab's usual round). The reporting
    servers' cards missing from their reports lose their rows, once."""
    changed = [uuid for uuid, digest in digests.items() if digest != stored.digests[uuid]]
    gone = [uuid for uuid, digest in stored.unreported.items() if digest != _NO_PROCESSES]
    if not changed and not gone:
        return
    GPUProcess.objects.filter(gpu_id__in=changed + gone).delete()
    if gone:
        GPU.objects.filter(uuid__in=gone).update(processes_digest=_NO_PROCESSES)
    rows_insert(
        GPUProcess,
        ["gpu", *PROCESS_FIELDS],
        [(uuid, *row) for uuid in changed for row in processes[uuid]],
    )


def _history_record(
    latest: dict[str, Snapshot], known: dict[str, _Known], now: datetime, stored: dict[str, str]
) -> None:
    """A chart point per card of the hosts whose last one is TELEMETRY_HISTORY_SECONDS old."""
    history_every = timedelta(seconds=settings.TELEMETRY_HISTORY_SECONDS)
    due = {name for name, (_, at) in known.items() if at is None or now - at >= history_every}
    if not due:
        return
    db_now = connection.ops.adapt_datetimefield_value(now)
    rows_insert(
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

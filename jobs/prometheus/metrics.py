"""What Prometheus reads at /metrics (jobs/prometheus/views.py): the portal's state, from the
database, at scrape time (docs/integrations.md, "Prometheus and Grafana").

One collector reads everything when Prometheus asks, in a fixed handful of queries whatever the
number of cards, jobs or bookings (no query per card): so every gunicorn worker answers the same,
which per-process counters could not, and nothing is kept between scrapes.

Per card, the labels are DCGM exporter's own, `Hostname`, `gpu` (the NVML index) and `UUID`, so a
Grafana query joins the portal's series with DCGM's `DCGM_FI_*` ones `on (Hostname, gpu, UUID)`;
`server` is the portal's name for the host. DCGM exporter's `Hostname` is its node's hostname
(NVIDIA/dcgm-exporter internal/pkg/hostname: NODE_NAME if set, else os.Hostname()), which is what
the host's worker reports as Server.hostname (socket.gethostname()); the server's portal name
stands in when it reported none.

Every metric is named gpu_portal_*; sizes are bytes and times seconds (Prometheus' base units);
utilisation is a percentage, as DCGM's DCGM_FI_DEV_GPU_UTIL, so one can stand in for the other.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count, Min, Q
from django.db.models.functions import Coalesce
from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpus.inventory import CardState
from gpus.models import GPU, Allocation, Server, Violation
from jobs.host.dcgm import job_name, session_name
from jobs.lending_report import HOUR, lending_totals
from jobs.models import InteractiveSession, Job
from portal.clock import db_now
from portal.models import WatchdogKind

MIB = 1024 * 1024
CARD_LABELS = ["Hostname", "gpu", "UUID", "server"]
SERVER_LABELS = ["server", "Hostname"]
# A card's state: offline (its server stopped reporting, or the card fell off the bus / stopped
# answering), whole (a whole-card booking holds it), shared (memory bookings), draining (free,
# but its server takes no new work) or free.
CARD_STATES = ("free", "shared", "whole", "draining", "offline")


@dataclass(frozen=True)
class Card:
    labels: list[str]
    total_mb: int
    state: str


class PortalCollector:
    """The portal's gauges, read from the database on each collect()."""

    def collect(self) -> Iterator[Metric]:
        now = timezone.now()
        # `last_seen` is the database's clock (portal.clock): its age and the servers' status are
        # measured against the database's now, never this web server's.
        seen_now = db_now()
        servers = {s["pk"]: s for s in Server.objects.values(*SERVER_FIELDS)}
        for server in servers.values():
            server["status"] = Server.status_for(server["last_seen"], server["draining"], seen_now)
        yield from server_metrics(servers.values(), seen_now)
        yield from card_metrics(servers, now)
        yield from job_metrics(now)
        yield from session_metrics()
        yield from violation_metrics()
        yield from work_metrics(servers)
        yield from lending_metrics(now)


SERVER_FIELDS = (
    "pk",
    "name",
    "hostname",
    "last_seen",
    "draining",
    "telemetry_round_seconds",
    "watchdog_round_seconds",
)


def _hostname(server: dict) -> str:
    return server["hostname"] or server["name"]


def server_metrics(servers: Iterable[dict], seen_now: datetime) -> Iterator[Metric]:
    up = GaugeMetricFamily("gpu_portal_server_up", "1 while the host's worker reports.", labels=SERVER_LABELS)
    draining = GaugeMetricFamily(
        "gpu_portal_server_draining",
        "1 while the server takes no new bookings or jobs.",
        labels=SERVER_LABELS,
    )
    age = GaugeMetricFamily(
        "gpu_portal_server_last_seen_age_seconds",
        "Seconds since the host's last telemetry report was written.",
        labels=SERVER_LABELS,
    )
    telemetry = GaugeMetricFamily(
        "gpu_portal_telemetry_round_seconds",
        "How long the collector's last round that wrote this host's report took.",
        labels=SERVER_LABELS,
    )
    watchdog = GaugeMetricFamily(
        "gpu_portal_watchdog_round_seconds",
        "How long the host's last GPU watchdog round took.",
        labels=SERVER_LABELS,
    )
    for server in servers:
        labels = [server["name"], _hostname(server)]
        up.add_metric(labels, 0 if server["status"] == Server.Status.OFFLINE else 1)
        draining.add_metric(labels, 1 if server["draining"] else 0)
        if server["last_seen"] is not None:
            age.add_metric(labels, max(0.0, (seen_now - server["last_seen"]).total_seconds()))
        if server["telemetry_round_seconds"] is not None:
            telemetry.add_metric(labels, server["telemetry_round_seconds"])
        if server["watchdog_round_seconds"] is not None:
            watchdog.add_metric(labels, server["watchdog_round_seconds"])
    yield from (up, draining, age, telemetry, watchdog)


def card_metrics(servers: dict[int, dict], now: datetime) -> Iterator[Metric]:
    """Memory, state, telemetry and the bookings holding each card: two queries."""
    bookings = _bookings_by_card(now)
    total = GaugeMetricFamily("gpu_portal_gpu_memory_total_bytes", "The card's memory.", labels=CARD_LABELS)
    booked = GaugeMetricFamily(
        "gpu_portal_gpu_memory_booked_bytes",
        "Memory held by the bookings active now (a whole-card booking: all of it).",
        labels=CARD_LABELS,
    )
    state = GaugeMetricFamily(
        "gpu_portal_gpu_state",
        "1 for the card's state now, 0 for the others.",
        labels=[*CARD_LABELS, "state"],
    )
    booking = GaugeMetricFamily(
        "gpu_portal_gpu_booking_bytes",
        "One series per booking active on the card now: its memory (whole card: all of it).",
        labels=[*CARD_LABELS, "user", "team", "reservation", "mode"],
    )
    used = GaugeMetricFamily(
        "gpu_portal_gpu_memory_used_bytes", "Memory in use, as last reported.", labels=CARD_LABELS
    )
    utilization = GaugeMetricFamily(
        "gpu_portal_gpu_utilization_percent", "GPU utilisation (0-100), as last reported.", labels=CARD_LABELS
    )
    fields = ("uuid", "index", "server_id", "memory_total_mb", "memory_used_mb", "utilization_pct", "state")
    for gpu in GPU.objects.values(*fields).order_by("server_id", "index"):
        server = servers.get(gpu["server_id"])
        if server is None:
            continue  # added since the servers were read
        held = bookings.get(gpu["uuid"], [])
        card = _card(gpu, server, held)
        total.add_metric(card.labels, card.total_mb * MIB)
        # A whole-card booking holds all of it; memory bookings their sum (never above the card).
        sizes = [card.total_mb if b["memory_mb"] is None else b["memory_mb"] for b in held]
        booked.add_metric(card.labels, min(sum(sizes), card.total_mb) * MIB)
        for name in CARD_STATES:
            state.add_metric([*card.labels, name], 1 if name == card.state else 0)
        for one, size in zip(held, sizes, strict=True):
            mode = "whole" if one["memory_mb"] is None else "shared"
            people = [one["user"], one["team"], str(one["reservation"]), mode]
            booking.add_metric([*card.labels, *people], size * MIB)
        if gpu["memory_used_mb"] is not None:
            used.add_metric(card.labels, gpu["memory_used_mb"] * MIB)
        if gpu["utilization_pct"] is not None:
            utilization.add_metric(card.labels, gpu["utilization_pct"])
    yield from (total, booked, state, booking, used, utilization)


def _card(gpu: dict, server: dict, held: list[dict]) -> Card:
    labels = [_hostname(server), str(gpu["index"]), gpu["uuid"], server["name"]]
    if server["status"] == Server.Status.OFFLINE or gpu["state"] != CardState.OK:
        state = "offline"
    elif any(b["memory_mb"] is None for b in held):
        state = "whole"
    elif held:
        state = "shared"
    else:
        state = "draining" if server["status"] == Server.Status.DRAINING else "free"
    return Card(labels=labels, total_mb=gpu["memory_total_mb"], state=state)


def _bookings_by_card(now: datetime) -> dict[str, list[dict]]:
    """The allocations holding a card now (Allocation.objects.live_at: cancelled and released ones
    are out), with their booking's owner and team: one query."""
    rows = Allocation.objects.live_at(now).values(
        "gpu_id", "memory_mb", "reservation_id", "reservation__owner__username", "reservation__team__slug"
    )
    found: dict[str, list[dict]] = defaultdict(list)
    for row in rows.order_by("gpu_id", "reservation_id"):
        found[row["gpu_id"]].append(
            {
                "memory_mb": row["memory_mb"],
                "reservation": row["reservation_id"],
                "user": row["reservation__owner__username"],
                "team": row["reservation__team__slug"],
            }
        )
    return found


def job_metrics(now: datetime) -> Iterator[Metric]:
    """Jobs by state, the queue's length and its longest wait: two queries."""
    jobs = GaugeMetricFamily("gpu_portal_jobs", "Jobs by state.", labels=["state"])
    counts = dict(Job.objects.order_by().values_list("status").annotate(n=Count("pk")))
    for status in Job.Status.values:
        jobs.add_metric([status], counts.get(status, 0))
    yield jobs
    # Pending jobs wait in the queue; one held back by its own begin time waits from then on.
    pending = Job.objects.filter(status=Job.Status.PENDING)
    queue = pending.aggregate(
        length=Count("pk"),
        # A requeued job waits again from its return (jobs.notices), not from its submission.
        oldest=Min(
            Coalesce("requeued_at", "begin_at", "created_at"), filter=Q(begin_at=None) | Q(begin_at__lte=now)
        ),
    )
    yield GaugeMetricFamily(
        "gpu_portal_queue_length", "Jobs waiting in the queue (pending).", value=queue["length"]
    )
    oldest = queue["oldest"]
    wait = max(0.0, (now - oldest).total_seconds()) if oldest is not None else 0.0
    yield GaugeMetricFamily(
        "gpu_portal_queue_oldest_wait_seconds",
        "How long the longest-waiting pending job has waited.",
        value=wait,
    )


def lending_metrics(now: datetime) -> Iterator[Metric]:
    """Idle booked cards lent to the queue, and what its borrowers used of them, since the first
    loan (jobs/lending_report.py): counters in GPU-seconds (÷ 3600 for GPU-hours), by the lending
    team and server. The settled totals, then three queries over the loans of the last day or so."""
    labels = ["team", "server"]
    lent = CounterMetricFamily(
        "gpu_portal_lent_gpu_seconds", "Booked but idle GPU time lent to queued jobs.", labels=labels
    )
    used = CounterMetricFamily(
        "gpu_portal_lent_used_gpu_seconds", "Lent GPU time the borrowing jobs ran.", labels=labels
    )
    for row in lending_totals(now):
        lent.add_metric([row.team, row.server], row.lent * HOUR)
        used.add_metric([row.team, row.server], row.used * HOUR)
    yield lent
    yield used


def session_metrics() -> Iterator[Metric]:
    sessions = GaugeMetricFamily(
        "gpu_portal_sessions",
        "Interactive sessions (gpu exec, gpu shell, JupyterLab) by kind and state.",
        labels=["kind", "state"],
    )
    rows = InteractiveSession.objects.order_by().values_list("kind", "status").annotate(n=Count("pk"))
    counts = {(kind, status): n for kind, status, n in rows}
    for kind in InteractiveSession.Kind.values:
        for status in InteractiveSession.Status.values:
            sessions.add_metric([kind, status], counts.get((kind, status), 0))
    yield sessions


def violation_metrics() -> Iterator[Metric]:
    rows = (
        Violation.objects.order_by()
        .values("kind")
        .annotate(total=Count("pk"), open=Count("pk", filter=Q(ended_at=None)))
    )
    found = {row["kind"]: row for row in rows}
    open_ = GaugeMetricFamily(
        "gpu_portal_violations_open",
        "Watchdog violations whose process is still on the card.",
        labels=["kind"],
    )
    total = CounterMetricFamily(
        "gpu_portal_violations", "Watchdog violations ever recorded.", labels=["kind"]
    )
    for kind in WatchdogKind.values:
        row = found.get(kind, {"total": 0, "open": 0})
        open_.add_metric([kind], row["open"])
        total.add_metric([kind], row["total"])
    yield from (open_, total)


def work_metrics(servers: dict[int, dict]) -> Iterator[Metric]:
    """Each running job and active session, named as in DCGM's `hpc_job` label (jobs/host/dcgm.py),
    with its people: `DCGM_FI_DEV_GPU_UTIL * on (Hostname, hpc_job) group_left (user, team)
    gpu_portal_work_info` puts names on DCGM's series. Two queries."""
    info = GaugeMetricFamily(
        "gpu_portal_work_info",
        "1 for each running job and active session, by the name DCGM's hpc_job label gives it.",
        labels=["Hostname", "server", "hpc_job", "kind", "user", "team", "reservation"],
    )
    jobs = Job.objects.filter(status__in=(Job.Status.STARTING, Job.Status.RUNNING)).values_list(
        "pk", "server_id", "owner__username", "team__slug", "reservation_id"
    )
    for pk, server_id, user, team, reservation in jobs.order_by("pk"):
        if (server := servers.get(server_id)) is not None:
            info.add_metric(
                [_hostname(server), server["name"], job_name(pk), "job", user, team, str(reservation or "")],
                1,
            )
    sessions = InteractiveSession.objects.filter(status__in=InteractiveSession.ACTIVE).values_list(
        "pk", "server_id", "kind", "owner__username", "reservation__team__slug", "reservation_id"
    )
    for pk, server_id, kind, user, team, reservation in sessions.order_by("pk"):
        if (server := servers.get(server_id)) is not None:
            info.add_metric(
                [_hostname(server), server["name"], session_name(pk), kind, user, team, str(reservation)], 1
            )
    yield info

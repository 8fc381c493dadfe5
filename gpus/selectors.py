"""Reads for pages and the API: a fixed number of queries, however many servers and GPUs."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any

from django.db.models import Prefetch, QuerySet
from django.db.models.functions import Now
from django.urls import reverse
from django.utils import timezone

from gpus.card_rows import URL_PK, Booked, CardFacts, Links, ProcessFacts, ServerFacts
from gpus.hooks import job_images, loan_words, own_jobs
from gpus.models import GPU, Allocation, GPUProcess, Server, SlurmNode, TelemetrySample, Violation, format_mb
from portal.access import display_name, is_admin, team_ids_of
from portal.accounts import unix_account_candidate, unix_account_name
from portal.timefmt import short_time

# A card's live figures: what each telemetry round writes (gpus.services, with `updated_at`) and
# what the dashboard reads, in this order.
GPU_LIVE_FIELDS = (
    "memory_used_mb",
    "utilization_pct",
    "temperature_c",
    "power_w",
    "power_limit_w",
    "state",
    "processes_known",
    "slurm_job",  # a Slurm cluster's card: the job holding it (gpus/slurm_inventory.py)
)
# A server's live facts: what each round writes (gpus.services) and the dashboard reads.
SERVER_LIVE_FIELDS = (
    "hostname",
    "simulated",
    "driver_version",
    "cuda_version",
    "cpu_count",
    "ram_mb",
    "last_seen",
)


def gpus_with_processes() -> QuerySet[GPU]:
    return GPU.objects.select_related("server").prefetch_related(
        Prefetch("processes", queryset=GPUProcess.objects.order_by("-used_memory_mb", "pid"))
    )


# --- command lines: whose process it is, and what a viewer sees of it ---------------------------


def program_name(command: str) -> str:
    """The basename of argv[0]: "python3" for "/usr/bin/python3 train.py --token x"."""
    words = command.split(maxsplit=1)
    return words[0].rsplit("/", 1)[-1] if words else ""


class CommandLines:
    """What one viewer sees of processes' command lines, on the pages and in the API alike: all of
    it for admins and for the process's owner, else the program's name only, since arguments often
    carry secrets (tokens, passwords, data paths). A process in a portal job is the job owner's;
    any other is the portal user's whose Unix account runs it (portal.accounts)."""

    def __init__(self, viewer: Any, *, job_ids: Iterable[int]) -> None:
        self.viewer = viewer
        self.everything = is_admin(viewer)
        # Whether a username stands in for the viewer's Unix account is a query, asked only when
        # a process runs as that name (most pages show none of the viewer's own).
        self.candidate = None if self.everything else unix_account_candidate(viewer)
        self.jobs = frozenset() if self.everything else frozenset(own_jobs(viewer, job_ids))

    @cached_property
    def unix_name(self) -> str | None:
        return None if self.everything else unix_account_name(self.viewer)

    def shown(self, command: str, *, username: str, job_id: int | None) -> str:
        if self.everything:
            return command
        # A job's processes may run as a shared account (JOB_USER): the job says whose they are.
        if job_id:
            own = job_id in self.jobs
        else:
            own = username == self.candidate and bool(self.unix_name) and username == self.unix_name
        return command if own else program_name(command)


def violation_command(violation: Any, viewer: Any) -> str:
    """A violation's command line by the same rule: whole for admins and for the person whose
    process it was, the program's name for the booking's owner, leaders and everyone else."""
    if is_admin(viewer) or (
        violation.user_id is not None and violation.user_id == getattr(viewer, "pk", None)
    ):
        return violation.command
    return program_name(violation.command)


def command_lines_for(viewer: Any) -> CommandLines:
    """The rule for every process on the cards now (the API's GPU list and detail)."""
    job_ids = GPUProcess.objects.exclude(job_id=None).values_list("job_id", flat=True)
    return CommandLines(viewer, job_ids=job_ids)


def bookings_now(viewer: Any, now: datetime) -> dict[str, list[dict[str, Any]]]:
    """Who holds each card at `now`, by card UUID, named as the privacy rule allows. A booking
    lent to the queue says so (`lent`: "lent to the queue since 14:02: job 812", gpus.hooks
    .loan_words), and its loan, the queue's booking on the same card, is not listed apart."""
    viewer_teams = team_ids_of(viewer)
    held: dict[str, list[dict[str, Any]]] = defaultdict(list)
    rows = list(_BOOKING_ROWS.all().live_at(now))
    loans = {(gpu_id, lender): loan for gpu_id, *_, loan, lender in rows if lender is not None}
    words = loan_words(set(loans.values()))
    for gpu_id, memory_mb, end, owner_id, owner_name, team_id, booking, lender in rows:
        if lender is not None:
            continue
        held[gpu_id].append(
            {
                "who": display_name(viewer, viewer_teams, owner_id, owner_name, team_id),
                "memory": "whole card" if memory_mb is None else format_mb(memory_mb),
                "until": short_time(end),
                "lent": words.get(loans.get((gpu_id, booking)), ""),
            }
        )
    return held


def dashboard_servers(viewer: Any) -> list[dict[str, Any]]:
    """Every server, as a plain dict, with what its cards' rows are made from (`cards`: CardFacts,
    gpus.card_rows; processes and current bookings included), in a fixed number of queries (the
    viewer's Unix account and jobs for the command lines among them).

    Plain rows rather than model instances: this page is polled every few seconds for
    up to hundreds of cards, and building 2,000 model objects per poll dominated its cost.
    """
    now = timezone.now()
    servers = []
    admin = is_admin(viewer)  # only admins are told where jobs run as root: theirs to change
    timeline_url = url_maker("server_timeline", "SERVER")
    rows = list(_SERVER_ROWS.all())
    # Slurm nodes belong to Slurm clusters only: a lab without one is not asked for them.
    nodes = _slurm_nodes() if any(server["kind"] == Server.Kind.SLURM for server in rows) else {}
    for server in rows:
        server["timeline_url"] = timeline_url(server["name"])
        server["jobs_as_root"] = server["jobs_as_root"] and admin
        server["status"] = Server.status_for(server["last_seen"], server["draining"], server.pop("seen_now"))
        server["ram_gb"] = round(server["ram_mb"] / 1024)
        server["cards"] = []
        server["nodes"] = nodes.get(server["id"], ())  # a Slurm cluster's, as its last round read them
        servers.append(server)
    _dashboard_cards(
        {server["id"]: server for server in servers},
        processes=_dashboard_processes(viewer),
        booked=bookings_now(viewer, now),
    )
    return servers


def _slurm_nodes() -> dict[int, list[dict[str, Any]]]:
    nodes: dict[int, list[dict[str, Any]]] = defaultdict(list)
    fields = ("server_id", "name", "state", "slurm_state", "reason", "partitions", "gpus", "gpus_used")
    for node in SlurmNode.objects.order_by("server_id", "name").values(*fields):
        nodes[node["server_id"]].append(node)
    return nodes


def _dashboard_processes(viewer: Any) -> dict[str, list[ProcessFacts]]:
    """Each card's processes, biggest first, with their command lines as the viewer may see them
    and the watchdog's open finding on each (a red badge)."""
    breaking: dict[tuple[str, int], str] = {(gpu, pid): kind for gpu, pid, kind in _BREAKING.all()}
    processes: dict[str, list[ProcessFacts]] = defaultdict(list)
    rows = list(_PROCESS_ROWS.all())
    job_ids = {row[5] for row in rows if row[5]}
    commands = CommandLines(viewer, job_ids=job_ids)
    images = job_images(job_ids)  # "job 12 · image tf-2.17"
    # A thousand processes a page, of a few programs and people: each command line as shown is
    # worked out once per (command, user, job), and the facts made by `_make` (a tuple in the
    # fields' order, its length checked), which costs half a call with arguments.
    shown: dict[tuple[str, str, int | None], str] = {}
    make = ProcessFacts._make
    for gpu, pid, username, command, memory, job, interactive, session in rows:
        seen = shown.get((command, username, job))
        if seen is None:
            seen = shown[command, username, job] = commands.shown(command, username=username, job_id=job)
        processes[gpu].append(
            make(
                (
                    pid,
                    username,
                    memory,
                    seen,
                    breaking.get((gpu, pid)),
                    job,
                    images.get(job),
                    interactive,
                    session,
                )
            )
        )
    return processes


# The columns of a card that its dashboard row is made from (gpus.card_rows.card_row).
DASHBOARD_CARD_COLUMNS = (
    "uuid",
    "server_id",
    "node",
    "index",
    "name",
    "mig_mode",
    "memory_total_mb",
    "memory_reserved_mb",
    *GPU_LIVE_FIELDS,
)


def _dashboard_cards(
    servers: dict[int, dict[str, Any]],
    *,
    processes: dict[str, list[ProcessFacts]],
    booked: dict[str, list[dict[str, Any]]],
) -> None:
    """Each server's cards (in index order), as what their rows are made from, onto its "cards"."""
    detail_url = url_maker("gpu_detail", "UUID")
    links = Links(job=reverse("job_detail", args=[URL_PK]), session=reverse("session_detail", args=[URL_PK]))
    bookable_mb = _remembered(GPU.bookable_mb)  # a lab has a few models of card
    facts = {
        server["id"]: ServerFacts(
            name=server["name"],
            slurm=server["kind"] == Server.Kind.SLURM,
            draining=server["draining"],
            simulated=server["simulated"],
        )
        for server in servers.values()
    }
    make = CardFacts._make
    for card in _CARD_ROWS.all():
        uuid = card.uuid
        servers[card.server_id]["cards"].append(
            make(  # in CardFacts' order, as ProcessFacts in _dashboard_processes
                (
                    card,
                    detail_url(uuid),
                    bookable_mb(card.memory_total_mb or 0, card.memory_reserved_mb),
                    facts[card.server_id],
                    tuple(processes.get(uuid, ())),
                    tuple(Booked(**held) for held in booked[uuid]) if uuid in booked else (),
                    links,
                )
            )
        )


# The dashboard's reads, built once (but for what changes, the moment of the bookings): building a
# queryset (its filters, columns, joins and ordering) was a third of each one's CPU on a page
# polled every few seconds by each viewer (issue 40). Each request runs a clone (`.all()`),
# compiled then: `Now()` is the database's clock at that request.
_SERVER_ROWS = (
    Server.objects.order_by("name")
    # `last_seen` is the database's clock (portal.clock), read with the rows rather than apart.
    .annotate(seen_now=Now())
    .values(
        "id",
        "name",
        "kind",
        "draining",
        "containers_ok",
        "containers_detail",
        *SERVER_LIVE_FIELDS,
        "jobs_as_root",
        "seen_now",
    )
)
# Its columns and joins built once; the moment (Allocation.objects.live_at) each request.
_BOOKING_ROWS = Allocation.objects.order_by("gpu_id", "start").values_list(
    "gpu_id",
    "memory_mb",
    "end",
    "reservation__owner_id",
    "reservation__owner__username",
    "reservation__team_id",
    "reservation_id",
    "reservation__lent_from_id",
)
_BREAKING = (
    Violation.objects.filter(ended_at=None)
    .exclude(kind=Violation.Kind.OWNER_OUTSIDE_JOB)
    .values_list("gpu_id", "pid", "kind")
)
_PROCESS_ROWS = GPUProcess.objects.order_by("gpu_id", "-used_memory_mb", "pid").values_list(
    "gpu_id", "pid", "username", "command", "used_memory_mb", "job_id", "interactive_id", "session_id"
)
_CARD_ROWS = GPU.objects.order_by("server_id", "node", "index").values_list(
    *DASHBOARD_CARD_COLUMNS, named=True
)


def url_maker(name: str, sample: object) -> Callable[[object], str]:
    """`reverse(name, args=[value])` for many values at the cost of one reverse (each cost ~10 µs,
    hundreds a page): the path of `sample`, with `sample` replaced. For values that need no
    quoting in a path: card UUIDs, server names (slugs), primary keys."""
    path = reverse(name, args=[sample])
    return lambda value: path.replace(str(sample), str(value))


def _remembered(compute: Callable[..., Any]) -> Callable[..., Any]:
    """`compute`, remembering its answer for each set of arguments (for one page)."""
    answers: dict[tuple, Any] = {}

    def remembered(*args: Any) -> Any:
        if args not in answers:
            answers[args] = compute(*args)
        return answers[args]

    return remembered


def gpu_history(gpu: GPU, *, minutes: int = 60) -> QuerySet[TelemetrySample]:
    since = timezone.now() - timedelta(minutes=minutes)
    return gpu.samples.filter(at__gte=since).order_by("at")

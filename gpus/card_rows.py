"""The dashboard's card rows: what each row is made from, as one hashable value, and its HTML
rendered once for each such value.

The dashboard is polled every few seconds by everyone who has it open, and rendering 512 rows
(about 10,000 escaped outputs) took a quarter of each request (issue 40). A row is made from a
`CardFacts`: the card's columns, its server's, its processes and bookings already in the words
this viewer may see (command lines, who holds the card), and the few values read elsewhere; the
row template's only input is the `CardRow` that `card_row` makes from it alone. So two requests
that would render the same row share one rendering, and any change in what it shows (a telemetry
round's figures, a booking, a viewer allowed more) is a different value, rendered anew. What is
kept is bounded (`KEPT`) and forgotten when the row template changes (a development reload).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from django.template import engines
from django.utils.safestring import SafeString, mark_safe

from gpus.inventory import CardState
from portal.figures import na

ROW_TEMPLATE = "gpus/_gpu_row.html"
# Rows kept per process: 8 views of a 512-card lab, about 1.5 KB each.
KEPT = 4096


class ProcessFacts(NamedTuple):
    """A process on the card as the viewer may see it: what its line in the row is made from."""

    pid: int
    username: str
    memory_mb: int | None
    command: str  # as the viewer may see it (gpus.selectors.CommandLines)
    violation: str | None  # the watchdog's open finding on it (a Violation.Kind)
    job_id: int | None
    image: str | None  # the job's container image
    interactive_id: int | None
    session_id: int | None


class ProcessRow(NamedTuple):
    """A process's line as the row shows it."""

    summary: str  # "alice · pid 812 · 2048 MiB": one text, escaped once rather than three times
    command: str
    violation: str | None
    job_id: int | None
    job_url: str
    image: str | None
    interactive_id: int | None
    session_url: str
    session_id: int | None


class Links(NamedTuple):
    """The paths of a job's and a session's page (this request's), `URL_PK` where the pk goes."""

    job: str
    session: str


URL_PK = 2147483647  # a number no path holds otherwise, for paths of a pk (gpus.selectors.url_maker)


class Booked(NamedTuple):
    """Who holds the card now, as gpus.selectors.bookings_now words it for the viewer."""

    who: str
    memory: str
    until: str
    lent: str


class CardRow(NamedTuple):
    uuid: str
    number: str  # "3", or a Slurm node's "node7:3"
    url: str
    name: str
    mig: bool
    state: str
    violations: int
    memory_title: str
    used_pct: float
    bookable_pct: float
    memory_text: str
    utilization_text: str
    temperature_text: str
    power_text: str
    processes: tuple[ProcessRow, ...]
    slurm_job: str
    processes_known: bool
    booked: tuple[Booked, ...]
    server: str  # its server's name
    simulated: bool  # its server's inventory is simulated
    slurm: bool  # its server is a Slurm cluster
    reservable: bool  # a Reserve link: the card answers and its server takes bookings


class ServerFacts(NamedTuple):
    name: str
    slurm: bool  # a Slurm cluster
    draining: bool
    simulated: bool  # its inventory is simulated


class CardFacts(NamedTuple):
    """What one row is made from (`card_row`), and what its HTML is kept by."""

    card: Any  # the card's columns by name (a named row: gpus.selectors.DASHBOARD_CARD_COLUMNS)
    url: str  # its page
    bookable_mb: int  # GPU.bookable_mb of its memory
    server: ServerFacts
    processes: tuple[ProcessFacts, ...]
    booked: tuple[Booked, ...]
    links: Links


def card_row(facts: CardFacts) -> CardRow:
    """The row's values as it shows them, from `facts` alone: its figures a few texts, each
    escaped once, rather than a dozen values and filters."""
    card, server, bookable = facts.card, facts.server, facts.bookable_mb
    total = card.memory_total_mb or 0
    used = card.memory_used_mb
    used_of = f"{na(used)} / {card.memory_total_mb} MiB"
    power, limit = card.power_w, card.power_limit_w
    watts = "n/a"
    if power is not None:
        watts = f"{round(power)} / {round(limit)} W" if limit else f"{round(power)} W"
    return CardRow(
        uuid=card.uuid,
        number=f"{card.node}:{card.index}" if card.node else str(card.index),
        url=facts.url,
        name=card.name,
        mig=card.mig_mode == "enabled",
        state=card.state,
        violations=sum(1 for p in facts.processes if p.violation),
        memory_title=f"{used_of} used, {bookable} MiB bookable",
        used_pct=round(100 * used / total, 1) if total and used is not None else 0,
        bookable_pct=round(100 * bookable / total, 1) if total else 0,
        memory_text=used_of,
        utilization_text=na(card.utilization_pct, "%"),
        temperature_text=na(card.temperature_c, " °C"),
        power_text=watts,
        processes=tuple(_process_row(p, facts.links) for p in facts.processes),
        slurm_job=card.slurm_job,
        processes_known=card.processes_known,
        booked=facts.booked,
        server=server.name,
        simulated=server.simulated,
        slurm=server.slurm,
        reservable=not server.draining and card.state == CardState.OK and not server.slurm,
    )


def _process_row(p: ProcessFacts, links: Links) -> ProcessRow:
    pk = str(URL_PK)
    return ProcessRow(
        summary=f"{p.username or '?'} · pid {p.pid} · {na(p.memory_mb, ' MiB')}",
        command=p.command,
        violation=p.violation,
        job_id=p.job_id,
        job_url=links.job.replace(pk, str(p.job_id)) if p.job_id else "",
        image=p.image,
        interactive_id=p.interactive_id,
        session_url=links.session.replace(pk, str(p.interactive_id)) if p.interactive_id else "",
        session_id=p.session_id,
    )


_rendered: dict[tuple[CardFacts, str], str] = {}
_rendered_by: list[object] = [None]  # the row template they came from


def card_rows_html(cards: Sequence[CardFacts], *, reserve_url: str) -> SafeString:
    """The rows of `cards`, in order, each made and rendered (the row template's `row` macro) once."""
    template = engines["jinja2"].env.get_template(ROW_TEMPLATE)  # its own cache; a reload is anew
    if _rendered_by[0] is not template:
        _rendered.clear()
        _rendered_by[0] = template
    parts = []
    for card in cards:
        key = (card, reserve_url)
        html = _rendered.get(key)
        if html is None:
            if len(_rendered) >= KEPT:
                _rendered.clear()
            html = _rendered[key] = str(template.module.row(card_row(card), reserve_url))
        parts.append(html)
    return mark_safe("".join(parts))  # each part the row template's escaped HTML


def forget() -> None:
    """Every kept row forgotten: the next pages render each anew (the benches' cold figure, tests)."""
    _rendered.clear()

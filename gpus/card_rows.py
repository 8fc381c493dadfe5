"""The dashboard's card rows: what each row shows, as one hashable value, and its HTML rendered
once for each such value.

The dashboard is polled every few seconds by everyone who has it open, and rendering 512 rows
(about 10,000 escaped outputs) took a quarter of each request (issue 40). A row is a `CardRow`,
the row template's only input besides the reserve link: every text already in the words this
viewer may see (command lines, who holds the card), so two requests that would render the same
row share one rendering, and any change in what it shows (a telemetry round's figures, a booking,
a viewer allowed more) is a different value, rendered anew. What is kept is bounded (`KEPT`) and
forgotten when the row template changes (a development server's reload).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from django.template import engines
from markupsafe import Markup

ROW_TEMPLATE = "gpus/_gpu_row.html"
# Rows kept per process: 8 views of a 512-card lab, about 1.5 KB each.
KEPT = 4096


class ProcessRow(NamedTuple):
    summary: str  # "alice · pid 812 · 2048 MiB"
    command: str  # as the viewer may see it (gpus.selectors.CommandLines)
    violation: str | None  # the watchdog's open finding on it (a Violation.Kind)
    job_id: int | None
    job_url: str
    image: str | None  # the job's container image
    interactive_id: int | None
    session_url: str
    session_id: str | None


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


_rendered: dict[tuple[CardRow, str], str] = {}
_rendered_by: list[object] = [None]  # the row template they came from


def card_rows_html(cards: Sequence[CardRow], *, reserve_url: str) -> Markup:
    """The rows of `cards`, in order, each rendered by the row template's `row` macro once."""
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
            html = _rendered[key] = str(template.module.row(card, reserve_url))
        parts.append(html)
    return Markup("".join(parts))


def forget() -> None:
    """Every kept row forgotten: the next pages render each anew (the benches' cold figure, tests)."""
    _rendered.clear()

"""The cards: `gpu status` (nvidia-smi for every server), `gpu book`, `gpu release`; and the
container images jobs may run in, `gpu images`."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

import click

from gpu_cli import render
from gpu_cli.api import connect
from gpu_cli.errors import NotFound
from gpu_cli.params import DURATION, MEMORY, WHEN
from gpu_cli.render import json_option


@click.command()
@click.option("--server", help="Only this server.")
@json_option
def status(server: str | None, as_json: bool) -> None:
    """Servers and their cards now: memory, utilization, who runs what; open violations; your bookings.

    \b
      gpu status
      gpu status --server sim-rtx-4x24 --json
    """
    portal = connect()
    every = portal.get("servers/")
    servers = [s for s in every if server in (None, s["name"])]
    if server is not None and not servers:  # a typo is no empty server: say so, and fail as a 404 does
        names = ", ".join(s["name"] for s in every) or "none yet"
        raise NotFound(f"No server {server!r}; the servers are: {names}.")
    gpus = portal.get("gpus/", server=server)
    violations = portal.rows("violations/", limit=100, open="true", server=server).rows
    bookings = portal.rows("reservations/", limit=100, status="open", mine=1, server=server).rows
    if as_json:
        render.print_json(
            {"servers": servers, "gpus": gpus, "violations": violations, "reservations": bookings}
        )
        return
    by_server: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for gpu in gpus:
        by_server[gpu["server"]].append(gpu)
    out = render.console()
    for entry in servers:
        out.print(render.server_table(entry, sorted(by_server[entry["name"]], key=lambda g: g["index"])))
        out.print()
    if not servers:
        out.print("No servers.")
    if violations:
        cards = {g["uuid"]: render.card_name(g) for g in gpus}
        out.print(render.violations_table(violations, cards))
        out.print()
    if bookings:
        out.print(render.reservations_table(bookings, title="Your bookings (upcoming and active)"))


@click.command()
@click.option("--gpus", "count", type=click.IntRange(min=1), help="How many cards the portal picks [1].")
@click.option(
    "--gpu", "uuids", multiple=True, metavar="UUID", help="This card (repeatable), instead of --gpus."
)
@click.option("--server", help="Pick the cards on this server.")
@click.option(
    "--node",
    "nodes",
    multiple=True,
    metavar="NAME",
    help="On a Slurm cluster (--server): this whole node (repeatable); Slurm reserves it for you.",
)
@click.option(
    "--mem", "memory_mb", type=MEMORY, help="Memory on each card, e.g. 16G; without it, whole cards."
)
@click.option("--start", type=WHEN, help="2025-06-01 14:00, 14:00, now+1h [now].")
@click.option("--end", type=WHEN, help="When it ends; or give --time.")
@click.option("--time", "minutes", type=DURATION, help="How long, e.g. 2h, 90m, 1d [the portal's default].")
@click.option("--note", default="", help="What it is for, shown to your team.")
@click.option("--team", help="The team whose quota it counts against [your first].")
@json_option
def book(
    count: int | None,
    uuids: tuple[str, ...],
    server: str | None,
    nodes: tuple[str, ...],
    memory_mb: int | None,
    start: datetime | None,
    end: datetime | None,
    minutes: int | None,
    note: str,
    team: str | None,
    as_json: bool,
) -> None:
    """Book cards: whole ones, or --mem on each (a share of a card); on a Slurm cluster, whole nodes.

    \b
      gpu book --gpus 2 --server sim-h100-8x80 --time 4h --note "ablation"
      gpu book --gpu GPU-1a2b… --mem 16G --start 14:00 --end 18:00
      gpu book --server cluster-a --node gpu07 --time 8h
    """
    if count and uuids:
        raise click.UsageError("Give --gpus N (the portal picks) or --gpu UUID (these cards), not both.")
    if nodes and (count or uuids or memory_mb):
        raise click.UsageError("A Slurm cluster is booked by whole nodes: drop --gpus, --gpu and --mem.")
    if end and minutes:
        raise click.UsageError("Give --end or --time, not both.")
    if minutes:
        # From the start asked for; from now when it is "now", which the portal sets for a missing start.
        try:
            end = (start or datetime.now().astimezone()) + timedelta(minutes=minutes)
        except OverflowError:  # an end past the year 9999
            raise click.BadParameter("it ends past the year 9999.", param_hint="'--time'") from None
    request = {
        "gpus": list(uuids) or None,
        "count": None if uuids or nodes else count or 1,
        "nodes": list(nodes) or None,
        "server": server,
        "memory_mb": memory_mb,
        "start": start.isoformat() if start else None,
        "end": end.isoformat() if end else None,
        "note": note,
        "team": team,
    }
    reservation = connect().post("reservations/", json={k: v for k, v in request.items() if v is not None})
    if as_json:
        render.print_json(reservation)
        return
    out = render.console()
    # The team says whose quota it counts against: for someone in several teams, the first by
    # name unless --team says otherwise.
    team = f" for team {reservation['team']}" if reservation.get("team") else ""
    out.print(f"Booked reservation {reservation['id']}{team}.")
    out.print(render.reservations_table([reservation]))
    out.print(f"Run in it: gpu run --reservation {reservation['id']} train.py")


@click.command()
@click.argument("reservation_id", metavar="ID", type=int)
@json_option
def release(reservation_id: int, as_json: bool) -> None:
    """Release your booking: the cards are free for others from now on.

    \b
      gpu release 12
    """
    reservation = connect().post(f"reservations/{reservation_id}/release/")
    if as_json:
        render.print_json(reservation)
        return
    click.echo(f"Reservation {reservation['id']} is {reservation['status']}.")


@click.command()
@click.option("--server", help="Only the images this server has.")
@json_option
def images(server: str | None, as_json: bool) -> None:
    """The container images jobs and labs may run in (`gpu run --image NAME`), and where they run;
    JUPYTERLAB "yes": JupyterLab can open in it too (the booking's page, POST /api/v1/sessions/).

    \b
      gpu images
      gpu images --server gpu-01 --json
    """
    found = connect().get("images/", server=server)
    if as_json:
        render.print_json(found)
        return
    render.console().print(
        render.images_table(found) if found else "No container images; jobs run on the hosts."
    )

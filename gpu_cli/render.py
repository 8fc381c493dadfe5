"""Tables (rich) and JSON for the API's rows. Memory is MiB in the API and shown as GiB/MiB;
times are shown in this machine's local time."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

# Off a terminal (a pipe, a file) rich would fold rows at 80 columns; grep wants one line a row.
PIPE_WIDTH = 240

STATUS_STYLES = {
    "pending": "yellow",
    "queued": "yellow",
    "starting": "cyan",
    "running": "bold cyan",
    "succeeded": "green",
    "failed": "bold red",
    "cancelled": "magenta",
    "timed_out": "red",
    "lost": "bold red",
    "online": "green",
    "offline": "red",
    "draining": "yellow",
    "upcoming": "yellow",
    "active": "bold cyan",
    "ok": "green",
}


json_option = click.option("--json", "as_json", is_flag=True, help="Print the API's JSON instead of a table.")


def console() -> Console:
    terminal = sys.stdout.isatty()
    # A terminal in latin-1 or ascii cannot show jürgen's em dash: a "?" there, not a traceback.
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="replace")
    return Console(highlight=False, width=None if terminal else PIPE_WIDTH)


def print_json(data: Any) -> None:
    text = json.dumps(data, indent=2, ensure_ascii=False)
    if not _encodable(text):  # \u escapes where stdout cannot carry a name: the same JSON
        text = json.dumps(data, indent=2)
    click.echo(text)


def _encodable(text: str) -> bool:
    try:
        text.encode(getattr(sys.stdout, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def mib(mb: int | None) -> str:
    if mb is None:
        return "—"
    return f"{mb / 1024:.1f} GiB" if mb >= 1024 else f"{mb} MiB"


def when(iso: str | None) -> str:
    if not iso:
        return "—"
    return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M")


def elapsed(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def status(text: str | None) -> Text:
    return Text(text or "—", style=STATUS_STYLES.get(text or "", ""))


def _table(*columns: str, title: str | Text | None = None) -> Table:
    return Table(*columns, title=title, title_justify="left", box=None, header_style="bold")


def footer(shown: int, total: int, what: str) -> str | None:
    """A note when a list was cut at --limit, so that a short list is never taken for all of it."""
    return f"{shown} of {total} {what}; --limit N shows more." if total > shown else None


# --- servers and cards ----------------------------------------------------------------------------


def images_table(images: Iterable[dict[str, Any]]) -> Table:
    """Each image, where it runs now (containers work there) and where it is but cannot run."""
    table = _table("IMAGE", "RUNS ON", "NETWORK", "JUPYTERLAB", "DESCRIPTION")
    for image in images:
        ok = image.get("containers_ok", {})
        where = [name if ok.get(name) else f"{name} (containers off)" for name in image["servers"]]
        lab = "yes" if image.get("has_jupyterlab") else "no"  # a portal before issue 34's labs sends none
        table.add_row(
            image["name"],
            ", ".join(where) or "—",
            "yes" if image["network"] else "no",
            lab,
            image["description"],
        )
    return table


def _processes(gpu: dict[str, Any]) -> str:
    if not gpu["processes_known"]:
        return "unknown (the host could not list them)"
    return "; ".join(
        f"{p['username'] or '?'}: {p['job']}, {mib(p['used_memory_mb'])} (pid {p['pid']})"
        for p in gpu["processes"]
    )


def _card_use(gpu: dict[str, Any]) -> Text:
    """'idle' for a working card that no process holds. A booking may still hold it: the API does not
    say whose bookings hold a card, and `gpu book` answers whether it is free for a window."""
    if gpu["state"] != "ok":
        return status(gpu["state"])
    if gpu["processes_known"] and not gpu["processes"]:
        return Text("idle", style="green")
    return Text("busy" if gpu["processes"] else "?", style="yellow")


def server_table(server: dict[str, Any], gpus: list[dict[str, Any]]) -> Table:
    idle = sum(1 for g in gpus if _card_use(g).plain == "idle")
    simulated = " · simulated" if server["simulated"] else ""
    title = Text.assemble(
        (server["name"], "bold"),
        " · ",
        status(server["status"]),
        f"{simulated} · {idle} of {len(gpus)} cards idle",
    )
    table = _table("GPU", "NAME", "MEMORY USED", "UTIL", "TEMP", "USE", "PROCESSES", title=title)
    for gpu in gpus:
        table.add_row(
            str(gpu["index"]),
            gpu["name"],
            f"{mib(gpu['memory_used_mb'])} / {mib(gpu['memory_total_mb'])}",
            f"{gpu['utilization_pct']}%" if gpu["utilization_pct"] is not None else "—",
            f"{gpu['temperature_c']}°C" if gpu["temperature_c"] is not None else "—",
            _card_use(gpu),
            _processes(gpu),
        )
    return table


def violations_table(violations: Iterable[dict[str, Any]], cards: dict[str, str]) -> Table:
    table = _table("ID", "KIND", "CARD", "PID", "USER", "MEMORY", "ACTION", "SINCE", title="Open violations")
    for v in violations:
        table.add_row(
            str(v["id"]),
            v["kind"],
            cards.get(v["gpu"], v["gpu"]),
            str(v["pid"]),
            v["user"] or v["os_user"] or "?",
            mib(v["memory_mb"]),
            v["action"],
            when(v["first_seen"]),
        )
    return table


def card_name(gpu: dict[str, Any]) -> str:
    return f"{gpu['server']}:{gpu['index']}"


# --- bookings ---------------------------------------------------------------------------------------


def reservations_table(reservations: Iterable[dict[str, Any]], title: str | None = None) -> Table:
    table = _table("ID", "STATUS", "CARDS", "MEMORY", "START", "END", "OWNER", "NOTE", title=title)
    for r in reservations:
        allocations = r["allocations"]
        table.add_row(
            str(r["id"]),
            status(r["status"]),
            ", ".join(f"{a['server']}:{a['index']}" for a in allocations),
            "whole cards" if all(a["whole_card"] for a in allocations) else mib(allocations[0]["memory_mb"]),
            when(r["start"]),
            when(r["end"]),
            r["owner"],
            r["note"],
        )
    return table


# --- jobs -------------------------------------------------------------------------------------------


def job_name(job: dict[str, Any]) -> str:
    """The script's name; an array task's as Slurm writes it: train.py [12_3]."""
    if job["array_id"] is None:
        return job["name"]
    return f"{job['name']} [{job['array_id']}_{job['array_index']}]"


def _job_note(job: dict[str, Any]) -> str:
    """Why a pending job waits (`gpu queue` says until when), or how a finished one ended."""
    return f"waits: {job['reason']}" if job["reason"] else job["message"]


def jobs_table(jobs: Iterable[dict[str, Any]], *, owners: bool = False) -> Table:
    """One row a job; an IMAGE column when any runs in a container image (a portal from before
    images sends none)."""
    jobs = list(jobs)
    images = any(job.get("image") for job in jobs)
    columns = ["ID", "NAME", "STATUS", "SERVER", "GPUS", "SUBMITTED", "ELAPSED", "EXIT", "NOTE"]
    table = _table(*columns[:2], *(["OWNER"] if owners else []), *(["IMAGE"] if images else []), *columns[2:])
    for job in jobs:
        cells = [str(job["id"]), job_name(job)]
        if owners:
            cells.append(job["owner"])
        if images:
            cells.append(job.get("image") or "—")
        exit_code = job["exit_code"]
        table.add_row(
            *cells,
            status(job["status"]),
            job["server"] or job["requested_server"] or "any",
            str(len(job["gpu_uuids"]) or job["gpu_count"] or "—"),
            when(job["created_at"]),
            elapsed(job["duration_seconds"]),
            job.get("exit_label")
            or ("—" if exit_code is None else str(exit_code)),  # older portals: the code
            _job_note(job),
        )
    return table


def _estimate(entry: dict[str, Any]) -> str:
    """The estimated start and what it rests on: "14:02 (plan)"; a portal too old to say, the time."""
    basis = entry.get("estimate_basis") or ""
    return when(entry["estimated_start"]) + (f" ({basis})" if basis and entry["estimated_start"] else "")


def queue_table(entries: Iterable[dict[str, Any]]) -> Table:
    table = _table(
        "JOB", "NAME", "USER", "TEAM", "GPUS", "MEMORY", "SERVER", "TIME", "PRIORITY", "REASON",
        "EST. START", "SUBMITTED",
    )  # fmt: skip
    for e in entries:
        table.add_row(
            str(e["job"]),
            job_name(e),
            e["owner"],
            e["team"],
            # A job that may be preempted (a portal from before lending sends no such field).
            f"{e['gpu_count']} (preemptible)" if e.get("preemptible") else str(e["gpu_count"]),
            "whole cards" if e["memory_mb"] is None else mib(e["memory_mb"]),
            e["server"] or "any",
            elapsed(e["time_limit_minutes"] * 60) if e["time_limit_minutes"] else "—",
            f"{e['priority']:.3f}",
            e["reason"] or "",
            _estimate(e),
            when(e["submitted_at"]),
        )
    return table

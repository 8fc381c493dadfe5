"""`GET /api/v1/gpus/` from plain rows: the JSON `GPUSerializer(many=True)` gives, without a model
instance, a prefetch queryset or a serializer field lookup per card and process.

The serializer stays the one description of a card (its fields, the schema, the detail view's
output); these rows name its fields in its order and use its own conversion where a value is not
already what JSON shows (times, in the viewer's time zone). Through the serializer, 64 servers ×
8 cards took 80 ms of CPU a request (issue 40); tests/test_api_rows.py holds both outputs equal.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone
from rest_framework import serializers

from gpus.hooks import job_images
from gpus.models import GPU, GPUProcess
from gpus.selectors import CommandLines, bookings_now

_CARD_COLUMNS = (
    "uuid",
    "server__name",
    "index",
    "name",
    "pci_bus_id",
    "memory_total_mb",
    "memory_reserved_mb",
    "memory_used_mb",
    "utilization_pct",
    "temperature_c",
    "power_w",
    "power_limit_w",
    "mig_mode",
    "state",
    "processes_known",
    "server__simulated",
    "updated_at",
)


def gpu_rows(
    cards: QuerySet[GPU], *, viewer: Any, serializer: serializers.Serializer
) -> list[dict[str, Any]]:
    """Each of `cards` (in their order) as `serializer` (a GPUSerializer) shows it to `viewer`, with
    the context GPUViewSet gives it: bookings now, command lines as the viewer may see them, jobs'
    images. The processes are read first, and their jobs taken from them."""
    processes, job_ids = _processes(cards)
    commands = CommandLines(viewer, job_ids=job_ids)
    images = job_images(job_ids)
    booked = bookings_now(viewer, timezone.now())
    # A round writes one `updated_at` for all its cards, and a lab has a few models of card: each
    # value is converted once (the field's conversion reads the viewer's time zone each time).
    updated_at = _once(serializer.fields["updated_at"].to_representation)
    bookable = _once(lambda memory: GPU.bookable_mb(*memory))
    rows = []
    for values in cards.values_list(*_CARD_COLUMNS):
        row = _card(values, bookable, updated_at)
        row["processes"] = [_process(p, commands, images) for p in processes.get(row["uuid"], ())]
        row["booked"] = booked.get(row["uuid"], [])
        rows.append(row)
    return rows


def _card(values: tuple, bookable: Callable[[Any], Any], updated_at: Callable[[Any], Any]) -> dict[str, Any]:
    """One card's row in the serializer's field order; its processes and bookings are the caller's."""
    (uuid, server, index, name, pci_bus_id, total, reserved, used, utilization, temperature) = values[:10]
    (power, power_limit, mig_mode, state, known, simulated, updated) = values[10:]
    return {
        "uuid": uuid,
        "server": server,
        "index": index,
        "name": name,
        "pci_bus_id": pci_bus_id,
        "memory_total_mb": total,
        "memory_reserved_mb": reserved,
        "memory_bookable_mb": bookable((total, reserved)),
        "memory_used_mb": used,
        "utilization_pct": utilization,
        "temperature_c": temperature,
        "power_w": None if power is None else float(power),  # FloatField's conversion
        "power_limit_w": None if power_limit is None else float(power_limit),
        "mig_mode": mig_mode,
        "state": state,
        "processes_known": known,
        "processes": [],
        "booked": [],
        "simulated": simulated,
        "updated_at": None if updated is None else updated_at(updated),
    }


def _processes(cards: QuerySet[GPU]) -> tuple[dict[str, list[tuple]], set[int]]:
    """The cards' processes by card, biggest first (the serializer's prefetch order), and their jobs."""
    by_card: dict[str, list[tuple]] = defaultdict(list)
    rows = GPUProcess.objects.filter(gpu__in=cards).order_by("gpu_id", "-used_memory_mb", "pid")
    for row in rows.values_list(
        "gpu_id", "pid", "username", "command", "used_memory_mb", "session_id", "job_id", "interactive_id"
    ):
        by_card[row[0]].append(row[1:])
    return by_card, {row[5] for listed in by_card.values() for row in listed if row[5]}


def _process(row: tuple, commands: CommandLines, images: dict[int, str]) -> dict[str, Any]:
    pid, username, command, memory, session, job, interactive = row
    return {
        "pid": pid,
        "username": username,
        "command": commands.shown(command, username=username, job_id=job),
        "used_memory_mb": memory,
        "session_id": session,
        "job": GPUProcess.label(job, interactive),
        "image": images.get(job),
        "interactive_session": interactive,
    }


def _once(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`convert`, remembering its answer for each value (for this request only)."""
    answers: dict[Any, Any] = {}

    def converted(value: Any) -> Any:
        if value not in answers:
            answers[value] = convert(value)
        return answers[value]

    return converted

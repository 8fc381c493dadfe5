"""Checks 1 and 2: the portal's cards against nvidia-smi, and a process attributed on its card."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from portal.gpu_check.context import Context, row, skip
from portal.gpu_check.machine import nvidia_smi
from portal.gpu_check.report import Row
from portal.gpu_check.waiting import CheckTimeout, Deadline

# Utilization, temperature and power move between nvidia-smi's reading and the portal's round.
LIVE_TOLERANCE = {"utilization": 10.0, "temperature": 3.0}
POWER_TOLERANCE = (0.10, 15.0)  # 10 % or 15 W, whichever is more
ATTRIBUTION_MIB = 2048


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def _card_mismatches(smi: dict[str, str], card: dict[str, Any]) -> list[str]:
    """What differs between nvidia-smi's line and the portal's card, beyond the tolerances."""
    wrong = []
    if smi["name"] != card["name"]:
        wrong.append(f"name {card['name']!r} ≠ {smi['name']!r}")
    total = _number(smi["memory.total"]) or 0
    for field, theirs in (("memory_total_mb", total), ("memory_used_mb", _number(smi["memory.used"]))):
        ours = card[field]
        if theirs is None or ours is None or abs(ours - theirs) > 0.01 * total:
            wrong.append(f"{field} {ours} vs {theirs} MiB")
    live = (
        ("utilization_pct", _number(smi["utilization.gpu"]), LIVE_TOLERANCE["utilization"]),
        ("temperature_c", _number(smi["temperature.gpu"]), LIVE_TOLERANCE["temperature"]),
    )
    power = _number(smi["power.draw"])
    if power is not None:
        live += (("power_w", power, max(POWER_TOLERANCE[0] * power, POWER_TOLERANCE[1])),)
    for field, theirs, tolerance in live:
        ours = card[field]
        if (ours is None) != (theirs is None) or (ours is not None and abs(ours - theirs) > tolerance):
            wrong.append(f"{field} {ours} vs {theirs}")
    return wrong


def check_inventory(ctx: Context, deadline: Deadline) -> list[Row]:
    expected = (
        "every card nvidia-smi lists, by UUID: same name, memory total and used within 1 % of the"
        " card, utilization ±10 points, temperature ±3 °C, power ±10 % or 15 W"
    )
    smi = {line["uuid"]: line for line in nvidia_smi()}
    cards = {card["uuid"]: card for card in ctx.admin.get("/api/v1/gpus/", server=ctx.server)}
    wrong = [f"portal lacks {uuid}" for uuid in smi.keys() - cards.keys()]
    wrong += [f"nvidia-smi lacks {uuid}" for uuid in cards.keys() - smi.keys()]
    for uuid in smi.keys() & cards.keys():
        wrong += [f"{uuid}: {what}" for what in _card_mismatches(smi[uuid], cards[uuid])]
    seen = "; ".join(wrong) or f"{len(smi)} card(s) match: " + ", ".join(
        f"{c['name']} {c['memory_total_mb']} MiB" for c in cards.values()
    )
    return [row("NVML inventory vs nvidia-smi", expected, seen, not wrong)]


def _stored_at(card: dict[str, Any]) -> float:
    """When the round that the card's row shows was stored (its `updated_at`), as epoch seconds."""
    return datetime.fromisoformat(card["updated_at"].replace("Z", "+00:00")).timestamp()


def check_attribution(ctx: Context, deadline: Deadline) -> list[Row]:
    name = "attribution: a PyTorch process on its card"
    interval = ctx.portal.settings["TELEMETRY_INTERVAL_SECONDS"]
    rounds = 2 * interval + 1
    expected = (
        f"{ATTRIBUTION_MIB} MiB process shown on its card with its pid, user {ctx.portal.os_user!r} and"
        f" memory within 5 % of NVML's list, stored within 2 telemetry rounds (+1 s to store:"
        f" {rounds:g} s)"
    )
    if ctx.frameworks["PyTorch"]:
        return [skip(name, expected, f"no PyTorch ({ctx.frameworks['PyTorch']})")]
    card = ctx.cards[0]
    helper = ctx.helper("attribution", "hold.py", str(ATTRIBUTION_MIB), uuid=card["uuid"])
    held = helper.wait_said("held", deadline)
    last: dict[str, Any] = {}
    # The latest round seen without it: `updated_at` is the round before the API's answer, and
    # rounds between two slow answers go unseen; the first that showed it lies in (unseen, stored].
    unseen: list[float] = []

    def shown() -> tuple[dict[str, Any], float, int] | None:
        # A round read between the CUDA context and the allocation shows the pid with the context
        # alone: the first round that shows the memory NVML lists now is the one that counts.
        detail = ctx.admin.get(f"/api/v1/gpus/{card['uuid']}/")
        process = next((p for p in detail["processes"] if p["pid"] == helper.pid), None)
        nvml = ctx.nvml.processes(card["uuid"]).get(helper.pid)
        last.update(process=process, nvml=nvml)
        if detail["updated_at"] is None:  # a row no round has written: not a round's word yet
            return None
        if process is None or nvml is None or abs(process["used_memory_mb"] - nvml) > 0.05 * nvml:
            unseen.append(_stored_at(detail))
            return None
        return process, _stored_at(detail), nvml

    try:
        process, stored, nvml = deadline.wait_for(shown, f"process {helper.pid} on {card['uuid']}")
    except CheckTimeout:
        seen = f"not shown with NVML's memory; last read: API {last.get('process')}, NVML {last.get('nvml')}"
        return [row(name, expected, seen, False)]
    # The rounds' own times, not the check's: a slow answer from a loaded web server is not the
    # telemetry's lateness. Nor are the rounds two slow answers apart never saw: the first that
    # showed it lies after the last round seen without it (none seen: after "held") and by `stored`.
    after = stored - held
    before = max(unseen, default=held - interval) - held
    if after - before < 1.5 * interval:  # the round after the one seen without it: this one
        first, when = after, f"{after:.1f} s"
    else:
        first = before + interval
        when = f"{first:.1f} to {after:.1f} s (the rounds between the API's answers unseen)"
    seen = (
        f"pid {process['pid']} user {process['username']!r} {process['used_memory_mb']} MiB"
        f" (NVML: {nvml} MiB) on {card['uuid']}, stored {when} after it allocated"
    )
    ok = process["username"] == ctx.portal.os_user and first <= rounds
    return [row(name, expected, seen, ok)]

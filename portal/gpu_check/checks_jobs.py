"""Checks 3, 4 and 7: jobs on a booked share through the launcher. Each framework is capped at
the share less GPU_CONTEXT_HEADROOM_MB (docs/jobs.md, "Memory caps for every framework"), and a
job sees its booked cards by UUID, whatever it sets CUDA_VISIBLE_DEVICES to."""

from __future__ import annotations

import math
import re
from typing import Any

from portal.gpu_check.context import Context, row, skip
from portal.gpu_check.machine import FRAMEWORKS, PeakSampler
from portal.gpu_check.report import Row
from portal.gpu_check.waiting import Deadline

STEP_MIB = 256  # scripts/cap.py's step
# How far below its cap a framework may refuse: its own rounding and workspaces (XLA's compiled
# `ones`, PyTorch's 2 MiB blocks) may take a little of it.
WINDOW_MIB = 2 * STEP_MIB
# What the launcher's line says it applied, per framework (docs/jobs.md, "The launcher").
LOG_CAP = {
    "PyTorch": (re.compile(r"PyTorch[^·\n]*· memory fraction ([0-9.]+)"), "fraction"),
    "JAX": (re.compile(r"XLA_PYTHON_CLIENT_MEM_FRACTION=([0-9.]+)"), "fraction"),
    "TensorFlow": (re.compile(r"memory_limit (\d+) MiB"), "limit"),
}


def _cap_mib(ctx: Context, card: dict[str, Any], share: int) -> tuple[float, int]:
    """(fraction, MiB) each framework may allocate on a share of `card`, as the launcher computes it."""
    headroom = ctx.portal.settings["GPU_CONTEXT_HEADROOM_MB"]
    fraction = math.floor((share - headroom) / card["memory_total_mb"] * 1e6) / 1e6
    return fraction, int(fraction * card["memory_total_mb"])


def check_caps(ctx: Context, deadline: Deadline) -> list[Row]:
    card = ctx.cards[0]
    share = ctx.share_mb(card)
    fraction, cap = _cap_mib(ctx, card, share)
    tolerance = ctx.portal.settings["WATCHDOG_MEMORY_TOLERANCE_MB"]
    expected = (
        f"on a {share} MiB share: out of memory inside the job at its cap ({cap} MiB, fraction"
        f" {fraction:g}, within {WINDOW_MIB} MiB, allocating {STEP_MIB} MiB at a time);"
        f" NVML peak ≤ share + {tolerance:g} MiB (WATCHDOG_MEMORY_TOLERANCE_MB);"
        " no over_memory verdict; the launcher's log line names the cap"
    )
    booking = None
    rows = []
    for framework, why in ctx.frameworks.items():
        name = f"memory cap: {framework} job"
        if why:
            rows.append(skip(name, expected, f"no {framework} ({why})"))
            continue
        booking = booking or ctx.book(ctx.alice, [card["uuid"]], share)
        seen, ok = _cap_job(ctx, deadline, framework, booking, card, share)
        rows.append(row(name, expected, seen, ok))
    return rows


def _cap_job(
    ctx: Context, deadline: Deadline, framework: str, booking: int, card: dict[str, Any], share: int
) -> tuple[str, bool]:
    fraction, cap = _cap_mib(ctx, card, share)
    with PeakSampler(ctx.nvml, card["uuid"]) as sampler:
        job_id = ctx.submit(ctx.alice, booking, "cap.py", f"{FRAMEWORKS[framework]} {share + 2048}")
        job = ctx.job_end(ctx.alice, job_id, deadline)
    said = ctx.job_said(ctx.alice, job_id) or {}
    log = f"{job.get('launcher_line') or ''}\n{ctx.job_log(ctx.alice, job_id)}"
    pattern, kind = LOG_CAP[framework]
    named = pattern.search(log)
    logged = named and float(named.group(1))
    log_ok = logged == (
        fraction if kind == "fraction" else share - ctx.portal.settings["GPU_CONTEXT_HEADROOM_MB"]
    )
    allocated = said.get("allocated_mib")
    oom_ok = said.get("error") is not None and allocated is not None and cap - WINDOW_MIB < allocated <= cap
    peak = sampler.peaks.get(said.get("pid", -1))
    over = [v for v in ctx.admin.get("/api/v1/violations/", kind="over_memory") if v["job"] == job_id]
    seen = (
        f"job {job_id} {job['status']}: allocated {allocated} MiB, then {said.get('error') or 'no error'};"
        f" NVML peak {peak} MiB; over_memory verdicts {len(over)};"
        f" log: {named.group(0) if named else 'no cap named'}"
    )
    ok = (
        job["status"] == "succeeded"
        and oom_ok
        and log_ok
        and peak is not None
        and peak <= share + ctx.portal.settings["WATCHDOG_MEMORY_TOLERANCE_MB"]
    )
    return seen, ok and not over


def _visible(ctx: Context, deadline: Deadline, uuids: list[str]) -> tuple[str, bool]:
    """A job on a booking of `uuids` sees exactly them; its own CUDA_VISIBLE_DEVICES=1 stays inside."""
    share = min(ctx.share_mb(card) for card in ctx.cards if card["uuid"] in uuids)
    booking = ctx.book(ctx.alice, uuids, share)
    job_id = ctx.submit(ctx.alice, booking, "visible.py")
    job = ctx.job_end(ctx.alice, job_id, deadline)
    said = ctx.job_said(ctx.alice, job_id)
    if said is None:
        return f"job {job_id} {job['status']}, said nothing: {ctx.job_log(ctx.alice, job_id)[-400:]}", False
    booked = (said["env"] or "").split(",")
    remapped = said["remapped"]
    inside = booked[1:2]  # index 1 is the second booked card; with one card, nothing
    ok = sorted(booked) == sorted(uuids) and said["count"] == len(uuids) and said["uuids"] == booked
    ok = ok and remapped["uuids"] == inside and remapped["count"] == len(inside)
    seen = (
        f"CUDA_VISIBLE_DEVICES={said['env']}; device_count {said['count']}, UUIDs {said['uuids']};"
        f" after CUDA_VISIBLE_DEVICES=1: {remapped['env']!r},"
        f" {remapped['count']} device(s) {remapped['uuids']}"
    )
    return seen, ok


def check_visible_one(ctx: Context, deadline: Deadline) -> list[Row]:
    name = "CUDA_VISIBLE_DEVICES by UUID (1 card)"
    expected = (
        "the job's CUDA_VISIBLE_DEVICES is the booked UUID; torch.cuda.device_count() 1, its UUID the"
        " booked one; after the script sets CUDA_VISIBLE_DEVICES=1: no card (index 1 is outside a"
        " 1-card booking)"
    )
    if ctx.frameworks["PyTorch"]:
        return [skip(name, expected, f"no PyTorch ({ctx.frameworks['PyTorch']})")]
    return [row(name, expected, *_visible(ctx, deadline, [ctx.cards[0]["uuid"]]))]


def check_visible_two(ctx: Context, deadline: Deadline) -> list[Row]:
    name = "a 2-card booking's job sees those two"
    expected = (
        "device_count 2, the two booked UUIDs; after the script sets CUDA_VISIBLE_DEVICES=1: the"
        " second booked card only"
    )
    if len(ctx.cards) < 2:
        return [skip(name, expected, f"this machine has {len(ctx.cards)} GPU")]
    if ctx.frameworks["PyTorch"]:
        return [skip(name, expected, f"no PyTorch ({ctx.frameworks['PyTorch']})")]
    uuids = [card["uuid"] for card in ctx.cards[-2:]]
    return [row(name, expected, *_visible(ctx, deadline, uuids))]

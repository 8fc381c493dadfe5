"""Check 5: the GPU watchdog on real processes. Alice (this check's OS user) intrudes on Bob's
booked card, and later goes past her own share outside any job; each is flagged within 3 s and
stopped per the policy (WATCHDOG_STOP_AFTER_SECONDS, portal_run.SETTINGS), and nothing else is
signalled: Bob's job on that card and a bystander process of the same account run on."""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Any

from portal.gpu_check.context import Context, row, skip
from portal.gpu_check.machine import Helper
from portal.gpu_check.portal_run import MEMBER
from portal.gpu_check.report import Row
from portal.gpu_check.waiting import CheckTimeout, Deadline

FLAG_SECONDS = 3.0
STOP_SLACK_SECONDS = 12.0  # a stop is confirmed once NVML no longer lists the process: a round or a few


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _bystander(ctx: Context) -> Helper:
    """A process of the same account on no card: nothing may touch it."""
    argv = [sys.executable, "-c", "import time; print('held', time.time(), flush=True); time.sleep(3600)"]
    made = Helper(argv, ctx.work / "bystander.out", {})
    ctx.helpers.append(made)
    return made


def _flagged_and_stopped(
    ctx: Context, deadline: Deadline, kind: str, helper: Helper, held: float
) -> tuple[dict[str, Any], float, float | None]:
    """(the violation, seconds from the allocation to its first_seen, seconds to the stop or None)."""
    violation = deadline.wait_for(
        lambda: ctx.violation(kind, helper.pid), f"{kind} verdict on pid {helper.pid}"
    )
    flagged = _epoch(violation["first_seen"]) - held
    stop_by = (
        ctx.portal.settings["WATCHDOG_STOP_AFTER_SECONDS"]
        + ctx.portal.settings["WATCHDOG_KILL_GRACE_SECONDS"]
    )
    try:
        violation = deadline.wait_for(
            lambda: (
                (v := ctx.violation(kind, helper.pid)) and v["action"] in ("stopped", "stop_failed") and v
            ),
            f"the stop of pid {helper.pid}",
            within=stop_by + STOP_SLACK_SECONDS,
        )
    except CheckTimeout:  # flagged but not stopped: the row says so
        return ctx.violation(kind, helper.pid) or violation, flagged, None
    return violation, flagged, _epoch(violation["stopped_at"] or violation["action_at"]) - held


def check_intruder(ctx: Context, deadline: Deadline) -> list[Row]:
    name = "watchdog: an intruder on a booked card"
    stop_after = ctx.portal.settings["WATCHDOG_STOP_AFTER_SECONDS"]
    expected = (
        f"another account's process on Bob's booked card: `intruder` within {FLAG_SECONDS:g} s, stopped"
        f" per the policy (stop after {stop_after:g} s: action `stopped`, the process gone); Bob's job on"
        " that card and a bystander process of the same account untouched"
    )
    if ctx.frameworks["PyTorch"]:
        return [skip(name, expected, f"no PyTorch ({ctx.frameworks['PyTorch']})")]
    card = ctx.cards[0]
    booking = ctx.book(ctx.bob, [card["uuid"]], ctx.share_mb(card))
    job_id = ctx.submit(ctx.bob, booking, "hold.py", "256")
    deadline.wait_for(lambda: "held" in ctx.job_log(ctx.bob, job_id), f"Bob's job {job_id} on the card")
    bystander = _bystander(ctx)
    bystander.wait_said("held", deadline)
    intruder = ctx.helper("intruder", "hold.py", "1024", uuid=card["uuid"])
    held = intruder.wait_said("held", deadline)
    violation, flagged, stopped = _flagged_and_stopped(ctx, deadline, "intruder", intruder, held)
    gone = (
        deadline.wait_for(lambda: not intruder.alive() or None, "the intruder's exit", within=5)
        if stopped
        else False
    )
    job = ctx.bob.get(f"/api/v1/jobs/{job_id}/")
    others = [
        v
        for v in ctx.admin.get("/api/v1/violations/", server=ctx.server)
        if v["action"] == "stopped" and v["pid"] != intruder.pid
    ]
    seen = (
        f"{violation['kind']} after {flagged:.1f} s; action {violation['action']}"
        + (f" {stopped:.1f} s after it allocated, exit {intruder.proc.returncode}" if stopped else "")
        + f"; Bob's job {job['status']}; bystander {'alive' if bystander.alive() else 'GONE'};"
        f" other processes stopped: {[v['pid'] for v in others]}"
    )
    ok = flagged <= FLAG_SECONDS and stopped is not None and gone and violation["action"] == "stopped"
    ok = ok and job["status"] == "running" and bystander.alive() and not others
    return [row(name, expected, seen, ok)]


def check_over_share(ctx: Context, deadline: Deadline) -> list[Row]:
    name = "watchdog: the owner above their share"
    expected = (
        f"Alice's own process (no job) past her share + 256 MiB: `over_memory` within {FLAG_SECONDS:g} s,"
        " her share and user named in the verdict"
    )
    if ctx.frameworks["PyTorch"]:
        return [skip(name, expected, f"no PyTorch ({ctx.frameworks['PyTorch']})")]
    card = ctx.cards[0]
    share = 1024
    ctx.book(ctx.alice, [card["uuid"]], share)
    helper = ctx.helper("over-share", "hold.py", str(share + 512), uuid=card["uuid"])
    held = helper.wait_said("held", deadline)
    violation = deadline.wait_for(
        lambda: ctx.violation("over_memory", helper.pid), f"over_memory on pid {helper.pid}"
    )
    flagged = _epoch(violation["first_seen"]) - held
    seen = (
        f"{violation['kind']} after {flagged:.1f} s: {violation['memory_mb']} MiB of booked"
        f" {violation['booked_mb']} MiB, user {violation['user']!r}, os_user {violation['os_user']!r}"
    )
    ok = (
        flagged <= FLAG_SECONDS
        and violation["booked_mb"] == share
        and (violation["user"], violation["os_user"]) == (MEMBER, ctx.portal.os_user)
    )
    return [row(name, expected, seen, ok)]

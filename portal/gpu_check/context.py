"""What every check works with: the portal's API as its three users, this machine's cards, and
what a check starts (helpers, bookings), undone after each check whatever its outcome."""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from portal.gpu_check.machine import SCRIPTS, Helper, Nvml
from portal.gpu_check.portal_run import Api, Portal
from portal.gpu_check.report import Row
from portal.gpu_check.waiting import Deadline

ENDED = {"succeeded", "failed", "cancelled", "timed_out", "lost"}
MARK = re.compile(r"\[gpu-check\] (\{.*\})")


@dataclass
class Context:
    portal: Portal
    admin: Api
    alice: Api  # the member whose Unix account is this check's OS user: the helpers are hers
    bob: Api  # another member, whose booking alice's helper intrudes on
    server: str
    cards: list[dict[str, Any]]  # the API's cards of this host, by index
    python: str  # the interpreter of the jobs and helpers: the one with the frameworks
    frameworks: dict[str, str]  # {name: "" if importable, else why not}
    nvml: Nvml
    work: Path
    helpers: list[Helper] = field(default_factory=list)
    bookings: list[tuple[Api, int]] = field(default_factory=list)

    def share_mb(self, card: dict[str, Any]) -> int:
        """The memory share the checks book: 8 GiB, or a third of a smaller card's bookable memory."""
        return min(8192, card["memory_bookable_mb"] // 3 // 256 * 256)

    def helper(self, name: str, script: str, *args: str, uuid: str) -> Helper:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        made = Helper([self.python, str(SCRIPTS / script), *args], self.work / f"{name}.out", env)
        self.helpers.append(made)
        return made

    def book(self, api: Api, uuids: list[str], memory_mb: int | None) -> int:
        booking = api.post(
            "/api/v1/reservations/", {"gpus": uuids, "memory_mb": memory_mb, "note": "gpu-check"}
        )
        self.bookings.append((api, booking["id"]))
        return booking["id"]

    def submit(self, api: Api, booking: int, script: str, args: str = "") -> int:
        files = {"script": (script, (SCRIPTS / script).read_bytes(), "text/x-python")}
        return api.post("/api/v1/jobs/", {"reservation": str(booking), "args": args}, files)["id"]

    def job_end(self, api: Api, job_id: int, deadline: Deadline) -> dict[str, Any]:
        return deadline.wait_for(
            lambda: (job := api.get(f"/api/v1/jobs/{job_id}/"))["status"] in ENDED and job,
            f"end of job {job_id}",
        )

    def job_log(self, api: Api, job_id: int) -> str:
        return api.text(f"/api/v1/jobs/{job_id}/log/")

    def job_said(self, api: Api, job_id: int) -> dict[str, Any] | None:
        """The job's `[gpu-check] {json}` line, once it printed it."""
        found = MARK.search(self.job_log(api, job_id))
        return json.loads(found.group(1)) if found else None

    def violation(self, kind: str, pid: int) -> dict[str, Any] | None:
        for seen in self.admin.get("/api/v1/violations/", kind=kind, server=self.server):
            if seen["pid"] == pid:
                return seen
        return None

    def undo(self) -> None:
        """Stop the check's helpers and release its bookings (their jobs are stopped with them)."""
        for made in self.helpers:
            made.stop()
        self.helpers.clear()
        for api, booking in self.bookings:
            with contextlib.suppress(Exception):
                api.client.delete(f"/api/v1/reservations/{booking}/")
        self.bookings.clear()


def row(name: str, expected: str, seen: str, ok: bool) -> Row:
    return Row(name, expected, seen, "pass" if ok else "fail")


def skip(name: str, expected: str, why: str) -> Row:
    return Row(name, expected, f"skipped: {why}", "skip")

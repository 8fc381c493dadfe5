"""The check's order, each check's time limit, and the teardown that runs whatever happens
(a failed check, Ctrl-C, SIGTERM)."""

from __future__ import annotations

import argparse
import platform
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from portal.env import env_pairs
from portal.gpu_check import checks_cards, checks_exec, checks_jobs, checks_watchdog
from portal.gpu_check.bootstrap import remove_venv
from portal.gpu_check.context import Context
from portal.gpu_check.machine import Nvml, frameworks
from portal.gpu_check.portal_run import ADMIN, MEMBER, OTHER, START_SECONDS, Portal
from portal.gpu_check.report import Report, Row, print_table
from portal.gpu_check.waiting import CheckTimeout, Deadline

Check = Callable[[Context, Deadline], list[Row]]
# (name, time limit in seconds, check). Each is cut to what is left of the whole run's RUN_SECONDS.
CHECKS: list[tuple[str, float, Check]] = [
    ("NVML inventory vs nvidia-smi", 30, checks_cards.check_inventory),
    ("attribution: a PyTorch process on its card", 45, checks_cards.check_attribution),
    ("memory caps", 120, checks_jobs.check_caps),
    ("CUDA_VISIBLE_DEVICES by UUID (1 card)", 45, checks_jobs.check_visible_one),
    ("watchdog: an intruder on a booked card", 60, checks_watchdog.check_intruder),
    ("watchdog: the owner above their share", 30, checks_watchdog.check_over_share),
    ("gpu exec sees only the booked card", 45, checks_exec.check_exec),
    ("a 2-card booking's job sees those two", 45, checks_jobs.check_visible_two),
]


# The whole run, start-up included: under the 8 minutes it may take on one GPU, with the
# teardown's margin. A check the run has no time left for fails, saying so.
RUN_SECONDS = 7 * 60
CHECK_MIN_SECONDS = 10


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m portal.gpu_check", description=__doc__)
    parser.add_argument("--report", default="gpu-check-report.json", help="where the JSON report goes")
    parser.add_argument("--keep", action="store_true", help="keep the temporary var folder (logs) afterwards")
    return parser.parse_args(argv)


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str]) -> int:
    args = _arguments(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    started = time.monotonic()
    var = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    report = Report(machine=_machine(), started=datetime.now(UTC).isoformat(timespec="seconds"))
    portal = Portal(var)
    ctx = None
    whole = Deadline(RUN_SECONDS)
    try:
        ctx = _bring_up(portal, var)
        report.machine.update(
            server=ctx.server, frameworks={k: v or "yes" for k, v in ctx.frameworks.items()}
        )
        for name, limit, check in CHECKS:
            if whole.left() < CHECK_MIN_SECONDS:
                rows = [Row(name, f"run within the run's {RUN_SECONDS} s", "no time left for it", "fail")]
            else:
                rows = _run(ctx, name, min(limit, whole.left()), check)
            report.rows += rows
            print(f"gpu-check: {name}: {', '.join(r.status for r in rows)}", flush=True)
    except KeyboardInterrupt:
        report.rows.append(Row("interrupted", "every check run", "stopped by Ctrl-C or SIGTERM", "fail"))
    except Exception as exc:
        report.rows.append(
            Row("portal start-up", "the portal up on this machine's NVML", _said(exc, portal), "fail")
        )
    finally:
        portal.stop()
        if ctx is not None:
            ctx.nvml.close()
        report.seconds = time.monotonic() - started
        report.write(Path(args.report))
        print_table(report)
        print(
            f"gpu-check: report in {args.report}; portal log in {portal.log}"
            if args.keep
            else f"gpu-check: report in {args.report}"
        )
        if not args.keep:
            shutil.rmtree(var, ignore_errors=True)
        remove_venv()
    return 1 if report.failed else 0


def _said(exc: BaseException, portal: Portal) -> str:
    return f"{type(exc).__name__}: {exc}\n--- portal log ---\n{portal.tail(1500)}"


def _machine() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def _bring_up(portal: Portal, var: Path) -> Context:
    """The portal up, this host online with real (not simulated) cards, and the three users' clients."""
    deadline = Deadline(START_SECONDS)
    portal.start(deadline)
    admin = portal.api(ADMIN)

    def online() -> dict[str, Any] | None:
        servers = [s for s in admin.get("/api/v1/servers/") if not s["simulated"] and s["status"] == "online"]
        return servers[0] if servers and servers[0]["gpu_count"] else None

    server = deadline.wait_for(online, "GPU host online with NVML cards (is the NVIDIA driver loaded?)")
    cards = sorted(admin.get("/api/v1/gpus/", server=server["name"]), key=lambda c: c["index"])
    python = env_pairs("JOB_INTERPRETERS", {}).get("default", sys.executable)
    work = var / "work"
    work.mkdir()
    nvml = Nvml()
    return Context(
        portal,
        admin,
        portal.api(MEMBER),
        portal.api(OTHER),
        server["name"],
        cards,
        python,
        frameworks(python, deadline),
        nvml,
        work,
    )


def _run(ctx: Context, name: str, limit: float, check: Check) -> list[Row]:
    """One check within its limit; whatever it raises is its failure, and what it started is undone."""
    started = time.monotonic()
    try:
        rows = check(ctx, Deadline(limit))
    except CheckTimeout as exc:
        rows = [Row(name, f"done within {limit:g} s", f"timed out: {exc}", "fail")]
    except Exception as exc:
        rows = [Row(name, "runs to the end", f"{type(exc).__name__}: {exc}"[:800], "fail")]
    finally:
        ctx.undo()
    for made in rows:
        made.seconds = round(time.monotonic() - started, 1)
    return rows

"""A simulated lab week (issue 36): does lending idle bookings pay, and does the owner still come first?

What is measured
    A week of a 12-card lab (3 servers × 4 cards, 20 people in 4 teams), replayed through the
    portal's real services on a simulated clock and inventory (bench/lab_week_sim.py: what runs
    for real, what is simulated). The people's habits (bench/lab_week_habits.py) come from one
    file, bench/lab_week.toml, with a seed: bookings of 2-48 h, booked up to a day ahead, 20 %
    no-shows, idle stretches inside bookings (meetings, nights), owners coming back unannounced
    with a job on the booking or a process from a shell; 40 queued jobs a day, half preemptible,
    of each person's few scripts (so the Queue page's typical run times have a history to learn).
    The week runs twice from the same plan: lending on, then off (every team's `lend_idle`).

    Figures (lending on unless said):
    1. Booked-but-idle GPU-hours (the owner's cards with no work of theirs while the booking
       lasts) and the share of them lent and used by a borrower. Goal: >= 50 %.
    2. The owner's wait from coming back (their job submitted, their process on the card) to the
       card being free, over the returns that found a borrower on it: median and p95. Goal: p95
       <= 30 s. And bookings where the owner found their card taken: a borrower still there 30 s
       after they came back, one placed on it while they worked, or their job started beside a
       borrower. Goal: 0.
    3. Preemptions, and the work each lost (since its last checkpoint). Goal: at most one
       checkpoint interval each.
    4. The estimated start's error for pending jobs: every 30 minutes each pending job's estimate
       on the Queue page (`queue_plan(expected=True)`), against when it started: |start -
       estimate| / its wait from then (at least 10 minutes). Median. Goal: <= 25 %.
    5. Queue wait of ordinary (not preemptible) jobs, lending on and off: median, p95 and mean (a
       job still waiting at the week's end counts its wait so far). Goal: not longer with lending.
    6. The watchdog's rules over every telemetry round: owners' and borrowers' processes are
       never intruders nor escaped. Goal: 0.

The two weeks run at once, each in a process of its own, on a throw-away database of its own
(SQLite in memory by default; with DATABASE_URL, PostgreSQL's test_<name>_bench_lab_week_on and
_off). Needs no Redis and no worker: the hosts are simulated, and the scheduler's holds for
waiting jobs are kept in the week's own memory, so a Redis, if any, changes nothing.
`--params FILE` replays another lab's habits; `--estimates-csv FILE` writes every sampled
estimate beside the start it met. A missed goal prints MISSED; the exit code is non-zero only on
errors.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.common import ROOT, report, setup_django_test_db, stop

PARAMS = Path(__file__).with_name("lab_week.toml")
WEEK_START = datetime(2030, 1, 7, tzinfo=UTC)  # a Monday; the clock is the simulation's
TAKEN_AFTER = timedelta(seconds=30)  # the owner's promise: the card is theirs again within this


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


Interval = tuple[datetime, datetime]


def _minus(span: Interval, holes: list[Interval]) -> list[Interval]:
    left, out = span[0], []
    for a, b in sorted(holes):
        if b <= left or a >= span[1]:
            continue
        if a > left:
            out.append((left, a))
        left = max(left, b)
    if left < span[1]:
        out.append((left, span[1]))
    return out


def _overlap(spans: list[Interval], a: datetime, b: datetime) -> float:
    return sum(max(0.0, (min(b, y) - max(a, x)).total_seconds()) for x, y in spans)


def booked_idle(rec: Any) -> tuple[float, float]:
    """(booked-but-idle GPU-hours, of them lent and used): the owner's stretches of work are the
    only busy time of their booking; a borrower's run on its cards is used idle time."""
    from gpus.models import Allocation, Reservation

    rows = Reservation.objects.filter(pk__in=list(rec.bookings)).values_list(
        "pk", "start", "end", "released_at", "cancelled_at"
    )
    cards = defaultdict(set)
    for booking, gpu in Allocation.objects.filter(reservation__in=list(rec.bookings)).values_list(
        "reservation_id", "gpu_id"
    ):
        cards[booking].add(gpu)
    busy = defaultdict(list)
    for booking, stretch in rec.returns:
        busy[booking].append((stretch.start, stretch.end))
    borrowed = defaultdict(list)
    for run in rec.runs:
        if run.lender is not None and run.start is not None:
            borrowed[run.lender].append(run)
    idle_s = used_s = 0.0
    for pk, start, end, released, cancelled in rows:
        until = min(t for t in (end, released, cancelled, rec.end) if t is not None)
        if until <= start:
            continue
        idle = _minus((start, until), busy[pk])
        idle_s += sum((b - a).total_seconds() for a, b in idle) * len(cards[pk])
        for run in borrowed[pk]:
            used_s += _overlap(idle, run.start, run.end or rec.end) * len(set(run.cards) & cards[pk])
    return idle_s / 3600, used_s / 3600


def owner_returns(rec: Any) -> dict[str, Any]:
    """The owner's wait for a lent card, and the bookings where they found it taken."""
    borrowed = defaultdict(list)
    for run in rec.runs:
        if run.lender is not None and run.start is not None:
            borrowed[run.lender].append(run)
    owner_runs = defaultdict(list)
    for runs in rec.owner_job_runs.values():
        for run in runs:
            owner_runs[run.booking].append(run)
    waits, taken, beside = [], set(), set()
    for booking, stretch in rec.returns:
        there = [r for r in borrowed[booking] if r.start <= stretch.start < (r.end or rec.end)]
        if there:
            free_at = max(r.end or rec.end for r in there)
            waits.append((free_at - stretch.start).total_seconds())
            if free_at - stretch.start > TAKEN_AFTER:
                taken.add(booking)
            for mine in owner_runs[booking]:
                if stretch.start <= mine.start < free_at:
                    beside.add(booking)
        if any(stretch.start < r.start < stretch.end for r in borrowed[booking]):
            taken.add(booking)  # placed on the card while its owner worked
    return {"waits": waits, "taken": taken | beside, "beside": beside, "returns": len(rec.returns)}


def first_starts(rec: Any) -> dict[int, list[datetime]]:
    starts = defaultdict(list)
    for run in rec.runs:
        if run.start is not None:
            starts[run.job_id].append(run.start)
    return {job: sorted(times) for job, times in starts.items()}


@dataclass
class Estimates:
    errors: list[float]  # each sample's |start - estimate| / its wait from then
    later: int  # samples whose job started later than estimated
    unresolved: int  # samples of jobs still waiting at the week's end
    short: list[float]  # the errors of samples whose job started within 2 hours
    ordinary: list[float]  # the errors of ordinary (not preemptible) jobs' samples
    per_job: dict[int, list[float]]  # each job's samples' errors (a long wait is sampled more often)


def estimate_errors(rec: Any, floor: timedelta) -> Estimates:
    """Each sampled estimate's error against the job's next start."""
    starts = first_starts(rec)
    done = Estimates([], 0, 0, [], [], defaultdict(list))
    for job, when, estimate in rec.samples:
        actual = next((t for t in starts.get(job, []) if t >= when), None)
        if actual is None:
            done.unresolved += 1
            continue
        wait = max(actual - when, floor)
        error = abs((actual - estimate).total_seconds()) / wait.total_seconds()
        done.errors.append(error)
        done.per_job[job].append(error)
        done.later += actual > estimate
        if actual - when <= timedelta(hours=2):
            done.short.append(error)
        if job in rec.submitted and not rec.submitted[job][0].preemptible:
            done.ordinary.append(error)
    return done


def estimates_write(rec: Any, path: Path) -> None:
    """Each sampled estimate (the week with lending) beside the job's next start, for a closer look:
    job, person, preemptible, cards, limit and typical minutes, submitted, sampled, estimate, start."""
    starts = first_starts(rec)
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(
            [
                "job",
                "person",
                "preemptible",
                "cards",
                "limit",
                "minutes",
                "submitted",
                "when",
                "estimate",
                "start",
            ]
        )
        for job, when, estimate in rec.samples:
            planned, submitted = rec.submitted.get(job, (None, None))
            if planned is None:
                continue
            actual = next((t for t in starts.get(job, []) if t >= when), None)
            writer.writerow([
                job, planned.person, int(planned.preemptible), planned.cards, planned.limit,
                round(planned.minutes, 1), submitted.isoformat(), when.isoformat(), estimate.isoformat(),
                actual.isoformat() if actual else "",
            ])  # fmt: skip


def queue_waits(rec: Any, *, preemptible: bool) -> list[float]:
    starts = first_starts(rec)
    waits = []
    for job, (planned, submitted) in rec.submitted.items():
        if planned.preemptible == preemptible:
            first = starts.get(job, [rec.end])[0]
            waits.append((first - submitted).total_seconds() / 60)
    return waits


def use_own_database(week: str) -> None:
    """Not the test suite's database (a test run may be using it), nor the other week's: SQLite in
    memory (nothing else reads it), PostgreSQL's test_<name>_bench_lab_week_<week>."""
    from django.conf import settings

    database = settings.DATABASES["default"]
    if database["ENGINE"].endswith("sqlite3"):
        database["TEST"]["NAME"] = ":memory:"
    else:
        database.setdefault("TEST", {})["NAME"] = f"test_{database['NAME']}_bench_lab_week_{week}"


def run_week(params: dict[str, Any], *, lending: bool) -> tuple[Any, float]:
    from bench.lab_week_habits import plan_week
    from bench.lab_week_sim import Week

    week = Week(params, plan_week(params, WEEK_START), WEEK_START, lending=lending)
    undo = week.attach()
    began = time.perf_counter()
    try:
        rec = week.run()
    finally:
        for step in undo:
            step()
    return rec, time.perf_counter() - began


def week_line(rec: Any, seconds: float, lending: bool) -> str:
    calls = ", ".join(f"{k} {v}" for k, v in sorted(rec.calls.items()))
    return (
        f"  week with lending {'on' if lending else 'off'}: {seconds:.1f} s ({calls})\n"
        f"    {len(rec.bookings)} bookings ({rec.refused_bookings} refused), {len(rec.returns)} returns"
        f" ({rec.returns_released} to a booking already released), {len(rec.submitted)} queued jobs"
    )


def one_week(params: dict[str, Any], lending: bool) -> tuple[Any, str]:
    """A week on a fresh database of its own: its record and its line."""
    use_own_database("on" if lending else "off")
    teardown = setup_django_test_db()
    logging.disable(logging.WARNING)  # each start, loan and preemption logs a line
    try:
        rec, seconds = run_week(params, lending=lending)
        return rec, week_line(rec, seconds, lending)
    finally:
        logging.disable(logging.NOTSET)
        teardown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=Path, default=PARAMS)
    parser.add_argument(
        "--estimates-csv",
        type=Path,
        help="write each sampled estimate of the week with lending, and the start it met",
    )
    parser.add_argument(
        "--without-lending-to", type=Path, help=argparse.SUPPRESS
    )  # the second week's process
    args = parser.parse_args()
    params = tomllib.loads(args.params.read_text())
    if args.without_lending_to:
        rec, line = one_week(params, lending=False)
        waits = {
            kind: queue_waits(rec, preemptible=kind == "preemptible") for kind in ("ordinary", "preemptible")
        }
        floor = timedelta(minutes=params["report"]["estimate_floor_minutes"])
        errors = estimate_errors(rec, floor).errors
        args.without_lending_to.write_text(json.dumps({"line": line, "estimate_errors": errors, **waits}))
        return
    began = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the other week's process is ended too
    with tempfile.TemporaryDirectory(prefix="bench-lab-week-") as scratch:
        # The week without lending in a process of its own, beside this one's: two cores, half the time.
        out = Path(scratch) / "off.json"
        argv = [sys.executable, "-m", "bench.bench_lab_week", "--params", str(args.params)]
        other = subprocess.Popen([*argv, "--without-lending-to", str(out)], cwd=ROOT)
        try:
            on, line = one_week(params, lending=True)
            print(line, flush=True)
            if other.wait() != 0:
                raise SystemExit(f"the week without lending failed ({other.returncode})")
        finally:
            stop(other)
        off = json.loads(out.read_text())
    print(off["line"])
    print(f"  both weeks: {time.perf_counter() - began:.1f} s")
    figures(params, on, off)
    if args.estimates_csv:
        estimates_write(on, args.estimates_csv)


def figures(params: dict[str, Any], on: Any, off: dict[str, Any]) -> None:
    idle_h, used_h = booked_idle(on)
    share = 100 * used_h / idle_h if idle_h else 0.0
    print(f"  booked-but-idle GPU-hours {idle_h:.0f}, lent and used {used_h:.0f}")
    report("idle booked GPU-hours lent and used", share, "%", ">= 50", share >= 50)
    back = owner_returns(on)
    print(f"  owner came back {back['returns']} times, {len(back['waits'])} to a lent card")
    report("owner's wait for a lent card, median", statistics.median(back["waits"] or [0]), "s", "", True)
    p95 = quantile(back["waits"], 0.95)
    report("owner's wait for a lent card, p95", p95, "s", "<= 30", p95 <= 30)
    report("bookings where the owner found it taken", len(back["taken"]), "", "0", not back["taken"])
    report("  of them: their job started beside a borrower", len(back["beside"]), "", "0", not back["beside"])
    lost = on.preemptions
    every = params["queue"]["checkpoint_minutes"] * 60
    report("preemptions", len(lost), "", "", True)
    worst = max(lost or [0]) / 60
    report("work lost per preemption, max", worst, "min", f"<= {every // 60}", worst * 60 <= every)
    report("work lost per preemption, mean", statistics.mean(lost or [0]) / 60, "min", "", True)
    floor = timedelta(minutes=params["report"]["estimate_floor_minutes"])
    est = estimate_errors(on, floor)
    median = 100 * statistics.median(est.errors or [0])
    print(
        f"  {len(est.errors)} estimates of pending jobs sampled and resolved ({est.unresolved} more for jobs"
        f" not started by the end); {100 * est.later / max(len(est.errors), 1):.0f} % of jobs started later"
        " than estimated"
    )
    report("estimated start's error, median", median, "%", "<= 25", median <= 25)
    report("estimated start's error, p90", 100 * quantile(est.errors, 0.9), "%", "", True)
    short = 100 * statistics.median(est.short or [0])
    report(f"  of jobs that started within 2 h ({len(est.short)}), median", short, "%", "", True)
    ordinary = 100 * statistics.median(est.ordinary or [0])
    report(f"  of ordinary jobs ({len(est.ordinary)}), median", ordinary, "%", "", True)
    per_job = 100 * statistics.median([statistics.median(e) for e in est.per_job.values()] or [0])
    report(f"  each job once ({len(est.per_job)}: its samples' median), median", per_job, "%", "", True)
    without = 100 * statistics.median(off["estimate_errors"] or [0])
    report("  the same week without lending, median", without, "%", "", True)
    w_on, w_off = queue_waits(on, preemptible=False), off["ordinary"]
    for name, waits in (("on", w_on), ("off", w_off)):
        print(
            f"  ordinary jobs' queue wait, lending {name}: median {statistics.median(waits):.1f} min,"
            f" p95 {quantile(waits, 0.95):.1f} min, mean {statistics.mean(waits):.1f} min ({len(waits)} jobs)"
        )
    ratio = statistics.mean(w_on) / max(statistics.mean(w_off), 1e-9)
    ok = ratio <= 1.02 and quantile(w_on, 0.95) <= quantile(w_off, 0.95) * 1.02
    report("ordinary jobs' mean wait, on / off", ratio, "x", "<= 1", ok)
    p_on, p_off = queue_waits(on, preemptible=True), off["preemptible"]
    print(
        f"  preemptible jobs' queue wait: median {statistics.median(p_on):.1f} min with lending,"
        f" {statistics.median(p_off):.1f} min without"
    )
    bad = {k: v for k, v in on.watchdog.items() if k in ("intruder", "escaped", "zombie", "over_memory")}
    print(f"  watchdog verdicts over the week: {dict(sorted(on.watchdog.items()))}")
    report("owners' or borrowers' processes judged wrong", sum(bad.values()), "", "0", not bad)


if __name__ == "__main__":
    sys.exit(main())

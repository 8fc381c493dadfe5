"""Jobs, in Slurm's words: `gpu run` (sbatch), `gpu queue` (squeue), `gpu jobs` (squeue --me),
`gpu history` (sacct), `gpu logs` (tail), `gpu cancel` (scancel)."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import click

from gpu_cli import live, render
from gpu_cli.api import MAX_PAGE_SIZE, Portal, answer_json, connect
from gpu_cli.errors import INTERRUPTED, Failed, NotFound, Refused, Unreachable
from gpu_cli.params import DAY, DURATION, ENV_PAIR, MEMORY, WHEN
from gpu_cli.render import json_option

FINISHED = frozenset({"succeeded", "failed", "cancelled", "timed_out", "lost"})
# `gpu jobs`: waiting in the queue (pending), for a booking's start or a worker (queued), or on a card.
ACTIVE = ("pending", "queued", "starting", "running")
POLL_SECONDS = 1.0  # as the job page; the worker stores new output every 0.5 s

# What `gpu run --wait` exits with when the job's end is not its own exit code (docs/cli.md).
FAILED_EXIT = 1  # failed without an exit code: it could not start
TIMED_OUT_EXIT = 124  # as timeout(1)
LOST_EXIT = 125  # its worker or host died; nobody knows how it ended
CANCELLED_EXIT = 143  # 128 + SIGTERM: what a cancelled job is sent
SIGNAL_EXIT_BASE = 128  # killed by signal N: 128 + N, as a shell reports it


def job_exit_code(job: dict[str, Any]) -> int:
    """The job's end as a shell would report it, for `gpu run --wait`."""
    code = job["exit_code"]
    match job["status"]:
        case "succeeded":
            return 0
        case "timed_out":
            return TIMED_OUT_EXIT
        case "lost":
            return LOST_EXIT
        case "cancelled":
            return CANCELLED_EXIT
    if not code:
        return FAILED_EXIT
    return SIGNAL_EXIT_BASE - code if code < 0 else code


def copy_log(portal: Portal, job_id: int, *, follow: bool) -> None:
    """Copy the job's log to stdout as it arrives; with `follow`, until the job has finished and
    its last bytes are out."""
    out = sys.stdout.buffer
    offset, last = 0, b"\n"
    while True:
        with portal.stream(f"jobs/{job_id}/log/", offset=offset) as response:
            for chunk in response.iter_bytes():
                out.write(chunk)
                last = chunk[-1:] or last
            out.flush()
            status = response.headers.get("X-Job-Status", "")
            next_offset = int(response.headers.get("X-Log-Next-Offset", offset))
        # A finished job's status is read before its log: one more read after it proves nothing is left.
        if not follow or (next_offset == offset and status in FINISHED):
            if last != b"\n" and sys.stdout.isatty():  # a line still being drawn: the prompt below it
                out.write(b"\n")
                out.flush()
            return
        if next_offset == offset:
            time.sleep(POLL_SECONDS)
        offset = next_offset


def _follow(portal: Portal, job_id: int) -> None:
    try:
        try:
            live.follow_log(portal, job_id, sys.stdout.buffer)
        except NotFound:  # a portal from before the stream (or no such job: copy_log says which)
            copy_log(portal, job_id, follow=True)
    except KeyboardInterrupt:
        click.echo(f"\nStopped following; job {job_id} goes on (`gpu cancel {job_id}` stops it).", err=True)
        raise click.exceptions.Exit(INTERRUPTED) from None


def _submitted(job: dict[str, Any]) -> str:
    where = f" on {job['server']}" if job["server"] else ""
    waits = f", waiting for {job['reason']}" if job["reason"] else ""
    if job["array_id"] is not None:
        return (
            f"Submitted array {job['array_id']} ({job['name']}): first task job {job['id']}, {job['status']}."
        )
    text = f"Submitted job {job['id']} ({job['name']}): {job['status']}{where}{waits}."
    return text + (" `gpu queue` says when it should start." if job["status"] == "pending" else "")


def _size_hint(portal: Portal, script: str, mem: int | None) -> str | None:
    """The portal's size for the script from your recent runs of it, as one line; None when it has
    none, when --mem asks exactly that, or when the portal is too old to say (a 404): the hint is
    advice, never a reason not to run."""
    try:
        response = portal.request("GET", "jobs/size-hint/", params={"script": script})
    except NotFound:
        return None
    if response.status_code == 204:
        return None
    hint = answer_json(response)  # a proxy's login page: said as for any other request
    mb = hint["suggested_mb"]
    if mem == mb:
        return None
    size = f"{mb // 1024}G" if mb % 1024 == 0 else f"{mb}M"
    return f"Hint: {hint['text']} Use --mem {size}."


# What a job in a booking of whole Slurm nodes still says: Slurm picks its cards in the booking
# (docs/slurm.md). The portal refuses them, naming each, on a booking of a GPU host's cards.
IN_SLURM_BOOKING = {"gpus": "gpu_count", "server": "server", "partition": "partition"}


def _queue_request(options: dict[str, Any], reservation: int | None) -> dict[str, Any]:
    """What a queued job asks for; nothing for a job in a booking, which fixes cards and start
    (but a GPU count and a partition in a booking of Slurm nodes)."""
    given = [name for name, value in options.items() if value not in (None, False)]
    if reservation is not None:
        if other := [f"--{name}" for name in given if name not in IN_SLURM_BOOKING]:
            raise click.UsageError(
                f"A booking fixes the cards and when: drop {', '.join(other)}, or --reservation."
            )
        return {"reservation": reservation} | {IN_SLURM_BOOKING[name]: options[name] for name in given}
    begin = options["begin"]
    return {
        "gpu_count": options["gpus"] or 1,
        "memory_mb": options["mem"],
        "server": options["server"],
        "array": options["array"],
        "nice": options["nice"],
        "begin_at": begin.isoformat() if begin else None,
        "team": options["team"],
        "preemptible": True if options["preemptible"] else None,
        "partition": options["partition"],
    }


@click.command()
@click.option("--gpus", type=click.IntRange(min=1), help="How many cards [1].")
@click.option("--mem", type=MEMORY, help="Memory on each card, e.g. 16G [whole cards].")
@click.option("--time", "minutes", type=DURATION, help="Time limit, e.g. 2h [the portal's default].")
@click.option("--server", help="Run on this server [any]; a Slurm cluster's name sends it to Slurm.")
@click.option("--partition", help="On a Slurm cluster: its partition [the first the portal shows].")
@click.option("--array", metavar="0-99[%8]", help="An array of tasks, at most %N at once.")
@click.option("--nice", type=click.IntRange(min=0), help="Lower the job's priority by N.")
@click.option("--begin", type=WHEN, help="Not before this time: 14:00, now+1h, 2025-06-01 09:00.")
@click.option(
    "--team", help="The team whose share it counts against, by slug: needed when you are in several."
)
@click.option(
    "--preemptible",
    is_flag=True,
    help="It may be stopped and requeued at its old place (and run on idle lent cards); "
    "keep a checkpoint in $PORTAL_CHECKPOINT_DIR.",
)
@click.option("--reservation", type=int, metavar="ID", help="Run in this booking, on its cards.")
@click.option("--env", type=ENV_PAIR, multiple=True, help="An environment variable (repeatable).")
@click.option("--python", "interpreter", metavar="NAME", help="One of the portal's Python environments.")
@click.option("--image", metavar="NAME", help="Run in this container image (`gpu images` lists them).")
@click.option(
    "--notify",
    metavar="end,fail,start",
    help="What you are told of it, in your inbox, mail and chat: any of end, fail, start, or none "
    "[your profile's choice]. An array is told once, when all its tasks are done.",
)
@click.option("--wait", is_flag=True, help="Follow the log until the job ends; exit with its exit code.")
@click.option("--no-hint", is_flag=True, help="Skip the size your recent runs of the script suggest.")
@json_option
@click.argument("script", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(
    minutes: int | None,
    reservation: int | None,
    env: tuple[tuple[str, str], ...],
    interpreter: str | None,
    image: str | None,
    notify: str | None,
    wait: bool,
    no_hint: bool,
    as_json: bool,
    script: Path,
    args: tuple[str, ...],
    **queue_options: Any,  # --gpus --mem --server --partition --array --nice --begin --team --preemptible
) -> None:
    """Submit SCRIPT (a .py file, uploaded) with its ARGS: to the queue, or into your booking.

    The script's own options go after `--`; what comes before it is gpu's. First it prints the size
    per card that your recent runs of the script suggest, if any (--no-hint skips it).

    \b
      gpu run train.py --gpus 1 --time 10m --wait
      gpu run train.py --gpus 1 --time 8h --notify end,fail,start
      gpu run sweep.py --gpus 2 --mem 16G --time 2h --array 0-9%2 -- --lr 0.1
      gpu run train.py --reservation 12 --env WANDB_MODE=offline -- --epochs 3
      gpu run train.py --gpus 1 --time 1h --image tf-2.17
      gpu run train.py --server cluster-a --gpus 2 --time 4h
    """
    if wait and (queue_options["array"] or as_json):
        raise click.UsageError("--wait follows one job's log: leave out --array and --json.")
    fields = {
        **_queue_request(queue_options, reservation),
        # One command-line string, quoted so that the portal's shell-like split gives back these words.
        "args": shlex.join(args) or None,
        "env": json.dumps(dict(env)) if env else None,
        "interpreter": interpreter,
        "image": image,
        "time_limit_minutes": minutes,
        "notify": notify,
    }
    portal = connect()
    # On stderr before submitting, so it can be read while the job waits; never with --json.
    if not (no_hint or as_json) and (hint := _size_hint(portal, script.name, queue_options["mem"])):
        click.echo(hint, err=True)
    job = portal.post(
        "jobs/",
        data={name: str(value) for name, value in fields.items() if value is not None},
        files={"script": (script.name, script.read_bytes(), "text/x-python")},
    )
    if as_json:
        render.print_json(job)
        return
    click.echo(_submitted(job), err=wait)  # with --wait, stdout is the job's log alone
    if wait:
        _follow(portal, job["id"])
        job = portal.get(f"jobs/{job['id']}/")
        message = f": {job['message']}" if job["message"] else ""
        click.echo(f"Job {job['id']} {job['status']}{message}", err=True)
        raise click.exceptions.Exit(job_exit_code(job))


@click.command()
@click.option("--limit", default=100, show_default=True, type=click.IntRange(min=1), help="At most N jobs.")
@json_option
def queue(limit: int, as_json: bool) -> None:
    """Everyone's pending jobs in the order they will start: why each waits, and when it should start.

    \b
      gpu queue
      gpu queue --json | jq '.[] | select(.owner == "alice")'
    """
    page = connect().rows("queue/", limit=limit)
    if as_json:
        render.print_json(page.rows)
        return
    out = render.console()
    out.print(render.queue_table(page.rows) if page.rows else "The queue is empty.")
    if note := render.footer(len(page.rows), page.total, "pending jobs"):
        out.print(note)


@click.command()
@json_option
def jobs(as_json: bool) -> None:
    """Your jobs that have not finished: pending, queued, starting or running.

    \b
      gpu jobs
      gpu jobs --json | jq '.[].id'
    """
    portal = connect()
    # The job list filters one status at a time; few jobs are active, so one request each is cheap.
    rows = sorted(
        (
            job
            for status in ACTIVE
            for job in portal.rows("jobs/", limit=MAX_PAGE_SIZE, mine=1, status=status).rows
        ),
        key=lambda job: job["id"],
        reverse=True,
    )
    if as_json:
        render.print_json(rows)
        return
    render.console().print(
        render.jobs_table(rows) if rows else "No active jobs; `gpu history` lists the rest."
    )


@click.command()
@click.option("--since", type=DAY, help="From this day on: 2025-06-01, today, yesterday, 7d, 2w.")
@click.option("--until", type=DAY, help="Up to this day, inclusive.")
@click.option("--status", "job_status", help="Only this status: succeeded, failed, cancelled, timed_out, …")
@click.option("--server", help="Only jobs on this server.")
@click.option("--array", type=int, metavar="ID", help="The tasks of this array (implies --all).")
@click.option("--all", "everyone", is_flag=True, help="Everyone's you may see (teams you lead; admins: all).")
@click.option("--user", help="This user's jobs (a leader's or admin's view; implies --all).")
@click.option("--team", help="This team's jobs, by slug (implies --all).")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1), help="At most N jobs.")
@json_option
def history(
    since: str | None,
    until: str | None,
    job_status: str | None,
    server: str | None,
    everyone: bool,
    user: str | None,
    team: str | None,
    array: int | None,
    limit: int,
    as_json: bool,
) -> None:
    """Your jobs, newest first, finished ones included (sacct).

    \b
      gpu history --since 7d --status failed
      gpu history --all --team vision-lab --since 2025-06-01 --json
    """
    mine = None if everyone or user or team or array else 1
    filters = {
        "since": since,
        "until": until,
        "status": job_status,
        "server": server,
        "user": user,
        "team": team,
        "array": array,
    }
    page = connect().rows("jobs/", limit=limit, mine=mine, **filters)
    if as_json:
        render.print_json(page.rows)
        return
    out = render.console()
    out.print(render.jobs_table(page.rows, owners=mine is None) if page.rows else "No jobs.")
    if note := render.footer(len(page.rows), page.total, "jobs"):
        out.print(note)


@click.command()
@click.option("-f", "--follow", is_flag=True, help="Go on printing as the job writes, until it ends.")
@click.argument("job_id", metavar="ID", type=int)
def logs(follow: bool, job_id: int) -> None:
    """Print a job's log (each line with its UTC time); -f follows it live, like tail -f.

    \b
      gpu logs 42
      gpu logs -f 42
    """
    portal = connect()
    if follow:
        _follow(portal, job_id)
    else:
        copy_log(portal, job_id, follow=False)


def _cancelled(job: dict[str, Any]) -> str:
    if job["status"] in FINISHED:
        return f"Job {job['id']} is {job['status']}."
    return f"Job {job['id']} is being stopped (SIGTERM, then SIGKILL)."


@click.command()
@click.option("--whole-array", is_flag=True, help="Cancel every task of each job's array.")
@click.option(
    "--reason",
    default="",
    help="Why: required to cancel someone else's job (a leader's, an admin's); its owner is told.",
)
@json_option
@click.argument("job_ids", metavar="ID...", nargs=-1, required=True, type=int)
def cancel(whole_array: bool, reason: str, as_json: bool, job_ids: tuple[int, ...]) -> None:
    """Cancel jobs: a waiting one at once, a running one is stopped (scancel). A job that cannot be
    cancelled is reported and the others are still cancelled; the exit code is the first failure's.

    \b
      gpu cancel 42 43
      gpu cancel --whole-array 50
      gpu cancel --reason "blocking the demo" 61   # someone else's job
    """
    portal = connect()
    answers, failed = [], None
    body = {"whole_array": True} if whole_array else {}
    body |= {"reason": reason} if reason else {}
    for index, job_id in enumerate(job_ids):
        try:
            job = portal.post(f"jobs/{job_id}/cancel/", json=body or None)
        except (Refused, NotFound, Unreachable) as exc:  # Unreachable: Failed (a 5xx) too
            said = exc.format_message()  # named already ("Job 3 is already cancelled"), or not
            named = said.startswith(f"Job {job_id} ")
            click.echo(f"Error: {said}" if named else f"Error: job {job_id}: {said}", err=True)
            failed = failed or exc
            # A 5xx was this job's: the next may go through. No answer at all (after the retries):
            # the next would wait as long for the same, so stop; what was cancelled is still told.
            if isinstance(exc, Unreachable) and not isinstance(exc, Failed):
                if rest := job_ids[index + 1 :]:
                    click.echo(f"Not tried: {', '.join(map(str, rest))}.", err=True)
                break
            continue
        answers.append(job)
        if not as_json:
            click.echo(_cancelled(job))
    if as_json:
        render.print_json(answers)
    if failed:
        raise click.exceptions.Exit(failed.exit_code)

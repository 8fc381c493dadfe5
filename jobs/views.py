"""Job pages: the form, "My jobs", history, one job with its live log, and cancel; the right-sizing
hint partial and the leaders' right-sizing report (jobs/rightsizing.py).

Every rule is in jobs/submit.py and jobs/services.py; these views only translate their errors into
form errors or messages. POST → redirect → GET throughout. Who sees a job: jobs.selectors
(owner, leaders of its team, admins; 404 for everyone else).
"""

from __future__ import annotations

import re
import shlex
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Page, Paginator
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from gpus.models import GPU, Reservation, format_mb
from jobs.filters import JobFilter, JobHistoryFilter, MyJobFilter
from jobs.forms import JobCancelForm, JobForm
from jobs.lending import loan_take_back, taken_back_words
from jobs.logs.store import log_response, parse_offset
from jobs.metrics import job_card_usage, metrics_csv_response
from jobs.models import InteractiveSession, Job
from jobs.queue.scheduler import queue_plan
from jobs.rightsizing import REPORT_PERIODS, oversized_report, report_days, size_hint_for
from jobs.selectors import get_job_for_user, job_placement, queue_rows
from jobs.services import job_cancel, job_cancel_reason_check
from jobs.submit import ScriptUpload, job_submit
from portal.access import can_manage, is_admin, team_for_user, teams_led_by
from portal.errors import Conflict, Forbidden, Invalid, ServiceError
from portal.filters import filter_list
from portal.http import redirect_back
from portal.timefmt import format_duration, format_time, short_time

EXAMPLE = Path(__file__).resolve().parent / "examples" / "keras_example.py"
PAGE_SIZE = 25


def _describe(jobs: list[Job]) -> list[Job]:
    """Add the display values lists and the job page need: card indices and the duration."""
    uuids = {uuid for job in jobs for uuid in job.gpu_uuids}
    index = dict(GPU.objects.filter(uuid__in=uuids).values_list("uuid", "index"))
    for job in jobs:
        job.cards_label = "GPU " + ", ".join(str(index.get(u, "?")) for u in job.gpu_uuids)
        job.duration_label = format_duration(job.duration)
    return jobs


def _queued_message(job: Job) -> str:
    """Said once, above a page that then changes live: an event with its time, never a state that
    goes stale ("is queued" above a job that has since finished)."""
    at = short_time(job.created_at)
    if job.status == Job.Status.PENDING:
        what = (
            f"array {job.array_id} ({job.array.size} tasks)" if job.array_id else f"job {job.pk} ({job.name})"
        )
        return f"Submitted {what} at {at} to the queue: it starts when cards are free (the Queue page)."
    if job.not_before <= timezone.now():
        when = "as soon as its worker takes it"
    else:
        when = f"when the booking starts ({format_time(job.not_before)})"
    return f"Submitted job {job.pk} ({job.name}) at {at} to {job.server.name}, to start {when}."


@login_required
def job_new(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        form = JobForm(request.POST, request.FILES, user=request.user)
        if form.is_valid():
            try:
                job = job_submit(user=request.user, **form.service_kwargs())
            except ServiceError as error:
                form.add_service_error(error)
            else:
                messages.success(request, _queued_message(job))
                return redirect("job_detail", pk=job.pk)
    else:
        form = JobForm(user=request.user, initial={"reservation": request.GET.get("reservation")})
    return render(request, "jobs/job_form.html", {"form": form})


@require_GET
@login_required
def job_size_hint(request: HttpRequest) -> HttpResponse:
    """The right-sizing hint (htmx) for the job and booking forms, empty when there is none.
    ?script= names the script (a file name or a path); empty or absent: the user's most frequent one."""
    hint = size_hint_for(request.user, request.GET.get("script"))
    return render(request, "jobs/_size_hint.html", {"hint": hint})


@require_GET
@login_required
def team_rightsizing(request: HttpRequest, slug: str) -> HttpResponse:
    """Leaders' report: the team's bookings and people whose jobs use little of what they book.
    Members get 403 and outsiders 404, as on the team page."""
    team = team_for_user(request.user, slug, manage=True)
    days = report_days(request.GET.get("days"))
    report = oversized_report(team, since=timezone.now() - timedelta(days=days))
    return render(
        request, "jobs/oversized.html", {"team": team, "days": days, "periods": REPORT_PERIODS, **report}
    )


@require_POST
@login_required
def job_example(request: HttpRequest) -> HttpResponse:
    """Submit jobs/examples/keras_example.py on a booking with the default settings."""
    raw = request.POST.get("reservation", "")
    if not re.fullmatch(r"[0-9]{1,18}", raw):
        messages.error(request, "Run the example: choose a booking (its number) to run it on.")
        return redirect_back(request, "my_reservations")
    upload = ScriptUpload(name=EXAMPLE.name, content=EXAMPLE.read_bytes())
    try:
        job = job_submit(user=request.user, reservation=int(raw), script=upload)
    except ServiceError as error:
        messages.error(request, f"Run the example: {error.message}")
        return redirect_back(request, "my_reservations")
    messages.success(request, _queued_message(job))
    return redirect("job_detail", pk=job.pk)


def _job_list(request: HttpRequest, jobs: QuerySet[Job], filterset_class: type[JobFilter]) -> dict[str, Any]:
    """Filter (errors beside the filter form, and then an empty list) and paginate, newest first."""
    filter_form, jobs = filter_list(request, filterset_class, jobs.order_by("-created_at", "-id"))
    page: Page = Paginator(jobs, PAGE_SIZE).get_page(request.GET.get("page"))
    return {"filter_form": filter_form, "page": page, "jobs": _describe(list(page.object_list))}


def _job_tabs(request: HttpRequest, current: str) -> list[tuple[str, str, bool]]:
    """The Jobs pages' tabs, (label, url, shown now): Mine, each team the user leads (its jobs, in
    History filtered by it) and, for admins, every job. None for a member: Mine is all they see."""
    teams = list(teams_led_by(request.user).order_by("name"))
    admin = is_admin(request.user)
    if not teams and not admin:
        return []
    history = reverse("job_history")
    tabs = [("Mine", reverse("my_jobs"), current == "")]
    tabs += [(f"{t.name}'s jobs", f"{history}?team={t.slug}", current == t.slug) for t in teams]
    if admin:
        tabs.append(("All jobs", history, current == "*"))
    return tabs


@require_GET
@login_required
def my_jobs(request: HttpRequest) -> HttpResponse:
    own = Job.objects.filter(owner=request.user).select_related("owner", "server")
    context = _job_list(request, own, MyJobFilter)
    context["tabs"] = _job_tabs(request, "")
    # Your interactive sessions beside your jobs: the running ones and the last few.
    context["sessions"] = list(
        InteractiveSession.objects.filter(owner=request.user).select_related("server")[:10]
    )
    return render(request, "jobs/my_jobs.html", context)


@require_GET
@login_required
def job_history(request: HttpRequest) -> HttpResponse:
    """Leaders see their teams' jobs, admins all; members only their own (Job.objects.restrict)."""
    context = _job_list(
        request,
        Job.objects.restrict(request.user).select_related("owner", "team", "server"),
        JobHistoryFilter,
    )
    context["tabs"] = _job_tabs(request, request.GET.get("team") or "*")
    return render(request, "jobs/job_history.html", context)


def _status_context(request: HttpRequest, job: Job) -> dict[str, Any]:
    _describe([job])
    entry = None
    if job.status == Job.Status.PENDING:
        # Where this job stands in the whole plan: on the page and on each refresh of its status
        # part (pushed when the row changes), so its "Runs on" line never falls back to less.
        entries = queue_plan(shared_usage=True, expected=True)
        entry = next((e for e in entries if e.request.job_id == job.pk), None)
        if entry is not None:
            entry.reason_label = Job.Reason(entry.reason).label if entry.reason else "starting now"
    may_manage = can_manage(request.user, job)
    peak = format_mb(job.peak_memory_mb) if job.peak_memory_mb is not None else ""
    env_applied = sorted(job.env_applied.items())
    return {
        "job": job,
        "may_cancel": job.is_active and may_manage,
        # An array's tasks are cancelled together from any task's page (the API's whole_array).
        "array_unfinished": _array_unfinished(job) if may_manage else 0,
        "peak_memory": peak,
        "env_applied": env_applied,
        "queue_entry": entry,
        "placement": job_placement(job, entry),
    }


@require_GET
@login_required
def job_detail(request: HttpRequest, pk: int) -> HttpResponse:
    job = get_job_for_user(request.user, pk)
    context = _status_context(request, job)
    if request.GET.get("part") == "status":  # the htmx poll while the job is active
        return render(request, "jobs/_job_status.html", context)
    gpus = {g.uuid: g for g in GPU.objects.filter(uuid__in=job.gpu_uuids)}
    context |= {
        "cards": [(uuid, gpus.get(uuid)) for uuid in job.gpu_uuids],
        "command_args": shlex.join(job.args),
        "env_extra": sorted(job.env.items()),
        "job_root": settings.JOB_FOLDERS,
        # Curves appear once a record comes (none for a script without Keras); the cards' use
        # is shown for any job that ran or may run.
        "show_charts": job.started_at is not None or job.is_active,
        "has_metrics": job.metrics.exists(),
    }
    return render(request, "jobs/job_detail.html", context)


@require_GET
@login_required
def job_log_tail(request: HttpRequest, pk: int) -> HttpResponse:
    """The log from ?offset= on; X-Log-Next-Offset says where to go on, X-Job-Status whether to."""
    job = get_job_for_user(request.user, pk)
    try:
        offset = parse_offset(request.GET.get("offset"))
    except Invalid as error:
        return HttpResponseBadRequest(error.message, content_type="text/plain; charset=utf-8")
    return log_response(job, offset=offset)


@require_GET
@login_required
def job_log_download(request: HttpRequest, pk: int) -> HttpResponse:
    return log_response(get_job_for_user(request.user, pk), attachment=True)


@require_GET
@login_required
def job_metrics_csv(request: HttpRequest, pk: int) -> HttpResponse:
    """The training curves as CSV; the page reads them live from GET /api/v1/jobs/{id}/metrics/."""
    return metrics_csv_response(get_job_for_user(request.user, pk))


@require_GET
@login_required
def job_usage_json(request: HttpRequest, pk: int) -> JsonResponse:
    """The job's cards' utilization and memory over its life, for the chart beside its curves."""
    job = get_job_for_user(request.user, pk)
    return JsonResponse(job_card_usage(job) | {"status": job.status}, headers={"Cache-Control": "no-store"})


def _array_unfinished(job: Job) -> int:
    """How many of the job's array's tasks have not finished and are not being cancelled."""
    if job.array_id is None:
        return 0
    tasks = Job.objects.filter(array_id=job.array_id, status__in=Job.ACTIVE, cancel_requested_at=None)
    return tasks.count()


@require_POST
@login_required
def job_cancel_view(request: HttpRequest, pk: int) -> HttpResponse:
    job = get_job_for_user(request.user, pk)
    whole_array = request.POST.get("whole_array") == "1" and job.array_id is not None
    if asked := _cancel_confirm(request, job, whole_array):
        return asked
    if whole_array:
        return _array_cancel(request, job)
    try:
        job = job_cancel(user=request.user, job=job, reason=request.POST.get("reason", ""))
    except Forbidden as error:
        raise PermissionDenied(error.message) from error
    except (Conflict, Invalid) as error:
        # A double click on Cancel: the first click's cancel stands, so the second is news, not a
        # failure: a running job's is being cancelled (Conflict), a waiting one's ended at once
        # (Invalid: already cancelled). Someone else's earlier cancel is still said as a refusal.
        job.refresh_from_db(fields=["cancelled_by", "cancel_requested_at"])
        own = job.cancel_requested_at is not None and job.cancelled_by_id == request.user.pk
        (messages.info if own else messages.error)(request, error.message)
    except ServiceError as error:
        messages.error(request, error.message)
    else:
        if job.status == Job.Status.CANCELLED:
            messages.success(request, f"Cancel requested: job {job.pk} ({job.name}) is cancelled.")
        else:
            messages.success(
                request,
                f"Cancel requested: job {job.pk} ({job.name}) gets SIGTERM now and SIGKILL after "
                f"{settings.JOB_KILL_GRACE_SECONDS} s if it is still running.",
            )
    return redirect("job_detail", pk=pk)


def _array_cancel(request: HttpRequest, job: Job) -> HttpResponse:
    """Every unfinished task of the job's array, cancelled as the API's whole_array does."""
    count = _array_unfinished(job)
    try:
        job_cancel(user=request.user, job=job, whole_array=True, reason=request.POST.get("reason", ""))
    except Forbidden as error:
        raise PermissionDenied(error.message) from error
    except ServiceError as error:
        messages.error(request, error.message)
    else:
        messages.success(
            request,
            f"Cancel requested for {count} task{'s' if count != 1 else ''} of job array {job.array_id}: "
            f"waiting ones never start, running ones get SIGTERM now and SIGKILL after "
            f"{settings.JOB_KILL_GRACE_SECONDS} s.",
        )
    return redirect("job_detail", pk=job.pk)


def _cancel_confirm(request: HttpRequest, job: Job, whole_array: bool = False) -> HttpResponse | None:
    """Someone else's job asks first: what stops, and the reason its owner will read, checked by
    the service's rule before anything stops (refused: asked again, the refusal beside the field,
    400, nothing written). None: go on (one's own job; confirmed with a reason; or nothing left to
    confirm, which the service then says)."""
    if job.owner_id == request.user.pk:
        return None
    if not whole_array and (job.is_finished or job.cancel_requested_at):
        return None
    if whole_array and not _array_unfinished(job):
        return None
    reason = request.POST.get("reason", "")
    if request.POST.get("confirm") != "1":  # from the job's page: asked, nothing refused yet
        form = JobCancelForm(initial={"reason": reason})
    else:
        form = JobCancelForm(request.POST)
        form.is_valid()
        form.errors.pop("reason", None)  # the rule below has its own words for the same checks
        try:
            job_cancel_reason_check(user=request.user, job=job, reason=reason)
        except Forbidden as error:
            raise PermissionDenied(error.message) from error
        except ServiceError as error:
            form.add_service_error(error)
        if not form.errors:
            return None
    context = {"job": job, "form": form, "grace": settings.JOB_KILL_GRACE_SECONDS}
    context |= {"whole_array": whole_array, "array_unfinished": _array_unfinished(job) if whole_array else 0}
    return render(request, "jobs/job_cancel_confirm.html", context, status=400 if form.errors else 200)


@require_POST
@login_required
def booking_take_back(request: HttpRequest, pk: int) -> HttpResponse:
    """*Take it back*: the queue's jobs on a lent booking leave it now (jobs/lending.py)."""
    booking = get_object_or_404(Reservation.objects.restrict(request.user), pk=pk)
    try:
        asked = loan_take_back(user=request.user, booking=booking)
    except Forbidden as error:
        raise PermissionDenied(error.message) from error
    if asked:
        messages.success(request, taken_back_words(asked))
    else:
        messages.info(request, "Nothing of the queue's runs on this booking now.")
    return redirect("reservation_detail", pk=pk)


@require_GET
@login_required
def queue(request: HttpRequest) -> HttpResponse:
    """The pending jobs in priority order, like squeue: factors, reason and estimated start."""
    rows = queue_rows(request.user, queue_plan(shared_usage=True, expected=True))
    page = Paginator(rows, 100).get_page(request.GET.get("page"))
    if request.GET.get("part") == "table":  # read again when jobs or bookings change (static/js/live.js)
        return render(request, "jobs/_queue_table.html", {"page": page})
    return render(request, "jobs/queue.html", {"page": page, "reasons": dict(Job.Reason.choices)})

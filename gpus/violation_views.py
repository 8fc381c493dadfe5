"""The Violations page: what the GPU watchdog found (jobs/host/watchdog.py writes the rows), and
what people do about one: stop it now, or mark it resolved (gpus/violations.py).

Admins see every violation; leaders those of their teams' people and bookings; everyone the
ones they caused and the ones on their own bookings (`Violation.objects.restrict`). A violation
the user may not see is a 404, its actions included."""

from __future__ import annotations

from datetime import datetime

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST

from gpus.filters import ViolationFilter
from gpus.forms import ViolationResolveForm, ViolationStopForm
from gpus.models import Violation
from gpus.selectors import violation_command
from gpus.violations import violation_resolve, violation_stop
from portal.errors import Forbidden, ServiceError
from portal.filters import filter_list

PAGE_SIZE = 50
NOBODY_TOLD = "Recorded: nobody to tell"


def action_label(violation: Violation) -> str:
    """The action as the list shows it: "Warned" only where a warning could reach someone.

    The watchdog's warning goes to the portal user behind the process, the owners of the booking
    it broke, and their teams' channels (jobs/watchdog/notify.py). A process of an OS user the
    portal does not know, outside any job, on a card nobody booked has none of them: its row
    says "warned" (the policy was applied), but nobody's bell rang, so the list says so."""
    nobody = violation.user_id is None and violation.job_id is None and violation.reservation_id is None
    if violation.action == Violation.Action.WARNED and nobody:
        return NOBODY_TOLD
    return violation.get_action_display()


def action_steps(violation: Violation) -> list[tuple[str, datetime | None]]:
    """What the watchdog did, each step once with its own time: "Warned" at the warning, then
    "stopped" or "could not stop" at the stop. `action_at` alone is no record of the warning:
    each later step moves it on (a row from before `warned_at` shows only its last step)."""
    label, action = action_label(violation), violation.action
    steps: list[tuple[str, datetime | None]] = []
    if violation.warned_at:
        steps.append((NOBODY_TOLD if label == NOBODY_TOLD else "Warned", violation.warned_at))
    if action == Violation.Action.STOPPED:
        steps.append(("Stopped", violation.stopped_at or violation.action_at))
    elif action == Violation.Action.STOP_FAILED:
        steps.append(("Could not stop", violation.action_at))
    elif not steps:
        steps.append((label, violation.action_at if action == Violation.Action.WARNED else None))
    return steps


def _visible(request: HttpRequest):  # type: ignore[no-untyped-def]
    return Violation.objects.restrict(request.user).select_related(
        "gpu__server", "user", "reservation__owner"
    )


@require_GET
@login_required
def violations(request: HttpRequest) -> HttpResponse:
    filter_form, rows = filter_list(request, ViolationFilter, _visible(request))
    page = Paginator(rows.order_by("-first_seen", "-id"), PAGE_SIZE).get_page(request.GET.get("page"))
    page.object_list = list(page.object_list)
    for violation in page.object_list:
        violation.action_label = action_label(violation)
    return render(request, "gpus/violations.html", {"filter_form": filter_form, "page": page})


@require_GET
@login_required
def violation_detail(request: HttpRequest, pk: int) -> HttpResponse:
    violation = get_object_or_404(_visible(request), pk=pk)  # 404 for what the user may not see
    return _detail(request, violation)


def _detail(
    request: HttpRequest,
    violation: Violation,
    stop_form: ViolationStopForm | None = None,
    resolve_form: ViolationResolveForm | None = None,
) -> HttpResponse:
    """The page; a refused action's form (bound, with its error) replaces the blank one."""
    violation.action_label = action_label(violation)
    context = {
        "v": violation,
        "command": violation_command(violation, request.user),
        "steps": action_steps(violation),
        "why_not_stop": violation.why_not_stoppable(),
        "stop_form": stop_form or ViolationStopForm(),
        "resolve_form": (resolve_form or ViolationResolveForm()) if _resolvable(request, violation) else None,
    }
    return render(request, "gpus/violation_detail.html", context)


def _resolvable(request: HttpRequest, violation: Violation) -> bool:
    """Whether the page shows "Mark resolved": not resolved already, and the user may."""
    return not violation.why_not_resolvable() and (
        Violation.objects.resolvable_by(request.user).filter(pk=violation.pk).exists()
    )


def _refused(
    request: HttpRequest, violation: Violation, form: ViolationStopForm | ViolationResolveForm
) -> None:
    """Why nothing was done: beside the field when the page shows the form again; said in full
    when it does not (resolved or stopped meanwhile: the page then has no such form)."""
    if isinstance(form, ViolationStopForm):
        shown = not violation.why_not_stoppable()
    else:
        shown = _resolvable(request, violation)
    if shown:
        messages.error(request, "Nothing was done: see the message beside the field.")
    else:
        said = " ".join(m for ms in form.errors.values() for m in ms)
        messages.error(request, f"Nothing was done: {said}")


def _act(request: HttpRequest, pk: int, form_class: type, service, done: str) -> HttpResponse:  # type: ignore[no-untyped-def]
    violation = get_object_or_404(_visible(request), pk=pk)
    form = form_class(request.POST)
    if form.is_valid():
        try:
            service(actor=request.user, violation=violation, **form.cleaned_data)
        except Forbidden as error:
            raise PermissionDenied(error.message) from None
        except ServiceError as error:
            form.add_service_error(error)
        else:
            messages.success(request, done)
            return redirect("violation_detail", pk=violation.pk)
    _refused(request, violation, form)
    kind = {"stop_form": form} if form_class is ViolationStopForm else {"resolve_form": form}
    return _detail(request, violation, **kind)


@require_POST
@login_required
def violation_stop_now(request: HttpRequest, pk: int) -> HttpResponse:
    done = (
        "Asked: the watchdog on its host stops it at its next round (a job through its own supervisor), "
        "and everyone concerned is told. It is in the audit log."
    )
    return _act(request, pk, ViolationStopForm, violation_stop, done)


@require_POST
@login_required
def violation_mark_resolved(request: HttpRequest, pk: int) -> HttpResponse:
    done = "Marked resolved; the people concerned are told, and it is in the audit log."
    return _act(request, pk, ViolationResolveForm, violation_resolve, done)

"""The Violations page: what the GPU watchdog found (jobs/host/watchdog.py writes the rows).

Admins see every violation; leaders those of their teams' people and bookings; everyone the
ones they caused and the ones on their own bookings (`Violation.objects.restrict`)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from gpus.filters import ViolationFilter
from gpus.models import Violation
from gpus.selectors import violation_command
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
    command = violation_command(violation, request.user)
    violation.action_label = action_label(violation)
    return render(request, "gpus/violation_detail.html", {"v": violation, "command": command})
